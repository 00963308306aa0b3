"""`lockstep train` on 2 gloo processes (DISTRIBUTED.md proof (g)) and a peer dying mid-run.

(g) A 2-rollout run on 2 processes (`--nproc-per-node 2`: torch's launcher, colocated engine
replicas, FSDP trainer) against the same run on 1 process, metrics.jsonl line by line: every metric
but the perf/* timings bitwise equal, train/num_microbatches included. Two flags make this so (RUN):

- `--batch-invariant`: each engine runs every sequence in a forward call of its own, so a sample's
  logprobs do not depend on the batch a replica or the one engine ran it in (without it they move
  by ~1e-7 on the CPU, tests/dist/test_replicas.py).
- `--max-tokens-per-gpu 172`: each rank trains its block of 8 samples (`replicas.shard`), and 172 is
  the tokens of either block in each of the 2 steps (4 x 21 + 4 x 22; a 9th sample would exceed it),
  so each rank packs its block into one micro-batch and one process packs the same two micro-batches
  (greedy in-order packing, train/logprobs.py). FSDP's reduce-scatter then sums the same two
  micro-batch gradients one process accumulates (test_fsdp.py), and the ranks' summed metrics are
  one process's sums over its micro-batches. The test checks the packing: 2 micro-batches in both.

Either flag alone leaves train/* metrics differing from the first train step on (measured over 3
steps: 28 values with the budget alone, 23 with the batch-invariant engine alone).

Without them (the defaults: non-invariant engine, 8192 tokens: one process packs the 16 samples into
one micro-batch, the ranks into two) the tokens and every metric fixed by them are still the same,
and the train/* metrics agree to ~2e-3 relative (what this test accepted before; the two causes above).
Rollout 2 is sampled from the weights trained on 2 processes, so equal tokens there also say the
pushed weights are the trained ones; the eval after it scores the second step's (its Adam moments
those of the first step). Two rollouts, not more: each `lockstep train` start is ~20 s on a 2-core
machine and a rollout ~4 s, and a third step runs nothing the second does not.

Disaggregated 1 + 1 (`--actor-num-gpus 1 --rollout-num-gpus 1`: rank 0 trains on FSDP, rank 1
serves, the weights pushed over gloo after every step) against 1 process: every metric bitwise
equal. One engine sees the whole batch as the single process's engine does, one trainer rank the
whole step, and the push is torch.equal to the in-process update (test_weight_push.py).

Four other ways to run the 2-process run each log its metrics bitwise: with the routed experts
sharded instead of FSDP (`--expert-model-parallel-size 2`); with the engines' routed experts sharded
(`--rollout-expert-parallel-size 2`: one expert-parallel engine, each rank serving its block); its flags
read from a `--layout` file (lockstep plan --json's format); and in two halves, its first rollout
started by two launchers (`--nnodes 2 --node-rank 0|1 --nproc-per-node 1`, the multi-node command run
twice on this machine) and saved, its second resumed from that save on 2 processes of one launcher.
The two expert-parallel ways and the layout file are one run: the file's flags shard both sides' experts.

Pipeline parallel (`--pipeline-model-parallel-size 2 --decoder-last-pipeline-num-layers 1`: the trainer
group is the pipeline, layers 0-2 on rank 0 and 3 with the head on rank 1, every rank training the
whole batch through PipelineTrainer, each colocated engine taking the whole model's weights) logs
every metric of 1 process bitwise. The pipeline pads every micro-batch of a step to one [b, S] (the
most samples in one, the longest sample; lockstep/dist/pipeline_parallel.py), one process pads each
to its own longest sample: with the 172-token budget both pack each step's 16 samples into the same
two micro-batches of 8, and each holds a sample of the step's longest length (the 4 x 21 + 4 x 22
above), so both pad them to [8, 22] and run the same GEMMs (checked: 2 micro-batches in both).
That run takes its flags from `lockstep plan --colocate --json`'s entry (`--layout`), the plan's
memory per stage and phase set against its per-rank peaks, and runs in two halves: its first rollout
saved (the one-process checkpoint, written by stage 0), its second resumed on PP=2 from that save.
A PP other than the trainer ranks is refused before any process starts.

A peer that exits mid-run, or hangs, ends the run on the other rank with DistributedError naming the
rank and the operation (at once for an exit, at --distributed-timeout for a hang).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time

import pytest

from dist_world import free_port, run_world
from lockstep.plan.measured import compare
from lockstep.rl.embedded import ASSET_DIR  # lockstep train's default model
from lockstep.rl import save_layout
from processes import cli_env

# 4 eval prompts: 2 a rank, still sharded (an eval of 8 cost ~1.6 s at step 0 and after the last rollout)
SIZES = ["--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--eval-interval", "2",
         "--eval-prompts-limit", "4", "--no-plot"]
# the runs compared with one another: a batch-invariant engine, and micro-batches cut where the ranks' blocks are
RUN = [*SIZES, "--batch-invariant", "--max-tokens-per-gpu", "172"]


def _train(run_dir, *flags, stderr: list | None = None) -> list[dict]:
    """metrics.jsonl of `lockstep train RUN FLAGS`; its stderr appended to `stderr` when given."""
    env = cli_env()
    cmd = [sys.executable, "-m", "lockstep.cli", "train", *RUN, "--run-dir", str(run_dir), *flags]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    if stderr is not None:
        stderr.append(proc.stderr)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# one_process and two_processes, the runs the others are compared with: tests/dist/conftest.py
# (session-scoped: test_ray_launch.py and test_pipeline_expert_parallel.py compare with them too)


def saved(directory):
    """The directory of the save `directory` holds (lockstep/rl/save_layout.py)."""
    return save_layout.read(directory)[1]


def _perf_free(line: dict) -> dict:
    return {k: v for k, v in line.items() if not k.startswith("perf/")}


def test_disaggregated_one_plus_one_logs_the_metrics_of_one_process(tmp_path, one_process):
    two = _train(tmp_path, "--nproc-per-node", "2", "--actor-num-gpus", "1", "--rollout-num-gpus", "1",
                 "--master-port", str(free_port()))
    assert [_perf_free(line) for line in two] == [_perf_free(line) for line in one_process]
    pushed = [line["perf/weight_sync_bytes"] for line in two if "perf/weight_sync_bytes" in line]
    assert len(pushed) == 2 and min(pushed) > 2_000_000  # a push over torch.distributed after every step


def _first_difference(want: list[dict], got: list[dict]):
    """(line, step, metric, want, got) of the first metric that differs, perf/* aside; None if none."""
    for i, (w, g) in enumerate(zip(want, got)):
        for k in sorted(k for k in set(w) | set(g) if not k.startswith("perf/")):
            if w.get(k, "missing") != g.get(k, "missing"):
                return i, w.get("step"), k, w.get(k, "missing"), g.get(k, "missing")
    return None


def test_two_processes_log_the_metrics_of_one(one_process, two_processes):
    one, two = one_process, two_processes
    assert len(one) == len(two) == 3  # step 0's eval, then 2 rollouts
    train_lines = [line for line in one if "train/step" in line]
    assert len(train_lines) == 2 and all(line["train/optimizer_steps"] == 1.0 for line in train_lines)
    # one process packed the ranks' blocks: 2 micro-batches per step in both runs (module docstring)
    assert [line["train/num_microbatches"] for line in two if "train/step" in line] == [2.0] * 2
    assert _first_difference(one, two) is None, _first_difference(one, two)
    assert {k for k in one[-1] if k.startswith("eval/")}  # the last line carries an eval
    # each phase's peak memory (a CPU process's peak RSS here): every rank's, the largest under the plain name
    for line in (line for line in two if "train/step" in line):
        for phase in ("rollout", "train", "weight_sync"):
            ranks = [line[f"perf/memory/rank{r}/{phase}_peak_gb"] for r in range(2)]
            assert line[f"perf/memory/{phase}_peak_gb"] == max(ranks) and min(ranks) > 0.1, (phase, line)
    assert all(line["perf/memory/train_peak_gb"] > 0.1 for line in one if "train/step" in line)


# one run for three claims (each `lockstep train` start is ~20 s): its flags come from a --layout file,
# and they shard the trainer's routed experts (EP instead of FSDP) and the engines' (one expert-parallel
# engine); the trainer and the engines are independent parts, each proven to take one process's step
# or two engines' samples bitwise, so the run still logs the 2-process run's metrics
EP_LAYOUT_FLAGS = ["--nproc-per-node", "2", "--max-tokens-per-gpu", "172", "--expert-model-parallel-size", "2",
                   "--rollout-expert-parallel-size", "2"]


@pytest.fixture(scope="module")
def expert_parallel_by_layout(tmp_path_factory) -> dict:
    """The 2-process run started from a --layout file whose flags shard the trainer's and the engines'
    experts: its config.json, stderr and metrics.jsonl."""
    tmp_path = tmp_path_factory.mktemp("ep-layout")
    layout = tmp_path / "plan.json"
    layout.write_text(json.dumps([{"tp": 1, "pp": 1, "ep": 2, "cp": 1, "feasible": True, "not_runnable": "",
                                   "train_flags": EP_LAYOUT_FLAGS}]))
    run_dir = tmp_path / "run"
    env = cli_env()
    proc = subprocess.run([sys.executable, "-m", "lockstep.cli", "train", *SIZES, "--batch-invariant", "--run-dir",
                           str(run_dir), "--layout", str(layout), "--master-port", str(free_port())], env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"config": json.loads((run_dir / "config.json").read_text()), "stderr": proc.stderr,
            "lines": [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]}


def test_layout_file_starts_the_two_process_run(expert_parallel_by_layout, two_processes):
    """`--layout FILE` (lockstep plan --json's format) gives the launch flags; the started processes, which
    read the file again, run the 2-process run (with the file's EP flags: the processes applied them)."""
    config = expert_parallel_by_layout["config"]
    assert config["world_size"] == 2
    assert config["train"]["max_tokens_per_gpu"] == 172 and config["train"]["expert_model_parallel_size"] == 2
    lines = expert_parallel_by_layout["lines"]
    assert [_perf_free(line) for line in lines] == [_perf_free(line) for line in two_processes]


def test_expert_parallel_two_processes_log_what_fsdp_logs(expert_parallel_by_layout, two_processes):
    # EP=2 (experts sharded, the rest replicated) and FSDP on 2 ranks both take the step one process
    # takes on the ranks' two micro-batches (test_expert_parallel.py, test_fsdp.py): the same run
    assert expert_parallel_by_layout["config"]["train"]["expert_model_parallel_size"] == 2
    lines = expert_parallel_by_layout["lines"]
    assert [_perf_free(line) for line in lines] == [_perf_free(line) for line in two_processes]


def test_expert_parallel_engines_log_what_two_engines_log(expert_parallel_by_layout, two_processes):
    # --rollout-expert-parallel-size 2: each rank's engine keeps half of the routed experts and serves its
    # block of the prompts, the experts' rows exchanged with the peer; a rank's samples are bitwise one
    # engine's for that block (test_engine_expert_parallel.py), so the run is the 2-engine run
    for rank, experts in ((0, "[0, 4)"), (1, "[4, 8)")):
        assert f"rank {rank}: expert parallel over 2 ranks, experts {experts} of 8 in each of 4" in \
            expert_parallel_by_layout["stderr"]
    lines = expert_parallel_by_layout["lines"]
    assert [_perf_free(line) for line in lines] == [_perf_free(line) for line in two_processes]


PIPELINE = ["--nproc-per-node", "2", "--pipeline-model-parallel-size", "2", "--decoder-last-pipeline-num-layers", "1"]


@pytest.fixture(scope="module")
def colocated_plan() -> dict:
    """`lockstep plan --colocate --json` for the embedded model on 1 node of 2 GPUs (PP 2 fixed): the entry."""
    from lockstep.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "--model", str(ASSET_DIR), "--colocate", "--nodes", "1", "--gpus-per-node", "2",
                     "--seq-len", "64", "--max-tokens-per-gpu", "172", "--rollout-gpus-per-engine", "1",
                     "--decoder-last-pipeline-num-layers", "1", "--tp", "1", "--pp", "2", "--ep", "1", "--cp", "1",
                     "--json"]) == 0
    (entry,) = json.loads(out.getvalue())
    return entry


@pytest.fixture(scope="module")
def pipeline_two(tmp_path_factory, colocated_plan) -> dict:
    """The pipeline run in two halves, its flags read from the plan's JSON (`lockstep train --layout`):
    its first rollout, saved, then its second resumed from that save; one pair of runs for the claims
    below (each 2-process start is ~20 s). -> resumed (the second run's lines), lines (the halves' lines as
    one run's: the first half's end eval and the second's data line aside), save (the directory)."""
    run_dir = tmp_path_factory.mktemp("pipeline")
    (run_dir / "plan.json").write_text(json.dumps([colocated_plan]))
    layout = ["--layout", str(run_dir / "plan.json")]
    first = _train(run_dir / "first", *layout, "--num-rollout", "1", "--save", str(run_dir / "save"),
                   "--master-port", str(free_port()))
    train = json.loads((run_dir / "first" / "config.json").read_text())["train"]
    assert (train["pipeline_model_parallel_size"], train["decoder_last_pipeline_num_layers"]) == (2, 1)
    resumed = _train(run_dir / "resumed", *layout, "--load", str(run_dir / "save"), "--master-port", str(free_port()))
    assert len(first) == 2 and len(resumed) == 1
    lines = [first[0], _without_end_eval(first[1]), {k: v for k, v in resumed[0].items() if k != "data/skipped_rows"}]
    return {"resumed": resumed, "lines": lines, "save": run_dir / "save"}


def test_pipeline_parallel_two_stages_log_the_metrics_of_one_process(one_process, pipeline_two):
    # the same two micro-batches, padded to the same [8, 22] on both sides (module docstring)
    lines = pipeline_two["lines"]
    assert [line["train/num_microbatches"] for line in lines if "train/step" in line] == [2.0] * 2
    assert _first_difference(one_process, lines) is None, _first_difference(one_process, lines)


def test_a_colocated_plan_gives_the_pipeline_run_its_flags(colocated_plan, pipeline_two):
    """`lockstep plan --colocate`'s flags are the pipeline run's (the run above took them from its JSON),
    and its memory per stage and phase is set against the run's per-rank peaks."""
    entry, lines = colocated_plan, pipeline_two["lines"]
    assert entry["colocate"] and entry["feasible"] and entry["stage_layers"] == [3, 1]
    assert entry["train_flags"] == ["--nnodes", "1", *PIPELINE[:2], "--max-tokens-per-gpu", "172", *PIPELINE[2:]]
    # the plan per stage and phase against the run's per-rank peaks (stage s on rank s here)
    rows = compare(entry, lines)
    assert [(r.stage, r.phase, r.ranks) for r in rows] == [
        (s, phase, (s,)) for s in (0, 1) for phase in ("rollout", "train", "weight_sync")]
    for r in rows:
        assert r.measured_gb == max(line[f"perf/memory/rank{r.stage}/{r.phase}_peak_gb"] for line in lines
                                    if f"perf/memory/rank{r.stage}/{r.phase}_peak_gb" in line)
        phases = entry["stage_phase_gb"][r.stage]
        train = max(v for k, v in phases.items() if k in ("train", "activations", "gradients"))
        assert r.planned_gb == {"rollout": phases["generate"], "weight_sync": phases["push"], "train": train}[r.phase]


def test_pipeline_parallel_resume_continues_the_unbroken_run(one_process, pipeline_two):
    # the one-process files, written by stage 0, and stage 1's RNG states
    assert sorted(p.name for p in (saved(pipeline_two["save"]) / "trainer").iterdir()) == \
        ["model.safetensors", "optimizer.pt", "trainer.pt", "trainer.rank1.pt"]
    resumed = dict(pipeline_two["resumed"][0])
    assert resumed.pop("data/skipped_rows") == 0.0  # each run's first line has it
    assert resumed["train/step"] == 2.0
    assert _perf_free(resumed) == _perf_free(one_process[-1])


def test_pipeline_parallel_refuses_before_starting(tmp_path, capsys):
    # in this process: the refusal comes before anything starts (a subprocess only added its imports)
    from lockstep.cli import main

    returncode = main(["train", *SIZES, "--run-dir", str(tmp_path / "run"), "--pipeline-model-parallel-size", "2"])
    err = capsys.readouterr().err
    message = "--pipeline-model-parallel-size 2 must equal the trainer ranks for now"
    assert returncode != 0 and message in err, err[-2000:]
    assert not (tmp_path / "run").exists()  # refused before any process or run directory


def _without_end_eval(line: dict) -> dict:
    """A run's last metrics line without the eval that a run's end adds (an unbroken longer run's line
    for that rollout has none at --eval-interval 2)."""
    return {k: v for k, v in line.items() if not k.startswith("eval/")}


def test_two_nodes_save_and_two_processes_resume_the_unbroken_run(tmp_path, two_processes):
    """The 2-process run in two halves: its first rollout started by two launchers, one per "node" (here
    both on this machine, meeting at --master-addr:--master-port), saved; its second resumed from that save
    by one launcher of 2 processes. Together they log the unbroken 2-process run's lines."""
    port, run_dir, save = str(free_port()), tmp_path / "first", tmp_path / "save"
    nodes = [subprocess.Popen([sys.executable, "-m", "lockstep.cli", "train", *RUN, "--run-dir", str(run_dir),
                               "--num-rollout", "1", "--save", str(save), "--nnodes", "2", "--node-rank", str(r),
                               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port],
                              env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for r in (1, 0)]
    errors = [node.communicate(timeout=180)[1] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [e[-3000:] for e in errors]
    first = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    halves = [first[0], _without_end_eval(first[1])]
    assert len(first) == 2 and _first_difference(two_processes[:2], halves) is None, \
        _first_difference(two_processes[:2], halves)
    assert (saved(save) / "trainer" / "trainer.rank1.pt").is_file()  # each rank's RNG state
    resumed = _train(tmp_path / "resumed", "--nproc-per-node", "2", "--load", str(save),
                     "--master-port", str(free_port()))
    assert len(resumed) == 1 and resumed[0].pop("data/skipped_rows") == 0.0  # each run's first line has it
    assert _perf_free(resumed[0]) == _perf_free(two_processes[-1])


def _failing_rank(rank: int, run_dir: str, timeout_s: float, how: str) -> None:
    """Every rank runs `lockstep train`; in its rollout 2 (its 3rd generate: eval at step 0, rollout 1,
    rollout 2) rank 1 exits abruptly, or hangs past the timeout before it exits."""
    from lockstep.cli import main
    from lockstep.engine.engine import Engine

    calls, generate = [0], Engine.generate

    def failing_generate(self, requests):
        calls[0] += 1
        if rank == 1 and calls[0] == 3:
            if how == "hang":  # for twice the timeout, then gone (the test need not wait for a guard)
                time.sleep(2 * timeout_s)
            os._exit(3)
        return generate(self, requests)

    Engine.generate = failing_generate
    main(["train", *SIZES, "--run-dir", run_dir, "--distributed-timeout", str(timeout_s)])


@pytest.mark.parametrize("how, timeout_s", [("exit", 20.0), ("hang", 4.0)])
def test_failed_peer_ends_the_run_naming_rank_and_operation(tmp_path, how, timeout_s):
    start = time.monotonic()
    r0, r1 = run_world(_failing_rank, 2, guard_s=timeout_s + 30, args=(str(tmp_path), timeout_s, how))
    assert r1.exitcode == 3 and r1.value is None and not r1.hung
    assert r0.error_type == "DistributedError", r0.error
    first = r0.error.splitlines()[0]
    assert first.startswith("rank 0: all_gather_object of rollout samples (4 requests)"), first
    assert ("a peer probably exited" if how == "exit" else f"timed out after {timeout_s:g}s") in first, first
    # rank 0 gave up within the timeout of the collective it was in (plus the start and rollout 1)
    assert r0.elapsed_s < timeout_s + 15 and time.monotonic() - start < timeout_s + 45
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2  # step 0's eval and rollout 1 were logged before the peer failed
