"""Training throughput: lockstep's Trainer.train_step vs transformers + torch AdamW, and MFU.

    python benchmarks/train_throughput.py --config cpu-tiny                      # CPU smoke check, < 1 min
    python benchmarks/train_throughput.py --config 1b                            # one H200: 8 x 2048, bf16
    python benchmarks/train_throughput.py --config 1b --compile-backend none inductor   # + compiled layers
    python benchmarks/train_throughput.py --config 1b --true-on-policy          # + its cost, as a ratio
    python benchmarks/train_throughput.py --config 1b --cuda-graphs             # + forward / backward graphed
    python benchmarks/train_throughput.py --config 1b --compile-backend inductor --cuda-graphs   # compiled, graphed
    python benchmarks/train_throughput.py --config 1b --cuda-graphs --fused-adamw    # + torch's fused AdamW passes
    python benchmarks/train_throughput.py --config 1b --cuda-graphs --index-kernel   # + the indexer's scores kernel
    python benchmarks/train_throughput.py --config 1b --kernel-rows none flash_attention triton_norm \
        triton_rope triton_combine fused_logprobs        # + rows with none / each of the trainer's kernels
    python benchmarks/train_throughput.py --config 1b --profile 30              # + where a step's time goes

What is timed (after --warmup untimed steps, CUDA synchronised around the --steps timed ones):
- lockstep: `Trainer.train_step` on --batch synthetic samples of --seq-len tokens (the first
  --prompt-len are the prompt), each with a random advantage: one packed micro-batch, forward,
  GRPO loss (PPO-clip, token mean, on-policy so the ratio is 1), backward, gradient clipping at
  1.0, AdamW on fp32 masters (bf16 compute), plus the step's metrics. `--compile-backend` sets
  TrainConfig.compile_backend (several values: one row each); `--kernel-rows` adds a row per set of
  TrainConfig kernel switches, exactly those on (flash_attention, triton_norm, triton_rope,
  triton_combine, fused_logprobs; '+' joins several; `none`: the eager ops; the default row has
  all five on), eager layers. `--cuda-graphs` adds a row per --compile-backend with
  TrainConfig.train_cuda_graphs: the forward and backward replayed from the CUDA graphs recorded in
  the first step (the batch is the same every step: one shape, recorded once, in the warm-up). A
  compiled row prints the graph breaks dynamo made in it (each break splits a layer's region, so
  fewer kernels fuse).
- transformers: `DeepseekV4ForCausalLM` (eager attention, the only one it has) with the same config,
  the same weights (lockstep's state dict loads into it as is) in the dtypes `from_pretrained(dtype=)`
  gives (bf16, its fp32-kept modules fp32), the same token batch as [batch, seq_len], loss = the
  same per-token objective: token mean over response tokens of -A * exp(logp - logp.detach())
  (the PPO ratio at 1, whose gradient is -A * grad logp), backward, clip_grad_norm_ 1.0, then
  torch.optim.AdamW on the bf16 parameters themselves (no fp32 masters: the usual transformers
  recipe, which also holds less optimiser memory than lockstep).

Figures, each side: tokens/s = batch * seq_len * steps / timed seconds; MFU = tokens/s x model
FLOPs per token / the peak measured in this run by a large GEMM (--gemm-size^3, default 8192 on
CUDA) in the benchmark dtype; peak memory, over a side's set-up and steps, =
torch.cuda.max_memory_allocated (reset before each side, after the previous side's model is freed)
on CUDA, the process RSS high-water (resource.getrusage: it only grows from one side to the next)
on the CPU. The first step's gradient norm of each side is printed too: same weights, batch and
objective, so they agree to rounding (a check that the two sides do the same work).

Model FLOPs per token (`lockstep.plan.compute.train_flops_per_token`, the planner's count):
3 x (1 forward + 2 backward) the forward FLOPs, which are 2 x active matmul parameters (every
dense projection, the shared expert, top-k of the routed experts, router, compressors, indexer,
mHC mixing, LM head; not the embedding lookup) + attention scores (QK^T and PV: 4 x heads x
head_dim per attended entry, over the mean sliding-window + compressed entries a causal position
attends to at --seq-len, plus the C4 indexer's scores). So "6 x active params + attention".
Recomputation is not counted (lockstep's default runs none).

On an H200: copy the repository, `pip install -e '.[test]'` (torch with CUDA, transformers 5.23),
then the second command above. Reference (DESIGN.md): transformers 33.6k tokens/s, 4.0% MFU,
49.7 GiB at 8 x 2048.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_throughput import bench_config, sync  # noqa: E402  (the 1b config of the other benchmarks)

from lockstep.models.deepseek_v4 import DeepseekV4ForCausalLM  # noqa: E402
from lockstep.models.deepseek_v4_config import CSA, HCA, DeepseekV4Config  # noqa: E402
from lockstep.models.deepseek_v4_init import init_deepseek_v4_, tiny_config  # noqa: E402
from lockstep.models.layers.kernel_switch import TRAINER_ONLY, trainer_kernels  # noqa: E402
from lockstep.models.precision import cast_model  # noqa: E402
from lockstep.plan.compute import train_flops_per_token  # noqa: E402
from lockstep.plan.hf_config import spec_from_config  # noqa: E402
from lockstep.sample import Sample  # noqa: E402
from lockstep.train.config import TrainConfig  # noqa: E402
from lockstep.train.trainer import Trainer  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# --kernel-rows values: exactly these of the trainer's kernel switches (TrainConfig fields) on: none,
# each alone, all (the default's)
KERNEL_ROWS = ("none",) + TRAINER_ONLY + ("+".join(TRAINER_ONLY),)
# per config: defaults of (batch, seq_len, prompt_len, steps, warmup, device, dtype)
DEFAULTS = {
    "cpu-tiny": dict(batch=4, seq_len=256, prompt_len=32, steps=3, warmup=1, device="cpu", dtype="float32"),
    "1b": dict(batch=8, seq_len=2048, prompt_len=128, steps=5, warmup=2, device="cuda", dtype="bfloat16"),
}


def model_config(name: str) -> DeepseekV4Config:
    if name == "1b":
        return bench_config("1b")
    # every layer kind at V4's own compress rates (4 and 128, which the FLOP count models), small
    # enough that 4 x 256 tokens train in seconds on a CPU core
    return tiny_config(vocab_size=512, hidden_size=64, moe_intermediate_size=64, num_attention_heads=4, head_dim=32,
                       q_lora_rank=32, n_routed_experts=8, o_lora_rank=16, index_head_dim=16, index_topk=16,
                       sliding_window=32, compress_rates={CSA: 4, HCA: 128})


def initial_weights(config: DeepseekV4Config, seed: int) -> dict[str, torch.Tensor]:
    """The weights every side starts from (CPU, fp32): the init draws on the CPU generator."""
    model = DeepseekV4ForCausalLM(config)
    init_deepseek_v4_(model, seed)
    return model.state_dict()


def make_batch(args, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [batch, seq_len], one advantage per sequence [batch]), seeded."""
    g = torch.Generator().manual_seed(args.seed + 1)
    return torch.randint(2, vocab, (args.batch, args.seq_len), generator=g), torch.randn(args.batch, generator=g)


