"""Data-parallel engine replicas (DISTRIBUTED.md proof (f)): 2 gloo processes, each an Engine on the
bundled tiny DeepSeek-V4, generate their block of a prompt set, and every rank gets all samples.

- Batch-invariant engines (`EngineConfig(batch_invariant=True)`, `--batch-invariant`: every sequence
  in a forward call of its own, lockstep/engine/runner.py): the replicas' samples are bitwise (token
  ids, logprobs, finish reasons) what one batch-invariant engine in one process generates for all the
  prompts at once. A sample depends neither on which replica drew it nor on what else ran.
- Default engines: each replica's samples are bitwise what one engine generates for the same block
  (sharding and gathering change nothing). Against one engine generating every prompt at once: the
  same token ids and finish reasons, but logprobs that differ, by at most 2e-6. Why (measured here):
  torch's CPU matmul computes a row with another kernel when the GEMM has 1 or 2 rows than when it
  has 3 or more (test_cpu_gemm_rows_depend_on_the_batch), and a batched decode step's rows and the
  tokens an MoE expert receives change with what else is in the batch; the same 1e-6 differences
  appear in one process between a 4-prompt and a 7-prompt batch. Batch-invariant mode pays for its
  bitwise agreement with one call per sequence (benchmarks/batch_invariance_cost.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lockstep
from dist_world import rank_values, run_world
from lockstep.config import EngineConfig
from lockstep.dist.replicas import shard

ASSET = Path(lockstep.__file__).parent / "assets" / "tiny-dsv4"
PROMPTS = 7  # odd: the blocks differ in size (4 + 3), so the replicas run different batches


def _samples(engine_or_replicas, block: slice = slice(None)) -> list:
    """(group id, token ids, logprobs, finish reason) of each sample of the prompt set's `block`."""
    from lockstep.rl.embedded import embedded_prompts
    from lockstep.rl.rollout import RolloutSpec, make_requests

    spec = RolloutSpec(n_samples=4, temperature=1.0, top_p=1.0, max_response_len=8, apply_chat_template=False,
                       seed=11)
    requests = make_requests(embedded_prompts("eval")[:PROMPTS], engine_or_replicas.tokenizer, spec, (0, 0), 0)
    return [(s.group_id, s.response_ids.tolist(), s.rollout_logprobs.clone(), s.finish_reason)
            for s in engine_or_replicas.generate(requests[block])]


def _engine(batch_invariant: bool = False):
    from lockstep.engine.engine import Engine

    return Engine.from_pretrained(ASSET, EngineConfig(max_num_seqs=64, max_model_len=64,
                                                      batch_invariant=batch_invariant))


def _replica_rank(rank: int) -> dict:
    from lockstep.dist.groups import init_distributed
    from lockstep.dist.replicas import EngineReplicas

    ctx = init_distributed(30.0)
    default, invariant = EngineReplicas(ctx, _engine()), EngineReplicas(ctx, _engine(batch_invariant=True))
    return {"default": _samples(default), "invariant": _samples(invariant),
            "local_requests": len(default.my_requests(list(range(PROMPTS))))}


def test_shard_blocks():
    assert [shard(5, 2, i) for i in range(2)] == [slice(0, 3), slice(3, 5)]
    assert [shard(2, 3, i) for i in range(3)] == [slice(0, 1), slice(1, 2), slice(2, 2)]
    for n in range(9):
        assert sum((list(range(n))[shard(n, 3, i)] for i in range(3)), []) == list(range(n))


def test_cpu_gemm_rows_depend_on_the_batch():
    # the reason the default engines' full-batch comparison below is not bitwise (module docstring)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 64, generator=g), torch.randn(64, 64, generator=g)
    full = x @ w.T
    # one row alone takes another kernel than 8 (which row counts agree with 8 depends on the CPU's ISA)
    assert not torch.equal((x[:1] @ w.T)[0], full[0])


def _same(got: list, want: list, what: str, logprob_atol: float = 0.0) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert g[0] == w[0] and g[1] == w[1] and g[3] == w[3], f"{what} sample {i}: {g} != {w}"
        close = torch.equal(g[2], w[2]) if logprob_atol == 0 else torch.allclose(g[2], w[2], rtol=0, atol=logprob_atol)
        assert close, f"{what} sample {i}: logprobs {g[2]} != {w[2]}"


@pytest.fixture(scope="module")
def replicas() -> list:
    """Each rank's gathered samples, from default engines and from batch-invariant ones (one world)."""
    return rank_values(run_world(_replica_rank, 2, guard_s=90))


def test_batch_invariant_replicas_generate_bitwise_what_one_engine_generates(replicas):
    torch.set_num_threads(1)
    whole = _samples(_engine(batch_invariant=True))
    assert len(whole) == PROMPTS * 4 and len({len(w[1]) for w in whole}) > 1  # lengths vary: a real rollout
    for rank, got in enumerate(replicas):
        assert got["local_requests"] == [4, 3][rank]
        _same(got["invariant"], whole, f"rank {rank} vs one batch-invariant engine, all prompts")


def test_default_replicas_generate_what_one_engine_generates_per_block(replicas):
    torch.set_num_threads(1)
    one = _engine()
    blocks = [_samples(one, shard(PROMPTS, 2, r)) for r in range(2)]
    whole = _samples(one)
    for rank, got in enumerate(replicas):
        _same(got["default"], blocks[0] + blocks[1], f"rank {rank} vs one engine per block")
        _same(got["default"], whole, f"rank {rank} vs one engine, all prompts", logprob_atol=2e-6)
    # not bitwise: the batch changes the arithmetic (module docstring)
    assert any(not torch.equal(g[2], w[2]) for g, w in zip(replicas[0]["default"], whole))
