"""Where a data-parallel train step's time goes: the same Trainer step on a 1-rank and a 2-rank world.

Weak scaling of `lockstep train` on 2 H200s stops at 1.62x (benchmarks/scaling.py); its train phase
grows from 0.274 s (1-process launched FSDP world) to 0.446 s on 2 ranks each training as many
tokens. This benchmark isolates that phase: no engine, no rollout. For each world size it spawns
N processes with torchrun's env:// variables, each of which

    joins the world         lockstep.dist.groups.init_distributed (NCCL + gloo on CUDA, gloo on CPU)
    builds the trainer      lockstep.rl.data_parallel._sharded_trainer, as a colocated run does:
                            fp32 load, apply_fsdp over the trainer group, DataParallel, Trainer
    trains                  the same synthetic samples on every rank (what one rollout of
                            grpo_step.py's config gives one GPU: prompts x n completions, random
                            tokens, rollout logprobs, loss mask, GRPO-like advantages), so every
                            rank does the 1-rank world's work and any extra time is the world's

and times each step after `--warmup` (CUDA synchronised at every boundary), rank 0's view:

    train_step        Trainer.train_step = forward_backward + optimiser_step
    fwd+bwd           forward_backward, its DataParallel collectives excluded (FSDP's all-gathers and
                      reduce-scatters run inside it, overlapped with compute)
    DP <op>           each DataParallel collective (the `collective` hook it already calls), count
                      and seconds per step; the hook synchronises on entry and exit, so a rank's wait
                      for a slower peer lands here
    optimiser         optimiser_step: the grad-norm all_reduce, clipping, the AdamW update
    named_weights     every weight gathered whole (what the colocated weight push reads)

One more step runs under torch.profiler on every rank: its communication events (NCCL kernels on
CUDA, c10d / gloo ops on the CPU) are listed with count and total time per step; `--profile` also
prints rank 0's key_averages table (top 25 by self device time on CUDA, self CPU time on CPU).

Prototypes (`--variant`, each measured as an extra 2-rank column in the same run; benchmark-only
monkeypatches of this process's objects, nothing in lockstep changes):
    coalesce-grads   DataParallel.sum_grads as one all_reduce of the flattened replicated gradients
                     instead of one per parameter (lockstep/train/data_parallel.py loops)
    no-reshard       every FSDP unit keeps its gathered parameters from forward to backward
                     (set_reshard_after_forward(False)): no all-gather in backward, more memory
    unit-gather      named_weights through FSDP's own unshard: one all-gather per unit (27 on gpu-848m)
                     instead of one full_tensor per parameter (188), each already in the compute
                     dtype (bf16: half the bytes); checked bitwise equal to Trainer.named_weights
    bf16-gather      named_weights still per parameter, each shard cast to bf16 before its gather
                     (half the bytes, same count; the cast is elementwise: checked bitwise equal)
    all              coalesce-grads, no-reshard and unit-gather together
    bf16-reduce      FSDP reduces gradients in bf16 (apply_fsdp's reduce_dtype) instead of fp32: half
                     the reduce-scatter bytes, NOT the one-process gradients (a measurement only;
                     not part of `all`)

    OMP_NUM_THREADS=1 python benchmarks/fsdp_step.py --config cpu-tiny                  # CPU smoke, gloo
    OMP_NUM_THREADS=1 python benchmarks/fsdp_step.py --config gpu-848m --variant all --variant no-reshard \
        --variant unit-gather --profile                       # 2 GPUs

The model is scaling.py's (grpo_step.py's config with the embedded tokenizer's 103-token vocabulary,
written once with save_pretrained and loaded by every rank, bf16 compute on CUDA).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import re
import statistics
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_variants import MEASURE_ONLY, VARIANTS, apply_variant, reduce_dtype  # noqa: E402

COMM_WORDS = ("nccl", "gloo", "allgather", "all_gather", "reducescatter", "reduce_scatter", "allreduce",
              "all_reduce", "broadcast", "c10d::")


# ---- synthetic rollout --------------------------------------------------------------------------


def make_samples(bench, vocab: int, seed: int) -> list:
    """One GPU's rollout of `bench`: prompts x n completions; variable lengths unless fixed (EOS)."""
    from lockstep.sample import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(bench.num_prompts * bench.n):
        # sample 0 at full length: gpu-848m's HCA layers need a padded batch of >= 128 positions
        r = bench.max_new_tokens if bench.fixed_length or i == 0 else \
            int(torch.randint(bench.max_new_tokens // 2, bench.max_new_tokens + 1, (1,), generator=g))
        out.append(Sample(prompt_ids=torch.randint(2, vocab, (bench.prompt_len,), generator=g),
                          response_ids=torch.randint(2, vocab, (r,), generator=g),
                          rollout_logprobs=-2.0 * torch.rand(r, generator=g), loss_mask=torch.ones(r, dtype=torch.int64),
                          advantages=1.0 if i % 2 else -1.0, group_id=i // bench.n))
    return out


# ---- timing -------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CollectiveTimer:
    """Wraps DataParallel.collective: seconds and count per op label, synchronised at both ends."""

    def __init__(self, inner, device: torch.device):
        self.inner, self.device = inner, device
        self.seconds: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)

    def __call__(self, op: str):
        import contextlib

        @contextlib.contextmanager
        def timed():
            _sync(self.device)
            t0 = time.perf_counter()
            with self.inner(op):
                yield
            _sync(self.device)
            self.seconds[op] += time.perf_counter() - t0
            self.count[op] += 1
        return timed()

    def take(self) -> dict[str, tuple[int, float]]:
        out = {op: (self.count[op], self.seconds[op]) for op in self.count}
        self.seconds.clear()
        self.count.clear()
        return out


def _label(op: str) -> str:
    # "data-parallel all_reduce (loss normalisers)" -> "DP all_reduce (loss normalisers)"
    return "DP " + op.removeprefix("data-parallel ")


def timed_step(trainer, samples, timer: CollectiveTimer, weights_fn) -> dict[str, float]:
    """One train step and one weight gather, seconds per part (module docstring)."""
    dev = trainer.device
    _sync(dev)
    t0 = time.perf_counter()
    metrics = trainer.forward_backward(samples)
    _sync(dev)
    t1 = time.perf_counter()
    fb_collectives = timer.take()
    trainer.optimiser_step(metrics)
    _sync(dev)
    t2 = time.perf_counter()
    opt_collectives = timer.take()
    weights = list(weights_fn())
    _sync(dev)
    t3 = time.perf_counter()
    del weights
    fb_comm = sum(s for _, s in fb_collectives.values())
    parts = {"train_step": t2 - t0, "fwd+bwd": t1 - t0 - fb_comm, "optimiser": t2 - t1, "named_weights": t3 - t2}
    for op, (n, s) in {**fb_collectives, **opt_collectives}.items():
        parts[f"{_label(op)} x{n}"] = s
    return parts


def profiled_step(trainer, samples, table: bool) -> tuple[dict[str, tuple[int, float]], str | None]:
    """One train step under torch.profiler: (comm event name -> (count, seconds)), the table or None."""
    from torch.profiler import ProfilerActivity, profile

    cuda = trainer.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(trainer.device)
    with profile(activities=activities) as prof:
        trainer.train_step(samples)
        _sync(trainer.device)
    events = prof.key_averages()
    comm: dict[str, tuple[int, float]] = {}
    for e in events:
        if any(w in e.key.lower() for w in COMM_WORDS):
            # one row per kind: FSDP's per-unit labels and NCCL kernels' template arguments merged
            key = re.sub(r"\s*[(<].*$", "", e.key)
            us = e.device_time_total if cuda and e.device_time_total > 0 else e.cpu_time_total
            n, sec = comm.get(key, (0, 0.0))
            comm[key] = (n + e.count, sec + us / 1e6)
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    return comm, (events.table(sort_by=sort, row_limit=25) if table else None)


def rank_main(rank: int, world: int, port: int, out: str, args, model_dir: str, variant: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        record = {"value": measure(rank, args, model_dir, variant)}
    except BaseException as e:  # the parent prints it
        record = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    Path(out).write_bytes(pickle.dumps(record))
    os._exit(0)  # no process-group teardown: a failed peer must not hang it


def measure(rank: int, args, model_dir: str, variant: str) -> dict:
    from grpo_step import _configs, _train_config

    from lockstep.dist.groups import init_distributed
    from lockstep.rl.data_parallel import _sharded_trainer

    torch.set_num_threads(args.threads)
    ctx = init_distributed()
    bench = _configs()[args.config]
    cfg = dataclasses.replace(_train_config(bench), compile_hc=args.compile_hc)
    with reduce_dtype(torch.bfloat16 if variant == "bf16-reduce" else torch.float32):
        trainer = _sharded_trainer(ctx, model_dir, cfg, lambda policy: None)
    timer = CollectiveTimer(trainer.dp.collective, trainer.device)
    trainer.dp.collective = timer  # the optimiser holds the same DataParallel
    vocab = trainer.model.config.vocab_size
    samples = make_samples(bench, vocab, seed=1 + (rank if args.distinct_samples else 0))
    weights_fn = apply_variant(trainer, variant, samples)
    timer.take()  # the variants' checks are not steps
    steps = []
    for step in range(args.warmup + args.steps):
        parts = timed_step(trainer, samples, timer, weights_fn)
        if step >= args.warmup:
            steps.append(parts)
    comm, table = profiled_step(trainer, samples, table=args.profile and rank == 0)
    timer.take()
    keys = list(dict.fromkeys(k for s in steps for k in s))
    med = {k: statistics.median(s.get(k, 0.0) for s in steps) for k in keys}
    peak = torch.cuda.max_memory_allocated(trainer.device) if trainer.device.type == "cuda" else None
    return {"parts": med, "comm": comm, "table": table, "tokens": sum(s.response_len for s in samples),
            "peak_bytes": peak, "device": str(trainer.device), "fsdp_bytes": fsdp_bytes(trainer, variant),
            # gloo on a shared CPU moves ~0.1 GB/s: a small probe there
            "link": link_bandwidth(trainer.dp, 256 if trainer.device.type == "cuda" else 8) if trainer.dp.enabled else None}


def fsdp_bytes(trainer, variant: str) -> dict[str, float]:
    """Bytes one rank receives per step through FSDP on a 2-rank world: half of every all-gathered
    unsharded parameter (compute dtype; twice with reshard after forward), half of every gradient
    reduce-scattered (reduce dtype). Comparing with the link's bandwidth says whether the step's
    extra time is the bytes."""
    from torch.distributed.tensor import DTensor

    from lockstep.models.precision import storage_dtype

    low = 2 if trainer.config.dtype == "bfloat16" else 4
    sharded = [(n, p) for n, p in trainer.model.named_parameters() if isinstance(p, DTensor)]
    gathered = sum(p.numel() * (low if storage_dtype(trainer.model, n, torch.bfloat16) != torch.float32 else 4)
                   for n, p in sharded)
    grads = sum(p.numel() for _, p in sharded) * (2 if variant == "bf16-reduce" else 4)
    passes = 1 if variant in ("no-reshard", "all") else 2
    return {"all_gather": passes * gathered / 2, "reduce_scatter": grads / 2}


def link_bandwidth(dp, mib: int = 256, iters: int = 5) -> dict[str, float]:
    """Bus bandwidth (bytes/s) of an all_gather and a reduce_scatter of `mib` MiB (fp32) outputs / inputs
    over the data-parallel group: NVLink gives hundreds of GB/s, PCIe or shared memory tens."""
    import torch.distributed as dist

    n, dev = dp.size, dp.device
    full = torch.empty(mib * 2**20 // 4, dtype=torch.float32, device=dev)
    shard = torch.empty(full.numel() // n, dtype=torch.float32, device=dev)
    ops = {"all_gather": lambda: dist.all_gather_into_tensor(full, shard, group=dp.group),
           "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full, group=dp.group)}
    out = {}
    for name, op in ops.items():
        op()
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(iters):
            op()
        _sync(dev)
        out[name] = full.numel() * 4 * (n - 1) / n * iters / (time.perf_counter() - t0)
    return out


# ---- driver -------------------------------------------------------------------------------------


def run_world(world: int, args, model_dir: str, variant: str) -> dict:
    """Spawn `world` ranks; rank 0's measurements (errors of any rank raised)."""
    import torch.multiprocessing as mp

    from scaling import free_port

    ctx, port = mp.get_context("spawn"), free_port()
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"rank{r}.pkl") for r in range(world)]
        procs = [ctx.Process(target=rank_main, args=(r, world, port, outs[r], args, model_dir, variant))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(args.time_limit)
            if p.is_alive():
                p.kill()
        records = [pickle.loads(Path(o).read_bytes()) if os.path.exists(o) else {"error": "no result (killed?)"}
                   for o in outs]
    errors = [f"rank {r}: {rec['error']}" for r, rec in enumerate(records) if "error" in rec]
    if errors:
        raise RuntimeError("\n".join(errors))
    return records[0]["value"]


def print_table(columns: dict[str, dict]) -> None:
    """Seconds per part per column, and each column's ratio to the 1-rank column."""
    names = list(columns)
    base = columns[names[0]]["parts"]
    keys = list(dict.fromkeys(k for c in columns.values() for k in c["parts"]))
    width = max(12, *(len(n) + 6 for n in names))
    head = f"{'part (s/step, rank 0)':<52}" + "".join(f"{n:>{width}}" for n in names) + \
        "".join(f"{n + ' / 1':>{width}}" for n in names[1:])
    print(head)
    print("-" * len(head))
    for k in keys:
        vals = [c["parts"].get(k) for c in columns.values()]
        row = f"{k[:51]:<52}" + "".join(f"{v:>{width}.4f}" if v is not None else f"{'-':>{width}}" for v in vals)
        for v in vals[1:]:
            b = base.get(k)
            row += f"{v / b:>{width - 1}.2f}x" if v is not None and b else f"{'-':>{width}}"
        print(row)


def print_comm(columns: dict[str, dict]) -> None:
    """The profiled step's communication events: count and seconds per column."""
    keys = sorted({k for c in columns.values() for k in c["comm"]})
    print("\ncommunication in one profiled train_step (rank 0; device time on CUDA, CPU time on CPU; "
          "nested events overlap)")
    width = max(22, *(len(n) + 2 for n in columns))
    print(f"{'event':<60}" + "".join(f"{n:>{width}}" for n in columns))
    for k in keys:
        cells = ["{:>6d} x {:>8.4f}s".format(*c["comm"][k]) if k in c["comm"] else "-" for c in columns.values()]
        print(f"{k[:59]:<60}" + "".join(f"{x:>{width}}" for x in cells))


def print_link(columns: dict[str, dict]) -> None:
    """Per multi-rank column: FSDP bytes per step against the link's measured bus bandwidth."""
    for name, c in columns.items():
        if not c["link"]:
            continue
        ag, rs = c["fsdp_bytes"]["all_gather"], c["fsdp_bytes"]["reduce_scatter"]
        bw_ag, bw_rs = c["link"]["all_gather"], c["link"]["reduce_scatter"]
        print(f"[{name}] link bus bandwidth: all_gather {bw_ag / 1e9:.1f} GB/s, reduce_scatter {bw_rs / 1e9:.1f} GB/s"
              f"; FSDP per step per rank ~{ag / 1e6:.1f} MB all-gathered + {rs / 1e6:.1f} MB "
              f"reduce-scattered = {ag / bw_ag + rs / bw_rs:.4f} s of pure transfer if none overlapped compute")


def largest_growth(columns: dict[str, dict]) -> str:
    names = list(columns)
    one, two = columns[names[0]]["parts"], columns[names[1]]["parts"]
    leaves = {k: two[k] - one.get(k, 0.0) for k in two if k != "train_step"}
    k = max(leaves, key=leaves.get)
    return (f"largest growth 1 -> 2 ranks: {k} +{leaves[k]:.4f} s/step "
            f"({leaves[k] / max(two['train_step'] - one['train_step'], 1e-9):.0%} of train_step's "
            f"+{two['train_step'] - one['train_step']:.4f} s; named_weights is outside train_step)"
            if k != "named_weights" else
            f"largest growth 1 -> 2 ranks: named_weights +{leaves[k]:.4f} s/step (outside train_step)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=("cpu-tiny", "gpu-848m"), default="cpu-tiny")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--variant", choices=("base", *VARIANTS, "all", *MEASURE_ONLY), action="append", default=[],
                    help="prototype measured as an extra 2-rank column (repeatable)")
    ap.add_argument("--distinct-samples", action="store_true",
                    help="each rank its own samples (lengths differ: the step waits for the slowest)")
    ap.add_argument("--compile-hc", action="store_true", help="lockstep's default; scaling.py runs without")
    ap.add_argument("--profile", action="store_true", help="print rank 0's key_averages table per column")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank on the CPU")
    ap.add_argument("--time-limit", type=float, default=900.0, help="seconds per world before its ranks are killed")
    args = ap.parse_args()
    from scaling import write_model

    device = "cuda" if args.config.startswith("gpu") else "cpu"
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the ranks run over gloo even on a GPU machine
    dtype = "bfloat16" if device == "cuda" else "float32"
    runs = [("1 rank", 1, "base"), ("2 ranks", 2, "base")] + [(f"2r {v}", 2, v) for v in args.variant if v != "base"]
    with tempfile.TemporaryDirectory() as tmp:
        n = write_model(args.config, "cpu", dtype, Path(tmp))  # on the host: the ranks own the GPUs
        print(f"{args.config}: {n / 1e6:.1f}M params, {dtype}, steps {args.steps} after {args.warmup} warm-up",
              flush=True)
        columns = {}
        for name, world, variant in runs:
            t0 = time.perf_counter()
            try:
                columns[name] = run_world(world, args, tmp, variant)
            except RuntimeError as e:
                if variant == "base":
                    raise
                print(f"[{name}] failed, column left out:\n{e}", flush=True)  # the other columns still count
                continue
            c = columns[name]
            peak = f", peak {c['peak_bytes'] / 2**30:.1f} GiB" if c["peak_bytes"] else ""
            print(f"[{name}] {c['device']}, {c['tokens']} response tokens per rank, "
                  f"train_step {c['parts']['train_step']:.4f} s{peak} ({time.perf_counter() - t0:.0f}s)", flush=True)
            if c["table"]:
                print(c["table"], flush=True)
    print()
    print_table(columns)
    print_comm(columns)
    print()
    print_link(columns)
    print("\n" + largest_growth(columns))


if __name__ == "__main__":
    main()
