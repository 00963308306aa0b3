"""grpo_step.py's GRPO step with the trainer and the engine in two processes (`--disaggregated`).

The same work as grpo_step.py's in-process run (model, prompts, reward, advantages, TrainConfig,
EngineConfig), but rank 0 holds only the Trainer and rank 1 only the Engine, in one
torch.distributed world made by lockstep's own `init_distributed` with a disaggregated layout
(1 trainer rank + 1 engine rank). Per step:

    rank 1: Engine.generate -> reward -> advantages -> samples broadcast to rank 0 (gloo control group)
    rank 0: Trainer.train_step(samples)
    both:   lockstep.dist.weight_push.push_weights (manifest header, bucketed broadcast on the weight
            group, two-phase commit; the engine re-quantises and serves version step + 1)

Devices: two GPUs -> rank r on cuda:r, NCCL for the weight group; one GPU -> both processes on
cuda:0 and every group on gloo (CUDA tensors over gloo: no NCCL between two processes of one GPU);
CPU -> gloo. With seeded sampling (grpo_step.py seeds every request when `--disaggregated` is
given) the two runs sample the same tokens as long as their weights are equal, so rewards and the
train/rollout gap per step can be compared with the in-process run's.

Each process reports its peak `torch.cuda.max_memory_allocated`: rank 0 is a pure trainer GPU and
rank 1 a pure engine GPU, the two sides `lockstep plan` predicts separately (actor, rollout).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue as queue_mod
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def placement(bench) -> tuple[list[int], str | None]:
    """(local device index per rank, backend override): see the module docstring."""
    if not bench.device.startswith("cuda"):
        return [0, 0], "gloo"
    if torch.cuda.device_count() >= 2:
        return [0, 1], None
    return [0, 0], "gloo"


class _PhasePeaks:
    """Peak allocated bytes per phase of a step (max over steps) and what stays allocated between steps,
    so a plan term can be set against the phase it describes."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.setup = torch.cuda.memory_allocated(device) if self.cuda else 0
        self.setup_peak = torch.cuda.max_memory_allocated(device) if self.cuda else 0
        self.peaks: dict[str, int] = {}
        self.resident = 0

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        yield
        if self.cuda:
            self.peaks[name] = max(self.peaks.get(name, 0), torch.cuda.max_memory_allocated(self.device))
            self.resident = torch.cuda.memory_allocated(self.device)

    @property
    def overall(self) -> int | None:
        return max(self.peaks.values()) if self.peaks else None

    def report(self) -> str:
        if not self.cuda:
            return ""
        parts = [f"after set-up {self.setup / 1e9:.2f} (peak {self.setup_peak / 1e9:.2f})",
                 f"between steps {self.resident / 1e9:.2f}"]
        return ", ".join(parts + [f"peak in {k} {v / 1e9:.2f}" for k, v in self.peaks.items()]) + " GB"


