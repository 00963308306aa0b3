"""Pipeline parallel x expert parallel trainer, gloo, the bundled tiny DeepSeek-V4 (fp32, and bf16).

PP2 x EP2: 4 processes, two pipelines of two stages (ranks {0, 2} and {1, 3}); each stage's 8 routed
experts sharded over its two ranks (ranks {0, 1} hold stage 0, {2, 3} stage 1), pipeline p trains
block p of the batch. PP2 x EP1: 2 processes, one pipeline, the whole batch. Both are driven as the
RL loop drives them (`pipeline_expert_trainer`: TrainerShard over PipelineTrainer; every rank passes
the whole batch), two steps each with the logprobs before the step passed as pi_old.

Checked: the grid (which rank holds which stage of which pipeline, 4 experts a layer per rank), the
logprobs before each step, every metric of each step, every parameter's gradient at the first step
(each stage's, expert shards gathered) and the whole model's weights after each step (named_weights,
on every rank).

Bitwise where it can be: one micro-batch a pipeline, in fp32, in bf16 (bf16 streams between the stages,
fp32 masters), and with routing replay (one pipeline's prompts a single token: it has no prompt to
route, yet runs the forward the other pipeline's experts wait for).
Each stage's expert gradient is then A + B (one backward, the two pipelines' rows in separate GEMMs,
expert_parallel.py) and each replicated gradient A + B (the all-reduce of two), which is what one
pipeline accumulating micro-batch A then B computes.

Rounding where it must: pipeline 0 with two micro-batches (A0, A1: Schedule1F1B), pipeline 1 with one
(B0, repeated at zero weight for the count), one pipeline with A0, A1, B0. The logprobs and the loss
metrics are still bitwise (the same padded micro-batches; the loss terms summed (A0 + A1) + B0 in both),
but an expert's gradient is summed in micro-batch pairs, (A0 + B0) + A1, where one pipeline sums
(A0 + A1) + B0; the replicated gradients keep the one-pipeline order. No order of the one pipeline's
micro-batches gives both sums, so the gradients and everything after (grad norm, weights) differ in
the last bits: asserted within tolerances measured here (see CLOSE).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

import lockstep
from dist_world import rank_values, run_world
from lockstep.models import load_pretrained
from test_pipeline_parallel import _trainer_samples

ASSET = Path(lockstep.__file__).parent / "assets" / "tiny-dsv4"
N_LAYERS, N_EXPERTS, PP, STEPS = 4, 8, 2, 2

# name: ((prompt, response) lengths, max_tokens_per_gpu, routing replay, dtype). The blocks are the
# batch's halves; "1f1b-uneven": pipeline 0 packs [0], [1, 2], pipeline 1 [3, 4, 5], one pipeline all three
SCENARIOS = {"one-microbatch": ([(4, 6), (3, 4), (5, 5), (6, 2)], 18, False, "float32"),
             "routing-replay": ([(1, 9), (1, 6), (5, 5), (6, 2)], 18, True, "float32"),
             "bf16": ([(4, 6), (3, 4), (5, 5), (6, 2)], 18, False, "bfloat16"),
             "1f1b-uneven": ([(4, 6), (5, 4), (4, 4), (3, 2), (4, 2), (2, 2)], 18, False, "float32")}
EXACT = ("one-microbatch", "routing-replay", "bf16")
# "1f1b-uneven"'s limits, about 8-10x the largest differences measured (x86 CPU, torch 2.13): expert
# gradients 1.2e-7 of the tensor's largest entry, weights 3.0e-8 after the first step and 1.2e-7 after
# the second (lr 1e-2), the second step's logprobs 4.8e-6, its metrics 1.9e-8 (relative above 1)
CLOSE = {"grad": 1e-6, "weights": 1e-6, "logprobs": 5e-5, "metrics": 2e-7}


def _samples(name: str):
    return _trainer_samples(SCENARIOS[name][0])


def _config(name: str, ep: int):
    from lockstep.train.config import TrainConfig

    _, budget, replay, dtype = SCENARIOS[name]
    # a large lr and a clip that binds: every parameter moves, by the norm over all stages and shards
    return TrainConfig(lr=1e-2, clip_grad=1e-5, max_tokens_per_gpu=budget, use_tis=True, entropy_coef=0.01,
                       weight_decay=0.01, use_rollout_routing_replay=replay, pipeline_model_parallel_size=PP,
                       expert_model_parallel_size=ep, dtype=dtype)


def _record_grads(stage_trainer, grads: dict) -> None:
    """The stage's gradients as the first optimiser step sees them (expert shards gathered: a collective
    over the ep group, whose ranks step together)."""
    from lockstep.train.data_parallel import gather_full

    launch = stage_trainer.optimizer.launch  # what train_step and optimiser_step call

    def recording_launch(*args, **kwargs):
        if not grads:
            for name, p in stage_trainer.model.named_parameters():
                g = p.grad
                if g is not None:
                    grads[name] = (gather_full(g) if isinstance(g, DTensor) else g).clone()
        return launch(*args, **kwargs)

    stage_trainer.optimizer.launch = recording_launch


def _trace(trainer, samples) -> dict:
    stage_trainer = trainer.trainer.trainer  # TrainerShard -> PipelineTrainer -> the stage's Trainer
    out = {"grads": {}, "logprobs": [], "metrics": [], "weights": []}
    _record_grads(stage_trainer, out["grads"])
    for _ in range(STEPS):
        logprobs = trainer.logprobs(samples)
        out["metrics"].append(trainer.train_step(samples, old_logprobs=logprobs))
        out["logprobs"].append(logprobs)
        # cloned: a stage's own tensors come back as the live parameters, which the next step updates
        out["weights"].append({n: t.clone() for n, t in trainer.named_weights()})
    return out


def _resume(make, samples, directory: str) -> dict:
    """Step, save, step (unbroken); a fresh trainer loads the save and steps again."""
    unbroken = make()
    unbroken.train_step(samples)
    unbroken.save(directory)
    out = {"unbroken": unbroken.train_step(samples), "unbroken_weights": dict(unbroken.named_weights())}
    resumed = make()
    resumed.load(directory)
    out.update(resumed=resumed.train_step(samples), resumed_weights=dict(resumed.named_weights()))
    return out


def _rank(rank: int, ep: int, checkpoint: str | None = None) -> dict:
    from lockstep.dist.expert_parallel import ExpertParallelExperts
    from lockstep.dist.groups import init_distributed
    from lockstep.dist.pipeline_expert_parallel import pipeline_expert_trainer
    from lockstep.dist.pipeline_grid import pipeline_grid

    ctx = init_distributed(60.0)
    grid = pipeline_grid(ctx, PP)
    out = {"grid": (grid.stage, grid.pipeline, grid.ep)}
    def make(name: str):
        # loaded in the compute dtype, as the loop loads a pipeline's policy (lockstep/rl/data_parallel.py)
        config = _config(name, ep)
        return pipeline_expert_trainer(load_pretrained(ASSET, dtype=getattr(torch, config.dtype)), config, grid,
                                       ctx.device, ctx.collective, ctx)

    for name in SCENARIOS:
        trainer = make(name)
        out[name] = _trace(trainer, _samples(name))
        out["local_experts"] = [m.expert_weights()[0].shape[0] for m in trainer.trainer.pipe.stage.modules()
                                if isinstance(m, ExpertParallelExperts)]
    if checkpoint is not None:
        out["resume"] = _resume(lambda: make("one-microbatch"), _samples("one-microbatch"), checkpoint)
    return out


@pytest.fixture(scope="module")
def one_pipeline() -> list[dict]:
    """PP2 x EP1: the whole batch through one pipeline (proven equal to one process by
    test_pipeline_parallel.py)."""
    return rank_values(run_world(_rank, 2, guard_s=150, args=(1,)))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pp-ep-checkpoint")


@pytest.fixture(scope="module")
def two_pipelines(checkpoint) -> list[dict]:
    """PP2 x EP2: every scenario on one 4-process world (starting processes costs more than the steps)."""
    return rank_values(run_world(_rank, 4, guard_s=240, args=(2, str(checkpoint))))


def _stage_grads(results: list[dict], name: str, pipeline: int = 0) -> dict:
    """Every parameter's gradient: the stages of one pipeline taken together (the ep ranks agree)."""
    return {n: g for r in results if r["grid"][1] == pipeline for n, g in r[name]["grads"].items()}


