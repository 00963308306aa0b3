"""Routed experts served from packed fp4 storage (the fp8-fp4 format's experts, engine opt-in:
EngineConfig.packed_fp4): e2m1 codes two per byte with one e8m0 scale per 1x32 block, quant/fp4.py's
layout, 0.5 byte per parameter + 1 byte per 32 instead of bf16's 2.

    gate_up_proj  uint8 [E, 2F, H/2]   (state-dict names of Experts; the weight update knows the
    down_proj     uint8 [E, H, F/2]     unpacked shapes through `packed_tensors`)
    gate_up_scale, down_scale           uint8 e8m0 bytes [E, rows, ceil(in/32)]

A decode step on CUDA in bf16 (the triton_moe switch on) runs grouped_gemm_fp4's kernel for both
GEMMs with the eager SwiGLU between (grouped_gemm_triton's fused SwiGLU reads bf16 weights);
anything else (prefill, CPU, fp32) dequantises the experts to the compute dtype for the call and
takes Experts' own path: the values the emulation serves (serving_format.served_value).
"""

from __future__ import annotations

import torch

from lockstep.quant.fp4 import fp4_scale_shape, quantize_fp4_block
from lockstep.quant.scales import E8M0

from . import grouped_gemm_fp4
from .kernel_switch import forward_kernel_allowed
from .moe import Experts, swiglu_clamped


class PackedTensor:
    """One packed tensor of a module: its unpacked (logical) shape and dtype for the weight update's
    checks, and `load_(w)`, which quantises w into the storage in place."""

    def __init__(self, module, attr: str, shape, dtype):
        self.module, self.attr = module, attr
        self.logical = torch.empty(shape, dtype=dtype, device="meta")

    def load_(self, w: torch.Tensor) -> None:
        self.module.load_(self.attr, w)


class PackedFp4Experts(Experts):
    """Experts (moe.py) over packed fp4 storage, quantised from `experts`' weights."""

    def __init__(self, experts: Experts):
        torch.nn.Module.__init__(self)  # not Experts.__init__: no bf16 parameters
        self.n_experts, self.limit = experts.n_experts, experts.limit
        gate_up, down = experts.gate_up_proj, experts.down_proj
        self.dtype = gate_up.dtype  # the compute dtype the emulation would hold them in
        self.shapes = {"gate_up_proj": tuple(gate_up.shape), "down_proj": tuple(down.shape)}
        for attr, w in (("gate_up_proj", gate_up), ("down_proj", down)):
            *lead, cols = w.shape
            self.register_buffer(attr, torch.zeros(*lead, cols // 2, dtype=torch.uint8, device=w.device))
            self.register_buffer(attr.replace("_proj", "_scale"),
                                 torch.zeros(fp4_scale_shape(tuple(w.shape)), dtype=torch.uint8, device=w.device),
                                 persistent=False)
            self.load_(attr, w.detach())

    @torch.no_grad()
    def load_(self, attr: str, w: torch.Tensor) -> None:
        packed, scale = quantize_fp4_block(w.to(getattr(self, attr).device), scale_dtype=E8M0)
        getattr(self, attr).copy_(packed)
        getattr(self, attr.replace("_proj", "_scale")).copy_(scale.view(torch.uint8))

    def packed_tensors(self) -> dict[str, PackedTensor]:
        return {attr: PackedTensor(self, attr, shape, self.dtype) for attr, shape in self.shapes.items()}

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantised, in the compute dtype (a transient copy per call)."""
        from lockstep.quant.fp4 import dequantize_fp4_block

        return tuple(dequantize_fp4_block(getattr(self, a), getattr(self, a.replace("_proj", "_scale")).view(E8M0),
                                          self.dtype) for a in ("gate_up_proj", "down_proj"))

    def mlp(self, xs: torch.Tensor, counts: torch.Tensor, decode: bool = False) -> torch.Tensor:
        if (decode and grouped_gemm_fp4.triton is not None and xs.dtype == torch.bfloat16
                and forward_kernel_allowed(self.kernels.on("triton_moe"), xs)):
            offs = torch.cumsum(counts, 0).to(torch.int32)
            gate, up = grouped_gemm_fp4.grouped_mm_fp4(xs, self.gate_up_proj, self.gate_up_scale, offs).chunk(2, -1)
            return grouped_gemm_fp4.grouped_mm_fp4(swiglu_clamped(gate, up, self.limit), self.down_proj,
                                                   self.down_scale, offs)
        return super().mlp(xs, counts, decode=False)


@torch.no_grad()
def pack_fp4_experts(model: torch.nn.Module, is_fp4) -> list[str]:
    """Replace every plain Experts module (not a subclass: expert-parallel shards stay as they are)
    whose `{name}.gate_up_proj` is_fp4 by PackedFp4Experts. Returns the packed modules' names."""
    packed = []
    for name, module in list(model.named_modules()):
        if type(module) is Experts and is_fp4(f"{name}.gate_up_proj"):
            parent, _, attr = name.rpartition(".")
            replacement = PackedFp4Experts(module)
            replacement.kernels = module.kernels
            setattr(model.get_submodule(parent), attr, replacement)
            packed.append(name)
    return packed
