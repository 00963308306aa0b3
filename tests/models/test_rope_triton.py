"""The trainer's rotary-embedding kernel (models/layers/rope_triton.py): values and gradients
against rope.apply_rope's eager ops (their autograd) computed in fp64; under Triton's interpreter
here (TRITON_INTERPRET=1, conftest.py), compiled on a GPU with LOCKSTEP_TEST_DEVICE=cuda."""

import pytest
import torch

from devices import DEVICE, KERNEL_DTYPES
from lockstep.models.deepseek_v4_config import CSA, SLIDING
from lockstep.models.deepseek_v4_init import tiny_config
from lockstep.models.layers import rope_triton
from lockstep.models.layers.rope import apply_rope, default_inv_freq, rope_cos_sin
from switched_training import assert_switch_changes_nothing

pytestmark = pytest.mark.skipif(rope_triton.triton is None, reason="Triton is not installed")


def _angles(positions, rope_dim):
    cos, sin = rope_cos_sin(default_inv_freq(rope_dim, 10_000.0), positions)
    return cos.to(DEVICE), sin.to(DEVICE)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("case", ["q per head", "kv", "undo (-sin)", "all channels rotate"])
def test_values_and_gradients_equal_the_eager_ops(dtype, case):
    g = torch.Generator().manual_seed(1)
    D, R = (16, 16) if case == "all channels rotate" else (40, 8)
    shape = (2, 7, D) if case == "kv" else (2, 7, 3, D)
    x = (torch.randn(shape, generator=g) * 3).to(DEVICE, dtype).requires_grad_()
    cos, sin = _angles(torch.arange(7).expand(2, 7) + 100, R)
    if case != "kv":
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if case == "undo (-sin)":
        sin = -sin
    assert rope_triton.applies(x, cos, True)
    w = torch.randn(shape, generator=g).to(DEVICE)
    y = rope_triton.rope_with_grad(x, cos, sin)
    (got,) = torch.autograd.grad((y.float() * w).sum(), x)
    x64 = x.detach().double().requires_grad_()
    ref = apply_rope(x64, cos.double(), sin.double())
    (want,) = torch.autograd.grad((ref * w.double()).sum(), x64)
    assert y.dtype == got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    assert torch.equal(y[..., :D - R], x[..., :D - R])  # the channels that do not rotate pass through


def test_other_broadcasts_take_the_eager_ops():
    x = torch.randn(2, 7, 3, 16, device=DEVICE, requires_grad=True)
    cos, sin = _angles(torch.arange(7), 8)  # [7, 4]: no batch axis
    per_head = cos.expand(2, 7, 4).unsqueeze(-2)
    assert not rope_triton.applies(x, cos, True) and not rope_triton.applies(x, per_head, False)
    with torch.no_grad():
        assert not rope_triton.applies(x, per_head, True)  # no gradient wanted
    assert rope_triton.applies(x, per_head, True) == (DEVICE == "cpu")  # fp32: the interpreter only
    assert not rope_triton.applies(x, per_head, None)  # the default: bf16 on CUDA only


def test_a_model_with_the_switch_on_trains_as_with_the_eager_ops(monkeypatch):
    """Whole DeepSeek-V4 model (fp32 here, bf16 on a GPU): loss and gradients as with the eager ops; each attention's q,
    kv and output, each compressor's entries and each indexer's queries took the kernel."""
    calls = []
    apply = rope_triton.RotaryEmbedding.apply
    monkeypatch.setattr(rope_triton.RotaryEmbedding, "apply", lambda *a: calls.append(1) or apply(*a))
    assert_switch_changes_nothing("triton_rope", seed=7, shape=(1, 24))
    config = tiny_config()
    compressed = sum(kind != SLIDING for kind in config.layer_types)  # a compressor each
    indexed = sum(kind == CSA for kind in config.layer_types)  # an indexer each, with its own compressor
    assert len(calls) == 3 * config.num_hidden_layers + compressed + 2 * indexed
