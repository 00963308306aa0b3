"""`lockstep eval` tells a broken setup from a weak model (issue 15 item 8): a summary of each set,
a few completions with label and reward, and a warning when most reward calls fail. Eval sets get
their own reward (NAME:RM, else the data set's checker by name or path, else --rm-type), so a
mismatch is now an explicit NAME:RM, or a set lockstep does not know scored by a --rm-type (default
arithmetic) that cannot read its labels: every call fails and pass@1 was a bare 0.0."""

import json

import pytest

from lockstep.cli import main


def _write(path, labels):
    rows = [{"prompt": f"What is {i} + 1?", "label": label} for i, label in enumerate(labels)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _eval(tmp_path, capsys, name, labels, *extra):
    file = _write(tmp_path / "mine.jsonl", labels)
    argv = ["eval", "--eval-data", name, str(file), "--n-samples-per-eval-prompt", "2",
            "--eval-max-response-len", "4", *extra]
    assert main(argv) == 0
    captured = capsys.readouterr()
    return file, captured.out, captured.err


@pytest.mark.parametrize("name, extra", [
    ("mine", ()),  # unknown set: the run's --rm-type, arithmetic by default
    ("mine:arithmetic", ()),  # the reward named explicitly
])
def test_mismatched_reward_warns_loudly(tmp_path, capsys, name, extra):
    file, out, err = _eval(tmp_path, capsys, name, ["\\frac{1}{2}", "seven", "x = 3", "#### 4"], *extra)
    assert "WARNING: mine: 8 of 8 reward calls failed (100%)" in err
    assert "Reward 'arithmetic' on label '\\\\frac{1}{2}': ValueError" in err and "--eval-data mine:RM PATH" in err
    assert "eval/mine/reward_errors                  8.0000" in out


def test_weak_model_shows_summary_and_samples_without_warning(tmp_path, capsys):
    file, out, err = _eval(tmp_path, capsys, "mine", [str(i + 1) for i in range(4)])
    assert "WARNING" not in err
    assert "model " in out and f"mine: 4 prompts from {file} x 2 samples" in out
    assert "scored by reward arithmetic" in out and "mine: 8 completions in" in out
    assert "0 of 8 reward calls failed" in out
    lines = out.splitlines()
    shown = [i for i, line in enumerate(lines) if line.startswith("  prompt ")]
    assert len(shown) == 3 and "label '1'" in lines[shown[0]]
    assert all(lines[i + 1].startswith("    completion (") and ", reward " in lines[i + 1] for i in shown)


def test_eval_shows_a_bar_of_the_prompts_done(monkeypatch, capsys):
    from lockstep.rl import progress

    seen = []

    class Counting:  # what prompts_bar yields, counted: one tick per prompt of the set, its total known
        def __init__(self, name, total):
            seen.append([name, total, 0])

        def __enter__(self):
            return lambda: seen[-1].__setitem__(2, seen[-1][2] + 1)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(progress, "prompts_bar", Counting)
    assert main(["eval", "--n-samples-per-eval-prompt", "2", "--eval-max-response-len", "4",
                 "--eval-prompts-limit", "6"]) == 0
    assert seen == [["arithmetic", 6, 6]]
