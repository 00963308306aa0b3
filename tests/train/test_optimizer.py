"""MasterAdamW: agrees with torch.optim.AdamW, offload changes nothing, bf16 masters, skips."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lockstep.train import adamw_triton
from lockstep.train.optimizer import MasterAdamW
from launches import launch_arguments


def _net(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    return net.to(dtype)


def _grads(net, seed):
    torch.manual_seed(seed)
    x = torch.randn(5, 8, dtype=next(net.parameters()).dtype)
    net(x).pow(2).sum().backward()


def test_matches_torch_adamw_with_clipping_and_decay():
    ours_net, ref_net = _net(), _net()
    ours = MasterAdamW(ours_net.named_parameters(), lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1)
    decay = [p for p in ref_net.parameters() if p.dim() >= 2]
    no_decay = [p for p in ref_net.parameters() if p.dim() < 2]
    ref = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.98), eps=1e-8, foreach=False)
    for step in range(4):
        _grads(ours_net, step)
        _grads(ref_net, step)
        norm, stepped = ours.step(max_grad_norm=0.5)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_net.parameters(), 0.5)
        ref.step()
        ref.zero_grad()
        assert stepped
        assert abs(norm - float(ref_norm)) < 1e-5
    for p, q in zip(ours_net.parameters(), ref_net.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
    assert ours.slots["0.weight"].aliased  # fp32, not offloaded: no copy


def _close_to_fp32_rounding(got: torch.Tensor, want: torch.Tensor, ulps: int = 32) -> None:
    """Within `ulps` fp32 ulps of the tensor's largest magnitude: the Triton update and torch's fused one
    round (and contract into FMAs) differently on a GPU, and a master that an update brings near zero
    keeps the absolute error of its larger operands (on an H200, 2026-12-04: 2.6 ulps of the scale after
    two steps of the multi-chunk test, 10 after three of the small model's). A wrong formula moves
    elements by far more (a decay term 10% off: ~800 ulps of the scale, caught)."""
    atol = ulps * torch.finfo(torch.float32).eps * want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=atol)


def _op_by_op(w, m, v, g, step, lr, b1, b2, eps, wd):
    """The update of optimizer.py's docstring, one op at a time (MasterAdamW's before the fused kernel)."""
    w.mul_(1 - lr * wd)
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    w.addcdiv_(m, (v.sqrt() / (1 - b2**step) ** 0.5).add_(eps), value=-lr / (1 - b1**step))


def test_fused_update_agrees_with_the_op_by_op_one():
    """bf16 parameters (fp32 masters, rounded back), decay and no decay, clipping: moments and masters
    within fp32 roundings (the kernel fuses and orders its multiply-adds its own way)."""
    net = _net(dtype=torch.bfloat16)
    opt = MasterAdamW(net.named_parameters(), lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1)
    ref = {n: [p.detach().float().clone(), torch.zeros_like(p, dtype=torch.float32),
               torch.zeros_like(p, dtype=torch.float32)] for n, p in net.named_parameters()}
    for step in range(1, 4):
        _grads(net, step)
        grads = {n: p.grad.float() for n, p in net.named_parameters()}
        norm, _ = opt.step(max_grad_norm=0.5)
        inv_scale = torch.tensor((norm + 1e-6) / 0.5 if norm > 0.5 else 1.0, dtype=torch.float32)
        for n, (w, m, v) in ref.items():
            _op_by_op(w, m, v, grads[n] / inv_scale, step, 1e-2, 0.9, 0.98, 1e-8, 0.1 if w.dim() >= 2 else 0.0)
    for n, p in net.named_parameters():
        for ours, theirs in zip((opt.slots[n].master, opt.slots[n].exp_avg, opt.slots[n].exp_avg_sq), ref[n]):
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-10)
        assert torch.equal(p, opt.slots[n].master.to(torch.bfloat16))


def test_offload_gives_the_same_update():
    a_net, b_net = _net(), _net()
    a = MasterAdamW(a_net.named_parameters(), lr=1e-2, weight_decay=0.1)
    b = MasterAdamW(b_net.named_parameters(), lr=1e-2, weight_decay=0.1, offload=True)
    assert not b.slots["0.weight"].aliased and b.slots["0.weight"].master.device.type == "cpu"
    for step in range(3):
        _grads(a_net, step)
        _grads(b_net, step)
        a.step(1.0)
        b.step(1.0)
    for p, q in zip(a_net.parameters(), b_net.parameters()):
        assert torch.equal(p, q)


def test_bf16_params_keep_small_updates_in_fp32_masters():
    net = _net(dtype=torch.bfloat16)
    opt = MasterAdamW(net.named_parameters(), lr=1e-5)
    slot = opt.slots["0.weight"]
    start = slot.master.clone()
    for step in range(3):
        _grads(net, step)
        opt.step()
    assert slot.master.dtype == torch.float32 and not torch.equal(slot.master, start)
    assert torch.equal(slot.param, slot.master.to(torch.bfloat16))


def test_nonfinite_gradient_skips_update():
    net = _net()
    opt = MasterAdamW(net.named_parameters(), lr=1e-2)
    before = copy.deepcopy(net.state_dict())
    _grads(net, 0)
    net[0].weight.grad[0, 0] = float("inf")
    norm, stepped = opt.step(1.0)
    assert not stepped and norm == float("inf") and opt.step_count == 0
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k])
    assert all(p.grad is None for p in net.parameters())
    assert float(opt.slots["0.weight"].exp_avg.abs().sum()) == 0.0


def test_state_dict_round_trip():
    a_net = _net(dtype=torch.bfloat16)
    a = MasterAdamW(a_net.named_parameters(), lr=1e-3)
    _grads(a_net, 0)
    a.step()
    b_net = _net(seed=5, dtype=torch.bfloat16)
    b = MasterAdamW(b_net.named_parameters(), lr=1e-3)
    b.load_state_dict(a.state_dict())
    for name in a.slots:
        for field in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(getattr(a.slots[name], field), getattr(b.slots[name], field))
        assert torch.equal(a.slots[name].param, b.slots[name].param)
    assert b.step_count == 1


def test_grad_norm_of_mixed_dtypes_is_the_fp64_norm_from_one_dtype_groups(monkeypatch):
    """bf16 and fp32 gradients (a bf16 model keeps some parameters in fp32): the fp64 norm of them all,
    each multi-tensor norm called on gradients of one dtype (a mixed list takes torch's per-tensor
    fallback on CUDA: a cast and a reduction per tensor)."""
    net = _net()
    net[0].to(torch.bfloat16)
    net[2].to(torch.bfloat16)
    opt = MasterAdamW(net.named_parameters())
    for p in net.parameters():
        p.grad = torch.randn(p.shape).to(p.dtype)
    calls = []
    foreach_norm = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda ts, *a, **k: calls.append({t.dtype for t in ts}) or
                        foreach_norm(ts, *a, **k))
    want = torch.cat([p.grad.double().flatten() for p in net.parameters()]).norm()
    assert float(opt.grad_norm()) == float(want.float())
    assert sorted(map(sorted, calls), key=str) == [[torch.bfloat16], [torch.float32]]


def test_the_device_side_clip_and_skip_match_torch_and_read_nothing_back():
    """On DEVICE (a GPU with LOCKSTEP_TEST_DEVICE=cuda: the fused kernel's grad_scale and found_inf):
    clipped updates as torch.optim.AdamW after clip_grad_norm_, a non-finite gradient skipped with
    nothing changed, and on CUDA `launch` queues it all without a host read (sync debug mode)."""
    from devices import DEVICE

    ours_net, ref_net = _net().to(DEVICE), _net().to(DEVICE)
    ours = MasterAdamW(ours_net.named_parameters(), lr=1e-2, weight_decay=0.0)
    ref = torch.optim.AdamW(ref_net.parameters(), lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0,
                            foreach=False)
    x = torch.randn(5, 8, device=DEVICE)
    for step in range(3):
        for net in (ours_net, ref_net):
            (net(x * (step + 1)).pow(2).sum() * 10).backward()  # norms well above 0.5: clipped
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_net.parameters(), 0.5)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            pending = ours.launch(0.5)
        finally:
            if DEVICE == "cuda":
                torch.cuda.set_sync_debug_mode(0)
        norm, stepped = ours.finish(pending)
        ref.step()
        ref.zero_grad()
        assert stepped and norm > 0.5 and abs(norm - float(ref_norm)) <= 1e-6 * norm
    for a, b in zip(ours_net.parameters(), ref_net.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    before = [p.detach().clone() for p in ours_net.parameters()]
    for p in ours_net.parameters():
        p.grad = torch.full_like(p, float("nan"))
    norm, stepped = ours.step(0.5)
    assert not stepped and norm != norm and ours.step_count == 3
    assert all(torch.equal(a, b) for a, b in zip(before, ours_net.parameters()))


@pytest.mark.skipif(adamw_triton.triton is None, reason="Triton is not installed")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_triton_update_agrees_with_the_fused_passes(dtype):
    """TrainConfig.triton_adamw: masters and moments as the cast + fused AdamW + write-back passes give
    them, to fp32 rounding, with clipping and decay; a bf16 parameter holds its master rounded; a
    skipped step (non-finite gradient) writes nothing. On DEVICE (the interpreter on the CPU)."""
    from devices import DEVICE

    nets = [_net(dtype=dtype).to(DEVICE) for _ in range(2)]
    opts = [MasterAdamW(net.named_parameters(), lr=1e-2, weight_decay=0.1, triton=triton)
            for net, triton in zip(nets, (False, True))]
    x = torch.randn(5, 8, device=DEVICE, dtype=dtype)
    for step in range(3):
        for net, opt in zip(nets, opts):
            (net(x * (step + 1)).float().pow(2).sum() * 5).backward()
            opt.step(max_grad_norm=0.5)
    for (name, a), b in zip(nets[0].named_parameters(), nets[1].parameters()):
        for want, got in zip(*((o.slots[name].master, o.slots[name].exp_avg, o.slots[name].exp_avg_sq) for o in opts)):
            _close_to_fp32_rounding(got, want)
        assert torch.equal(b, opts[1].slots[name].master.to(dtype))
    before = [p.detach().clone() for p in nets[1].parameters()]
    moments = [s.exp_avg.clone() for s in opts[1].slots.values()]
    for p in nets[1].parameters():
        p.grad = torch.full_like(p, float("inf"))
    assert opts[1].step(0.5)[1] is False
    assert all(torch.equal(a, b) for a, b in zip(before, nets[1].parameters()))
    assert all(torch.equal(a, s.exp_avg) for a, s in zip(moments, opts[1].slots.values()))


@pytest.mark.skipif(adamw_triton.triton is None, reason="Triton is not installed")
def test_one_triton_launch_updates_every_chunk_of_every_tensor_once(monkeypatch):
    """adamw_triton.multi_adamw_ over tensors of several chunks, a ragged last chunk, one exact
    chunk and a tiny one, bf16 parameters written from fp32 masters: each element as the fused
    passes update it, to fp32 rounding; a parameter kept in fp32 beside bf16 ones (the trainer's
    fp32-kept modules) takes a launch of its own, and the sizes that are multiples of 16 one told so
    (ALIGN 16: 16-byte accesses on a GPU)."""
    from devices import DEVICE

    C = adamw_triton.CHUNK
    sizes = (2 * C + 100, 5, C)
    tensor, first, numel = adamw_triton._chunks(sizes, torch.device("cpu"))
    assert tensor.tolist() == [0, 0, 0, 1, 2] and first.tolist() == [0, C, 2 * C, 0, 0]
    assert numel.tolist() == list(sizes)
    g = torch.Generator().manual_seed(3)
    params = [nn.Parameter((torch.randn(n, generator=g) * 0.1).to(DEVICE, torch.bfloat16)) for n in sizes]
    params.append(nn.Parameter(torch.randn(7, generator=g).to(DEVICE)))  # fp32: its own launch, aliased
    opts = [MasterAdamW([(f"p{i}", p.detach().clone().requires_grad_()) for i, p in enumerate(params)], lr=1e-2,
                        weight_decay=0.1, triton=triton) for triton in (False, True)]
    launches = launch_arguments(monkeypatch, adamw_triton, "_adamw_kernel")
    for step in range(2):
        grads = [torch.randn(p.shape, generator=g).to(DEVICE, p.dtype) for p in params]
        for opt in opts:
            for s, grad in zip(opt.slots.values(), grads):
                s.param.grad = grad.clone()
            opt.step(max_grad_norm=0.5)
    # a step: the bf16 parameters of sizes 2C + 100 and 5, then C (aligned), then the fp32 one
    first_step = [(k["P_BF16"], k["ALIGN"], a[4]) for a, k in launches[:3]]  # a[4]: the launch's tensors
    assert sorted(first_step) == [(False, 1, 1), (True, 1, 2), (True, 16, 1)], first_step
    for name in opts[0].slots:
        want, got = opts[0].slots[name], opts[1].slots[name]
        for a, b in ((want.master, got.master), (want.exp_avg, got.exp_avg), (want.exp_avg_sq, got.exp_avg_sq)):
            _close_to_fp32_rounding(b, a)
        assert torch.equal(got.param, got.master.to(got.param.dtype))


@pytest.mark.skipif(adamw_triton.triton is None, reason="Triton is not installed")
def test_a_launch_of_mixed_gradient_dtypes_is_refused_by_name():
    w = [torch.zeros(4), torch.zeros(4)]
    with pytest.raises(ValueError, match=r"one launch takes gradients of one dtype.*torch.bfloat16.*torch.float32"):
        adamw_triton.multi_adamw_(w, [torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4)], [torch.zeros(4)] * 2,
                                  [torch.zeros(4)] * 2, None, step=1, lr=1e-3, betas=(0.9, 0.98), eps=1e-8,
                                  weight_decay=0.0, inv_scale=None, found_inf=torch.zeros(()))
