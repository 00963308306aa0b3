"""Batch-invariant token logprobs and log-softmax rows as one Triton kernel, registered as the
custom ops `lockstep::fixed_order_token_logprobs` (logp of chosen ids, [M] fp32) and
`lockstep::fixed_order_log_softmax` (full rows, [M, V] fp32) (issue 16, item 2: fixed-order
kernels on the policy path, shared by the engine's sampler and the trainer's logprobs).

What is invariant, and why: one program per row, three fixed passes over the row's BLOCK-wide
tiles in index order: the max (exact in any order), the sum of exp(z - max) accumulated per lane
in fp32 and then summed by one fixed tree (tl.sum), and the outputs. BLOCK and the warps come
from V only (`launch_config`), so a row's logprobs are the same bits whatever M, the other rows
(garbage padding included), its position, or whether the chosen-id or full-row op computed them
(the chosen logprob is the full row's entry, bit for bit).

Numerics, as lockstep's definition (train/logprobs.py, engine/sampler.py): z = logits.float() /
temperature (a correctly rounded division per row; temperature 1 leaves z as is), then torch's
log_softmax formula: (z - max) - log(sum exp(z - max)), in fp32. Only the sum's order and the
exp / log implementations differ from eager torch (libdevice's expf / logf on GPUs, not Triton's
approximate tl.exp; numpy's under the interpreter, an ulp from torch's CPU ones): <= 2e-6 apart
at |logp| < 50 on CPU (the tests' tolerance: rtol 1e-6 + atol 4e-6). An id outside [0, V) gives NaN (torch's gather raises).

`fixed_order_token_logprobs` / `fixed_order_log_softmax` take the kernel where it runs (CUDA, or
the interpreter) and the reference elsewhere or when a gradient is wanted (forward only, no
autograd registered). Not wired into the engine or trainer.

GPU validation owed: speed (one program per row reads a 129k-vocab row two or three times;
decode's few rows use few SMs: a split-V variant with a split count fixed by V would stay
invariant) and bitwise invariance on a GPU have not been measured.
"""

from __future__ import annotations

import torch

from lockstep.triton_support import interpreted

from . import grouped_gemm_triton as _gt

triton = _gt.triton
if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _scaled(logits: torch.Tensor, temperature) -> torch.Tensor:
    """logits.float() / temperature (a float, or a tensor of one per row: [..] or [.., 1])."""
    z = logits.float()
    if isinstance(temperature, torch.Tensor):
        return z / temperature.float().reshape(*logits.shape[:-1], 1)
    return z if temperature == 1.0 else z / temperature


