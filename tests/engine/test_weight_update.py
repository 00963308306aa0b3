"""Weight updates: a pushed version serves exactly like a fresh engine built on those weights;
a corrupted update is rejected whole and the previous version keeps serving."""

import pytest
import torch

from lockstep.engine import WeightUpdateError
from lockstep.engine import value_checks as vc
from lockstep.quant.serving_format import serving_storage
from lockstep.quant.formats import Storage

from conftest import DEVICE, greedy, make_engine, prompts, requests, same_outputs, sampled, tiny_dsv4


def trainer_weights(seed):
    """What a trainer's named_weights() sends: parameters and the policy buffers, in bf16 / fp32."""
    m = tiny_dsv4(seed)
    out = {}
    for name, t in m.state_dict().items():
        out[name] = t.to(torch.bfloat16) if t.is_floating_point() and t.dim() >= 2 else t.clone()
    return out


def params(i):
    return greedy(max_new_tokens=8) if i % 2 else sampled(seed=i, max_new_tokens=8)


def _addresses(engine) -> list[int]:
    return [t.data_ptr() for t in (*engine.model.parameters(), *engine.model.buffers())]


@pytest.mark.parametrize("fmt, packed", [("bf16", False), ("fp8", False), ("fp8-fp4", False), ("fp8", True),
                                         ("fp8-fp4", True)])  # bf16 packs nothing
def test_update_equals_fresh_engine(fmt, packed):
    """An update equals an engine built on the new weights, and writes every tensor in place: no
    address moves, which the engine relies on (its CUDA graphs are not re-captured after an update,
    its update targets are kept: Engine.update_weights)."""
    ps = prompts(4, seed=20)
    engine = make_engine(seed=21, serving_format=fmt, packed_fp8=packed, packed_experts=packed)
    before = engine.generate(requests(ps, params))
    addresses = _addresses(engine)
    new = trainer_weights(22)
    engine.update_weights(new.items(), version=3)
    assert engine.weight_version == 3 and _addresses(engine) == addresses
    after = engine.generate(requests(ps, params))
    assert all(s.weight_version == 3 for s in after) and all(s.weight_version == 0 for s in before)
    fresh_model = tiny_dsv4(0)
    fresh_model.load_state_dict({k: v.to(fresh_model.state_dict()[k].dtype) for k, v in new.items()})
    fresh = make_engine(model=fresh_model, serving_format=fmt, packed_fp8=packed, packed_experts=packed)
    for k, v in fresh.model.state_dict().items():
        assert torch.equal(v, engine.model.state_dict()[k]), k
    same_outputs(after, fresh.generate(requests(ps, params)), exact=True)


def test_a_write_plan_is_made_once_per_layout():
    """write_served decides where each tensor goes once per layout of an update (names, dtypes,
    devices) and keeps the plan: a second update of the same layout reuses it, a partial update of
    one tensor gets its own; the values are still the new ones (fp8: a packed weight, a copied one)."""
    engine = make_engine(seed=23, serving_format="fp8", packed_fp8=True)
    plans = engine.update_targets().plans
    # on the engine's device, as a colocated trainer's (a host tensor takes the per-tensor path: `other`)
    first, second = ({k: v.to(DEVICE) for k, v in trainer_weights(seed).items()} for seed in (24, 25))
    engine.update_weights(first.items(), version=1)
    plan = next(iter(plans.values()))
    engine.update_weights(second.items(), version=2)
    assert len(plans) == 1 and next(iter(plans.values())) is plan and plan.packed["fp8"][0]
    assert plan.kernel and plan.copy  # same-dtype tensors by the byte copy; bf16 ones served in fp32 cast
    reference = make_engine(seed=26, serving_format="fp8", packed_fp8=True)
    reference.update_weights(second.items(), version=1)
    for k, v in reference.model.state_dict().items():
        assert torch.equal(v, engine.model.state_dict()[k]), k
    name = "model.norm.weight"
    engine.update_weights({name: first[name]}, version=3, partial=True)
    assert len(plans) == 2 and not torch.equal(engine.model.state_dict()[name], reference.model.state_dict()[name])


