"""lockstep.quant: the serving quantisation formats, as small pure functions.

fp8.py         e4m3 weights, one scale per 128x128 block (ue8m0 power-of-two or fp32 scales)
fp4.py         e2m1 weights packed two per byte, one e8m0 scale per 1x32 block (MXFP4 style)
fp8_triton.py  Triton kernels for both (fp4_triton.py), taken on CUDA tensors by the two above
scales.py      power-of-two (UE8M0) scales: rounding up, float32 <-> float8_e8m0fnu
fake_quant.py  straight-through fake quantisation for quantisation-aware training
formats.py     serving formats (bf16 | fp8 | fp8-fp4) and which storage each checkpoint tensor gets
convert.py     convert a safetensors checkpoint directory between serving formats
"""

from lockstep.quant.errors import QuantFormatError
from lockstep.quant.fake_quant import fake_quant_fp4, fake_quant_fp8
from lockstep.quant.formats import ServingFormat, Storage, storage_for, tensor_role
from lockstep.quant.fp4 import dequantize_fp4_block, pack_e2m1, quantize_fp4_block, unpack_e2m1
from lockstep.quant.fp8 import dequantize_fp8_block, quantize_fp8_block
from lockstep.quant.scales import scale_from_e8m0, scale_to_e8m0

__all__ = [
    "QuantFormatError",
    "ServingFormat",
    "Storage",
    "storage_for",
    "tensor_role",
    "quantize_fp8_block",
    "dequantize_fp8_block",
    "quantize_fp4_block",
    "dequantize_fp4_block",
    "pack_e2m1",
    "unpack_e2m1",
    "scale_to_e8m0",
    "scale_from_e8m0",
    "fake_quant_fp8",
    "fake_quant_fp4",
]