def make_samples(ids: torch.Tensor, advantages: torch.Tensor, prompt_len: int) -> list[Sample]:
    # rollout logprobs only feed the mismatch metrics, which do not change the step's work
    return [Sample(prompt_ids=row[:prompt_len], response_ids=row[prompt_len:],
                   rollout_logprobs=torch.zeros(row.numel() - prompt_len), advantages=float(a), group_id=0)
            for row, a in zip(ids, advantages)]


def gemm_tflops(device: str, dtype: torch.dtype, n: int, reps: int = 5) -> float:
    """TFLOP/s of an n x n x n matmul (2 n^3 FLOPs), the MFU denominator: the fastest of batches of
    `reps` back-to-back matmuls, synchronised around each batch, over at least half a second."""
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    torch.matmul(a, b)
    best, start = float("inf"), time.perf_counter()
    while best == float("inf") or time.perf_counter() - start < 0.5:
        sync(device)
        t = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 * reps / best / 1e12


def reset_peak(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def timed(step, args) -> tuple[float, object]:
    """(seconds of args.steps calls of step() after args.warmup >= 1 untimed ones, the first call's result)."""
    first = step()
    for _ in range(args.warmup - 1):
        step()
    sync(args.device)
    t = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync(args.device)
    return time.perf_counter() - t, first


def lockstep_trainer(config, state: dict[str, torch.Tensor], args, backend: str | None,
                     true_on_policy: bool = False, kernels: tuple[str, ...] | None = None,
                     cuda_graphs: bool = False, triton_adamw: bool | None = None) -> Trainer:
    with torch.device(args.device):  # built where it runs: a 1b model's CPU init would take longer than the steps
        model = DeepseekV4ForCausalLM(config)
    model.load_state_dict(state)  # copies: the optimiser's in-place updates leave `state` as it was
    switches = {} if kernels is None else trainer_kernels(kernels)  # None: the defaults
    return Trainer(model, TrainConfig(dtype=args.dtype, compile_backend=backend, **switches, train_cuda_graphs=cuda_graphs,
                                      triton_adamw=triton_adamw, max_tokens_per_gpu=args.batch * args.seq_len,
                                      true_on_policy=true_on_policy))


def print_profile(step, args) -> None:
    """One more step under torch.profiler: the ops taking the most device time (CPU time on the
    CPU), by op and input shapes, so the next speed-up starts from where the time goes."""
    from torch.profiler import ProfilerActivity, profile

    cuda = args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        step()
        sync(args.device)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    ops = [e for e in prof.key_averages(group_by_input_shape=True) if e.key.startswith("aten::")]
    total = sum(getattr(e, key) for e in ops)
    print(f"profile of one step: {total / 1e3:.1f} ms of {'device' if cuda else 'CPU'} time in aten ops; "
          f"the {args.profile} largest (op, calls, ms, input shapes):")
    for e in sorted(ops, key=lambda e: -getattr(e, key))[:args.profile]:
        print(f"  {e.key:24s} {e.count:6d} {getattr(e, key) / 1e3:9.2f}  {str(e.input_shapes)[:110]}")
    # a step of many small kernels is bound by their launches, not by their device time
    by_op = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    calls = sorted(by_op, key=lambda e: -e.count)[:12]
    if cuda:  # every kernel, the Triton ones too (the aten table above does not hold them)
        kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.self_device_time_total for e in kernels) / 1e3
        print(f"{sum(e.count for e in kernels)} device kernels in the step, {busy:.1f} ms of kernel time; the "
              f"{args.profile} longest (kernel, launches, ms):")
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:args.profile]:
            print(f"  {e.key[:60]:60s} {e.count:6d} {e.self_device_time_total / 1e3:9.2f}")
        print(idle_gaps(prof))
    print("most called ops: " + ", ".join(f"{e.key[6:]} {e.count}" for e in calls))


