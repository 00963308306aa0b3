"""Multi-step decode: K decode steps per host round trip (vLLM's "multi-step scheduling").

A graph-replayed decode step of a 1B config keeps the GPU busy for ~3 ms; reading the sampled
tokens back, checking stops, scheduling and filling the next step's inputs takes the host
~0.6 ms, during which the GPU idles when every step ends in a sync. When every scheduled
sequence decodes, the engine instead queues K steps back to back:
- the sampling tables of all K steps (the uniforms u(seed, t) of the next K token indices, see
  sampler.py) travel to the device in one copy up front;
- each step's sampled tokens become the next step's inputs on the device
  (`DecodeGraphs.advance`), so nothing is read back between steps;
- one read brings back the K x N tokens and logprobs; the host appends each sequence's tokens
  up to its first stop (`StopChecker.first_stop`; token by token through `check` where stop
  strings need the decoded text) and finishes the stopped sequences in the order K single
  steps would have.
The outputs are bitwise those of K single steps while the batch stays the same (same graphs,
same sampler, same inputs). A sequence that stops at step j < K - 1 stays in the batch: it has
K - 1 - j more tokens computed and dropped, written only into its own cache slot (reset before
the slot is handed out again), and the others see a batch one row larger than single steps
would have run, which outside batch-invariant mode changes rounding only.

K is capped so that no sequence passes max_model_len (its cache has no room past it) and by
the most tokens any of the sequences may still sample.
"""

from __future__ import annotations

import torch

from lockstep.engine.sampler import draw_plan
from lockstep.transfer import to_device, to_host_async


def window_steps(seqs, max_steps: int, max_model_len: int) -> int:
    """How many decode steps the next window may run (1: take the single-step path)."""
    room = min(max_model_len - len(s.tokens) for s in seqs)
    wanted = max(s.sampling.max_new_tokens - s.num_output for s in seqs)
    return max(1, min(max_steps, room, wanted))


@torch.no_grad()
def decode_window(engine, seqs, K: int) -> None:
    """Run K decode steps of `seqs` through the engine's decode graphs, then append the tokens
    and finish the sequences that stopped, in the order K single steps would have."""
    tokens_NK, logprobs_NK, routed_NK = _run_on_device(engine, seqs, K)
    stopped = []  # (step, index in seqs, reason)
    for i, seq in enumerate(seqs):
        if routed_NK is not None and seq.sampling.return_routed_experts:
            seq.record_routing(seq.num_computed, routed_NK[i])  # positions past a stop are never read
        hit = _accept(engine, seq, tokens_NK[i], logprobs_NK[i])
        if hit is not None:
            stopped.append((hit[0], i, hit[1]))
    for _, i, reason in sorted(stopped):
        engine._finish(seqs[i], reason)


def _accept(engine, seq, tokens: list[int], logprobs: list[float]) -> tuple[int, str] | None:
    """Append seq's tokens up to its first stop -> (step, reason) of that stop, or None."""
    if seq.sampling.stop and engine.stop.tokenizer is not None:
        for k, (tok, lp) in enumerate(zip(tokens, logprobs)):  # stop strings: decoded text per token
            seq.num_computed += 1
            seq.append_token(tok, lp, engine.weight_version)
            reason = engine.stop.check(seq)
            if reason is not None:
                return k, reason
        return None
    hit = engine.stop.first_stop(seq, tokens)
    n = len(tokens) if hit is None else hit[0] + 1
    seq.num_computed += n
    seq.extend_tokens(tokens[:n], logprobs[:n], engine.weight_version)
    return hit


def _run_on_device(engine, seqs, K: int):
    """-> (tokens [N][K], logprobs [N][K] as lists, routed experts [N, K, L, k] on the host or None)."""
    graphs, sampler = engine.adapter.graphs, engine.sampler
    N = len(seqs)
    params = [s.sampling for s in seqs]
    table = sampler.table(list(range(N)), params, [s.seed for s in seqs], [s.num_output for s in seqs], K)
    tables = to_device(table, graphs.meta.device, torch.float64)
    plan = draw_plan(params)
    want_routing = any(p.return_routed_experts for p in params)
    engine.cache.prepare()
    graphs.load(seqs)
    tokens, logprobs, routed = [], [], []
    for k in range(K):
        logits, experts = graphs.run(N, want_routing)
        tok, lp = sampler.draw(logits, tables[k], plan, identity_rows=True)
        if k + 1 < K:
            graphs.advance(tok)
        tokens.append(tok)
        logprobs.append(lp)
        if experts is not None:
            routed.append(experts)
    # [K, N, 1, L, k] -> [N, K, L, k]; the copy completes with the read below
    routed_host = to_host_async(torch.stack(routed, dim=1).squeeze(2)) if routed else None
    # fp64 holds every token id and every fp32 logprob exactly: one device->host copy for all
    tok, lp = torch.stack([torch.stack(tokens, dim=1).double(), torch.stack(logprobs, dim=1).double()]).tolist()
    return [[int(t) for t in row] for row in tok], lp, routed_host
