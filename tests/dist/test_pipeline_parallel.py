"""Pipeline-parallel trainer stages, 2 gloo processes, the bundled tiny DeepSeek-V4 in fp32
(DISTRIBUTED.md proof (c)).

PP=2: rank 0 holds the embedding and the first decoder layers (layer 0 routes by token id: the
hash-routed MoE), rank 1 the other layers, mHC's head, the final norm and the LM head; the mHC streams,
the input ids and (routing replay) the forced experts travel between them through
torch.distributed.pipelining (PipelineStage + Schedule1F1B, 3 micro-batches; ScheduleGPipe for 1 and
for the forward-only pass, whose logits are checked too).
One process: the whole model on the same micro-batches, one after the other, gradients accumulated.
The loss of a micro-batch is sum over its tokens of logp(next token) times a fixed per-token weight
(a stand-in for mask x advantage / normaliser). Every micro-batch's loss and every parameter's gradient
(each stage's, taken together: every parameter on exactly one stage) must be bitwise equal, for the
splits 2 + 2 and 3 + 1 (`--decoder-last-pipeline-num-layers 1`), with and without routing replay, and
in bf16 (the model cast as the single-process bf16 Trainer casts it; bf16 streams between the stages).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lockstep
from dist_world import rank_values, run_world
from lockstep.dist.pipeline_parallel import stage_layers
from lockstep.models import load_pretrained
from lockstep.models.deepseek_v4 import Routing
from lockstep.models.layers.kernel_switch import KernelSwitches, set_kernel_switches
from lockstep.models.precision import cast_model

ASSET = Path(lockstep.__file__).parent / "assets" / "tiny-dsv4"
VOCAB, N_LAYERS, TOP_K, N_EXPERTS = 103, 4, 2, 8
B, S = 2, 12  # rows per micro-batch, padded length

# name: (micro-batches, last stage's layers (None: even split), routing replay, dtype)
SCENARIOS = {"2+2": (3, None, False, "float32"), "2+2-replay": (3, None, True, "float32"),
             "3+1": (3, 1, False, "float32"), "2+2-gpipe-one-microbatch": (1, None, False, "float32"),
             "2+2-bf16": (3, None, False, "bfloat16"), "2+2-true-on-policy": (3, None, True, "float32"),
             "2+2-bf16-true-on-policy": (3, None, False, "bfloat16")}


def _model(dtype: str, device="cpu", name: str = ""):
    model = load_pretrained(ASSET, device=device)
    if dtype == "bfloat16":  # what the single-process bf16 Trainer computes in (precision.cast_model)
        cast_model(model, torch.bfloat16)
    # the true-on-policy forward (models/deepseek_v4_rows.py) through the stages
    return set_kernel_switches(model, KernelSwitches(true_on_policy=name.endswith("true-on-policy")))


def _batch(n_mb: int):
    """ids [n_mb B, S], forced experts [n_mb B, S, L, k] (distinct per token), weights [n_mb B, S - 1]."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, VOCAB, (n_mb * B, S), generator=g)
    ids[1, S - 4:] = 0  # a right-padded row, as variable-length samples give
    forced = torch.rand(n_mb * B, S, N_LAYERS, N_EXPERTS, generator=g).argsort(-1)[..., :TOP_K]
    weights = torch.randn(n_mb * B, S - 1, generator=g)
    weights[1, S - 5:] = 0
    return ids, forced, weights


