"""GRPO step time and tokens/s of `lockstep train` on 1, 2, ... N GPUs (data parallel), as ratios to 1.

Weak scaling: the work per GPU is fixed (each engine replica samples `--prompts-per-gpu` prompts x
`--n` completions per rollout, each trainer rank trains that block), so the rollout batch grows
with the GPU count: N GPUs do N times the work of one in each GRPO step. Data parallelism exists to
grow the batch (one rollout is the unit, each replica serves its block); at a fixed batch (strong
scaling) each GPU's decode batch would shrink, and decode at batch 32-64 costs about what it costs
at 64 (memory-bound), so strong scaling would mostly measure the fixed costs. Perfect weak scaling
is an N-fold throughput at the same step time; the issue's target is >= 1.8x at 2 GPUs.

Each GPU count is a real `lockstep train` run through lockstep's multi-process path: N > 1 is
`lockstep train --nproc-per-node N` (torch.distributed.run; colocated: each rank an engine replica
and an FSDP2 trainer shard, samples gathered as pickled objects over the gloo control group, each
engine taking its trainer's full weights after every step). N = 1 is what `lockstep train` runs on
one GPU (`--nproc-per-node 1` runs the single-process path, no launcher, no FSDP); `--baseline
launched` makes it a 1-process launched world instead (FSDP over one rank, the same gathers).

The model is random-init, built here from a config and written to a temporary directory with the
existing save code (`save_pretrained`, the embedded model's character tokenizer copied in):
    gpu-848m  grpo_step.py's gpu-848m config (8 layers, hidden 1024, 64 experts top-6) with the
              tokenizer's 103-token vocabulary; bf16 on CUDA; per GPU 8 prompts x 8 completions of
              up to 128 tokens (as grpo_step.py --config gpu-848m on one GPU)
    cpu-tiny  grpo_step.py's cpu-tiny config (vocab 103); fp32 gloo processes on the CPU, a smoke
              check of the path only (2 prompts x 4 completions of 8 tokens per process)
Prompts: the embedded arithmetic task's train split, written as a jsonl (so no eval runs).

Step time = perf/rollout_time + perf/train_time + perf/weight_sync_time of a metrics.jsonl line
(rank 0's view; the rollout time includes the sample gather), median over the rollouts after
`--warmup`; tokens = response tokens sampled in the rollout (all ranks). tokens/s = tokens / step
time; "rollout-only tok/s" is perf/tokens_per_s (tokens / rollout time, gather included).
Start-up (launch, model load, FSDP wrap, engine set-up) is the run's wall time less its steps,
reported apart.

    python benchmarks/scaling.py --config cpu-tiny                    # CPU smoke: 1 vs 2 gloo processes
    python benchmarks/scaling.py --config gpu-848m                    # 1 .. torch.cuda.device_count() GPUs
    python benchmarks/scaling.py --config gpu-848m --gpus 2,8 --rollouts 20 \
        --plan "--pp 4 --ep 2 --recompute --optimizer-offload"        # issue 19: the planned layouts

With `--plan ARGS`, each count N > 1 first runs `lockstep plan --colocate --model MODEL --nodes 1
--gpus-per-node N ... --json ARGS` for this benchmark's batch (ARGS fix the layout, e.g. "--pp 2" for the
2-GPU run and "--pp 4 --ep 2" for 8: `N=ARGS;M=ARGS` gives each count its own), and `lockstep train
--layout` runs the layout the plan picks; the run is then set against the plan per pipeline stage and
phase (lockstep/plan/measured.py: planned GB, the stage's largest measured peak, the error in %).

Measured on 2 H200s (README, "Running on N processes / GPUs"): 1.62x the 1-GPU tokens/s at 2 GPUs.

Nothing is compiled by default here (`--no-compile-decode --no-compile-prefill --no-compile-hc`; the
decode step is still replayed as a CUDA graph): compiling the engine's layers takes 3-4 min per
process on a fresh machine, more than the whole benchmark; `--compile` keeps lockstep's defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

CONFIGS = {
    "cpu-tiny": dict(device="cpu", dtype="float32", prompts_per_gpu=2, n=4, max_response_len=8, rollouts=3, warmup=1),
    "gpu-848m": dict(device="cuda", dtype="bfloat16", prompts_per_gpu=8, n=8, max_response_len=128, rollouts=5,
                     warmup=2),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_model(config_name: str, device: str, dtype: str, path: Path) -> int:
    """A random-init model of grpo_step.py's config with the embedded tokenizer's vocabulary, saved to
    `path`; returns its parameter count."""
    from grpo_step import _configs

    from lockstep.models.checkpoint import save_pretrained
    from lockstep.models.deepseek_v4 import DeepseekV4ForCausalLM
    from lockstep.models.deepseek_v4_init import init_deepseek_v4_
    from lockstep.rl.embedded import ASSET_DIR

    tok = json.loads((ASSET_DIR / "config.json").read_text())
    cfg = dataclasses.replace(_configs()[config_name].model, vocab_size=tok["vocab_size"],
                              eos_token_id=tok["eos_token_id"], bos_token_id=tok["bos_token_id"],
                              pad_token_id=tok["pad_token_id"])
    with torch.device(device):
        model = DeepseekV4ForCausalLM(cfg)
    init_deepseek_v4_(model, seed=0)
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    save_pretrained(model, path, tokenizer_dir=ASSET_DIR)
    n = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return n


def write_prompts(path: Path) -> None:
    from lockstep.rl.embedded import embedded_prompts

    with path.open("w") as f:
        for p in embedded_prompts("train"):
            f.write(json.dumps({"prompt": p.prompt, "label": p.label}) + "\n")


def plan_args_for(spec: str, n_gpus: int) -> list[str] | None:
    """--plan's arguments for a count: "ARGS" for every count, or "N=ARGS;M=ARGS" per count (None: no plan)."""
    if "=" not in spec.split(";")[0].split()[0]:
        return spec.split()
    per_count = dict(part.split("=", 1) for part in spec.split(";") if part.strip())
    args = per_count.get(str(n_gpus))
    return args.split() if args is not None else None


