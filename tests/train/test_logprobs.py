"""Logprob definition, micro-batch packing, and split-invariance of the loss and gradients."""

from __future__ import annotations

import pytest
import torch

from lockstep.train.config import TrainConfig
from lockstep.train.logprobs import (forward_packed, microbatch_logits, pack_microbatches, token_logprobs,
                                     token_logprobs_and_entropy)
from lockstep.train.trainer import Trainer
from tests.train.trainer_fixtures import make_samples, tiny_model


def test_token_logprobs_temperature_and_entropy():
    logits = torch.randn(5, 11, dtype=torch.float64) * 3
    targets = torch.tensor([0, 3, 10, 7, 7])
    got = token_logprobs(logits, targets, temperature=0.7)
    p = torch.softmax(logits.float() / 0.7, dim=-1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, p.log()[torch.arange(5), targets], atol=1e-6, rtol=0)
    _, ent = token_logprobs_and_entropy(logits, targets, temperature=0.7)
    torch.testing.assert_close(ent, -(p * p.log()).sum(-1), atol=1e-5, rtol=0)
    assert not ent.requires_grad


def test_pack_microbatches_respects_budget():
    samples = make_samples(7, prompt_len=(2, 5), response_len=(1, 4))
    samples[3].response_ids = torch.arange(30) % 96  # longer than the budget: alone
    samples[3].rollout_logprobs = torch.zeros(30)
    samples[3].loss_mask = torch.ones(30, dtype=torch.int64)
    mbs = pack_microbatches(samples, 12)
    assert [i for mb in mbs for i in mb.indices] == list(range(7))
    for mb in mbs:
        assert mb.num_tokens <= 12 or len(mb.indices) == 1
        assert int(mb.cu_seqlens[-1]) == mb.num_tokens
        assert mb.logit_index.numel() == mb.targets.numel() == int(mb.response_cu_seqlens[-1])
    assert any(mb.indices == [3] for mb in mbs)
    # each response token is predicted by the position just before it
    for mb in mbs:
        torch.testing.assert_close(mb.input_ids[mb.logit_index + 1], mb.targets)
    with pytest.raises(ValueError):
        pack_microbatches(samples, 0)


def test_packed_logits_equal_per_sample_forward():
    model = tiny_model()
    samples = make_samples(3)
    mb = pack_microbatches(samples, 10_000)[0]
    with torch.no_grad():
        packed = microbatch_logits(model, mb, "cpu")
        for j, s in enumerate(samples):
            alone = model(s.tokens.unsqueeze(0))[0, s.prompt_ids.numel() - 1:-1]
            lo, hi = int(mb.response_cu_seqlens[j]), int(mb.response_cu_seqlens[j + 1])
            torch.testing.assert_close(packed[lo:hi], alone, atol=1e-5, rtol=1e-5)


def test_forward_packed_pads_models_without_cu_seqlens():
    class Plain(torch.nn.Module):  # a model that only takes input_ids [B, S]
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids):
            return self.inner(input_ids)

    model = tiny_model()
    ids, cu = torch.randint(0, 96, (9,)), torch.tensor([0, 4, 9])
    with torch.no_grad():
        torch.testing.assert_close(forward_packed(Plain(model), ids, cu), forward_packed(model, ids, cu))


@pytest.mark.parametrize("loss_agg", ["token", "sequence"])
def test_microbatch_split_does_not_change_loss_or_gradients(loss_agg):
    samples = make_samples(6)
    grads, losses = [], []
    for budget in (10_000, 14):
        trainer = Trainer(tiny_model(), TrainConfig(loss_agg=loss_agg, max_tokens_per_gpu=budget, entropy_coef=0.01))
        metrics = trainer.forward_backward(samples)
        losses.append(metrics)
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
    assert losses[0]["train/num_microbatches"] == 1 and losses[1]["train/num_microbatches"] > 2
    for key in ("train/loss", "train/pg_loss", "train/entropy"):
        assert losses[0][key] == pytest.approx(losses[1][key], abs=1e-6)
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-6, rtol=0, msg=n)
