"""Safetensors checkpoint IO, the one reader and index writer for loading, saving and conversion.

Reading: a directory holds one or more `*.safetensors` files, or shards listed in
`model.safetensors.index.json` (the index is authoritative: each tensor is read from the shard
it names). `read_headers` plans from the headers alone (name, file, torch dtype, torch shape),
so nothing is read before the whole layout is known; `TensorReader` then reads tensors by name,
each shard opened once. Every error is a `CheckpointError` naming the file (and the tensor).

Writing: `write_index` writes the index transformers 5.23 writes ({"metadata": {"total_size":
bytes}, "weight_map": {name: shard}}, names sorted). `SafetensorsWriter` streams one file:
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
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"

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


class CheckpointError(ValueError):
    """A checkpoint cannot be read, or does not fit the model; the message names the tensor and the file."""


# ---- reading -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorHeader:
    """One stored tensor as its file's header describes it, in torch's terms."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]  # as torch holds it: packed fp4 counts bytes (pairs of e2m1), F4 included


def shard_files(directory: str | Path) -> tuple[dict[Path, list[str] | None], str]:
    """{file: tensor names the index assigns to it (None: all it holds)}, and where we looked (for messages)."""
    path = Path(directory)
    index = path / INDEX_NAME
    if not index.exists():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files (and no {INDEX_NAME}) in {path}")
        return dict.fromkeys(files), str(path)
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"bad index {index}: {e}") from e
    files: dict[Path, list[str]] = defaultdict(list)
    for name, file in weight_map.items():
        files[path / file].append(name)
    for file, names in files.items():
        if not file.exists():
            more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
            raise CheckpointError(f"index {index} maps tensor {names[0]}{more} to shard {file.name}, "
                                  f"which does not exist in {path}")
    return dict(files), str(index)


def open_file(file: Path, stack: ExitStack, why: str = ""):
    """A safe_open handle, closed with `stack`; unreadable files are CheckpointErrors."""
    try:
        return stack.enter_context(safe_open(str(file), framework="pt"))
    except Exception as e:  # safetensors raises its own error type for truncated / corrupt headers
        raise CheckpointError(f"cannot read safetensors file {file}{why}: {e} (truncated or corrupt?)") from e


def _header(handle, name: str, file: Path) -> TensorHeader:
    sl = handle.get_slice(name)
    code, shape = sl.get_dtype(), tuple(sl.get_shape())
    if code not in CODE_DTYPES:
        raise CheckpointError(f"tensor {name} in {file}: unsupported safetensors dtype {code}")
    if code == "F4":  # the header counts e2m1 elements; torch's float4_e2m1fn_x2 counts bytes
        shape = (*shape[:-1], shape[-1] // 2)
    return TensorHeader(name, file, CODE_DTYPES[code], shape)


def read_headers(directory: str | Path) -> tuple[dict[str, TensorHeader], str]:
    """Every tensor of a checkpoint directory (index order, else file by file), and where we looked."""
    files, where = shard_files(directory)
    headers: dict[str, TensorHeader] = {}
    with ExitStack() as stack:
        for file, listed in files.items():
            handle = open_file(file, stack, f" (holds tensor {listed[0]} per {INDEX_NAME})" if listed else "")
            present = set(handle.keys())
            for name in listed or sorted(present):
                if name not in present:
                    raise CheckpointError(f"tensor {name} listed in {where} is missing from shard {file}")
                if name in headers:
                    raise CheckpointError(f"tensor {name} is in both {headers[name].file} and {file}")
                headers[name] = _header(handle, name, file)
    return headers, where


class TensorReader:
    """Reads the tensors `read_headers` found, by name, opening each file once (close with `with`)."""

    def __init__(self, headers: dict[str, TensorHeader]):
        self.headers = headers
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}

    def _handle(self, file: Path):
        if file not in self._handles:
            self._handles[file] = open_file(file, self._stack)
        return self._handles[file]

    def get(self, name: str, rows: range | None = None) -> torch.Tensor:
        """Tensor `name`, or only its rows [rows.start, rows.stop) of dim 0 (the others are not read)."""
        file = self.headers[name].file
        try:
            if rows is not None:
                return self._handle(file).get_slice(name)[rows.start:rows.stop]
            return self._handle(file).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(f"cannot read tensor {name} from {file}: {err}") from err

    def metadata(self, file: Path) -> dict[str, str]:
        """The file's `__metadata__` ({} when it has none)."""
        return self._handle(file).metadata() or {}

    def __enter__(self) -> "TensorReader":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


# ---- writing -------------------------------------------------------------------------------------

def write_index(directory: str | Path, weight_map: dict[str, str], total_size: int) -> None:
    """`model.safetensors.index.json` as transformers writes it; total_size: bytes of all tensors."""
    index = {"metadata": {"total_size": int(total_size)}, "weight_map": dict(sorted(weight_map.items()))}
    (Path(directory) / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


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
