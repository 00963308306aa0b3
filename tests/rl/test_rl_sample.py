import math

import pytest
import torch

from lockstep.sample import Sample


def _example(**kw):
    args = dict(prompt_ids=[101, 7, 9, 8, 10], response_ids=[12, 2], rollout_logprobs=[math.log(0.5), math.log(0.25)],
                finish_reason="stop", weight_version=3, group_id=17,
                metadata={"label": "5", "source": "arithmetic", "index": 42})
    args.update(kw)
    return Sample(**args)


def test_worked_example_from_docstring():
    s = _example()
    assert s.prompt_ids.dtype == torch.int64 and s.rollout_logprobs.dtype == torch.float32
    assert s.loss_mask.tolist() == [1, 1]
    assert (s.num_tokens, s.response_len) == (7, 2)
    assert s.tokens.tolist() == [101, 7, 9, 8, 10, 12, 2]
    assert s.reward == 0.0 and s.advantages is None
    s.advantages = 0.87
    torch.testing.assert_close(s.token_advantages(), torch.tensor([0.87, 0.87]))


def test_shape_and_value_checks():
    with pytest.raises(ValueError, match="rollout_logprobs"):
        _example(rollout_logprobs=[-1.0])
    with pytest.raises(ValueError, match="finish_reason"):
        _example(finish_reason="eos")
    with pytest.raises(ValueError, match="routed_experts"):
        _example(routed_experts=torch.zeros(3, 4, 2))
    with pytest.raises(ValueError, match="per-token advantages"):
        _example(advantages=torch.zeros(3))
    s = _example(routed_experts=torch.zeros(2, 4, 6, dtype=torch.int64), advantages=torch.tensor([1.0, -1.0]))
    assert s.routed_experts.dtype == torch.int32 and s.routed_experts.shape == (2, 4, 6)
    assert s.token_advantages().tolist() == [1.0, -1.0]