def test_served_values_follow_the_format():
    engine = make_engine(seed=23, serving_format="fp8-fp4")
    sd = engine.model.state_dict()
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert serving_storage(name, "fp8-fp4") is Storage.FP4
    # e2m1 times a power of two: at most 8 distinct magnitudes per 1x32 block
    block = sd[name][0, 0, :32].abs()
    assert len(set(block.tolist())) <= 8
    assert serving_storage("model.layers.0.attn_hc.fn", "fp8") is Storage.FP32
    assert serving_storage("model.layers.0.self_attn.q_proj.weight", "fp8") is Storage.FP8  # dense names too


def corrupt_cases():
    good = trainer_weights(24)
    unknown = dict(good, **{"model.layers.9.mlp.gate.weight": torch.zeros(6, 32)})
    shape = dict(good, **{"model.layers.2.self_attn.q_a_proj.weight": torch.zeros(16, 31)})
    nan = dict(good)
    nan["model.layers.3.mlp.experts.down_proj"] = good["model.layers.3.mlp.experts.down_proj"].clone()
    nan["model.layers.3.mlp.experts.down_proj"][1, 2, 3] = float("nan")
    table = dict(good, **{"model.layers.0.mlp.gate.tid2eid": good["model.layers.0.mlp.gate.tid2eid"] + 100})
    return {"model.layers.9.mlp.gate.weight": unknown, "q_a_proj": shape, "down_proj": nan, "tid2eid": table}


def test_values_whose_norm_overflows_are_accepted_and_a_later_nan_is_named():
    """The finiteness check reads one norm per tensor; a norm that overflows (huge but finite values)
    is not a non-finite value, and the bad tensor is named even when it is not the first suspect."""
    from lockstep.engine.weight_update import validate_update

    engine = make_engine(seed=33, serving_format="bf16")
    weights = trainer_weights(34)
    first = "model.layers.0.self_attn.q_a_proj.weight"
    weights[first] = torch.full_like(weights[first], 3e38)  # norm inf in fp32, every value finite
    validate_update(engine.model, weights)
    bad = "model.layers.3.mlp.experts.down_proj"
    weights[bad] = weights[bad].clone()
    weights[bad][0, 0, :2] = torch.tensor([float("inf"), float("nan")])
    with pytest.raises(WeightUpdateError, match=rf"{bad}: 2 non-finite values"):
        validate_update(engine.model, weights)


@pytest.mark.parametrize("case", list(corrupt_cases()))
def test_corrupted_update_is_rejected_and_the_old_version_serves(case):
    ps = prompts(3, seed=25)
    engine = make_engine(seed=26, serving_format="fp8")
    before = engine.generate(requests(ps, params))
    snapshot = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with pytest.raises(WeightUpdateError, match=case.replace(".", r"\.")):
        engine.update_weights(corrupt_cases()[case], version=1)
    assert engine.weight_version == 0
    assert all(torch.equal(v, engine.model.state_dict()[k]) for k, v in snapshot.items())
    same_outputs(engine.generate(requests(ps, params)), before, exact=True)


def test_update_from_disk(tmp_path):
    from lockstep.models.checkpoint import save_pretrained

    src = tiny_dsv4(27)
    save_pretrained(src, tmp_path / "ckpt")
    engine = make_engine(seed=28, serving_format="fp8")
    engine.update_weights_from_disk(tmp_path / "ckpt")
    assert engine.weight_version == 1
    fresh = make_engine(model=tiny_dsv4(27), serving_format="fp8")
    ps = prompts(3, seed=29)
    same_outputs(engine.generate(requests(ps, params)), fresh.generate(requests(ps, params)), exact=True)
    with pytest.raises(WeightUpdateError):
        engine.update_weights_from_disk(tmp_path / "missing")
    assert engine.weight_version == 1


