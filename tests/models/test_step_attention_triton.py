"""A decode step's attention read from the caches in place (step_attention_triton.py) against the
torch form it replaces (DeepseekV4Attention._attend_gathered: the keys gathered and concatenated,
a 0 / -inf bias, sink_attention) in every layer kind, and fp64. The kernel runs under Triton's
interpreter here (TRITON_INTERPRET=1, set in conftest.py); LOCKSTEP_TEST_DEVICE=cuda runs the same
tests on a GPU."""

import copy
import os

import pytest
import torch

from lockstep.models.deepseek_v4 import DeepseekV4ForCausalLM, StepBatch
from lockstep.models.deepseek_v4_config import CSA, HCA, SLIDING
from lockstep.models.deepseek_v4_init import init_deepseek_v4_, tiny_config
from lockstep.models.layers import step_attention_triton as sa
from lockstep.models.layers.sink_attention import sink_attention
from lockstep.models.layers.window_ring import write_window
from compiled_op import compile_op

needs_triton = pytest.mark.skipif(sa.triton is None, reason="triton is not installed")
DEVICE = "cuda" if os.environ.get("LOCKSTEP_TEST_DEVICE") == "cuda" else "cpu"
# the GPU kernel takes bf16 only (an fp32 tl.dot would multiply in tf32); the interpreter both
DTYPES = [torch.bfloat16] if DEVICE == "cuda" else [torch.bfloat16, torch.float32]
# tiny_config: window 8, C4-style rate 2 with index_topk 3 (the indexer really picks), C128-style rate 4.
# Context lengths before the step: the window not yet full (3), just full (7: the step's token is
# position 7 = W - 1), wrapped (13, 20); the step's token closes a block of both rates (19: p + 1 = 20).
LENGTHS = [3, 7, 13, 19, 20]
# the 1b config's attention shapes: 16 heads x 128, window 128, rates 4 / 128, index_topk 16 (< the
# ~40 entries a 160-token context closes, so the picks are a real subset); two tiles of ring
BIG = dict(hidden_size=64, num_attention_heads=16, head_dim=128, q_lora_rank=32, o_groups=4, o_lora_rank=16,
           sliding_window=128, compress_rates={CSA: 4, HCA: 128}, index_topk=16, index_head_dim=32)
BIG_LENGTHS = [5, 127, 140, 160]


def _model(dtype, **overrides):
    model = DeepseekV4ForCausalLM(tiny_config(**overrides))
    init_deepseek_v4_(model, 0, std=0.3)  # scores of order one: the softmax is not flat
    return model.to(dtype).to(DEVICE).eval()


def _filled_cache(model, lengths):
    """A cache holding each sequence's first lengths[i] tokens (one prefill step through the torch form)."""
    N, S = len(lengths), max(lengths)
    cache = model.new_cache(num_slots=N + 1, max_len=S + 8)
    ids = torch.randint(0, model.config.vocab_size, (N, S), generator=torch.Generator().manual_seed(S)).to(DEVICE)
    batch = StepBatch(slots=torch.arange(N, device=DEVICE) + 1,
                      start_pos=torch.zeros(N, dtype=torch.long, device=DEVICE), num_new=torch.tensor(lengths, device=DEVICE))
    with torch.no_grad():
        model.forward_step(ids, batch, cache)
    return cache, batch.slots


def _both_forms(model, layer_idx, lengths, seed=0):
    """One decode step of layer layer_idx's attention from the same caches -> (kernel output, torch
    form output, the kernel's caches, the torch form's caches)."""
    cache, slots = _filled_cache(model, lengths)
    attn = model.model.layers[layer_idx].self_attn
    N = len(lengths)
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(N, 1, model.config.hidden_size, generator=g) * 3).to(attn.q_a_proj.weight.dtype).to(DEVICE)
    batch = StepBatch(slots=slots, start_pos=torch.tensor(lengths, device=DEVICE),
                      num_new=torch.ones(N, dtype=torch.long, device=DEVICE), max_new=1)
    outs, caches = [], []
    for in_cache in (True, False):
        layer_cache = copy.deepcopy(cache.layers[layer_idx])
        with torch.no_grad():
            x = attn._input_projections(h)
            q_res, q, kv, _, _ = attn._project(x, batch.positions)
            if in_cache:  # the kernel reads the step's key from the ring
                write_window(layer_cache.window, batch.slots, batch.positions, batch.valid, batch.num_new, kv,
                             layer_cache.scratch_slot)
                outs.append(attn._attend_in_cache(x, q_res, q, batch, layer_cache))
            else:
                outs.append(attn._attend_gathered(x, q_res, q, kv, batch, layer_cache))
        caches.append(layer_cache)
    return outs[0], outs[1], caches[0], caches[1]


def _assert_close_to_torch_form(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == dtype
    if dtype == torch.float32:  # fp32 sums in another order
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    else:  # rounded where the torch form rounds: within a bf16 ulp of it
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=2 ** -9)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layer_idx", [0, 1, 2], ids=["window", "C4 picked", "C128 closed blocks"])
def test_the_kernel_equals_the_torch_form_in_every_layer_kind(dtype, layer_idx):
    model = _model(dtype)
    assert model.config.layer_types[layer_idx] == (SLIDING, CSA, HCA)[layer_idx]
    out, ref, cache, ref_cache = _both_forms(model, layer_idx, LENGTHS)
    _assert_close_to_torch_form(out, ref, dtype)
    # both wrote the step into the caches alike (the kernel path writes first, then reads)
    for a, b in zip(cache.tensors(), ref_cache.tensors()):
        assert torch.equal(a, b)


