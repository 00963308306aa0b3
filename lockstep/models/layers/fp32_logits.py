"""The LM head with fp32 logits from bf16 operands, forward and backward on tensor cores.

Logits are fp32 whatever the model dtype: bf16 logits would be rounded to ~1/128 of their size,
and GEMMs of different row counts (a decode step vs a training batch) round differently, which
alone moved logprobs by ~0.01 per token on a 1B config.

On a GPU with bf16 hidden states and weight the forward is one bf16 GEMM with fp32 output
(`torch.mm(..., out_dtype=float32)`): a product of two bf16 values is exact in fp32, so it sums
the same terms as an fp32 GEMM of the upcast operands (up to summation order) while reading half
the bytes and skipping the weight's fp32 copy. torch (2.11-2.13) has no backward for it, and the
upcast fp32 GEMMs it replaced ran on CUDA cores: on the 1b config at 8 x 2048 tokens the head's
three fp32 GEMMs took 65 ms of a 660 ms train step on an H200. `Fp32Logits` gives it one: the
fp32 gradient of the logits rounded to bf16 (as a bf16 trainer's logits gradient is anyway), then
two bf16 GEMMs with fp32 accumulation. The parameters' gradients are bf16 either way.
Elsewhere (CPU, fp32 models): the fp32 GEMM of the upcast operands, with autograd.
"""

from __future__ import annotations

import torch

from .kernel_switch import grad_wanted


def fp32_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [..., H] x weight [V, H] -> fp32 logits [..., V]."""
    if hidden.is_cuda and hidden.dtype == weight.dtype == torch.bfloat16:
        flat = hidden.reshape(-1, hidden.shape[-1])
        logits = Fp32Logits.apply(flat, weight) if grad_wanted(hidden, weight) else mm_fp32_out(flat, weight.t())
        return logits.view(*hidden.shape[:-1], weight.shape[0])
    return torch.nn.functional.linear(hidden.float(), weight.float())


def mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp32: from two bf16 operands on a GPU, cuBLAS's bf16 GEMM with fp32 output; else
    (the CPU, the reference the tests hold the GPU path to; an fp32 operand) the fp32 GEMM of the
    upcast operands."""
    if a.is_cuda and a.dtype == b.dtype == torch.bfloat16:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


class Fp32Logits(torch.autograd.Function):
    """flat hidden [T, H] (bf16), weight [V, H] (bf16) -> fp32 [T, V]; backward in bf16 GEMMs."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(flat, weight)
        return mm_fp32_out(flat, weight.t())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        flat, weight = ctx.saved_tensors
        g = grad.to(flat.dtype)
        grad_flat = mm_fp32_out(g, weight).to(flat.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = mm_fp32_out(g.t(), flat).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_flat, grad_weight
