"""Packed storage of the engine's quantised weights, and what the weights occupy.

Under an fp8 serving format with `EngineConfig.packed_fp8` (off by default until measured on GPUs), every weight the format
stores as fp8 (`quant.serving_format.serving_storage`: DeepSeek-V4's LINEAR role, dense models'
attention and MLP projections) whose module is a bias-free linear is held packed: e4m3 bytes
plus 128x128 UE8M0 block scales, multiplied by an fp8 GEMM (models/layers/fp8_linear.py). The
served values are the emulation's (dequant(quant(w))), so the policy does not change, only its
bytes. With `EngineConfig.packed_experts` (off by default until measured on a GPU) the routed
experts are held packed too, in the format's expert storage: fp8 (e4m3 + 128x128 scales) under
"fp8", fp4 (e2m1 two per byte + e8m0 per 1x32) under "fp8-fp4" (models/layers/packed_experts.py,
grouped_gemm_fp8.py / grouped_gemm_fp4.py). Not packed: linears with a bias, tied weights,
expert-parallel shards.

Weight updates quantise straight into the packed storage, in place (weight_update.write_served
asks `packed_weights`), so captured CUDA graphs keep reading the current weights. On CUDA the
re-quantisation is quant/fp8_triton.py's and fp4_triton.py's Triton kernels (quantize_fp8_block /
quantize_fp4_block select them for CUDA tensors; bitwise the PyTorch rule, which CPU runs; their
`out=` writes the packed storage directly). Issue 17's bar, the push within 2x of its bytes at
copy bandwidth, is printed by benchmarks/weight_push.py --packed. On one H200 (gpu-848m, fp8): the
in-process update (re-quantisation included) 20 ms, ~25x that bound (0.81 ms for 1,709 MB); a push
over gloo through host memory 0.54 s, 665x (README; NCCL between two GPUs not yet measured).
"""

from __future__ import annotations

import torch
from torch import nn

from lockstep.models.layers.packed_experts import pack_experts
from lockstep.models.layers.fp8_linear import pack_fp8_linears, packed_weights
from lockstep.quant.formats import Storage, UnknownTensorError
from lockstep.quant.serving_format import serving_storage


def _storage(name: str, fmt: str) -> str | None:
    """serving_storage's value ("fp8", "fp4", "bf16", ...), None for names no rule knows."""
    try:
        return serving_storage(name, fmt).value
    except UnknownTensorError:
        return None


def stored_as(fmt: str, storage: Storage):
    """name -> whether the format stores that tensor as `storage` (the rule packing follows)."""
    return lambda name: _storage(name, fmt) == storage.value


def install_packed_weights(model: nn.Module, fmt: str, packed_fp8: bool, packed_experts: bool = False) -> list[str]:
    """Swap the fp8-stored linears (packed_fp8) and the quantised routed experts (packed_experts) for
    packed modules quantised from the current weights; returns their names."""
    names = pack_fp8_linears(model, stored_as(fmt, Storage.FP8)) if packed_fp8 else []
    if packed_experts:
        names += pack_experts(model, lambda name: _storage(name, fmt))
    return names


def unpacked_state_dict(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """model.state_dict() with every packed tensor replaced by its served values in `dtype` (a
    dequantised copy: for loading the served policy into another implementation)."""
    state = dict(model.state_dict())
    state.update({name: p.dequantized(dtype) for name, p in packed_weights(model).items()})
    return state


def _unique(model: nn.Module):
    """Each distinct storage behind the model's parameters and buffers once (a fused matrix and
    its views, tied weights) -> (storage nbytes, one tensor on it)."""
    seen = {}
    for t in list(model.parameters()) + list(model.buffers()):
        storage = t.untyped_storage()
        seen.setdefault(storage.data_ptr(), (storage.nbytes(), t))
    return seen.values()


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights occupy: every parameter and buffer storage once, packed weights
    as bytes + scales; no dequantised copies exist."""
    return sum(nbytes for nbytes, _ in _unique(model))


def unpacked_weight_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """What `weight_bytes` would be with every packed weight held as `dtype` values instead (the
    bf16 format's engine, in its compute dtype), computed from this model alone."""
    packed = packed_weights(model).values()
    modules = [getattr(p, "module", p) for p in packed]  # Fp8Linear, or the module of a PackedTensor
    packed_storages = {t.untyped_storage().data_ptr() for m in modules for t in m.buffers()}
    packed_storages |= {t.untyped_storage().data_ptr() for name, t in model.named_buffers()
                        if name.rpartition(".")[2].startswith("fused_fp8_")}  # fused_linear.py's stacks
    unpacked = sum(nbytes for nbytes, t in _unique(model) if t.untyped_storage().data_ptr() not in packed_storages)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return unpacked + sum(p.logical.numel() * itemsize for p in packed)
