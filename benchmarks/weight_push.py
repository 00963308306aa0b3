"""Weight push trainer -> engine over torch.distributed, against the in-process update, same run.

Rank 0 holds the trainer's weights, rank 1 an engine (disaggregated layout, started through torch's
launcher by this script itself). Rank 1 times `Engine.update_weights` from a local copy (the
in-process path, no transfer), then receives `--pushes` pushes (`lockstep.dist.weight_push`) and
checks the pushed engine equals the in-process one, every tensor. On one GPU both processes share
it and the push runs over gloo (NCCL does not put two ranks on one device): by default as handles to
shared memory (CUDA IPC; lockstep/dist/shared_buckets.py), `--transport broadcast` as gloo broadcasts.

    python benchmarks/weight_push.py --config cpu-tiny
    python benchmarks/weight_push.py --config gpu-848m --serving-format fp8

Measured on one H200 (torch 2.11, both ranks on the one GPU, gloo on CUDA tensors), gpu-848m, fp8
serving: 1709 MB in 4 buckets of 512 MiB, push 0.587 s (2.9 GB/s; gloo stages through host memory)
vs in-process update 0.058 s: ratio 10.1; 0 tensors differ from the in-process update. NCCL between
two GPUs is the figure to measure next (2-GPU issue). On 2 CPU cores, cpu-tiny fp8: 5 MB, 0.06 s.

Issue 17's bar: perf/weight_sync_time (the push: transfer, validation, re-quantisation into the
packed storage, whose CUDA path is quant/fp8_triton.py's kernels) within 2x of the bytes moved
at copy bandwidth. Rank 1 also prints `weight sync ratio R (T s for B bytes; copy bound C s at
X GB/s measured in this run)`: T the best push, B the bytes pushed, C a copy of B bytes timed
in the same run on the engine's device (CUDA: device-to-device, torch.cuda events; CPU: a
memcpy), X = B / C (each byte read once and written once). One H200 (2026-12-01), gpu-848m fp8 --packed:
in-process 0.020 s, push 0.536 s, weight sync ratio 665 (copy bound 0.81 ms at 2,123 GB/s).
With the shared transport (`--transport`, auto picks it on one GPU; one H200, 2026-12-04, one call):
bf16 0.027 s (ratio 33.3), fp8 --packed 0.031 s (39.2), fp8-fp4 --packed 0.038 s (47.2); broadcast
fp8 --packed 0.543 s (674) in the same call.
That ratio is the engine's view, from its call of push_weights: it also holds the engine's wait for the
trainer to arrive. A second line gives the trainer's (the source rank's fastest push, whose tensors
are walked inside the push as Trainer.named_weights() is): what the RL loop logs as
perf/weight_sync_time (rl/loop.py times the push in the trainer's process).
Each rank also prints its fastest push's phases (weight_push.PHASES: agree, transfer, vote, write,
release), from the push's `perf/weight_sync/<phase>_time` metrics.
On one host (auto) the pushes run four times: the shared transport with buckets of each push's own
(allocated, exported, mapped and freed per push), then with a `BucketPool` kept from push to push;
the mapped transport (lockstep/dist/mapped_weights.py: engines read the trainer's tensors in place)
exporting per push, then with its exports and mappings kept (as EngineReplicas keeps them); a
ratio line for each. On 2 CPU cores (2026-12-04, `--config gpu-848m --pushes 3`, bf16, 1709 MB,
copy bound 0.248 s at 6.9 GB/s): shared per push ratio 5.23, shared kept pool 2.91, mapped per
push 2.10, **mapped kept 1.59** (0.395 s; the in-process update 0.407 s; engine phases: transfer,
i.e. the finiteness read, 150 ms, write 239 ms); later that session, after the host-work changes
(README), on a slower moment of the machine: 6.17, 3.23, 2.27, **1.78**; at the session's last commit
5.61, 3.03, 2.19, **1.62** (0.399 s), and `--transport mapped` 2.16, **1.56**. cpu-tiny (5 MB, fixed
costs dominate): kept pool 10.3, kept mappings 8.0-9.5.
One H200, 2026-12-04, buckets per push (before the pool and the one-broadcast sharing): bf16 0.017 s
(ratio 20.7; engine phases agree 2.7 ms, transfer 10.7, vote 0.3,
write 2.3, release 0.8), fp8 --packed 0.025 s (31.0; write 9.7). After (one call, best of 5):
buckets per push bf16 0.0149 s (18.6), fp8 --packed 0.0229 s (28.5); kept pool bf16 0.0095 s
(11.8), fp8 --packed 0.0168 s (20.9).
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from grpo_step import _configs, make_model  # noqa: E402  (the same model configs as the GRPO benchmark)

from lockstep.config import EngineConfig  # noqa: E402
from lockstep.dist.config import DistConfig  # noqa: E402
from lockstep.dist.groups import Layout, init_distributed, launched  # noqa: E402
from lockstep.dist.launch import launch  # noqa: E402
from lockstep.dist.manifest import build_manifest  # noqa: E402
from lockstep.dist.mapped_weights import MappedWeights  # noqa: E402
from lockstep.dist.push_transport import TRANSPORTS, resolve_transport  # noqa: E402
from lockstep.dist.shared_buckets import BucketPool  # noqa: E402
from lockstep.dist.weight_push import PHASES, push_weights  # noqa: E402
from lockstep.engine import Engine  # noqa: E402
from lockstep.models.live_state import LiveState  # noqa: E402
from lockstep.models.precision import cast_model  # noqa: E402


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="cpu-tiny", choices=sorted(_configs()))
    p.add_argument("--serving-format", default="bf16", choices=("bf16", "fp8", "fp8-fp4"))
    p.add_argument("--bucket-mib", type=int, default=512)
    p.add_argument("--pushes", type=int, default=3)
    p.add_argument("--transport", default="auto", choices=TRANSPORTS,
                   help="broadcast over the weight group, or shared memory handed over by handle (CUDA IPC on a "
                        "GPU; lockstep/dist/shared_buckets.py); auto: shared where both ranks share this host over gloo")
    p.add_argument("--profile", action="store_true",
                   help="CUDA: two more pushes a series (and in-process updates) under the profilers, each rank "
                        "printing the kernels of one (kernel_profile.profile_call) and the host's time of the other")
    p.add_argument("--packed", action="store_true",
                   help="engine holds fp8 linears and routed experts packed (EngineConfig.packed_fp8 / packed_experts): "
                        "the push quantises into the packed storage")
    args = p.parse_args()
    if args.profile and not torch.cuda.is_available():
        p.error("--profile reads CUDA kernel times: run it on a GPU")
    return args


def profiled(push, label: str) -> None:
    """Two more calls of push(): the kernels of one, then the host's time of the other (--profile)."""
    from kernel_profile import host_profile, profile_call

    print(profile_call(push, label), flush=True)
    print(f"{label}, {host_profile(push, top=15)}", flush=True)


