"""Quantisation-aware forward: equals the served model, straight-through gradients, names kept."""

from __future__ import annotations

import copy

import pytest
import torch

from lockstep.quant.serving_format import served_value
from lockstep.quant.formats import Storage
from lockstep.train.config import TrainConfig
from lockstep.train.quant_aware import apply_quant_aware, canonical_name, is_quant_aware, remove_quant_aware
from lockstep.train.trainer import Trainer
from tests.train.trainer_fixtures import make_samples, tiny_model


def _served_copy(model, fmt):
    served = copy.deepcopy(model)
    with torch.no_grad():
        for name, t in served.state_dict(keep_vars=True).items():
            t.data.copy_(served_value(name, t.data, fmt, t.dtype))
    return served


@pytest.mark.parametrize("fmt", ["fp8", "fp8-fp4"])
def test_forward_equals_served_weights_and_gradients_flow(fmt):
    model = tiny_model()
    served = _served_copy(model, fmt)
    qat = apply_quant_aware(copy.deepcopy(model), fmt)
    assert is_quant_aware(qat)
    ids = torch.randint(0, 96, (2, 13))
    out_qat, out_served = qat(ids), served(ids)
    assert torch.equal(out_qat, out_served)
    assert not torch.equal(out_qat, model(ids))
    out_qat.log_softmax(-1).mean().backward()
    out_served.log_softmax(-1).mean().backward()
    served_grads = dict(served.named_parameters())
    for name, p in qat.named_parameters():
        ref = served_grads[canonical_name(name)].grad
        if ref is None:
            assert p.grad is None
            continue
        # straight-through: the master weight gets the served weight's gradient
        torch.testing.assert_close(p.grad, ref, atol=1e-6, rtol=1e-5, msg=name)


def test_expert_storage_follows_format():
    for fmt, storage in (("fp8", Storage.FP8), ("fp8-fp4", Storage.FP4)):
        experts = apply_quant_aware(tiny_model(), fmt).model.layers[0].mlp.experts
        assert experts.parametrizations.gate_up_proj[0].storage == storage
    attn = apply_quant_aware(tiny_model(), "fp8-fp4").model.layers[0].self_attn
    assert attn.q_a_proj.parametrizations.weight[0].storage == Storage.FP8
    assert not hasattr(attn, "parametrizations")  # sinks (fp32) untouched


def test_remove_restores_master_weights():
    model = tiny_model()
    names = list(model.state_dict())
    qat = apply_quant_aware(copy.deepcopy(model), "fp8")
    remove_quant_aware(qat)
    assert list(qat.state_dict()) == names
    for n, t in model.state_dict().items():
        assert torch.equal(qat.state_dict()[n], t)


def test_trainer_quant_aware_matches_served_logprobs_and_trains():
    model = tiny_model()
    samples = make_samples(3)
    trainer = Trainer(copy.deepcopy(model), TrainConfig(quant_aware_forward="fp8-fp4", lr=1e-3))
    reference = Trainer(_served_copy(model, "fp8-fp4"), TrainConfig())
    for a, b in zip(trainer.logprobs(samples), reference.logprobs(samples)):
        assert torch.equal(a, b)
    before = dict((n, t.clone()) for n, t in trainer.named_weights())
    assert trainer.train_step(samples)["train/skipped"] == 0.0
    after = dict(trainer.named_weights())
    assert list(after) == list(model.state_dict())
    moved = [n for n in after if not torch.equal(after[n], before[n])]
    assert "model.layers.0.mlp.experts.gate_up_proj" in moved
