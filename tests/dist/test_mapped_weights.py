"""The weight push's mapped transport (lockstep/dist/mapped_weights.py), over gloo, 2 processes, the
bundled tiny DeepSeek-V4: rank 0 trains, rank 1 serves; the engine maps the trainer's own tensors.

Kept from push to push, the source exports once and the engine maps once; an in-place step needs
no new handles and a re-homed parameter is exported alone; a NaN written in place is voted down by
the engine's early validation; a cast into a kept buffer rewritten after the header is validated
again; an engine without mappings gets the source's handles in a second round; a descriptor the
engine cannot open is a clear error. (Every format, dead peers: test_weight_push.py, with the other
transports.)
"""

import time

import pytest
import torch

from dist_world import run_world
from lockstep.dist.groups import init_distributed
from lockstep.dist.manifest import build_manifest
from lockstep.dist.mapped_weights import MappedWeights, open_tensor
from lockstep.dist.weight_push import push_weights
from test_weight_push import BUCKET, DISAGGREGATED, engine, new_policy, poison, state


def _kept_mappings_world(rank):
    ctx = init_distributed(30.0, config=DISAGGREGATED)
    pool, seen = MappedWeights(), []
    first = "model.embed_tokens.weight"
    if rank == 0:
        trainer = new_policy()
        param = dict(trainer.model.named_parameters())[first]
        for v in (1, 2, 3, 4):
            with torch.no_grad():
                if v == 3:  # the trainer steps in place: the engines read the new values through the old mappings
                    param.add_(1.0)
                if v == 4:  # a parameter re-homed (new storage): exported again, alone
                    param.data = param.data + 1.0
            offered = [h for h in pool._handles]
            push_weights(ctx, build_manifest(trainer.model, torch.float32, BUCKET), v,
                         named_tensors=trainer.named_weights(), transport="mapped", pool=pool)
            seen.append(sum(a is not b for a, b in zip(offered, pool._handles)) if offered else len(pool._handles))
        with torch.no_grad():  # a NaN written in place: the same handles, the engine's early validation fails
            param[0, 0] = float("nan")
        try:
            push_weights(ctx, build_manifest(trainer.model, torch.float32, BUCKET), 5,
                         named_tensors=trainer.named_weights(), transport="mapped", pool=pool)
        except Exception as e:
            seen.append(f"{type(e).__name__}: {e}")
        return seen, all(t.is_shared() for t in trainer.model.state_dict().values())
    pushed, reference, new = engine(), engine(), new_policy()
    param = dict(new.model.named_parameters())[first]
    for v in (1, 2, 3, 4):
        with torch.no_grad():
            if v >= 3:
                param.add_(1.0)
        poison(pushed)
        push_weights(ctx, build_manifest(pushed.model, torch.float32, BUCKET), None, engine=pushed,
                     transport="mapped", pool=pool)
        reference.update_weights(new.named_weights(), version=v)
        ref = reference.model.state_dict()
        seen.append(([t.data_ptr() for _, t in pool._mapped],
                     [n for n, t in pushed.model.state_dict().items() if not torch.equal(t, ref[n])]))
    before = state(pushed)
    try:
        push_weights(ctx, build_manifest(pushed.model, torch.float32, BUCKET), None, engine=pushed,
                     transport="mapped", pool=pool)
    except Exception as e:
        kept = all(torch.equal(t, before[n]) for n, t in pushed.model.state_dict().items())
        return seen, f"{type(e).__name__}: {e}", kept, pushed.weight_version
    return seen, None, None, None


def test_mapped_pushes_read_the_trainers_own_tensors_mapped_once():
    """The mapped transport (mapped_weights.py): the engine reads the trainer's live tensors. Kept
    from push to push, the first push exports every tensor (on the CPU moving the trainer's storages
    into shared memory), the next ones none even after the trainer stepped in place, and a parameter
    given new storage is exported again alone; every push equals the in-process update. A NaN the
    trainer writes in place (no new handles: the engine's validation ran before the offer) is voted
    down: both ranks raise naming it, the engine keeps version 4."""
    r0, r1 = run_world(_kept_mappings_world, 2, guard_s=120)
    assert r0.ok and r1.ok, (r0.error, r1.error)
    exported, shared = r0.value
    assert exported[0] > 100 and exported[1:4] == [0, 0, 1] and shared
    assert exported[4].startswith("WeightPushError: rank 0: weight push v5 aborted, rank(s) [1]"), exported[4]
    seen, nan_error, kept, version = r1.value
    ptrs, differs = zip(*seen)
    assert ptrs[0] == ptrs[1] == ptrs[2] and sum(a != b for a, b in zip(ptrs[2], ptrs[3])) == 1
    assert differs == ([], [], [], []), differs
    assert "model.embed_tokens.weight: 1 non-finite values" in nan_error and kept and version == 4, nan_error


