import math

import pytest
import torch

from lockstep.train.losses import entropy_from_logits, gspo_log_ratio, kl_penalty, ppo_policy_loss


def _ppo_case():
    ratio = torch.tensor([0.5, 1.0, 1.5, 1.5, 5.0, 0.5])
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
    return ratio.log().requires_grad_(), adv


def test_ppo_clip_higher_and_dual_clip_hand_values():
    log_ratio, adv = _ppo_case()
    out = ppo_policy_loss(log_ratio, adv, eps_clip=0.2, eps_clip_high=0.28, clip_c=3.0)
    # t0 r=.5,A=1: max(-.5,-.8)=-.5 | t2 r=1.5,A=1: max(-1.5,-1.28)=-1.28 (clipped high at 1.28)
    # t3 r=1.5,A=-1: max(1.5,1.28)=1.5 | t4 r=5,A=-1: max(5,1.28)=5 -> dual clip min(5, 3)=3
    # t5 r=.5,A=-1: max(.5,.8)=.8 (clipped low at 0.8)
    torch.testing.assert_close(out.loss, torch.tensor([-0.5, -1.0, -1.28, 1.5, 3.0, 0.8]))
    torch.testing.assert_close(out.clipfrac, torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 1.0]))
    torch.testing.assert_close(out.dual_clipfrac, torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0]))
    torch.testing.assert_close(out.ppo_kl, -log_ratio.detach())
    out.loss.sum().backward()
    # d(-A r)/d log r = -A r where unclipped; 0 on clipped and dual-clipped tokens.
    torch.testing.assert_close(log_ratio.grad, torch.tensor([-0.5, -1.0, 0.0, 1.5, 0.0, 0.0]))


def test_ppo_without_dual_clip_and_symmetric_eps():
    log_ratio, adv = _ppo_case()
    out = ppo_policy_loss(log_ratio, adv, eps_clip=0.2, clip_c=None)
    torch.testing.assert_close(out.loss, torch.tensor([-0.5, -1.0, -1.2, 1.5, 5.0, 0.8]))


def test_ppo_is_weights_scale_loss():
    log_ratio, adv = _ppo_case()
    w = torch.tensor([2.0, 0.0, 1.0, 1.0, 0.5, 1.0])
    out = ppo_policy_loss(log_ratio, adv, eps_clip_high=0.28, is_weights=w)
    torch.testing.assert_close(out.loss, torch.tensor([-1.0, 0.0, -1.28, 1.5, 1.5, 0.8]))


def test_gspo_value_is_sequence_geometric_mean_and_grad_is_per_token():
    logp = torch.tensor([-1.0, -2.0, -3.0, -1.0, -1.0], requires_grad=True)
    old = torch.tensor([-1.5, -2.0, -2.5, -2.0, -1.0])
    mask = torch.tensor([1, 1, 1, 1, 0])
    cu = torch.tensor([0, 3, 5])
    s = gspo_log_ratio(logp, old, mask, cu)
    # sample 0: mean(0.5, 0, -0.5) = 0; sample 1: only the first token is valid -> 1.0
    torch.testing.assert_close(s.detach(), torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0]))
    torch.exp(s).sum().backward()
    # d exp(sg[s_i] + logp_t - sg[logp_t]) / d logp_t = s_i's ratio
    e = math.e
    torch.testing.assert_close(logp.grad, torch.tensor([1.0, 1.0, 1.0, e, e]))


def test_kl_estimators_hand_values():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([math.log(2)]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([0.5 * math.log(2) ** 2]))
    # k3 = exp(d) - 1 - d with d = ref - logp = -log 2: 0.5 - 1 + log 2
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([math.log(2) - 0.5]))
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl"), torch.tensor([math.log(2) - 0.5]))
    # Huge ref/logp gap: exp(20) is clamped to 10.
    assert kl_penalty(torch.tensor([-30.0]), torch.tensor([-10.0]), "k3").item() == 10.0


def test_low_var_kl_huge_log_ratio_has_finite_loss_and_gradient():
    # ref_logp - logp = 100 > ~88: exp overflowed float32 and the clamp's zero gradient times inf
    # was a NaN gradient (issue 14 item 6); verl clamps the log-ratio to [-20, 20] before exp
    logp = torch.tensor([-100.0, 100.0, -1.0], requires_grad=True)
    ref = torch.tensor([0.0, 0.0, -0.5])
    kl = kl_penalty(logp, ref, "low_var_kl")
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(logp.grad).all()
    assert kl[0].item() == 10.0 and kl[1].item() == 10.0  # both beyond the [-10, 10] bound
    assert logp.grad[2].item() == pytest.approx(1 - math.exp(0.5))  # in range: d k3 / d logp = 1 - exp(d)


def test_entropy_from_logits_stable_and_masked():
    h = entropy_from_logits(torch.tensor([[0.0, 0.0, 0.0, 0.0], [1000.0, 1000.0, -1000.0, -1000.0]]))
    torch.testing.assert_close(h, torch.tensor([math.log(4), math.log(2)]))
    p = torch.tensor([0.5, 0.25, 0.25])
    expected = -(p * p.log()).sum()
    torch.testing.assert_close(entropy_from_logits(p.log() + 7.0), expected)
    logits = torch.tensor([0.0, -math.inf, 0.0], requires_grad=True)
    h = entropy_from_logits(logits)
    torch.testing.assert_close(h, torch.tensor(math.log(2)))
    h.backward()
    assert torch.isfinite(logits.grad).all()
