"""A decode step's query / key norms, rotary embeddings and the key's ring write as one Triton kernel
(qk_norm_rope_triton.py) against the torch form (DeepseekV4Attention._normed_rotated, then
window_ring.write_window). The kernel runs under Triton's interpreter here (TRITON_INTERPRET=1,
conftest.py); LOCKSTEP_TEST_DEVICE=cuda runs it on a GPU."""

import pytest
import torch

from devices import DEVICE
from lockstep.models.deepseek_v4 import StepBatch
from lockstep.models.deepseek_v4_init import tiny_config
from lockstep.models.layers import qk_norm_rope_triton as qk
from lockstep.models.layers import step_attention_triton
from lockstep.models.layers.attention import DeepseekV4Attention
from lockstep.models.layers.norm import rms_norm
from lockstep.models.layers.rope import apply_rope, default_inv_freq, rope_cos_sin
from lockstep.models.layers.whole_rows import whole_rows
from lockstep.models.layers.window_ring import write_window

pytestmark = pytest.mark.skipif(qk.triton is None, reason="Triton is not installed")
BF16_ULP = 2.0**-7
EPS = 1e-6


def _within_an_ulp(got, want):
    """Almost every value bit for bit the torch form's, the others within a bf16 ulp of their row's
    largest (the sums of squares run in another order, so a normed value may round to the next bf16,
    and a rotation mixes two of them; on a GPU an fma may also round a rotation once)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    diff = (got.float() - want.float()).abs()
    assert (diff <= BF16_ULP * want.float().abs().amax(-1, keepdim=True)).all()
    assert (diff == 0).float().mean() > 0.98


def _cos_sin_match(got_cos, got_sin, cos, sin):
    """The kernel's cos / sin are rope_cos_sin's: on a GPU the same functions (libdevice's), bit for
    bit; under the interpreter numpy's, within an fp32 ulp."""
    for got, want in ((got_cos, cos), (got_sin, sin)):
        assert got.shape == want.shape and got.dtype == torch.float32
        if DEVICE == "cuda":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=2.0**-23, atol=2.0**-24)


def _torch_form(q, kv, weight, cos, sin):
    q = apply_rope(rms_norm(q, EPS), cos.unsqueeze(-2), sin.unsqueeze(-2))
    kvf = kv.float()
    kv = (weight.float() * (kvf * torch.rsqrt(kvf.square().mean(-1, keepdim=True) + EPS))).to(kv.dtype)
    return q, apply_rope(kv, cos, sin)


@pytest.mark.parametrize("H,D,rope", [(16, 128, 64), (6, 32, 16)])
def test_the_kernel_is_the_torch_form(H, D, rope):
    """Queries per head and the key (a strided view, as the fused input projection leaves it) normed
    and rotated; the keys land where write_window puts them: a prefill-like step of up to S = 5 new
    tokens in a ring of W = 3 (only each sequence's last W survive; the rest, and the padding, go to
    the scratch slot), some sequences with fewer new tokens."""
    g = torch.Generator().manual_seed(H + D)
    N, S, W, slots = 4, 5, 3, 6
    q = (torch.randn(N, S, H, D, generator=g) * 3).bfloat16().to(DEVICE)
    wide = torch.randn(N, S, D + 8, generator=g).bfloat16().to(DEVICE)
    kv = wide[..., 8:]  # rows D + 8 apart
    weight = (torch.rand(D, generator=g) + 0.5).bfloat16().to(DEVICE)
    batch = StepBatch(slots=torch.tensor([2, 0, 5, 3], device=DEVICE), max_new=S,
                      start_pos=torch.tensor([0, 7, 40_000, 2], device=DEVICE),
                      num_new=torch.tensor([5, 1, 4, 2], device=DEVICE))
    inv_freq = default_inv_freq(rope, 10_000.0).to(DEVICE)
    ring = torch.randn(slots + 1, W, D, generator=g).bfloat16().to(DEVICE)
    want_ring = ring.clone()

    got_q, got_cos, got_sin = qk.qk_norm_rope_step(q, kv, weight, inv_freq, EPS, ring, batch.slots, batch.positions,
                                                   batch.valid, batch.num_new, slots)
    cos, sin = rope_cos_sin(inv_freq, batch.positions)
    want_q, want_kv = _torch_form(q, kv, weight, cos, sin)
    write_window(want_ring, batch.slots, batch.positions, batch.valid, batch.num_new, want_kv, slots)
    _cos_sin_match(got_cos, got_sin, cos, sin)
    _within_an_ulp(got_q, want_q)
    _within_an_ulp(ring[:slots], want_ring[:slots])  # the scratch slot's rows are the writes' leftovers
    assert torch.equal(got_q[..., : D - rope], rms_norm(q, EPS)[..., : D - rope])  # plain channels: the norm
    untouched = [s for s in range(slots) if s not in batch.slots.tolist()]
    assert torch.equal(ring[untouched], want_ring[untouched])


