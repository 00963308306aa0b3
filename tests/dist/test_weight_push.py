"""Weight push over gloo, 2 processes, the bundled tiny DeepSeek-V4: rank 0 trains, rank 1 serves.

(d) a push equals the in-process `Engine.update_weights` bit for bit, every tensor (tid2eid and the
    router bias included), in each serving format: the engine is poisoned first, so a tensor the
    push missed cannot pass; a push with a NaN is voted down and both sides keep the old version.
(e) a manifest mismatch raises on both ranks naming the first differing tensor; a peer killed
    mid-push makes the survivor raise DistributedError naming its rank and the step, in seconds.

The three transports run: "broadcast" (buckets over the weight group), "shared" (shared_buckets.py:
the source's bucket handed over by handle, shared memory on the CPU, CUDA IPC on a GPU; no shared
segment outlives a push) and "mapped" (mapped_weights.py: the engine maps the trainer's own tensors;
the default where every rank is on one host and the weight group is gloo).
The push and the dead-peer tests run on the CPU over gloo (fp32, as CI runs them) and, with
LOCKSTEP_TEST_DEVICE=cuda on 2 GPUs, over NCCL (dist_world.world_devices): trainer on cuda:0 in bf16
(the wire carries bf16, fp32 where the model keeps fp32), engine on cuda:1 in bf16, eager (no decode
is run, so no graphs are captured). NCCL does not notice a dead peer: the survivor raises when its
wait reaches the timeout (groups.DistContext.wait), or at once on the gloo control group.
"""

import os
import time
from pathlib import Path

import pytest
import torch

import lockstep
from dist_world import report, run_world, world_devices
from lockstep.config import EngineConfig
from lockstep.dist.config import DistConfig
from lockstep.dist.groups import init_distributed
from lockstep.dist.manifest import build_manifest
from lockstep.dist.weight_push import PHASES, push_weights
from lockstep.engine import Engine
from lockstep.models import load_pretrained
from lockstep.models.registry import config_from_hf_dict, model_class
from lockstep.train.config import TrainConfig
from lockstep.train.trainer import Trainer

ASSET = Path(lockstep.__file__).parent / "assets" / "tiny-dsv4"
BUCKET = 128 * 1024  # the 2.5 MB model travels in ~20 buckets
FORMATS = ("bf16", "fp8", "fp8-fp4")
TID2EID = "model.layers.0.mlp.gate.tid2eid"
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"
DISAGGREGATED = DistConfig(actor_num_gpus=1, rollout_num_gpus=1)


def dtype_of(device) -> str:
    """The trainer's and engine's dtype: fp32 on the CPU (CI), bf16 on GPUs (issue 18)."""
    return "float32" if torch.device(device).type == "cpu" else "bfloat16"


def new_policy(device="cpu"):
    """A trainer whose weights differ from the asset everywhere, the routing tables included."""
    model = load_pretrained(ASSET)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("tid2eid"):
                t.copy_((t + 1) % model.config.n_routed_experts)
            elif t.is_floating_point():
                t.add_(0.01 * torch.randn(t.shape, generator=g))
    return Trainer(model.to(device), TrainConfig(dtype=dtype_of(device)))


def engine(fmt="bf16", model=None, device="cpu"):
    cfg = EngineConfig(max_num_seqs=4, max_model_len=64, max_prefill_tokens=32, serving_format=fmt,
                       device=str(device), dtype=dtype_of(device), cuda_graph=False, compile_decode=False,
                       compile_hc=False)
    return Engine(model if model is not None else load_pretrained(ASSET), cfg)


def poison(e):
    with torch.no_grad():
        for t in e.model.state_dict().values():
            t.fill_(0.25) if t.is_floating_point() else t.zero_()


def state(e):
    return {k: v.clone() for k, v in e.model.state_dict().items()}


def record_segments() -> list[str]:
    """The names of the shared-memory segments this process's pushes create, as they are created
    (other tests' segments may come and go meanwhile: pytest-xdist runs them side by side)."""
    import lockstep.dist.shared_buckets as sb

    created = []

    class Recorded(sb.SharedMemory):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            created.append(self.name)

    sb.SharedMemory = Recorded
    return created


