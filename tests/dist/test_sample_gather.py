"""lockstep/dist/sample_gather.py on 2 gloo processes: the flat-tensor gather returns, sample for
sample and attribute for attribute, what `all_gather_object` of the same samples returns (the gather
it replaced), bitwise, with ranks of different sizes, an empty rank, routed experts on one rank only,
per-token advantages and metadata; one collective per tensor field some rank has."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_world import rank_values, run_world
from lockstep.sample import Sample

# rank -> (samples, with routed experts)
CASES = {"uneven": {0: (3, True), 1: (2, True)}, "one_rank_empty": {0: (4, True), 1: (0, False)},
         "routed_on_one_rank": {0: (2, False), 1: (3, True)}, "no_routed": {0: (2, False), 1: (1, False)}}


def _samples(rank: int, count: int, routed: bool) -> list[Sample]:
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for i in range(count):
        p, r = 3 + i, 5 + 2 * i + rank
        out.append(Sample(prompt_ids=torch.randint(0, 50, (p,), generator=g),
                          response_ids=torch.randint(0, 50, (r,), generator=g),
                          rollout_logprobs=-torch.rand(r, generator=g) * 3, loss_mask=torch.randint(0, 2, (r,), generator=g),
                          reward=float(i), finish_reason=("stop", "length")[i % 2], weight_version=rank + 1,
                          routed_experts=torch.randint(0, 8, (r, 4, 2), generator=g, dtype=torch.int32) if routed else None,
                          group_id=10 * rank + i, metadata={"label": str(i), "index": i, "text": "é" * i},
                          advantages=torch.randn(r, generator=g) if i == 1 else None))
    return out


def _gather_rank(rank: int, case: str) -> dict:
    from lockstep.dist.groups import init_distributed
    from lockstep.dist.sample_gather import gather_samples

    ctx = init_distributed(30.0)
    local = _samples(rank, *CASES[case][rank])
    old: list = [None] * ctx.world_size
    dist.all_gather_object(old, local, group=ctx.control_group)
    ops = []

    def collective(op):
        ops.append(op)
        return ctx.collective(op)

    new = gather_samples(local, ctx.control_group, collective, "rollout samples (test)")
    return {"old": old, "new": new, "ops": ops}


def _same_sample(got: Sample, want: Sample) -> None:
    assert list(vars(got)) == list(vars(want))  # the attributes, in the sender's order
    for name, w in vars(want).items():
        g = getattr(got, name)
        if isinstance(w, torch.Tensor):
            assert g.dtype == w.dtype and g.shape == w.shape and g.device == w.device, name
            # bitwise: the bytes, so -0.0 and NaN payloads count too
            assert torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)), name
        else:
            assert type(g) is type(w) and g == w, name


@pytest.mark.parametrize("case", sorted(CASES))
def test_flat_gather_returns_what_all_gather_object_returns(case):
    for rank, got in enumerate(rank_values(run_world(_gather_rank, 2, guard_s=60, args=(case,)))):
        assert [len(p) for p in got["new"]] == [CASES[case][r][0] for r in range(2)]
        for part_new, part_old in zip(got["new"], got["old"]):
            for s_new, s_old in zip(part_new, part_old):
                _same_sample(s_new, s_old)
        routed = any(routed for _, routed in CASES[case].values())  # no rank has them: no collective for them
        fields = ["prompt_ids", "response_ids", "rollout_logprobs", "loss_mask", *(["routed_experts"] if routed else [])]
        assert got["ops"] == ["all_gather_object of rollout samples (test)",
                              *[f"all_gather of rollout samples (test): {f}" for f in fields]], rank


def test_mixed_dtypes_within_a_rank_are_refused():
    from lockstep.dist.sample_gather import _small_part

    a, b = _samples(0, 2, True)
    b.rollout_logprobs = b.rollout_logprobs.double()  # one flat tensor cannot hold both bitwise
    with pytest.raises(ValueError, match="rollout_logprobs in torch.float32 and torch.float64"):
        _small_part([a, b])