def _weights(bench, device, dtype):
    model = cast_model(make_model(bench), dtype).to(device)
    with torch.no_grad():  # new weights: the engine starts from the unperturbed ones
        for t in model.parameters():
            t.add_(1e-3)
    return model


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bound(nbytes: int, device: torch.device, repeats: int = 5) -> float:
    """Seconds to copy nbytes on `device` (best of `repeats`, after one warm-up): device to device
    timed by CUDA events on a GPU, a memcpy timed by the clock on CPU."""
    src = torch.ones(max(nbytes, 1), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
    return best


def ratio_line(sync_s: float, nbytes: int, copy_s: float) -> str:
    """Issue 17's figure: the push's time over the copy bound of the same bytes."""
    return (f"weight sync ratio {sync_s / copy_s:.2f} ({sync_s:.4f} s for {nbytes} bytes; copy bound {copy_s:.6f} s "
            f"at {nbytes / copy_s / 1e9:.1f} GB/s measured in this run)")


def live_weights(live: LiveState):
    """The trainer's tensors, walked inside the push as the RL loop's Trainer.named_weights() walks
    them (through the LiveState it keeps), so that the source's time covers the walk and the
    engine's does not wait for it outside the push."""
    yield from live.items(detached=True)


def best_times(ctx, pushes: list[dict]) -> list[float]:
    """Every rank's fastest push, in rank order (a collective on the control group, both ranks at the
    end of a series): the source's is the RL loop's view (rl/loop.py's perf/weight_sync_time is timed
    in the trainer's process), the engine's also holds its wait for the source to arrive."""
    out = [None] * ctx.world_size
    torch.distributed.all_gather_object(out, min(m["perf/weight_sync_time"] for m in pushes), group=ctx.control_group)
    return out


def phase_line(pushes: list[dict]) -> str:
    """The fastest push's phases on this rank (weight_push.PHASES), in ms."""
    best = min(pushes, key=lambda m: m["perf/weight_sync_time"])
    return "phases of the fastest push (ms): " + ", ".join(
        f"{phase} {best[f'perf/weight_sync/{phase}_time'] * 1e3:.2f}" for phase in PHASES)


def series(requested: str, transport: str) -> list[tuple[str, str, BucketPool | MappedWeights | None]]:
    """(label, transport, pool) per series of pushes: the shared transport with buckets of each push's
    own (no pool), then with a pool kept from push to push; the mapped transport likewise (exports
    per push, then kept); auto on one host runs both; a broadcast has nothing to keep."""
    if transport == "broadcast":
        return [("", "broadcast", None)]
    shared = [(" (buckets per push)", "shared", None), (" (kept pool)", "shared", BucketPool())]
    mapped = [(" (mapped per push)", "mapped", None), (" (kept mappings)", "mapped", MappedWeights())]
    return {"shared": shared, "mapped": mapped}.get(requested, shared + mapped)


def rank_main(args) -> None:
    bench = _configs()[args.config]
    one_gpu = torch.cuda.is_available() and torch.cuda.device_count() == 1
    ctx = init_distributed(600.0, layout=Layout.disaggregated(1, 1), backend="gloo" if one_gpu else None)
    dtype, device = getattr(torch, bench.dtype), ctx.device
    trainer_model = _weights(bench, device, dtype)
    live = LiveState.of(trainer_model)
    manifest = build_manifest(trainer_model, dtype, args.bucket_mib * 2 ** 20)
    transport = resolve_transport(ctx, args.transport)  # every rank: a collective
    if ctx.rank == 0:
        version = 0
        for label, kind, pool in series(args.transport, transport):
            pushes = []
            for _ in range(args.pushes):
                version += 1
                pushes.append(push_weights(ctx, manifest, version, named_tensors=live_weights(live),
                                           transport=kind, pool=pool))
            best_times(ctx, pushes)
            print(f"trainer rank{label}, {phase_line(pushes)}", flush=True)
            if args.profile:
                version += 2
                profiled(lambda v=iter((version - 1, version)), kind=kind, pool=pool, live=live: push_weights(
                    ctx, manifest, next(v), named_tensors=live_weights(live), transport=kind, pool=pool),
                    f"trainer rank{label}")
        return
    cfg = EngineConfig(max_num_seqs=8, max_model_len=256, max_prefill_tokens=256, device=str(device),
                       dtype=bench.dtype, serving_format=args.serving_format, cuda_graph=False,
                       packed_fp8=args.packed, packed_experts=args.packed, true_on_policy=False)
    reference, pushed = Engine(make_model(bench), cfg), Engine(make_model(bench), cfg)
    in_process = float("inf")
    for v in range(1, args.pushes + 1):
        _sync(device)
        start = time.perf_counter()
        reference.update_weights(live_weights(live), version=v)
        _sync(device)
        in_process = min(in_process, time.perf_counter() - start)
    if args.profile:
        versions = iter((args.pushes + 1, args.pushes + 2))
        profiled(lambda live=live: reference.update_weights(live_weights(live), version=next(versions)),
                 "in-process update")
    del trainer_model, live
    copy_s = copy_bound(manifest.total_bytes, torch.device(device))
    # one process holding trainer and engine (the colocated RL loop: its perf/weight_sync_time is this)
    print(f"{args.serving_format}{' packed' if args.packed else ''} in-process update (the colocated RL loop's "
          f"perf/weight_sync_time): {ratio_line(in_process, manifest.total_bytes, copy_s)}", flush=True)
    ref = reference.model.state_dict()
    for label, kind, pool in series(args.transport, transport):
        pushes = [push_weights(ctx, manifest, None, engine=pushed, transport=kind, pool=pool)
                  for _ in range(args.pushes)]
        differ = [n for n, t in pushed.model.state_dict().items() if not torch.equal(t, ref[n])]
        source_s, push_s = best_times(ctx, pushes)
        print(f"weight push {args.config} {args.serving_format} on {device} ({kind}{label}): "
              f"{manifest.total_bytes / 1e6:.1f} MB in {len(manifest.buckets)} buckets; push {push_s:.3f} s (best of "
              f"{len(pushes)}, {manifest.total_bytes / push_s / 1e9:.2f} GB/s) vs in-process update {in_process:.3f} s "
              f"(best): ratio {push_s / in_process:.2f}; tensors differing from the in-process update: {len(differ)} "
              f"{differ[:3]}", flush=True)
        print(f"engine rank{label}, {phase_line(pushes)}", flush=True)
        if args.profile:
            profiled(lambda kind=kind, pool=pool: push_weights(ctx, manifest, None, engine=pushed, transport=kind,
                                                               pool=pool), f"engine rank{label}")
        name = f"{args.serving_format}{' packed' if args.packed else ''}{label}"
        print(f"{name}: {ratio_line(push_s, manifest.total_bytes, copy_s)}", flush=True)
        print(f"{name}, the trainer's view (the RL loop's perf/weight_sync_time): "
              f"{ratio_line(source_s, manifest.total_bytes, copy_s)}", flush=True)


def main() -> None:
    args = _args()
    if launched():
        return rank_main(args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch(DistConfig(nproc_per_node=2, master_port=port), [__file__, *sys.argv[1:]])


if __name__ == "__main__":
    main()
