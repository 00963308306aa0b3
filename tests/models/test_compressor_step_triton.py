"""The entry a decode step closes, by the kernel reading the compressor's open block in place
(compressor_step_triton.py, Compressor.decode_step), against the torch form it replaces
(Compressor.forward_step's two-block layout), step after step, for C4 (overlapping) and C128-style
compressors. The kernel runs under Triton's interpreter here (TRITON_INTERPRET=1, set in
conftest.py); LOCKSTEP_TEST_DEVICE=cuda runs the same tests on a GPU."""

import copy
import os

import pytest
import torch

from lockstep.models.layers import compressor_step_triton as cs
from lockstep.models.layers.compressor import Compressor, CompressorState
from lockstep.models.layers.rope import inv_freq_for, rope_cos_sin
from compiled_op import compile_op

needs_triton = pytest.mark.skipif(cs.triton is None, reason="triton is not installed")
DEVICE = "cuda" if os.environ.get("LOCKSTEP_TEST_DEVICE") == "cuda" else "cpu"
DTYPES = [torch.bfloat16] if DEVICE == "cuda" else [torch.bfloat16, torch.float32]
HIDDEN = 32


def _compressor(head_dim, m, overlap, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    comp = Compressor(HIDDEN, head_dim, m, overlap, norm_eps=1e-6)
    with torch.no_grad():
        for p in comp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if p is comp.kv_norm.weight else 0.0))
    return comp.to(dtype).to(DEVICE)


def _tokens(comp, N, S, seed):
    g = torch.Generator().manual_seed(seed)
    kv, gate = (torch.randn(N, S, comp.width, generator=g) * 2 for _ in range(2))
    dtype = comp.kv_proj.weight.dtype
    return kv.to(dtype).to(DEVICE), gate.to(dtype).to(DEVICE)


def _run(comp, lengths, steps, decode_by_kernel, capacity=64):
    """A prefill of lengths[i] tokens per sequence (torch form), then `steps` decode steps (one more
    token each; a last row without a token, as a CUDA graph pads) -> the state after each step."""
    N = len(lengths)
    rope_dim = comp.head_dim // 2
    inv_freq = inv_freq_for(rope_dim, 10000.0, None).to(DEVICE)
    state = CompressorState(N + 2, capacity, comp, comp.kv_proj.weight.dtype, DEVICE)
    slots = torch.arange(N, device=DEVICE).flip(0)  # not the row order
    start = torch.zeros(N, dtype=torch.long, device=DEVICE)
    num_new = torch.tensor(lengths, device=DEVICE)
    with torch.no_grad():
        comp.forward_step(*_tokens(comp, N, max(lengths), 0), start, num_new, state, slots, inv_freq)
        start, states = num_new.clone(), []
        pad_slot = torch.tensor([state.scratch_slot], device=DEVICE)
        for k in range(steps):
            kv, gate = _tokens(comp, N + 1, 1, k + 1)
            args = (torch.cat([start, start[:1]]), torch.cat([torch.ones_like(start), torch.zeros_like(start[:1])]),
                    state, torch.cat([slots, pad_slot]), inv_freq)
            if decode_by_kernel:
                comp.decode_step(kv[:, 0], gate[:, 0], *args)
            else:
                comp.forward_step(kv, gate, *args)
            start = start + 1
            states.append(copy.deepcopy(state))
    return states


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,m,overlap", [(16, 2, True), (16, 4, False), (32, 4, True)],
                         ids=["C4-like m 2", "C128-like m 4", "C4 m 4"])
def test_every_step_writes_the_torch_forms_entries(dtype, head_dim, m, overlap):
    comp = _compressor(head_dim, m, overlap, dtype)
    lengths = [0, 1, m - 1, m, 2 * m + 1]  # blocks that close at the first decode step, later, never before
    steps = 2 * m + 1
    ours, ref = _run(comp, lengths, steps, True), _run(comp, lengths, steps, False)
    real = slice(0, len(lengths))  # the scratch slot's contents are nobody's
    for a, b in zip(ours, ref):
        if dtype == torch.float32:
            torch.testing.assert_close(a.entries[real], b.entries[real], rtol=1e-5, atol=1e-6)
        else:  # rounded where the torch form rounds: within a bf16 ulp
            torch.testing.assert_close(a.entries[real].float(), b.entries[real].float(), rtol=2 ** -7, atol=2 ** -8)
        if overlap:  # the Ca half is data movement: the same bits
            assert torch.equal(a.prev_kv[real], b.prev_kv[real]) and torch.equal(a.prev_gate[real], b.prev_gate[real])
    assert ours[-1].entries[real].abs().sum() > 0  # entries were written at all


@needs_triton
def test_a_c128_block_pools_its_slots_in_several_tiles():
    # m = 128 slots: four tiles of the kernel's SLOT_BLOCK, at the 1b config's head_dim
    comp = _compressor(128, 128, False, torch.bfloat16, seed=1)
    ours, ref = (_run(comp, [126, 127, 255], 2, by_kernel, capacity=4) for by_kernel in (True, False))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.entries[:3].float(), b.entries[:3].float(), rtol=2 ** -7, atol=2 ** -8)
    assert (ours[0].entries[1, 0] != 0).any() and (ours[1].entries[0, 0] != 0).any()


