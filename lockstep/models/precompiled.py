"""Compiled regions carried to another process whole: dynamo's trace as well as inductor's code.

The compile cache (engine/compile_cache.py) spares a fresh engine start inductor's work, but dynamo
still traces every compiled region again: on an H200 the 1b config's start with that cache hit took
60.1 s, 40.9 of them tracing (engine/compile_clock.py). torch.compile's ahead-of-time form, PyTorch's
"precompile" (`torch.compile(fn, fullgraph=True).aot_compile((args, kwargs))`), returns the traced and
compiled function as an object that saves to a file (`save_compiled_function`) and loads in another
process without tracing (`torch.compiler.load_compiled_function`).

Such a function keeps the guards that check tensors and values, but drops those on object identity
(which code a callable runs, whether an attribute is None, which class a module is): identities do
not survive a process. `PrecompiledRegions.key` therefore files each function under what those
guards would have checked: the region's name, the grad mode, and each argument's kind (a module's
class tree and plain attributes, a callable's code and what its closure holds, a tensor's dtype,
device and rank). Under one key several functions may live (a guard on a value, say a host int,
told them apart when they were compiled); a call runs the first whose guards pass and compiles one
more when none does.

Only serializable backends precompile: inductor (the engine on CUDA) and aot_eager (the CPU tests).
Should precompiling a region fail, it warns once and runs as an ordinary torch.compile region
(torch 2.11's aot_eager, for one, is not serializable; 2.13's is).
The static dimensions (layers/fixed_shapes.py) are marked only while a region compiles.
A directory holds one file per function, KEY-ID.bin, written with the engine start's other
artifacts, and after the start as each function compiles (a shape the start did not meet); a
damaged file is a warning naming it, then a compilation, never a crash.
"""

from __future__ import annotations

import hashlib
import os
import uuid
import warnings
from pathlib import Path

import torch

from lockstep.files import write_atomically

from .layers import fixed_shapes

# a layer's position in the stack: the compiled layers never read it (compiled_layers.py), so that
# layers of one kind share a graph; in the key it would split them into one function per layer
POSITION_FIELDS = frozenset({"layer_idx"})
_PLAIN = (bool, int, float, str, type(None))
# how far a region's tensors are looked for: the arguments, a closure's cells, their objects' fields
# (the engine's layer cache), and those objects' fields (its compressors' state)
REACH = 4


def precompilable(fn, **options):
    """torch.compile(fn, fullgraph=True, **options) with the `aot_compile` method that
    PrecompiledRegions.call uses (torch 2.11 attaches it only under enable_aot_compile)."""
    settings = {"enable_aot_compile": True} if hasattr(torch._dynamo.config, "enable_aot_compile") else {}
    with torch._dynamo.config.patch(**settings):
        return torch.compile(fn, fullgraph=True, **options)


