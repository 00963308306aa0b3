"""Hugging Face style checkpoint directories: load (any known layout, lazily) and save.

A directory holds `config.json` and safetensors weights, one `model.safetensors` or shards
listed in `model.safetensors.index.json`. Loading is planned from the safetensors headers
first (names, shapes, dtypes), so a missing, unexpected or mis-shaped tensor fails before any
data is read; then each tensor is read with `safe_open`, dequantised if it has a sibling
scale (FP8 e4m3 block scales, or packed FP4 with e8m0 1x32 scales), and copied straight into
its destination (a model parameter, or one expert's slice of a stacked expert tensor). Every
error is a `CheckpointError` naming the tensor and the file.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from lockstep.models import registry
from lockstep.models.key_maps import EXPERT_PARTS, KEY_MAPS, KeyMap, Mapped, expert_slice

INDEX = "model.safetensors.index.json"
# (weight suffix, scale suffix): DeepSeek's release uses `.scale`, HF FP8 dumps `.weight_scale_inv`
SCALE_SUFFIXES = ((".weight", ".scale"), (".weight", ".weight_scale_inv"))
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
              "F8_E8M0": getattr(torch, "float8_e8m0fnu", None)}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "generation_config.json")


class CheckpointError(ValueError):
    """A checkpoint does not fit the model; the message names the tensor and the file."""


@dataclass
class _Entry:
    """One checkpoint tensor as its header describes it."""

    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str
    scale: str | None = None  # name of the sibling scale tensor, if quantised
    mapped: Mapped | None = None

    @property
    def logical_shape(self) -> tuple[int, ...]:
        if self.scale and self.dtype in ("U8", "I8"):  # FP4 e2m1, two values per byte along the last dim
            return (*self.shape[:-1], self.shape[-1] * 2)
        return self.shape


# ---- reading headers -----------------------------------------------------------------------------

def _open(file: Path, stack: ExitStack, why: str = ""):
    try:
        return stack.enter_context(safe_open(str(file), framework="pt"))
    except Exception as e:  # safetensors raises its own error type for truncated / corrupt headers
        raise CheckpointError(f"cannot read safetensors file {file}{why}: {e} (truncated or corrupt?)") from e


def _weight_files(path: Path) -> tuple[dict[Path, list[str] | None], str]:
    """{file: tensor names the index assigns to it (None: all)}, and where we looked, for messages."""
    index = path / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
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
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files (and no {INDEX}) in {path}")
    return {f: None for f in files}, str(path)


def _read_headers(path: Path) -> tuple[dict[str, _Entry], str]:
    files, where = _weight_files(path)
    entries: dict[str, _Entry] = {}
    with ExitStack() as stack:
        for file, listed in files.items():
            why = f" (holds tensor {listed[0]} per {INDEX})" if listed else ""
            handle = _open(file, stack, why)
            present = set(handle.keys())
            for name in listed or sorted(present):
                if name not in present:
                    raise CheckpointError(f"tensor {name} listed in {where} is missing from shard {file}")
                sl = handle.get_slice(name)
                entries[name] = _Entry(name, file, tuple(sl.get_shape()), sl.get_dtype())
    return entries, where


def _plan(entries: dict[str, _Entry], key_map: KeyMap) -> list[_Entry]:
    """Pair weights with their scales, drop skipped names, map the rest; unknown names are errors."""
    scales = set()
    for e in entries.values():
        for wsuf, ssuf in SCALE_SUFFIXES:
            if e.name.endswith(wsuf) and (s := e.name[: -len(wsuf)] + ssuf) in entries:
                e.scale = s
                scales.add(s)
    plan = []
    for e in entries.values():
        if e.name in scales or key_map.is_skipped(e.name):
            continue
        e.mapped = key_map.to_lockstep(e.name)
        if e.mapped is None:
            raise CheckpointError(f"unexpected tensor {e.name} in {e.file}: no {key_map.family} name maps to it")
        plan.append(e)
    return plan


# ---- validating against destinations --------------------------------------------------------------

def _dest_view(dest: dict[str, torch.Tensor], e: _Entry) -> torch.Tensor:
    m = e.mapped
    full = dest[m.name]
    if m.part is None:
        return full
    if m.expert >= full.shape[0]:
        raise CheckpointError(f"tensor {e.name} in {e.file}: expert {m.expert} out of range, "
                              f"{m.name} has {full.shape[0]} experts")
    return expert_slice(full, m.expert, m.part)


def _validate(plan: list[_Entry], dest: dict[str, torch.Tensor], aliases: set[str], key_map: KeyMap, where: str):
    filled = set()
    for e in plan:
        name = e.mapped.name
        if name in aliases:
            continue
        if name not in dest:
            raise CheckpointError(f"unexpected tensor {e.name} in {e.file}: maps to {name}, which the model lacks")
        got, want = e.logical_shape, tuple(_dest_view(dest, e).shape)
        if got != want:
            alias = f" (lockstep {name})" if name != e.name else ""
            raise CheckpointError(f"wrong shape for tensor {e.name}{alias} in {e.file}: expected {list(want)}, "
                                  f"got {list(got)}")
        filled.add((name, e.mapped.expert, e.mapped.part))
    for name, t in dest.items():
        parts = EXPERT_PARTS.get(name.rsplit(".", 1)[-1]) if t.dim() == 3 else None
        need = [(name, None, None)] if not parts or (name, None, None) in filled else \
            [(name, x, p) for x in range(t.shape[0]) for p in parts]
        for key in need:
            if key not in filled:
                ckpt = key_map.checkpoint_name(name, expert=key[1] or 0, part=key[2])
                what = f" (expert {key[1]}, {key[2]} part of {name})" if key[1] is not None else \
                    f" (lockstep {name})" if ckpt != name else ""
                raise CheckpointError(f"missing tensor {ckpt}{what} in {where}")


# ---- reading data -------------------------------------------------------------------------------

def _fp8_block(path: Path) -> tuple[int, int]:
    """The FP8 block shape config.json declares (quantization_config.weight_block_size), else 128x128."""
    file = path / "config.json"
    qc = (json.loads(file.read_text()).get("quantization_config") or {}) if file.exists() else {}
    return tuple(qc.get("weight_block_size") or (128, 128))


def _dequantize(q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, e: _Entry, block) -> torch.Tensor:
    if q.dtype == torch.float8_e4m3fn:
        from lockstep.quant.fp8 import dequantize_fp8_block
        return dequantize_fp8_block(q, scale, out_dtype, name=e.name, block=block)
    if q.dtype in (torch.uint8, torch.int8):
        from lockstep.quant.fp4 import dequantize_fp4_block
        return dequantize_fp4_block(q, scale, out_dtype, name=e.name)
    raise CheckpointError(f"tensor {e.name} in {e.file} has scale {e.scale} but dtype {q.dtype} "
                          "is neither FP8 e4m3 nor packed FP4")


def _fill(plan: list[_Entry], dest: dict[str, torch.Tensor], entries: dict[str, _Entry], aliases: set[str],
          fp8_block: tuple[int, int]):
    with ExitStack() as stack:
        handles: dict[Path, object] = {}

        def get(name: str) -> torch.Tensor:
            file = entries[name].file
            if file not in handles:
                handles[file] = _open(file, stack)
            try:
                return handles[file].get_tensor(name)
            except Exception as err:
                raise CheckpointError(f"cannot read tensor {name} from {file}: {err}") from err

        for e in plan:
            if e.mapped.name in aliases:
                continue
            view = _dest_view(dest, e)
            t = get(e.name)
            if e.scale:
                t = _dequantize(t, get(e.scale), view.dtype if view.is_floating_point() else torch.float32, e,
                                fp8_block)
            with torch.no_grad():
                view.copy_(t)


# ---- public loading API ---------------------------------------------------------------------------

def _read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.exists():
        raise CheckpointError(f"no config.json in {path}")
    return json.loads(file.read_text())


def _resolve(path: Path, model_type_or_config) -> tuple[str, object | None]:
    if model_type_or_config is None:
        return _read_config(path)["model_type"], None
    if isinstance(model_type_or_config, str):
        return model_type_or_config, None
    return model_type_or_config.model_type, model_type_or_config


def _matches(name: str, patterns) -> bool:
    return any(re.search(p.replace("*", ".*"), name) for p in patterns)


def _alloc_dest(plan: list[_Entry], dtype, keep_fp32, n_experts: int | None) -> dict[str, torch.Tensor]:
    """Destination tensors for a model-less load, shaped from the headers (experts stacked)."""
    shapes, dtypes, experts = {}, {}, defaultdict(int)
    for e in plan:
        name, src = e.mapped.name, _ST_DTYPES.get(e.dtype) or torch.float32
        if e.scale:
            src = dtype or torch.bfloat16
        elif dtype is not None and src.is_floating_point:
            src = torch.float32 if _matches(name, keep_fp32) else dtype
        dtypes[name] = src
        if e.mapped.part is None:
            shapes[name] = e.logical_shape
        else:
            rows, cols = e.logical_shape
            shapes[name] = (rows * len(EXPERT_PARTS[name.rsplit(".", 1)[-1]]), cols)
            experts[name] = max(experts[name], e.mapped.expert + 1, n_experts or 0)
    return {n: torch.empty(((experts[n],) if n in experts else ()) + tuple(s), dtype=dtypes[n])
            for n, s in shapes.items()}


def load_state_dict(path, model_type_or_config=None, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory under lockstep (= transformers in-memory) names.

    Per-expert tensors are stacked into `gate_up_proj` [E, 2F, D] / `down_proj` [E, D, F];
    quantised tensors are dequantised (to `dtype`, bf16 by default); `mtp.*` is skipped.
    """
    path = Path(path)
    model_type, config = _resolve(path, model_type_or_config)
    key_map = KEY_MAPS[registry.entry(model_type).key_map]
    entries, where = _read_headers(path)
    plan = _plan(entries, key_map)
    dest = _alloc_dest(plan, dtype, registry.keep_in_fp32_patterns(model_type),
                       getattr(config, "n_routed_experts", None))
    _validate(plan, dest, set(), key_map, where)
    _fill(plan, dest, entries, set(), _fp8_block(path))
    return dest


