"""Grouped GEMM for MoE experts: tokens sorted by expert, one kernel over all groups.

`torch._grouped_mm` runs every expert's GEMM in one launch on GPUs in bf16 (and forward-only on
CPU builds that have it, fp32 too; its CPU backward rejects empty groups, so training on CPU
takes the reference loop, as does fp32 on GPUs). `grouped_mm_reference` is the pure-PyTorch
definition both must match. At decode (CUDA, bf16, no gradient: few rows per expert) the experts
take Triton kernels instead, the SwiGLU fused into the first (`triton_experts`,
grouped_gemm_triton.py); the `triton_moe` switch turns them off (kernel_switch.py).
"""

from __future__ import annotations

import torch

from . import grouped_gemm_triton
from .kernel_switch import forward_kernel_allowed


def grouped_mm_reference(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [M, K] sorted by group, w [G, N, K] (out, in), counts [G] -> [M, N]; row block g uses w[g]."""
    # Built for the backward on CPU, where this loop trains: unbind, not w[g] (G selects would each
    # zero-fill a full [G, N, K] gradient), and a cat of the blocks, not writes into slices of one
    # output (each write's backward would clone the whole output gradient).
    experts = w.unbind(0)
    blocks = [rows @ experts[g].t() for g, rows in enumerate(x.split(counts.tolist())) if rows.shape[0]]
    return torch.cat(blocks) if blocks else x.new_empty(0, w.shape[1])


def _can_use_native(x: torch.Tensor, w: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.bfloat16, torch.float32):
        return False
    if not x.is_cuda and torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return False
    # CUDA kernels and the op's meta function (what torch.compile traces) take bf16 only
    if (x.is_cuda or torch.compiler.is_compiling()) and x.dtype != torch.bfloat16:
        return False
    aligned = 16 // x.element_size()  # the kernel wants 16-byte aligned row strides
    return x.shape[1] % aligned == 0 and w.shape[1] % aligned == 0 and x.shape[0] > 0


def grouped_mm_gathered(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The same product with each row's weight matrix gathered: no loop over the groups and no
    read of `counts` on the host, so a compiled region traces it whole (under torch.compile where
    the native op is unavailable: fp32, or a CPU backward). Memory: rows x N x K, a small-model path."""
    rows = torch.arange(x.shape[0], device=x.device, dtype=counts.dtype)
    group_of_row = torch.searchsorted(torch.cumsum(counts, 0), rows, right=True)
    return torch.bmm(w[group_of_row], x.unsqueeze(-1)).squeeze(-1)


def group_offsets(counts: torch.Tensor) -> torch.Tensor:
    """counts [G] -> the int32 cumulative row counts the grouped kernels take (`offs`)."""
    return torch.cumsum(counts, 0).to(torch.int32)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    if torch.is_autocast_enabled(x.device.type):
        # torch._grouped_mm has no autocast rule (fp32 weights met bf16 rows in `lockstep sft`'s bf16
        # autocast): cast both as autocast casts a Linear's input and weight
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w = x.to(dtype), w.to(dtype)
    if _can_use_native(x, w):
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=group_offsets(counts))
    if torch.compiler.is_compiling():
        return grouped_mm_gathered(x, w, counts)
    return grouped_mm_reference(x, w, counts)


def triton_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, enabled: bool) -> bool:
    """Whether rows x can go through the experts (gate_up [G, 2F, K], down [G, K, F]) on the
    Triton kernels: `enabled` (the triton_moe switch), on CUDA, in bf16, with no gradient wanted
    (they are forward-only). Experts.mlp asks at decode steps only."""
    return (forward_kernel_allowed(enabled, x, gate_up, down)
            and grouped_gemm_triton.available(x, gate_up) and down.dtype == torch.bfloat16
            and gate_up.shape[1] == 2 * down.shape[2])
