"""Activation recomputation: same names, same gradients, routing recorded once."""

from __future__ import annotations

import copy

import torch

from lockstep.models.deepseek_v4 import Routing
from lockstep.models.deepseek_v4_init import tiny_config
from lockstep.train.config import TrainConfig
from lockstep.train.recompute import apply_recompute, is_recomputed, remove_recompute
from lockstep.train.trainer import Trainer
from tests.train.trainer_fixtures import make_samples, tiny_model


def _loss_and_grads(model, ids, forced=None):
    routing = Routing(forced=forced)
    loss = model(ids, routing=routing).log_softmax(-1).mean()
    loss.backward()
    return routing, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_recompute_keeps_names_and_gradients():
    model = tiny_model(config=tiny_config())  # every layer kind
    wrapped = apply_recompute(copy.deepcopy(model))
    assert is_recomputed(wrapped)
    assert list(wrapped.state_dict()) == list(model.state_dict())
    ids = torch.randint(0, 96, (2, 19))
    r_plain, g_plain = _loss_and_grads(model, ids)
    r_wrapped, g_wrapped = _loss_and_grads(wrapped, ids)
    assert len(r_wrapped.chosen) == len(r_plain.chosen) == model.config.num_hidden_layers  # not twice
    assert torch.equal(r_wrapped.stacked(), r_plain.stacked())
    assert g_plain.keys() == g_wrapped.keys()
    for n in g_plain:
        torch.testing.assert_close(g_wrapped[n], g_plain[n], atol=1e-6, rtol=0, msg=n)
    remove_recompute(wrapped)
    assert not is_recomputed(wrapped)


def test_recompute_with_forced_routing():
    model = tiny_model()
    wrapped = apply_recompute(copy.deepcopy(model))
    ids = torch.randint(0, 96, (2, 11))
    c = model.config
    forced = torch.stack([torch.randperm(c.n_routed_experts)[:c.num_experts_per_tok].sort().values
                          for _ in range(2 * 11 * c.num_hidden_layers)]).view(2, 11, c.num_hidden_layers, -1)
    r_plain, g_plain = _loss_and_grads(model, ids, forced)
    r_wrapped, g_wrapped = _loss_and_grads(wrapped, ids, forced)
    assert torch.equal(r_wrapped.stacked(), forced)
    for n in g_plain:
        torch.testing.assert_close(g_wrapped[n], g_plain[n], atol=1e-6, rtol=0, msg=n)


def test_trainer_step_same_with_and_without_recompute():
    samples = make_samples(4)
    plain = Trainer(tiny_model(), TrainConfig(lr=1e-3))
    recomputed = Trainer(tiny_model(), TrainConfig(lr=1e-3, recompute_activations=True))
    a, b = plain.train_step(samples), recomputed.train_step(samples)
    for k in ("train/loss", "train/grad_norm", "train/entropy"):
        assert abs(a[k] - b[k]) < 1e-6, k
    for (n, x), (_, y) in zip(plain.named_weights(), recomputed.named_weights()):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0, msg=n)
