"""Packed storage of the engine's quantised weights, and what the weights occupy.

Under an fp8 serving format with `EngineConfig.packed_fp8` (the default), every weight the format
stores as fp8 (`quant.serving_format.serving_storage`: DeepSeek-V4's LINEAR role, dense models'
attention and MLP projections) whose module is a bias-free linear is held packed: e4m3 bytes
plus 128x128 UE8M0 block scales, multiplied by an fp8 GEMM (models/layers/fp8_linear.py). The
served values are the emulation's (dequant(quant(w))), so the policy does not change, only its
bytes. Not packed yet, served emulated as before: routed experts (fp8 or fp4; the grouped GEMMs
take bf16), linears with a bias, tied weights. With `EngineConfig.packed_fp4` (off by default until
measured on a GPU) the fp8-fp4 format's routed experts are held packed too: e2m1 codes two per
byte + e8m0 per 1x32 (models/layers/fp4_experts.py, grouped_gemm_fp4.py).

Weight updates quantise straight into the packed storage, in place (weight_update.write_served
asks `packed_weights`), so captured CUDA graphs keep reading the current weights.
"""

from __future__ import annotations

import torch
from torch import nn

from lockstep.models.layers.fp4_experts import pack_fp4_experts
from lockstep.models.layers.fp8_linear import pack_fp8_linears, packed_weights
from lockstep.quant.formats import Storage, UnknownTensorError
from lockstep.quant.serving_format import serving_storage


def _stored(fmt: str, storage: Storage):
    def stored(name: str) -> bool:
        try:
            return serving_storage(name, fmt) is storage
        except UnknownTensorError:
            return False
    return stored


def install_packed_weights(model: nn.Module, fmt: str, packed_fp8: bool, packed_fp4: bool = False) -> list[str]:
    """Swap the fp8-stored linears (packed_fp8) and fp4-stored routed experts (packed_fp4) for
    packed modules quantised from the current weights; returns their names."""
    names = pack_fp8_linears(model, _stored(fmt, Storage.FP8)) if packed_fp8 else []
    if packed_fp4:
        names += pack_fp4_experts(model, _stored(fmt, Storage.FP4))
    return names


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
