"""A repeated in-process weight update replayed (engine/update_replay.py): the same tensors pushed
again (a trainer's parameters, updated in place) run the captured device work (on CUDA a graph; here
the update's kernels under Triton's interpreter, the stand-in), and every check still holds: the
values written are the launched update's, a NaN is named and leaves the model as it was, and other
tensors are launched anew."""

import pytest
import torch

from lockstep.engine import WeightUpdateError, update_replay
from lockstep.engine import value_checks as vc

from conftest import make_engine
from test_weight_update import trainer_weights


def _step(weights: dict[str, torch.Tensor], scale: float) -> None:
    """A trainer's optimizer step: every floating weight changed in place (its address kept)."""
    with torch.no_grad():
        for t in weights.values():
            if t.is_floating_point():
                t.mul_(scale)


def _same(engine, reference) -> bool:
    ref = reference.model.state_dict()
    return all(torch.equal(t, ref[n]) for n, t in engine.model.state_dict().items())


def test_a_repeated_update_is_replayed_and_still_checked(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(vc, "INTERPRETED_KERNELS", True)
    monkeypatch.setattr(update_replay, "REPLAY", True)
    engine, reference = make_engine(seed=60), make_engine(seed=60)
    dest = engine.model.state_dict()
    weights = {n: t.to(dest[n]) for n, t in trainer_weights(61).items()}  # on the engine's device, its dtypes
    replays = engine.update_targets().replays
    for version, scale in ((1, 1.0), (2, 1.5), (3, 0.5)):
        _step(weights, scale)
        engine.update_weights(weights, version=version)
    assert replays.replays == 1  # seen, captured, then replayed
    monkeypatch.setattr(vc, "INTERPRETED_KERNELS", False)
    reference.update_weights(weights, version=1)  # torch's norms and copy
    assert _same(engine, reference)  # the replay wrote this step's values
    monkeypatch.setattr(vc, "INTERPRETED_KERNELS", True)

    name = next(n for n, t in weights.items() if t.dim() == 2 and t.is_floating_point())
    kept = weights[name][0, 0].item()
    weights[name][0, 0] = float("nan")
    with pytest.raises(WeightUpdateError, match=name):
        engine.update_weights(weights, version=4)
    assert replays.replays == 2
    assert _same(engine, reference)  # the replayed write was gated: nothing of it landed

    weights[name][0, 0] = kept
    moved = {n: t.clone() for n, t in weights.items()}  # other addresses: another key
    _step(moved, 2.0)
    engine.update_weights(moved, version=5)
    assert replays.replays == 2
    monkeypatch.setattr(vc, "INTERPRETED_KERNELS", False)
    reference.update_weights(moved, version=2)
    assert _same(engine, reference)


def test_a_switch_turned_off_between_updates_is_not_replayed(monkeypatch):
    """The switches choosing the launches are in the key: the byte copy turned off after a capture
    (as weight_update_parts.py's rows do) runs torch's copy, and writes this step's values."""
    pytest.importorskip("triton")
    from lockstep import tensor_copy_triton

    monkeypatch.setattr(vc, "INTERPRETED_KERNELS", True)
    monkeypatch.setattr(update_replay, "REPLAY", True)
    engine, reference = make_engine(seed=62), make_engine(seed=62)
    dest = engine.model.state_dict()
    weights = {n: t.to(dest[n]) for n, t in trainer_weights(63).items()}
    replays = engine.update_targets().replays
    for version in (1, 2):  # seen, captured
        _step(weights, 1.5)
        engine.update_weights(weights, version=version)
    monkeypatch.setattr(tensor_copy_triton, "WRITE_KERNEL", False)
    _step(weights, 0.5)
    engine.update_weights(weights, version=3)
    assert replays.replays == 0
    reference.update_weights(weights, version=1)
    assert _same(engine, reference)
