"""A portable compile cache: the engine's compiled graphs carried to another process or machine.

Inductor already keeps its results on disk (TORCHINDUCTOR_CACHE_DIR), but only on the machine
that compiled them; a fresh machine (a new rollout node, a restarted job) compiles its graphs
again: 211-245 s for the 1b config's 10 graphs on an H200. `EngineConfig.compile_cache_dir` names
a directory of torch.compiler's "mega-cache" artifacts (torch.compiler.save_cache_artifacts: FX
graphs with their Triton kernels, AOT autograd results, autotuning results), one file per key:

    DIR/KEY.bin    the artifacts, loaded (torch.compiler.load_cache_artifacts) before the engine
                   compiles and written after a start that compiled something new
    DIR/KEY.json   what the key covers, for people
    DIR/KEY.regions/  the compiled layers precompiled (models/precompiled.py): dynamo's trace too,
                   which the artifacts above do not hold (tracing was 40.9 s of a 60.1 s start
                   with them hit)

KEY hashes everything that decides which graphs a start compiles and whether another machine's
artifacts apply: torch, Triton and Python versions, the device kind (GPU name and compute
capability, or "cpu"), the model's config, and the EngineConfig fields except the few that
change no compiled graph (KEY_EXCLUDED), with the inductor settings the decode step compiles with
(lockstep's defaults under compile_options: cuda_graph.decode_inductor_options). A stale file is
therefore never looked up; inside a file, inductor checks each entry against its own key, so an
entry that does not apply is a miss (a compilation), never a wrong graph. A damaged or unreadable
file is a warning naming it, then a start that compiles as if there were none. The artifacts spare
inductor's lowering, code generation and Triton compilation; the precompiled regions spare dynamo's
tracing; the CUDA graph capture still runs.

`lockstep compile MODEL` (commands/compile.py) fills MODEL/compile-cache once; train, serve and
generate use that directory by default when it exists (`default_dir`, the one home of that rule).
Measured on an H200 (benchmarks/rollout_throughput.py prints each engine's start and cache status;
1b config, eager prefill, inductor's and Triton's own caches wiped before each run): 98.7 s with
the file missing, 28.7 s with it hit (98 MiB); with the prefill compiled and the regions
precompiled: 240.5 s with the directory empty, 12.5 s with it filled (2026-12-03).

The artifacts are process-wide: anything else this process compiled before the save (a trainer in
the same process) is written too; that costs bytes, not correctness.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import sys
import warnings
from pathlib import Path

import torch

from lockstep.engine.cuda_graph import decode_inductor_options
from lockstep.files import write_atomically
from lockstep.models.precompiled import PrecompiledRegions

CACHE_SUBDIR = "compile-cache"  # MODEL/compile-cache: where `lockstep compile MODEL` writes

# EngineConfig fields that change no compiled graph, left out of the key so that they do not split
# the cache: what ends a sequence, host-side stepping, the fallback after a failure, where the cache
# lives, which device of a kind (the kind is in the key), and the cache memory (serve sizes it from
# the memory free at start, which varies between starts; should a compiled graph specialise on a
# cache size, inductor's own entry key misses: a compilation, never a wrong graph; not measured).
KEY_EXCLUDED = ("eos_token_ids", "decode_steps", "async_scheduling", "compile_fallback", "compile_cache_dir",
                "device", "cache_memory_bytes")

# counters whose growth means this start compiled something the cache did not hold; with the hits,
# that this start compiled anything at all (the artifacts are process-wide: another component's
# compilations must not make an engine that compiled nothing write a file)
_MISSES = (("inductor", "fxgraph_cache_miss"), ("aot_autograd", "autograd_cache_miss"))
_COMPILED = (*_MISSES, ("inductor", "fxgraph_cache_hit"), ("aot_autograd", "autograd_cache_hit"))


def default_dir(model_dir, given: str | None = None) -> str | None:
    """The compile cache directory of an engine serving `model_dir`: `given` when the command line gave one
    ("" turns the cache off), else MODEL/compile-cache when that directory exists, else None (off)."""
    if given is not None:
        return given or None
    if model_dir:
        path = Path(model_dir) / CACHE_SUBDIR
        if path.is_dir():
            return str(path)
    return None


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return getattr(triton, "__version__", "unknown")


def device_kind(device) -> str:
    """What compiled code depends on in the device: GPU name and compute capability, or the CPU's kind."""
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} sm_{major}{minor} cuda {torch.version.cuda}"
    return f"{device.type} {platform.machine()}"


def _model_fields(model_config) -> dict:
    if dataclasses.is_dataclass(model_config):
        return dataclasses.asdict(model_config)
    if hasattr(model_config, "to_dict"):  # a transformers config
        return model_config.to_dict()
    return dict(vars(model_config))


def key_fields(model_config, config) -> dict:
    """Everything the key hashes (see the module docstring), as JSON-able values."""
    engine = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in KEY_EXCLUDED}
    engine["compile_options"] = decode_inductor_options(config.compile_options)  # lockstep's defaults too
    return json.loads(json.dumps({
        "torch": torch.__version__, "triton": _triton_version(), "python": sys.version.split()[0],
        "device": device_kind(config.device), "model": _model_fields(model_config), "engine": engine,
    }, sort_keys=True, default=repr))