def idle_gaps(prof, top: int = 12) -> str:
    """Where the device waited in the profiled step: its span, kernel time and idle time, and the
    `top` longest gaps between consecutive kernels (ms into the step, us, the kernels either side):
    a step whose span exceeds its kernel time waits on the host there."""
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    if len(kernels) < 2:
        return "idle: fewer than two kernels"
    t0 = kernels[0].time_range.start
    gaps = [(b.time_range.start - a.time_range.end, a, b) for a, b in zip(kernels, kernels[1:])]
    span = (kernels[-1].time_range.end - t0) / 1e3
    idle = sum(max(g, 0.0) for g, _, _ in gaps) / 1e3
    lines = [f"device timeline: span {span:.1f} ms, idle between kernels {idle:.1f} ms; the {top} longest gaps "
             f"(ms into the step, us, kernel before -> after):"]
    for g, a, b in sorted(gaps, key=lambda x: -x[0])[:top]:
        lines.append(f"  {(a.time_range.end - t0) / 1e3:8.2f} {g:9.1f}  {a.name[:45]} -> {b.name[:45]}")
    return "\n".join(lines)


def graph_breaks() -> str:
    """Dynamo's graph breaks since the counters were cleared: count, and each reason's count."""
    reasons = torch._dynamo.utils.counters["graph_break"]
    listed = "; ".join(f"{n} x {reason[:160]}" for reason, n in reasons.most_common(8))
    return f"graph breaks: {sum(reasons.values())}" + (f" ({listed})" if listed else "")


