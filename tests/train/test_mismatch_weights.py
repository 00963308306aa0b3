import math

import pytest
import torch

from lockstep.train.mismatch import (
    importance_weights,
    importance_weights_only,
    mis_weights,
    mismatch_metrics,
    tis_weights,
    train_rollout_kl,
    train_rollout_logprob_abs_diff,
)


def _logs(ratios):
    return torch.tensor([math.log(r) for r in ratios])


def test_abs_diff_is_mean_of_sample_means():
    lt = torch.tensor([-1.0, -2.0, -0.5, -0.5, -0.5])
    lr = torch.tensor([-1.1, -2.3, -0.5, -1.5, -0.5])
    mask = torch.ones(5)
    cu = torch.tensor([0, 2, 5])
    # sample means 0.2 and 1/3; the token mean would be 0.28
    expected = (0.2 + 1 / 3) / 2
    assert train_rollout_logprob_abs_diff(lt, lr, mask, cu).item() == pytest.approx(expected, abs=1e-6)
    as_lists = train_rollout_logprob_abs_diff([lt[:2], lt[2:]], [lr[:2], lr[2:]], [mask[:2], mask[2:]])
    assert as_lists.item() == pytest.approx(expected, abs=1e-6)


def test_abs_diff_ignores_masked_tokens_and_empty_samples():
    lt = torch.tensor([0.0, 0.0, 0.0])
    lr = torch.tensor([-1.0, -5.0, -9.0])
    mask = torch.tensor([1, 0, 0])
    assert train_rollout_logprob_abs_diff(lt, lr, mask, torch.tensor([0, 2, 3])).item() == pytest.approx(1.0)


def test_train_rollout_kl_is_k3_of_rollout_vs_train():
    # delta = logp_train - logp_rollout; k3 = exp(delta) - 1 - delta
    lt = torch.tensor([math.log(2.0), math.log(0.5)])
    lr = torch.zeros(2)
    cu = torch.tensor([0, 1, 2])
    k_a = 2 - 1 - math.log(2)
    k_b = 0.5 - 1 + math.log(2)
    assert train_rollout_kl(lt, lr, torch.ones(2), cu).item() == pytest.approx((k_a + k_b) / 2, abs=1e-6)
    m = mismatch_metrics(lt, lr, torch.ones(2), cu)
    assert set(m) == {"train/train_rollout_logprob_abs_diff", "train/train_rollout_kl"}
    assert m["train/train_rollout_logprob_abs_diff"] == pytest.approx(math.log(2), abs=1e-6)


def test_tis_truncates_and_reports():
    lt = _logs([0.5, 1.0, 3.0, 2.5]).requires_grad_()
    lr = torch.zeros(4)
    mask = torch.tensor([1, 1, 1, 0])
    w, m = tis_weights(lt, lr, mask)
    torch.testing.assert_close(w, torch.tensor([0.5, 1.0, 2.0, 0.0]))
    assert not w.requires_grad
    # Miles' names: tis is the raw ratio pi_train / pi_rollout, before truncation
    assert m["train/tis"] == pytest.approx(4.5 / 3)
    assert m["train/tis_abs"] == pytest.approx(2.5 / 3)
    assert m["train/tis_weight"] == pytest.approx(3.5 / 3)
    assert m["train/tis_clipfrac"] == pytest.approx(1 / 3)
    assert "train/ois" not in m  # pi_theta / pi_old: the trainer's (test_trainer_diagnostics.py)
    assert m["train/ess"] == pytest.approx(3.5**2 / (3 * 5.25))
    w, m = tis_weights(lt, lr, mask, tis_clip_low=0.6)
    torch.testing.assert_close(w, torch.tensor([0.6, 1.0, 2.0, 0.0]))
    assert m["train/tis_clipfrac"] == pytest.approx(2 / 3)


def test_ratio_metrics_are_sample_means():
    # sample 0: one token, ratio 3 (clipped at 2); sample 1: three tokens, ratio 1. Miles averages per
    # sample, then over samples (a token mean would give 1.5 and clipfrac 0.25)
    lt, cu = _logs([3.0, 1.0, 1.0, 1.0]), torch.tensor([0, 1, 4])
    _, m = tis_weights(lt, torch.zeros(4), torch.ones(4), cu)
    assert m["train/tis"] == pytest.approx(2.0) and m["train/tis_clipfrac"] == pytest.approx(0.5)
    assert m["train/tis_weight"] == pytest.approx(1.5) and m["train/tis_abs"] == pytest.approx(1.0)


