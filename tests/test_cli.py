import subprocess
import sys

import pytest

from lockstep.cli import SUBCOMMANDS, main


def test_help_lists_every_subcommand(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out


def test_console_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "lockstep.cli", "--help"], capture_output=True, text=True, check=True)
    assert "plan" in out.stdout


@pytest.mark.parametrize("flags, message", [
    # each was accepted: top_p failed after the step-0 eval, a limit of -1 dropped the set's last prompt
    (["--rollout-top-p", "1.5"], "RunConfig.rollout_top_p: must be in (0, 1], got 1.5"),
    (["--eval-prompts-limit", "-1"], "RunConfig.eval_prompts_limit: must be >= 0, got -1"),
    (["--save-interval", "-2"], "RunConfig.save_interval: must be >= 0, got -2"),
    (["--eval-temperature", "-1"], "RunConfig.eval_temperature: must be in [0, 100], got -1.0"),
    (["--eval-max-response-len", "0"], "RunConfig.eval_max_response_len: must be >= 1, got 0"),
])
def test_a_bad_run_flag_is_refused_before_the_run(capsys, tmp_path, flags, message):
    assert main(["train", "--num-rollout", "1", "--run-dir", str(tmp_path / "run"), *flags]) == 2
    assert capsys.readouterr().err.strip() == f"lockstep train: error: {message}"
    assert not (tmp_path / "run").exists()  # nothing started
