"""A portable compile cache: the engine's compiled graphs carried to another machine as one file.

Inductor already keeps its results on disk (TORCHINDUCTOR_CACHE_DIR), but only on the machine
that compiled them; a fresh machine (a new rollout node, a restarted job) compiles its graphs
again, 211-245 s for the 1b config's 10 graphs on an H200. `EngineConfig.compile_cache` names a
file holding torch.compiler's cache artifacts (FX graphs, AOT autograd results, Triton kernels): loaded
before the engine compiles, rewritten after, so the next start on any machine with the same
torch, Triton and GPU replays them instead of compiling (tracing still runs).

A file written by another torch version, or damaged, is reported and ignored: the engine then
compiles as if there were none.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch


def load(path: str | os.PathLike) -> bool:
    """Hand the artifacts in `path` to torch.compiler -> whether there were any to use."""
    path = Path(path)
    if not path.exists():
        return False
    info = torch.compiler.load_cache_artifacts(path.read_bytes())
    if info is None:
        warnings.warn(f"compile cache {path}: unreadable (written by another torch version, or damaged); "
                      "compiling from scratch", RuntimeWarning, stacklevel=2)
        return False
    return True


def save(path: str | os.PathLike) -> int:
    """Write every artifact compiled in this process to `path` (atomically) -> bytes written, 0 if
    nothing was compiled (the file is then left as it was)."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return 0
    data, _ = saved
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return len(data)
