"""`Engine`: the rollout engine's public face (DESIGN.md, "The seams").

    engine = Engine(model, EngineConfig(...), tokenizer)      # or Engine.from_pretrained(path, config)
    samples = engine.generate([GenerateRequest(prompt_ids, SamplingParams(n=4, ...)), ...])
    engine.update_weights(trainer.named_weights(), version=step)

One step = schedule (continuous batching, chunked prefill) -> run the model -> sample -> check
stops; when every scheduled sequence decodes through the decode graphs, a step runs up to
`config.decode_steps` decode steps before it reads anything back (multi_step.py), and with
`config.async_scheduling` launches the next such window before that read, so that a step reads
back the window the previous step launched while the GPU runs the next. Steps run
either inline in the caller of `generate` or in a background thread started by `start()`, which
`generate_async` (the HTTP server) uses: concurrent calls hand their requests over through a
thread-safe queue and join the same running batch; results go back to each caller's asyncio
loop with `call_soon_threadsafe`. A lock is held for the duration of one
step, so `update_weights`, `abort`, `flush_cache` and `pause` always land between steps.

At construction the model's weights are replaced by their served values in
`config.serving_format` (see serving_format.py), so `engine.model` is exactly the policy served.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import threading
import time
from typing import Callable

import torch

from lockstep.config import EngineConfig, SamplingParams
from lockstep.engine import compile_cache, scoring
from lockstep.engine.compile_clock import CompileClock
from lockstep.engine.background import BackgroundLoop
from lockstep.engine.decode_path import compile_backend_for, describe, start_graphs
from lockstep.engine.model_adapter import make_adapter
from lockstep.engine.multi_step import chain_window, finish_window, launch_window, window_steps
from lockstep.engine.output import StopChecker, build_samples
from lockstep.engine.packed_weights import install_packed_weights, unpacked_weight_bytes, weight_bytes
from lockstep.engine.request import GenerateRequest, PromptTooLong, RequestState, TokensAdded
from lockstep.engine.runner import ModelRunner, is_decode
from lockstep.engine.sampler import Sampler, top_alternatives
from lockstep.engine.scheduler import Scheduler
from lockstep.engine.weight_update import (UpdateTargets, WeightUpdateError, apply_serving_format, check_version,
                                           load_update_from_disk, update_weights)
from lockstep.models.layers.kernel_switch import KernelSwitches, decide_true_on_policy, set_kernel_switches
from lockstep.models.precision import cast_model
from lockstep.prompt_encoding import encode_prompt
from lockstep.sample import Sample

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cast_for_serving(model: torch.nn.Module, dtype: torch.dtype, device) -> torch.nn.Module:
    """Move the model to device and its weights to dtype, except the ones it keeps in fp32
    (models/precision.py: the rule the trainer and the checkpoint loader use too)."""
    return cast_model(model.to(device), dtype).eval()


def compiled_graph_count() -> int:
    """Graphs torch.compile has built in this process (dynamo's count): the startup line reports
    how many the engine took (two per layer kind and two for the final head, unless a guard
    splits them)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


class Engine:
    def __init__(self, model: torch.nn.Module, config: EngineConfig, tokenizer=None):
        started = time.perf_counter()
        # None decided here, once: every later reader (decode_path, the switches) sees a bool
        config = dataclasses.replace(config, true_on_policy=decide_true_on_policy(
            config.true_on_policy, model, config.device, config.true_on_policy_excluded_by()))
        self.config, self.tokenizer = config, tokenizer
        self.dtype = _DTYPES[config.dtype]
        self.model = cast_for_serving(model, self.dtype, config.device)
        install_packed_weights(self.model, config.serving_format, config.packed_fp8,  # packed_weights.py
                               config.packed_experts)
        apply_serving_format(self.model, config.serving_format)
        # the model imports no config: its kernel switches are handed over (kernel_switch.py)
        self.kernels = KernelSwitches(triton_moe=config.triton_moe, triton_hc=config.triton_hc,
                                      triton_attention=config.triton_attention, triton_router=config.triton_router,
                                      triton_compressor=config.triton_compressor,
                                      triton_sampler=config.triton_sampler, compile_hc=config.compile_hc,
                                      true_on_policy=config.true_on_policy)
        set_kernel_switches(self.model, self.kernels)
        if self.kernels.on("true_on_policy") and not hasattr(self.model, "true_on_policy"):
            raise ValueError(f"EngineConfig.true_on_policy: {type(self.model).__name__} has no true-on-policy "
                             "forward (DeepSeek-V4 has)")
        self._fuse_projections()
        self._update_targets: UpdateTargets | None = None  # update_targets(): built at the first update
        # never past the positions the model was built for
        limit = getattr(self.model.config, "max_position_embeddings", None) or config.max_model_len
        self.max_model_len = min(config.max_model_len, limit)
        self.weight_version = 0
        self.adapter = make_adapter(self.model)
        self.cache = self.adapter.make_cache(dataclasses.replace(config, max_model_len=self.max_model_len), self.dtype)
        self.scheduler = Scheduler(self.cache, config.max_num_seqs, config.max_prefill_tokens, config.batch_invariant)
        self.runner = ModelRunner(self.adapter, config.batch_invariant)
        if hasattr(self.adapter, "compile_prefill"):
            self.adapter.compile_prefill = config.compile_prefill
        on_cuda = torch.device(config.device).type == "cuda"
        # compiled graphs from earlier starts, here or on another machine (compile_cache.py)
        self.compile_cache = compile_cache.StartCache(config.compile_cache_dir, self.model.config, config)
        self.compile_phases = ""  # where a compiling start's seconds went (_capture_graphs)
        if config.cuda_graph and on_cuda:
            self._capture_graphs()
        self.serving_path = describe(self.adapter, self.kernels)  # what serves, for the log and the tests
        if on_cuda:
            print(f"lockstep engine: {self.serving_path}", file=sys.stderr)
        self.sampler = Sampler(draw_kernels=bool(self.kernels.on("triton_sampler")))
        self.stop = StopChecker(self._eos_ids(), tokenizer, self.max_model_len)
        self._requests: dict[str, RequestState] = {}
        self._lock = threading.RLock()  # held for one step; weight updates etc. land between steps
        self._unpaused = threading.Event()
        self._unpaused.set()
        self._loop = BackgroundLoop(self)
        self._in_flight = None  # a multi-step window launched and not read back yet (async scheduling)
        self.start_seconds = time.perf_counter() - started  # construction, compilation included

    def _capture_graphs(self) -> None:
        if not hasattr(self.adapter, "enable_graphs"):
            return  # this model's adapter decodes eagerly
        if self.dtype != torch.bfloat16:
            # torch._grouped_mm (the MoE GEMMs) runs on CUDA without reading the device only in
            # bf16; other dtypes take a fallback that copies the group offsets to the host
            return
        # a failure is an error naming its stage, unless config.compile_fallback (decode_path.py)
        start, compiled_before, clock = time.perf_counter(), compiled_graph_count(), CompileClock()
        if compile_backend_for(self.config):
            self.compile_cache.load()  # save() below writes only after a load(): nothing compiles without it
            print("lockstep engine: compiling the decoder layers for decode and prefill, capturing decode graphs: "
                  "minutes on a machine's first start, seconds once inductor's cache (or the compile cache) "
                  "holds them", file=sys.stderr)
        start_graphs(self.adapter, self.config, regions=self.compile_cache.regions)
        self.compile_cache.save()
        self.compile_phases = clock.describe()  # "" when nothing compiled (compile_clock.py)
        phases = f"{self.compile_phases}; " if self.compile_phases else ""
        print(f"lockstep engine: decode graphs ready in {time.perf_counter() - start:.0f} s "
              f"({compiled_graph_count() - compiled_before} graphs compiled; {phases}{self.compile_cache.describe()})",
              file=sys.stderr)

    def _fuse_projections(self) -> None:
        # not in the true-on-policy forward: the trainer multiplies by each weight on its own, and a
        # stacked weight is a GEMM of another shape (another order of sums)
        if hasattr(self.model, "fuse_projections") and not self.kernels.on("true_on_policy"):
            self.model.fuse_projections()

    def _refresh_graphs(self) -> None:
        graphs = getattr(self.adapter, "graphs", None)
        if graphs is not None:
            graphs.refresh()

    @classmethod
    def from_pretrained(cls, path, config: EngineConfig) -> "Engine":
        from lockstep.models import load_pretrained
        from lockstep.models.tokenizer import has_tokenizer, load_tokenizer

        model = load_pretrained(path, dtype=_DTYPES[config.dtype], device=config.device)
        return cls(model, config, load_tokenizer(path) if has_tokenizer(path) else None)

    def _eos_ids(self) -> tuple[int, ...]:
        if self.config.eos_token_ids:
            return self.config.eos_token_ids
        eos = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)

    # ---- requests -------------------------------------------------------------------------

    def _new_state(self, request: GenerateRequest, on_done=None, on_tokens=None) -> RequestState:
        """Check a request in the caller's thread (errors go to the caller, not the loop)."""
        if len(request.prompt_ids) >= self.max_model_len:
            raise PromptTooLong(request, self.max_model_len)
        self._check_vocabulary(request.prompt_ids)
        if request.sampling.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids")
        return RequestState(request, self.config.device, on_done, on_tokens)

    def _check_vocabulary(self, ids: list[int]) -> None:
        vocab = self.model.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")

    def _add(self, state: RequestState) -> None:
        """Register a request with the scheduler (inside the step lock or the loop thread)."""
        if state.request_id in self._requests:
            state.error = ValueError(f"request_id {state.request_id!r} is already running")
            state.on_done and state.on_done(state)
            return
        self._requests[state.request_id] = state
        self.scheduler.add(state.sequences)

    def generate(self, requests: list[GenerateRequest],
                 on_request_done: Callable[[], None] | None = None) -> list[Sample]:
        """Run requests to completion; samples in request order, n per request consecutive.
        `on_request_done`: called as each request finishes (a progress bar's tick)."""
        if self._loop.running:
            return self._generate_via_loop(requests, on_request_done)
        done = None if on_request_done is None else (lambda _state: on_request_done())
        states = [self._new_state(r, on_done=done) for r in requests]
        with self._lock:
            for s in states:
                self._add(s)
        while not all(s.done for s in states):
            self._unpaused.wait()
            with self._lock:
                if not self._unpaused.is_set():
                    continue
                if not self.scheduler.has_work() and not all(s.done for s in states):
                    raise RuntimeError("engine has no runnable work but requests are unfinished")
                try:
                    self.step()
                except Exception as e:
                    self._fail_all(e)
                    raise
        return [x for s in states for x in s.result()]

    def _generate_via_loop(self, requests: list[GenerateRequest], on_request_done=None) -> list[Sample]:
        events = [threading.Event() for _ in requests]
        tick = on_request_done or (lambda: None)
        states = [self._new_state(r, on_done=lambda _s, e=e: (e.set(), tick())) for r, e in zip(requests, events)]
        for s in states:
            self._loop.submit(s)
        for e in events:
            e.wait()
        return [x for s in states for x in s.result()]

    async def generate_async(self, request: GenerateRequest,
                             on_tokens: Callable[[int, TokensAdded], None] | None = None) -> list[Sample]:
        """One request through the background loop (started on first use); n samples.
        `on_tokens(sample index, TokensAdded)`: called in the caller's event loop as tokens are
        sampled (streaming; several at once after a multi-step window)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def call_soon(fn, *args) -> None:
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the caller's event loop has closed: nobody is waiting
                pass

        def deliver(state: RequestState) -> None:
            call_soon(_resolve, fut, state)

        tokens = None if on_tokens is None else (lambda i, added: call_soon(on_tokens, i, added))
        state = self._new_state(request, on_done=deliver, on_tokens=tokens)
        self.start()
        self._loop.submit(state)
        try:
            return await fut
        except asyncio.CancelledError:
            self.abort(request.request_id)  # the caller went away: free its sequences
            raise

    # ---- the step -------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> int:
        """One scheduling + forward + sampling step; returns the number of tokens fed."""
        with self._lock:
            if self._in_flight is not None:
                return self._finish_in_flight(chain=True)
            out = self.scheduler.schedule()
            if not out.scheduled:
                if self.scheduler.has_work():  # would spin forever: a scheduling bug, not a wait
                    raise RuntimeError(f"scheduler could not schedule any of {len(self.scheduler.waiting)} waiting "
                                       f"and {len(self.scheduler.running)} running sequences")
                return 0
            K = self._window_steps(out.scheduled)
            if K > 1:
                self._in_flight = launch_window(self, [s for s, _ in out.scheduled], K)
                return self._finish_in_flight(chain=self.config.async_scheduling)
            logits, leaders = self.runner.execute(out.scheduled)
            for seq, n in out.scheduled:
                seq.num_computed += n
            rows, seqs = [], []
            for r, seq in enumerate(leaders):
                for s in [seq, *self.scheduler.fork_parked(seq)]:
                    rows.append(r)
                    seqs.append(s)
            params = [s.sampling for s in seqs]
            tokens, logprobs = self.sampler(logits, rows, params, [s.seed for s in seqs], [s.num_output for s in seqs])
            alternatives = top_alternatives(logits, rows, params) or [None] * len(seqs)
            for seq, tok, lp, alt in zip(seqs, tokens, logprobs, alternatives):
                seq.append_token(tok, lp, self.weight_version, alt)
                reason = self.stop.check(seq)
                if reason is not None:
                    self._finish(seq, reason)
            return out.num_tokens

    def _finish_in_flight(self, chain: bool) -> int:
        """Read the window in flight back and apply it; first, where `chain` and nothing waits to
        join the batch, launch the next window (multi_step.py, async scheduling). -> tokens fed."""
        window, self._in_flight = self._in_flight, None
        if chain and self._unpaused.is_set() and not self.scheduler.can_admit():
            self._in_flight = chain_window(self, window, self.config.decode_steps, self.max_model_len)
        finish_window(self, window)
        return len(window.seqs) * window.K

    def _drain(self) -> None:
        """Apply the window in flight, launching none after it (before weights or the cache change)."""
        if self._in_flight is not None:
            self._finish_in_flight(chain=False)

    def _window_steps(self, scheduled) -> int:
        """Decode steps to run before the next host round trip (multi_step.py); 1: one step."""
        graphs = getattr(self.adapter, "graphs", None)
        if (graphs is None or self.config.decode_steps == 1 or self.config.batch_invariant
                or len(scheduled) > graphs.max_batch or not all(is_decode(s, n) for s, n in scheduled)
                or any(s.sampling.top_logprobs for s, _ in scheduled)):  # alternatives: per step (step())
            return 1
        return window_steps([s for s, _ in scheduled], self.config.decode_steps, self.max_model_len)

    def _finish(self, seq, reason: str) -> None:
        self._finish_many([seq], reason)

    def _finish_many(self, seqs, reason: str) -> None:
        """Finish seqs (of one or many requests) with reason: one pass over the scheduler's queues
        and O(1) per sequence, so an abort costs time linear in what it aborts."""
        self.scheduler.remove(seqs)
        states = {}
        for seq in seqs:
            if seq.num_output == 0:
                seq.weight_version = self.weight_version  # aborted before sampling: the version serving now
            seq.group.mark_finished(seq, reason)
            states[id(seq.group)] = seq.group
        for state in states.values():
            if state.finished and state.samples is None:
                state.samples = build_samples(state, self.stop, self.adapter.routing_shape)
                self._requests.pop(state.request_id, None)
                if state.on_done is not None:
                    state.on_done(state)

    # ---- control ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the background step loop (idempotent)."""
        self._loop.start()

    def shutdown(self) -> None:
        """Stop the background loop; requests still in flight finish with "abort"."""
        self._loop.stop()
        with self._lock:
            self._abort_all()

    def pause(self) -> None:
        """Finish the current step, then hold; running requests stay and resume() continues them."""
        self._unpaused.clear()
        with self._lock:  # waits for a step in progress
            pass

    def resume(self) -> None:
        self._unpaused.set()
        self._loop.wake()

    def stalled_for(self) -> float:
        """Seconds the background loop has held work without finishing a step; 0 when it has none
        or is paused (the HTTP server's /health answers 503 past its limit)."""
        if self.paused or not (self.scheduler.has_work() or self._loop.has_pending()):
            return 0.0
        return self._loop.stalled_for()

    @property
    def paused(self) -> bool:
        return not self._unpaused.is_set()

    def abort(self, request_id: str) -> bool:
        """Finish every sequence of the request with "abort" (at the next step boundary when the
        background loop runs). Returns whether the request was known."""
        known = request_id in self._requests or self._loop.pending(request_id)
        if self._loop.running:
            self._loop.submit_abort(request_id)
        else:
            with self._lock:
                self._abort_now([request_id])
        return known

    def abort_all(self) -> None:
        """abort() of every request in flight, those still on their way to the loop included."""
        if self._loop.running:
            self._loop.submit_abort(None)
        else:
            with self._lock:
                self._abort_all()

    def _abort_now(self, request_ids) -> None:
        states = [s for s in map(self._requests.get, request_ids) if s is not None]
        self._finish_many([q for s in states for q in s.sequences if not q.is_finished], "abort")

    def _fail_all(self, error: BaseException) -> None:
        """The step failed: every request in flight gets the error, its memory is freed."""
        with self._lock:
            self._in_flight = None
            states = list(self._requests.values())
            self.scheduler.remove([q for s in states for q in s.sequences if not q.is_finished])
            for state in states:
                for seq in state.sequences:
                    state.mark_finished(seq, None)
                state.error = error
                self._requests.pop(state.request_id, None)
                if state.on_done is not None:
                    state.on_done(state)

    def _abort_all(self) -> None:
        self._abort_now(list(self._requests))

    def flush_cache(self) -> bool:
        """Reset the whole cache; only when idle (nothing running or queued). Returns whether it did."""
        with self._lock:
            if self.scheduler.has_work() or self._loop.has_pending():
                return False
            self._drain()
            self.cache.reset_all()
            self._refresh_graphs()
            return True

    # ---- weights ---------------------------------------------------------------------------

    def update_weights(self, named_tensors, version: int, partial: bool = False) -> None:
        """Validate all tensors and the version, then quantise to the serving format and write them in
        place. An update holds every tensor of the model unless `partial`; versions only increase
        (weight_update.py). A rejected update (WeightUpdateError) writes nothing and leaves
        `weight_version` alone. Running sequences are preempted and recomputed: their cached state is stale.
        The cache itself is not cleared: preemption frees every slot / block, a DeepSeek-V4 slot is reset
        when it is handed out again (SlotCacheManager.prepare) and a paged block is written before it is
        read, as for any recycled block; clearing it was a write of the whole cache per update."""
        with self._lock:
            check_version(self.weight_version, int(version), partial)
            self._drain()  # its tokens came from the weights before
            # written in place (weight_update.py; test_weight_update checks no address moves): the fused
            # matrices' views and the CUDA graphs stay valid, so no re-fuse check and no graph refresh
            # (walks of every tensor, ~0.5 ms of host time each on an 8-layer model)
            update_weights(self.model, named_tensors, self.config.serving_format, partial, self.update_targets())
            self.scheduler.preempt_all()
            self.weight_version = int(version)

    def update_targets(self) -> UpdateTargets:
        """What updates are checked against and written into (weight_update.UpdateTargets), built once:
        its walk of the model (~1 ms of host time on an 8-layer model) is not repeated per update.
        Valid for the engine's life because an update writes every tensor in place and nothing
        else replaces the model's tensors once the engine is built."""
        if self._update_targets is None:
            self._update_targets = UpdateTargets.of(self.model)
        return self._update_targets

    def update_weights_from_disk(self, path, version: int | None = None, partial: bool = False) -> None:
        try:
            tensors = load_update_from_disk(path, self.model)
        except (ValueError, OSError) as e:
            raise WeightUpdateError(f"cannot load weights from {path}: {e}") from e
        self.update_weights(tensors, self.weight_version + 1 if version is None else version, partial)

    def weight_bytes(self) -> int:
        """Bytes the served weights occupy on the device (packed fp8 as bytes + scales; packed_weights.py)."""
        return weight_bytes(self.model)

    def unpacked_weight_bytes(self) -> int:
        """The same model's weights with nothing packed, in the engine's dtype: the bf16 format's bytes."""
        return unpacked_weight_bytes(self.model, self.dtype)

    def prompt_logprobs(self, prompt_ids: list[int], sampling: SamplingParams):
        """Each prompt token's logprob given the ones before it, [P - 1], and its `sampling.top_logprobs`
        alternatives (or None), on the served weights between steps (scoring.py)."""
        if len(prompt_ids) > self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit max_model_len={self.max_model_len}")
        self._check_vocabulary(prompt_ids)
        with self._lock:
            return scoring.prompt_logprobs(self.model, self.adapter.device, prompt_ids, sampling)

    # ---- text helpers ----------------------------------------------------------------------

    def tokenize_prompt(self, prompt: str | list[dict], chat_template: bool = True) -> list[int]:
        """Token ids of a prompt, by the one rule in `lockstep.prompt_encoding`."""
        return encode_prompt(self.tokenizer, prompt, chat_template)

    def decode(self, ids) -> str:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer")
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def _resolve(fut: asyncio.Future, state: RequestState) -> None:
    if fut.done():
        return
    if state.error is not None:
        fut.set_exception(state.error)
    else:
        fut.set_result(state.samples)
