"""Routed experts served from packed storage (engine opt-in: EngineConfig.packed_experts), in the
serving format's expert storage (quant/formats.py: fp8 for "fp8", fp4 for "fp8-fp4"):

    fp8: gate_up_proj float8_e4m3fn [E, 2F, H], down_proj [E, H, F]; 1 byte per parameter, and
         gate_up_scale / down_scale fp32 [E, ceil(rows/128), ceil(in/128)] (128x128 UE8M0 blocks)
    fp4: gate_up_proj uint8 [E, 2F, H/2], down_proj [E, H, F/2] (e2m1 two per byte); 0.5 byte per
         parameter, and gate_up_scale / down_scale e8m0 bytes [E, rows, ceil(in/32)]

under Experts' state-dict names; the weight update checks a sent tensor against the unpacked shape
(`packed_tensors`, fp8_linear.packed_weights) and `load_` quantises it into the storage in place.
A decode step on CUDA in bf16 (the triton_moe switch on) runs the format's grouped GEMM
(grouped_gemm_fp8.py / grouped_gemm_fp4.py) for both expert GEMMs with the eager SwiGLU between
(grouped_gemm_triton's fused SwiGLU reads bf16 weights); any other call (prefill, CPU, fp32)
dequantises the experts to the compute dtype for the call and takes Experts' own path. Either way
the values are the emulation's (serving_format.served_value). In fp8 storage the decode step's
shared expert, packed in fp8 too, runs inside the same two kernels (Experts.folds_shared).
Expert-parallel shards (subclasses of Experts) are not packed.
"""

from __future__ import annotations

import torch

from lockstep.quant.fp4 import dequantize_fp4_block, fp4_scale_shape
from lockstep.quant.fp8 import FP8_BLOCK, dequantize_fp8_block, fp8_scale_shape
from lockstep.quant.scales import E8M0

from . import grouped_gemm_fp4, grouped_gemm_fp8
from .fp8_linear import quantise_packed
from .grouped_gemm import group_offsets
from .grouped_gemm_triton import laid_out_as_one
from .kernel_switch import forward_kernel_allowed
from .moe import Experts, swiglu_clamped

ATTRS = ("gate_up_proj", "down_proj")


def _scale_attr(attr: str) -> str:
    return attr.replace("_proj", "_scale")


class PackedTensor:
    """One packed tensor of a module: `logical`, a meta tensor of its unpacked shape and dtype (the
    weight update's checks), and `load_(w)`, which quantises w into the storage in place."""

    def __init__(self, module, attr: str, shape, dtype):
        self.module, self.attr = module, attr
        self.logical = torch.empty(shape, dtype=dtype, device="meta")

    def load_(self, w: torch.Tensor) -> None:
        self.module.load_(self.attr, w)

    def packed_target(self) -> tuple[str, tuple[torch.Tensor, torch.Tensor]]:
        """As Fp8Linear.packed_target: (the storage format, "fp8" or "fp4", and the storage load_
        quantises into); fp4 with e8m0 scales per FP4_BLOCK."""
        return self.module.storage, self.module.stored(self.attr)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return self.module.dequantized(self.attr, dtype)


