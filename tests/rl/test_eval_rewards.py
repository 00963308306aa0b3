"""Each eval set is scored by its own reward, not the run's training reward (issue 14 item 2)."""

import json
from types import SimpleNamespace

import pytest

from lockstep.rl.config import RunConfig
from lockstep.rl.evaluate import evaluate
from lockstep.rl.rewards import get_reward_fn, natural_reward
from lockstep.rl.rollout import RolloutSpec
from lockstep.rl.setup import eval_sets
from lockstep.sample import Sample

# MATH-500 writes 1/2 as \frac12 in places; DAPO's string match cannot equate it with \frac{1}{2}
ANSWER, LABEL = "So the probability is \\boxed{\\frac{1}{2}}.\nAnswer: \\frac{1}{2}", "\\frac12"


class EchoEngine:
    """Every sample of every prompt answers ANSWER."""

    tokenizer = SimpleNamespace(encode=lambda text: [1, 2], chat_template=None)

    def generate(self, requests):
        return [Sample(prompt_ids=r.prompt_ids, response_ids=[3], rollout_logprobs=[-0.5], group_id=r.group_id,
                       metadata={**r.metadata, "text": ANSWER}, finish_reason="stop")
                for r in requests for _ in range(r.sampling.n)]


@pytest.fixture
def math500_file(tmp_path):
    path = tmp_path / "math500" / "test.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps({"problem": "A fair coin lands heads with what probability?", "answer": LABEL}) + "\n")
    return path


def pass_at_1(run: RunConfig) -> dict[str, float]:
    metrics = evaluate(EchoEngine(), eval_sets(run)[0], RolloutSpec(2, 1.0, 1.0, 8, False, 0))
    return {k.split("/")[1]: v for k, v in metrics.items() if k.endswith("/pass@1")}


def test_the_example_is_one_dapo_gets_wrong_and_math_verify_right():
    assert get_reward_fn("dapo")(ANSWER, LABEL) == 0.0 and get_reward_fn("math")(ANSWER, LABEL) == 1.0


def test_math500_in_a_dapo_run_is_scored_by_math_verify(math500_file):
    run = RunConfig(rm_type="dapo", eval_data=("math500", str(math500_file)))
    assert run.eval_sets == [("math500", str(math500_file), "math")]
    assert pass_at_1(run) == {"math500": 1.0}


def test_known_path_under_another_name_and_unknown_sets(math500_file, tmp_path):
    other = tmp_path / "mine.jsonl"
    other.write_text(math500_file.read_text())
    run = RunConfig(rm_type="dapo", eval_data=("held", str(math500_file), "mine", str(other)))
    assert [reward for _, _, reward in run.eval_sets] == ["math", "dapo"]  # by path; else the run's reward
    assert pass_at_1(run) == {"held": 1.0, "mine": 0.0}


def test_explicit_rm_wins_over_the_natural_checker(math500_file):
    run = RunConfig(rm_type="math", eval_data=("math500:dapo", str(math500_file)))
    assert run.eval_sets == [("math500", str(math500_file), "dapo")]
    assert pass_at_1(run) == {"math500": 0.0}  # the metric keeps the set's NAME


def test_natural_rewards_of_the_known_sets():
    assert natural_reward("math500") == natural_reward("AIME-2024") == "math"
    assert natural_reward("gsm8k_test") == natural_reward("x", "../shared/data/gsm8k/test.jsonl") == "gsm8k"
    assert natural_reward("x", "../shared/data/dapo_math_17k/dapo_math_17k.parquet") == "dapo"
    assert natural_reward("arithmetic") == "arithmetic" and natural_reward("held", "data/held.jsonl") is None


@pytest.mark.parametrize("data, match", [(("a:", "p"), "RM after ':'"), (("a:nope", "p"), "RM after ':'"),
                                         (("a", "p", "a:math", "q"), "distinct")])
def test_bad_eval_data_names_the_field(data, match):
    with pytest.raises(ValueError, match=f"RunConfig.eval_data: .*{match}"):
        RunConfig(eval_data=data)


def test_train_and_eval_commands_parse_name_rm(math500_file):
    from lockstep.cli import build_parser
    from lockstep.cli_args import dataclass_from_args
    from lockstep.commands.train import configs_from_args

    argv = ["--rm-type", "dapo", "--eval-data", "math500", str(math500_file), "g:gsm8k", str(math500_file)]
    run, _, _ = configs_from_args(build_parser(["train"]).parse_args(["train", *argv]))
    evaluated = dataclass_from_args(RunConfig, build_parser(["eval"]).parse_args(["eval", *argv]))
    assert [s[2] for s in run.eval_sets] == [s[2] for s in evaluated.eval_sets] == ["math", "gsm8k"]
