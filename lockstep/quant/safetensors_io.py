"""Streaming safetensors writing: the header is planned up front, tensors are written one at a time.

`safetensors.torch.save_file` needs every tensor of a file in memory at once; converting a
checkpoint shard by shard with it would hold a whole (possibly 4x larger, fp4 -> bf16) shard.
The format is simple enough to stream: an 8-byte little-endian header length, a JSON header
{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}} padded with spaces
to a multiple of 8, then the raw little-endian bytes of each tensor at its offsets.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

# safetensors dtype codes; "F4" (float4_e2m1fn_x2) is left out on purpose: its header shape
# counts e2m1 elements, not bytes, and we only ever write packed fp4 as U8 / I8.
DTYPE_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e8m0fnu: "F8_E8M0",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()} | {"F4": torch.float4_e2m1fn_x2}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


class SafetensorsWriter:
    """Write the tensors of `specs`, in that order, to `path` without holding more than one in memory."""

    def __init__(self, path: str | Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.specs = list(specs)
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        for spec in self.specs:
            if spec.dtype not in DTYPE_CODES:
                raise ValueError(f"{spec.name}: cannot write dtype {spec.dtype} to safetensors")
            if spec.name in header:
                raise ValueError(f"{spec.name}: written twice to {self.path.name}")
            header[spec.name] = {
                "dtype": DTYPE_CODES[spec.dtype],
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)
        self._next = 0

    def write(self, tensor: torch.Tensor) -> None:
        """Write the next planned tensor; its dtype and shape must match the plan."""
        spec = self.specs[self._next]
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(
                f"{spec.name}: planned {spec.dtype} {spec.shape}, got {tensor.dtype} {tuple(tensor.shape)}"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        if data.numel():
            self._file.write(data.view(torch.uint8).numpy().data)
        self._next += 1

    def close(self) -> None:
        self._file.close()
        if self._next != len(self.specs):
            raise ValueError(f"{self.path}: wrote {self._next} of {len(self.specs)} planned tensors")

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()
