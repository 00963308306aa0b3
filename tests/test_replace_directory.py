"""A save is written beside its directory and swapped in (lockstep/files.py): what each step of the
swap leaves when a process dies there, and what the next save and `--load` make of it."""

from lockstep.cli import main
from lockstep.files import previous_directory, remove_stale_staging, replace_directory, staging_directory


def _dir(path, **files):
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def test_replace_puts_the_new_save_in_place_of_the_old(tmp_path):
    final = _dir(tmp_path / "ckpt", a="old", b="old")
    replace_directory(_dir(staging_directory(final, 3), a="new"), final)
    assert {p.name: p.read_text() for p in final.iterdir()} == {"a": "new"}  # no file of the old save left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    replace_directory(_dir(staging_directory(tmp_path / "fresh", 1), a="1"), tmp_path / "fresh")
    assert (tmp_path / "fresh" / "a").read_text() == "1"


def test_stale_staging_goes_but_the_current_stays(tmp_path):
    final = tmp_path / "ckpt"
    for tag in (2, 5, 7):
        _dir(staging_directory(final, tag), a=str(tag))
    remove_stale_staging(final, 5)  # another rank may be writing 5's already
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.saving-5"]


def test_load_names_the_old_save_a_kill_left_between_the_renames(tmp_path, capsys):
    final = tmp_path / "ckpt"
    _dir(final.with_name("ckpt.old"), **{"loop_state.json": "{}"})  # renamed away, the new not yet in
    assert previous_directory(final) == tmp_path / "ckpt.old"
    assert main(["train", "--num-rollout", "1", "--load", str(final), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "ckpt.old holds the save before it" in err and f"rename it to {final}" in err, err
