"""Frozen, keyword-only configuration shared across components.

Each class validates itself in `__post_init__` and names the offending field. Component-
specific configs live beside their component (`lockstep.train.config`, `lockstep.rl.config`);
this file holds what crosses the engine seam.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from lockstep.files import FieldError

# Above this temperature sampling is near uniform for any logit scale a model produces: the cap
# catches typos and overflow (1e6, Infinity), not taste. OpenAI's API stops at 2.
MAX_TEMPERATURE = 100.0

# Most alternatives a request may ask for per token (vLLM's default max_logprobs; OpenAI's chat API
# also stops at 20): each costs a top-k over the vocabulary and a host copy per sampled token.
MAX_TOP_LOGPROBS = 20

# the engine's weight formats; quant/formats.py ServingFormat holds the storage rule of each
SERVING_FORMATS = ("bf16", "fp8", "fp8-fp4")


def _fail(cls: str, field_name: str, why: str):
    raise FieldError(cls, field_name, why)  # a ValueError: "Cls.field: why"


def check_choices(config) -> None:
    """Each field named in `type(config).CHOICES` holds one of its allowed values, or None (for
    fields typed `X | None`). The CLI offers the same tuples as the flags' choices."""
    for name, allowed in type(config).CHOICES.items():
        value = getattr(config, name)
        if value is not None and value not in allowed:
            _fail(type(config).__name__, name, f"must be one of {allowed}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request is sampled.

    Logprob definition (the trainer uses the same): the log-probability of each sampled token
    under softmax(logits / temperature) over the FULL vocabulary, i.e. before top-p / top-k
    truncation. temperature == 0 means greedy; its logprobs are those of temperature 1.
    top_logprobs = k > 0 also records, at every sampled position, the k most likely tokens under
    that same distribution with their logprobs (OpenAI's `top_logprobs`; for serving, the trainer
    never reads them).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    seed: int | None = None
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    n: int = 1
    return_routed_experts: bool = False
    ignore_eos: bool = False
    top_logprobs: int = 0

    def __post_init__(self):
        name = "SamplingParams"
        if not 0 <= self.temperature <= MAX_TEMPERATURE:  # NaN fails too
            _fail(name, "temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            _fail(name, "top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            _fail(name, "top_k", f"must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            _fail(name, "max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            _fail(name, "n", f"must be >= 1, got {self.n}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            _fail(name, "top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        if "" in self.stop:  # it would match before the first token: every answer empty
            _fail(name, "stop", "stop strings must not be empty")


def _check_inductor_options(name: str, options: dict) -> None:
    import torch._inductor.config as inductor_config

    known = inductor_config.get_config_copy()
    for key, value in options.items():
        if key not in known:
            _fail(name, "compile_options", f"{key!r} is not an inductor setting (torch._inductor.config)")
        kind = type(known[key])
        allowed = (int, float) if kind is float else kind
        if known[key] is not None and not isinstance(value, allowed):
            _fail(name, "compile_options", f"{key!r} takes a {kind.__name__}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Rollout engine settings; each field's documentation is the string below it (also its --help)."""

    CHOICES: ClassVar[dict[str, tuple]] = {"serving_format": SERVING_FORMATS, "dtype": ("float32", "bfloat16")}

    max_num_seqs: int = 64
    """Sequences decoded together at most (the batch size of a decode step)."""
    max_model_len: int = 2048
    """Longest sequence, prompt + response, in tokens; capped by the model's max_position_embeddings."""
    max_prefill_tokens: int = 2048
    """Chunked prefill: at most this many prompt tokens per engine step."""
    cache_memory_bytes: int | None = None
    """Cache memory in bytes; None: room for max_num_seqs sequences of max_model_len."""
    block_size: int = 128
    """Cache memory is accounted in blocks of this many token positions (tokens)."""
    serving_format: str = "bf16"
    """Weights as served: bf16; fp8 (block e4m3, ue8m0 scales, experts too); fp8-fp4 (fp8 attention and
    shared experts, e2m1 routed experts with e8m0 scales)."""
    packed_fp8: bool = False
    """Under an fp8 serving format, fp8 linear weights are held packed (e4m3 bytes + 128x128 scales, read by an
    fp8 GEMM: models/layers/fp8_linear.py); off: as their dequantised values in dtype (the emulation, same
    values). Off until its kernels are measured on GPUs (CPU-tested only). Routed experts: packed_experts."""
    packed_experts: bool = False
    """Routed experts held packed in the format's storage (fp8: e4m3 + 128x128 scales; fp8-fp4: e2m1 two per
    byte + e8m0 per 32), read by grouped GEMMs that dequantise in registers at decode
    (models/layers/packed_experts.py); off: dequantised values in dtype. Off until measured on GPUs."""
    batch_invariant: bool = False
    """A sequence's logprobs do not depend on what else is in the batch."""
    true_on_policy: bool | None = None
    """The true-on-policy forward (models/deepseek_v4_rows.py, DeepSeek-V4 only): a token's logprob has the
    same bits as the trainer's with the same setting, whatever the batch, chunk or CUDA-graph bucket. Decode
    graphs replay the eager forward (no compiled layers); fp8 serving keeps dequantised weights (the values
    the trainer's quantisation-aware forward uses), so packed_fp8 / packed_experts must stay off. None: on
    CUDA for DeepSeek-V4 unless packed_fp8 / packed_experts is on (kernel_switch.decide_true_on_policy);
    off elsewhere."""
    dtype: str = "float32"
    """Compute dtype of the engine's model."""
    device: str = "cpu"
    """torch device of the engine, e.g. cpu, cuda, cuda:1."""
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    """Token ids that end a sequence; empty: the tokenizer's EOS."""
    cuda_graph: bool = True
    """On CUDA with dtype bfloat16, decode steps replay captured CUDA graphs (engine/cuda_graph.py); ignored
    elsewhere."""
    decode_steps: int = 16
    """When every scheduled sequence decodes through the decode graphs, run this many steps per host round
    trip (engine/multi_step.py); 1 syncs after every step. New requests join at the window's end (a few ms)."""
    async_scheduling: bool = True
    """Launch a decode window's successor before reading the window back, so that the host's work at
    the window's end runs while the GPU decodes (engine/multi_step.py). A sequence that stops in a window
    has one more window's tokens computed and dropped (so does the last batch of a generate whose sequences all
    stop before max_new_tokens: one window); new requests join a window later."""
    compile_prefill: bool = True
    """Where the decode graphs run compiled layers, prefill runs them too (one more compilation per layer kind,
    at engine start); off keeps prefill eager. Compiled prefill scores span the cache's whole capacity
    (max_model_len / 4 compressed entries): more memory for the first chunks of long prompts."""
    compile_options: dict = field(default_factory=dict)
    """Inductor settings for the compiled decoder layers on top of lockstep's own (torch.compile's `options`;
    names from torch._inductor.config, e.g. {"coordinate_descent_tuning": True}); lockstep's include
    combo_kernels=True for the decode step (engine/cuda_graph.DECODE_INDUCTOR_OPTIONS), which
    {"combo_kernels": False} turns off. Not a flag."""
    compile_cache_dir: str | None = None
    """Directory of compiled-graph artifacts reused across processes and machines (engine/compile_cache.py):
    at start the engine loads the file matching this torch, GPU, model and engine config before compiling,
    and saves one after a start that compiled something new. None: off; train, serve and generate default to
    MODEL/compile-cache when it exists (`lockstep compile MODEL` fills it); "" turns that off."""
    compile_decode: bool = True
    """On CUDA in bf16 with cuda_graph, the decoder layers are compiled (inductor) before the decode graphs are
    captured; off: the graphs replay the eager forward (a different rounding: README, train/rollout agreement).
    LOCKSTEP_COMPILE=0 / 1, when set, overrides."""
    compile_fallback: bool = False
    """If compiling the decoder layers or capturing the decode graphs fails at engine start, warn and serve the
    eager path instead of raising (its train/rollout gap differs from the compiled one's)."""
    triton_moe: bool = True
    """The routed experts of decode steps run lockstep's Triton grouped GEMMs (CUDA, bf16); off: torch's grouped
    GEMM. LOCKSTEP_TRITON_MOE=0 / 1, when set, overrides (models/layers/kernel_switch.py)."""
    triton_hc: bool = True
    """mHC's projection and RMSNorm in decode steps is one Triton kernel (CUDA), the coefficients, Sinkhorn and
    collapse another; off: a torch GEMM and compiled torch ops. LOCKSTEP_TRITON_HC=0 / 1, when set, overrides."""
    triton_attention: bool = True
    """A decode step's core attention (scores, softmax with the sink, P V) is one Triton kernel reading the
    window ring and the compressed entries (C4 layers: the indexer's picks only) where they are cached (CUDA,
    bf16; models/layers/step_attention_triton.py); off: torch ops over the keys gathered from the caches.
    LOCKSTEP_TRITON_ATTENTION=0 / 1, when set, overrides."""
    triton_router: bool = True
    """A decode step's top-k router (fp32 logits, scores, top-k, weights) is one Triton kernel (CUDA;
    models/layers/router_triton.py: its figures); off: torch ops (cuBLAS's fp32 GEMM, inductor's top-k).
    LOCKSTEP_TRITON_ROUTER=0 / 1, when set, overrides."""
    triton_compressor: bool = True
    """The compressed entry a decode step's token closes is one Triton kernel reading the compressor's open
    block where it is cached, and only the token is written into it (CUDA; models/layers/compressor_step_triton.py);
    off: torch ops over both blocks the step spans. LOCKSTEP_TRITON_COMPRESSOR=0 / 1, when set, overrides."""
    triton_sampler: bool = True
    """The draw of a batch whose rows share one temperature and truncate nothing (greedy or sampled: the token and
    its logprob) is two or three Triton kernels reading the logits once or twice (CUDA; engine/draw_triton.py);
    off: torch's log_softmax, argmax or exp, cumsum and search, and gather.
    LOCKSTEP_TRITON_SAMPLER=0 / 1, when set, overrides."""
    compile_hc: bool = True
    """On CUDA, mHC's coefficients are compiled where the layers around them are not (eager prefill, the
    trainer). LOCKSTEP_COMPILE=0 / 1, when set, overrides."""

    # the fields that choose the served path (its kernels, its scheduling), offered as flags by every command
    # that builds an engine (train, serve, generate), so the path a measurement used can always be named
    PATH_FIELDS = ("compile_decode", "compile_prefill", "compile_fallback", "cuda_graph", "triton_moe", "triton_hc",
                   "triton_attention", "triton_router", "triton_compressor", "triton_sampler", "compile_hc",
                   "true_on_policy", "async_scheduling")

    def __post_init__(self):
        name = "EngineConfig"
        if self.compile_options:
            _check_inductor_options(name, self.compile_options)
        check_choices(self)
        for f in ("max_num_seqs", "max_model_len", "max_prefill_tokens", "block_size", "decode_steps"):
            if getattr(self, f) < 1:
                _fail(name, f, f"must be >= 1, got {getattr(self, f)}")
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        if self.true_on_policy and self.true_on_policy_excluded_by():
            _fail(name, self.true_on_policy_excluded_by(),
                  "true_on_policy serves the dequantised fp8 values (the trainer's quantisation-aware forward "
                  "computes with them); packed weights compute in another order: turn one off")

    def true_on_policy_excluded_by(self) -> str | None:
        """The field that rules the true-on-policy forward out (an error when it is asked for, off when
        it is None), or None."""
        return "packed_fp8" if self.packed_fp8 else "packed_experts" if self.packed_experts else None