def run_lockstep(config, state: dict[str, torch.Tensor], samples: list[Sample], args, backend: str | None,
                 kernels: tuple[str, ...] | None = None, cuda_graphs: bool = False,
                 triton_adamw: bool | None = None) -> dict:
    reset_peak(args.device)
    torch._dynamo.utils.counters.clear()
    trainer = lockstep_trainer(config, state, args, backend, kernels=kernels, cuda_graphs=cuda_graphs,
                               triton_adamw=triton_adamw)
    seconds, first = timed(lambda: trainer.train_step(samples), args)
    if backend is not None:
        print(graph_breaks(), flush=True)
    if args.profile:
        print_profile(lambda: trainer.train_step(samples), args)
    out = {"seconds": seconds, "peak_bytes": peak_bytes(args.device), "grad_norm": first["train/grad_norm"]}
    torch._dynamo.reset()  # compiled layers' code holds the model: let it go with this frame
    return out


def run_true_on_policy_pair(config, state, samples: list[Sample], args) -> tuple[dict, dict, list[float]]:
    """The default trainer (eager) and the true-on-policy one, both resident, their steps
    interleaved (default, true-on-policy, default, ...) and each timed alone: the host's and the
    GPU's drift hits both alike (runs one after the other moved this ratio by 0.66-1.01x on one
    H200). Per side: seconds = the median step x args.steps; also each pair's ratio."""
    reset_peak(args.device)
    trainers = [lockstep_trainer(config, state, args, None, tod) for tod in (False, True)]
    firsts = [t.train_step(samples) for t in trainers]
    for _ in range(args.warmup - 1):
        for t in trainers:
            t.train_step(samples)
    times = [[], []]
    for _ in range(args.steps):
        for side, t in enumerate(trainers):
            sync(args.device)
            start = time.perf_counter()
            t.train_step(samples)
            sync(args.device)
            times[side].append(time.perf_counter() - start)
    runs = [{"seconds": statistics.median(ts) * args.steps, "peak_bytes": peak_bytes(args.device),
             "grad_norm": first["train/grad_norm"]} for ts, first in zip(times, firsts)]
    return runs[0], runs[1], [d / t for d, t in zip(*times)]


def hf_model(config: DeepseekV4Config, state: dict[str, torch.Tensor], args):
    from transformers import DeepseekV4Config as HFConfig
    from transformers import DeepseekV4ForCausalLM as HFModel

    hf_config = HFConfig(**config.to_hf_dict())
    hf_config._attn_implementation = "eager"
    with torch.device(args.device):
        model = HFModel(hf_config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("inv_freq" in k for k in missing), (missing, unexpected)
    return cast_model(model, DTYPES[args.dtype]).train()


def grpo_token_loss(logits: torch.Tensor, ids: torch.Tensor, advantages: torch.Tensor, prompt_len: int):
    """lockstep's on-policy PPO-clip loss, token mean over the response tokens (module docstring)."""
    logp = torch.log_softmax(logits[:, prompt_len - 1:-1].float(), dim=-1)
    logp = logp.gather(-1, ids[:, prompt_len:, None]).squeeze(-1)
    return -(advantages[:, None] * torch.exp(logp - logp.detach())).mean()


def run_transformers(config, state, ids, advantages, args) -> dict:
    reset_peak(args.device)
    model = hf_model(config, state, args)
    # lockstep's optimiser settings (TrainConfig defaults)
    c = TrainConfig()
    opt = torch.optim.AdamW(model.parameters(), lr=c.lr, betas=(c.adam_beta1, c.adam_beta2), eps=c.adam_eps,
                            weight_decay=c.weight_decay)
    ids, advantages = ids.to(args.device), advantages.to(args.device)

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, use_cache=False).logits
        grpo_token_loss(logits, ids, advantages, args.prompt_len).backward()
        del logits
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), c.clip_grad)
        opt.step()
        return norm

    seconds, first = timed(step, args)
    out = {"seconds": seconds, "peak_bytes": peak_bytes(args.device), "grad_norm": float(first)}
    return out


def figures(run: dict, args, flops_per_token: float, peak_tflops: float) -> dict:
    tok_s = args.batch * args.seq_len * args.steps / run["seconds"]
    return {"tokens_per_s": tok_s, "mfu": tok_s * flops_per_token / (peak_tflops * 1e12),
            "step_s": run["seconds"] / args.steps, "peak_gib": run["peak_bytes"] / 2**30,
            "first_grad_norm": run["grad_norm"]}