def artifact_key(model_config, config) -> str:
    return _hash(key_fields(model_config, config))


def _hash(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]


def load(path: str | os.PathLike) -> int | None:
    """Hand the artifacts in `path` to torch.compiler -> how many entries it took; None when there is no
    file, or it could not be read (a warning naming the file: the start then compiles as usual)."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        info = torch.compiler.load_cache_artifacts(path.read_bytes())
    except Exception as e:  # never a crash: the cache only saves time
        info, why = None, f"{type(e).__name__}: {e}"
    else:
        why = "not torch.compiler cache artifacts, or damaged"
    if info is None:
        warnings.warn(f"compile cache {path}: unreadable ({why}); compiling as usual", RuntimeWarning, stacklevel=2)
        return None
    return _entries(info)


def _entries(info) -> int:
    artifacts = getattr(info, "artifacts", None)  # CacheInfo's layout since torch 2.8
    if isinstance(artifacts, dict):
        return sum(len(v) for v in artifacts.values())
    return sum(len(getattr(info, f"{kind}_artifacts", ()) or ())
               for kind in ("inductor", "autotune", "aot_autograd", "pgo", "precompile"))


def save(path: str | os.PathLike) -> int:
    """Write every artifact compiled (or hit) in this process to `path`, atomically (a temporary file
    in the same directory, then a rename) -> bytes written; 0 when there is nothing to write (the file,
    if any, is left as it was)."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return 0
    data = saved[0]
    write_atomically(Path(path), data)
    return len(data)


def _counts() -> tuple[int, int]:
    """(cache misses, misses + hits) of inductor's FX graph cache and AOT autograd's cache so far."""
    from torch._dynamo.utils import counters

    def total(names):
        return sum(counters[group][name] for group, name in names)

    return total(_MISSES), total(_COMPILED)


class StartCache:
    """One engine start's use of the cache directory: `load()` before compiling, `save()` after.

    status: "off" (no directory), "hit" (a matching file was loaded and this start compiled nothing
    else), "miss" (this start compiled what no file held, and saved), "nothing" (the directory is set
    but this start compiled nothing with inductor, e.g. on a CPU, where the engine serves eagerly)."""

    def __init__(self, directory, model_config, config):
        self.directory = Path(directory) if directory else None
        self.path = self.regions = None
        if self.directory is not None:
            self.key_fields = key_fields(model_config, config)
            self.path = self.directory / f"{_hash(self.key_fields)}.bin"
            self.regions = PrecompiledRegions(self.path.with_suffix(".regions"))
        self.status = "off" if self.directory is None else "nothing"
        self.loaded = self.saved_bytes = self.others = 0  # others: artifacts of other settings in the directory
        self.regions_saved = 0
        self._before: tuple[int, int] | None = None

    def load(self) -> None:
        self._before = _counts()
        if self.path is None:
            return
        entries = load(self.path)
        self.regions.load()
        if entries is not None:
            self.status, self.loaded = "hit", entries
        elif not self.path.exists() and self.directory.is_dir():
            self.others = len([p for p in self.directory.glob("*.bin") if p != self.path])

    def save(self) -> None:
        """Save when this start compiled what the file did not hold (or there was no usable file)."""
        if self.path is None or self._before is None:
            return
        self.regions_saved += self.regions.save()
        self.regions.save_on_compile = True  # what compiles after the start is saved as it compiles
        (misses, compiled), (misses_before, compiled_before) = _counts(), self._before
        if compiled == compiled_before:
            return  # this start compiled nothing: nothing to cache
        if self.status == "hit" and misses == misses_before:
            return  # everything came from the file: it holds this start already
        self.status = "miss" if misses > misses_before or self.status != "hit" else self.status
        self.saved_bytes = save(self.path)
        if self.saved_bytes:
            write_atomically(self.path.with_suffix(".json"), json.dumps(self.key_fields, indent=1).encode())

    def describe(self) -> str:
        """e.g. "compile cache: loaded 12 entries from DIR" / "compile cache: saved DIR/KEY.bin (3.1 MB)"."""
        if self.path is None:
            return "compile cache: off"
        parts = []
        if self.status == "hit":
            parts.append(f"loaded {self.loaded} entries from {self.directory}")
        if self.regions.loaded or self.regions.compiled:
            parts.append(f"precompiled regions: {self.regions.loaded} loaded, {self.regions.compiled} compiled")
        if self.regions_saved:
            parts.append(f"saved {self.regions_saved} to {self.regions.directory}")
        if self.regions.failures:
            parts.append(f"{len(self.regions.failures)} regions failed to precompile (first: "
                         f"{next(iter(self.regions.failures.values()))})")
        if self.others:
            parts.append(f"none of the {self.others} artifacts there is for these settings (their .json files "
                         "say what they were built for)")
        if self.saved_bytes:
            parts.append(f"saved {self.path} ({self.saved_bytes / 1e6:.1f} MB)")
        if self.status == "nothing":
            parts.append("nothing to cache (this start compiled nothing with inductor)")
        elif not parts:
            parts.append("torch.compiler recorded nothing to save")
        return "compile cache: " + "; ".join(parts)
