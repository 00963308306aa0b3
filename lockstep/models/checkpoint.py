"""Hugging Face style checkpoint directories: load (any known layout, lazily) and save.

A directory holds `config.json` and safetensors weights, one `model.safetensors` or shards
listed in `model.safetensors.index.json` (read through quant/safetensors_io.py, the reader
conversion uses too). Loading is planned from the safetensors headers
first (names, shapes, dtypes), so a missing, unexpected or mis-shaped tensor fails before any
data is read; then each tensor is read by name, dequantised if it has a sibling
scale (FP8 e4m3 block scales, or packed FP4 with e8m0 1x32 scales), and copied straight into
its destination (a model parameter, or one expert's slice of a stacked expert tensor). Every
error is a `CheckpointError` naming the tensor and the file.

Expert window (`load_pretrained(..., experts=range(lo, hi))`, an expert-parallel rank's block): the
model's routed experts are built with hi - lo experts' storage (moe.expert_window) and only those
experts are read: per-expert tensors (DeepSeek's and transformers' layouts) of other experts are
never opened, and a stacked tensor (lockstep / transformers in-memory names, `gate_up_proj` [E, ...])
is read through `get_slice` rows [lo, hi), so no host ever holds every expert.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lockstep.files import read_json
from lockstep.models import registry
from lockstep.models.key_maps import EXPERT_PARTS, KEY_MAPS, KeyMap, Mapped, expert_slice
from lockstep.models.precision import cast_model, model_tensors, storage_dtype  # noqa: F401  (re-export)
from lockstep.quant.formats import scale_names
from lockstep.quant.fp4 import PACKED_DTYPES
from lockstep.quant.safetensors_io import INDEX_NAME as INDEX  # noqa: F401  (re-export)
from lockstep.quant.safetensors_io import CheckpointError, TensorHeader, TensorReader, read_headers

if TYPE_CHECKING:
    from lockstep.models.layers.moe import Experts

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "generation_config.json")


@dataclass
class _Entry:
    """One checkpoint tensor as its header describes it, and what loading makes of it."""

    header: TensorHeader
    scale: str | None = None  # name of the sibling scale tensor, if quantised
    mapped: Mapped | None = None

    name = property(lambda self: self.header.name)
    file = property(lambda self: self.header.file)
    shape = property(lambda self: self.header.shape)  # torch's (packed fp4: bytes)
    dtype = property(lambda self: self.header.dtype)

    @property
    def logical_shape(self) -> tuple[int, ...]:
        if self.scale and self.dtype in PACKED_DTYPES:  # FP4 e2m1, two values per byte along the last dim
            return (*self.shape[:-1], self.shape[-1] * 2)
        return self.shape


# ---- reading headers -----------------------------------------------------------------------------

def _read_headers(path: Path) -> tuple[dict[str, _Entry], str]:
    headers, where = read_headers(path)
    return {n: _Entry(h) for n, h in headers.items()}, where


def _plan(entries: dict[str, _Entry], key_map: KeyMap) -> list[_Entry]:
    """Pair weights with their scales, drop skipped names, map the rest; unknown names are errors."""
    for e in entries.values():
        e.scale = next((s for s in scale_names(e.name) if s in entries and s != e.name), None)
    scales = {e.scale for e in entries.values() if e.scale}
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

def _expert_windows(model: torch.nn.Module) -> dict[str, "Experts"]:
    """{stacked expert tensor name: its Experts} for experts built in an expert window."""
    from lockstep.models.layers.moe import Experts  # here: it imports the Triton kernels (~1 s)

    return {f"{name}.{attr}": m for name, m in model.named_modules()
            if isinstance(m, Experts) and len(m.rows) != m.n_experts for attr in EXPERT_PARTS}


def _rows(dest: dict[str, torch.Tensor], windows: dict[str, "Experts"], name: str) -> range:
    """The experts destination `name` holds (its rows' experts; all of them unless windowed)."""
    return windows[name].rows if name in windows else range(dest[name].shape[0])


def _source_rows(e: _Entry, windows: dict[str, "Experts"]) -> range | None:
    """The rows of a stacked checkpoint tensor to read (None: all of it)."""
    return windows[e.mapped.name].rows if e.mapped.part is None and e.mapped.name in windows else None


def _dest_view(dest: dict[str, torch.Tensor], e: _Entry, windows: dict[str, "Experts"]) -> torch.Tensor | None:
    """Where entry `e` goes; None for one expert's tensor outside the window (never read)."""
    m = e.mapped
    full = dest[m.name]
    if m.part is None:
        return full
    n_experts = windows[m.name].n_experts if m.name in windows else full.shape[0]
    if m.expert >= n_experts:
        raise CheckpointError(f"tensor {e.name} in {e.file}: expert {m.expert} out of range, "
                              f"{m.name} has {n_experts} experts")
    rows = _rows(dest, windows, m.name)
    return expert_slice(full, m.expert - rows.start, m.part) if m.expert in rows else None


def _expected_shape(dest: dict[str, torch.Tensor], e: _Entry, windows: dict[str, "Experts"]) -> tuple[int, ...]:
    """The shape entry `e` must have on disk: a windowed stacked tensor still holds every expert."""
    full = dest[e.mapped.name]
    if _source_rows(e, windows) is not None:
        return (windows[e.mapped.name].n_experts, *full.shape[1:])
    view = _dest_view(dest, e, windows)
    return tuple((view if view is not None else expert_slice(full, 0, e.mapped.part)).shape)


def _validate(plan: list[_Entry], dest: dict[str, torch.Tensor], aliases: set[str], key_map: KeyMap, where: str,
              windows: dict[str, "Experts"]):
    filled = set()
    for e in plan:
        name = e.mapped.name
        if name in aliases:
            continue
        if name not in dest:
            raise CheckpointError(f"unexpected tensor {e.name} in {e.file}: maps to {name}, which the model lacks")
        got, want = e.logical_shape, _expected_shape(dest, e, windows)
        if got != want:
            alias = f" (lockstep {name})" if name != e.name else ""
            raise CheckpointError(f"wrong shape for tensor {e.name}{alias} in {e.file}: expected {list(want)}, "
                                  f"got {list(got)}")
        filled.add((name, e.mapped.expert, e.mapped.part))
    for name, t in dest.items():
        parts = EXPERT_PARTS.get(name.rsplit(".", 1)[-1]) if t.dim() == 3 else None
        need = [(name, None, None)] if not parts or (name, None, None) in filled else \
            [(name, x, p) for x in _rows(dest, windows, name) for p in parts]
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
    qc = (read_json(file).get("quantization_config") or {}) if file.exists() else {}
    return tuple(qc.get("weight_block_size") or (128, 128))


def _dequantize(q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, e: _Entry, block) -> torch.Tensor:
    if q.dtype == torch.float8_e4m3fn:
        from lockstep.quant.fp8 import dequantize_fp8_block
        return dequantize_fp8_block(q, scale, out_dtype, name=e.name, block=block)
    if q.dtype in PACKED_DTYPES:
        from lockstep.quant.fp4 import dequantize_fp4_block
        return dequantize_fp4_block(q, scale, out_dtype, name=e.name)
    raise CheckpointError(f"tensor {e.name} in {e.file} has scale {e.scale} but dtype {q.dtype} "
                          "is neither FP8 e4m3 nor packed FP4")


def _fill(plan: list[_Entry], dest: dict[str, torch.Tensor], entries: dict[str, _Entry], aliases: set[str],
          fp8_block: tuple[int, int], windows: dict[str, "Experts"]):
    with TensorReader({n: e.header for n, e in entries.items()}) as reader:
        for e in plan:
            view = None if e.mapped.name in aliases else _dest_view(dest, e, windows)
            if view is None:  # an alias, or an expert outside the window
                continue
            rows = _source_rows(e, windows)  # a stacked scale is [E, ...] too: the same rows
            t = reader.get(e.name, rows)
            if e.scale:
                t = _dequantize(t, reader.get(e.scale, rows),
                                view.dtype if view.is_floating_point() else torch.float32, e, fp8_block)
            with torch.no_grad():
                view.copy_(t)


# ---- public loading API ---------------------------------------------------------------------------

def _config_file(path: Path) -> Path:
    file = path / "config.json"
    if not file.exists():
        raise CheckpointError(f"no config.json in {path}")
    return file


def _resolve(path: Path, model_type_or_config) -> tuple[str, object | None]:
    if model_type_or_config is None:
        return registry.config_from_file(_config_file(path)).model_type, None
    if isinstance(model_type_or_config, str):
        return model_type_or_config, None
    return model_type_or_config.model_type, model_type_or_config


def _alloc_dest(plan: list[_Entry], dtype, model_type: str, n_experts: int | None) -> dict[str, torch.Tensor]:
    """Destination tensors for a model-less load, shaped from the headers (experts stacked)."""
    shapes, dtypes, experts = {}, {}, defaultdict(int)
    for e in plan:
        name, src = e.mapped.name, e.dtype
        if e.scale:  # dequantised: to `dtype`, bf16 by default
            src = storage_dtype(model_type, name, dtype or torch.bfloat16)
        elif dtype is not None and src.is_floating_point:
            src = storage_dtype(model_type, name, dtype)
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
    dest = _alloc_dest(plan, dtype, model_type, getattr(config, "n_routed_experts", None))
    _validate(plan, dest, set(), key_map, where, {})
    _fill(plan, dest, entries, set(), _fp8_block(path), {})
    return dest


def load_into(model: torch.nn.Module, path, model_type: str | None = None, absent: frozenset = frozenset()) -> None:
    """Copy a checkpoint into an existing model's parameters and buffers, validating everything;
    experts built in an expert window read only their rows (module docstring). `absent`: lockstep
    names of tensors the model lacks on purpose (a part of the model: `load_part`), never read."""
    path = Path(path)
    model_type = model_type or model.config.model_type
    key_map = KEY_MAPS[registry.entry(model_type).key_map]
    entries, where = _read_headers(path)
    plan = [e for e in _plan(entries, key_map) if e.mapped.name not in absent]
    dest, aliases = model_tensors(model)
    windows = _expert_windows(model)
    _validate(plan, dest, aliases, key_map, where, windows)
    _fill(plan, dest, entries, aliases, _fp8_block(path), windows)


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


def _build(path: Path, device, dtype: torch.dtype | None, experts: range | None) -> tuple[torch.nn.Module, Path]:
    """The model config.json names, built on `device` without random initialisation, in `dtype`
    (None: float32), holding experts `experts` -> (model, the config file)."""
    config_file = _config_file(path)
    config = registry.config_from_file(config_file)
    from lockstep.models.layers.moe import expert_window

    with torch.device(device), _skip_init(), expert_window(experts):
        model = registry.model_class(config.model_type)(config)
    if dtype is not None:
        cast_model(model, dtype)
    return model, config_file


def _filled(model: torch.nn.Module, path: Path, config_file: Path, absent: frozenset = frozenset()) -> torch.nn.Module:
    """`model` (built from `config_file`) filled from the checkpoint in `path`, in eval mode."""
    try:
        load_into(model, path, model.config.model_type, absent=absent)
    except CheckpointError as e:  # the model was built from config.json: a wrong field shows up as a tensor
        raise CheckpointError(f"{e} (the model was built from {config_file}: do its fields match the weights?)") from e
    model.source_dir = str(path)  # save_pretrained copies the tokenizer from here
    return model.eval()


def load_pretrained(path, dtype: torch.dtype | None = None, device="cpu",
                    experts: range | None = None) -> torch.nn.Module:
    """Build the model config.json names and load its weights; `dtype` None keeps float32.
    `experts`: hold and read only these routed experts of every MoE layer (module docstring); the
    model then runs once they are sharded (lockstep/dist/engine_expert_parallel.py)."""
    path = Path(path)
    model, config_file = _build(path, device, dtype, experts)
    return _filled(model, path, config_file)


def load_part(path, cut, dtype: torch.dtype | None = None, device="cpu", experts: range | None = None) -> torch.nn.Module:
    """The part of a model one process holds, and only its tensors read: the model config.json names
    is built on the meta device (no memory), `cut(model)` returns the part to keep (e.g. a pipeline
    stage: lockstep/dist/pipeline_parallel.split_model), which is then made on `device` and filled
    from the checkpoint; the tensors of what the cut dropped are never opened, so no process holds
    the whole model. `dtype` and `experts` as load_pretrained's."""
    path = Path(path)
    model, config_file = _build(path, "meta", dtype, experts)
    whole = set(model_tensors(model)[0])
    part = cut(model)
    absent = frozenset(whole - set(model_tensors(part)[0]))
    part.to_empty(device=device)
    return _filled(part, path, config_file, absent)


from lockstep.models.checkpoint_save import save_pretrained, save_state_dict  # noqa: E402,F401  (re-export)
