"""The trainer's RMSNorm kernels (models/layers/rms_norm_grad_triton.py): values and gradients
against norm.py's eager ops (their autograd) computed in fp64; under Triton's interpreter here
(TRITON_INTERPRET=1, conftest.py), compiled on a GPU with LOCKSTEP_TEST_DEVICE=cuda."""

import pytest
import torch

from devices import DEVICE
from lockstep.models.deepseek_v4 import DeepseekV4ForCausalLM
from lockstep.models.deepseek_v4_init import tiny_config
from lockstep.models.layers import rms_norm_grad_triton as grad_kernels
from lockstep.models.layers.kernel_switch import KernelSwitches, set_kernel_switches
from lockstep.models.layers.norm import RMSNorm, rms_norm
from switched_training import assert_switch_changes_nothing

pytestmark = pytest.mark.skipif(grad_kernels.triton is None, reason="Triton is not installed")


def _eager(x, weight, eps):
    xf = x.double()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else weight.double() * y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("D", [48, 1500])  # one column tile, and two with a partial one (tiles of 1024)
def test_values_and_gradients_equal_the_eager_ops(dtype, weighted, D):
    g = torch.Generator().manual_seed(D)
    x = (torch.randn(2, 9, D, generator=g) * 2).to(DEVICE, dtype).requires_grad_()
    weight = (torch.rand(D, generator=g) + 0.5).to(DEVICE).requires_grad_() if weighted else None  # fp32, as kept
    w = torch.randn(2, 9, D, generator=g).to(DEVICE)
    y = grad_kernels.trained_rms_norm(x, weight, 1e-6)
    leaves = [x] + ([weight] if weighted else [])
    got = torch.autograd.grad((y.float() * w).sum(), leaves)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = _eager(ref_leaves[0], ref_leaves[1] if weighted else None, 1e-6)
    want = torch.autograd.grad((ref * w.double()).sum(), ref_leaves)
    assert y.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: the output's gradient arrives in bf16
    for a, b, leaf in zip(got, want, leaves):
        assert a.dtype == leaf.dtype and a.shape == leaf.shape
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol * b.abs().max().item())


def _dw_reference(x, weight, grad_y):
    xd = x.double()
    return (grad_y.double() * xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + 1e-6)).sum(0)


def test_dw_over_many_shares_equals_the_eager_sum(monkeypatch):
    """d w by its own kernel (rows wider than one tile) where the rows split into several shares of
    several 32-row steps, the last share and the last step ragged, and the columns into full tiles and
    a partial one: each row counted once. (Fewer programs than on a GPU, so that a small batch has
    shares of several steps.)"""
    monkeypatch.setattr(grad_kernels, "DW_PROGRAMS", 40)
    g = torch.Generator().manual_seed(7)
    R, D = 300, 1100
    assert D > grad_kernels.launch_config(D)["BLOCK"]  # not the one-kernel backward
    cfg, shares, per_share = grad_kernels.dw_launch(R, D)
    assert shares > 1 and per_share > cfg["BLOCK_R"] and R % per_share and D % cfg["BLOCK_D"]
    x = torch.randn(R, D, generator=g).to(DEVICE)
    weight = (torch.rand(D, generator=g) + 0.5).to(DEVICE)
    grad_y = torch.randn(R, D, generator=g).to(DEVICE)
    _, dw = grad_kernels.rms_norm_backward(x, weight, grad_y, 1e-6, with_dw=True)
    want = _dw_reference(x, weight, grad_y)
    torch.testing.assert_close(dw.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_kernel_backward_gives_the_dx_kernels_bits_and_dw_over_ragged_shares(monkeypatch, dtype):
    """Rows of one tile: d x and d w's shares in one kernel. Its d x is the d x kernel's (the same
    expressions): bit for bit under the interpreter; compiled, the GPU compiler may contract the two
    kernels' products into FMAs differently (fp32 rounding; seen once in fp32 on an H200, not in bf16).
    Its d w, over shares of whole rows with the last one short, counts each row once (fp64 reference).
    (Fewer programs than on a GPU, so that shares hold many rows.)"""
    monkeypatch.setattr(grad_kernels, "FUSED_PROGRAMS", 8)
    g = torch.Generator().manual_seed(11)
    R, D = 101, 300
    programs, rows = grad_kernels.fused_launch(R)
    assert programs == 8 and rows > 1 and R % rows
    x = (torch.randn(R, D, generator=g) * 2).to(DEVICE, dtype)
    weight = (torch.rand(D, generator=g) + 0.5).to(DEVICE)
    grad_y = torch.randn(R, D, generator=g).to(DEVICE, dtype)
    dx, dw = grad_kernels.rms_norm_backward(x, weight, grad_y, 1e-6, with_dw=True)
    dx_alone, none = grad_kernels.rms_norm_backward(x, weight, grad_y, 1e-6, with_dw=False)
    dx_two, dw_two = grad_kernels.rms_norm_backward(x, weight, grad_y, 1e-6, with_dw=True, one_kernel=False)
    assert none is None and dx.dtype == dtype and dw.dtype == weight.dtype
    for other in (dx_alone, dx_two):
        if DEVICE == "cpu":
            assert torch.equal(dx, other)
        else:  # a few fp32 roundings, or one bf16 rounding where the fp32 values straddle a bf16 half-way point
            torch.testing.assert_close(dx, other, rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-6)
    want = _dw_reference(x, weight, grad_y)
    for got in (dw, dw_two):  # different share sums, the same to fp32 rounding
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_the_modules_take_it_only_when_switched_on():
    norm = RMSNorm(32).to(DEVICE)
    x = torch.randn(4, 32, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    # the default (None): on CUDA, eager ops elsewhere (the interpreter too)
    assert (type(norm(x).grad_fn).__name__ == "TrainedRMSNormBackward") == (DEVICE == "cuda")
    set_kernel_switches(norm, KernelSwitches(triton_norm=False))
    assert type(norm(x).grad_fn).__name__ != "TrainedRMSNormBackward"
    set_kernel_switches(norm, KernelSwitches(triton_norm=True))
    assert type(norm(x).grad_fn).__name__ == "TrainedRMSNormBackward"
    assert type(rms_norm(x, 1e-6, triton=True).grad_fn).__name__ == "TrainedRMSNormBackward"
    with torch.no_grad():
        assert not grad_kernels.applies(x, norm.weight, True)  # no gradient: the engine's eager ops


def test_a_model_with_the_switch_on_trains_as_with_the_eager_norms(monkeypatch):
    """Whole DeepSeek-V4 model (fp32 here, bf16 on a GPU): the loss and every parameter's gradient
    with the kernels equal the eager norms' to the dtype's rounding, and every norm took them."""
    calls = []
    apply = grad_kernels.TrainedRMSNorm.apply
    monkeypatch.setattr(grad_kernels.TrainedRMSNorm, "apply", lambda *a: calls.append(a[1] is None) or apply(*a))
    assert_switch_changes_nothing("triton_norm", seed=5, shape=(1, 24))
    config = tiny_config()
    norms = [m for m in DeepseekV4ForCausalLM(config).modules() if isinstance(m, RMSNorm)]
    assert calls.count(False) == len(norms) and calls.count(True) == config.num_hidden_layers  # + q's per-head norm