def _push_world(rank, transport):
    ctx = init_distributed(30.0, config=DISAGGREGATED)
    dev, wire = ctx.device, getattr(torch, dtype_of(ctx.device))
    if rank == 0:
        created = record_segments()
        trainer = new_policy(dev)
        manifest = build_manifest(trainer.model, wire, BUCKET)
        metrics = [push_weights(ctx, manifest, v, named_tensors=trainer.named_weights(), transport=transport)
                   for v in range(1, len(FORMATS) + 1)]
        bad = [(n, t.clone().fill_(float("nan")) if n == BIAS else t) for n, t in trainer.named_weights()]
        try:
            push_weights(ctx, manifest, len(FORMATS) + 1, named_tensors=bad, transport=transport)
        except Exception as e:
            return {"metrics": metrics, "nan_error": f"{type(e).__name__}: {e}", "buckets": len(manifest.buckets),
                    "segments": created}
        return {"metrics": metrics, "nan_error": None, "segments": created}
    new = dict(new_policy(dev).named_weights())  # the trainer's weights, made on this rank's GPU
    out = {"differs": {}, "versions": [], "asset_equal": {}, "metrics": []}
    for v, fmt in enumerate(FORMATS, start=1):
        pushed, reference = engine(fmt, device=dev), engine(fmt, device=dev)
        out["asset_equal"][fmt] = {n: torch.equal(state(reference)[n].to(new[n]), new[n]) for n in (TID2EID, BIAS)}
        reference.update_weights(new.items(), version=v)  # the in-process path
        poison(pushed)
        manifest = build_manifest(pushed.model, wire, BUCKET)
        out["metrics"].append(push_weights(ctx, manifest, None, engine=pushed, transport=transport))
        ref = reference.model.state_dict()
        out["differs"][fmt] = [n for n, t in pushed.model.state_dict().items() if not torch.equal(t, ref[n])]
        out["versions"].append(pushed.weight_version)
        out["n_tensors"] = len(ref)
    before = state(pushed)
    try:
        push_weights(ctx, manifest, None, engine=pushed, transport=transport)
    except Exception as e:
        out["nan_error"] = f"{type(e).__name__}: {e}"
    out["kept"] = all(torch.equal(t, before[n]) for n, t in pushed.model.state_dict().items())
    out["after_nan"] = (pushed.weight_version, pushed.paused)
    return out


def shared_segments() -> set[str]:
    """Python's shared-memory segments on this host (what a CPU shared push allocates)."""
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("psm_*")} if shm.is_dir() else set()


@pytest.mark.parametrize("transport", ["shared", "broadcast", "mapped"])
@pytest.mark.parametrize("device", world_devices())
def test_push_equals_in_process_update_in_every_format(device, transport):
    r0, r1 = run_world(_push_world, 2, guard_s=120 if device == "cpu" else 240, args=(transport,), device=device)
    assert r0.ok and r1.ok, (r0.error, r1.error)
    # shared memory on the CPU only; the source unlinked every bucket it made, the engine kept no mapping
    assert bool(r0.value["segments"]) == (transport == "shared" and device == "cpu")
    assert not set(r0.value["segments"]) & shared_segments()
    if device != "cpu":
        report(check=f"weight push ({transport}) vs in-process update ({device})", differing=r1.value["differs"],
               tensors=r1.value["n_tensors"], formats=FORMATS, trainer=r0.value["metrics"],
               engine=r1.value["metrics"], nan_push=r1.value.get("nan_error", "")[:200])
    assert r1.value["differs"] == {f: [] for f in FORMATS}, r1.value["differs"]
    assert r1.value["n_tensors"] > 100 and r1.value["versions"] == [1, 2, 3]
    # the routing tables really changed, so equality above means they travelled
    assert r1.value["asset_equal"]["bf16"] == {TID2EID: False, BIAS: False}
    m = r0.value["metrics"][0]  # 622k parameters, 4 bytes each in fp32 (CPU), 2 in bf16 (CUDA)
    assert m["perf/weight_sync_bytes"] >= (4 if device == "cpu" else 2) * 600_000 and m["perf/weight_sync_time"] > 0
    for metrics in (r0.value["metrics"][0], r1.value["metrics"][0]):  # each rank's phases, within the push's time
        phases = [metrics[f"perf/weight_sync/{phase}_time"] for phase in PHASES]
        assert all(t >= 0 for t in phases) and 0 < sum(phases) <= metrics["perf/weight_sync_time"]
    assert r1.value["metrics"][0]["perf/weight_sync/write_time"] > 0  # the engine wrote; the trainer had nothing to
    # a NaN in the router bias: engine rank 1 fails staging, both ranks abort, version 3 keeps serving
    assert r0.value["nan_error"].startswith("WeightPushError: rank 0: weight push v4 aborted, rank(s) [1]")
    assert "WeightPushError: rank 1: weight push v4 aborted" in r1.value["nan_error"]
    assert BIAS in r1.value["nan_error"] and "non-finite" in r1.value["nan_error"]
    assert r1.value["kept"] and r1.value["after_nan"] == (3, False)


