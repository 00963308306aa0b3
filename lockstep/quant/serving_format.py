"""The values the engine serves for each weight under a serving format (bf16 | fp8 | fp8-fp4).

How quantised weights are served: the engine's model holds every weight as
dequant(quant(w)) in the model's dtype, i.e. exactly the values the fp8 / fp4 GEMM kernels
multiply by (fp8: e4m3 with 128x128 UE8M0 block scales; fp4: e2m1 with 1x32 e8m0 scales;
tensors stored unquantised ("bf16") kept in the engine's dtype — bf16 on GPUs, and exactly the
trainer's weights in a float32 run; fp32 tensors kept). This fake-quantised form is correct
on any device and is what the trainer's quantisation-aware forward reproduces; real fp8 / fp4
kernels over packed weights are a speed optimisation that must return the same values: the
engine holds fp8 linears packed that way by default (lockstep/engine/packed_weights.py,
models/layers/fp8_linear.py; EngineConfig.packed_fp8), routed experts not yet.

Which storage a tensor gets: DeepSeek-V4 names follow `lockstep.quant.formats.storage_for`;
dense Llama / Qwen3 names (which that rule does not know) follow the rule below: attention and
MLP projections are quantised like DeepSeek's LINEAR role, everything else stays bf16.
"""

from __future__ import annotations

import functools
import re

import torch

from lockstep.quant.formats import ServingFormat, Storage, UnknownTensorError, local_name, storage_for
from lockstep.quant.fp4 import dequantize_fp4_block, quantize_fp4_block
from lockstep.quant.fp8 import dequantize_fp8_block, quantize_fp8_block

_DENSE_LINEAR = re.compile(r"(?:self_attn\.(?:q|k|v|o)_proj|mlp\.(?:gate|up|down)_proj)\.weight")
_DENSE_BF16 = re.compile(r"embed_tokens\.weight|lm_head\.weight|(?:\w+\.)*\w*norm\.weight|.*\.bias")
# fp8 weights' block scales when served (the emulated value here, the packed storage's:
# models/layers/fp8_linear.quantise_packed): powers of two
FP8_SCALE_FMT = "ue8m0"
_LINEAR_STORAGE = {ServingFormat.BF16: Storage.BF16, ServingFormat.FP8: Storage.FP8, ServingFormat.FP8_FP4: Storage.FP8}


@functools.lru_cache(maxsize=1 << 16)
def serving_storage(name: str, fmt: str | ServingFormat) -> Storage:
    """How tensor `name` (lockstep / transformers in-memory name) is stored when served in `fmt`.
    Cached: a function of the name, asked per tensor per weight update (~20 regular expressions
    each, ~3 ms of an 8-layer model's update on the host)."""
    try:
        return storage_for(name, fmt)
    except UnknownTensorError:
        local = local_name(name)
        if _DENSE_LINEAR.fullmatch(local):
            return _LINEAR_STORAGE[ServingFormat.parse(fmt)]
        if _DENSE_BF16.fullmatch(local):
            return Storage.BF16
        raise


def copied_unchanged(name: str, w: torch.Tensor, fmt: str | ServingFormat, out_dtype: torch.dtype) -> bool:
    """The served value is `w.to(out_dtype)`: index tables (tid2eid, copied exactly) and tensors
    stored unquantised (BF16 / FP32 storage, kept in the destination's dtype)."""
    if not w.is_floating_point() or not out_dtype.is_floating_point:
        return True
    return not serving_storage(name, fmt).quantised


def served_value(name: str, w: torch.Tensor, fmt: str | ServingFormat, out_dtype: torch.dtype) -> torch.Tensor:
    """dequant(quant(w)) for tensor `name` under `fmt`, as `out_dtype` (the destination's dtype)."""
    if copied_unchanged(name, w, fmt, out_dtype):
        return w.to(out_dtype)
    storage = serving_storage(name, fmt)
    if storage is Storage.FP8:
        q, s = quantize_fp8_block(w, scale_fmt=FP8_SCALE_FMT, name=name)
        return dequantize_fp8_block(q, s, out_dtype, name=name)
    packed, s = quantize_fp4_block(w, name=name)  # FP4: the only other quantised storage
    return dequantize_fp4_block(packed, s, out_dtype, name=name)