class PackedExperts(Experts):
    """Experts (moe.py) over packed `storage` ("fp8" or "fp4"), quantised from `experts`' weights."""

    def __init__(self, experts: Experts, storage: str):
        torch.nn.Module.__init__(self)  # not Experts.__init__: no bf16 parameters
        if storage not in ("fp8", "fp4"):
            raise ValueError(f"packed expert storage is fp8 or fp4, got {storage!r}")
        self.n_experts, self.limit, self.storage = experts.n_experts, experts.limit, storage
        self.rows = experts.rows
        self.dtype = experts.gate_up_proj.dtype  # the compute dtype the emulation holds them in
        self.shapes = {attr: tuple(getattr(experts, attr).shape) for attr in ATTRS}
        for attr in ATTRS:
            w = getattr(experts, attr)
            *lead, cols = w.shape
            if storage == "fp8":
                q = torch.zeros(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
                scale = torch.ones(fp8_scale_shape(tuple(w.shape)), device=w.device)
            else:
                q = torch.zeros(*lead, cols // 2, dtype=torch.uint8, device=w.device)
                scale = torch.zeros(fp4_scale_shape(tuple(w.shape)), dtype=torch.uint8, device=w.device)
            self.register_buffer(attr, q)
            self.register_buffer(_scale_attr(attr), scale, persistent=False)
            self.load_(attr, w.detach())

    def stored(self, attr: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed storage of weight `attr`: (its bytes, its block scales)."""
        return getattr(self, attr), getattr(self, _scale_attr(attr))

    @torch.no_grad()
    def load_(self, attr: str, w: torch.Tensor) -> None:
        storage = self.stored(attr)  # quantised in place, no staging copy
        quantise_packed(self.storage, [w.to(storage[0].device)], [storage])

    def packed_tensors(self) -> dict[str, PackedTensor]:
        return {attr: PackedTensor(self, attr, shape, self.dtype) for attr, shape in self.shapes.items()}

    def dequantized(self, attr: str, dtype: torch.dtype) -> torch.Tensor:
        q, scale = self.stored(attr)
        if self.storage == "fp8":
            return dequantize_fp8_block(q, scale, dtype)
        return dequantize_fp4_block(q, scale.view(E8M0), dtype)

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantised to the compute dtype (a transient copy per call)."""
        return tuple(self.dequantized(attr, self.dtype) for attr in ATTRS)

    def _decode_kernels(self, xs: torch.Tensor) -> bool:
        return (grouped_gemm_fp8.triton is not None and xs.dtype == torch.bfloat16
                and forward_kernel_allowed(self.kernels.on("triton_moe"), xs))

    def folds_shared(self, x: torch.Tensor, gate_up, down) -> bool:
        """Experts.folds_shared for fp8 storage: a shared expert packed in fp8 ((bytes, scale) pairs,
        fused_linear.py's fused gate and up) whose blocks are an expert's (its gate a whole number of
        128-row blocks, so that the up rows' scales follow in the expert's table order)."""
        if self.storage != "fp8" or not isinstance(gate_up, tuple) or not self._decode_kernels(x):
            return False
        if (gate_up[0].shape[0] // 2) % FP8_BLOCK[0]:
            return False
        mine = [self.stored(attr) for attr in ATTRS]  # [(gate_up bytes, scale), (down bytes, scale)]
        return all(laid_out_as_one(t, m) for theirs, ours in zip((gate_up, down), mine) for t, m in zip(theirs, ours))

    def _grouped_mm(self, x: torch.Tensor, attr: str, offs: torch.Tensor, shared=None, rows=None) -> torch.Tensor:
        """The format's grouped GEMM over x's rows (x[rows] with `rows`: the fp8 kernel reads them in place)."""
        if self.storage == "fp4":
            return grouped_gemm_fp4.grouped_mm_fp4(x if rows is None else x[rows], *self.stored(attr), offs)
        return grouped_gemm_fp8.grouped_mm_fp8(x, *self.stored(attr), offs, shared=shared, rows=rows)

    def mlp(self, xs: torch.Tensor, counts: torch.Tensor, decode: bool = False) -> torch.Tensor:
        if decode and self._decode_kernels(xs):
            return self.decode_mlp(xs, group_offsets(counts))
        return super().mlp(xs, counts, decode=False)

    def decode_mlp(self, x: torch.Tensor, offs: torch.Tensor, shared=None, rows=None) -> torch.Tensor:
        """The format's grouped GEMM for both expert GEMMs over the rows x[rows] (x without `rows`),
        the eager SwiGLU between (module docstring); fp8 with grouped_gemm_fp8.FUSED_SWIGLU: the
        SwiGLU inside the first kernel."""
        shared_gate_up, shared_down = shared or (None, None)
        if self.storage == "fp8" and grouped_gemm_fp8.FUSED_SWIGLU:
            act = grouped_gemm_fp8.grouped_swiglu_fp8(x, *self.stored("gate_up_proj"), offs, self.limit,
                                                      shared=shared_gate_up, rows=rows)
        else:
            gate, up = self._grouped_mm(x, "gate_up_proj", offs, shared_gate_up, rows).chunk(2, dim=-1)
            act = swiglu_clamped(gate, up, self.limit)
        return self._grouped_mm(act, "down_proj", offs, shared_down)

    def extra_repr(self) -> str:
        return f"n_experts={self.n_experts}, packed {self.storage}"


@torch.no_grad()
def pack_experts(model: torch.nn.Module, storage_of) -> list[str]:
    """Replace every plain Experts module (not a subclass: expert-parallel shards stay as they are)
    whose `storage_of(f"{name}.gate_up_proj")` is "fp8" or "fp4" by PackedExperts. Returns the
    packed modules' names."""
    packed = []
    for name, module in list(model.named_modules()):
        storage = storage_of(f"{name}.gate_up_proj") if type(module) is Experts else None
        if storage in ("fp8", "fp4"):
            parent, _, attr = name.rpartition(".")
            replacement = PackedExperts(module, storage)
            replacement.kernels = module.kernels
            setattr(model.get_submodule(parent), attr, replacement)
            packed.append(name)
    return packed
