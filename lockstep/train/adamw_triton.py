"""MasterAdamW's update as one Triton kernel per parameter (`TrainConfig.triton_adamw`).

The default update (optimizer.MasterAdamW._adamw) is three multi-tensor passes for a bf16 model:
the bf16 gradients cast into fp32 copies, torch's fused AdamW over master, moments and those
copies, and the masters rounded back into the bf16 parameters. Per parameter that moves 2 + 4
(cast), 4 x 4 + 3 x 4 (AdamW: w, g, m, v read; w, m, v written) and 4 + 2 (write-back) = 40 bytes;
here one pass reads g in its own dtype and w, m, v, and writes w, m, v and the bf16 parameter: 28.
On the 1b config (918M parameters) the three passes took ~10.5 ms of a 105 ms graphed step on an
H200 (profile, 2026-12-02); this kernel's bytes at that machine's copy bandwidth are ~5.5 ms
(estimated, not yet measured: off by default until it is).

Per element, in fp32, torch's fused AdamW's order of operations (ADAMW mode):
    g = grad / inv_scale                       (the clipping, as its grad_scale)
    w = w - lr * weight_decay * w
    m = beta1 m + (1 - beta1) g,   v = beta2 v + (1 - beta2) g g
    w = w - step_size * m / (sqrt(v) / sqrt(bias_correction2) + eps),   step_size = lr / bias_correction1
    p = w rounded to p's dtype                 (where the master is a copy)
nothing written where found_inf is 1 (the skipped step), as torch's kernel. Equal to it to fp32
rounding (tests/train/test_optimizer.py, under the interpreter on the CPU).
"""

from __future__ import annotations

import math

import torch

from lockstep.models.layers import grouped_gemm_triton as _gt
from lockstep.triton_support import interpreted

triton = _gt.triton
if triton is not None:
    import triton.language as tl

BLOCK = 2048


def runs(param: torch.Tensor, enabled: bool) -> bool:
    """Where the kernel takes this parameter's update: switched on, Triton present, on CUDA (or the
    interpreter: the CPU tests)."""
    return enabled and triton is not None and (param.is_cuda or interpreted())


@torch.no_grad()
def adamw_(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, p: torch.Tensor | None, *,
           step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
           inv_scale: torch.Tensor | None, found_inf: torch.Tensor) -> None:
    """One parameter's update in place: w, m, v fp32 (contiguous), g its gradient (bf16 or fp32), p the
    parameter to write w into when w is a copy (None when w is the parameter)."""
    n = w.numel()
    if n == 0:
        return
    if not all(t.is_contiguous() for t in (w, m, v, w if p is None else p)):
        raise ValueError("TrainConfig.triton_adamw: the kernel writes parameters and optimiser state as flat "
                         f"contiguous tensors; a parameter of shape {tuple(w.shape)} is not (set it to False)")
    beta1, beta2 = betas
    bias_correction1, bias_correction2 = 1 - beta1 ** step, 1 - beta2 ** step
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        w, g.contiguous(), m, v, w if p is None else p, found_inf, w if inv_scale is None else inv_scale, n,
        lr, beta1, beta2, eps, weight_decay, lr / bias_correction1, math.sqrt(bias_correction2),
        HAS_P=p is not None, SCALED=inv_scale is not None, P_BF16=p is not None and p.dtype == torch.bfloat16,
        INTERPRETED=interpreted(), BLOCK=BLOCK, num_warps=8)


if triton is not None:
    _bf16 = _gt._bf16  # by name: a module alias does not resolve inside a kernel

    @triton.jit
    def _adamw_kernel(w_ptr, g_ptr, m_ptr, v_ptr, p_ptr, found_inf_ptr, inv_scale_ptr, n, lr, beta1, beta2, eps,
                      weight_decay, step_size, bias_correction2_sqrt, HAS_P: tl.constexpr, SCALED: tl.constexpr,
                      P_BF16: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < tl.where(tl.load(found_inf_ptr) == 0.0, n, 0)  # a skipped step writes nothing
        g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        if SCALED:
            g = g / tl.load(inv_scale_ptr)
        w = tl.load(w_ptr + offs, mask=ok, other=0.0)
        w = w - lr * weight_decay * w
        m = beta1 * tl.load(m_ptr + offs, mask=ok, other=0.0) + (1 - beta1) * g
        v = beta2 * tl.load(v_ptr + offs, mask=ok, other=0.0) + (1 - beta2) * g * g
        w = w - step_size * m / (tl.sqrt_rn(v) / bias_correction2_sqrt + eps)
        tl.store(w_ptr + offs, w, mask=ok)
        tl.store(m_ptr + offs, m, mask=ok)
        tl.store(v_ptr + offs, v, mask=ok)
        if HAS_P:
            if P_BF16:
                tl.store(p_ptr + offs, _bf16(w, INTERPRETED), mask=ok)
            else:
                tl.store(p_ptr + offs, w, mask=ok)
