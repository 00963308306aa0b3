"""DeepSeek-V4 model configuration: a frozen dataclass with Hugging Face's field names.

Field names follow `transformers.DeepseekV4Config` (5.23) so a `config.json` written by either
side reads into the other. `from_hf_dict` accepts the legacy spellings that released
checkpoints ship (`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, flat
`rope_scaling`) and normalises them the way transformers does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from lockstep.files import FieldError, check_positive, check_types

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"  # C4: compress 4:1 + lightning-indexer top-k
HCA = "heavily_compressed_attention"  # C128: compress 128:1, dense over entries
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
_RATIO_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
# sizes and counts that must be >= 1
_SIZES = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads", "head_dim",
          "q_lora_rank", "num_experts_per_tok", "n_routed_experts", "hc_mult", "sliding_window", "o_groups",
          "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk")


@dataclass(frozen=True, kw_only=True)
class DeepseekV4Config:
    model_type: str = "deepseek_v4"
    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    q_lora_rank: int = 1024
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    # {"rope_type": "yarn", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow"}
    # applies to the compressed layers only (window-only layers use plain rope_theta).
    compress_rope_scaling: dict | None = None
    partial_rotary_factor: float = 64 / 512
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    compress_rates: dict = field(default_factory=lambda: {CSA: 4, HCA: 128})
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 1
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self):
        n = self.num_hidden_layers
        if not self.layer_types:
            interleave = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
            object.__setattr__(self, "layer_types", tuple([HCA] * min(n, 2) + interleave))
        if not self.mlp_layer_types:
            object.__setattr__(self, "mlp_layer_types", tuple(["hash_moe"] * min(n, 3) + ["moe"] * max(0, n - 3)))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mlp_layer_types", tuple(self.mlp_layer_types))
        self._validate()

    def _validate(self):
        def bad(field_name, why):
            raise FieldError("DeepseekV4Config", field_name, why)

        check_positive("DeepseekV4Config", {n: getattr(self, n) for n in _SIZES})
        for name, types, allowed in (("layer_types", self.layer_types, LAYER_TYPES),
                                     ("mlp_layer_types", self.mlp_layer_types, MLP_LAYER_TYPES)):
            if len(types) != self.num_hidden_layers:
                bad(name, f"has {len(types)} entries but num_hidden_layers is {self.num_hidden_layers}")
            for t in types:
                if t not in allowed:
                    bad(name, f"unknown entry {t!r}; allowed: {allowed}")
        if self.num_experts_per_tok > self.n_routed_experts:
            bad("num_experts_per_tok", f"{self.num_experts_per_tok} > n_routed_experts {self.n_routed_experts}")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            bad("o_groups", f"{self.o_groups} does not divide num_attention_heads * head_dim")
        if self.rope_head_dim % 2 or self.rope_head_dim > self.index_head_dim:
            bad("partial_rotary_factor", f"rope dim {self.rope_head_dim} must be even and <= index_head_dim")
        if self.scoring_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
            bad("scoring_func", f"unknown {self.scoring_func!r}")
        if self.n_shared_experts not in (0, 1):
            bad("n_shared_experts", "only 0 or 1 shared expert is supported")
        for t in (CSA, HCA):
            if self.compress_rates.get(t, 0) < 1:
                bad("compress_rates", f"missing a positive rate for {t}")

    @property
    def rope_head_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def compress_rate(self, layer_idx: int) -> int:
        t = self.layer_types[layer_idx]
        return 0 if t == SLIDING else self.compress_rates[t]

    def replace(self, **changes) -> "DeepseekV4Config":
        return dataclasses.replace(self, **changes)

    # ---- Hugging Face config.json <-> dataclass -------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "DeepseekV4Config":
        check_types(cls, d)
        d = dict(d)
        if "compress_ratios" in d and not d.get("layer_types"):
            d["layer_types"] = [_RATIO_TO_LAYER_TYPE[r] for r in d["compress_ratios"]][: d["num_hidden_layers"]]
        if "num_hash_layers" in d and not d.get("mlp_layer_types"):
            n, h = d["num_hidden_layers"], d["num_hash_layers"]
            d["mlp_layer_types"] = ["hash_moe"] * min(n, h) + ["moe"] * max(0, n - h)
        if d.get("partial_rotary_factor") is None and "qk_rope_head_dim" in d:
            d["partial_rotary_factor"] = d["qk_rope_head_dim"] / d.get("head_dim", 512)
        rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
        compress = rp.get("compress", rp) if isinstance(rp, dict) else {}
        if compress.get("rope_type", compress.get("type")) == "yarn":
            keys = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
            d["compress_rope_scaling"] = {"rope_type": "yarn", **{k: compress[k] for k in keys if k in compress}}
        if isinstance(rp, dict) and isinstance(rp.get("main"), dict):
            d.setdefault("rope_theta", rp["main"].get("rope_theta", 10000.0))
            d.setdefault("compress_rope_theta", compress.get("rope_theta", 160000.0))
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names and (v is not None or k == "pad_token_id")}
        for k in ("layer_types", "mlp_layer_types"):
            if k in kwargs:
                kwargs[k] = tuple(kwargs[k])
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["mlp_layer_types"] = list(self.mlp_layer_types)
        scaling = d.pop("compress_rope_scaling")
        compress = {"rope_type": "default", "rope_theta": self.compress_rope_theta,
                    "partial_rotary_factor": self.partial_rotary_factor}
        if scaling:
            compress.update(scaling, attention_factor=1.0)
        d["rope_parameters"] = {
            "main": {"rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": self.partial_rotary_factor},
            "compress": compress,
        }
        d["num_key_value_heads"] = 1
        d["architectures"] = ["DeepseekV4ForCausalLM"]
        return d