def _loss_fn(ids: torch.Tensor, weights: torch.Tensor):
    """The loss of micro-batch rows `rows` from its logits [b, S, V]."""
    def loss(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        taken = logp.gather(-1, ids[rows, 1:].unsqueeze(-1)).squeeze(-1)
        return (taken * weights[rows]).sum()
    return loss


def _reference(name: str) -> dict:
    n_mb, _, replay, dtype = SCENARIOS[name]
    ids, forced, weights = _batch(n_mb)
    model, loss_fn = _model(dtype, name=name), _loss_fn(ids, weights)
    losses, logits = [], []
    for i in range(n_mb):
        rows = torch.arange(i * B, (i + 1) * B)
        routing = Routing(forced=forced[rows]) if replay else None
        with torch.no_grad():
            logits.append(model(ids[rows], routing=routing))
        loss = loss_fn(model(ids[rows], routing=routing), rows)
        loss.backward()
        losses.append(loss.detach())
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {"losses": losses, "logits": torch.cat(logits), "grads": grads,
            "params": [n for n, _ in model.named_parameters()]}


def _pp_rank(rank: int) -> dict:
    from lockstep.dist.groups import init_distributed
    from lockstep.dist.pipeline_parallel import PipelineParallel, split_model

    ctx = init_distributed(30.0)
    out = {}
    for name, (n_mb, last, replay, dtype) in SCENARIOS.items():
        ids, forced, weights = _batch(n_mb)
        stage = split_model(_model(dtype, ctx.device, name), rank, 2, last)
        pipe = PipelineParallel(stage, ctx.trainer_group, ctx.device, streams_dtype=getattr(torch, dtype),
                                collective=ctx.collective)
        first = {"microbatch_shape": (B, S), "forced": forced if replay and rank == 0 else None, "replay": replay}
        hidden = pipe.forward(ids if rank == 0 else None, n_mb, **first)
        with torch.no_grad():
            logits = None if hidden is None else stage.logits(hidden)
        loss_fn = _loss_fn(ids, weights)
        losses = pipe.train(ids if rank == 0 else None, lambda out, rows: loss_fn(stage.logits(out), rows), n_mb,
                            **first)
        out[name] = {"losses": losses, "logits": logits, "layers": list(stage.layer_ids),
                     "grads": {n: p.grad for n, p in stage.named_parameters() if p.grad is not None},
                     "params": [n for n, _ in stage.named_parameters()]}
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    """Every scenario on one 2-process world (starting processes costs more than the steps)."""
    return rank_values(run_world(_pp_rank, 2, guard_s=120))


def test_stage_layers():
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(4, 2, 1) == [range(0, 3), range(3, 4)]
    assert stage_layers(61, 4, 10) == [range(0, 17), range(17, 34), range(34, 51), range(51, 61)]
    assert stage_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert stage_layers(4, 1) == [range(0, 4)]
    with pytest.raises(ValueError, match="needs a layer"):
        stage_layers(4, 2, 4)
    with pytest.raises(ValueError, match="more stages"):
        stage_layers(2, 3)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_pp2_equals_one_process(two_ranks, name):
    want = _reference(name)
    first, last = (r[name] for r in two_ranks)
    n_mb, last_layers, _, _ = SCENARIOS[name]
    assert [first["layers"], last["layers"]] == [list(r) for r in stage_layers(N_LAYERS, 2, last_layers)]
    assert 0 in first["layers"]  # the hash-routed layer, on the stage that has the ids anyway
    assert first["logits"] is None and torch.equal(last["logits"], want["logits"])  # forward only
    assert first["losses"] is None and len(last["losses"]) == n_mb
    for i, (got, ref) in enumerate(zip(last["losses"], want["losses"])):
        assert torch.equal(got, ref), f"micro-batch {i}: loss {got.item()} != {ref.item()}"
    # every parameter on exactly one stage, named as in the full model
    assert not set(first["params"]) & set(last["params"])
    assert sorted(first["params"] + last["params"]) == sorted(want["params"])
    assert any(n.startswith("model.embed_tokens") for n in first["params"])
    assert "lm_head.weight" in last["params"] and "model.norm.weight" in last["params"]
    got = {**first["grads"], **last["grads"]}
    assert got.keys() == want["grads"].keys()
    for n, g in want["grads"].items():
        assert torch.equal(got[n], g), f"{name}: gradient of {n} differs by {(got[n] - g).abs().max().item()}"
    assert want["grads"]["model.embed_tokens.weight"].abs().sum() > 0  # the gradient crossed the stages


def test_config_fields_and_trainer_refusal():
    from lockstep.train.config import TrainConfig
    from lockstep.train.trainer import Trainer

    with pytest.raises(ValueError, match="pipeline_model_parallel_size"):
        TrainConfig(pipeline_model_parallel_size=0)
    with pytest.raises(ValueError, match="decoder_last_pipeline_num_layers"):
        TrainConfig(decoder_last_pipeline_num_layers=0)
    with pytest.raises(ValueError, match="split the model into its 2 stages first"):
        Trainer(load_pretrained(ASSET), TrainConfig(pipeline_model_parallel_size=2))
    from lockstep.dist.pipeline_parallel import split_model

    trainer = _stage_trainer(split_model(load_pretrained(ASSET), 1, 2))
    with pytest.raises(ValueError, match="holds one stage"):  # its forward needs the other stage
        trainer.logprobs(_trainer_samples())


def _hung_stage_world(rank: int, hung: int):
    import time

    from lockstep.dist.groups import init_distributed
    from lockstep.dist.pipeline_parallel import PipelineParallel, split_model

    ctx = init_distributed(2.0)
    if rank == hung:
        time.sleep(4)  # alive, but never runs its stage
        return "slept"
    ids, _, weights = _batch(2)
    stage = split_model(load_pretrained(ASSET), rank, 2)
    PipelineParallel(stage, ctx.trainer_group, ctx.device, collective=ctx.collective).train(
        ids if rank == 0 else None, _loss_fn(ids, weights), 2, microbatch_shape=(B, S))


@pytest.mark.parametrize("hung", [0, 1])
def test_hung_stage_times_out_naming_the_step(hung):
    """A stage whose peer never runs its part raises within the timeout (2 s), naming the schedule step."""
    results = run_world(_hung_stage_world, 2, guard_s=45, args=(hung,))
    waiting = results[1 - hung]
    assert results[hung].value == "slept"
    assert not waiting.hung and waiting.error_type == "DistributedError", waiting.error
    assert f"rank {1 - hung}: pipeline-parallel Schedule1F1B step (stage {1 - hung} of 2) timed out after 2s" \
        in waiting.error, waiting.error
    assert waiting.elapsed_s < 15, waiting.elapsed_s  # the configured 2 s (+ start-up), not gloo's default


def test_stage_refuses_streams_of_another_dtype():
    """The next stage receives into a buffer of the announced dtype: a mismatch fails before the send."""
    from lockstep.dist.pipeline_parallel import split_model

    stage = split_model(load_pretrained(ASSET), 0, 2)
    stage.streams_dtype = torch.bfloat16
    with pytest.raises(ValueError, match="streams are torch.float32, the pipeline was set up for torch.bfloat16"):
        stage(torch.ones(1, 4, dtype=torch.int64))


# The Trainer's own loss on the last stage: 2 micro-batches of 2 samples, each with a 10-token sample,
# so the padded [2, 10] batches are the ones the one-process Trainer runs (max_tokens_per_gpu 18)
LENGTHS, TRAIN_BUDGET = [(4, 6), (3, 4), (5, 5), (6, 2)], 18


def _trainer_samples(lengths=LENGTHS):
    """With rollout experts (routing replay reads them; the other runs ignore them); (prompt, response)
    lengths per sample."""
    from lockstep.sample import Sample

    g = torch.Generator().manual_seed(11)
    out = []
    for i, (p, r) in enumerate(lengths):
        mask = torch.ones(r, dtype=torch.int64)
        mask[0] = int(i != 2)
        experts = torch.rand(r, N_LAYERS, N_EXPERTS, generator=g).argsort(-1)[..., :TOP_K].sort(-1).values
        out.append(Sample(prompt_ids=torch.randint(1, VOCAB, (p,), generator=g),
                          response_ids=torch.randint(1, VOCAB, (r,), generator=g),
                          rollout_logprobs=-torch.rand(r, generator=g), loss_mask=mask, routed_experts=experts,
                          advantages=1.0 if i % 2 else -1.0, group_id=i // 2))
    return out


def _train_config(replay: bool = False):
    from lockstep.train.config import TrainConfig

    return TrainConfig(lr=1e-2, clip_grad=1e-5, max_tokens_per_gpu=TRAIN_BUDGET, use_tis=True, entropy_coef=0.01,
                       use_rollout_routing_replay=replay)


def _stage_trainer(stage, replay: bool = False):
    from lockstep.train.trainer import Trainer

    return Trainer(stage, _train_config(replay).replace(pipeline_model_parallel_size=2))


def _trainer_rank(rank: int) -> dict:
    from lockstep.dist.groups import init_distributed
    from lockstep.dist.pipeline_parallel import PipelineParallel, split_model
    from lockstep.dist.pipeline_trainer import pipeline_logprobs, trainer_forward_backward

    ctx = init_distributed(30.0)
    out = {}
    for replay in (False, True):
        stage = split_model(load_pretrained(ASSET), rank, 2)
        trainer = _stage_trainer(stage, replay)
        pipe = PipelineParallel(stage, ctx.trainer_group, ctx.device, collective=ctx.collective)
        logprobs = pipeline_logprobs(trainer, pipe, _trainer_samples())
        stats = trainer_forward_backward(trainer, pipe, _trainer_samples())
        out[replay] = {"stats": stats, "logprobs": logprobs,
                       "grads": {n: p.grad for n, p in stage.named_parameters() if p.grad is not None}}
    return out


@pytest.fixture(scope="module")
def trainer_ranks() -> list[dict]:
    return rank_values(run_world(_trainer_rank, 2, guard_s=120))


@pytest.mark.parametrize("replay", [False, True], ids=["routed", "routing-replay"])
def test_trainer_loss_on_the_last_stage(trainer_ranks, replay):
    """PP=2 with the Trainer's loss (PPO clip, TIS, entropy bonus, global token normaliser) computed on the
    last stage: every metric (loss terms, train/rollout mismatch) and every gradient bitwise those of
    `Trainer.forward_backward` in one process, and the logprobs `Trainer.logprobs`; with routing replay
    too (the prompts' own routing through a forward-only pipeline, the rollout's experts forced)."""
    from lockstep.dist.pipeline_trainer import pad_microbatches
    from lockstep.train.logprobs import pack_microbatches
    from lockstep.train.trainer import Trainer

    samples = _trainer_samples()
    mbs = pack_microbatches(samples, TRAIN_BUDGET)
    assert [mb.indices for mb in mbs] == [[0, 1], [2, 3]]
    assert pad_microbatches(mbs)[1:] == (2, 10)
    first, last = (r[replay] for r in trainer_ranks)
    one = Trainer(load_pretrained(ASSET), _train_config(replay))
    want_logprobs = one.logprobs(samples)
    for r in (first, last):
        assert all(torch.equal(g, w) for g, w in zip(r["logprobs"], want_logprobs, strict=True))
    if replay:  # the forced experts change the forward
        assert not torch.equal(torch.cat(last["logprobs"]), torch.cat(trainer_ranks[1][False]["logprobs"]))
    want = one.forward_backward(samples)
    assert first["stats"] is None and last["stats"].keys() == want.keys()
    for k, v in last["stats"].items():
        assert v == want[k], (k, v, want[k])
    assert want["train/pg_loss"] != 0
    got = {**first["grads"], **last["grads"]}
    ref = {n: p.grad for n, p in one.model.named_parameters() if p.grad is not None}
    assert got.keys() == ref.keys()
    for n, g in ref.items():
        assert torch.equal(got[n], g), f"gradient of {n} differs by {(got[n] - g).abs().max().item()}"


def _train_step_rank(rank: int) -> dict:
    """Through `PipelineTrainer`, the Trainer seam a loop calls (logprobs, train_step, named_weights)."""
    from lockstep.dist.groups import init_distributed
    from lockstep.dist.pipeline_parallel import PipelineParallel, split_model
    from lockstep.dist.pipeline_trainer import PipelineTrainer

    ctx = init_distributed(30.0)
    stage = split_model(load_pretrained(ASSET), rank, 2)
    trainer = PipelineTrainer(_stage_trainer(stage),
                              PipelineParallel(stage, ctx.trainer_group, ctx.device, collective=ctx.collective))
    out = []
    for _ in range(2):
        logprobs = trainer.logprobs(_trainer_samples())
        metrics = trainer.train_step(_trainer_samples(), old_logprobs=logprobs)
        out.append({"metrics": metrics, "logprobs": logprobs,
                    "weights": {n: p.detach().clone() for n, p in stage.named_parameters()}})
    out.append(list(trainer.named_weights()))
    return out


def test_two_optimiser_steps_over_the_stages():
    """Through PipelineTrainer: two PP=2 train steps (clipping binds: the norm is the one over both stages'
    gradients) leave every parameter bitwise where two one-process `Trainer.train_step`s leave it; every
    stage reports all of train_step's metrics, equal; the logprobs before each step (`logprobs`, passed
    as pi_old) are `Trainer.logprobs`; afterwards every stage gathers `named_weights` of the whole model,
    the one process's in its order."""
    from lockstep.train.trainer import Trainer

    results = run_world(_train_step_rank, 2, guard_s=120)
    assert all(r.ok for r in results), [r.error for r in results]
    one = Trainer(load_pretrained(ASSET), _train_config())
    for step in range(2):
        want_logprobs = one.logprobs(_trainer_samples())
        for r in results:  # before the step, on every stage
            got_logprobs = r.value[step]["logprobs"]
            assert len(got_logprobs) == len(want_logprobs)
            for i, (g, w) in enumerate(zip(got_logprobs, want_logprobs)):
                assert torch.equal(g, w), (step, r.rank, i)
        want = one.train_step(_trainer_samples(), old_logprobs=want_logprobs)
        assert want["train/grad_norm"] > _train_config().clip_grad and not want["train/skipped"]
        weights = {n: p.detach() for n, p in one.model.named_parameters()}
        got = {}
        for r in results:
            metrics = r.value[step]["metrics"]
            assert metrics.keys() == want.keys(), (step, r.rank, metrics.keys() ^ want.keys())
            for k, v in metrics.items():
                assert v == want[k], (step, r.rank, k, v, want[k])
            got.update(r.value[step]["weights"])
        assert got.keys() == weights.keys()
        for n, w in weights.items():
            assert torch.equal(got[n], w), f"step {step}: {n} differs by {(got[n] - w).abs().max().item()}"
    want_weights = list(one.named_weights())  # parameters and buffers (tid2eid, router bias), in order
    for r in results:
        got_weights = r.value[2]
        assert [n for n, _ in got_weights] == [n for n, _ in want_weights], r.rank
        for (n, g), (_, w) in zip(got_weights, want_weights):
            assert torch.equal(g, w), (r.rank, n)
