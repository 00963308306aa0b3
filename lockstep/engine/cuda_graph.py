"""CUDA graphs for decode: the model's forward over N sequences x 1 new token, captured once per
batch bucket and replayed, so a decode step costs one graph launch instead of thousands of
kernel launches issued from Python.

Why the forward is capturable: the step metadata carries host ints (`StepBatch.max_new = 1`,
`max_end = None`: compressed attention runs over every entry of the cache, masked by position,
so shapes never depend on how long the sequences are), every cache write has a fixed shape
(masked-out tokens land in the cache's scratch slot), the MoE counts tokens per expert without
bincount, and nothing reads a device value back on the host.

Static input: `meta` [max_batch, 4] long = (token id, slot, start position, num_new) per row,
filled by one non-blocking host->device copy per step (in multi-step decode, once per window;
`advance` moves it on by one step on the device). A batch of N rows is padded up to the
smallest bucket B >= N with rows (token 0, the scratch slot, position 0, num_new 0): they attend
to nothing, write only to the scratch slot, and their outputs are dropped. Static outputs: the
logits [B, V] fp32 and each MoE layer's routed experts [B, 1, k].

Captured graphs stay valid across `Engine.update_weights` (weights are written in place with
copy_, so the graphs read the new values) and `flush_cache` (cache tensors are zeroed in place);
`refresh()` (after a cache flush) re-captures should a parameter or cache tensor ever be re-allocated;
an update, written in place by construction, does not call it.
`capture=False` (and any non-CUDA device) runs the same padded static-shape forward eagerly:
the CPU tests exercise the padding and the fixed-capacity attention through it.

Compiled before capture: a graph removes the launch cost from Python, not the per-kernel cost on
the GPU. An eager decode step of a 1B config is ~4,000 small kernels (element-wise mHC, RoPE,
norms, masks) at ~2 us each inside a graph; the decoder layers are compiled first
(models/compiled_layers.py: one compilation per layer kind, dynamic batch), which fuses them.
`compile_backend=None` captures the eager forward (EngineConfig.compile_decode off, or
LOCKSTEP_COMPILE=0: engine/decode_path.py decides); the default ("auto") compiles with inductor
when capturing on CUDA only (on CPU inductor needs a C++ toolchain and minutes per layer kind; the
CPU tests trace the compiled region with the "eager" backend).

Each start-up step runs as a named `stage`: a failure raises `StageError` saying which step
failed (compiling the layers, compiling the decode step at a batch size, capturing its graph), so
that decode_path.py can report it or, if asked to, fall back.
"""

from __future__ import annotations

import contextlib

import torch

from lockstep.transfer import copy_into, to_device
from lockstep.models.compiled_layers import CompiledLayers

# Inductor settings of the decode step's compiled layers, under EngineConfig.compile_options (which
# override them). combo_kernels fuses independent kernels side by side into one launch: a decode step
# is hundreds of 1-5 us kernels back to back, latency-bound. Measured on an H200 (1b config, batch
# 64, rollout_throughput.py --step-trace, 2026-12-03): 620 -> 480 kernels a step, 2.02 -> 1.76 ms.
DECODE_INDUCTOR_OPTIONS = {"combo_kernels": True}


def decode_inductor_options(configured: dict | None) -> dict:
    """The inductor settings the decode step compiles with: DECODE_INDUCTOR_OPTIONS, then `configured`."""
    return {**DECODE_INDUCTOR_OPTIONS, **(configured or {})}


class StageError(RuntimeError):
    """A start-up stage of the compiled / captured decode path failed; `stage` names it."""

    def __init__(self, stage: str, cause: BaseException, hint: str = ""):
        super().__init__(f"{stage} failed: {type(cause).__name__}: {cause}" + (f" ({hint})" if hint else ""))
        self.stage, self.cause = stage, cause


