"""Old vs new rollout sample gather on 2 gloo processes (lockstep/dist/sample_gather.py).

    python benchmarks/sample_gather.py [--samples 512] [--tokens 1024] [--layers 8] [--top-k 6]

Each rank holds half the samples, each a 64-token prompt and a `--tokens`-token response with its
logprobs, loss mask and routed experts [tokens, layers, top-k] int32. Timed on every rank, the
median of `--repeats` after a warm-up: the old gather (`all_gather_object` of the samples, pickled
tensors included) and the new one (`gather_samples`: small fields pickled, tensors as flat
per-field all_gathers). Rank 0 prints both times, the ratio and whether every gathered sample was
bitwise the old gather's.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _samples(rank: int, count: int, args) -> list:
    from lockstep.sample import Sample

    g = torch.Generator().manual_seed(rank)
    return [Sample(prompt_ids=torch.randint(0, 100_000, (64,), generator=g),
                   response_ids=torch.randint(0, 100_000, (args.tokens,), generator=g),
                   rollout_logprobs=-torch.rand(args.tokens, generator=g),
                   routed_experts=torch.randint(0, 256, (args.tokens, args.layers, args.top_k), generator=g,
                                                dtype=torch.int32),
                   reward=float(i % 2), group_id=i // 8, metadata={"label": "42", "index": i})
            for i in range(count)]


def _timed(fn, repeats: int, group) -> tuple[float, object]:
    out = fn()  # warm-up: connections, allocator
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def _bitwise(new: list, old: list) -> bool:
    for part_new, part_old in zip(new, old):
        for a, b in zip(part_new, part_old, strict=True):
            for name, want in vars(b).items():
                got = getattr(a, name)
                same = (torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
                        and got.shape == want.shape) if isinstance(want, torch.Tensor) else got == want
                if not same:
                    return False
    return True


def _rank(rank: int, world: int, port: int, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from lockstep.dist.groups import init_distributed
    from lockstep.dist.sample_gather import gather_samples

    ctx = init_distributed(600.0)
    local = _samples(rank, args.samples // world, args)

    def old():
        parts: list = [None] * world
        dist.all_gather_object(parts, local, group=ctx.control_group)
        return parts

    def new():
        return gather_samples(local, ctx.control_group, ctx.collective, "rollout samples (benchmark)")

    old_s, old_out = _timed(old, args.repeats, ctx.control_group)
    new_s, new_out = _timed(new, args.repeats, ctx.control_group)
    same = _bitwise(new_out, old_out)
    if rank == 0:
        mb = sum(t.numel() * t.element_size() for s in local for t in vars(s).values()
                 if isinstance(t, torch.Tensor)) * world / 1e6
        print(f"{args.samples} samples x {args.tokens} tokens, routed experts [{args.tokens}, {args.layers}, "
              f"{args.top_k}] int32, {world} gloo processes, {mb:.0f} MB of tensors gathered to every rank")
        print(f"old all_gather_object: {old_s:.3f} s   new flat gather: {new_s:.3f} s   "
              f"ratio old/new: {old_s / new_s:.2f}x   bitwise equal: {same}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(2, port, args), nprocs=2)


if __name__ == "__main__":
    main()
