import json

import numpy as np
import pytest
import torch

from lockstep.metrics.sinks import (
    JsonlSink,
    MetricsFileError,
    MissingDependencyError,
    TensorBoardSink,
    WandbSink,
    read_metrics,
)


def test_jsonl_sink_appends_one_object_per_step(tmp_path):
    with JsonlSink(tmp_path) as sink:
        sink.log({"train/pg_loss": torch.tensor(0.5), "rollout/raw_reward": np.float32(0.25)}, step=0)
        # flushed at once: readable before close
        assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {
            "step": 0, "train/pg_loss": 0.5, "rollout/raw_reward": 0.25}
        sink.log({"train/grad_norm": float("nan"), "perf/tokens_per_s": np.int64(7)}, step=1)
    with JsonlSink(tmp_path) as sink:  # a resumed run appends
        sink.log({"rollout/raw_reward": 1.0}, step=2)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[1] == {"step": 1, "train/grad_norm": None, "perf/tokens_per_s": 7}


def test_read_metrics_errors_name_file_and_line(tmp_path):
    with pytest.raises(MetricsFileError, match="metrics file not found"):
        read_metrics(tmp_path / "metrics.jsonl")
    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 0, "a": 1}\n{"step": 1, "a": \n')
    with pytest.raises(MetricsFileError, match=f"{f}, line 2: not valid JSON"):
        read_metrics(f)
    f.write_text('{"step": 0}\n\n{"a": 1}\n')
    with pytest.raises(MetricsFileError, match="line 3: expected an object with an integer 'step'"):
        read_metrics(f)


def test_read_metrics_leaves_out_a_last_line_a_kill_cut_short(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 0}\n{"step": 1, "a": 0.5}\n{"step": 2, "a": 0.')
    assert [r["step"] for r in read_metrics(f)] == [0, 1]
    f.write_text('{"step": 0}\n{"step": 1, "a": 0.\n')  # a whole line (newline written) is malformed
    with pytest.raises(MetricsFileError, match="line 2: not valid JSON"):
        read_metrics(f)


def test_rewind_moves_the_redone_steps_and_a_cut_line_aside(tmp_path):
    f = tmp_path / "metrics.jsonl"
    # an earlier run in the same directory (steps 0-1), then this run: 0-3 and a write cut short
    f.write_text("".join(f'{{"step": {s}, "run": {r}}}\n' for r, s in
                         [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (1, 3)]) + '{"step": 4, "ru')
    with JsonlSink(tmp_path) as sink:
        assert sink.rewind(2) == 2  # resumed from the save after step 2
        sink.log({"run": 2}, step=3)
    assert [(r["run"], r["step"]) for r in read_metrics(f)] == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (2, 3)]
    assert (tmp_path / "metrics.jsonl.rewound").read_text() == '{"step": 3, "run": 1}\n{"step": 4, "ru\n'
    with JsonlSink(tmp_path) as sink:
        assert sink.rewind(3) == 0  # nothing after the step: the file is left as it is
    assert len(read_metrics(f)) == 6


def test_optional_sinks_give_clear_error_when_missing(tmp_path):
    for cls, package in [(TensorBoardSink, "tensorboard"), (WandbSink, "wandb")]:
        try:
            sink = cls(tmp_path)
        except MissingDependencyError as e:
            assert f"pip install {package}" in str(e)
        else:  # the package is installed here: the sink must then work
            sink.log({"x": 1.0}, step=0)
            sink.close()
