"""Pipeline-parallel checkpoints on 2 gloo processes (lockstep/dist/pipeline_checkpoint.py): the
one-process files, written by the first stage, loaded by any process count. A PP=2 save resumed on
PP=2 (split 2 + 2 as saved, and 3 + 1) takes the unbroken run's next step bitwise; loaded into one
process it gives the same weights, optimiser state and next step; a one-process save loads into PP=2;
load errors reach every stage; a bf16 save holds every stage's fp32 masters. The stages, samples and
TrainConfig are test_pipeline_parallel.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dist_world import held_while_saving, rank_values, run_world
from lockstep.models import load_pretrained
from test_pipeline_parallel import ASSET, _train_config, _trainer_samples

def _pipeline_trainer(ctx, rank: int, dtype: str = "float32", last_stage_layers: int | None = None):
    from lockstep.dist.pipeline_parallel import PipelineParallel, split_model
    from lockstep.dist.pipeline_trainer import PipelineTrainer
    from lockstep.train.trainer import Trainer

    stage = split_model(load_pretrained(ASSET), rank, 2, last_stage_layers)
    trainer = Trainer(stage, _train_config().replace(pipeline_model_parallel_size=2, dtype=dtype))
    return PipelineTrainer(trainer, PipelineParallel(stage, ctx.trainer_group, ctx.device,
                                                     streams_dtype=getattr(torch, dtype), collective=ctx.collective))


def _step(trainer) -> dict:
    """One train step with pi_old from the trainer's logprobs (the loop's order)."""
    return trainer.train_step(_trainer_samples(), old_logprobs=trainer.logprobs(_trainer_samples()))


def _checkpoint_rank(rank: int, directory: str) -> dict:
    """Step, save, step (unbroken); fresh stages load the PP save (split 2 + 2 as saved, and 3 + 1), and
    the one-process save of one step (`one/`), and step; a save with a tensor of another model is refused."""
    from lockstep.dist.groups import init_distributed

    ctx = init_distributed(30.0)
    unbroken = _pipeline_trainer(ctx, rank)
    _step(unbroken)
    held = held_while_saving(unbroken.trainer, lambda: unbroken.save(f"{directory}/pp"))
    out = {"held_while_saving": held,"unbroken": _step(unbroken), "unbroken_weights": dict(unbroken.named_weights()),
           "gather_order": _gather_order(unbroken)}
    for name, save, last in (("pp", "pp", None), ("one", "one", None), ("pp-3+1", "pp", 1)):
        resumed = _pipeline_trainer(ctx, rank, last_stage_layers=last)
        resumed.load(f"{directory}/{save}")
        out[name] = {"num_steps": resumed.num_steps, "metrics": _step(resumed),
                     "weights": dict(resumed.named_weights())}
    for name in ("foreign", "absent"):
        try:
            _pipeline_trainer(ctx, rank).load(f"{directory}/{name}")
        except ValueError as e:
            out[name] = str(e)
    bf16 = _pipeline_trainer(ctx, rank, "bfloat16")  # fp32 masters apart from the bf16 weights
    _step(bf16)
    bf16.save(f"{directory}/pp-bf16")
    out["bf16"] = {"state": bf16.trainer.optimizer.state_dict(), "weights": dict(bf16.named_weights())}
    return out


def _gather_order(pipeline_trainer) -> list[str]:
    """What iterating a pipeline trainer's named_weights does, in order: "gather NAME" as this stage's
    Trainer yields its tensor (a gather of the shards under FSDP / EP), "get NAME" as the pipeline
    yields a tensor, this stage's or another's."""
    events, inner = [], pipeline_trainer.trainer.named_weights

    def recording():
        for name, t in inner():
            events.append(f"gather {name}")
            yield name, t

    pipeline_trainer.trainer.named_weights = recording
    try:
        for name, _ in pipeline_trainer.named_weights():
            events.append(f"get {name}")
    finally:
        del pipeline_trainer.trainer.named_weights
    return events


def _one_process_save(directory: Path):
    """A one-process Trainer after one step, saved to directory/one (and directory/foreign with an extra
    tensor); returns it with its weights and optimiser state at the save."""
    import shutil

    from safetensors.torch import load_file, save_file

    from lockstep.train.trainer import Trainer

    one = Trainer(load_pretrained(ASSET), _train_config())
    _step(one)
    one.save(directory / "one")
    shutil.copytree(directory / "one", directory / "foreign")
    tensors = load_file(directory / "one" / "model.safetensors")
    save_file({**tensors, "model.extra.weight": torch.zeros(2)}, directory / "foreign" / "model.safetensors")
    return one, dict(one.named_weights()), one.optimizer.state_dict()


def _assert_state_equal(got: dict, want: dict) -> None:
    assert (got["step"], got["lr"]) == (want["step"], want["lr"])
    assert list(got["state"]) == list(want["state"])
    for name, entry in want["state"].items():
        assert got["state"][name].keys() == entry.keys(), name
        for key, t in entry.items():
            assert torch.equal(got["state"][name][key], t), (name, key)


def _assert_weights_equal(got: dict, want: dict, what: str) -> None:
    assert list(got) == list(want), what
    for n, w in want.items():
        assert got[n].dtype == w.dtype, f"{what}: {n} is {got[n].dtype}, want {w.dtype}"
        assert torch.equal(got[n], w), f"{what}: {n} differs by {(got[n] - w).abs().max().item()}"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(the one-process Trainer after 2 steps, its weights and optimiser state after step 1, each stage's
    results, the directory of the saves)."""
    directory = tmp_path_factory.mktemp("pp-checkpoints")
    one, weights, state = _one_process_save(directory)
    results = rank_values(run_world(_checkpoint_rank, 2, guard_s=180, args=(str(directory),)))
    return one, weights, state, results, directory


