"""DataParallel.gather_tensors on 2 gloo processes: every rank gets every rank's lists of 1-D tensors,
in rank order, bitwise, in each list's dtype (fp32 logprobs, bf16 values, integer masks), with ranks
holding different numbers of tensors of different lengths; one process returns its input. And
gather_full through host memory (the path of ranks sharing a GPU) equals DTensor's full_tensor."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dist_world import rank_values, run_world
from lockstep.train.data_parallel import DataParallel, gather_full

COUNTS = {0: 3, 1: 1}


def _lists(rank: int):
    g = torch.Generator().manual_seed(7 + rank)
    lens = [2 + 3 * i + rank for i in range(COUNTS[rank])]
    logp = [-torch.rand(n, generator=g) * 5 for n in lens]
    half = [torch.randn(n, generator=g).to(torch.bfloat16) for n in lens]
    mask = [torch.randint(0, 2, (n,), generator=g) for n in lens]
    return logp, half, mask


def _gather(rank: int):
    dist.init_process_group("gloo")
    return DataParallel(dist.group.WORLD).gather_tensors(*_lists(rank))


def test_gather_tensors_returns_every_ranks_lists_bitwise():
    got = rank_values(run_world(_gather, 2, guard_s=60))
    want = [_lists(r) for r in (0, 1)]
    for ranks in got:  # what each rank received
        assert len(ranks) == 2
        for received, sent in zip(ranks, want):
            for r_list, s_list in zip(received, sent):
                assert len(r_list) == len(s_list)
                for a, b in zip(r_list, s_list):
                    assert a.dtype == b.dtype and torch.equal(a, b)


def test_one_process_returns_its_input():
    lists = _lists(0)
    (out,) = DataParallel().gather_tensors(*lists)
    assert all(a is b for x, y in zip(out, lists) for a, b in zip(x, y))


def _gather_full(rank: int):
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(5 * 3, dtype=torch.float32).view(5, 3).to(torch.bfloat16)  # 5 rows: uneven shards
    t = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
    return full, t.full_tensor(), gather_full(t, host_staged=True)


def test_gather_full_through_host_equals_full_tensor():
    for full, direct, staged in rank_values(run_world(_gather_full, 2, guard_s=60)):
        assert staged.dtype == torch.bfloat16 and torch.equal(staged, direct) and torch.equal(staged, full)