def model_tensors(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], set[str]]:
    """(parameters + persistent buffers, de-duplicated; names that alias another, e.g. tied lm_head)."""
    tensors = {n: p.data for n, p in model.named_parameters()}
    for name, buf in model.named_buffers():
        mod, _, leaf = name.rpartition(".")
        owner = model.get_submodule(mod) if mod else model
        if leaf not in owner._non_persistent_buffers_set:
            tensors[name] = buf
    return tensors, set(model.state_dict().keys()) - set(tensors)


def load_into(model: torch.nn.Module, path, model_type: str | None = None) -> None:
    """Copy a checkpoint into an existing model's parameters and buffers, validating everything."""
    path = Path(path)
    model_type = model_type or model.config.model_type
    key_map = KEY_MAPS[registry.entry(model_type).key_map]
    entries, where = _read_headers(path)
    plan = _plan(entries, key_map)
    dest, aliases = model_tensors(model)
    _validate(plan, dest, aliases, key_map, where)
    _fill(plan, dest, entries, aliases, _fp8_block(path))


def cast_model(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast floating parameters and persistent buffers to `dtype`, except the model's fp32 patterns."""
    keep = registry.fp32_patterns_of(model)
    tensors, _ = model_tensors(model)
    for name, t in tensors.items():
        if t.is_floating_point():
            target = torch.float32 if _matches(name, keep) else dtype
            mod, _, leaf = name.rpartition(".")
            owner = model.get_submodule(mod) if mod else model
            if leaf in owner._parameters:
                owner._parameters[leaf].data = t.to(target)
            else:
                owner._buffers[leaf] = t.to(target)


@contextmanager
def _skip_init():
    """Make torch.nn.init a no-op while building a model whose every tensor the checkpoint overwrites
    (load_into fails on any missing one), so no time goes into random initialisation."""
    names = [n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch.nn.init, n, fn)


def load_pretrained(path, dtype: torch.dtype | None = None, device="cpu") -> torch.nn.Module:
    """Build the model config.json names and load its weights; `dtype` None keeps float32."""
    path = Path(path)
    config = registry.config_from_hf_dict(_read_config(path))
    with torch.device(device), _skip_init():
        model = registry.model_class(config.model_type)(config)
    if dtype is not None:
        cast_model(model, dtype)
    load_into(model, path, config.model_type)
    model.source_dir = str(path)  # save_pretrained copies the tokenizer from here
    return model.eval()


from lockstep.models.checkpoint_save import save_pretrained, save_state_dict  # noqa: E402,F401  (re-export)
