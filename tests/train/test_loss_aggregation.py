import pytest
import torch

from lockstep.train.aggregation import (
    aggregate,
    broadcast_to_tokens,
    constant_normalized,
    pack,
    segment_ids,
    sequence_mean,
    token_mean,
)

VALUES = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
MASK = torch.tensor([1, 1, 0, 1, 1, 1])
CU = torch.tensor([0, 3, 6])


def test_pack_and_segment_ids():
    flat, cu = pack([torch.tensor([1, 2]), torch.tensor([3]), torch.tensor([4, 5, 6])])
    assert flat.tolist() == [1, 2, 3, 4, 5, 6]
    assert cu.tolist() == [0, 2, 3, 6]
    assert segment_ids(cu).tolist() == [0, 0, 1, 2, 2, 2]
    assert broadcast_to_tokens(torch.tensor([0.5, -1.0, 2.0]), cu).tolist() == [0.5, 0.5, -1.0, 2.0, 2.0, 2.0]


def test_hand_values():
    assert token_mean(VALUES, MASK, 5).item() == pytest.approx(18 / 5)
    assert token_mean(VALUES, MASK, torch.tensor(5.0)).item() == pytest.approx(18 / 5)
    # sample 0: (1 + 2) / 2 = 1.5; sample 1: (4 + 5 + 6) / 3 = 5
    assert sequence_mean(VALUES, MASK, CU, 2).item() == pytest.approx(3.25)
    assert constant_normalized(VALUES, MASK, 2, 4).item() == pytest.approx(18 / 8)
    assert aggregate(VALUES, MASK, CU, "sequence_mean", num_samples=2).item() == pytest.approx(3.25)


def test_aggregate_requires_global_normaliser():
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate(VALUES, MASK, CU, "token_mean")
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(VALUES, MASK, CU, "mean", num_tokens=5)


@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean", "constant"])
def test_micro_batch_split_sums_to_full_batch(mode):
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 7, 1, 5, 4, 6, 2]
    values = [torch.randn(n, generator=gen) for n in lengths]
    masks = [(torch.rand(n, generator=gen) > 0.3).long() for n in lengths]
    masks[2] = torch.zeros(1, dtype=torch.long)  # a sample with no valid token
    norms = dict(num_tokens=int(sum(m.sum() for m in masks)), num_samples=len(lengths), max_len=8)

    def run(lo, hi):
        v, cu = pack(values[lo:hi])
        m, _ = pack(masks[lo:hi])
        return aggregate(v, m, cu, mode, **norms)

    full = run(0, 7)
    split = run(0, 2) + run(2, 5) + run(5, 7)
    torch.testing.assert_close(split, full)
    # The same split with micro-batch-local normalisers does not agree: that is the bug avoided.
    local = []
    for lo, hi in [(0, 2), (2, 5), (5, 7)]:
        v, cu = pack(values[lo:hi])
        m, _ = pack(masks[lo:hi])
        local.append(aggregate(v, m, cu, mode, num_tokens=int(m.sum()), num_samples=hi - lo, max_len=8))
    assert not torch.allclose(sum(local) / 3, full)