def test_a_cast_to_the_wire_dtype_is_exported_once():
    """A trainer tensor not in the wire dtype is cast into a buffer kept from push to push (its address
    stays), so a second offer of the same tensors exports nothing; the buffer holds the new values,
    and the rewrite is reported (engines validate again what they read before it)."""
    pool, w, table = MappedWeights(), torch.randn(4, 8), torch.arange(5)
    wire, rewritten = pool.wire([w, table], [torch.bfloat16, torch.int64])
    assert wire[1] is table and wire[0].dtype == torch.bfloat16 and torch.equal(wire[0], w.to(torch.bfloat16))
    assert len(pool.offer(wire)) == 2 and not rewritten
    w.add_(1.0)
    again, rewritten = pool.wire([w, table], [torch.bfloat16, torch.int64])
    assert again[0].data_ptr() == wire[0].data_ptr() and torch.equal(again[0], w.to(torch.bfloat16))
    assert pool.offer(again) is None and rewritten  # same handles, but the engines' early reads are stale


def _cast_world(rank):
    """An fp32 trainer pushing to a bf16 wire (every float cast into kept buffers); push 2 carries a
    NaN written in place after push 1: same handles, but the engine must not keep its early read."""
    ctx = init_distributed(30.0, config=DISAGGREGATED)
    pool = MappedWeights()
    if rank == 0:
        trainer = new_policy()
        manifest = build_manifest(trainer.model, torch.bfloat16, BUCKET)
        push_weights(ctx, manifest, 1, named_tensors=trainer.named_weights(), transport="mapped", pool=pool)
        with torch.no_grad():
            dict(trainer.model.named_parameters())["model.embed_tokens.weight"][0, 0] = float("nan")
        cast = pool.wire
        pool.wire = lambda *a: time.sleep(1.0) or cast(*a)  # the engine's early read certainly comes first
        try:
            push_weights(ctx, manifest, 2, named_tensors=trainer.named_weights(), transport="mapped", pool=pool)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return None
    e = engine(fmt="bf16")
    manifest = build_manifest(e.model, torch.bfloat16, BUCKET)
    push_weights(ctx, manifest, None, engine=e, transport="mapped", pool=pool)
    try:
        push_weights(ctx, manifest, None, engine=e, transport="mapped", pool=pool)
    except Exception as err:
        return f"{type(err).__name__}: {err}", e.weight_version
    return None, e.weight_version


def test_a_cast_rewritten_after_the_header_is_validated_again():
    r0, r1 = run_world(_cast_world, 2, guard_s=120)
    assert r0.ok and r1.ok, (r0.error, r1.error)
    assert r0.value and r0.value.startswith("WeightPushError: rank 0: weight push v2 aborted, rank(s) [1]"), r0.value
    error, version = r1.value
    assert "model.embed_tokens.weight: 1 non-finite values" in error and version == 1, (error, version)


def _unmapped_engine_world(rank):
    """The source keeps its exports, the engine maps anew at every push (a pool of its own per push):
    from the second push on, the source has nothing new to offer but the engine has nothing mapped,
    so its NOT_READY ballot brings the second round, with the source's current handles."""
    ctx = init_distributed(30.0, config=DISAGGREGATED)
    if rank == 0:
        trainer, pool = new_policy(), MappedWeights()
        for v in (1, 2, 3):
            push_weights(ctx, build_manifest(trainer.model, torch.float32, BUCKET), v,
                         named_tensors=trainer.named_weights(), transport="mapped", pool=pool)
        return None
    pushed, new, differs = engine(), dict(new_policy().named_weights()), []
    for _ in (1, 2, 3):
        poison(pushed)
        push_weights(ctx, build_manifest(pushed.model, torch.float32, BUCKET), None, engine=pushed, transport="mapped")
        differs.append([n for n, t in pushed.model.state_dict().items() if n in new and not torch.equal(t, new[n])])
    return differs, pushed.weight_version


def test_an_engine_without_mappings_gets_the_sources_handles():
    r0, r1 = run_world(_unmapped_engine_world, 2, guard_s=120)
    assert r0.ok and r1.ok, (r0.error, r1.error)
    differs, version = r1.value
    assert version == 3 and differs == [[], [], []], differs


def test_a_mapping_that_cannot_be_opened_is_a_clear_error():
    """A CPU handle whose descriptor this process cannot open (here: a process that does not exist)
    is a ValueError naming the /proc path, which a push turns into a staging failure and a vote."""
    with pytest.raises(ValueError, match=r"opening /proc/999999999/fd/7 failed .*shared transport"):
        open_tensor(("cpu", 999_999_999, 7, 64, torch.float32, 0, (16,), (1,)))
