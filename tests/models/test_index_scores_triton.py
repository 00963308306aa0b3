"""The whole-rows indexer scores (index_scores_triton.py) against key_tiles.tiled_index_scores, their
torch reference, and bitwise row invariance: a row's scores do not depend on how many rows share
the launch or on how many entries the caller passes. Under Triton's interpreter here
(TRITON_INTERPRET=1, conftest.py); LOCKSTEP_TEST_DEVICE=cuda runs them on a GPU."""


import pytest
import torch

from lockstep.models.layers import index_scores_triton as ist
from lockstep.models.layers.key_tiles import gather_tile, tiled_index_scores
from devices import DEVICE

needs_triton = pytest.mark.skipif(ist.triton is None, reason="triton is not installed")
# 17 heads: a full head block and one of a single head; D 8 below tl.dot's 16 (zero-padded)
H, D = 17, 8


def _case(seed, R, E, dtype, sequences=3):
    """R rows over `sequences` sequences of E entries each: q, head weights, flat keys, base, count."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(R, H, D, generator=g).to(dtype)
    w = torch.randn(R, H, generator=g) * H**-0.5
    keys = torch.randn(sequences * E, D, generator=g).to(dtype)
    base = torch.randint(0, sequences, (R,), generator=g) * E
    count = torch.randint(0, E + 1, (R,), generator=g)
    return [t.to(DEVICE) for t in (q, w, keys, base, count)]


def _reference(q, w, keys, base, count, L):
    columns = torch.arange(L, device=q.device)
    valid = columns < count.unsqueeze(1)
    scores = tiled_index_scores(q, w, gather_tile(keys, base.unsqueeze(1) + columns, valid))
    return scores.masked_fill(~valid, float("-inf"))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_the_torch_reference(dtype):
    E = 2 * ist.TILE + 7  # three tiles, the last one short
    args = _case(0, 6, E, dtype)
    out = ist.index_scores(*args, E)
    ref = _reference(*args, E)
    assert out.shape == (6, E) and out.dtype == torch.float32
    assert torch.equal(torch.isinf(out), torch.isinf(ref))  # -inf exactly where the row may not look
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_triton
def test_a_rows_scores_do_not_depend_on_the_others_or_on_the_entries_passed():
    E = 2 * ist.TILE
    q, w, keys, base, count = _case(1, 9, E, torch.bfloat16)
    batch = ist.index_scores(q, w, keys, base, count, E)
    for r in (0, 4, 8):
        row = [t[r:r + 1] for t in (q, w, base, count)]
        alone = ist.index_scores(row[0], row[1], keys, row[2], row[3], E)
        assert torch.equal(alone, batch[r:r + 1])
        # the engine passes its cache's capacity, the trainer its sequence's entries: the same bits
        fewer = int(row[3]) + 1
        assert torch.equal(ist.index_scores(row[0], row[1], keys, row[2], row[3], fewer), alone[:, :fewer])


@needs_triton
def test_zero_scores_are_positive_zero():
    """Every ReLU zero and negative head weights: the products are -0.0; the sort must see one zero."""
    q, w, keys, base, count = _case(2, 4, 10, torch.float32)
    keys = keys.abs()
    q, w = -q.abs(), -w.abs()
    count = torch.full_like(count, 10)
    out = ist.index_scores(q, w, keys, base, count, 10)
    assert torch.all(out == 0) and not torch.any(torch.signbit(out))


def test_available_only_where_the_kernel_runs():
    q, keys = torch.zeros(2, H, D, device=DEVICE), torch.zeros(4, D, device=DEVICE)
    if ist.triton is None:
        assert not ist.available(q, keys)
        return
    assert ist.available(q, keys) == (DEVICE == "cuda" or ist._gt.interpreted())
    assert not ist.available(q, keys.bfloat16())
