"""Regional compilation of DeepSeek-V4 decoder layers (the engine's decode step).

torch.compile fuses a layer's many small ops (mHC, norms, RoPE, masks, Sinkhorn) into a few
dozen kernels. It compiles the layer, not the model: layers of the same kind (attention kind x
router kind) run one compiled graph, so a model compiles once per kind, and the token dimensions
are dynamic, so one compilation serves every batch size.

Three things keep the compiler from recompiling per layer or per batch size:
- the compiled region returns the layer's chosen experts instead of appending them to
  `Routing.chosen` (the list's length would become a guard). Forced experts (routing replay)
  are passed whole: the layer picks its own slice by `layer_idx`, which then becomes a guard,
  so replayed forwards compile once per layer (the decode step never forces);
- callers build `attend` closures over the layer's own cache, not over the cache list indexed
  by `layer.layer_idx`;
- no duck shaping: a batch size that happens to equal a weight dimension at the first call
  would be specialised to it.

`CompiledLayers(backend)` is a `call_layer` for `DeepseekV4Model.run`. Backend "inductor" is the
fast one (CUDA; on CPU it needs a C++ toolchain and minutes); "eager" / "aot_eager" trace the
same region without code generation, which is what the CPU tests run.
The trainer's layers stay eager for now (compiling them needs the CPU reference grouped GEMM,
a loop over experts, to stop breaking the graph, and `layer_idx` out of the replay path).
"""

from __future__ import annotations

import torch

from .deepseek_v4 import Routing


def _layer_with_experts(layer, streams, input_ids, forced, attend):
    routing = Routing(forced=forced)  # all layers' forced experts [..., L, k], or None
    streams = layer(streams, input_ids, routing, attend)
    return streams, routing.chosen[0]


class CompiledLayers:
    def __init__(self, backend: str = "inductor"):
        self.backend = backend
        # inductor keeps a fused chain of bf16 ops in fp32 and rounds once; eager rounds after
        # every op. The trainer runs eager, so the engine emulates eager's roundings: on a bf16
        # tiny model the compiled engine's mean |logprob gap| to the trainer was 4.2e-4 without
        # this, 4.8e-5 with it, 3.6e-5 for the eager engine.
        options = {"emulate_precision_casts": True} if backend == "inductor" else None
        self._compiled = torch.compile(_layer_with_experts, dynamic=True, backend=backend, options=options)

    def __call__(self, layer, streams, input_ids, routing: Routing | None, attend):
        forced = routing.forced if routing is not None else None
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            streams, experts = self._compiled(layer, streams, input_ids, forced, attend)
        if routing is not None:
            routing.chosen.append(experts)
        return streams
