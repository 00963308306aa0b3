"""End to end on the CPU: generate, reward, train, push weights, evaluate, save and resume."""

import json

import pytest

from lockstep.cli import main
from lockstep.commands.sft import _new_embedded_model
from lockstep.metrics.sinks import read_metrics
from lockstep.models import save_pretrained
from lockstep.rl.embedded import ASSET_DIR


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    model, tok = _new_embedded_model(0)
    save_pretrained(model, d)
    tok.save_pretrained(d)
    return d


def train(model_dir, run_dir, *extra):
    args = ["train", "--model", str(model_dir), "--num-rollout", "4", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "4", "--rollout-max-response-len", "4", "--eval-interval", "2",
            "--n-samples-per-eval-prompt", "2", "--eval-max-response-len", "4", "--eval-prompts-limit", "4",
            "--lr", "1e-3", "--use-tis", "--serving-format", "bf16", "--max-num-seqs", "16", "--max-model-len", "48",
            "--run-dir", str(run_dir), "--no-plot", *extra]
    assert main(args) == 0
    return {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl")}


def comparable(record):
    return {k: v for k, v in record.items() if not k.startswith(("perf/", "data/"))}


def test_loop_runs_saves_and_resumes_identically(tiny_model_dir, tmp_path):
    full = train(tiny_model_dir, tmp_path / "full", "--save", str(tmp_path / "ckpt"), "--save-interval", "2")
    assert sorted(full) == [0, 1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        m = full[step]
        assert m["rollout/num_samples"] == 8
        assert "train/train_rollout_logprob_abs_diff" in m and "train/tis" in m
        assert m["perf/weight_sync_time"] >= 0
    assert "eval/arithmetic/pass@1" in full[0] and "eval/arithmetic/pass@2" in full[2]
    state = json.loads((tmp_path / "ckpt" / "loop_state.json").read_text())
    assert state["rollout_id"] == 4 and state["weight_version"] == 4

    # resume from the save made after rollout 2 (keep a copy: the full run overwrote ckpt at 4)
    resumed_dir = tmp_path / "resumed"
    first_half = train(tiny_model_dir, tmp_path / "half", "--num-rollout", "2", "--save", str(tmp_path / "ckpt2"))
    assert comparable(first_half[2]) == comparable(full[2])
    resumed = train(tiny_model_dir, resumed_dir, "--load", str(tmp_path / "ckpt2"))
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert comparable(resumed[step]) == comparable(full[step])

    # resumed in its own run directory, where a kill cut the step-3 record short: each step once
    with open(tmp_path / "half" / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rollout/raw_reward": 0.')
    train(tiny_model_dir, tmp_path / "half", "--load", str(tmp_path / "ckpt2"))
    records = read_metrics(tmp_path / "half" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert [comparable(r) for r in records] == [comparable(full[step]) for step in range(5)]


def test_a_save_cut_short_leaves_the_previous_save_whole(tiny_model_dir, tmp_path, monkeypatch):
    from lockstep.train import checkpointing

    unbroken = train(tiny_model_dir, tmp_path / "unbroken", "--num-rollout", "2")
    ckpt, real_save = tmp_path / "ckpt", checkpointing.save_weights

    def dies_in_the_second_save(named, path):
        if "step-2.saving" in str(path):  # the save after rollout 2: half a file, then the process dies
            path.write_bytes(b"\0" * 64)
            raise KeyboardInterrupt
        real_save(named, path)

    monkeypatch.setattr(checkpointing, "save_weights", dies_in_the_second_save)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_model_dir, tmp_path / "killed", "--num-rollout", "2", "--save", str(ckpt), "--save-interval", "1")
    monkeypatch.setattr(checkpointing, "save_weights", real_save)
    # the save after rollout 1 is whole (in place it would hold rollout 2's half-written weights)
    assert json.loads((ckpt / "loop_state.json").read_text())["rollout_id"] == 1
    resumed = train(tiny_model_dir, tmp_path / "resumed", "--num-rollout", "2", "--load", str(ckpt),
                    "--save", str(ckpt))
    assert comparable(resumed[2]) == comparable(unbroken[2])
    state = json.loads((ckpt / "loop_state.json").read_text())
    assert state["rollout_id"] == 2  # the killed save's staging reused, the step-1 save gone
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(["loop_state.json", state["step_dir"]])


def test_bad_prompt_file_names_file_and_line(tiny_model_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "What is 1 + 1?", "label": "2"}\n{"prompt": "oops"\n')
    rc = main(["train", "--model", str(tiny_model_dir), "--prompt-data", str(bad), "--run-dir", str(tmp_path / "r")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "bad.jsonl" in err and "line 2" in err


def test_skip_bad_rows_counts_and_logs(tiny_model_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    good = [f'{{"prompt": "What is {i} + {i}?", "label": "{2 * i}"}}' for i in range(10, 14)]
    data.write_text("\n".join(good[:2] + ['{"prompt": 5}', "not json"] + good[2:]) + "\n")
    held = tmp_path / "held.jsonl"  # its own prompts: a held-out set loses those it shares with training
    held.write_text('{"prompt": "What is 20 + 20?", "label": "40"}\n')
    metrics = train(tiny_model_dir, tmp_path / "run", "--prompt-data", str(data), "--skip-bad-rows",
                    "--num-rollout", "1", "--eval-data", "held", str(held))
    first = metrics[min(metrics)]
    assert first["data/skipped_rows"] == 2


def test_several_steps_per_rollout_clip_against_the_rollout_policy(tmp_path):
    # the bundled warm-started model earns some reward, so advantages (and updates) are non-zero
    metrics = train(ASSET_DIR, tmp_path / "run", "--num-rollout", "1", "--num-steps-per-rollout", "2",
                    "--rollout-batch-size", "4", "--lr", "1e-2", "--eval-interval", "5")
    # the second step's ratio is against the weights before the first step, so it moves off 1
    assert metrics[1]["train/ppo_kl"] != 0.0
