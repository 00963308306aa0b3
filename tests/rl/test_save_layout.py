"""A --save directory commits a save by replacing loop_state.json (lockstep/rl/save_layout.py): what a
kill at each point leaves, and what a save does to the directory's other files."""

import json

import pytest

from lockstep.files import FileError
from lockstep.rl import save_layout


def _stage(directory, step, primary=True):
    part = save_layout.begin(directory, step, primary)
    (part / "trainer").mkdir()
    (part / "trainer" / "weights").write_text(str(step))
    (part / "rng.pt").write_text(f"rng {step}")
    return part


def test_a_save_replaces_the_last_and_leaves_the_rest_of_the_directory(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")  # --save may be the run directory
    (tmp_path / "trainer").mkdir()  # a save of the older layout, in the directory itself
    (tmp_path / "rng.pt").write_text("old")
    (tmp_path / "loop_state.json").write_text(json.dumps({"rollout_id": 1}))
    assert save_layout.read(tmp_path)[1] == tmp_path / "."  # the older layout loads
    for step in (2, 3):
        _stage(tmp_path, step)
        save_layout.commit(tmp_path, step, {"rollout_id": step})
    state, base = save_layout.read(tmp_path)
    assert state["rollout_id"] == 3 and (base / "trainer" / "weights").read_text() == "3"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["metrics.jsonl", "loop_state.json", base.name])


def test_a_save_killed_before_its_commit_leaves_the_last_one(tmp_path):
    _stage(tmp_path, 1)
    save_layout.commit(tmp_path, 1, {"rollout_id": 1})
    _stage(tmp_path, 2)  # killed here: staged, not committed
    state, base = save_layout.read(tmp_path)
    assert state["rollout_id"] == 1 and (base / "rng.pt").read_text() == "rng 1"
    # a later run's save clears the killed one's staging, but not its own (other ranks may be writing it)
    _stage(tmp_path, 4)
    save_layout.begin(tmp_path, 4, primary=True)
    assert (save_layout.staging(tmp_path, 4) / "rng.pt").is_file()
    assert not save_layout.staging(tmp_path, 2).exists()


def test_a_state_naming_a_missing_save_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no loop_state.json"):
        save_layout.read(tmp_path)
    (tmp_path / "loop_state.json").write_text(json.dumps({"rollout_id": 2, "step_dir": "step-2-0123abcd"}))
    with pytest.raises(FileError, match="field step_dir: .*step-2-0123abcd holds no trainer/"):
        save_layout.read(tmp_path)
