"""The whole-rows attention core (tiled_attention_triton.py) against key_tiles.tiled_sink_attention,
its torch reference, and bitwise row invariance: a row's output does not depend on how many rows
share the launch, on what they hold, or on entry tiles past what the row can see. Under Triton's
interpreter here (TRITON_INTERPRET=1, conftest.py); LOCKSTEP_TEST_DEVICE=cuda runs them on a GPU."""


import pytest
import torch

from lockstep.models.layers import tiled_attention_triton as ta
from lockstep.models.layers.key_tiles import ENTRY_TILE, gather_tile, tiled_sink_attention
from devices import DEVICE

needs_triton = pytest.mark.skipif(ta.triton is None, reason="triton is not installed")
H, D, W = 3, 16, 8  # heads fewer than a program's 16 (masked), the smallest head dim, a short window


def _case(seed, R, L, dtype, M=40, E=150):
    """Random q, sources and index / valid masks for R rows, L entries per row (some invalid)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(R, H, D, generator=g).to(dtype)
    ws, es = torch.randn(M, D, generator=g).to(dtype), torch.randn(E, D, generator=g).to(dtype)
    wi, ei = torch.randint(0, M, (R, W), generator=g), torch.randint(0, E, (R, L), generator=g)
    wv, ev = torch.rand(R, W, generator=g) < 0.8, torch.rand(R, L, generator=g) < 0.5
    reach = torch.randint(0, L + 1, (R,), generator=g)
    ev &= torch.arange(L).unsqueeze(0) < reach.unsqueeze(1)  # nothing valid past a row's reach
    sinks = torch.randn(H, generator=g)
    return [t.to(DEVICE) for t in (q, ws, wi, wv, es, ei, ev, reach, sinks)]


def _reference(q, ws, wi, wv, es, ei, ev, reach, sinks, scale):
    tiles = [(gather_tile(ws, wi, wv), wv)]
    for a in range(0, ei.shape[1], ENTRY_TILE):
        i, ok = ei[:, a:a + ENTRY_TILE], ev[:, a:a + ENTRY_TILE]
        tiles.append((gather_tile(es, i, ok), ok))
    return tiled_sink_attention(q, tiles, sinks, scale)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_the_torch_reference(dtype):
    args = _case(0, 5, 2 * ENTRY_TILE + 7, dtype)  # three entry tiles, the last one short
    out = ta.tiled_sink_attention(*args, 0.25)
    ref = _reference(*args, 0.25)
    assert out.shape == ref.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    # no entries: the window alone
    q, ws, wi, wv, *_, sinks = args
    torch.testing.assert_close(ta.tiled_sink_attention(q, ws, wi, wv, None, None, None, None, sinks, 0.25).float(),
                               tiled_sink_attention(q, [(gather_tile(ws, wi, wv), wv)], sinks, 0.25).float(),
                               rtol=tol, atol=tol)


@needs_triton
def test_a_rows_output_does_not_depend_on_the_others():
    q, ws, wi, wv, es, ei, ev, reach, sinks = _case(1, 9, 2 * ENTRY_TILE, torch.bfloat16)
    batch = ta.tiled_sink_attention(q, ws, wi, wv, es, ei, ev, reach, sinks, 0.3)
    g = torch.Generator().manual_seed(2)
    for r in (0, 4, 8):
        row = [t[r:r + 1] for t in (q, wi, wv, ei, ev, reach)]
        alone = ta.tiled_sink_attention(row[0], ws, row[1], row[2], es, row[3], row[4], row[5], sinks, 0.3)
        assert torch.equal(alone, batch[r:r + 1])
        # more entry tiles than the row can see (the engine's cache capacity vs the trainer's
        # sequence), garbage indices there, a reach past them: the same bits
        extra = ENTRY_TILE + 5
        wide_i = torch.cat([row[3], torch.randint(0, es.shape[0], (1, extra), generator=g).to(DEVICE)], dim=1)
        wide_v = torch.cat([row[4], torch.zeros(1, extra, dtype=torch.bool, device=DEVICE)], dim=1)
        far = torch.full_like(row[5], wide_i.shape[1])
        wider = ta.tiled_sink_attention(row[0], ws, row[1], row[2], es, wide_i, wide_v, far, sinks, 0.3)
        assert torch.equal(wider, alone)


def test_available_only_where_the_kernel_runs():
    q, ws = torch.zeros(2, H, D, device=DEVICE), torch.zeros(4, D, device=DEVICE)
    if ta.triton is None:
        assert not ta.available(q, ws)
        return
    assert ta.available(q, ws) == (DEVICE == "cuda" or ta._gt.interpreted())
    assert not ta.available(q[..., :8].contiguous(), ws[:, :8])  # head dim below tl.dot's 16
    assert not ta.available(torch.zeros(2, H, 24), torch.zeros(4, 24))  # head dim not a power of two
    assert not ta.available(q, ws.bfloat16())  # mixed dtypes
    assert not ta.available(q.double(), ws.double())
