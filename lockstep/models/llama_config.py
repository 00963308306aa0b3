"""Dense Llama / Qwen3 configuration: a frozen dataclass with Hugging Face's field names.

`from_hf_dict` reads both transformers 5 `rope_parameters` and the legacy top-level
`rope_theta` + `rope_scaling`; `to_hf_dict` writes a config.json that transformers'
LlamaConfig / Qwen3Config read back. Qwen3 is Llama plus a per-head RMSNorm on q and k
(`qk_norm`), selected by `model_type`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lockstep.files import FieldError, check_positive, check_types

MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ROPE_TYPES = ("default", "linear", "llama3")
# sizes and counts that must be >= 1 (None: derived)
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "max_position_embeddings")


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: = num_attention_heads (no GQA)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None, or {"rope_type": "linear", "factor"} or {"rope_type": "llama3", "factor",
    # "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    rope_scaling: dict | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None

    def __post_init__(self):
        check_positive("LlamaConfig", {n: getattr(self, n) for n in _SIZES})
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        self._validate()

    def _validate(self):
        def bad(field_name, why):
            raise FieldError("LlamaConfig", field_name, why)

        if self.model_type not in MODEL_TYPES:
            bad("model_type", f"{self.model_type!r} is not one of {sorted(MODEL_TYPES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            bad("num_key_value_heads", f"{self.num_key_value_heads} does not divide {self.num_attention_heads} heads")
        if self.head_dim % 2:
            bad("head_dim", f"{self.head_dim} must be even for RoPE")
        if self.hidden_act != "silu":
            bad("hidden_act", f"only 'silu' (SwiGLU) is supported, got {self.hidden_act!r}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            bad("rope_scaling", f"rope_type {rope_type!r} is not supported; supported: {ROPE_TYPES}")

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises each query / key head (RMSNorm over head_dim) before RoPE."""
        return self.model_type == "qwen3"

    def replace(self, **changes) -> "LlamaConfig":
        return dataclasses.replace(self, **changes)

    # ---- Hugging Face config.json <-> dataclass -------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        check_types(cls, d)
        d = dict(d)
        if d.get("use_sliding_window"):
            raise ValueError("LlamaConfig: sliding-window attention (use_sliding_window) is not supported")
        rp = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        if "rope_theta" in rp:
            d["rope_theta"] = rp.pop("rope_theta")
        rope_type = rp.pop("rope_type", rp.pop("type", "default"))
        rp.pop("partial_rotary_factor", None)
        d["rope_scaling"] = None if rope_type == "default" else {"rope_type": rope_type, **rp}
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names and (v is not None or k.endswith("token_id"))}
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        scaling = d.pop("rope_scaling") or {"rope_type": "default"}
        d["rope_parameters"] = {**scaling, "rope_theta": d.pop("rope_theta")}
        d["architectures"] = [MODEL_TYPES[self.model_type]]
        return d
