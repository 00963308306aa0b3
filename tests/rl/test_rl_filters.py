from lockstep.rl.filters import filter_zero_std, should_continue_sampling, zero_std_groups
from lockstep.sample import Sample


def _s(group, reward):
    return Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[-0.1], reward=reward, group_id=group)


def test_zero_std_groups_dropped_and_ratio_reported():
    samples = [_s(0, 1.0), _s(0, 1.0), _s(1, 0.0), _s(1, 1.0), _s(2, 0.0), _s(2, 0.0)]
    kept, metrics = filter_zero_std(samples)
    assert [(s.group_id, s.reward) for s in kept] == [(1, 0.0), (1, 1.0)]
    assert metrics == {"rollout/zero_std_ratio": 2 / 3}
    assert zero_std_groups([0.5, 0.5 + 1e-12, 0.1, 0.2], [0, 0, 1, 1]).tolist() == [True, True, False, False]
    assert filter_zero_std([]) == ([], {"rollout/zero_std_ratio": 0.0})


def test_should_continue_sampling():
    assert should_continue_sampling(kept_groups=3, target_groups=8, sampled_groups=10, max_sampled_groups=32)
    assert not should_continue_sampling(kept_groups=8, target_groups=8, sampled_groups=10, max_sampled_groups=32)
    assert not should_continue_sampling(kept_groups=3, target_groups=8, sampled_groups=32, max_sampled_groups=32)
    assert should_continue_sampling(kept_groups=3, target_groups=8, sampled_groups=10**6, max_sampled_groups=None)