@needs_triton
@pytest.mark.parametrize("layer_idx", [0, 1, 3], ids=["window", "C4 picked", "C128 closed blocks"])
def test_the_kernel_equals_the_torch_form_at_the_1b_configs_shapes(layer_idx):
    model = _model(torch.bfloat16, **BIG, layer_types=(SLIDING, CSA, CSA, HCA))
    out, ref, _, _ = _both_forms(model, layer_idx, BIG_LENGTHS, seed=1)
    _assert_close_to_torch_form(out, ref, torch.bfloat16)


def _attend(q, keys, sinks, scale):
    """sink_attention of one sequence's token q [1, 1, H, D] over exactly `keys` [Sk, D]."""
    return sink_attention(q, keys[None], torch.zeros(1, 1, len(keys), device=keys.device), sinks, scale)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_picked_entries_are_read_through_their_indices(dtype):
    # the kernel against sink_attention over exactly the picked entries and the seen ring rows
    g = torch.Generator().manual_seed(3)
    N, H, D, W, cap = 3, 4, 16, 8, 12
    q, sinks = torch.randn(N, 1, H, D, generator=g).to(dtype).to(DEVICE), torch.randn(H, generator=g).to(DEVICE)
    ring, entries = (torch.randn(N + 1, r, D, generator=g).to(dtype).to(DEVICE) for r in (W, cap))
    slots, positions = torch.tensor([2, 0, 3], device=DEVICE), torch.tensor([[4], [30], [9]], device=DEVICE)
    picks = torch.tensor([[[5, -1, 0]], [[11, 3, 7]], [[-1, -1, -1]]], device=DEVICE)
    out = sa.sink_attention_step(q, ring, slots, positions, sinks, 0.25, entries, picks)
    for n in range(N):
        seen = ring[slots[n], :min(W, int(positions[n]) + 1)]
        chosen = entries[slots[n], picks[n, 0][picks[n, 0] >= 0]]
        _assert_close_to_torch_form(out[n:n + 1], _attend(q[n:n + 1], torch.cat([seen, chosen]), sinks, 0.25), dtype)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_closed_blocks_stop_at_the_position_and_the_capacity(dtype):
    g = torch.Generator().manual_seed(4)
    N, H, D, W, cap, rate = 3, 4, 16, 8, 5, 4
    q, sinks = torch.randn(N, 1, H, D, generator=g).to(dtype).to(DEVICE), torch.randn(H, generator=g).to(DEVICE)
    ring, entries = (torch.randn(N, r, D, generator=g).to(dtype).to(DEVICE) for r in (W, cap))
    positions = torch.tensor([[2], [10], [40]], device=DEVICE)  # 0, 2 and (capped at) 5 closed blocks
    out = sa.sink_attention_step(q, ring, torch.arange(N, device=DEVICE), positions, sinks, 0.3, entries, None, rate)
    for n, closed in enumerate([0, 2, 5]):
        keys = torch.cat([ring[n, :min(W, int(positions[n]) + 1)], entries[n, :closed]])
        _assert_close_to_torch_form(out[n:n + 1], _attend(q[n:n + 1], keys, sinks, 0.3), dtype)


@needs_triton
def test_a_large_score_does_not_overflow():
    # the running max starts at the sink and follows the scores: exp never sees a large argument
    g = torch.Generator().manual_seed(7)
    q = (torch.randn(2, 1, 16, 128, generator=g) * 30).to(torch.bfloat16)
    ring = torch.randn(2, 64, 128, generator=g).to(torch.bfloat16)
    slots, positions, sinks = torch.arange(2), torch.tensor([[70], [20]]), torch.randn(16, generator=g)
    out = sa.sink_attention_step(*[t.to(DEVICE) for t in (q, ring, slots, positions, sinks)], 1.0)
    bias = torch.zeros(2, 1, 64).masked_fill(torch.arange(64) > positions.view(2, 1, 1), float("-inf"))
    ref = sink_attention(q, ring, bias, sinks, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float().cpu(), ref.float(), rtol=2 ** -7, atol=2 ** -9)


@needs_triton
def test_a_cache_with_strided_rows_is_refused():
    q, ring = torch.zeros(1, 1, 4, 16), torch.zeros(2, 8, 32)[..., ::2]
    with pytest.raises(ValueError, match="ring must be .* contiguous rows"):
        sa.sink_attention_step(q, ring, torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
                               torch.zeros(4), 1.0)


def test_the_kernel_runs_only_for_a_decode_step_without_gradients_on_cuda():
    q = torch.zeros(2, 1, 16, 128, dtype=torch.bfloat16)
    assert not sa.runs(q, True)  # CPU: torch ops (the interpreter runs only where a test calls it)
    if torch.cuda.is_available():
        q = q.cuda()
        assert sa.runs(q, True) and not sa.runs(q, False)
        assert not sa.runs(q.expand(2, 3, 16, 128), True)  # prefill: several positions
        assert not sa.runs(q.float(), True)
        assert not sa.runs(q.requires_grad_(), True)


@needs_triton
def test_compiled_callers_get_the_kernels_result():
    # the op is opaque to torch.compile (its fake computes the shape): a compiled decode step calls it as is
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 1, 16, 128, generator=g).to(DTYPES[0])
    ring, entries = (torch.randn(3, 16, 128, generator=g).to(DTYPES[0]) for _ in range(2))
    args = [t.to(DEVICE) for t in (q, ring, torch.tensor([2, 0]), torch.tensor([[9], [30]]),
                                   torch.randn(16, generator=g))]
    compiled = compile_op(sa.sink_attention_step)
    assert torch.equal(compiled(*args, 0.3, entries.to(DEVICE), None, 4),
                       sa.sink_attention_step(*args, 0.3, entries.to(DEVICE), None, 4))