def plan_layout(args, n_gpus: int, model_dir: Path, work: Path) -> tuple[Path, dict] | None:
    """`lockstep plan --colocate` for this run's batch on N GPUs of one node -> (its JSON file, the layout
    `lockstep train --layout` will run); None where --plan gives this count nothing."""
    from lockstep.plan.train_flags import chosen_layout

    extra = plan_args_for(args.plan, n_gpus)
    if extra is None or n_gpus == 1:
        return None
    memory_gb = torch.cuda.get_device_properties(0).total_memory / 1e9 if args.device == "cuda" else 24.0
    cmd = [sys.executable, "-m", "lockstep.cli", "plan", "--model", str(model_dir), "--colocate", "--nodes", "1",
           "--gpus-per-node", str(n_gpus), "--gpu-memory-gb", f"{memory_gb:.1f}", "--rollout-gpus-per-engine", "1",
           "--seq-len", str(args.max_response_len + 128), "--max-tokens-per-gpu", str(tokens_per_gpu(args)),
           "--rollout-batch-size", str(args.prompts_per_gpu * n_gpus), "--n-samples-per-prompt", str(args.n),
           "--json", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"lockstep plan for {n_gpus} GPUs failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    path = work / f"plan-{n_gpus}.json"
    path.write_text(proc.stdout)
    index, entry, passed = chosen_layout(path)
    label = " ".join(f"{d.upper()}{entry[d]}" for d in ("tp", "pp", "ep", "cp"))
    print(f"[{n_gpus} GPUs] lockstep plan {' '.join(extra)}: layout #{index} {label}, stage layers "
          f"{entry['stage_layers']}, actor {entry['actor_gb_per_gpu']} + engine {entry['rollout_gb_per_gpu']} GB per GPU; "
          f"flags {' '.join(entry['train_flags'])}", flush=True)
    for note in passed:
        print(f"  passed over: {note}", flush=True)
    return path, entry


def tokens_per_gpu(args) -> int:
    """One micro-batch per rank and step: each rank packs its whole block."""
    return args.prompts_per_gpu * args.n * (args.max_response_len + 128)


def train_command(args, n_gpus: int, model_dir: Path, prompts: Path, run_dir: Path,
                  layout: Path | None = None) -> list[str]:
    per_gpu = args.prompts_per_gpu * args.n
    cmd = ["-m", "lockstep.cli", "train", "--model", str(model_dir), "--prompt-data", str(prompts),
           "--num-rollout", str(args.rollouts), "--rollout-batch-size", str(args.prompts_per_gpu * n_gpus),
           "--n-samples-per-prompt", str(args.n), "--rollout-max-response-len", str(args.max_response_len),
           "--max-model-len", str(args.max_response_len + 128), "--max-num-seqs", str(per_gpu),
           "--max-tokens-per-gpu", str(tokens_per_gpu(args)),
           "--device", args.device, "--dtype", args.dtype, "--no-plot", "--run-dir", str(run_dir),
           *[f"--{'' if args.compile else 'no-'}compile-{k}" for k in ("decode", "prefill", "hc")], *args.extra]
    if layout is not None:
        cmd += ["--layout", str(layout)]
    if n_gpus > 1:
        return [sys.executable, *cmd, "--nproc-per-node", str(n_gpus), "--master-port", str(free_port())]
    if args.baseline == "launched":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port",
                str(free_port()), *cmd]
    return [sys.executable, *cmd]