def _kept_pool_world(rank):
    from lockstep.dist.shared_buckets import BucketPool

    ctx = init_distributed(30.0, config=DISAGGREGATED)
    pool, seen = BucketPool(), []
    if rank == 0:
        created = record_segments()
        trainer = new_policy()
        for v in (1, 2, 3, 4):
            if v == 3:  # the trainer moves on: new weights through the same buckets
                with torch.no_grad():
                    next(trainer.model.parameters()).add_(1.0)
            # push 4 cuts the weights into other buckets: new ones replace the pool's
            manifest = build_manifest(trainer.model, torch.float32, BUCKET if v < 4 else BUCKET // 2)
            push_weights(ctx, manifest, v, named_tensors=trainer.named_weights(), transport="shared", pool=pool)
            seen.append([b.tensor.data_ptr() for b in pool._own])
            seen.append(set(created) & shared_segments())  # named after the push: none
        pool.free()
        return seen, created
    pushed, reference = engine(), engine()
    new = new_policy()
    for v in (1, 2, 3, 4):
        if v == 3:
            with torch.no_grad():
                next(new.model.parameters()).add_(1.0)
        manifest = build_manifest(pushed.model, torch.float32, BUCKET if v < 4 else BUCKET // 2)
        poison(pushed)
        push_weights(ctx, manifest, None, engine=pushed, transport="shared", pool=pool)
        reference.update_weights(new.named_weights(), version=v)
        ref = reference.model.state_dict()
        seen.append(([id(m) for _, m in pool._mapped],
                     [n for n, t in pushed.model.state_dict().items() if not torch.equal(t, ref[n])]))
    pool.unmap()
    return seen


def test_a_kept_pool_reuses_its_buckets_and_mappings():
    """A BucketPool kept from push to push: the source packs into the same buckets and the engine
    keeps its mappings (made once), every push still equals the in-process update, new weights
    included, and no segment is left named in /dev/shm while the pool lives; a manifest cut into
    other buckets gets new buckets and new mappings, and still equals it."""
    r0, r1 = run_world(_kept_pool_world, 2, guard_s=120)
    assert r0.ok and r1.ok, (r0.error, r1.error)
    seen, created = r0.value
    ptrs, named = seen[0::2], seen[1::2]
    assert len(ptrs[0]) > 5 and ptrs[0] == ptrs[1] == ptrs[2] and len(ptrs[3]) > len(ptrs[0])
    assert len(created) == len(ptrs[0]) + len(ptrs[3])  # allocated twice: at the first push and the fourth
    assert named == [set()] * 4 and not set(created) & shared_segments()
    mappings, differs = zip(*r1.value)
    assert len(mappings[0]) == len(ptrs[0]) and mappings[0] == mappings[1] == mappings[2]
    assert len(mappings[3]) == len(ptrs[3]) and not set(mappings[3]) & set(mappings[0])
    assert differs == ([], [], [], []), differs


def _narrow_experts():
    import json

    cfg = json.loads((ASSET / "config.json").read_text())
    cfg["moe_intermediate_size"] = 32  # e.g. an engine started from another checkpoint
    model = model_class(cfg["model_type"])(config_from_hf_dict(cfg))
    return model


def _mismatch_world(rank):
    ctx = init_distributed(30.0, config=DISAGGREGATED)
    if rank == 0:
        trainer = Trainer(load_pretrained(ASSET), TrainConfig())
        push_weights(ctx, build_manifest(trainer.model, torch.float32, BUCKET), 1,
                     named_tensors=trainer.named_weights())
    else:
        e = engine(model=_narrow_experts())
        try:
            push_weights(ctx, build_manifest(e.model, torch.float32, BUCKET), None, engine=e)
        finally:
            assert e.weight_version == 0 and not e.paused


def test_manifest_mismatch_names_the_first_differing_tensor_on_both_ranks():
    r0, r1 = run_world(_mismatch_world, 2, guard_s=60)
    for r in (r0, r1):
        assert r.error_type == "ManifestMismatch", r.error
        assert f"rank {r.rank}: weight push v1: manifest mismatch at tensor #" in r.error
        assert ("the trainer (rank 0) sends model.layers.0.mlp.experts.gate_up_proj [8, 128, 64] float32, "
                "rank 1 expects model.layers.0.mlp.experts.gate_up_proj [8, 64, 64] float32") in r.error
        assert r.elapsed_s < 30


def _exit_after(n_calls, fn):
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == n_calls:
            os._exit(7)
        return fn(*args, **kwargs)
    return wrapped


def _dead_peer_world(rank, dying, transport):
    import lockstep.dist.weight_push as wp

    ctx = init_distributed(10.0, config=DISAGGREGATED)
    dev, wire = ctx.device, getattr(torch, dtype_of(ctx.device))
    if rank == 0:
        trainer = Trainer(load_pretrained(ASSET, device=dev), TrainConfig(dtype=dtype_of(dev)))
        tensors = trainer.named_weights()
        if dying == 0:  # the trainer dies while gathering its weights, a few buckets in
            die = _exit_after(40, lambda x: x)
            tensors = (die(x) for x in tensors)
        push_weights(ctx, build_manifest(trainer.model, wire, BUCKET), 1, named_tensors=tensors, transport=transport)
        return "pushed"
    e = engine(device=dev)
    before = state(e)
    if dying == 1:  # the engine dies while staging: its third bucket (broadcast), all of them at once (shared)
        wp.validate_update = _exit_after(3 if transport == "broadcast" else 1, wp.validate_update)
    try:
        push_weights(ctx, build_manifest(e.model, wire, BUCKET), None, engine=e, transport=transport)
    finally:
        kept = all(torch.equal(t, before[n]) for n, t in e.model.state_dict().items())
        assert kept and e.weight_version == 0 and not e.paused  # nothing committed, serving again


@pytest.mark.parametrize("transport", ["shared", "broadcast", "mapped"])
@pytest.mark.parametrize("device", world_devices())
@pytest.mark.parametrize("dying", [0, 1])
def test_dead_peer_mid_push_raises_naming_rank_and_step(dying, device, transport):
    results = run_world(_dead_peer_world, 2, guard_s=60, args=(dying, transport), device=device)
    dead, alive = results[dying], results[1 - dying]
    if device != "cpu":
        report(check=f"rank {dying} killed mid-push ({device}, {transport}), timeout 10s", dead_exitcode=dead.exitcode,
               alive_hung=alive.hung, alive_exitcode=alive.exitcode, alive_elapsed_s=alive.elapsed_s,
               alive_error=(alive.error or "").splitlines()[0] if alive.error else None)
    assert dead.exitcode == 7 and not alive.hung
    assert alive.error_type == "DistributedError", alive.error
    assert alive.error.startswith(f"rank {alive.rank}: weight push v1: "), alive.error
    steps = {"broadcast": ("broadcast bucket",), "shared": ("share bucket", "mapped"),
             "mapped": ("map weights",)}[transport]
    assert any(step in alive.error for step in steps) or "commit vote" in alive.error
    # from the rank's start: joining the world and building trainer / engine, then at most the 10 s
    # timeout (NCCL: the wait runs out; gloo: at once when the peer's socket closes)
    assert alive.elapsed_s < (20 if device == "cpu" else 30)


def test_transport_choice_is_checked(monkeypatch):
    """A transport name outside the four, or "shared" / "mapped" on a world spread over hosts, is refused
    by name; a pool of another transport's kind too."""
    from types import SimpleNamespace

    from lockstep.dist.push_transport import resolve_transport

    ctx = SimpleNamespace(rank=1, world_size=4)
    with pytest.raises(ValueError, match="one of .'auto', 'broadcast', 'shared', 'mapped'.*got 'nccl'"):
        resolve_transport(ctx, "nccl")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two nodes of two ranks
    for kind in ("shared", "mapped"):
        with pytest.raises(ValueError, match=f"rank 1: the {kind} weight-push transport needs every rank on one host"):
            resolve_transport(ctx, kind)
    assert resolve_transport(ctx, "broadcast") == "broadcast"


def _update_fails_world(rank):
    ctx = init_distributed(5.0, config=DISAGGREGATED)
    if rank == 0:
        trainer = new_policy()
        push_weights(ctx, build_manifest(trainer.model, torch.float32, BUCKET), 1,
                     named_tensors=trainer.named_weights(), transport="shared")
        return "pushed"
    e = engine()

    def broken(*args, **kwargs):
        raise RuntimeError("injected: the engine's write failed")
    e.update_weights = broken
    try:
        push_weights(ctx, build_manifest(e.model, torch.float32, BUCKET), None, engine=e, transport="shared")
    except RuntimeError as err:
        time.sleep(6)  # the engine lives on (a server would): past the world's 5 s timeout
        return f"raised: {err}"
    return "no error"


def test_an_engine_failing_after_the_vote_does_not_hold_the_trainer_at_release():
    """The engine's write fails after a successful vote: it still meets the trainer at the release
    barrier, so the trainer frees its shared buckets and returns instead of timing out there."""
    r0, r1 = run_world(_update_fails_world, 2, guard_s=60)
    assert r0.ok and r1.ok, (r0.error, r1.error)
    assert r0.value == "pushed" and r1.value == "raised: injected: the engine's write failed"
