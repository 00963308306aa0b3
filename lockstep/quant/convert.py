"""Convert a safetensors checkpoint directory between serving formats: bf16 | fp8 | fp8-fp4.

    convert_checkpoint(src_dir, dst_dir, to="fp8-fp4", scale_fmt="ue8m0")

Input: a Hugging Face style directory: config.json, one or more *.safetensors (sharded with
model.safetensors.index.json), tokenizer and other small files. Tensor names are DeepSeek-V4's
official ones (optionally `model.`-prefixed) or transformers' in-memory ones; a quantised weight
`X.weight` has its block scale beside it as `X.scale` (V4) or `X.weight_scale_inv` (V3 style).

Each tensor gets the storage that `formats.storage_for(name, to)` gives it:
  bf16 / fp32 / int32  dequantised if it was quantised (fp8 when the weight is float8_e4m3fn,
                       fp4 when it is packed uint8 / int8), then cast; scales dropped
  fp8                  e4m3 + 128x128 block scale `X.scale` (float8_e8m0fnu for ue8m0, else float32)
  fp4                  packed e2m1 + 1x32 scale; int8 by default, the official checkpoints' dtype
                       (transformers 5.23's fp8 loader unpacks int8 / float4_e2m1fn_x2 as fp4
                       but would read uint8 as plain numbers)
Weights already in the target storage with fitting scales are copied, not re-quantised (only the
scale's dtype may change), so converting an official checkpoint to its own format is lossless.

Output keeps the input's shard files (same names; a scale lands in its weight's shard) and writes
an index json when the input was sharded (reading, F4 / F8 headers included, and the index are
safetensors_io.py's, shared with the model loader and `save_pretrained`). config.json's
`quantization_config` is rewritten
({"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128],
"expert_dtype": "fp4" | "fp8", ...}) or removed for bf16. Other top-level files (tokenizer,
generation config, chat template) are copied.

Tensors are read one at a time (`TensorReader`) and written one at a time (SafetensorsWriter), so
memory holds one tensor and its conversion, not a shard. Errors name the tensor and its file.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lockstep.files import read_json
from lockstep.quant.errors import QuantFormatError
from lockstep.quant.formats import STORAGE_DTYPE, ServingFormat, Storage, UnknownTensorError, scale_names, storage_for
from lockstep.quant.fp4 import PACKED_DTYPES, check_fp4_scale, dequantize_fp4_block, fp4_scale_shape, quantize_fp4_block
from lockstep.quant.fp8 import FP8_BLOCK, check_fp8_scale, dequantize_fp8_block, fp8_scale_shape, quantize_fp8_block
from lockstep.quant.safetensors_io import INDEX_NAME, SafetensorsWriter, TensorHeader, TensorReader, TensorSpec, \
    read_headers, write_index
from lockstep.quant.scales import E8M0, is_pow2, scale_to_e8m0

SCALE_FMTS = ("ue8m0", "fp32")


@dataclass
class _Unit:
    """One output weight (and its scale, for quantised storage) made from one source tensor (and its scale)."""

    src: TensorHeader
    src_scale: TensorHeader | None
    target: Storage | None  # None: copy unchanged (unknown name, strict=False)
    out: list[TensorSpec] = field(default_factory=list)

    @property
    def kind(self) -> str:
        if self.src_scale is None:
            return "plain"
        if self.src.dtype == torch.float8_e4m3fn:
            return "fp8"
        if self.src.dtype in PACKED_DTYPES:
            return "fp4"
        raise QuantFormatError(f"{self.src.name}: has a scale ({self.src_scale.name}) but dtype {self.src.dtype}")

    @property
    def logical_shape(self) -> tuple[int, ...]:
        if self.kind == "fp4":
            return (*self.src.shape[:-1], 2 * self.src.shape[-1])
        return self.src.shape


@dataclass
class ConversionResult:
    files: list[Path]  # safetensors files written
    storage: dict[str, Storage | None]  # source weight name -> storage it got (None: copied unchanged)


def convert_checkpoint(
    src_dir: str | Path,
    dst_dir: str | Path,
    to: str | ServingFormat,
    scale_fmt: str = "ue8m0",
    *,
    block: tuple[int, int] | None = None,
    fp4_dtype: torch.dtype = torch.int8,
    strict: bool = True,
    progress: bool | None = None,
) -> ConversionResult:
    """Convert checkpoint directory `src_dir` to serving format `to`, writing `dst_dir`.

    scale_fmt: "ue8m0" (power-of-two scales stored as float8_e8m0fnu) or "fp32" (float32 scales;
    fp4 scales are then float32 powers of two). block: fp8 block of the output (default: the
    input's `weight_block_size`, else 128x128). fp4_dtype: torch.int8 or torch.uint8 storage of
    packed e2m1. strict: unknown tensor names are an error; with strict=False they are copied
    (dequantised for bf16). progress: a rich progress bar (default: when stderr is a terminal).
    """
    fmt = ServingFormat.parse(to)
    scale_fmt = "fp32" if scale_fmt == "float" else scale_fmt
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"scale_fmt must be one of {SCALE_FMTS}, got {scale_fmt!r}")
    if fp4_dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"fp4_dtype must be torch.int8 or torch.uint8, got {fp4_dtype}")
    src, dst = Path(src_dir), Path(dst_dir)
    if src.resolve() == dst.resolve():
        raise ValueError("convert_checkpoint: src_dir and dst_dir must differ")
    config = read_json(src / "config.json") if (src / "config.json").exists() else None
    src_block = _config_block(config) or FP8_BLOCK
    out_block = tuple(block) if block is not None else src_block
    scale_dtype = E8M0 if scale_fmt == "ue8m0" else torch.float32

    sources, _ = read_headers(src)
    files = sorted({h.file for h in sources.values()})
    plan = _plan(sources, files, fmt, strict, out_block, scale_dtype, fp4_dtype)

    dst.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total_size = 0
    written: list[Path] = []
    show = sys.stderr.isatty() if progress is None else progress
    with contextlib.ExitStack() as stack:
        reader = stack.enter_context(TensorReader(sources))
        bar = stack.enter_context(_progress(show))
        task = bar.add_task(f"convert -> {fmt.value}", total=sum(len(units) for units in plan.values()))
        for f in files:
            units = plan[f]
            specs = [spec for unit in units for spec in unit.out]
            metadata = {**reader.metadata(f), "format": "pt"}
            with SafetensorsWriter(dst / f.name, specs, metadata) as writer:
                for unit in units:
                    try:
                        tensors = _produce(unit, reader, src_block, out_block, scale_dtype, fp4_dtype)
                        for t in tensors:
                            writer.write(t)
                    except (QuantFormatError, ValueError, RuntimeError, TypeError) as e:
                        msg = str(e) if unit.src.name in str(e) else f"{unit.src.name}: {e}"
                        raise QuantFormatError(f"{f}: {msg}") from e
                    bar.advance(task)
            written.append(dst / f.name)
            for spec in specs:
                weight_map[spec.name] = f.name
                total_size += spec.nbytes

    if (src / INDEX_NAME).exists() or len(files) > 1:
        write_index(dst, weight_map, total_size)
    if config is not None:
        new_config = updated_config(config, fmt, scale_fmt, out_block)
        (dst / "config.json").write_text(json.dumps(new_config, indent=2) + "\n")
    for extra in sorted(src.iterdir()):
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in (INDEX_NAME, "config.json"):
            shutil.copy2(extra, dst / extra.name)
    storage = {unit.src.name: unit.target for units in plan.values() for unit in units}
    return ConversionResult(files=written, storage=storage)


def updated_config(config: dict, to: str | ServingFormat, scale_fmt: str = "ue8m0", block=FP8_BLOCK) -> dict:
    """config.json contents for a checkpoint converted to `to` (a new dict)."""
    fmt = ServingFormat.parse(to)
    out = dict(config)
    if fmt == ServingFormat.BF16:
        out.pop("quantization_config", None)
        out.pop("expert_dtype", None)
        return out
    qc = dict(out.get("quantization_config") or {})
    qc.update(
        quant_method="fp8",
        fmt="e4m3",
        activation_scheme=qc.get("activation_scheme", "dynamic"),
        weight_block_size=[int(block[0]), int(block[1])],
        expert_dtype="fp4" if fmt == ServingFormat.FP8_FP4 else "fp8",
    )
    if scale_fmt == "ue8m0":
        qc["scale_fmt"] = "ue8m0"
    else:
        qc.pop("scale_fmt", None)  # absent means float32 scales for both DeepSeek's and transformers' readers
    out["quantization_config"] = qc
    if "expert_dtype" in out:
        out["expert_dtype"] = qc["expert_dtype"]
    return out


# ----------------------------------------------------------------------------- planning


def _config_block(config: dict | None) -> tuple[int, int] | None:
    qc = (config or {}).get("quantization_config") or {}
    wbs = qc.get("weight_block_size")
    return (int(wbs[0]), int(wbs[1])) if wbs else None


def _plan(sources, files, fmt, strict, block, scale_dtype, fp4_dtype) -> dict[Path, list[_Unit]]:
    scale_of: dict[str, TensorHeader] = {}
    for name in sources:
        for cand in scale_names(name):
            if cand in sources and cand != name:
                scale_of[name] = sources[cand]
                break
    consumed = {s.name for s in scale_of.values()}
    plan: dict[Path, list[_Unit]] = {f: [] for f in files}
    out_names: dict[str, str] = {}
    for name, src in sources.items():
        if name in consumed:
            continue
        unit = _Unit(src, scale_of.get(name), None)
        try:
            unit.target = _target(unit, fmt, strict)
            unit.out = _out_specs(unit, block, scale_dtype, fp4_dtype)
        except QuantFormatError as e:
            raise QuantFormatError(f"{src.file}: {e}") from e
        for spec in unit.out:
            if spec.name in out_names:
                raise QuantFormatError(f"{src.file}: {spec.name}: written for both {out_names[spec.name]} and {name}")
            out_names[spec.name] = name
        plan[src.file].append(unit)
    return plan


def _target(unit: _Unit, fmt: ServingFormat, strict: bool) -> Storage | None:
    try:
        return storage_for(unit.src.name, fmt)
    except UnknownTensorError:
        if strict:
            raise
    kind = unit.kind
    if kind == "plain":
        return None
    if fmt == ServingFormat.BF16:
        return Storage.BF16
    return Storage.FP8 if kind == "fp8" else Storage.FP4


def _out_specs(unit: _Unit, block, scale_dtype, fp4_dtype) -> list[TensorSpec]:
    name, target, shape = unit.src.name, unit.target, unit.logical_shape
    if target is None:
        return [TensorSpec(name, unit.src.dtype, unit.src.shape)]
    is_float = unit.src.dtype.is_floating_point or unit.kind != "plain"
    if (target == Storage.INT32) == is_float:
        raise QuantFormatError(f"{name}: dtype {unit.src.dtype} cannot be stored as {target.value}")
    if target in STORAGE_DTYPE:
        return [TensorSpec(name, STORAGE_DTYPE[target], shape)]
    scale_name = unit.src_scale.name if unit.src_scale is not None else scale_names(name)[0]
    if len(shape) < 2:
        raise QuantFormatError(f"{name}: a {target.value} weight must be at least 2-D, got shape {shape}")
    if target == Storage.FP8:
        return [
            TensorSpec(name, torch.float8_e4m3fn, shape),
            TensorSpec(scale_name, scale_dtype, fp8_scale_shape(shape, block)),
        ]
    if shape[-1] % 2:
        raise QuantFormatError(f"{name}: last dim {shape[-1]} is odd; e2m1 packs two values per byte")
    return [
        TensorSpec(name, fp4_dtype, (*shape[:-1], shape[-1] // 2)),
        TensorSpec(scale_name, scale_dtype, fp4_scale_shape(shape)),
    ]


# ----------------------------------------------------------------------------- producing


def _produce(unit: _Unit, reader: TensorReader, src_block, block, scale_dtype, fp4_dtype) -> list[torch.Tensor]:
    name = unit.src.name
    t = reader.get(name)
    s = reader.get(unit.src_scale.name) if unit.src_scale is not None else None
    kind, target = unit.kind, unit.target
    if target is None:
        return [t]

    def logical(dtype: torch.dtype) -> torch.Tensor:
        if kind == "fp8":
            return dequantize_fp8_block(t, s, dtype, name=name, block=src_block)
        if kind == "fp4":
            return dequantize_fp4_block(t, s, dtype, name=name)
        return t.to(dtype)

    if target in STORAGE_DTYPE:
        return [logical(STORAGE_DTYPE[target])]
    if target == Storage.FP8:
        if kind == "fp8" and tuple(block) == tuple(src_block):
            check_fp8_scale(t, s, src_block, name)
            kept = _keep_scale(s, scale_dtype, name)
            if kept is not None:
                return [t, kept]
        return list(quantize_fp8_block(logical(torch.float32), block, _fmt(scale_dtype), scale_dtype=scale_dtype, name=name))
    # Storage.FP4
    if kind == "fp4":
        check_fp4_scale(t, s, name=name)
        kept = _keep_scale(s, scale_dtype, name)
        if kept is not None:
            packed = t.view(torch.uint8) if t.dtype != torch.uint8 else t
            return [packed.view(fp4_dtype), kept]
    packed, scale = quantize_fp4_block(logical(torch.float32), scale_dtype=scale_dtype, name=name)
    return [packed.view(fp4_dtype), scale]


def _fmt(scale_dtype: torch.dtype) -> str:
    return "ue8m0" if scale_dtype == E8M0 else "fp32"


def _keep_scale(s: torch.Tensor, scale_dtype: torch.dtype, name: str) -> torch.Tensor | None:
    """The source scale in the output's scale dtype, or None when it cannot be kept exactly."""
    if scale_dtype == torch.float32:
        return s.float()
    if s.dtype == E8M0:
        return s
    if bool(is_pow2(s).all()):
        return scale_to_e8m0(s.float(), name)
    return None  # fp32 scales that are not powers of two: re-quantise with ue8m0 scales


class _NoProgress:
    def add_task(self, *a, **k):
        return 0

    def advance(self, *a, **k):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _progress(show: bool):
    if not show:
        return _NoProgress()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), transient=True
    )