def test_the_op_compiles_as_one_call():
    """Under torch.compile (fullgraph) the op is one call that writes the ring in place."""
    g = torch.Generator().manual_seed(1)
    N, H, D, rope, W = 3, 4, 32, 16, 4
    q = torch.randn(N, 1, H, D, generator=g).bfloat16().to(DEVICE)
    kv = torch.randn(N, 1, D, generator=g).bfloat16().to(DEVICE)
    weight = torch.ones(D, dtype=torch.bfloat16, device=DEVICE)
    batch = StepBatch(slots=torch.arange(N, device=DEVICE), start_pos=torch.tensor([0, 5, 9], device=DEVICE),
                      num_new=torch.ones(N, dtype=torch.long, device=DEVICE), max_new=1)
    inv_freq = default_inv_freq(rope, 10_000.0).to(DEVICE)
    rings = [torch.zeros(N + 1, W, D, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    args = (inv_freq, EPS)
    batch_args = (batch.slots, batch.positions, batch.valid, batch.num_new, N)

    def step(q, kv, ring):
        return qk.qk_norm_rope_step(q, kv, weight, *args, ring, *batch_args)

    eager = step(q, kv, rings[0])
    compiled = torch.compile(step, backend="eager", fullgraph=True)(q, kv, rings[1])
    assert all(torch.equal(c, e) for c, e in zip(compiled, eager)) and torch.equal(rings[1], rings[0])
    assert rings[0][torch.arange(N), batch.positions[:, 0] % W].abs().sum() > 0  # the keys were written


def _attention(seed):
    cfg = tiny_config()
    torch.manual_seed(seed)
    attn = DeepseekV4Attention(cfg, 0)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return attn.to(DEVICE, torch.bfloat16).eval()


def test_a_decode_step_takes_the_kernel(monkeypatch):
    """DeepseekV4Attention.forward_step where the step attention kernel reads the ring: the queries
    and the ring's keys through this kernel where `runs` says so, the torch form otherwise; the same
    layer output and ring to bf16 rounding. Over whole rows the torch form."""
    attn = _attention(5)
    N, hidden = 5, attn.q_a_proj.in_features
    h = torch.randn(N, 1, hidden, generator=torch.Generator().manual_seed(6)).bfloat16().to(DEVICE)
    batch = StepBatch(slots=torch.arange(N, device=DEVICE), start_pos=torch.tensor([0, 3, 8, 20, 31], device=DEVICE),
                      num_new=torch.ones(N, dtype=torch.long, device=DEVICE), max_new=1)
    monkeypatch.setattr(step_attention_triton, "runs", lambda q, enabled: True)  # the ring-reading path on CPU
    calls, kernel = [], qk.qk_norm_rope_step
    monkeypatch.setattr(qk, "qk_norm_rope_step", lambda *a: calls.append(a) or kernel(*a))
    outs, rings = [], []
    for takes in (True, False):
        monkeypatch.setattr(qk, "runs", lambda q, ring, takes=takes: takes)
        cache = attn.new_cache(num_slots=N, max_len=64, dtype=torch.bfloat16, device=DEVICE)
        with torch.no_grad():
            outs.append(attn.forward_step(h, batch, cache))
        rings.append(cache.window)
    assert len(calls) == 1
    tol = 4 * BF16_ULP
    torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=tol, atol=tol * outs[1].abs().max().item())
    _within_an_ulp(rings[0][:N], rings[1][:N])
    monkeypatch.undo()
    q = torch.zeros(N, 1, 4, 32, dtype=torch.bfloat16)
    ring = torch.zeros(N + 1, 8, 32, dtype=torch.bfloat16)
    assert qk.runs(q, ring)
    with whole_rows():
        assert not qk.runs(q, ring)
    assert not qk.runs(q, ring.float()) and not qk.runs(q[..., :24], ring[..., :24])
