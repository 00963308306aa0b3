"""Stage-only loading (lockstep/dist/pipeline_parallel.load_stage, models/checkpoint.load_part): a
pipeline rank reads its stage of the checkpoint and nothing else, and gets the same tensors and the same
forward as cutting the whole loaded model (split_model). One process, no collectives."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lockstep.dist.pipeline_parallel import load_stage, split_model
from lockstep.models import load_pretrained
from lockstep.models.checkpoint import CheckpointError
from lockstep.models.precision import model_tensors
from test_pipeline_parallel import ASSET


def _tensors(module) -> dict[str, torch.Tensor]:
    return model_tensors(module)[0]


@pytest.mark.parametrize("stage_index,last_stage_layers,dtype", [(0, None, None), (1, None, None),
                                                                  (0, 1, torch.bfloat16), (1, 1, torch.bfloat16)])
def test_stage_equals_the_cut_whole_model(stage_index, last_stage_layers, dtype):
    whole = load_pretrained(ASSET, dtype=dtype)
    reference = split_model(whole, stage_index, 2, last_stage_layers)
    stage = load_stage(ASSET, stage_index, 2, last_stage_layers, dtype=dtype)
    want, got = _tensors(reference), _tensors(stage)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert stage.layer_ids == reference.layer_ids and stage.layer_ranges == reference.layer_ranges
    ids = torch.randint(1, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if stage_index == 0:
            inputs = (ids,)
        else:  # the last stage takes the first stage's streams
            inputs = (split_model(load_pretrained(ASSET, dtype=dtype), 0, 2, last_stage_layers)(ids)[0], ids)
        assert all(torch.equal(a, b) for a, b in zip(_as_tuple(stage(*inputs)), _as_tuple(reference(*inputs))))


def _as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def test_other_stages_are_never_read(tmp_path):
    """A checkpoint without the last layer's tensors: the whole model refuses to load it, the first
    stage (layers 0-1) loads, the stage that holds the layer names it."""
    for f in ASSET.iterdir():
        shutil.copy(f, tmp_path / f.name)
    weights = load_file(ASSET / "model.safetensors")
    save_file({k: v for k, v in weights.items() if ".layers.3." not in k}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError):
        load_pretrained(tmp_path)
    assert sorted(_tensors(load_stage(tmp_path, 0, 2))) == sorted(_tensors(split_model(load_pretrained(ASSET), 0, 2)))
    with pytest.raises(CheckpointError, match="layers.3"):
        load_stage(tmp_path, 1, 2)


def test_an_expert_window_reads_its_rows_only():
    """With experts 4-7 of 8: each routed expert weight holds those rows of the whole model's."""
    want = _tensors(split_model(load_pretrained(ASSET), 1, 2))
    got = _tensors(load_stage(ASSET, 1, 2, experts=range(4, 8)))
    assert sorted(got) == sorted(want)
    windowed = [n for n in got if got[n].shape != want[n].shape]
    assert windowed and all(".experts." in n for n in windowed)
    for name in windowed:
        assert torch.equal(got[name], want[name][4:8]), name
