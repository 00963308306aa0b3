"""A decode step's core attention as one Triton kernel (step_attention_triton.py) against the torch
form it replaces (sink_attention.sink_attention) and fp64. The kernel runs under Triton's interpreter
here (TRITON_INTERPRET=1, set in conftest.py); LOCKSTEP_TEST_DEVICE=cuda runs the same tests on a GPU."""

import os

import pytest
import torch

from lockstep.models.layers import step_attention_triton as sa
from lockstep.models.layers.sink_attention import sink_attention

needs_triton = pytest.mark.skipif(sa.triton is None, reason="triton is not installed")
DEVICE = "cuda" if os.environ.get("LOCKSTEP_TEST_DEVICE") == "cuda" else "cpu"
# the GPU kernel takes bf16 only (an fp32 tl.dot would multiply in tf32); the interpreter both
DTYPES = [torch.bfloat16] if DEVICE == "cuda" else [torch.bfloat16, torch.float32]


def _inputs(seed, N, H, D, Sk, dtype, masked=0.4):
    """q [N, 1, H, D], keys [N, Sk, D], a 0 / -inf bias [N, 1, Sk] hiding ~`masked` of the keys, sinks [H]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(N, 1, H, D, generator=g).to(dtype)
    kv = torch.randn(N, Sk, D, generator=g).to(dtype)
    bias = torch.zeros(N, 1, Sk).masked_fill(torch.rand(N, 1, Sk, generator=g) < masked, float("-inf"))
    sinks = torch.randn(H, generator=g)
    return [t.to(DEVICE) for t in (q, kv, bias, sinks)]


def _fp64(q, kv, bias, sinks, scale):
    return sink_attention(q.double(), kv.double(), bias.double(), sinks.double(), scale)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
# the 1b config's window layer (129 keys padded to 136: three tiles, the last partial); fewer keys than a
# tile; H below the 16 rows a tensor-core tile takes; another head dim
@pytest.mark.parametrize("N,H,D,Sk", [(3, 16, 128, 136), (2, 16, 128, 40), (2, 4, 64, 70)])
def test_the_kernel_equals_the_torch_form(dtype, N, H, D, Sk):
    q, kv, bias, sinks = _inputs(N * H + Sk, N, H, D, Sk, dtype)
    scale = D ** -0.5
    out = sa.sink_attention_step(q, kv, bias, sinks, scale)
    ref = sink_attention(q, kv, bias, sinks, scale)
    assert out.shape == ref.shape and out.dtype == dtype
    exact = _fp64(q, kv, bias, sinks, scale)
    if dtype == torch.float32:  # fp32 sums in another order
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    else:  # rounded where the torch form rounds: within a bf16 ulp of it, and as close to fp64
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=2 ** -9)
        assert (out.double() - exact).abs().max() <= 1.5 * (ref.double() - exact).abs().max()


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_that_sees_no_key_is_the_sink_alone(dtype):
    # every key masked: the sink takes all the mass and the output is exactly zero, not NaN
    q, kv, bias, sinks = _inputs(5, 2, 16, 128, 72, dtype)
    bias[1] = float("-inf")
    out = sa.sink_attention_step(q, kv, bias, sinks, 0.1)
    assert torch.isfinite(out).all() and (out[1] == 0).all() and (out[0] != 0).any()


@needs_triton
def test_a_large_score_does_not_overflow():
    # the running max starts at the sink and follows the scores: exp never sees a large argument
    q, kv, bias, sinks = _inputs(7, 2, 16, 128, 100, DTYPES[0], masked=0.0)
    q = q * 30
    out = sa.sink_attention_step(q, kv, bias, sinks, 1.0)
    ref = sink_attention(q, kv, bias, sinks, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=2 ** -9)


def test_the_kernel_runs_only_for_a_decode_step_without_gradients_on_cuda():
    q = torch.zeros(2, 1, 16, 128, dtype=torch.bfloat16)
    kv = torch.zeros(2, 40, 128, dtype=torch.bfloat16)
    assert not sa.runs(q, kv, True)  # CPU: torch ops (the interpreter runs only where a test calls it)
    if torch.cuda.is_available():
        q, kv = q.cuda(), kv.cuda()
        assert sa.runs(q, kv, True) and not sa.runs(q, kv, False)
        assert not sa.runs(q.expand(2, 3, 16, 128), kv, True)  # prefill: several positions
        assert not sa.runs(q.float(), kv.float(), True)
        assert not sa.runs(q.requires_grad_(), kv, True)


def test_off_the_kernel_step_attention_is_the_torch_form():
    q, kv, bias, sinks = (t.cpu() for t in _inputs(3, 2, 16, 128, 40, torch.float32))
    assert torch.equal(sa.step_attention(q, kv, bias, sinks, 0.2, True), sink_attention(q, kv, bias, sinks, 0.2))


@needs_triton
def test_compiled_callers_get_the_kernels_result():
    # the op is opaque to torch.compile (its fake computes the shape): a compiled decode step calls it as is
    q, kv, bias, sinks = _inputs(11, 2, 16, 128, 64, DTYPES[0])
    compiled = torch.compile(sa.sink_attention_step, backend="eager", fullgraph=True)
    assert torch.equal(compiled(q, kv, bias, sinks, 0.3), sa.sink_attention_step(q, kv, bias, sinks, 0.3))