def _role(rank: int, bench, prompts, port: int, local_ranks, backend, timeout_s: float, bucket_bytes: int,
          out) -> None:
    from grpo_step import _batch, _engine, _record, _rollout, _train_config, make_model

    from lockstep.dist.groups import Layout, destroy_distributed, init_distributed
    from lockstep.dist.manifest import build_manifest
    from lockstep.dist.weight_push import push_weights
    from lockstep.train.trainer import Trainer

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(local_ranks[rank]),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = init_distributed(timeout_s, layout=Layout.disaggregated(1, 1), backend=backend)
    try:
        bench = dataclasses.replace(bench, device=str(ctx.device))
        cfg = _train_config(bench)
        model = make_model(bench).to(ctx.device)
        trainer = Trainer(model, cfg) if ctx.is_trainer else None
        engine = _engine(bench, model) if ctx.is_engine else None
        manifest = build_manifest(trainer.model if trainer else engine.model, getattr(torch, cfg.dtype), bucket_bytes)
        mem = _PhasePeaks(ctx.device)
        rows = []
        for step in range(bench.warmup + bench.steps):
            t0 = time.perf_counter()
            with mem.phase("rollout"):
                box = [_rollout(engine, bench, _batch(bench, prompts, step), step, True, cfg.advantage_fn)
                       if engine else None]
            with ctx.collective(f"step {step}: broadcast_object_list of the rollout's samples"):
                dist.broadcast_object_list(box, src=ctx.layout.engine_ranks[0], group=ctx.control_group)
            samples = box[0]
            t1 = time.perf_counter()
            with mem.phase("train step"):
                row = _record(trainer.train_step(samples), samples) if trainer else {}
                if trainer and ctx.device.type == "cuda":
                    torch.cuda.synchronize(ctx.device)
            t2 = time.perf_counter()
            with mem.phase("weight push"):
                pushed = push_weights(ctx, manifest, step + 1 if trainer else None,
                                      named_tensors=trainer.named_weights() if trainer else None, engine=engine)
            t3 = time.perf_counter()
            rows.append({**row, "rollout": t1 - t0, "train": t2 - t1, "push": t3 - t2, "step": t3 - t0,
                         "push_bytes": pushed["perf/weight_sync_bytes"], "tokens": sum(s.response_len for s in samples)})
        peak = torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda" else None
        out.put((rank, {"rows": rows, "peak_bytes": mem.overall or peak, "memory": mem.report(),
                        "device": str(ctx.device)}))
    except BaseException as e:
        out.put((rank, {"error": f"{type(e).__name__}: {e}"}))
        raise
    finally:
        destroy_distributed()