def test_update_while_requests_run_recomputes_them():
    """The running sequences are preempted and recomputed on the new weights. The update does not
    clear the cache (a write of all of it per update): a slot is reset when handed out again, so every
    cache tensor filled with NaN after the update (what a stale slot could hold at worst) changes
    neither the recomputed sequences nor new requests, which equal a fresh engine's."""
    ps = prompts(3, seed=30)
    engine = make_engine(seed=31)
    states = [engine._new_state(r) for r in requests(ps, lambda i: greedy(max_new_tokens=10))]
    for s in states:
        engine._add(s)
    for _ in range(4):
        engine.step()
    sampled_before = [st.sequences[0].num_output for st in states]
    assert all(k >= 1 for k in sampled_before)
    engine.update_weights(trainer_weights(32), version=5)
    _poison(engine)
    while not all(s.done for s in states):
        engine.step()
    fresh = make_engine(model=tiny_dsv4(0))
    fresh.update_weights(trainer_weights(32), version=5)
    for st, k in zip(states, sampled_before):
        s = st.samples[0]
        assert s.weight_version == 5
        # the tokens sampled after the update are what the new weights give for that prefix
        prefix = s.prompt_ids.tolist() + s.response_ids[:k].tolist()
        cont = fresh.generate([type(st.request)(prefix, greedy(max_new_tokens=10 - k))])[0]
        assert cont.response_ids.tolist() == s.response_ids[k:].tolist()
    _poison(engine)
    same_outputs(engine.generate(requests(ps, params)), fresh.generate(requests(ps, params)), exact=True)


def _poison(engine):
    """Every tensor of a DeepSeek-V4 engine's rollout cache filled with NaN (-7 where integer)."""
    for layer in engine.cache.cache.layers:
        for t in layer.tensors():
            t.fill_(float("nan") if t.is_floating_point() else -7)


