import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lockstep.rl.arithmetic import arithmetic_problem, arithmetic_prompts
from lockstep.rl.data import DataError, Prompt, PromptDataset, PromptSource, get_dotted
from lockstep.rl.rewards import get_reward_fn

DATA = Path("/work/shared/data")
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason="shared data sets not present")


@needs_data
def test_dapo_math_17k_first_rows():
    ds = PromptDataset(DATA / "dapo_math_17k/dapo_math_17k.parquet", "prompt", "reward_model.ground_truth", "extra_info")
    assert len(ds) == 17917 and ds.num_skipped == 0
    first = ds[0]
    assert [p.label for p in ds.prompts[:5]] == ["34", "113", "-3", "3", "37"]
    assert first.source == "DAPO-17k" and first.index == 0 and first.metadata["index"] == 0
    assert first.prompt[0]["role"] == "user" and first.prompt[0]["content"].startswith("In triangle $ABC$")
    assert first.sample_metadata()["label"] == "34"


@needs_data
def test_gsm8k_first_rows_and_reward():
    ds = PromptDataset(DATA / "gsm8k/test.jsonl", "question", "answer")
    assert len(ds) == 1319 and ds.source == "gsm8k"
    assert ds[0].prompt.startswith("Janet\u2019s ducks lay 16 eggs") and ds[0].label.endswith("#### 18")
    assert get_reward_fn("gsm8k")("She makes $18 every day.", ds[0].label) == 1.0


@needs_data
def test_math500_first_rows_and_reward():
    ds = PromptDataset(DATA / "math500/test.jsonl", "problem", "answer")
    assert len(ds) == 500 and ds.source == "math500"
    assert ds[0].label == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert get_reward_fn("math")("$\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$", ds[0].label) == 1.0


def _write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_malformed_jsonl_row_names_file_and_line(tmp_path):
    good = json.dumps({"prompt": "1+1?", "label": 2})
    f = _write_jsonl(tmp_path / "p.jsonl", [good, "", good, '{"prompt": "2+2?", "label": 4'])  # line 4 is cut off
    with pytest.raises(DataError) as err:
        PromptDataset(f)
    assert str(err.value).startswith(f"{f}, line 4:")
    ds = PromptDataset(f, skip_bad_rows=True)
    assert len(ds) == 2 and ds.num_skipped == 1 and ds[1].label == "2"


@pytest.mark.parametrize(
    "row,message",
    [
        ({"prompt": "q"}, "missing key 'label'"),
        ({"prompt": 5, "label": "1"}, "prompt must be"),
        ({"prompt": [{"role": "user"}], "label": "1"}, "prompt must be"),
        ({"prompt": "q", "label": None}, "label must be"),
        ([1, 2], "row must be a JSON object"),
    ],
)
def test_bad_row_kinds(tmp_path, row, message):
    f = _write_jsonl(tmp_path / "p.jsonl", [json.dumps({"prompt": "ok", "label": "1"}), json.dumps(row)])
    with pytest.raises(DataError, match=f"line 2: {message}"):
        PromptDataset(f)


def test_parquet_bad_row_reports_row_index(tmp_path):
    table = pa.table({"question": ["a", "b", "c"], "meta": [{"gt": "1"}, {"gt": None}, {"gt": "3"}]})
    f = tmp_path / "train.parquet"
    pq.write_table(table, f)
    with pytest.raises(DataError, match=r"train.parquet, row index 1: label must be"):
        PromptDataset(f, "question", "meta.gt")
    ds = PromptDataset(f, "question", "meta.gt", skip_bad_rows=True)
    assert [p.index for p in ds] == [0, 2] and ds.num_skipped == 1 and ds.source == tmp_path.name


def test_get_dotted_prefers_literal_key():
    assert get_dotted({"a.b": 1, "a": {"b": 2}}, "a.b") == 1
    assert get_dotted({"a": {"b": 2}}, "a.b") == 2
    with pytest.raises(KeyError):
        get_dotted({"a": {"c": 2}}, "a.b")


def _prompts(n):
    return [Prompt(prompt=f"q{i}", label=str(i), index=i) for i in range(n)]


def test_prompt_source_epochs_are_permutations_and_deterministic():
    src = PromptSource(_prompts(10), seed=3)
    seen = [p.index for p in src.next_batch(4) + src.next_batch(4) + src.next_batch(4)]
    assert sorted(seen[:10]) == list(range(10))  # epoch 0 covers every prompt exactly once
    assert src.epoch == 1 and src.position == 2
    again = PromptSource(_prompts(10), seed=3)
    assert [p.index for p in again.next_batch(12)] == seen
    assert seen[:10] != list(range(10))  # actually shuffled
    assert [p.index for p in PromptSource(_prompts(10), shuffle=False).next_batch(3)] == [0, 1, 2]


def test_prompt_source_resume_continues_with_next_unseen_prompt():
    ref = PromptSource(_prompts(7), seed=11)
    expected = [p.index for p in ref.next_batch(20)]
    first = PromptSource(_prompts(7), seed=11)
    got = [p.index for p in first.next_batch(5)] + [p.index for p in first.next_batch(4)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint round trip
    resumed = PromptSource(_prompts(7), seed=0)
    resumed.load_state_dict(state)
    got += [p.index for p in resumed.next_batch(11)]
    assert got == expected
    with pytest.raises(DataError, match="cannot resume"):
        PromptSource(_prompts(8)).load_state_dict(state)


def test_arithmetic_prompts():
    prompts = arithmetic_prompts(50, seed=5)
    assert prompts == arithmetic_prompts(50, seed=5)
    assert prompts[:10] == arithmetic_prompts(10, seed=5)  # a set of n is a prefix of the set of n + 1
    assert len({p.prompt for p in prompts}) == 50  # distinct
    assert prompts != arithmetic_prompts(50, seed=6)
    for p in prompts:
        a, op, b = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", p.prompt).groups()
        a, b = int(a), int(b)
        assert 10 <= a <= 99 and 10 <= b <= 99 and op in "+-"
        assert int(p.label) == (a + b if op == "+" else a - b) >= 0
    q, ans = arithmetic_problem(0, seed=1, digits=3, operators=("*",))
    a, b = map(int, q[len("What is "):-1].split(" * "))
    assert 100 <= a <= 999 and ans == a * b
    with pytest.raises(ValueError, match="operators"):
        arithmetic_problem(0, operators=("/",))
