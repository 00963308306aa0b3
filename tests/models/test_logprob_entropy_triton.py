"""The trainer's fused token logprobs and entropies (models/layers/logprob_entropy_triton.py) against
torch's ops in fp64, values and gradients; and a Trainer step with the switch on against one with it
off. Under Triton's interpreter here (TRITON_INTERPRET=1, conftest.py), compiled on a GPU with
LOCKSTEP_TEST_DEVICE=cuda."""

import pytest
import torch

from devices import DEVICE
from lockstep.models.deepseek_v4 import DeepseekV4ForCausalLM
from lockstep.models.deepseek_v4_init import init_deepseek_v4_, tiny_config
from lockstep.models.layers import logprob_entropy_triton as fused
from lockstep.sample import Sample
from lockstep.train.config import TrainConfig
from lockstep.train.logprobs import token_logprobs
from lockstep.train.trainer import Trainer

pytestmark = [pytest.mark.skipif(fused.triton is None, reason="Triton is not installed"),
              # the interpreter's numpy warns at -inf - -inf in lanes the kernel then masks out
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


def _reference(logits64, targets, temperature):
    """fp64: (logp of targets, entropy -sum p log p, 0 where p is)."""
    log_p = torch.log_softmax(logits64 / temperature, -1)
    p = log_p.exp()
    return log_p.gather(-1, targets[:, None]).squeeze(-1), -(p * torch.where(p > 0, log_p, 0.0)).sum(-1)


@pytest.mark.parametrize("V, temperature", [(1000, 1.0), (9000, 0.7)])  # one tile; three with a partial one
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_values_and_gradients_equal_torchs(V, temperature, entropy_grad):
    g = torch.Generator().manual_seed(V)
    T = 6
    logits = (torch.randn(T, V, generator=g, dtype=torch.float64) * 4).to(DEVICE)
    logits[2, : V // 3] = float("-inf")  # masked entries add nothing, and no NaN
    logits[4] += 80.0  # large logits: the entropy must not cancel
    targets = torch.randint(0, V, (T,), generator=g).to(DEVICE)
    targets[2] = V - 1
    w_logp, w_ent = (torch.randn(T, generator=g, dtype=torch.float64).to(DEVICE) for _ in range(2))

    want_in = logits.clone().requires_grad_()
    want_logp, want_ent = _reference(want_in, targets, temperature)
    (want_logp * w_logp + (want_ent * w_ent if entropy_grad else 0)).sum().backward()

    got_in = logits.float().requires_grad_()
    got_logp, got_ent = fused.token_logprobs_and_entropy(got_in, targets, temperature, entropy_grad)
    assert got_ent.requires_grad == entropy_grad
    (got_logp * w_logp.float() + (got_ent * w_ent.float() if entropy_grad else 0)).sum().backward()

    torch.testing.assert_close(got_logp.double(), want_logp.detach(), rtol=1e-6, atol=4e-6)
    torch.testing.assert_close(got_ent.double(), want_ent.detach(), rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got_in.grad).all()
    torch.testing.assert_close(got_in.grad.double(), want_in.grad, rtol=1e-5, atol=1e-6)


def test_token_logprobs_takes_it_only_where_asked():
    logits = torch.randn(3, 50, device=DEVICE)
    targets = torch.tensor([1, 2, 3], device=DEVICE)
    calls = []
    apply = fused.LogprobEntropy.apply
    fused.LogprobEntropy.apply = lambda *a: calls.append(1) or apply(*a)
    try:
        plain = token_logprobs(logits, targets)
        assert not calls
        torch.testing.assert_close(token_logprobs(logits, targets, fused=True), plain, rtol=1e-6, atol=4e-6)
        assert calls
    finally:
        fused.LogprobEntropy.apply = apply
    assert torch.isnan(fused.token_logprobs_and_entropy(logits, torch.tensor([1, 50, -1], device=DEVICE))[0][1:]).all()
    assert not fused.applies(logits.bfloat16(), True)  # the head's logits are fp32
    # the default (None): CUDA only; the CPU trainer keeps torch's ops even under the interpreter
    assert fused.applies(logits, None) == (DEVICE == "cuda") and not fused.applies(logits, False)


def _gradients(fused_logprobs: bool, true_on_policy: bool = False):
    config = tiny_config()
    model = DeepseekV4ForCausalLM(config)
    init_deepseek_v4_(model, 4)
    model.to(DEVICE)
    trainer = Trainer(model, TrainConfig(lr=1e-3, fused_logprobs=fused_logprobs, true_on_policy=true_on_policy,
                                         entropy_coef=0.01, temperature=0.9))
    g = torch.Generator().manual_seed(5)
    samples = [Sample(prompt_ids=torch.randint(2, config.vocab_size, (5,), generator=g),
                      response_ids=torch.randint(2, config.vocab_size, (n,), generator=g),
                      rollout_logprobs=-torch.rand(n, generator=g) * 3, reward=r, advantages=r)
               for n, r in ((7, 1.0), (4, -1.0))]
    metrics = trainer.forward_backward(samples)
    return trainer, metrics, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def test_a_trainer_with_the_switch_on_steps_as_with_it_off():
    """Loss (with an entropy bonus, temperature 0.9), metrics and gradients as with the eager ops, to
    fp32 rounding; the true-on-policy trainer never takes it (its logprobs are the engine's bits)."""
    off, metrics0, grads0 = _gradients(False)
    on, metrics1, grads1 = _gradients(True)
    assert on.fused_logprobs and not off.fused_logprobs
    for k in ("train/pg_loss", "train/entropy", "train/train_rollout_logprob_abs_diff"):
        assert metrics1[k] == pytest.approx(metrics0[k], rel=1e-5, abs=1e-6), k
    assert grads0.keys() == grads1.keys() and grads0
    for k in grads0:
        torch.testing.assert_close(grads1[k], grads0[k], rtol=1e-4, atol=1e-5 * grads0[k].abs().max().item() + 1e-9,
                                   msg=k)
    assert not _gradients(True, true_on_policy=True)[0].fused_logprobs