def test_pp_save_resumes_on_pp_as_the_unbroken_run(checkpoints):
    """PP=2 save after a step, loaded into fresh PP=2 stages: the next step's metrics and weights are the
    unbroken run's, bitwise, also when the stages are cut elsewhere (3 + 1); the files are the one-process
    layout plus stage 1's RNG states."""
    _, _, _, results, directory = checkpoints
    assert sorted(p.name for p in (directory / "pp").iterdir()) == \
        ["model.safetensors", "optimizer.pt", "trainer.pt", "trainer.rank1.pt"]
    for rank, r in enumerate(results):
        for name in ("pp", "pp-3+1"):  # the same split as saved, and another
            assert r[name]["num_steps"] == 1, (rank, name)
            assert r[name]["metrics"] == r["unbroken"], (rank, name)
            _assert_weights_equal(r[name]["weights"], r["unbroken_weights"], f"rank {rank} resumed {name}")
    assert results[0]["unbroken"] == results[1]["unbroken"]


def test_a_stage_gathers_its_tensors_one_at_a_time_as_it_sends_them(checkpoints):
    """pipeline_named_weights takes a stage's next tensor from its Trainer only once the last was sent
    (the header from Trainer.weight_specs): never a whole stage's gathered tensors at once."""
    *_, results, _ = checkpoints
    for rank, r in enumerate(results):
        events = r["gather_order"]
        gathers = [i for i, e in enumerate(events) if e.startswith("gather ")]
        assert gathers and len(events) == len(gathers) + len(r["unbroken_weights"]), rank
        assert all(events[i + 1] == "get " + events[i][len("gather "):] for i in gathers), (rank, events)


def test_a_saving_stage_sends_each_tensor_before_it_gathers_the_next(checkpoints):
    """Each stage's save takes its next tensor (weights, then optimiser state) only once the last is sent
    to the first stage (or, there, copied to the host): none of them is alive when the next is gathered."""
    *_, results, _ = checkpoints
    for rank, r in enumerate(results):
        for kind, held in r["held_while_saving"].items():
            assert len(held) > 10 and max(held) == 0, (rank, kind, held)


def test_pp_save_loads_into_one_process(checkpoints):
    """The PP=2 save holds the whole model: one process loads it and has the weights and optimiser
    state of one process that took the same step, then takes the same next step."""
    from lockstep.train.trainer import Trainer

    one, weights, state, results, directory = checkpoints
    loaded = Trainer(load_pretrained(ASSET), _train_config())
    loaded.load(directory / "pp")
    assert loaded.num_steps == 1
    _assert_weights_equal(dict(loaded.named_weights()), weights, "one process from the PP save")
    _assert_state_equal(loaded.optimizer.state_dict(), state)
    metrics = _step(loaded)
    assert metrics["train/step"] == 2.0
    assert metrics == results[0]["unbroken"]
    _assert_weights_equal(dict(loaded.named_weights()), results[0]["unbroken_weights"], "after the next step")


def test_one_process_save_loads_into_pp(checkpoints):
    """A one-process save loaded by PP=2 stages (each takes its part): their next step is the one
    process's next step, metrics and every weight bitwise."""
    one, _, _, results, _ = checkpoints
    want = _step(one)
    for rank, r in enumerate(results):
        assert r["one"]["num_steps"] == 1 and r["one"]["metrics"] == want, rank
        _assert_weights_equal(r["one"]["weights"], dict(one.named_weights()), f"rank {rank} from the one-process save")


def test_pp_load_errors_reach_every_stage(checkpoints):
    """A tensor no stage holds, and a stage that cannot load (here: no such directory), fail on every stage
    (none is left waiting for the others), naming the file, or each failed stage."""
    *_, results, directory = checkpoints
    for r in results:
        assert r["foreign"] == (f"{directory / 'foreign' / 'model.safetensors'}: no pipeline stage holds "
                                "['model.extra.weight'] (1 in all): a checkpoint of another model")
        assert r["absent"].startswith("pipeline stage 0: ") and "; pipeline stage 1: " in r["absent"]
        assert str(directory / "absent" / "model.safetensors") in r["absent"]


def test_pp_bf16_save_holds_every_stage_s_masters(checkpoints):
    """bf16 stages keep fp32 masters in their optimiser state: the PP save's optimizer.pt is the stages'
    states together (masters included), and a one-process bf16 Trainer loads it."""
    from lockstep.train.trainer import Trainer

    *_, results, directory = checkpoints
    first, last = (r["bf16"]["state"] for r in results)
    assert not first["state"].keys() & last["state"].keys()
    for state in (first, last):  # bf16 weights have masters, those kept fp32 (sinks, norms) are their own
        assert 0 < sum("master" in entry for entry in state["state"].values()) < len(state["state"])
    loaded = Trainer(load_pretrained(ASSET), _train_config().replace(dtype="bfloat16"))
    loaded.load(directory / "pp-bf16")
    _assert_state_equal(loaded.optimizer.state_dict(), {**first, "state": {**first["state"], **last["state"]}})
    _assert_weights_equal(dict(loaded.named_weights()), results[0]["bf16"]["weights"], "one process from the bf16 save")
    assert {w.dtype for w in results[0]["bf16"]["weights"].values()} >= {torch.bfloat16, torch.float32}