def test_bucketed_updates_and_duplicates():
    engine = make_engine(seed=33, serving_format="fp8")
    new = trainer_weights(34)
    names = sorted(new)
    half = {k: new[k] for k in names[: len(names) // 2]}
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.update_weights(half, version=1, partial=True)
    sd = engine.model.state_dict()
    assert all(torch.equal(sd[k], before[k]) for k in names[len(names) // 2:])
    assert not torch.equal(sd["model.layers.0.mlp.gate.tid2eid"], before["model.layers.0.mlp.gate.tid2eid"]) \
        or "model.layers.0.mlp.gate.tid2eid" not in half
    with pytest.raises(WeightUpdateError, match="sent twice"):
        engine.update_weights([(names[0], new[names[0]]), (names[0], new[names[0]])], version=2, partial=True)
    assert engine.weight_version == 1


def test_updates_cover_every_tensor_and_versions_only_increase():
    """A push of some tensors is refused unless it says partial (1 of 272 tensors was accepted and
    the model emitted garbage, issue 15); a version at or below the serving one is refused; nothing
    is written either way."""
    from lockstep.engine.weight_update import WeightVersionError

    engine = make_engine(seed=60)
    new = trainer_weights(61)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    one = dict([next(iter(new.items()))])
    with pytest.raises(WeightUpdateError, match=rf"missing from the update \({len(new) - 1} of the model's {len(new)}"):
        engine.update_weights(one, version=1)
    for version in (-7, 0):
        with pytest.raises(WeightVersionError, match="only increase"):
            engine.update_weights(new, version=version)
    assert engine.weight_version == 0
    assert all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())
    engine.update_weights(one, version=1, partial=True)  # buckets of one version share it
    engine.update_weights(one, version=1, partial=True)
    with pytest.raises(WeightVersionError):
        engine.update_weights(new, version=1)  # a whole new set of weights needs a new version
    engine.update_weights(new, version=2)
    assert engine.weight_version == 2


def test_first_nonfinite_over_mixed_dtypes_names_the_first_bad_tensor():
    """The finiteness check groups tensors by dtype (one multi-tensor norm each) and still names the
    first bad tensor in the update's order, with its count."""
    from lockstep.engine.value_checks import first_nonfinite as first, launch_finiteness

    def _first_nonfinite(pairs):
        return first(*launch_finiteness(pairs))

    bad16 = torch.ones(4, 4, dtype=torch.bfloat16)
    bad16[1, 2] = float("inf")
    bad32 = torch.ones(3)
    bad32[0] = bad32[2] = float("nan")
    pairs = [("a", torch.ones(2, dtype=torch.bfloat16)), ("b", bad32), ("c", torch.zeros(5, dtype=torch.int64)),
             ("d", bad16), ("e", torch.ones(7))]
    assert _first_nonfinite(pairs) == ("b", 2)
    assert _first_nonfinite(pairs[2:]) == ("d", 1)
    assert _first_nonfinite([pairs[0], pairs[2], pairs[4]]) is None


def test_a_validated_update_is_written_without_reading_its_values_again(monkeypatch):
    """A bucketed push validates each bucket as it stages it and joins them; the update then writes
    them without a second finiteness pass. A part validated as partial is checked again when it is
    sent as a whole update, and the join checks the names across the parts."""
    from lockstep.engine import weight_update as wu

    engine = make_engine(seed=35, serving_format="fp8")
    weights = list(trainer_weights(36).items())
    targets = wu.UpdateTargets.of(engine.model)
    parts = [wu.validate_update(engine.model, weights[i::3], partial=True, targets=targets) for i in range(3)]
    reference = make_engine(seed=37, serving_format="fp8")
    reference.update_weights(dict(weights), version=1)
    reads = []
    launch = wu.launch_finiteness
    monkeypatch.setattr(wu, "launch_finiteness", lambda pairs, *plan: reads.append(len(pairs)) or launch(pairs, *plan))
    engine.update_weights(wu.ValidatedUpdate.joined(parts, partial=False), version=1)
    assert reads == []  # no value read twice
    assert all(torch.equal(v, reference.model.state_dict()[k]) for k, v in engine.model.state_dict().items())
    with pytest.raises(WeightUpdateError, match="missing from the update"):
        engine.update_weights(parts[0], version=2)  # partial: validated again as a whole update
    assert engine.weight_version == 1
    with pytest.raises(WeightUpdateError, match="sent twice"):
        wu.ValidatedUpdate.joined([parts[0], parts[0]], partial=True)
    with pytest.raises(WeightUpdateError, match="missing from the update"):
        wu.ValidatedUpdate.joined(parts[:2], partial=False)
    other = wu.validate_update(engine.model, weights[:1], partial=True)  # its own targets
    with pytest.raises(ValueError, match="same targets"):
        wu.ValidatedUpdate.joined([parts[0], other], partial=True)


def test_every_hash_table_is_range_checked_and_the_bad_one_named():
    """The tables' extremes are read together; the table out of range is the one named, whatever
    the integer dtype of each."""
    from lockstep.engine.value_checks import check_expert_ids, launch_expert_extremes, read_device_checks

    def _check_expert_ids(pairs, n_experts):
        names, extremes = launch_expert_extremes(pairs, n_experts)
        check_expert_ids(names, read_device_checks(extremes)[0] if extremes else [], n_experts)

    good = ("model.layers.0.mlp.gate.tid2eid", torch.tensor([[0, 7], [3, 1]], dtype=torch.int32))
    bad = ("model.layers.1.mlp.gate.tid2eid", torch.tensor([[2, -1], [3, 1]]))
    _check_expert_ids([good, ("model.layers.1.mlp.gate.weight", torch.zeros(2))], n_experts=8)
    with pytest.raises(WeightUpdateError, match=r"layers\.1\.mlp\.gate\.tid2eid: expert ids must be in \[0, 8\), "
                                                r"got \[-1, 3\]"):
        _check_expert_ids([good, bad], n_experts=8)
    with pytest.raises(WeightUpdateError, match=r"layers\.0\.mlp\.gate\.tid2eid: .* got \[0, 7\]"):
        _check_expert_ids([good], n_experts=7)


def test_name_shape_and_dtype_checks_run_once_per_layout(monkeypatch):
    """A push sends the same layout every time: its name / shape / dtype checks pass once and are
    kept in the engine's targets; another layout (a wrong shape, a name left out) is checked anew,
    and the values are read every time."""
    from lockstep.engine import weight_update as wu

    engine = make_engine(seed=38)
    weights = trainer_weights(39)
    checked = []
    check_one = wu._check_one
    monkeypatch.setattr(wu, "_check_one", lambda *a: checked.append(a[0]) or check_one(*a))
    engine.update_weights(weights, version=1)
    engine.update_weights(weights, version=2)
    assert len(checked) == len(weights)  # the second update's layout was already checked
    name = next(n for n, t in weights.items() if t.dim() == 2)
    with pytest.raises(WeightUpdateError, match="does not match the model's"):
        engine.update_weights({**weights, name: weights[name][:1]}, version=3)
    with pytest.raises(WeightUpdateError, match="missing from the update"):
        engine.update_weights({n: t for n, t in weights.items() if n != name}, version=3)
    bad = {**weights, name: weights[name].clone()}
    bad[name].view(-1)[0] = float("nan")
    with pytest.raises(WeightUpdateError, match="non-finite"):
        engine.update_weights(bad, version=3)  # the same layout: only the values' checks run, and fail
    assert engine.weight_version == 2


def test_the_weight_update_writes_the_same_with_the_kernel(monkeypatch):
    """tensor_copy_triton.WRITE_KERNEL on: the unquantised weights written by one Triton launch per
    alignment (the tiny config has odd-sized tensors), the same bytes as _foreach_copy_ writes."""
    pytest.importorskip("triton")
    from lockstep import tensor_copy_triton as tc
    from launches import count_launches

    weights = {n: t.to(DEVICE) for n, t in trainer_weights(41).items()}  # the kernels read the device's
    off, on = make_engine(seed=40), make_engine(seed=40)
    monkeypatch.setattr(tc, "WRITE_KERNEL", False)
    off.update_weights(weights, version=1)
    monkeypatch.setattr(tc, "WRITE_KERNEL", True)
    monkeypatch.setattr(vc, "INTERPRETED_KERNELS", True)
    launches = count_launches(monkeypatch, tc, "_copy_kernel")
    on.update_weights(weights, version=1)
    assert len(launches) == 2
    ref = off.model.state_dict()
    assert all(torch.equal(t, ref[n]) for n, t in on.model.state_dict().items())


def test_the_finiteness_check_by_the_kernel_rejects_and_accepts_as_the_norms(monkeypatch):
    """tensor_finite_triton.FINITE_KERNEL on: a launch per dtype group and alignment reads every value; a NaN is
    named with its count as before, and a clean update is written the same."""
    pytest.importorskip("triton")
    from lockstep import tensor_finite_triton as tf
    from launches import count_launches

    monkeypatch.setattr(tf, "FINITE_KERNEL", True)
    monkeypatch.setattr(vc, "INTERPRETED_KERNELS", True)
    launches = count_launches(monkeypatch, tf, "_nonfinite_kernel")
    weights = {n: t.to(DEVICE) for n, t in trainer_weights(43).items()}
    engine, reference = make_engine(seed=42), make_engine(seed=42)
    name = next(n for n, t in weights.items() if t.dim() == 2)
    bad = {**weights, name: weights[name].clone()}
    bad[name].view(-1)[:3] = float("nan")
    with pytest.raises(WeightUpdateError, match=rf"{name}: 3 non-finite values"):
        engine.update_weights(bad, version=1)
    dtypes = {t.dtype for t in weights.values() if t.is_floating_point() and t.numel()}
    assert len(dtypes) <= len(launches) <= 2 * len(dtypes)
    engine.update_weights(weights, version=1)
    monkeypatch.setattr(tf, "FINITE_KERNEL", False)
    reference.update_weights(weights, version=1)
    ref = reference.model.state_dict()
    assert all(torch.equal(t, ref[n]) for n, t in engine.model.state_dict().items())


def _strided(t: torch.Tensor) -> torch.Tensor:
    """t's values in a view of the same shape whose storage is not dense: every other column of
    a wider buffer (a byte copy or a linear read of it would take the wrong values)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    view = wide[..., ::2]
    view.copy_(t)
    return view


def test_a_layout_seen_contiguous_then_strided_is_still_copied_and_checked(monkeypatch):
    """The kept plans fix names, dtypes and shapes, not strides: a later update of the same layout
    whose sources are strided views (same shapes) is checked and written by torch, the same values."""
    pytest.importorskip("triton")

    monkeypatch.setattr(vc, "INTERPRETED_KERNELS", True)
    engine, reference = make_engine(seed=44), make_engine(seed=44)
    engine.update_weights(trainer_weights(45), version=1)  # the plans made on contiguous sources
    second = trainer_weights(46)
    dest = engine.model.state_dict()
    copied = next(n for n, t in second.items() if t.is_floating_point() and t.numel() > 1 and t.dtype == dest[n].dtype)
    checked = [n for n, t in second.items() if t.dim() == 2 and t.dtype == torch.bfloat16][-1]  # not its group's first
    bad = {**second, checked: second[checked].clone()}
    bad[checked][-1, -1] = float("inf")  # past what a linear read of the strided view's first numel values sees
    bad[checked] = _strided(bad[checked])
    with pytest.raises(WeightUpdateError, match=rf"{checked}: 1 non-finite values"):
        engine.update_weights(bad, version=2)
    engine.update_weights({**second, copied: _strided(second[copied]), checked: _strided(second[checked])}, version=2)
    reference.update_weights(second, version=1)
    ref = reference.model.state_dict()
    assert all(torch.equal(t, ref[n]) for n, t in engine.model.state_dict().items())


@pytest.mark.parametrize("case", ["nan", "tid2eid", "norm overflow"])
def test_the_write_gated_on_the_checks_writes_nothing_where_one_fails(monkeypatch, case):
    """An update every tensor of which the byte copy takes (the engine's own dtypes, bf16 format) is
    written gated on its value checks, launched before they are read: a NaN (the kernel's flags) or
    an expert id out of range leaves every byte as it was. Values whose norm overflows (the norms
    standing in for the kernel) close the gate though finite: the update is then written ungated."""
    pytest.importorskip("triton")
    from lockstep import tensor_copy_triton as tc
    from lockstep import tensor_finite_triton as tf
    from launches import launch_arguments

    monkeypatch.setattr(vc, "INTERPRETED_KERNELS", True)
    engine, reference = make_engine(seed=50), make_engine(seed=50)
    dest = engine.model.state_dict()
    weights = {n: t.to(dest[n]) for n, t in trainer_weights(51).items()}  # its device and dtype
    name = next(n for n, t in weights.items() if t.dim() == 2 and t.is_floating_point())
    sent = {**weights, name: weights[name].clone()}
    if case == "nan":
        sent[name][0, 0] = float("nan")
    elif case == "tid2eid":
        table = "model.layers.0.mlp.gate.tid2eid"
        sent[table] = sent[table] + 100
    else:
        monkeypatch.setattr(tf, "FINITE_KERNEL", False)
        sent[name][0] = 3e38  # fp32: its norm is inf, every value finite
    snapshot = {k: v.clone() for k, v in dest.items()}
    launches = launch_arguments(monkeypatch, tc, "_copy_kernel")
    if case == "norm overflow":
        engine.update_weights(sent, version=1)
        gates = [args[-1].item() for args, _ in launches]  # the gated write's (closed), then the ungated one's
        assert gates == sorted(gates, reverse=True) and set(gates) == {0, 1}
        monkeypatch.setattr(vc, "INTERPRETED_KERNELS", False)
        reference.update_weights(sent, version=1)  # torch's norms and copy
        ref = reference.model.state_dict()
        assert all(torch.equal(t, ref[n]) for n, t in engine.model.state_dict().items())
        return
    with pytest.raises(WeightUpdateError, match=name if case == "nan" else "expert ids"):
        engine.update_weights(sent, version=1)
    assert launches  # the write ran, gated: nothing of it landed
    assert all(torch.equal(v, engine.model.state_dict()[k]) for k, v in snapshot.items())
    reads = []
    monkeypatch.setattr(vc, "read_device_checks", lambda parts, real=vc.read_device_checks: reads.append(
        len(parts)) or real(parts))
    engine.update_weights(weights, version=1)
    assert reads == []  # the open gate alone (every check passed): no flag read
    prepared = []
    monkeypatch.setattr(tc, "_launches", lambda pairs, real=tc._launches: prepared.append(1) or real(pairs))
    engine.update_weights(weights, version=2)
    assert prepared == []  # the same tensors again: the copy's launches kept (by the plan's destinations' key)
    monkeypatch.setattr(vc, "INTERPRETED_KERNELS", False)
    reference.update_weights(weights, version=1)
    ref = reference.model.state_dict()
    assert all(torch.equal(t, ref[n]) for n, t in engine.model.state_dict().items())