def run_one(args, n_gpus: int, model_dir: Path, prompts: Path, work: Path, deadline: float) -> dict:
    run_dir = work / f"run-{n_gpus}"
    planned = plan_layout(args, n_gpus, model_dir, work) if args.plan else None
    cmd = train_command(args, n_gpus, model_dir, prompts, run_dir, planned[0] if planned else None)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"\n[{n_gpus} GPU{'s' if n_gpus > 1 else ''}] {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(deadline - time.time(), 1))
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-3000:]
        print(f"  timed out after {time.perf_counter() - t0:.0f}s (--time-limit); stderr tail:\n"
              f"{tail.decode(errors='replace') if isinstance(tail, bytes) else tail}", flush=True)
        return {}
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        print(f"  failed (exit {proc.returncode}) after {wall:.0f}s:\n{proc.stderr[-4000:]}", flush=True)
        return {}
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "train/step" in line]
    want = args.prompts_per_gpu * n_gpus * args.n
    got = {int(s["rollout/num_samples"]) for s in steps}
    assert got == {want}, f"{n_gpus} GPUs: rollouts of {got} samples, expected {want}"
    rows = []
    for s in steps:
        parts = {k: s.get(f"perf/{k}_time", 0.0) for k in ("rollout", "train", "weight_sync")}
        step = sum(parts.values())
        tokens = s["rollout/response_len"] * s["rollout/num_samples"]
        rows.append({**parts, "step": step, "tokens": tokens, "tok_s": tokens / step})
    timed = rows[args.warmup:] or rows[-1:]
    med = {k: statistics.median(r[k] for r in timed) for k in timed[0]}
    med.update(n_gpus=n_gpus, wall=wall, startup=wall - sum(r["step"] for r in rows), timed_steps=len(timed),
               rollout_tok_s=statistics.median(s["perf/tokens_per_s"] for s in steps[args.warmup:] or steps[-1:]),
               reward=statistics.mean(s["rollout/raw_reward"] for s in steps),
               abs_diff=statistics.mean(s.get("train/train_rollout_logprob_abs_diff", float("nan")) for s in steps))
    print(f"  done in {wall:.0f}s: step {med['step']:.3f}s (rollout {med['rollout']:.3f}, train {med['train']:.3f}, "
          f"weight sync {med['weight_sync']:.3f}), {med['tok_s']:,.0f} tok/s, reward {med['reward']:.3f}, "
          f"train/rollout logprob abs diff {med['abs_diff']:.4g}", flush=True)
    if planned:
        from lockstep.plan.measured import compare, report

        for line in report(compare(planned[1], lines)):
            print(f"  {line}", flush=True)
    return med


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", choices=list(CONFIGS), default=None,
                        help="default: gpu-848m when CUDA is available, else cpu-tiny")
    parser.add_argument("--gpus", default=None,
                        help="comma-separated GPU (process) counts; default 1..torch.cuda.device_count() (CPU: 1,2)")
    for k in ("prompts_per_gpu", "n", "max_response_len", "rollouts", "warmup"):
        parser.add_argument("--" + k.replace("_", "-"), type=int, default=None, help="override the config's value")
    parser.add_argument("--compile", action="store_true",
                        help="compile the engine's decode and prefill and mHC's coefficients (lockstep's CUDA "
                             "defaults; 3-4 min start-up per process on a fresh machine)")
    parser.add_argument("--baseline", choices=["plain", "launched"], default="plain",
                        help="1 GPU as `lockstep train` runs it (plain) or as a 1-process launched world")
    parser.add_argument("--time-limit", type=float, default=330.0, help="seconds for the whole benchmark")
    parser.add_argument("--plan", default=None, metavar="ARGS",
                        help='run each count N > 1 in the layout `lockstep plan --colocate ... ARGS` picks, e.g. '
                             '"--pp 4 --ep 2 --recompute", or per count "2=--pp 2;8=--pp 4 --ep 2" (module docstring)')
    parser.add_argument("--model", default=None, metavar="DIR",
                        help="a model directory (config.json, safetensors, tokenizer) instead of the config's "
                             "random-init model, e.g. lockstep/assets/tiny-dsv4, whose shape `lockstep plan` takes")
    parser.add_argument("--work-dir", default=None, help="keep the model and runs here (default: a temp dir)")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more `lockstep train` flags")
    args = parser.parse_args()
    deadline = time.time() + args.time_limit
    args.extra = [a for a in args.extra if a != "--"]
    config = args.config or ("gpu-848m" if torch.cuda.is_available() else "cpu-tiny")
    for k, v in CONFIGS[config].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.gpus:
        counts = [int(x) for x in args.gpus.split(",")]
    elif args.device == "cuda":
        counts = list(range(1, torch.cuda.device_count() + 1))
    else:
        counts = [1, 2]
    if args.device == "cuda" and (not torch.cuda.is_available() or max(counts) > torch.cuda.device_count()):
        parser.error(f"{config} needs {max(counts)} CUDA devices, found "
                     f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="lockstep-scaling-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model_dir = Path(args.model) if args.model else work / "model"
    if args.model:
        from lockstep.models import load_pretrained

        n_params = sum(p.numel() for p in load_pretrained(model_dir).parameters())
    else:
        n_params = write_model(config, args.device, args.dtype, model_dir)
    write_prompts(work / "prompts.jsonl")
    compiled = "compiled" if args.compile else ("eager, CUDA graphs kept (--no-compile-decode --no-compile-prefill "
                                                "--no-compile-hc: compiling costs 3-4 min per process)")
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (gloo)"
    print(f"config {config}: {n_params / 1e6:.1f}M params, {args.device} {args.dtype}, {gpu}; weak scaling: "
          f"{args.prompts_per_gpu} prompts x {args.n} completions (<= {args.max_response_len} tokens) per GPU "
          f"per rollout, {args.rollouts} rollouts, median of the last {args.rollouts - args.warmup}; decode "
          f"{compiled}; "
          f"1-GPU baseline: {args.baseline}; model written in {time.perf_counter() - t0:.0f}s to {work}", flush=True)
    results = [r for n in counts if (r := run_one(args, n, model_dir, work / "prompts.jsonl", work, deadline))]
    if not results:
        sys.exit("no run finished")
    base = next((r for r in results if r["n_gpus"] == 1), None)
    unit = "GPUs" if args.device == "cuda" else "procs"
    print(f"\n{unit:>5} | step s | rollout s | train s | sync s | tokens/step | tok/s total | tok/s per {unit[:-1]} "
          f"| x vs 1 | efficiency | rollout-only tok/s (x vs 1) | start-up s")
    for r in results:
        ratio = r["tok_s"] / base["tok_s"] if base else float("nan")
        rollout_ratio = r["rollout_tok_s"] / base["rollout_tok_s"] if base else float("nan")
        print(f"{r['n_gpus']:>5} | {r['step']:6.3f} | {r['rollout']:9.3f} | {r['train']:7.3f} | {r['weight_sync']:6.3f} "
              f"| {r['tokens']:11,.0f} | {r['tok_s']:11,.0f} | {r['tok_s'] / r['n_gpus']:12,.0f} | {ratio:6.2f} "
              f"| {ratio / r['n_gpus']:10.0%} | {r['rollout_tok_s']:18,.0f} ({rollout_ratio:.2f}) | {r['startup']:10.1f}")
    if base:
        for r in results:
            if r["n_gpus"] == 1:
                continue
            growth = {k: r[k] - base[k] for k in ("rollout", "train", "weight_sync")}
            worst = max(growth, key=growth.get)
            print(f"{r['n_gpus']} {unit} vs 1: step {r['step'] - base['step']:+.3f}s (rollout {growth['rollout']:+.3f}, "
                  f"train {growth['train']:+.3f}, weight sync {growth['weight_sync']:+.3f}); the largest growth is in "
                  f"{worst} (rollout includes the pickled sample gather on the gloo control group; train the FSDP "
                  f"all-gathers / reduce-scatters; weight sync each engine taking its trainer's gathered weights)")
    two = next((r for r in results if r["n_gpus"] == 2), None)
    for r in results:
        if two and r["n_gpus"] > 2:  # issue 19's figure: the layout's tokens/s per GPU against the 2-GPU run's
            print(f"{r['n_gpus']} {unit} vs 2: tok/s per {unit[:-1]} {r['tok_s'] / r['n_gpus']:,.0f} vs "
                  f"{two['tok_s'] / 2:,.0f}, ratio {r['tok_s'] / r['n_gpus'] / (two['tok_s'] / 2):.2f}")
    print(f"total {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
