"""Loading an expert window (`load_pretrained(..., experts=range(lo, hi))`, lockstep/models/checkpoint.py):
the model holds only those routed experts, equal to the full load's rows, and the reader never reads
another expert's data -- checked with a spy on safetensors' `safe_open` handles that records every
tensor read and its shape, for each layout lockstep reads: transformers' and DeepSeek's per-expert
names, stacked lockstep names (read through `get_slice` rows), and an fp8-fp4 checkpoint (per-expert
fp4 weights with scales)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import lockstep
from lockstep.models import load_pretrained, save_pretrained
from read_spy import STACKED, experts_read, spy_on_reads

ASSET = Path(lockstep.__file__).parent / "assets" / "tiny-dsv4"
WINDOW = range(4, 8)  # of the asset's 8 routed experts a layer


@pytest.fixture
def reads(monkeypatch) -> list[tuple[str, tuple]]:
    """(name, shape) of every tensor read from a safetensors file from now on."""
    log: list = []
    spy_on_reads(log, monkeypatch.setattr)
    return log


def _checkpoint(layout: str, tmp_path: Path) -> Path:
    """The asset in `layout`: "transformers" (as shipped), "official", "stacked" or "fp8-fp4"."""
    if layout == "transformers":
        return ASSET
    if layout == "official":
        save_pretrained(load_pretrained(ASSET), tmp_path, layout="official")
    elif layout == "stacked":  # lockstep's in-memory names: one [E, ...] tensor per expert weight
        save_file(load_pretrained(ASSET).state_dict(), str(tmp_path / "model.safetensors"))
        shutil.copy(ASSET / "config.json", tmp_path)
    else:
        from lockstep.quant.convert import convert_checkpoint

        convert_checkpoint(ASSET, tmp_path, to=layout)
    return tmp_path


def _expert_tensor(name: str) -> bool:
    return name.endswith(("experts.gate_up_proj", "experts.down_proj"))


@pytest.mark.parametrize("layout", ["transformers", "official", "stacked", "fp8-fp4"])
def test_a_window_holds_the_full_loads_rows_and_reads_no_other_expert(layout, tmp_path, reads):
    torch.set_num_threads(1)
    path = _checkpoint(layout, tmp_path)
    full = load_pretrained(path).state_dict()
    reads.clear()
    window = load_pretrained(path, experts=WINDOW)
    got = window.state_dict()
    assert set(got) == set(full)
    for name, t in got.items():
        want = full[name][WINDOW.start:WINDOW.stop] if _expert_tensor(name) else full[name]
        assert torch.equal(t, want), name
    assert got["model.layers.0.mlp.experts.gate_up_proj"].untyped_storage().nbytes() * 2 == \
        full["model.layers.0.mlp.experts.gate_up_proj"].untyped_storage().nbytes()
    per_expert = experts_read(reads)
    stacked = [(n, shape) for n, shape in reads if STACKED.fullmatch(n)]
    if layout == "stacked":
        assert not per_expert and stacked, reads
        assert all(shape[0] == len(WINDOW) for _, shape in stacked), stacked  # never all 8 experts
    else:
        assert per_expert == set(WINDOW) and not stacked, (per_expert, stacked)
    assert len(stacked) == (2 * window.config.num_hidden_layers if layout == "stacked" else 0)


def test_a_window_outside_the_routed_experts_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"expert window range\(6, 10\).*8 routed experts \(n_routed_experts\)"):
        load_pretrained(ASSET, experts=range(6, 10))


def test_a_window_alone_neither_runs_nor_saves(tmp_path):
    model = load_pretrained(ASSET, experts=WINDOW)
    with pytest.raises(RuntimeError, match=r"hold range\(4, 8\) of 8 only .*shard them"):
        model(torch.tensor([[5, 6, 7]]))
    # written as it holds them, experts 4..7 would come back as experts 0..3 of a 4-expert model
    with pytest.raises(ValueError, match=r"only experts range\(4, 8\) of 8 \(model.layers.0.mlp.experts"):
        save_pretrained(model, tmp_path)
    assert not list(tmp_path.iterdir())