@contextlib.contextmanager
def stage(name: str):
    """Run a start-up step; any exception leaves as a StageError naming it."""
    try:
        yield
    except StageError:
        raise
    except Exception as e:
        raise StageError(name, e) from e


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """Powers of two below max_num_seqs, then max_num_seqs: padding at most doubles a batch.
    One row pads to two: the compiler specialises a dimension of size 1 (one more compilation)."""
    return [b for b in (2, 4, 8, 16, 32, 64, 128, 256, 512) if b < max_num_seqs] + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, adapter, max_num_seqs: int, capture: bool = True, compile_backend="auto",
                 compile_options: dict | None = None, regions=None):
        """regions: PrecompiledRegions (models/precompiled.py) the compiled layers are filed in, or None."""
        from lockstep.models.deepseek_v4 import Routing, StepBatch

        self.adapter, self._Routing, self._StepBatch = adapter, Routing, StepBatch
        self.buckets = bucket_sizes(max_num_seqs)
        self.max_batch = self.buckets[-1]
        self.capture = capture and adapter.device.type == "cuda"
        self.meta = torch.zeros(self.max_batch, 4, dtype=torch.long, device=adapter.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._pointers: list[int] = []
        self._stand_in: torch.Tensor | None = None  # capture=False: the one output buffer (_stand_in_output)
        self.compiled_layers = None  # None: run_step calls the layers eagerly
        if compile_backend == "auto":
            compile_backend = "inductor" if self.capture else None
        if compile_backend:
            options = decode_inductor_options(compile_options) if compile_backend == "inductor" else None
            with stage("compiling the decoder layers"):
                self.compiled_layers = CompiledLayers(compile_backend, options, regions)
        if self.capture:
            self.capture_all()

    def fits(self, nums: list[int], want_logits: list[bool]) -> bool:
        """A call the graphs can run: one new token per row, every row sampled, within the buckets."""
        return len(nums) <= self.max_batch and all(n == 1 for n in nums) and all(want_logits)

    def _padding_row(self) -> list[int]:
        return [0, self.adapter.cache.scratch_slot, 0, 0]

    def _forward(self, B: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The decode forward of the first B rows of `meta`, static shapes only."""
        # columns copied out of `meta`: views of it would make the compiler guard on its row count
        ids, slots, start, num_new = self.meta[:B].t().contiguous().unbind(0)
        batch = self._StepBatch(slots=slots, start_pos=start, num_new=num_new, max_new=1, max_end=None)
        routing = self._Routing()
        hidden = self.adapter.run_step(ids.unsqueeze(1), batch, routing, self.compiled_layers)
        return self.adapter.model.compute_logits(hidden[:, 0]), routing.chosen

    @torch.no_grad()
    def forward(self, seqs, want_routing: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (logits [N, V] fp32, routed experts [N, 1, L, k] or None) of N decoding sequences.
        The logits are a view of the graph's output: read them before the next decode step."""
        self.load(seqs)
        return self.run(len(seqs), want_routing)

    def load(self, seqs) -> None:
        """Fill `meta` with the sequences' next step (their last token at their next position),
        padding rows up to the bucket."""
        B = self.bucket(len(seqs))
        rows = [[s.tokens[s.num_computed], s.slot, s.num_computed, 1] for s in seqs]
        copy_into(self.meta[:B], rows + [self._padding_row()] * (B - len(seqs)))

    def bucket(self, N: int) -> int:
        return next(b for b in self.buckets if b >= N)

    @torch.no_grad()
    def run(self, N: int, want_routing: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step of the N rows in `meta` (see forward)."""
        B = self.bucket(N)
        if self.capture:
            self.graphs[B].replay()
            logits, chosen = self.outputs[B]
        else:
            logits, chosen = self._forward(B)
            logits = self._stand_in_output(logits)
        routed = torch.stack(chosen, dim=-2)[:N] if want_routing else None
        return logits[:N], routed

    def _stand_in_output(self, logits: torch.Tensor) -> torch.Tensor:
        """The stand-in's logits as a view of one buffer that every call overwrites, as a replay
        overwrites the graphs' shared pool: a caller that keeps a step's logits past the next call
        then fails on the CPU too, not only under capture."""
        if self._stand_in is None or self._stand_in.shape[1:] != logits.shape[1:]:
            self._stand_in = torch.empty(self.max_batch, *logits.shape[1:], dtype=logits.dtype, device=logits.device)
        out = self._stand_in[:logits.shape[0]]
        out.copy_(logits)
        return out

    def advance(self, tokens_N: torch.Tensor) -> None:
        """Point `meta` at the next step on the device: the sampled tokens go in, positions move
        on by one (multi-step decode: no host round trip between steps)."""
        N = tokens_N.shape[0]
        self.meta[:N, 0].copy_(tokens_N)
        self.meta[:N, 2].add_(1)

    def keep_rows(self, rows: list[int], N: int) -> None:
        """Of the N rows in `meta`, keep `rows` (in order) at the top and pad the rest of the smaller
        batch's bucket: a chained window (multi_step.py) drops the sequences known to have finished
        without a host round trip."""
        if rows == list(range(N)):
            return
        kept = self.meta[to_device(rows, self.meta.device)]
        self.meta[:len(rows)].copy_(kept)
        B = self.bucket(len(rows))
        if B > len(rows):
            copy_into(self.meta[len(rows):B], [self._padding_row()] * (B - len(rows)))

    # ---- capture ------------------------------------------------------------------------

    @torch.no_grad()
    def capture_all(self) -> None:
        """Capture every bucket, largest first, all in one memory pool (only one graph's output
        is alive at a time: the step reads it before the next replay)."""
        # warm-up and capture run on padding rows only: they write nothing but the scratch slot
        copy_into(self.meta, [self._padding_row()] * self.max_batch)
        self.graphs.clear()
        self.outputs.clear()
        pool = None
        for B in reversed(self.buckets):
            pool = self._capture(B, pool)
        torch.cuda.synchronize()
        self._pointers = self._current_pointers()

    def _capture(self, B: int, pool):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        # warm-up: the compilation (first bucket), cuBLAS handles, lazily built tensors, autotuning
        warm_up = "compiling" if self.compiled_layers is not None else "running"
        with stage(f"{warm_up} the decode step (batch {B})"), torch.cuda.stream(side):
            for _ in range(2):
                self._forward(B)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with stage(f"capturing the decode CUDA graph (batch {B})"), torch.cuda.graph(graph, pool=pool):
            self.outputs[B] = self._forward(B)
        self.graphs[B] = graph
        return graph.pool()

    def _current_pointers(self) -> list[int]:
        model = self.adapter.model
        tensors = [*model.parameters(), *model.buffers(),
                   *(t for layer in self.adapter.cache.cache.layers for t in layer.tensors())]
        return [t.data_ptr() for t in tensors]

    def refresh(self) -> None:
        """Re-capture if any tensor the graphs read has moved (weights are normally written in place)."""
        if self.capture and self._current_pointers() != self._pointers:
            self.capture_all()