def line(label: str, f: dict, args, peak_tflops: float) -> str:
    mem = "peak mem" if args.device.startswith("cuda") else "RSS high-water"
    return (f"{label}: {f['tokens_per_s']:,.0f} tok/s, MFU {100 * f['mfu']:.2f}% of measured {args.dtype} GEMM peak "
            f"{peak_tflops:.3g} TFLOP/s, {mem} {f['peak_gib']:.2f} GiB ({f['step_s']:.3f} s/step)")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=list(DEFAULTS), default="cpu-tiny")
    for key in ("batch", "seq_len", "prompt_len", "steps", "warmup"):
        ap.add_argument("--" + key.replace("_", "-"), type=int, default=None, help="default: the config's")
    ap.add_argument("--device", default=None, help="default: cuda for 1b, cpu for cpu-tiny")
    ap.add_argument("--dtype", choices=list(DTYPES), default=None,
                    help="default: bfloat16 for 1b, float32 for cpu-tiny")
    ap.add_argument("--compile-backend", nargs="+", default=["none"],
                    help="TrainConfig.compile_backend of the lockstep side (none, inductor, ...); "
                         "several: one row each")
    ap.add_argument("--kernel-rows", nargs="+", default=[], choices=KERNEL_ROWS, metavar="SWITCHES",
                    help="one more row per value: exactly these TrainConfig kernel switches on ('+' joins "
                         f"several; none: the eager ops), eager layers ({', '.join(KERNEL_ROWS)})")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="one more row: TrainConfig.train_cuda_graphs (forward and backward replayed from CUDA graphs)")
    ap.add_argument("--index-kernel", action="store_true",
                    help="one more row: the C4 indexer's scores through the Triton kernel (KernelSwitches.triton_index, "
                         "set as LOCKSTEP_TRITON_INDEX=1 for the row; with the CUDA graphs where --cuda-graphs is given)")
    ap.add_argument("--fused-adamw", action="store_true",
                    help="one more row: TrainConfig.triton_adamw=False, torch's fused AdamW passes instead of the "
                         "one-pass Triton update (with the CUDA graphs where --cuda-graphs is given)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--true-on-policy", action="store_true",
                    help="TrainConfig.true_on_policy against the eager default, both resident, steps "
                         "interleaved: two more rows and their ratio")
    ap.add_argument("--gemm-size", type=int, default=None, help="peak-probe GEMM size (default 8192 CUDA, 1024 CPU)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the timed steps, profile one more lockstep step and print its N costliest ops")
    args = ap.parse_args(argv)
    for key, value in DEFAULTS[args.config].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be >= 1 (the first step compiles and allocates)")
    if not 1 <= args.prompt_len < args.seq_len:
        ap.error(f"--prompt-len must be in [1, --seq-len); got {args.prompt_len}, {args.seq_len}")
    args.gemm_size = args.gemm_size or (8192 if args.device.startswith("cuda") else 1024)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = model_config(args.config)
    flops_per_token = train_flops_per_token(spec_from_config(config.to_hf_dict(), name=args.config), args.seq_len)
    peak_tflops = gemm_tflops(args.device, DTYPES[args.dtype], args.gemm_size)
    state = initial_weights(config, args.seed)
    n_params = sum(v.numel() for k, v in state.items() if v.is_floating_point())
    print(f"config {args.config} ({n_params / 1e6:.1f}M params), {args.batch} x {args.seq_len} tokens (prompt "
          f"{args.prompt_len}), {args.device} {args.dtype}, {args.steps} timed steps after {args.warmup}; "
          f"{flops_per_token / 1e6:.1f} MFLOP/token trained; {args.gemm_size}^3 GEMM {peak_tflops:.3g} TFLOP/s")
    ids, advantages = make_batch(args, config.vocab_size)
    samples = make_samples(ids, advantages, args.prompt_len)
    result = {"config": args.config, "device": args.device, "dtype": args.dtype, "batch": args.batch,
              "seq_len": args.seq_len, "prompt_len": args.prompt_len, "steps": args.steps, "warmup": args.warmup,
              "params": n_params, "flops_per_token": flops_per_token, "gemm_size": args.gemm_size,
              "gemm_tflops": peak_tflops, "lockstep": {}}
    labels = {}  # result["lockstep"] key -> the row's name
    for backend in args.compile_backend:
        run = run_lockstep(config, state, samples, args, None if backend == "none" else backend)
        result["lockstep"][backend] = f = figures(run, args, flops_per_token, peak_tflops)
        labels[backend] = f"compile {backend}"
        print(line(f"lockstep train_step (compile {backend})", f, args, peak_tflops), flush=True)
    for backend in args.compile_backend if args.cuda_graphs else ():
        run = run_lockstep(config, state, samples, args, None if backend == "none" else backend, cuda_graphs=True)
        key = "cuda_graphs" if backend == "none" else f"cuda_graphs+{backend}"
        result["lockstep"][key] = f = figures(run, args, flops_per_token, peak_tflops)
        labels[key] = "cuda graphs" if backend == "none" else f"cuda graphs + compile {backend}"
        print(line(f"lockstep train_step ({labels[key]})", f, args, peak_tflops), flush=True)
    if args.index_kernel:
        # the switch is shared by engine and trainer, so it has no TrainConfig field (kernel_switch.py)
        with mock.patch.dict(os.environ, {"LOCKSTEP_TRITON_INDEX": "1"}):
            run = run_lockstep(config, state, samples, args, None, cuda_graphs=args.cuda_graphs)
        result["lockstep"]["index_kernel"] = f = figures(run, args, flops_per_token, peak_tflops)
        labels["index_kernel"] = ("cuda graphs + " if args.cuda_graphs else "") + "index kernel"
        print(line(f"lockstep train_step ({labels['index_kernel']})", f, args, peak_tflops), flush=True)
    if args.fused_adamw:
        run = run_lockstep(config, state, samples, args, None, cuda_graphs=args.cuda_graphs, triton_adamw=False)
        result["lockstep"]["fused_adamw"] = f = figures(run, args, flops_per_token, peak_tflops)
        labels["fused_adamw"] = ("cuda graphs + " if args.cuda_graphs else "") + "fused adamw"
        print(line(f"lockstep train_step ({labels['fused_adamw']})", f, args, peak_tflops), flush=True)
    for switches in args.kernel_rows:
        run = run_lockstep(config, state, samples, args, None,
                           kernels=() if switches == "none" else tuple(switches.split("+")))
        result["lockstep"][switches] = f = figures(run, args, flops_per_token, peak_tflops)
        labels[switches] = switches
        print(line(f"lockstep train_step ({switches})", f, args, peak_tflops), flush=True)
    if args.true_on_policy:
        default, exact, pair_ratios = run_true_on_policy_pair(config, state, samples, args)
        result["lockstep"]["true_on_policy_pair_default"] = d = figures(default, args, flops_per_token, peak_tflops)
        result["lockstep"]["true_on_policy"] = f = figures(exact, args, flops_per_token, peak_tflops)
        print("interleaved steps, median of each side; peak memory with both trainers resident:")
        print(line("lockstep train_step (compile none)", d, args, peak_tflops))
        print(line("lockstep train_step (true on policy)", f, args, peak_tflops), flush=True)
        result["ratio_true_on_policy"] = ratio = f["tokens_per_s"] / d["tokens_per_s"]
        print(f"ratio true on policy / compile none: {ratio:.2f}x tok/s (per pair of steps "
              f"{min(pair_ratios):.2f}-{max(pair_ratios):.2f}x)")
    if not args.skip_transformers:
        run = run_transformers(config, state, ids, advantages, args)
        result["transformers"] = hf = figures(run, args, flops_per_token, peak_tflops)
        print(line("transformers fwd+bwd+AdamW", hf, args, peak_tflops))
        result["ratio_lockstep_over_transformers"] = {}
        for backend, f in result["lockstep"].items():
            ratio = f["tokens_per_s"] / hf["tokens_per_s"]
            result["ratio_lockstep_over_transformers"][backend] = ratio
            # same weights, batch and objective: the first step's gradient norms agree to rounding
            print(f"ratio lockstep ({labels.get(backend, backend)}) / transformers: {ratio:.2f}x tok/s, "
                  f"{f['peak_gib'] / hf['peak_gib']:.2f}x peak memory; first-step gradient norm "
                  f"{f['first_grad_norm']:.5g} vs {hf['first_grad_norm']:.5g}")
    print("JSON " + json.dumps(result))


if __name__ == "__main__":
    main()
