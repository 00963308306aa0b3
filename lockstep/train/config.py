"""`TrainConfig`: every trainer setting, one field per Miles / slime launch flag.

Field names are the flags without dashes (`--eps-clip-high` -> `eps_clip_high`). Each field's
meaning, unit and default are in the string below it (also its `lockstep train --help` line).
The defaults are Miles' (AdamW lr 1e-6, betas (0.9, 0.98), PPO clip 0.2, TIS off): what a run with
`--model DIR` gets. The embedded CPU run has its own preset (lockstep/rl/embedded.py TRAIN_RECIPE).

loss_agg maps onto `lockstep.train.aggregation`: "token" -> token_mean, "sequence" ->
sequence_mean, "dr_grpo" -> constant with max_len = rollout_max_response_len (None: the longest
response of the global batch). use_tis and mis are alternatives (TIS truncates, MIS masks).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from lockstep.config import check_choices

ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "gspo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
LOSS_AGGS = {"token": "token_mean", "sequence": "sequence_mean", "dr_grpo": "constant"}
KL_LOSS_TYPES = ("k1", "k2", "low_var_kl")
MIS_LEVELS = ("token", "sequence", "geometric")
MIS_MODES = ("truncate", "mask")
QUANT_AWARE_FORMATS = ("fp8", "fp8-fp4")
DTYPES = ("float32", "bfloat16")

# TrainConfig estimator names -> lockstep.rl.advantages names.
_ESTIMATOR_FN = {"reinforce_plus_plus": "reinforce_pp", "reinforce_plus_plus_baseline": "reinforce_pp_baseline"}


def _fail(field_name: str, why: str):
    raise ValueError(f"TrainConfig.{field_name}: {why}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Trainer settings; each field's documentation is the string below it (also its --help)."""

    CHOICES: ClassVar[dict[str, tuple]] = {
        "advantage_estimator": ADVANTAGE_ESTIMATORS, "loss_agg": tuple(LOSS_AGGS), "kl_loss_type": KL_LOSS_TYPES,
        "mis": MIS_LEVELS, "mis_mode": MIS_MODES, "quant_aware_forward": QUANT_AWARE_FORMATS,
        "dtype": DTYPES}

    # optimiser
    lr: float = 1e-6
    """AdamW learning rate, constant over the run."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.98
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    triton_adamw: bool | None = None
    """The optimiser's update as one multi-tensor Triton kernel reading the gradients in their own dtype
    and writing the bf16 parameters (train/adamw_triton.py) instead of three multi-tensor passes (cast,
    torch's fused AdamW, write-back): 28 bytes a parameter instead of 40. None (the default): on CUDA;
    True: also under Triton's interpreter (the CPU tests); False: never. On an H200, 1b config, graphed
    train step: 162,350 -> 166,953 and 144,755 -> 164,768 tok/s in two runs (2026-12-04,
    `benchmarks/train_throughput.py --cuda-graphs --fused-adamw`); masters within fp32 rounding of
    torch's (tests/train/test_optimizer.py)."""
    clip_grad: float | None = 1.0
    """Clip the global gradient L2 norm to this; None: no clipping."""
    # batching
    max_tokens_per_gpu: int = 4096
    """Micro-batch size in real tokens (prompt + response, no padding) per device."""
    # policy loss
    eps_clip: float = 0.2
    """PPO clip: the ratio is clipped to [1 - eps_clip, 1 + eps_clip_high]."""
    eps_clip_high: float | None = None
    """Upper PPO clip (clip-higher; DAPO uses 0.28); None: eps_clip."""
    dual_clip_c: float | None = None
    """Dual-clip bound on the loss of negative-advantage tokens (Ye et al. use 3.0); None: off."""
    advantage_estimator: str = "grpo"
    """Group advantage estimator; gspo also switches the loss to the sequence-level ratio."""
    loss_agg: str = "token"
    """Loss aggregation: token = mean over the batch's tokens (DAPO), sequence = mean of per-sample means,
    dr_grpo = sum / (samples x rollout_max_response_len)."""
    rollout_max_response_len: int | None = None
    """dr_grpo's constant normaliser length in tokens; None: the longest response of the batch."""
    kl_loss_coef: float = 0.0
    """Weight of the KL penalty against the reference model; 0: off."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator of the penalty: k1, k2 or low_var_kl (k3)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus; 0: off."""
    # train / rollout mismatch
    use_tis: bool = False
    """Truncated importance sampling: weight each token's loss by clamp(pi_train / pi_rollout, tis_clip_low,
    tis_clip)."""
    tis_clip: float = 2.0
    """TIS upper bound on the token weight."""
    tis_clip_low: float = 0.0
    """TIS lower bound on the token weight."""
    mis: str | None = None
    """Masked importance sampling level (token, sequence or geometric mean ratio); None: off. An alternative
    to use_tis."""
    mis_mode: str = "mask"
    """MIS: mask zeroes the weight outside [mis_lower, mis_upper], truncate clamps it."""
    mis_lower: float = 0.5
    """MIS lower bound on the importance weight."""
    mis_upper: float = 2.0
    """MIS upper bound on the importance weight."""
    veto_threshold: float | None = None
    """TIS / MIS: a sample with any token ratio pi_train / pi_rollout below this (e.g. 1e-4) gets weight 0;
    None: no veto."""
    use_rollout_logprobs: bool = False
    """pi_old in the PPO ratio is the engine's logprobs instead of the trainer's re-scored ones."""
    # forward path
    quant_aware_forward: str | None = None
    """The trainer's forward uses dequant(quant(w)) in this serving format (the engine's); None: plain
    weights."""
    use_rollout_routing_replay: bool = False
    """The trainer's MoE layers use the experts the engine chose for each token (rollout routing replay)."""
    recompute_activations: bool = False
    """Recompute each decoder layer's activations in the backward pass: less memory, one more forward."""
    compile_backend: str | None = None
    """torch.compile backend for the decoder layers, compiled as the engine's decode step is
    (models/compiled_layers.py): inductor (CUDA), eager / aot_eager (trace only). Not with
    recompute_activations or quant_aware_forward. None: eager layers."""
    train_cuda_graphs: bool = False
    """On CUDA, the forward (model and token logprobs) and its backward replay CUDA graphs recorded per
    micro-batch shape bucket (train/cuda_graphs.py): the eager step is bound by its ~4,400 launches.
    A new bucket records anew (~3 eager steps). With compile_backend the compiled layers' kernels are
    recorded (compiled in the warm-up call before the capture). Not with recompute_activations,
    quant_aware_forward, rollout routing replay, FSDP, expert or pipeline parallelism;
    true_on_policy None decides off with it."""
    train_cuda_graph_shapes: int = 4
    """train_cuda_graphs: the shape buckets whose graphs are kept (the most recently used); each holds the
    activations' memory of its shape."""
    compile_hc: bool = True
    """On CUDA, mHC's coefficients are compiled (fused) outside compiled layers, as in the engine's prefill
    (models/layers/kernel_switch.py). LOCKSTEP_COMPILE=0 / 1, when set, overrides. (The engine's Triton
    switches, triton_moe, triton_hc, triton_attention, triton_router and triton_compressor, act on single-token
    steps, which the trainer's forward never takes, and triton_sampler on the engine's draw; the trainer's own
    are below.)"""
    # The trainer's Triton kernels (below), each with its backward. Measured on one H200 (1b config,
    # 8 x 2048 tokens, benchmarks/train_throughput.py, one run): each alone 0.99-1.13x of the eager ops'
    # step, all five 1.64x (58.5k -> 95.7k tok/s; 3.0x transformers), peak memory 49.3 -> 29.0 GiB.
    # None (the default): on CUDA; False: off; True: also under Triton's interpreter (the CPU tests;
    # elsewhere on the CPU the eager ops run). LOCKSTEP_<NAME>=0 / 1, when set, overrides (kernel_switch.py).
    flash_attention: bool | None = None
    """On CUDA in bf16, the attention of the eager forward runs as flash-style Triton kernels, forward
    and backward (models/layers/flash_sink_attention_triton.py): no score matrix in memory (alone:
    1.13x, peak 49.3 -> 44.4 GiB)."""
    triton_norm: bool | None = None
    """On CUDA in bf16, the RMSNorms of the eager forward run as Triton kernels, forward and backward
    (models/layers/rms_norm_grad_triton.py): one launch forward, two backward, no fp32 copy kept
    (alone 0.99x; with the other four on, 1.16x of those four)."""
    triton_rope: bool | None = None
    """On CUDA in bf16, the rotary embeddings of the eager forward (the attention's q, kv and output,
    the compressors' entries, the indexer's queries) run as one Triton kernel each way
    (models/layers/rope_triton.py) instead of ~10 element-wise kernels forward and ~15 backward
    (alone 1.05x)."""
    triton_combine: bool | None = None
    """On CUDA in bf16, the routed experts' combine (each token's k outputs weighted and added in
    order) in the eager forward runs as one Triton kernel each way, reading the grouped GEMMs'
    outputs in place (models/layers/moe_combine_triton.py): the same forward bits as the eager ops
    (alone 1.10x); the dispatch's gradient (a token's k rows added) is one kernel too."""
    fused_logprobs: bool | None = None
    """On CUDA, the token logprobs and entropies of the loss (and of `Trainer.logprobs`) come from the
    fp32 logits in one Triton kernel each way (models/layers/logprob_entropy_triton.py): the logits
    read once forward and once backward, where the eager ops walk them ~8 times (alone 1.07x, peak
    49.3 -> 39.4 GiB). Same values to fp32 rounding, not bitwise: off in the true-on-policy forward."""
    true_on_policy: bool | None = None
    """The true-on-policy forward (models/deepseek_v4_rows.py, DeepSeek-V4 only), in the trainer and the
    engine alike: the trainer's logprob of a rollout token has the same bits as the engine's, so
    train/train_rollout_logprob_abs_diff is 0. The loss reads its values; the gradient comes from the
    default forward (compiled with compile_backend, when set) run with the same experts. Slower (H200:
    0.78-0.83x of a train step, rollout 0.92x; CPU: row blocks, dense experts, 0.48x). Data and pipeline
    parallel keep it exact; not with expert parallel. None: on CUDA for DeepSeek-V4 without expert
    parallel (kernel_switch.decide_true_on_policy), off elsewhere; `lockstep train` decides it for
    engine and trainer together."""
    optimizer_offload: bool = False
    """Keep the fp32 master weights and AdamW states in host memory."""
    expert_model_parallel_size: int = 1
    """Expert parallel (EP): each trainer rank keeps 1/EP of every MoE layer's routed experts and sends
    tokens to them by all-to-all; EP ranks are the data-parallel ranks (lockstep/dist/expert_parallel.py).
    1: every rank holds all experts."""
    pipeline_model_parallel_size: int = 1
    """Pipeline parallel (PP): the decoder layers are cut into this many stages, one per rank, micro-batches
    flowing through them by torch.distributed.pipelining's 1F1B schedule (lockstep/dist/pipeline_parallel.py:
    `lockstep train --nproc-per-node PP` drives them, colocated, PP = the trainer ranks, no --save yet). 1: every
    rank holds every layer."""
    decoder_last_pipeline_num_layers: int | None = None
    """Pipeline parallel: decoder layers of the last stage (which also holds the LM head); the other stages share
    the rest evenly. None: every stage gets an even share."""
    dtype: str = "float32"
    """Compute dtype; bfloat16 computes in bf16 with fp32 master weights."""
    temperature: float = 1.0
    """Logprobs are log softmax(logits / temperature) over the full vocabulary: the rollout's temperature."""
    seed: int = 1234
    """torch seed of the trainer."""
    deterministic: bool = False
    """torch deterministic algorithms (slower kernels, reproducible on the GPU)."""

    def __post_init__(self):
        check_choices(self)
        self._check_optimiser()
        self._check_loss()
        self._check_mismatch()
        self._check_forward()

    def _check_optimiser(self):
        if not self.lr >= 0:
            _fail("lr", f"must be >= 0, got {self.lr}")
        if not self.weight_decay >= 0:
            _fail("weight_decay", f"must be >= 0, got {self.weight_decay}")
        for f in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, f) < 1:
                _fail(f, f"must be in [0, 1), got {getattr(self, f)}")
        if not self.adam_eps > 0:
            _fail("adam_eps", f"must be > 0, got {self.adam_eps}")
        if self.clip_grad is not None and not self.clip_grad > 0:
            _fail("clip_grad", f"must be > 0 or None (off), got {self.clip_grad}")
        if self.max_tokens_per_gpu < 1:
            _fail("max_tokens_per_gpu", f"must be >= 1, got {self.max_tokens_per_gpu}")

    def _check_loss(self):
        if not 0 < self.eps_clip < 1:
            _fail("eps_clip", f"must be in (0, 1), got {self.eps_clip}")
        if self.eps_clip_high is not None and not self.eps_clip_high > 0:
            _fail("eps_clip_high", f"must be > 0 or None (= eps_clip), got {self.eps_clip_high}")
        if self.dual_clip_c is not None and not self.dual_clip_c > 1:
            _fail("dual_clip_c", f"must be > 1 or None (off), got {self.dual_clip_c}")
        if self.rollout_max_response_len is not None and self.rollout_max_response_len < 1:
            _fail("rollout_max_response_len", f"must be >= 1 or None, got {self.rollout_max_response_len}")
        for f in ("kl_loss_coef", "entropy_coef"):
            if not getattr(self, f) >= 0:
                _fail(f, f"must be >= 0, got {getattr(self, f)}")

    def _check_mismatch(self):
        if not 0 <= self.tis_clip_low < self.tis_clip:
            _fail("tis_clip", f"need 0 <= tis_clip_low < tis_clip, got {self.tis_clip_low}, {self.tis_clip}")
        if self.mis is not None and self.use_tis:
            _fail("mis", "use_tis and mis are alternatives; set only one")
        if not 0 <= self.mis_lower < self.mis_upper:
            _fail("mis_lower", f"need 0 <= mis_lower < mis_upper, got {self.mis_lower}, {self.mis_upper}")
        if self.veto_threshold is not None and not 0 < self.veto_threshold < 1:
            _fail("veto_threshold", f"must be in (0, 1) or None, got {self.veto_threshold}")

    def _check_forward(self):
        if self.expert_model_parallel_size < 1:
            _fail("expert_model_parallel_size", f"must be >= 1, got {self.expert_model_parallel_size}")
        if self.pipeline_model_parallel_size < 1:
            _fail("pipeline_model_parallel_size", f"must be >= 1, got {self.pipeline_model_parallel_size}")
        if self.decoder_last_pipeline_num_layers is not None and self.decoder_last_pipeline_num_layers < 1:
            _fail("decoder_last_pipeline_num_layers",
                  f"must be >= 1 or None, got {self.decoder_last_pipeline_num_layers}")
        if self.expert_model_parallel_size > 1 and self.compile_backend:
            _fail("expert_model_parallel_size", "expert-parallel experts are not combined with compile_backend yet")
        if self.compile_backend is not None and (self.recompute_activations or self.quant_aware_forward):
            _fail("compile_backend", "compiled layers do not trace under recompute_activations or "
                  "quant_aware_forward (checkpointing and the fake-quant autograd.Function); use None")
        if self.train_cuda_graph_shapes < 1:
            _fail("train_cuda_graph_shapes", f"must be >= 1, got {self.train_cuda_graph_shapes}")
        if self.train_cuda_graphs and self.train_cuda_graphs_excluded_by():
            _fail("train_cuda_graphs", f"not combined with {self.train_cuda_graphs_excluded_by()} (train/cuda_graphs.py)")
        if self.true_on_policy and self.true_on_policy_excluded_by() == "expert_model_parallel_size":
            _fail("true_on_policy", "the true-on-policy forward runs every routed expert on each rank: "
                  "not with expert_model_parallel_size > 1")
        if self.true_on_policy and self.true_on_policy_excluded_by() == "train_cuda_graphs":
            _fail("true_on_policy", "the true-on-policy forward is not recorded in CUDA graphs (train_cuda_graphs) yet")
        if not self.temperature > 0:
            _fail("temperature", f"must be > 0 (the rollout's sampling temperature), got {self.temperature}")

    def train_cuda_graphs_excluded_by(self) -> str | None:
        """The first set field whose forward a CUDA graph cannot record (yet), or None."""
        for name in ("recompute_activations", "quant_aware_forward", "use_rollout_routing_replay"):
            if getattr(self, name):
                return name
        for name in ("expert_model_parallel_size", "pipeline_model_parallel_size"):
            if getattr(self, name) > 1:
                return name
        return None

    def true_on_policy_excluded_by(self) -> str | None:
        """The field that rules the true-on-policy forward out (an error when it is asked for, off when
        it is None), or None."""
        if self.expert_model_parallel_size > 1:
            return "expert_model_parallel_size"
        return "train_cuda_graphs" if self.train_cuda_graphs else None

    # ---- derived values --------------------------------------------------------------------

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @property
    def aggregation(self) -> str:
        """The `lockstep.train.aggregation` mode of `loss_agg`."""
        return LOSS_AGGS[self.loss_agg]

    @property
    def advantage_fn(self) -> str:
        """The `lockstep.rl.advantages.compute_advantages` name of `advantage_estimator`."""
        return _ESTIMATOR_FN.get(self.advantage_estimator, self.advantage_estimator)

    @property
    def importance_sampling(self) -> bool:
        return self.use_tis or self.mis is not None

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
