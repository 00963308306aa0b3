"""Token sampling for the whole batch at once: temperature, top-k, top-p, greedy, per-request
seeds, and the rollout logprob.

For each row of fp32 logits x [V], its sequence's SamplingParams and seed, and the index t of
the response token being drawn:

    T        = temperature, or 1 when temperature == 0 (greedy)
    logp     = log_softmax(x / T) over the FULL vocabulary, in fp32
    greedy:  token = argmax(x)  (the first maximum)
    sampled: p = exp(logp), zeroed outside the top-k and outside the top-p nucleus,
             token = the first i with cumsum(p)[i] >= u * sum(p)   (inverse CDF, cumsum in fp64)
             u = uniform(seed, t): output t of SplitMix64 seeded with the sequence's seed
    returns (token, logp[token])  -- the logprob is taken BEFORE top-k / top-p truncation
    alternatives (top_logprobs = k > 0): topk(logp, k) as (token, logprob) pairs (`top_alternatives`)

u is a pure function of (seed, t), computed on the host (Steele, Lea & Flood 2014, "Fast
splittable pseudorandom number generators": SplitMix64 is counter-based, output t needs no
state), so a sequence's draws depend only on its seed, the token index and its own logits:
not on what else is in the batch, on preemption and recompute, or on the device. The device
gets one uniform per row instead of V random numbers, and no per-sequence generator state.

A step costs one host->device copy (every row's parameters, pinned, non-blocking) and one
device->host copy (every token and logprob): the only sync of a decode step (multi-step decode,
multi_step.py, draws K steps' tokens with `draw` and reads them back together).
When all rows share one temperature, x / T divides by a Python float exactly as the trainer's
`token_logprobs` does (on CUDA that kernel multiplies by 1/T; a per-row tensor would not).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from lockstep.config import SamplingParams
from lockstep.engine import draw_triton
from lockstep.transfer import to_device

_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (2^64 / golden ratio, odd)
_M64 = (1 << 64) - 1


def uniform(seed: int, t: int) -> float:
    """Output t of SplitMix64 seeded with `seed`, as a float in (0, 1) with 53 random bits: the
    definition; the sampler draws through `uniforms`, its vectorised twin (tested bit for bit)."""
    z = (seed + (t + 1) * _GAMMA) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    z ^= z >> 31
    return ((z >> 11) + 0.5) / 2**53


def uniforms(seeds, steps) -> np.ndarray:
    """`uniform(seed, t)` over arrays (broadcast against each other), bit for bit: uint64
    arithmetic wraps modulo 2^64 as the masks above do, and the last step is the same float64
    addition and division. One call builds a step's table (K x N draws in multi-step decode)."""
    z = np.asarray([s & _M64 for s in seeds], dtype=np.uint64)
    t = np.asarray(steps, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = z + (t + np.uint64(1)) * np.uint64(_GAMMA)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return ((z >> np.uint64(11)).astype(np.float64) + 0.5) / 2.0**53


def truncate_probs(probs_MV: torch.Tensor, top_k, top_p) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k and top-p nucleus (the most likely token
    always stays). top_k [M] (<= 0: off) and top_p [M], lists or tensors on probs' device."""
    V, dev = probs_MV.shape[-1], probs_MV.device
    k = torch.as_tensor(top_k, device=dev).view(-1, 1)
    k = torch.where(k > 0, k, V)
    p = torch.as_tensor(top_p, dtype=torch.float32, device=dev).view(-1, 1)
    sorted_p, order = torch.sort(probs_MV, dim=-1, descending=True, stable=True)
    rank = torch.arange(V, device=dev).unsqueeze(0)
    # mass strictly before this token already reaches top_p -> the token is outside the nucleus
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    drop_sorted = (rank >= k) | ((before >= p) & (rank > 0))
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return probs_MV.masked_fill(drop, 0.0)


def inverse_cdf(probs_MV: torch.Tensor, u_M1: torch.Tensor) -> torch.Tensor:
    """The first index whose cumulative probability reaches u * total, per row -> [M]."""
    cdf = probs_MV.double().cumsum(dim=-1)
    drawn = torch.searchsorted(cdf, u_M1 * cdf[:, -1:])
    return drawn.squeeze(1).clamp(max=probs_MV.shape[-1] - 1)


class DrawPlan(NamedTuple):
    """What a batch's draw needs, decided on the host once per batch (per window in multi-step
    decode, where the same sequences draw K times)."""

    temperature: float | None  # the one temperature of every row, or None: the table's column
    sampled: bool  # some row samples (temperature > 0)
    truncated: bool  # some sampled row has top-k or top-p
    greedy: bool = True  # some row is greedy (an RL rollout's rows all sample: no argmax is needed)


def draw_plan(params: list[SamplingParams]) -> DrawPlan:
    temps = {logprob_temperature(p) for p in params}
    sampled = [p for p in params if p.temperature > 0]
    return DrawPlan(temps.pop() if len(temps) == 1 else None, bool(sampled),
                    any(p.top_k > 0 or p.top_p < 1.0 for p in sampled), len(sampled) < len(params))


def scaled_logprobs(x_MV: torch.Tensor, T: float | torch.Tensor) -> torch.Tensor:
    """log_softmax(x / T) over the full vocabulary, fp32: the logprob definition (SamplingParams)."""
    return torch.log_softmax(x_MV if isinstance(T, float) and T == 1.0 else x_MV / T, dim=-1)


def top_alternatives(logits_MV: torch.Tensor, rows: list[int],
                     params: list[SamplingParams]) -> list[list[tuple[int, float]]] | None:
    """For each (row, sequence) pair that asks for `top_logprobs` = k: its k most likely tokens and
    their logprobs under the distribution its logprob is taken from, most likely first ([] for
    the others); None when no pair asks. One top-k over the asking rows and one host read."""
    asking = [i for i, p in enumerate(params) if p.top_logprobs > 0]
    if not asking:
        return None
    dev = logits_MV.device
    x = logits_MV.index_select(0, to_device([rows[i] for i in asking], dev)).float()
    temps = [logprob_temperature(params[i]) for i in asking]
    # one temperature divides by a float, as `draw` does: the sampled token's logprob reappears bit for bit
    T = temps[0] if len(set(temps)) == 1 else to_device(temps, dev, torch.float32).view(-1, 1)
    k = max(params[i].top_logprobs for i in asking)
    values, ids = scaled_logprobs(x, T).topk(min(k, x.shape[-1]), dim=-1)
    values, ids = torch.stack([values.double(), ids.double()]).tolist()
    out: list[list[tuple[int, float]]] = [[] for _ in params]
    for j, i in enumerate(asking):
        n = params[i].top_logprobs
        out[i] = [(int(t), lp) for t, lp in zip(ids[j][:n], values[j][:n])]
    return out


class Sampler:
    """Samples one token for each (row, sequence) pair; several sequences may share a row
    (the n samples of a prompt all draw their first token from the leader's prefill logits).
    draw_kernels: a batch of one temperature that truncates nothing takes draw_triton's kernels
    where they run (KernelSwitches.triton_sampler)."""

    def __init__(self, draw_kernels: bool = False):
        self.draw_kernels = draw_kernels

    def __call__(self, logits_MV: torch.Tensor, rows: list[int], params: list[SamplingParams],
                 seeds: list[int], steps: list[int]) -> tuple[list[int], list[float]]:
        """-> (tokens, logprobs) as Python lists; steps[i] = index of the token drawn for row i."""
        if not rows:
            return [], []
        table = to_device(self.table(rows, params, seeds, steps)[0], logits_MV.device, torch.float64)
        tokens, chosen = self.draw(logits_MV, table, draw_plan(params),
                                   identity_rows=rows == list(range(logits_MV.shape[0])))
        # fp64 holds every token id and every fp32 logprob exactly: one device->host copy for both
        tok, lp = torch.stack([tokens.double(), chosen.double()]).tolist()
        return [int(t) for t in tok], lp

    @staticmethod
    def table(rows: list[int], params: list[SamplingParams], seeds: list[int], first_steps: list[int],
              K: int = 1) -> np.ndarray:
        """[K, M, 5] per drawn token: logits row, T, u (-1: greedy), top_k (<= 0: off), top_p.
        Draw k of row i is the sequence's token first_steps[i] + k (K > 1: multi-step decode)."""
        base = np.asarray([[r, logprob_temperature(p), -1.0, p.top_k, p.top_p] for r, p in zip(rows, params)],
                          np.float64)
        table = np.repeat(base[None], K, axis=0)
        sampled = np.asarray([p.temperature > 0 for p in params])
        if sampled.any():
            steps = np.asarray(first_steps, dtype=np.int64)[None, :] + np.arange(K)[:, None]
            table[:, :, 2] = np.where(sampled[None, :], uniforms(seeds, steps), -1.0)
        return table

    def draw(self, logits_MV: torch.Tensor, table: torch.Tensor, plan: DrawPlan,
             identity_rows: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens and their logprobs, on the logits' device, without reading anything back.
        identity_rows: table row i samples from logits row i (no gather needed)."""
        x = logits_MV if identity_rows else logits_MV.index_select(0, table[:, 0].long())
        x = x.float()
        if plan.temperature is not None and not plan.truncated and draw_triton.runs(x, self.draw_kernels):
            return draw_triton.draw(x, plan.temperature, table[:, 2] if plan.sampled else None)
        T = plan.temperature if plan.temperature is not None else table[:, 1:2].float()
        logp = scaled_logprobs(x, T)
        tokens = x.argmax(dim=-1) if plan.greedy else None  # a [M, V] reduction: only where a row wants it
        if plan.sampled:
            probs = logp.exp()
            if plan.truncated:
                probs = truncate_probs(probs, table[:, 3].long(), table[:, 4])
            u = table[:, 2:3]
            drawn = inverse_cdf(probs, u.clamp(min=0))
            tokens = torch.where(u[:, 0] >= 0, drawn, tokens) if plan.greedy else drawn
        return tokens, logp.gather(1, tokens.unsqueeze(1)).squeeze(1)


def logprob_temperature(p: SamplingParams) -> float:
    """The T of a request's logprobs: its temperature, 1 for greedy (SamplingParams' definition)."""
    return p.temperature if p.temperature > 0 else 1.0