def run_disaggregated(bench, prompts, timeout_s: float = 600.0, bucket_bytes: int = 512 << 20) -> dict:
    """Run the steps on a trainer process and an engine process; -> per-step rows (rank 0's timings,
    rank 0's train metrics, rank 1's push view) and each role's peak memory."""
    local_ranks, backend = placement(bench)
    mpc = mp.get_context("spawn")
    out = mpc.Queue()
    port = _free_port()
    procs = [mpc.Process(target=_role, args=(r, bench, prompts, port, local_ranks, backend, timeout_s, bucket_bytes,
                                             out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + timeout_s * (bench.warmup + bench.steps + 2)
    try:
        while len(results) < 2:
            try:
                rank, res = out.get(timeout=max(deadline - time.monotonic(), 1))
            except queue_mod.Empty:
                raise TimeoutError(f"disaggregated run: no result from rank(s) {sorted({0, 1} - set(results))}")
            if "error" in res:
                raise RuntimeError(f"disaggregated run: rank {rank} ({'trainer' if rank == 0 else 'engine'}) "
                                   f"failed: {res['error']}")
            results[rank] = res
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    trainer, engine = results[0], results[1]
    rows = [{**t, "engine_push": e["push"]} for t, e in zip(trainer["rows"], engine["rows"])]
    return {"rows": rows, "trainer_peak": trainer["peak_bytes"], "engine_peak": engine["peak_bytes"],
            "trainer_memory": trainer["memory"], "engine_memory": engine["memory"],
            "devices": (trainer["device"], engine["device"]), "backend": backend or "nccl (weights) + gloo (control)"}


def compare(inproc: dict, disagg: dict, warmup: int) -> list[str]:
    """Lines comparing the two runs step by step (reward and abs diff; equal means bitwise)."""
    lines = ["step | reward in-process / disaggregated | abs diff in-process / disaggregated | push s | push MB"]
    for i, (a, b) in enumerate(zip(inproc["steps"], disagg["rows"])):
        lines.append(f"{i:4d} | {a['reward']:.6f} / {b['reward']:.6f} | {a['abs_diff']:.6f} / {b['abs_diff']:.6f} "
                     f"| {b['push']:.3f} | {b['push_bytes'] / 1e6:.1f}")
    same_r = sum(a["reward"] == b["reward"] for a, b in zip(inproc["steps"], disagg["rows"]))
    same_d = sum(a["abs_diff"] == b["abs_diff"] for a, b in zip(inproc["steps"], disagg["rows"]))
    worst = max(abs(a["abs_diff"] - b["abs_diff"]) for a, b in zip(inproc["steps"], disagg["rows"]))
    timed = disagg["rows"][warmup:] or disagg["rows"]
    lines.append(f"equal rewards {same_r}/{len(disagg['rows'])} steps, equal abs diff {same_d}/{len(disagg['rows'])} "
                 f"(max |delta| {worst:.3g}); disaggregated median step {statistics.median(r['step'] for r in timed):.3f} s "
                 f"(rollout {statistics.median(r['rollout'] for r in timed):.3f}, train "
                 f"{statistics.median(r['train'] for r in timed):.3f}, push {statistics.median(r['push'] for r in timed):.3f} "
                 f"for {timed[-1]['push_bytes'] / 1e6:.1f} MB)")
    return lines


def plan_command(bench, config_json: Path, gpu_memory_gb: float) -> list[str]:
    """`lockstep plan` for this run's layout: 1 actor node + 1 rollout node of one GPU, TP = PP = EP = 1,
    the step's tokens in one micro-batch, and lockstep's trainer state (bf16 weights and gradients, fp32
    master + Adam moments: 12 B per parameter), a bf16 engine with every completion in flight."""
    from grpo_step import _train_config

    completions = bench.num_prompts * bench.n
    return [sys.executable, "-m", "lockstep.cli", "plan", "--model", str(config_json), "--nodes", "2",
            "--gpus-per-node", "1", "--gpu-memory-gb", f"{gpu_memory_gb:g}", "--actor-nodes", "1",
            "--rollout-nodes", "1", "--seq-len", str(bench.prompt_len + bench.max_new_tokens),
            "--max-tokens-per-gpu", str(_train_config(bench).max_tokens_per_gpu),
            "--rollout-batch-size", str(bench.num_prompts), "--n-samples-per-prompt", str(bench.n),
            "--param-dtype", "bf16" if bench.dtype == "bfloat16" else "fp32",
            "--grad-dtype", "bf16" if bench.dtype == "bfloat16" else "fp32",
            "--rollout-concurrency", str(completions), "--rollout-gpus-per-engine", "1",
            "--rollout-weight-format", "bf16", "--rollout-chunk-tokens", str(max(2048, bench.num_prompts * bench.prompt_len)),
            "--tp", "1", "--pp", "1", "--ep", "1", "--cp", "1", "--json"]


def planned_vs_measured(bench, disagg: dict) -> list[str]:
    """The plan's actor and rollout GB per GPU against each process's measured peak (error in %)."""
    if disagg["trainer_peak"] is None:
        return ["memory: CPU run, no device peak to compare with the plan"]
    gpu_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "config.json"
        cfg.write_text(json.dumps({**bench.model.to_hf_dict(), "model_type": "deepseek_v4"}))
        proc = subprocess.run(plan_command(bench, cfg, gpu_gb), capture_output=True, text=True, check=True)
    plan = json.loads(proc.stdout)[0]
    lines = []
    for role, key in (("trainer (actor)", "trainer"), ("engine (rollout)", "engine")):
        term = "actor" if key == "trainer" else "rollout"
        want, got = plan[f"{term}_gb_per_gpu"], disagg[f"{key}_peak"] / 1e9
        lines.append(f"memory {role}: planned {want:.2f} GB, measured peak {got:.2f} GB "
                     f"(max_memory_allocated), plan error {100 * (want - got) / got:+.1f}%; measured: "
                     f"{disagg[f'{key}_memory']}; plan terms "
                     + ", ".join(f"{k} {v:.2f}" for k, v in plan[f"{term}_terms_gb"].items()))
    return lines
