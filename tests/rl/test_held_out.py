"""A training run leaves out of its held-out sets the prompts it trains on (lockstep/rl/held_out.py):
MATH-500 and DAPO-Math-17K share 4 problems word for word, and the README's run trains on one and
evaluates on the other. The files here have those sets' layouts (DAPO: a parquet of chat prompts with
reward_model.ground_truth; MATH-500: jsonl of problem / answer)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lockstep.cli import main
from lockstep.metrics.sinks import read_metrics
from lockstep.rl.config import RunConfig
from lockstep.rl.data import DataError, Prompt
from lockstep.rl.held_out import prompt_texts, without_training_prompts
from lockstep.rl.setup import eval_sets, train_prompts

SHARED = ["What is 12 + 30?", "What is 7 * 6?"]
HELD_OUT = ["What is 40 + 2?", "What is 50 - 8?", "What is 84 / 2?"]


@pytest.fixture
def files(tmp_path):
    """DAPO-layout training prompts holding SHARED (the second with its spaces changed) and a
    MATH-500-layout set of SHARED + HELD_OUT."""
    train = [SHARED[0], "What  is 7 *\n6?", "What is 11 + 31?", "What is 6 * 7?"]
    dapo = tmp_path / "dapo_math_17k.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": q}],
                                          "reward_model": {"ground_truth": "42"}} for q in train]), dapo)
    math500 = tmp_path / "math500" / "test.jsonl"
    math500.parent.mkdir()
    rows = [SHARED[0], HELD_OUT[0], SHARED[1], *HELD_OUT[1:]]
    math500.write_text("".join(json.dumps({"problem": q, "answer": "42"}) + "\n" for q in rows))
    return dapo, math500


def test_the_same_words_are_the_same_prompt():
    train = [Prompt(prompt=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
                    label="4", index=0), Prompt(prompt="Solve x  + 1 = 3.", label="2", index=1)]
    held_out = [Prompt(prompt=p, label="", index=i) for i, p in enumerate(
        ["Be brief.\nWhat is 2+2?", "Solve x + 1 = 3.", "Solve x + 1 = 4.", "what is 2+2?"])]
    kept, dropped = without_training_prompts(held_out, prompt_texts(train))
    assert [p.index for p in kept] == [2, 3] and dropped == 2  # case differs: another prompt


def test_eval_sets_leave_training_prompts_out_before_the_limit(files):
    dapo, math500 = files
    run = RunConfig(prompt_data=str(dapo), eval_data=["math500", str(math500)], eval_prompts_limit=2)
    prompts, _ = train_prompts(run)
    sets, left_out = eval_sets(run, prompts)
    assert left_out == {"eval_overlap/math500": 2, "long_prompts/math500": 0}
    assert [p.prompt for p in sets["math500"].prompts] == HELD_OUT[:2]  # the limit takes held-out ones
    every = RunConfig(prompt_data=str(math500), eval_data=["math500", str(math500)])
    with pytest.raises(DataError, match="every prompt is also a training prompt"):
        eval_sets(every, train_prompts(every)[0])


def test_a_run_says_how_many_it_left_out(files, tmp_path, capsys):
    dapo, math500 = files
    assert main(["train", "--prompt-data", str(dapo), "--eval-data", "math500", str(math500), "--num-rollout", "1",
                 "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
                 "--n-samples-per-eval-prompt", "1", "--eval-max-response-len", "4", "--run-dir",
                 str(tmp_path / "run"), "--no-plot"]) == 0
    assert "math500: 2 held-out prompts are training prompts too" in capsys.readouterr().out
    first = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert first["data/eval_overlap/math500"] == 2.0
