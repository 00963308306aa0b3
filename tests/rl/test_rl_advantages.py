import math

import pytest
import torch

from lockstep.rl.advantages import compute_advantages, group_index

REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])


def test_grpo_hand_values():
    # group 0: mean .25, unbiased std .5 ; group 1: mean .5, std sqrt(1/3)
    a = compute_advantages("grpo", REWARDS, group_size=4)
    s = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(a, torch.tensor([1.5, -0.5, -0.5, -0.5, s, s, -s, -s]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compute_advantages("gspo", REWARDS, group_size=4), a)


def test_dr_grpo_and_rloo_hand_values():
    torch.testing.assert_close(compute_advantages("dr_grpo", REWARDS, group_size=4),
                               torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]))
    # RLOO: 1 - mean(0,0,0) = 1 ; 0 - mean(1,0,0) = -1/3 ; 1 - mean(1,0,0) = 2/3 ; 0 - mean(1,1,0) = -2/3
    t = 1 / 3
    torch.testing.assert_close(compute_advantages("rloo", REWARDS, group_size=4),
                               torch.tensor([1.0, -t, -t, -t, 2 * t, 2 * t, -2 * t, -2 * t]))


def test_group_ids_need_not_be_contiguous():
    a = compute_advantages("dr_grpo", [1.0, 2.0, 3.0, 6.0], group_ids=[7, 3, 7, 3])
    torch.testing.assert_close(a, torch.tensor([-1.0, -2.0, 1.0, 2.0]))
    idx, g = group_index(4, group_ids=[7, 3, 7, 3])
    assert g == 2 and idx.tolist() == [1, 0, 1, 0]


def test_degenerate_groups_give_zero_not_nan():
    a = compute_advantages("grpo", [1.0, 1.0, 1.0, 0.5], group_ids=[0, 0, 0, 1])
    torch.testing.assert_close(a, torch.zeros(4))
    torch.testing.assert_close(compute_advantages("rloo", [1.0, 0.5], group_ids=[0, 1]), torch.zeros(2))


def test_reinforce_pp_batch_normalised():
    std = math.sqrt(5 / 3)
    a = compute_advantages("reinforce_pp", [1.0, 2.0, 3.0, 4.0])
    torch.testing.assert_close(a, torch.tensor([-1.5, -0.5, 0.5, 1.5]) / std, atol=1e-5, rtol=1e-5)
    # baseline variant: centred by group [0.5, -0.5, 0, 0], then / batch std sqrt(1/6)
    b = compute_advantages("reinforce_pp_baseline", [1.0, 0.0, 1.0, 1.0], group_size=2)
    r = 0.5 / math.sqrt(1 / 6)
    torch.testing.assert_close(b, torch.tensor([r, -r, 0.0, 0.0]), atol=1e-5, rtol=1e-5)


def test_reinforce_pp_whitens_over_tokens_as_verl():
    # rewards 1, 0, 0 with 1, 3 and 2 valid tokens: the tokens are 1, 0, 0, 0, 0, 0 (issue 14 item 14;
    # per-sample whitening would give 1.1547 and -0.5774). Token mean 1/6, unbiased token variance
    # (25/36 + 5 / 36) / 5 = 1/6, so A = (5/6) / sqrt(1/6) = 2.0412 and (-1/6) / sqrt(1/6) = -0.4082.
    a = compute_advantages("reinforce_pp", [1.0, 0.0, 0.0], token_counts=[1, 3, 2])
    torch.testing.assert_close(a, torch.tensor([2.0412415, -0.4082483, -0.4082483]), atol=1e-5, rtol=1e-5)
    # a sample without valid tokens weighs nothing
    b = compute_advantages("reinforce_pp", [1.0, 0.0, 0.0, 7.0], token_counts=[1, 3, 2, 0])
    torch.testing.assert_close(b[:3], a)


def test_reinforce_pp_baseline_recentres_over_tokens():
    # group-centred [0.5, -0.5, 0, 0] on 2, 1, 1, 3 tokens = 0.5, 0.5, -0.5, 0, 0, 0, 0: the token
    # mean 1/14 is subtracted (verl's masked_whiten shifts the mean), then / the unbiased token std
    tokens = torch.tensor([0.5, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    mean, std = tokens.mean(), tokens.std()
    b = compute_advantages("reinforce_pp_baseline", [1.0, 0.0, 1.0, 1.0], group_size=2, token_counts=[2, 1, 1, 3])
    expected = (torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64) - mean) / std
    assert float(mean) == pytest.approx(1 / 14)
    torch.testing.assert_close(b, expected.float(), atol=1e-5, rtol=1e-5)


def test_token_counts_do_not_change_group_estimators():
    counts = [1, 5, 2, 2, 3, 1, 1, 4]
    for name in ("grpo", "dr_grpo", "rloo"):
        torch.testing.assert_close(compute_advantages(name, REWARDS, group_size=4, token_counts=counts),
                                   compute_advantages(name, REWARDS, group_size=4))


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown advantage"):
        compute_advantages("ppo", REWARDS, group_size=4)
    with pytest.raises(ValueError, match="group_size"):
        compute_advantages("grpo", REWARDS, group_size=3)
