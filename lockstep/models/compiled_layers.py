"""Regional compilation of DeepSeek-V4 decoder layers (the engine's decode step).

torch.compile fuses a layer's many small ops (mHC, norms, RoPE, masks) into a few dozen kernels
(the Sinkhorn inside mHC is already one Triton kernel, kept as it is: sinkhorn_triton.py). It
compiles the layer, not the model: layers of the same kind (attention kind x router kind) run
one compiled graph, so a model compiles once per kind, and the token dimensions are dynamic, so
one compilation serves every batch size. The model's last step after the layers (mHC's head and
the final norm, `final_hidden`) is compiled alike.

Four things keep the compiler from recompiling (or retracing) per layer or per batch size:
- the compiled region takes this layer's slice of the forced experts (`Routing.layer_forced`)
  and returns its chosen experts, instead of slicing `Routing.forced` by `layer_idx` and
  appending to `Routing.chosen` (the index and the list's length would become guards);
- callers build `attend` closures over the layer's own cache, not over the cache list indexed
  by `layer.layer_idx`;
- no duck shaping: a batch size that happens to equal a weight dimension at the first call
  would be specialised to it;
- floats (the SwiGLU clamp limit) are constants: dynamic=True makes them symbols, which a later
  pass specialises again, restarting the trace (each layer kind traced twice at its first call).

`CompiledLayers(backend)` is a `call_layer` for `DeepseekV4Model.run`, passed per call (the
engine's decode step) or installed for every forward by `compile_layers(model)` (the trainer,
TrainConfig.compile_backend). The backend is torch.compile's (a name or a callable); "inductor"
is the fast one (CUDA; on CPU it needs a C++ toolchain and minutes); "eager" / "aot_eager" trace
the same region without code generation, which is what the CPU tests run.
Given `PrecompiledRegions` (models/precompiled.py: the engine's compile cache directory), each
region is precompiled instead: traced and compiled once, saved, and loaded by a later start without
tracing again.
Where the native grouped GEMM is unavailable (fp32, CPU backward) the region uses a gathered
form instead of the reference loop over experts, which would break the graph.
"""

from __future__ import annotations

import torch

from .deepseek_v4 import Routing
from .layers import fixed_shapes
from .layers.compiled_rows import trace_settings as _trace_settings  # no duck shaping, floats as constants
from .layers.fixed_shapes import fixed_shape
from .precompiled import PrecompiledRegions, precompilable


def _layer_with_experts(layer, streams, input_ids, forced, attend):
    routing = Routing(layer_forced=forced)
    streams = layer(streams, input_ids, routing, attend)
    return streams, routing.chosen[0]


def _final_hidden(model, streams):
    return model.final_hidden(streams)


# Dynamo keeps at most `recompile_limit` (8) compilations per function and runs further guard
# failures eagerly, silently. Every CompiledLayers compiles the same function: one compilation per
# layer kind (attention x router: up to 6 in DeepSeek-V4), per grad mode and dtype, so an engine and
# a compiling trainer in one process pass 8; the tail of their layers would run uncompiled.
RECOMPILE_LIMIT = 64


def _token_dims_only(streams: torch.Tensor, mark: bool) -> None:
    """streams [B, S, n, H]: the mHC streams and hidden size are the model's, constants to the
    compiled region; only the token dimensions are symbols (layers/fixed_shapes.py: tracing time).
    mark=False: registered for a precompilation to mark (fixed_shapes.marked)."""
    fixed_shape(streams, range(2, streams.dim()), mark)


class CompiledLayers:
    def __init__(self, backend="inductor", options: dict | None = None, regions: PrecompiledRegions | None = None):
        """options: inductor settings on top of the defaults below (torch.compile's `options`,
        e.g. {"coordinate_descent_tuning": True}); inductor only. regions: precompile each region
        (module docstring)."""
        self.backend, self.options, self.regions = backend, dict(options or {}), regions
        fixed_shapes.mark_registered()  # the caches and frequencies of models built before dynamo was loaded
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        if backend != "inductor" and self.options:
            raise ValueError(f"compile options {sorted(self.options)} need the inductor backend, not {backend!r}")
        # inductor keeps a fused chain of bf16 ops in fp32 and rounds once; eager rounds after
        # every op. The trainer runs eager, so the engine emulates eager's roundings: on a bf16
        # tiny model the compiled engine's mean |logprob gap| to the trainer was 4.2e-4 without
        # this, 4.8e-5 with it, 3.6e-5 for the eager engine.
        options = {"emulate_precision_casts": True, **self.options} if backend == "inductor" else None
        # precompiling takes whole graphs only (the regions have no graph break: a test traces them so)
        compile_ = torch.compile if regions is None else precompilable
        self._compiled = compile_(_layer_with_experts, dynamic=True, backend=backend, options=options)
        self._compiled_final = compile_(_final_hidden, dynamic=True, backend=backend, options=options)

    def _run(self, compiled, name: str, *args):
        return compiled(*args) if self.regions is None else self.regions.call(compiled, name, args)

    def __call__(self, layer, streams, input_ids, routing: Routing | None, attend):
        forced = routing.forced_for(layer.layer_idx) if routing is not None else None
        _token_dims_only(streams, mark=self.regions is None)
        with _trace_settings():
            streams, experts = self._run(self._compiled, "layer", layer, streams, input_ids, forced, attend)
        if routing is not None:
            routing.chosen.append(experts)
        return streams

    def final_hidden(self, model, streams):
        """`model.final_hidden(streams)` (mHC's head collapse and the final norm) compiled too:
        eagerly it was ~20 small kernels at the end of every decode step."""
        _token_dims_only(streams, mark=self.regions is None)
        with _trace_settings():
            return self._run(self._compiled_final, "final", model, streams)

    def __deepcopy__(self, memo):  # a copied model compiles alike (dynamo's cache is per code)
        return CompiledLayers(self.backend, self.options)  # not the regions: they belong to one engine


def compile_layers(model, backend: str = "inductor"):
    """Every forward of a DeepSeek-V4 `model` runs its decoder layers compiled. Returns the model."""
    model.model.call_layer = CompiledLayers(backend)
    return model
