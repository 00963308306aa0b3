"""`TrainConfig`: every trainer setting, one field per Miles / slime launch flag.

Field names are the flags without dashes (`--eps-clip-high` -> `eps_clip_high`). Defaults:

    optimiser        AdamW, lr 1e-6, weight_decay 0.0, betas (0.9, 0.98), eps 1e-8, clip_grad 1.0
    batching         max_tokens_per_gpu 4096 (real tokens, prompt + response, per micro-batch)
    policy loss      PPO clip eps_clip 0.2, eps_clip_high None (= eps_clip; DAPO uses 0.28),
                     dual_clip_c None (off; Ye et al. use 3.0), loss_agg "token" (DAPO token mean)
    estimator        "grpo"; "gspo" also switches the loss to the sequence-level ratio
    KL / entropy     kl_loss_coef 0.0 (off), kl_loss_type "low_var_kl" (k3), entropy_coef 0.0
    mismatch         use_tis False (tis_clip 2.0, tis_clip_low 0.0); mis None, mis_mode "mask",
                     mis_lower 0.5, mis_upper 2.0; veto_threshold None
    numerics         dtype "float32"; "bfloat16" computes in bf16 with fp32 master weights
    forward          quant_aware_forward None; "fp8" | "fp8-fp4" = the engine's serving_format, whose
                     weights (dequant(quant(w))) the forward then uses; compile_backend None
                     (eager layers), "inductor" compiles the decoder layers as the engine's decode
                     step does (models/compiled_layers.py; not with recompute or quant-aware)
    temperature      1.0: logprobs are log softmax(logits / temperature) over the full vocabulary,
                     so it must equal the rollout's sampling temperature

loss_agg maps onto `lockstep.train.aggregation`: "token" -> token_mean, "sequence" ->
sequence_mean, "dr_grpo" -> constant with max_len = rollout_max_response_len (None: the longest
response of the global batch). use_tis and mis are alternatives (TIS truncates, MIS masks).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

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
    """Trainer settings; see the module docstring for defaults and meanings."""

    # optimiser
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-8
    clip_grad: float | None = 1.0
    # batching
    max_tokens_per_gpu: int = 4096
    # policy loss
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    dual_clip_c: float | None = None
    advantage_estimator: str = "grpo"
    loss_agg: str = "token"
    rollout_max_response_len: int | None = None
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    entropy_coef: float = 0.0
    # train / rollout mismatch
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    mis: str | None = None
    mis_mode: str = "mask"
    mis_lower: float = 0.5
    mis_upper: float = 2.0
    veto_threshold: float | None = None
    use_rollout_logprobs: bool = False
    # forward path
    quant_aware_forward: str | None = None
    use_rollout_routing_replay: bool = False
    recompute_activations: bool = False
    compile_backend: str | None = None
    optimizer_offload: bool = False
    dtype: str = "float32"
    temperature: float = 1.0
    seed: int = 1234
    deterministic: bool = False

    def __post_init__(self):
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
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            _fail("advantage_estimator", f"must be one of {ADVANTAGE_ESTIMATORS}, got {self.advantage_estimator!r}")
        if self.loss_agg not in LOSS_AGGS:
            _fail("loss_agg", f"must be one of {tuple(LOSS_AGGS)}, got {self.loss_agg!r}")
        if self.rollout_max_response_len is not None and self.rollout_max_response_len < 1:
            _fail("rollout_max_response_len", f"must be >= 1 or None, got {self.rollout_max_response_len}")
        if self.kl_loss_type not in KL_LOSS_TYPES:
            _fail("kl_loss_type", f"must be one of {KL_LOSS_TYPES}, got {self.kl_loss_type!r}")
        for f in ("kl_loss_coef", "entropy_coef"):
            if not getattr(self, f) >= 0:
                _fail(f, f"must be >= 0, got {getattr(self, f)}")

    def _check_mismatch(self):
        if not 0 <= self.tis_clip_low < self.tis_clip:
            _fail("tis_clip", f"need 0 <= tis_clip_low < tis_clip, got {self.tis_clip_low}, {self.tis_clip}")
        if self.mis is not None and self.mis not in MIS_LEVELS:
            _fail("mis", f"must be None or one of {MIS_LEVELS}, got {self.mis!r}")
        if self.mis is not None and self.use_tis:
            _fail("mis", "use_tis and mis are alternatives; set only one")
        if self.mis_mode not in MIS_MODES:
            _fail("mis_mode", f"must be one of {MIS_MODES}, got {self.mis_mode!r}")
        if not 0 <= self.mis_lower < self.mis_upper:
            _fail("mis_lower", f"need 0 <= mis_lower < mis_upper, got {self.mis_lower}, {self.mis_upper}")
        if self.veto_threshold is not None and not 0 < self.veto_threshold < 1:
            _fail("veto_threshold", f"must be in (0, 1) or None, got {self.veto_threshold}")

    def _check_forward(self):
        if self.quant_aware_forward is not None and self.quant_aware_forward not in QUANT_AWARE_FORMATS:
            _fail("quant_aware_forward", f"must be None or one of {QUANT_AWARE_FORMATS}, got {self.quant_aware_forward!r}")
        if self.compile_backend is not None and (self.recompute_activations or self.quant_aware_forward):
            _fail("compile_backend", "compiled layers do not trace under recompute_activations or "
                  "quant_aware_forward (checkpointing and the fake-quant autograd.Function); use None")
        if self.dtype not in DTYPES:
            _fail("dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        if not self.temperature > 0:
            _fail("temperature", f"must be > 0 (the rollout's sampling temperature), got {self.temperature}")

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
