"""The weight-push manifest: what one push carries, derived from the model on both sides.

A manifest lists every tensor of a push in the model's state-dict order (parameters and persistent
buffers: `tid2eid` and the router bias `e_score_correction_bias` define the policy too), with its
shape and the dtype it travels in, and cuts the list into buckets of at most `bucket_bytes` bytes
(a larger tensor gets a bucket of its own). Each tensor starts at a 16-byte aligned offset of its
bucket, so the receiver reads it as a view of the flat uint8 bucket with no copy.

The trainer and every engine build their manifest independently from their own copy of the one
model definition; equal hashes mean both sides will slice the same bytes the same way. The wire
dtype of a floating tensor is the trainer's weight dtype (`TrainConfig.dtype`), except the names
the model keeps in fp32 (`models.precision.storage_dtype`, the rule the trainer casts with), so the
bytes sent are the trainer's values unchanged and the engine re-quantises them exactly as an
in-process `Engine.update_weights` would. Integer tables keep the model's dtype.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass

import torch

from lockstep.models.layers.fp8_linear import packed_weights
from lockstep.models.precision import storage_dtype
from lockstep.train.quant_aware import canonical_name

ALIGN = 16  # bytes; covers every element size, so a tensor is a view of its bucket


class ManifestMismatch(ValueError):
    """Trainer and engine manifests differ; the message names the first differing tensor."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "float32"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.torch_dtype.itemsize

    def __str__(self) -> str:
        return f"{self.name} {list(self.shape)} {self.dtype}"


@dataclass(frozen=True)
class Bucket:
    """Entries [start, stop) of the manifest, at `offsets` (bytes) in a flat buffer of `nbytes`."""

    start: int
    stop: int
    offsets: tuple[int, ...]
    nbytes: int


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _cut(entries: tuple[TensorSpec, ...], bucket_bytes: int) -> tuple[Bucket, ...]:
    buckets, start, offsets, used = [], 0, [], 0
    for i, spec in enumerate(entries):
        at = _align(used)
        if offsets and at + spec.nbytes > bucket_bytes:  # full: close it (an empty bucket takes anything)
            buckets.append(Bucket(start, i, tuple(offsets), used))
            start, offsets, at = i, [], 0
        offsets.append(at)
        used = at + spec.nbytes
    if offsets:
        buckets.append(Bucket(start, len(entries), tuple(offsets), used))
    return tuple(buckets)


@dataclass(frozen=True)
class Manifest:
    entries: tuple[TensorSpec, ...]
    bucket_bytes: int

    @functools.cached_property
    def buckets(self) -> tuple[Bucket, ...]:
        return _cut(self.entries, self.bucket_bytes)

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def to_bytes(self) -> bytes:
        """Canonical serialised form (what the hash covers and what a mismatch report ships)."""
        return self._serialised

    @functools.cached_property
    def _serialised(self) -> bytes:
        # once per manifest: a push asks for it (and the hash) several times, a JSON dump each
        body = {"bucket_bytes": self.bucket_bytes, "entries": [[e.name, list(e.shape), e.dtype] for e in self.entries]}
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Manifest":
        body = json.loads(data.decode())
        return cls(entries=tuple(TensorSpec(n, tuple(s), d) for n, s, d in body["entries"]),
                   bucket_bytes=body["bucket_bytes"])

    @functools.cached_property
    def hash(self) -> int:
        """sha256 of `to_bytes`, first 8 bytes as a signed int64 (it travels in an int64 header)."""
        return int.from_bytes(hashlib.sha256(self.to_bytes()).digest()[:8], "little", signed=True)

    def first_difference(self, other: "Manifest") -> int | None:
        """Index of the first entry that differs (a missing entry counts), None when the lists are equal."""
        for i, (a, b) in enumerate(zip(self.entries, other.entries)):
            if a != b:
                return i
        if len(self.entries) != len(other.entries):
            return min(len(self.entries), len(other.entries))
        return None

    def describe(self, i: int) -> str:
        return str(self.entries[i]) if i < len(self.entries) else f"nothing (it ends after {len(self.entries)} tensors)"


def wire_dtype(model: torch.nn.Module, name: str, dtype: torch.dtype, weight_dtype: torch.dtype) -> torch.dtype:
    return storage_dtype(model, name, weight_dtype) if dtype.is_floating_point else dtype


def build_manifest(model: torch.nn.Module, weight_dtype: torch.dtype, bucket_bytes: int) -> Manifest:
    """The manifest of a push into or out of `model` (trainer or engine side; module docstring).
    Shapes are global (a sharded DTensor reports its full shape), so no gather is needed."""
    entries = []
    logical = {n: p.logical for n, p in packed_weights(model).items()}  # packed storage: the unpacked shape
    for name, t in model.state_dict().items():
        t = logical.get(name, t)
        name = canonical_name(name)
        entries.append(TensorSpec(name, tuple(t.shape), _dtype_name(wire_dtype(model, name, t.dtype, weight_dtype))))
    return Manifest(entries=tuple(entries), bucket_bytes=bucket_bytes)
