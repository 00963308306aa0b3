"""Which path serves the engine's steps, decided once at engine start.

On CUDA in bf16 the default is compiled decoder layers replayed as CUDA graphs for decode, and the
same compiled layers for prefill (cuda_graph.py, models/compiled_layers.py). Compiled and eager
layers round differently, so the path changes the measured train/rollout gap (README: 0.090
compiled vs 0.069 eager at the 1b config). A failure to compile or capture is therefore an error
naming the stage that failed, unless `EngineConfig.compile_fallback` asks for the fallback: then
a warning, and the engine serves CUDA graphs of the eager forward, or, if those fail too, eager
steps. `describe` is the engine's startup line: which path serves and which kernels are on.

`EngineConfig.compile_decode` off (or LOCKSTEP_COMPILE=0, which overrides it when set) captures
the eager forward from the start.
"""

from __future__ import annotations

import warnings

from lockstep.engine.cuda_graph import StageError, stage
from lockstep.models.layers.kernel_switch import ENV, TRAINER_ONLY, env_override


FALLBACK_HINT = "EngineConfig.compile_fallback (--compile-fallback) serves the eager path instead"


def compile_backend_for(config, requested="auto"):
    """The backend the decode graphs compile with: `requested`, or None when compiling is off."""
    if env_override(ENV["true_on_policy"], config.true_on_policy):  # eager on both sides (deepseek_v4_rows.py)
        return None
    return requested if env_override("LOCKSTEP_COMPILE", config.compile_decode) else None


def start_graphs(adapter, config, capture: bool = True, compile_backend="auto", regions=None) -> None:
    """Enable the adapter's decode graphs (capture=False: their eager stand-in, the CPU tests) and
    compile the prefill step, as `config` says; StageError on a failure unless compile_fallback.
    regions: PrecompiledRegions the compiled layers are filed in (compile_cache.py), or None."""
    backend = compile_backend_for(config, compile_backend)
    try:
        _enable(adapter, config, capture, backend, regions)
    except StageError as e:
        if not config.compile_fallback:
            raise StageError(e.stage, e.cause, FALLBACK_HINT) from e.cause
        _fall_back(adapter, config, capture, backend, e)


def _enable(adapter, config, capture: bool, backend, regions=None) -> None:
    adapter.enable_graphs(config.max_num_seqs, capture=capture, compile_backend=backend,
                          compile_options=config.compile_options, regions=regions)
    with stage("compiling the prefill step"):
        adapter.warm_up_prefill()


def _fall_back(adapter, config, capture: bool, backend, error: StageError) -> None:
    if backend is not None:
        warnings.warn(f"{error}; EngineConfig.compile_fallback: capturing the eager forward", RuntimeWarning,
                      stacklevel=4)
        try:
            _enable(adapter, config, capture, None)
            return
        except StageError as e:
            error = e
    adapter.graphs = None
    warnings.warn(f"{error}; EngineConfig.compile_fallback: decoding eagerly", RuntimeWarning, stacklevel=4)


def describe(adapter, switches) -> str:
    """e.g. "decode: compiled (inductor) + CUDA graphs; prefill: compiled; kernels: triton_moe on, ..."."""
    graphs = getattr(adapter, "graphs", None)
    compiled = graphs is not None and graphs.compiled_layers is not None
    if graphs is None:
        decode = "eager"
    else:
        backend = graphs.compiled_layers.backend if compiled else None
        name = backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend))
        steps = "CUDA graphs" if graphs.capture else "graph stand-in (no capture)"
        decode = f"compiled ({name}) + {steps}" if compiled else f"eager + {steps}"
    prefill = "compiled" if compiled and getattr(adapter, "compile_prefill", False) else "eager"
    return f"decode: {decode}; prefill: {prefill}; kernels: {switches.describe(omit=TRAINER_ONLY)}"
