"""`lockstep sft` writes the bundled asset only when rebuilding the embedded default."""

import pytest

from lockstep.cli import main
from lockstep.rl.embedded import ASSET_DIR


def asset_state():
    return {p.name: p.stat().st_mtime_ns for p in ASSET_DIR.iterdir()}


@pytest.mark.parametrize("extra", [["--model", "some/model"], ["--data", "pairs.jsonl"],
                                   ["--model", "some/model", "--output", str(ASSET_DIR)]])
def test_sft_of_another_model_or_data_without_output_is_refused(extra, capsys):
    before = asset_state()
    assert main(["sft", *extra]) == 2
    err = capsys.readouterr().err
    assert "--output" in err and str(ASSET_DIR) in err
    assert asset_state() == before