def log_softmax_reference(logits: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """log_softmax(logits.float() / temperature) over the last dim, fp32."""
    return torch.log_softmax(_scaled(logits, temperature), dim=-1)


def token_logprobs_reference(logits: torch.Tensor, ids: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """log_softmax(logits.float() / temperature)[ids], fp32; logits [..., V], ids [...]."""
    return log_softmax_reference(logits, temperature).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def kernel_applies(logits: torch.Tensor) -> bool:
    """Triton present, CUDA (or the interpreter), a float dtype, no gradient wanted."""
    if triton is None or logits.dtype not in DTYPES:
        return False
    if torch.is_grad_enabled() and logits.requires_grad:
        return False
    return logits.is_cuda or interpreted()


def _rows(logits: torch.Tensor, temperature) -> tuple[torch.Tensor, torch.Tensor]:
    """logits as [M, V] and one fp32 temperature per row [M]."""
    z = logits.reshape(-1, logits.shape[-1])
    if isinstance(temperature, torch.Tensor):
        t = temperature.to(z.device, torch.float32).reshape(-1).expand(z.shape[0]).contiguous()
    else:
        t = torch.full((z.shape[0],), temperature, dtype=torch.float32, device=z.device)
    return z, t


def fixed_order_token_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[ids] in fp32: logits [..., V], ids [...] -> [...]."""
    if not kernel_applies(logits):
        return token_logprobs_reference(logits, ids, temperature)
    z, t = _rows(logits, temperature)
    return torch.ops.lockstep.fixed_order_token_logprobs(z, ids.reshape(-1), t).view(ids.shape)


def fixed_order_log_softmax(logits: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """log softmax(logits / temperature) in fp32 over the last dim: [..., V] -> [..., V]."""
    if not kernel_applies(logits):
        return log_softmax_reference(logits, temperature)
    z, t = _rows(logits, temperature)
    return torch.ops.lockstep.fixed_order_log_softmax(z, t).view(logits.shape)


def launch_config(V: int) -> dict:
    """By the vocabulary only: tiles of up to 2048 columns (64 per pass for 129k), 8 warps. Not tuned."""
    block = min(2048, max(16, triton.next_power_of_2(V)))
    return dict(BLOCK=block, num_warps=8 if block >= 2048 else 4)


if triton is not None:

    @triton.jit
    def _tile(z_row, t, v0, cols, V, stride_zv):
        """z / t for the tile at v0, -inf past V."""
        ok = v0 + cols < V
        z = tl.load(z_row + (v0 + cols) * stride_zv, mask=ok, other=float("-inf")).to(tl.float32)
        return tl.math.div_rn(z, t), ok

    @triton.jit
    def _fixed_order_log_softmax_kernel(z_ptr, ids_ptr, t_ptr, lp_ptr, out_ptr, V, stride_zm, stride_zv,
                                        stride_om, stride_ov, CHOSEN: tl.constexpr, ROWS: tl.constexpr,
                                        INTERPRETED: tl.constexpr, BLOCK: tl.constexpr):
        """lp[m] = (z[m, ids[m]] - max) - log(sum exp(z[m] - max)) with z = logits / t[m] (CHOSEN);
        out[m] = (z[m] - max) - log(...) (ROWS); max and sum over BLOCK tiles in index order."""
        row = tl.program_id(0).to(tl.int64)
        z_row = z_ptr + row * stride_zm
        t = tl.load(t_ptr + row)
        cols = tl.arange(0, BLOCK)
        run_max = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
        for v0 in range(0, V, BLOCK):
            z, ok = _tile(z_row, t, v0, cols, V, stride_zv)
            run_max = tl.maximum(run_max, z, propagate_nan=tl.PropagateNan.ALL)
        m = tl.max(run_max, axis=0)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for v0 in range(0, V, BLOCK):
            z, ok = _tile(z_row, t, v0, cols, V, stride_zv)
            if INTERPRETED:  # which has no libdevice
                e = tl.exp(z - m)
            else:
                e = libdevice.exp(z - m)
            acc += tl.where(ok, e, 0.0)
        if INTERPRETED:
            log_sum = tl.log(tl.sum(acc, axis=0))
        else:
            log_sum = libdevice.log(tl.sum(acc, axis=0))
        if CHOSEN:
            y = tl.load(ids_ptr + row)
            y_ok = (y >= 0) & (y < V)
            zy = tl.load(z_row + tl.where(y_ok, y, 0) * stride_zv).to(tl.float32)
            lp = (tl.math.div_rn(zy, t) - m) - log_sum
            tl.store(lp_ptr + row, tl.where(y_ok, lp, float("nan")))
        if ROWS:
            for v0 in range(0, V, BLOCK):
                z, ok = _tile(z_row, t, v0, cols, V, stride_zv)
                tl.store(out_ptr + row * stride_om + (v0 + cols) * stride_ov, (z - m) - log_sum, mask=ok)

    def _launch(logits, ids, temperature, lp, out, block):
        M, V = logits.shape
        cfg = launch_config(V)
        if block:
            cfg["BLOCK"] = block
        if M == 0:
            return
        rows = out is not None
        out = lp if out is None else out
        torch.library.wrap_triton(_fixed_order_log_softmax_kernel)[(M,)](
            logits, temperature if ids is None else ids, temperature, lp, out, V, *logits.stride(), out.stride(0), out.stride(-1),
            CHOSEN=ids is not None, ROWS=rows, INTERPRETED=interpreted(), **cfg)

    @torch.library.triton_op("lockstep::fixed_order_token_logprobs", mutates_args=())
    def _token_logprobs_op(logits: torch.Tensor, ids: torch.Tensor, temperature: torch.Tensor,
                           block: int = 0) -> torch.Tensor:
        """logits [M, V] (bf16, fp16, fp32), ids [M] int64, temperature [M] fp32 -> [M] fp32. A
        nonzero block overrides `launch_config` (the same on every path, or rows differ)."""
        lp = logits.new_empty(logits.shape[0], dtype=torch.float32)
        _launch(logits, ids, temperature, lp, None, block)
        return lp

    @torch.library.triton_op("lockstep::fixed_order_log_softmax", mutates_args=())
    def _log_softmax_op(logits: torch.Tensor, temperature: torch.Tensor, block: int = 0) -> torch.Tensor:
        """logits [M, V], temperature [M] fp32 -> log_softmax rows [M, V] fp32."""
        out = logits.new_empty(logits.shape, dtype=torch.float32)
        _launch(logits, None, temperature, out, out, block)
        return out

    @_token_logprobs_op.register_fake
    def _(logits, ids, temperature, *config):
        return logits.new_empty(logits.shape[0], dtype=torch.float32)

    @_log_softmax_op.register_fake
    def _(logits, temperature, *config):
        return logits.new_empty(logits.shape, dtype=torch.float32)
