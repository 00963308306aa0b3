"""--max-prompt-len: training and held-out prompts longer than N tokens, as the engine encodes them
(chat template included), are left out at the start, counted, printed and logged (rl/long_prompts.py);
without it a prompt too long for the engine stops the run naming its file and line and the flag."""

import json
import re

import pytest

from lockstep.cli import main
from lockstep.metrics.sinks import read_metrics
from lockstep.models.tokenizer import load_tokenizer
from lockstep.prompt_encoding import encode_prompt
from lockstep.rl.config import RunConfig
from lockstep.rl.data import DataError, Prompt
from lockstep.rl.embedded import ASSET_DIR
from lockstep.rl.long_prompts import without_long_prompts
from lockstep.rl.setup import eval_sets

LONG = "What is " + " + ".join(["1"] * 40) + "?"


def rows(questions):
    return "".join(json.dumps({"prompt": q, "label": "2"}) + "\n" for q in questions)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ASSET_DIR)


def test_the_limit_counts_the_chat_template(tokenizer):
    prompts = [Prompt(prompt=q, label="", index=i) for i, q in enumerate(["What is 1 + 1?", LONG, "What is 2 + 2?"])]
    plain = len(encode_prompt(tokenizer, prompts[0].prompt, chat_template=False))
    templated = len(encode_prompt(tokenizer, prompts[0].prompt, chat_template=True))
    assert templated > plain
    kept, dropped = without_long_prompts(prompts, tokenizer, True, templated)
    assert [p.index for p in kept] == [0, 2] and dropped == 1
    kept, dropped = without_long_prompts(prompts, tokenizer, True, templated - 1)  # the template's tokens count
    assert kept == [] and dropped == 3
    assert without_long_prompts(prompts, tokenizer, False, plain)[0] == [prompts[0], prompts[2]]
    assert without_long_prompts(prompts, None, True, 0) == (prompts, 0)  # 0: off, nothing encoded


def test_eval_sets_leave_long_prompts_out_before_the_limit(tmp_path, tokenizer):
    held = tmp_path / "held.jsonl"
    held.write_text(rows([LONG, "What is 1 + 1?", LONG, "What is 3 + 3?", "What is 4 + 4?"]))
    run = RunConfig(eval_data=["held", str(held)], eval_prompts_limit=2, max_prompt_len=40)
    sets, left_out = eval_sets(run, [], tokenizer)
    assert left_out["long_prompts/held"] == 2
    assert [p.prompt for p in sets["held"].prompts] == ["What is 1 + 1?", "What is 3 + 3?"]
    with pytest.raises(DataError, match="held.*every prompt is longer than --max-prompt-len 5 tokens"):
        eval_sets(RunConfig(eval_data=["held", str(held)], max_prompt_len=5), [], tokenizer)


def train_args(tmp_path, *extra):
    data, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    data.write_text(rows(["What is 1 + 1?", LONG, "What is 3 + 3?", LONG, LONG]))
    held.write_text(rows(["What is 5 + 5?", LONG.replace("1", "2"), "What is 6 + 6?"]))
    return ["train", "--prompt-data", str(data), "--eval-data", "held", str(held), "--num-rollout", "1",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
            "--n-samples-per-eval-prompt", "1", "--eval-max-response-len", "4", "--max-model-len", "48",
            "--run-dir", str(tmp_path / "run"), "--no-plot", *extra]


def test_a_run_drops_long_prompts_and_says_how_many(tmp_path, capsys):
    # without the flag the first long prompt drawn stops the run, naming its line and the way out
    assert main(train_args(tmp_path)) == 2
    assert re.search(r"\.jsonl, line \d: prompt of \d+ tokens.*--max-model-len.*--max-prompt-len",
                     capsys.readouterr().err)
    assert main(train_args(tmp_path, "--max-prompt-len", "40")) == 0
    out = capsys.readouterr().out
    assert "train: 3 prompts are longer than --max-prompt-len" in out
    assert "held: 1 prompts are longer than --max-prompt-len" in out
    first = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert first["data/long_prompts/train"] == 3.0 and first["data/long_prompts/held"] == 1.0


def test_the_limit_must_leave_room_for_a_response(tmp_path, capsys):
    assert main(train_args(tmp_path, "--max-prompt-len", "48")) == 2
    assert "--max-prompt-len 48 leaves no room for a response in the engine's context (--max-model-len 48)" in (
        capsys.readouterr().err)
    with pytest.raises(ValueError, match="RunConfig.max_prompt_len: must be >= 0"):
        RunConfig(max_prompt_len=-1)


def test_lockstep_eval_drops_them_too(tmp_path, capsys):
    held = tmp_path / "held.jsonl"
    held.write_text(rows(["What is 5 + 5?", LONG, "What is 6 + 6?"]))
    args = ["eval", "--eval-data", "held", str(held), "--n-samples-per-eval-prompt", "1", "--eval-max-response-len",
            "4", "--max-model-len", "48"]
    assert main(args) == 2 and "--max-prompt-len" in capsys.readouterr().err
    assert main(args + ["--max-prompt-len", "40"]) == 0
    out = capsys.readouterr().out
    assert "held: 1 prompts are longer than --max-prompt-len" in out and "2 prompts" in out