def test_mis_token_mask():
    w, m = mis_weights(_logs([0.4, 1.0, 3.0, 1.5]), torch.zeros(4), torch.ones(4), level="token", mode="mask")
    torch.testing.assert_close(w, torch.tensor([0.0, 1.0, 0.0, 1.5]))
    assert m["train/tis_clipfrac"] == pytest.approx(0.5)
    assert m["train/tis"] == pytest.approx(5.9 / 4) and m["train/tis_weight"] == pytest.approx(2.5 / 4)


def test_mis_sequence_and_geometric_levels():
    lt, lr, mask = _logs([2.0, 0.75, 3.0, 1.0]), torch.zeros(4), torch.ones(4)
    cu = torch.tensor([0, 2, 4])  # sequence ratios 1.5 and 3.0
    w, _ = mis_weights(lt, lr, mask, cu, level="sequence", mode="mask")
    torch.testing.assert_close(w, torch.tensor([1.5, 1.5, 0.0, 0.0]))
    w, m = mis_weights(lt, lr, mask, cu, level="sequence", mode="truncate")
    torch.testing.assert_close(w, torch.tensor([1.5, 1.5, 2.0, 2.0]))
    assert m["train/ess"] == pytest.approx(3.5**2 / (2 * (1.5**2 + 2.0**2)))  # over samples
    w, _ = mis_weights(lt, lr, mask, cu, level="geometric", mode="mask")
    torch.testing.assert_close(w, torch.tensor([1.5**0.5] * 2 + [3.0**0.5] * 2))


def test_sequence_level_long_response_does_not_overflow():
    lt, lr = torch.ones(200), torch.zeros(200)  # product of ratios = e^200
    w, m = importance_weights(lt, lr, torch.ones(200), level="sequence", mode="truncate", upper=2.0)
    assert torch.isfinite(w).all() and torch.allclose(w, torch.full((200,), 2.0))
    assert m["train/tis"] == pytest.approx(math.e, rel=1e-5)


def test_veto_rejects_whole_sequence():
    lt = _logs([1e-5, 1.0, 1.0, 1.2])
    cu = torch.tensor([0, 2, 4])
    w, m = tis_weights(lt, torch.zeros(4), torch.ones(4), cu, veto_threshold=1e-4)
    torch.testing.assert_close(w, torch.tensor([0.0, 0.0, 1.0, 1.2]))
    assert m["train/tis_veto_frac"] == pytest.approx(0.5)
    # A masked-out tiny ratio does not veto.
    w, m = tis_weights(lt, torch.zeros(4), torch.tensor([0, 1, 1, 1]), cu, veto_threshold=1e-4)
    torch.testing.assert_close(w, torch.tensor([0.0, 1.0, 1.0, 1.2]))
    assert m["train/tis_veto_frac"] == 0.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        importance_weights(torch.zeros(2), torch.zeros(2), torch.ones(2), mode="clip")
    with pytest.raises(ValueError, match="level"):
        importance_weights(torch.zeros(2), torch.zeros(2), torch.ones(2), level="chunk")
    with pytest.raises(ValueError, match="cu_seqlens"):
        tis_weights(torch.zeros(3), torch.zeros(3), torch.ones(3), torch.tensor([0, 2]))


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_the_losss_weights_alone_are_the_weights_with_metrics(level):
    """importance_weights_only (the loss's call, on the logprobs' device, nothing read back) gives
    importance_weights' weights, vetoes included; on DEVICE (a GPU with LOCKSTEP_TEST_DEVICE=cuda)."""
    from devices import DEVICE

    g = torch.Generator().manual_seed(5)
    cu = torch.tensor([0, 4, 9, 15])
    train, rollout = torch.randn(15, generator=g) * 0.3, torch.randn(15, generator=g) * 0.3
    mask = torch.rand(15, generator=g) > 0.2
    config = dict(level=level, mode="mask", lower=0.5, upper=2.0, veto_threshold=0.6)
    want, _ = importance_weights(train, rollout, mask, cu, **config)
    got = importance_weights_only(train.to(DEVICE), rollout.to(DEVICE), mask.to(DEVICE), cu, **config)
    assert got.device.type == torch.device(DEVICE).type
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=0)
    assert (want == 0).any() and (want > 0).any()  # some vetoed or masked, some kept