class PrecompiledRegions:
    def __init__(self, directory: str | os.PathLike | None = None):
        """directory: where the functions are loaded from and saved to; None keeps them in memory."""
        self.directory = Path(directory) if directory else None
        self._functions: dict[str, list] = {}
        self._new: list[tuple[str, object]] = []  # compiled in this process, not yet saved
        self._module_kinds: dict[int, str] = {}  # id(module) -> its kind (modules keep their structure)
        # id(first argument: the layer) -> fixed_shapes.marks_made() when what it sees was last unmarked
        self._clean_at: dict[int, int] = {}
        self.loaded = 0
        self.compiled = 0
        self.failures: dict[str, str] = {}  # key -> why that region could not precompile (it runs compiled lazily)
        # set once the engine's start has saved (StartCache.save): a region compiled later (a shape or
        # guard the start did not meet) is written as it compiles, so the next start loads it too
        self.save_on_compile = False

    # ---- calls ---------------------------------------------------------------------------------

    def call(self, compiled, name: str, args: tuple):
        """`compiled(*args)` through a precompiled function: `compiled` is the region's
        `precompilable` form, `name` tells regions apart."""
        key = self.key(name, args)
        if key in self.failures:
            return compiled(*args)
        if fixed_shapes.marks_made() != self._clean_at.get(id(args[0])):  # a loaded function's guards refuse marks
            fixed_shapes.unmark(_tensors(args, REACH))
            self._clean_at[id(args[0])] = fixed_shapes.marks_made()
        for fn in self._functions.get(key, ()):
            if fn.guard_check(*args):
                return fn(*args)
        try:
            with fixed_shapes.marked(_tensors(args, REACH)):
                fn = compiled.aot_compile((args, {}))
        except Exception as e:  # the region still runs: compiled the ordinary way
            self.failures[key] = f"{name}: {type(e).__name__}: {e}"
            warnings.warn(f"precompiling the {name} region failed ({type(e).__name__}: {e}); compiling it "
                          "without precompile (later starts trace it again)", RuntimeWarning, stacklevel=3)
            return compiled(*args)
        fn.disable_guard_check()  # checked once, above, on the next call
        self._functions.setdefault(key, []).append(fn)
        self._new.append((key, fn))
        self.compiled += 1
        if self.save_on_compile:
            self.save()
        return fn(*args)

    def key(self, name: str, args: tuple) -> str:
        kinds = (name, torch.is_grad_enabled(), tuple(self._kind(a, depth=2) for a in args))
        return hashlib.sha256(repr(kinds).encode()).hexdigest()[:24]

    def _kind(self, value, depth: int):
        """What a dropped identity guard would have checked about `value` (module docstring)."""
        if isinstance(value, torch.Tensor):
            return ("tensor", str(value.dtype), value.device.type, value.dim())
        if isinstance(value, torch.nn.Module):
            return self._module_kind(value)
        if isinstance(value, (bool, str, type(None))):
            return repr(value)
        if isinstance(value, (int, float)):
            return type(value).__name__  # the value: a guard of its own, or a symbol
        code = getattr(value, "__code__", None)
        if code is not None:  # a function or a bound method: its code and what it closes over
            cells = getattr(value, "__closure__", None) or ()
            inner = tuple(self._kind(c.cell_contents, depth - 1) for c in cells) if depth else ()
            owner = self._kind(value.__self__, depth - 1) if depth and hasattr(value, "__self__") else None
            return ("code", code.co_qualname, code.co_filename, code.co_firstlineno, inner, owner)
        if depth and isinstance(value, (list, tuple)):
            return (type(value).__name__, tuple(self._kind(v, depth - 1) for v in value))
        if depth and hasattr(value, "__dict__"):
            fields = tuple((k, self._kind(v, depth - 1)) for k, v in sorted(vars(value).items()))
            return (type(value).__qualname__, fields)
        return type(value).__qualname__

    def _module_kind(self, module: torch.nn.Module) -> str:
        """The module tree's classes and plain attributes (their values: dynamo specialises a module's
        attributes), its position in the stack left out (POSITION_FIELDS); hashed once per module."""
        kind = self._module_kinds.get(id(module))
        if kind is None:
            tree = tuple((name, type(sub).__qualname__, _plain_attributes(sub)) for name, sub in module.named_modules())
            kind = self._module_kinds[id(module)] = hashlib.sha256(repr(tree).encode()).hexdigest()[:24]
        return kind

    # ---- files ---------------------------------------------------------------------------------

    def load(self) -> int:
        """Load every function saved in the directory -> how many loaded."""
        if self.directory is None or not self.directory.is_dir():
            return 0
        for path in sorted(self.directory.glob("*.bin")):
            try:
                with path.open("rb") as f:
                    fn = torch.compiler.load_compiled_function(f)
            except Exception as e:  # never a crash: precompiling only saves time
                warnings.warn(f"precompiled region {path}: unreadable ({type(e).__name__}: {e}); it compiles "
                              "again", RuntimeWarning, stacklevel=2)
                continue
            fn.disable_guard_check()
            self._functions.setdefault(path.stem.rsplit("-", 1)[0], []).append(fn)
            self.loaded += 1
        return self.loaded

    def save(self) -> int:
        """Write the functions compiled since the last save -> how many files written."""
        if self.directory is None:
            return 0
        written = len(self._new)
        for key, fn in self._new:  # a fresh name each: another process may save under the same key
            data = type(fn).serialize(fn).serialized_data  # what save_compiled_function writes
            write_atomically(self.directory / f"{key}-{uuid.uuid4().hex[:12]}.bin", data)
        self._new.clear()
        return written


def _tensors(value, depth: int):
    """The tensors a region sees through `value`: arguments, closures, objects' fields and modules'
    plain tensor attributes (parameters and buffers are never marked), `depth` levels down."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, torch.nn.Module):
        for sub in value.modules():
            yield from (v for v in vars(sub).values() if isinstance(v, torch.Tensor))
    elif depth:
        if getattr(value, "__code__", None) is not None:
            for cell in getattr(value, "__closure__", None) or ():
                yield from _tensors(cell.cell_contents, depth - 1)
        elif isinstance(value, (list, tuple)):
            for v in value:
                yield from _tensors(v, depth - 1)
        elif hasattr(value, "__dict__"):
            for v in vars(value).values():
                yield from _tensors(v, depth - 1)


def _plain_attributes(module: torch.nn.Module) -> tuple:
    return tuple((k, v) for k, v in sorted(vars(module).items())
                 if not k.startswith("_") and k not in POSITION_FIELDS and isinstance(v, _PLAIN))