def _diff(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape and got.dtype == want.dtype
    return float((got.double() - want.double()).abs().max()) if got.numel() else 0.0


def test_grid_layout(two_pipelines, one_pipeline):
    # trainer rank index i = stage * ep + pipeline: each stage's ep ranks consecutive (pipeline_grid.py)
    assert [r["grid"] for r in two_pipelines] == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    assert [r["grid"] for r in one_pipeline] == [(0, 0, 1), (1, 0, 1)]
    assert [r["local_experts"] for r in two_pipelines] == [[N_EXPERTS // 2] * (N_LAYERS // PP)] * 4
    assert [r["local_experts"] for r in one_pipeline] == [[], []]  # EP1: the model's own Experts


@pytest.mark.parametrize("name", EXACT)
def test_pp2_ep2_equals_pp2_ep1_bitwise(two_pipelines, one_pipeline, name):
    want = one_pipeline[0][name]
    assert want["metrics"][0]["train/grad_norm"] > _config(name, 1).clip_grad  # clipping binds
    for step in range(STEPS):
        for r in two_pipelines + one_pipeline:  # every rank reports the same
            got = r[name]
            assert got["metrics"][step] == want["metrics"][step], (r["grid"], step)
            for i, (g, w) in enumerate(zip(got["logprobs"][step], want["logprobs"][step], strict=True)):
                assert torch.equal(g, w), (r["grid"], step, i)
            assert list(got["weights"][step]) == list(want["weights"][step])  # names, in order
            for n, w in want["weights"][step].items():
                assert torch.equal(got["weights"][step][n], w), (r["grid"], step, n, _diff(got["weights"][step][n], w))
    reference = _stage_grads(one_pipeline, name)
    for pipeline in (0, 1):
        got = _stage_grads(two_pipelines, name, pipeline)
        assert got.keys() == reference.keys()
        for n, g in reference.items():
            assert torch.equal(got[n], g), (pipeline, n, _diff(got[n], g))
    _experts_on_both_ranks(reference)


def _experts_on_both_ranks(grads: dict) -> None:
    """Every MoE layer's experts on both ep ranks had tokens: the dispatch really crossed the pipelines."""
    for layer in range(N_LAYERS):
        per_expert = grads[f"model.layers.{layer}.mlp.experts.down_proj"].abs().flatten(1).sum(1)
        assert per_expert[:N_EXPERTS // 2].sum() > 0 and per_expert[N_EXPERTS // 2:].sum() > 0, layer


def test_pp2_ep2_uneven_microbatches_round_only(two_pipelines, one_pipeline):
    """Two micro-batches in pipeline 0, one in pipeline 1 (module docstring): the first step's logprobs and
    metrics (grad norm included: fp64 squares) bitwise, its gradients and weights bitwise but for the
    experts', those within CLOSE; the second step (from weights that differ) within CLOSE."""
    name = "1f1b-uneven"
    want = one_pipeline[0][name]
    assert want["metrics"][0]["train/num_microbatches"] == 3.0
    reference = _stage_grads(one_pipeline, name)
    for pipeline in (0, 1):
        got = _stage_grads(two_pipelines, name, pipeline)
        for n, g in reference.items():
            limit = CLOSE["grad"] * float(g.abs().max()) if ".mlp.experts." in n else 0.0
            assert _diff(got[n], g) <= limit, (pipeline, n, _diff(got[n], g))
    for r in two_pipelines:
        got = r[name]
        assert got["metrics"][0] == want["metrics"][0]
        assert all(torch.equal(g, w) for g, w in zip(got["logprobs"][0], want["logprobs"][0], strict=True))
        for n, w in want["weights"][0].items():
            limit = CLOSE["weights"] if ".mlp.experts." in n else 0.0
            assert _diff(got["weights"][0][n], w) <= limit, (r["grid"], n)
        assert max(_diff(g, w) for g, w in zip(got["logprobs"][1], want["logprobs"][1])) <= CLOSE["logprobs"]
        for k, v in got["metrics"][1].items():
            assert abs(v - want["metrics"][1][k]) <= CLOSE["metrics"] * max(1.0, abs(v)), (k, v, want["metrics"][1][k])
        assert max(_diff(got["weights"][1][n], w) for n, w in want["weights"][1].items()) <= CLOSE["weights"]


def test_resume_from_two_pipelines(two_pipelines, checkpoint):
    """The PP2 x EP2 save (the one-process files, written by stage 0 of pipeline 0 alone) resumes PP2 x EP2
    exactly, and one process (today's Trainer, the same two padded micro-batches) that loads it takes the
    same next step on all the samples."""
    from lockstep.train.trainer import Trainer

    assert sorted(p.name for p in (checkpoint).iterdir()) == \
        ["model.safetensors", "optimizer.pt", "trainer.pt", "trainer.rank1.pt"]
    for r in two_pipelines:
        got = r["resume"]
        assert got["resumed"] == got["unbroken"], r["grid"]
        for n, w in got["unbroken_weights"].items():
            assert torch.equal(got["resumed_weights"][n], w), (r["grid"], n)
    one = Trainer(load_pretrained(ASSET), _config("one-microbatch", 1).replace(pipeline_model_parallel_size=1))
    one.load(checkpoint)
    unbroken = two_pipelines[0]["resume"]
    assert one.train_step(_samples("one-microbatch")) == unbroken["unbroken"]
    for n, w in one.named_weights():
        assert torch.equal(w, unbroken["unbroken_weights"][n]), n


def test_refusals():
    """What is not built is refused with a sentence: pipelines in data parallel without their experts
    sharded over them, EP other than the pipelines' count, a config whose EP is not the grid's."""
    from lockstep.dist.pipeline_grid import grid_ranks
    from lockstep.rl.data_parallel import pipeline_refusal

    assert pipeline_refusal(_config("one-microbatch", 2), None, 4, True) is None
    assert pipeline_refusal(_config("one-microbatch", 1), None, 2, True) is None
    assert "data parallel across pipelines without EP" in pipeline_refusal(_config("one-microbatch", 1), None, 4, True)
    assert "run 8 processes" in pipeline_refusal(_config("one-microbatch", 4), None, 4, True)
    assert grid_ranks((0, 1, 2, 3, 4, 5), 3) == ([(0, 2, 4), (1, 3, 5)], [(0, 1), (2, 3), (4, 5)])
    with pytest.raises(ValueError, match="do not split into whole pipelines"):
        grid_ranks((0, 1, 2), 2)


def test_lockstep_train_pp4_ep2_on_eight_processes_logs_the_metrics_of_one_process_and_resumes(tmp_path,
                                                                                              one_process):
    """Issue 19's layout itself, PP 4 x EP 2 on 8 gloo processes (one decoder layer a stage, the last with
    the head; 2 pipelines, each stage's experts sharded over its 2 ranks; recompute, optimizer offload),
    with the colocated engines expert-parallel over all 8 ranks (`--rollout-expert-parallel-size 8`: one
    routed expert a layer each), in two halves (below): bitwise the one-process run. 4 stages make the
    1F1B schedule's warm-up and cool-down longer than 2 do, every stage but the first receives the mHC
    streams, the input ids and the replayed routing, the save gathers 4 stages' weights and optimizer
    state, and every engine rank keeps its expert of each pushed layer. `lockstep train --nproc-per-node 4
    --pipeline-model-parallel-size 2 --expert-model-parallel-size 2` ran the same halves too (~40-110 s on
    2 cores) until the suite's 15-minute budget came close: this run proves all it did, and that layout
    still trains through the CLI until a rank is killed (test_rank_killed.py) and is bitwise the
    PP 2 x EP 1 run in-process (above). Each run: test_train_world.py's 2-rollout run in two halves, its
    first rollout, saved, then resumed from that save (each rank reading only its stage and its experts,
    pipeline_parallel.load_stage) for the second, against the one-process run (tests/dist/conftest.py,
    run once a session) metrics.jsonl line by line bitwise (perf/* aside; the first half's eval after its
    last rollout aside, which the unbroken run has not). test_train_world.py's RUN makes it so: a
    batch-invariant engine, and a budget that packs each pipeline's block of 8 samples into one
    micro-batch, one process the 16 into the same two, each padded to [8, 22]."""
    _halves_log_the_metrics_of_one_process(tmp_path, one_process, pp=4, nproc=8,
                                           engines=["--rollout-expert-parallel-size", "8"])


def _halves_log_the_metrics_of_one_process(tmp_path, one_process, pp: int, nproc: int, engines=()) -> None:
    from dist_world import free_port
    from test_train_world import _first_difference, _perf_free, _train, _without_end_eval

    layout = ["--nproc-per-node", str(nproc), "--pipeline-model-parallel-size", str(pp),
              "--expert-model-parallel-size", "2", "--decoder-last-pipeline-num-layers", "1",
              "--recompute-activations", "--optimizer-offload", *engines]
    stderr: list[str] = []
    first = _train(tmp_path / "first", *layout, "--num-rollout", "1", "--save", str(tmp_path / "save"),
                   "--master-port", str(free_port()), stderr=stderr)
    if engines:  # each rank's engine says which experts it keeps: one block of the 8 a rank
        for rank in range(nproc):
            block = f"[{rank * 8 // nproc}, {(rank + 1) * 8 // nproc})"
            assert f"rank {rank}: expert parallel over {nproc} ranks, experts {block} of 8" in stderr[0], rank
    config = __import__("json").loads((tmp_path / "first" / "config.json").read_text())
    train = config["train"]
    assert (config["world_size"], train["pipeline_model_parallel_size"], train["expert_model_parallel_size"],
            train["recompute_activations"], train["optimizer_offload"]) == (nproc, pp, 2, True, True)
    assert [line["train/num_microbatches"] for line in first if "train/step" in line] == [2.0]
    halves = [first[0], _without_end_eval(first[1])]
    assert len(first) == 2 and _first_difference(one_process[:2], halves) is None, \
        _first_difference(one_process[:2], halves)
    resumed = _train(tmp_path / "resumed", *layout, "--load", str(tmp_path / "save"), "--master-port", str(free_port()))
    assert len(resumed) == 1 and resumed[0].pop("data/skipped_rows") == 0.0  # each run's first line has it
    assert resumed[0]["train/step"] == 2.0
    assert _perf_free(resumed[0]) == _perf_free(one_process[-1])
