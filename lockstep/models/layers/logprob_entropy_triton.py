"""The trainer's token logprobs and entropies from fp32 logits as one Triton kernel each way.

Eagerly, `log_softmax(logits / T).gather(targets)` plus the entropy of the same rows walk the
[T_r, V] fp32 logits about eight times forward and backward (the division, log_softmax's output,
the entropy's max / logsumexp / p / p * z, gather's zero-filled gradient, log_softmax's
backward), each pass 2 GB at 8 x 2048 tokens and a 32k vocabulary. Here the forward reads a row
once (an online softmax: per lane a running max, the sum of exp(z - max) and of exp(z - max) *
(z - max), rescaled when the max moves) and writes three numbers per row: logp, entropy and the
log-sum-exp the backward needs; the backward reads the row once and writes its gradient:

    z = logits / T,   p = softmax(z),   lse = log sum exp z,   H = lse - sum p z
    d logp / d z_k = [k == y] - p_k
    d H / d z_k    = -p_k (z_k - lse + H)
    d logits       = (g_logp d logp / d z + g_H d H / d z) / T

Values as torch's ops to fp32 rounding (logp = (z_y - max) - log(sum), as log_softmax forms it;
the sums in another order), not bit for bit: so the true-on-policy forward, whose trainer logprobs
must be the engine's bits, does not take it (kernel_switch: off there). One program per row; the
tile width follows V only. A target outside [0, V) gives a NaN logprob (torch's gather raises).
"""

from __future__ import annotations

import torch

from lockstep.triton_support import trainer_kernel_runs

from . import grouped_gemm_triton as _gt

triton = _gt.triton
if triton is not None:
    import triton.language as tl


def applies(logits: torch.Tensor, enabled: bool | None) -> bool:
    """Triton present, fp32 logits (the head's), where the switch lets the trainer's kernels run
    (triton_support.trainer_kernel_runs: None on CUDA, True also under the interpreter)."""
    return triton is not None and logits.dtype == torch.float32 and trainer_kernel_runs(logits, enabled)


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                               with_entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, V] fp32, targets [T] -> (logp [T], entropy [T]) of softmax(logits / temperature), fp32;
    the entropy carries a gradient only when with_entropy_grad."""
    logp, entropy = LogprobEntropy.apply(logits, targets, float(temperature))
    return logp, entropy if with_entropy_grad else entropy.detach()


def _block(V: int) -> int:
    return min(4096, triton.next_power_of_2(V))


class LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float):
        z = logits if logits.stride(-1) == 1 else logits.contiguous()
        M, V = z.shape
        logp, entropy, lse = (torch.empty(M, dtype=torch.float32, device=z.device) for _ in range(3))
        y = targets.to(z.device, torch.int64).contiguous()
        if M:
            _forward_kernel[(M,)](z, y, logp, entropy, lse, V, z.stride(0), temperature, BLOCK=_block(V),
                                  num_warps=8)
        ctx.save_for_backward(z, y, lse, entropy)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp: torch.Tensor | None, g_entropy: torch.Tensor | None):
        z, y, lse, entropy = ctx.saved_tensors
        M, V = z.shape
        dz = torch.empty_like(z)
        if M:
            g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.float().contiguous()
            with_entropy = g_entropy is not None
            g_entropy = g_entropy.float().contiguous() if with_entropy else g_logp
            _backward_kernel[(M,)](z, y, lse, entropy, g_logp, g_entropy, dz, V, z.stride(0), dz.stride(0),
                                   ctx.temperature, ENTROPY=with_entropy, BLOCK=_block(V), num_warps=8)
        return dz, None, None


if triton is not None:

    @triton.jit
    def _scaled_tile(z_row, v0, cols, V, temperature):
        """z / T of the tile at v0 (correctly rounded, as torch divides), -inf past V."""
        ok = v0 + cols < V
        z = tl.load(z_row + v0 + cols, mask=ok, other=float("-inf"))
        return tl.math.div_rn(z, temperature), ok

    @triton.jit
    def _forward_kernel(z_ptr, y_ptr, logp_ptr, entropy_ptr, lse_ptr, V, stride_zm, temperature,
                        BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        z_row = z_ptr + row * stride_zm
        cols = tl.arange(0, BLOCK)
        # per lane: the max so far, sum exp(z - max), sum exp(z - max) * (z - max)
        run_max = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
        s = tl.zeros((BLOCK,), dtype=tl.float32)
        w = tl.zeros((BLOCK,), dtype=tl.float32)
        for v0 in range(0, V, BLOCK):
            z, ok = _scaled_tile(z_row, v0, cols, V, temperature)
            new_max = tl.maximum(run_max, z)
            shift = tl.where(run_max > float("-inf"), run_max - new_max, 0.0)  # <= 0 (nothing yet: s = w = 0)
            a = tl.exp(shift)
            live = ok & (z > float("-inf"))  # a -inf logit adds nothing (and no 0 * inf)
            e = tl.where(live, tl.exp(z - new_max), 0.0)
            w = a * (w + s * shift) + e * tl.where(live, z - new_max, 0.0)
            s = a * s + e
            run_max = new_max
        m = tl.max(run_max, axis=0)
        lane = run_max > float("-inf")
        shift = tl.where(lane, run_max - m, 0.0)
        c = tl.where(lane, tl.exp(shift), 0.0)
        total = tl.sum(c * s, axis=0)
        weighted = tl.sum(c * (w + s * shift), axis=0)  # sum exp(z - m) * (z - m)
        log_total = tl.log(total)
        y = tl.load(y_ptr + row)
        y_ok = (y >= 0) & (y < V)  # an id outside the vocabulary: NaN, not a read out of bounds
        zy = tl.math.div_rn(tl.load(z_row + tl.where(y_ok, y, 0)), temperature)
        tl.store(logp_ptr + row, tl.where(y_ok, (zy - m) - log_total, float("nan")))
        tl.store(entropy_ptr + row, log_total - weighted / total)
        tl.store(lse_ptr + row, m + log_total)

    @triton.jit
    def _backward_kernel(z_ptr, y_ptr, lse_ptr, entropy_ptr, g_logp_ptr, g_entropy_ptr, dz_ptr, V, stride_zm,
                         stride_dm, temperature, ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        z_row = z_ptr + row * stride_zm
        cols = tl.arange(0, BLOCK)
        lse = tl.load(lse_ptr + row)
        g_logp = tl.load(g_logp_ptr + row)
        y = tl.load(y_ptr + row)
        if ENTROPY:
            g_entropy = tl.load(g_entropy_ptr + row)
            entropy = tl.load(entropy_ptr + row)
        for v0 in range(0, V, BLOCK):
            z, ok = _scaled_tile(z_row, v0, cols, V, temperature)
            p = tl.exp(z - lse)
            g = tl.where(v0 + cols == y, g_logp, 0.0) - g_logp * p
            if ENTROPY:
                g -= g_entropy * p * tl.where(p > 0, z - lse + entropy, 0.0)
            tl.store(dz_ptr + row * stride_dm + v0 + cols, tl.math.div_rn(g, temperature), mask=ok)
