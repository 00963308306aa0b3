"""MasterAdamW: agrees with torch.optim.AdamW, offload changes nothing, bf16 masters, skips."""

from __future__ import annotations

import copy

import torch
from torch import nn

from lockstep.train.optimizer import MasterAdamW


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
