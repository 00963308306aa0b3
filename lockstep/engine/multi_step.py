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

Async scheduling (EngineConfig.async_scheduling; vLLM's and SGLang's overlap scheduler, for
windows): the host's work at a window's end (the read, the stop checks, the next window's tables
and inputs) leaves the GPU idle. Instead the next window is launched before the current one is
read back (`chain_window`), on the sequences not known to have finished, its first inputs the
current window's last tokens on the device. The read then waits for its own copy only
(transfer.HostRead), and the host's work runs while the GPU runs the next window. A sequence
that stops in the current window has the chained window's tokens computed and dropped too (as
within a window: rounding only for the others), and it is left out of the window after; where
every sequence stops before its max_new_tokens, the window chained last is computed for nothing
(at most decode_steps steps of the last batch, ~20 ms on the 1b config by its step time, against
the ~0.8 ms of host work a window hides there as measured below: async scheduling pays from ~25
windows a generate, e.g. 400 tokens at 16 a window). The chain breaks, and the scheduler runs
again, when requests wait to join, when nothing may be sampled any more, and before a weight
update (which reads the window in flight back first: its tokens came from the weights before).
On one H200 (1b config, batch 64, 16-step windows, rollout_throughput.py --scheduling async
sync): decode 41,898 tok/s against 40,656 with each window read back before the next is
launched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lockstep.engine.sampler import draw_plan
from lockstep.transfer import HostRead, to_device, to_host_async


def steps_allowed(seqs, max_steps: int, max_model_len: int, ahead: int = 0) -> int:
    """Decode steps a window of `seqs` may run when each has `ahead` tokens sampled on the device
    and not on the host yet: none passes max_model_len, and none samples past the most any of
    them may still sample (<= 0: none)."""
    room = min(max_model_len - len(s.tokens) for s in seqs) - ahead
    wanted = max(s.sampling.max_new_tokens - s.num_output for s in seqs) - ahead
    return min(max_steps, room, wanted)


def window_steps(seqs, max_steps: int, max_model_len: int) -> int:
    """How many decode steps the next window may run (1: take the single-step path)."""
    return max(1, steps_allowed(seqs, max_steps, max_model_len))


@dataclass
class Window:
    """K decode steps of `seqs` queued on the device, their tokens on the way to the host."""
    seqs: list
    K: int
    last_tokens: torch.Tensor  # [N] the last step's sampled tokens: a chained window's first inputs
    read: HostRead  # [2, N, K] fp64: tokens, logprobs
    routed: torch.Tensor | None  # [N, K, L, k] host copy, complete once `read` is


@torch.no_grad()
def finish_window(engine, window: Window) -> None:
    """Read a launched window back, append each sequence's tokens up to its first stop and finish
    the stopped sequences in the order K single steps would have. A sequence finished before
    (it stopped in the window this one was chained to, or was aborted) has its rows dropped."""
    tokens_NK, logprobs_NK = window.read.values()
    stopped = []  # (step, index in seqs, reason)
    for i, seq in enumerate(window.seqs):
        if seq.is_finished:
            continue
        if window.routed is not None and seq.sampling.return_routed_experts:
            seq.record_routing(seq.num_computed, window.routed[i])  # positions past a stop are never read
        hit = _accept(engine, seq, [int(t) for t in tokens_NK[i]], logprobs_NK[i])
        if hit is not None:
            stopped.append((hit[0], i, hit[1]))
    for _, i, reason in sorted(stopped):
        engine._finish(window.seqs[i], reason)


def chain_window(engine, window: Window, max_steps: int, max_model_len: int) -> Window | None:
    """Launch the window that follows `window` before it is read back (async scheduling), or None
    when none may run. Its sequences are those of `window` not known to be finished, in order,
    counted as if each of them sampled all of `window`'s K tokens."""
    rows = [i for i, s in enumerate(window.seqs) if not s.is_finished]
    seqs = [window.seqs[i] for i in rows]
    if not seqs:
        return None
    K = steps_allowed(seqs, max_steps, max_model_len, ahead=window.K)
    return launch_window(engine, seqs, K, after=(window, rows)) if K >= 1 else None


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


@torch.no_grad()
def launch_window(engine, seqs, K: int, after: tuple[Window, list[int]] | None = None) -> Window:
    """Queue K decode steps of `seqs` and the copy of their outputs to the host; nothing waits.
    `after` = (window, rows): `seqs` are those rows of a window still running, whose last tokens
    the first step takes on the device, as the window's own steps do."""
    graphs, sampler = engine.adapter.graphs, engine.sampler
    N = len(seqs)
    ahead = 0 if after is None else after[0].K  # tokens each sequence has on the device, not on the host yet
    params = [s.sampling for s in seqs]
    table = sampler.table(list(range(N)), params, [s.seed for s in seqs], [s.num_output + ahead for s in seqs], K)
    tables = to_device(table, graphs.meta.device, torch.float64)
    plan = draw_plan(params)
    want_routing = any(p.return_routed_experts for p in params)
    engine.cache.prepare()
    if after is None:
        graphs.load(seqs)
    else:
        previous, rows = after
        graphs.advance(previous.last_tokens)
        graphs.keep_rows(rows, len(previous.seqs))
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
    # [K, N, 1, L, k] -> [N, K, L, k]; the copy completes with the read of the tokens
    routed_host = to_host_async(torch.stack(routed, dim=1).squeeze(2)) if routed else None
    # fp64 holds every token id and every fp32 logprob exactly: one device->host copy for all
    read = HostRead(torch.stack([torch.stack(tokens, dim=1).double(), torch.stack(logprobs, dim=1).double()]))
    return Window(seqs, K, tok, read, routed_host)