@needs_triton
def test_a_block_that_stays_open_gets_zeros_and_a_padding_row_writes_nothing_real():
    comp = _compressor(16, 4, True, DTYPES[0])
    inv_freq = inv_freq_for(8, 10000.0, None).to(DEVICE)
    state = CompressorState(3, 8, comp, DTYPES[0], DEVICE)
    kv, gate = _tokens(comp, 2, 1, 5)
    start, num_new = torch.tensor([1, 3], device=DEVICE), torch.tensor([1, 0], device=DEVICE)
    cos, sin = rope_cos_sin(inv_freq, start - 3)
    out = cs.closing_entry(kv[:, 0], gate[:, 0], start, num_new, torch.tensor([0, 2], device=DEVICE), state.buf_kv,
                           state.buf_gate, state.prev_kv, state.prev_gate, comp.position_bias, comp.kv_norm.weight,
                           cos, sin, 1e-6)
    assert (out == 0).all()  # row 0: position 1 closes nothing; row 1: no token (position 3 would close)


@needs_triton
def test_compiled_callers_get_the_kernels_result():
    comp = _compressor(16, 2, True, DTYPES[0])
    state = CompressorState(3, 8, comp, DTYPES[0], DEVICE)
    kv, gate = _tokens(comp, 2, 1, 3)
    cos, sin = torch.rand(2, 4, device=DEVICE), torch.rand(2, 4, device=DEVICE)
    args = (kv[:, 0], gate[:, 0], torch.tensor([1, 5], device=DEVICE), torch.ones(2, dtype=torch.long, device=DEVICE),
            torch.tensor([1, 0], device=DEVICE), state.buf_kv, state.buf_gate, state.prev_kv, state.prev_gate,
            comp.position_bias.detach(), comp.kv_norm.weight.detach(), cos, sin, 1e-6)
    compiled = compile_op(cs.closing_entry)
    assert torch.equal(compiled(*args), cs.closing_entry(*args))


@needs_triton
def test_strided_channels_are_refused():
    comp = _compressor(16, 2, False, torch.float32)
    state = CompressorState(2, 4, comp, torch.float32, DEVICE)
    kv = torch.zeros(1, 32, device=DEVICE)[:, ::2]
    with pytest.raises(ValueError, match="kv_new needs contiguous channels"):
        cs.closing_entry(kv, kv, torch.ones(1, dtype=torch.long), torch.ones(1, dtype=torch.long),
                         torch.zeros(1, dtype=torch.long), state.buf_kv, state.buf_gate, None, None,
                         comp.position_bias.detach(), comp.kv_norm.weight.detach(), torch.ones(1, 4),
                         torch.zeros(1, 4), 1e-6)


def test_the_kernel_runs_only_for_a_decode_step_without_gradients_on_cuda():
    kv = torch.zeros(2, 1, 32)
    assert not cs.runs(kv, True)  # CPU: torch ops (the interpreter runs only where a test calls it)
    if torch.cuda.is_available():
        kv = kv.cuda()
        assert cs.runs(kv, True) and not cs.runs(kv, False)
        assert not cs.runs(kv.expand(2, 3, 32), True)  # prefill: several tokens
        assert not cs.runs(kv.requires_grad_(), True)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,m,overlap", [(16, 2, True), (16, 4, False), (32, 4, True)],
                         ids=["C4-like m 2", "C128-like m 4", "C4 m 4"])
@pytest.mark.parametrize("fp32_bias", [False, True], ids=["bias in the dtype", "fp32 bias"])
def test_the_kernel_can_make_the_state_writes_too(monkeypatch, dtype, head_dim, m, overlap, fp32_bias):
    """WRITES_STATE (`compressor_step`: cos / sin, the entry, the token and the Ca half written by the
    kernel) against closing_entry with the torch writes, step after step: the buffers and prev_* (data
    movement, the bias add as torch's: in bf16, or fp32 where the bias is kept fp32 as a bf16 model
    keeps it) bit for bit, the entries within a bf16 ulp (its cos / sin are the interpreter's, numpy's;
    on a GPU libdevice's, torch's), the scratch slot aside."""
    comp = _compressor(head_dim, m, overlap, dtype)
    if fp32_bias:
        comp.position_bias.data = comp.position_bias.data.float()
    lengths = [0, 1, m - 1, m, 2 * m + 1]
    monkeypatch.setattr(cs, "WRITES_STATE", False)
    ref = _run(comp, lengths, 2 * m + 1, True)
    monkeypatch.setattr(cs, "WRITES_STATE", True)
    ours = _run(comp, lengths, 2 * m + 1, True)
    real = slice(0, len(lengths))
    for a, b in zip(ours, ref):
        assert torch.equal(a.buf_kv[real], b.buf_kv[real]) and torch.equal(a.buf_gate[real], b.buf_gate[real])
        if overlap:
            assert torch.equal(a.prev_kv[real], b.prev_kv[real]) and torch.equal(a.prev_gate[real], b.prev_gate[real])
        torch.testing.assert_close(a.entries[real].float(), b.entries[real].float(), rtol=2 ** -7, atol=2 ** -8)
    assert ours[-1].entries[real].abs().sum() > 0
