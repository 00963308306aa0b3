"""Serving formats and the rule that says how each DeepSeek-V4 checkpoint tensor is stored in them.

Per DSV4_SPEC.md "Released checkpoint formats":

    role            tensors                                                    bf16   fp8    fp8-fp4
    LINEAR          attention wq_a/wq_b/wkv/wo_a/wo_b, shared experts w1/w2/w3,  bf16   fp8    fp8
                    indexer wq_b, MTP e_proj/h_proj
    ROUTED_EXPERT   ffn.experts.{e}.w1/w2/w3                                   bf16   fp8    fp4
    BF16            compressor / indexer-compressor wkv, wgate; indexer         bf16   bf16   bf16
                    weights_proj; router gate weight; embed; head; norms
    FP32            hc_* (mHC fn/base/scale), attention sinks, ape (position    fp32   fp32   fp32
                    bias), router bias
    INT32           tid2eid (hash-routing table)                               int32  int32  int32

fp8 = e4m3 with 128x128 block scales; fp4 = e2m1 packed with 1x32 e8m0 scales. MTP e_proj /
h_proj are not in the spec's table; the published V4 listings show them as F8_E4M3 with
128x128 scales, so they are LINEAR here.

Names are accepted in DeepSeek's official layout (`layers.3.attn.wq_a.weight`, `embed.weight`,
`mtp.0.e_proj.weight`), with the `model.` prefix that transformers' save_pretrained adds, and in
transformers' in-memory DeepseekV4 layout (`model.layers.3.self_attn.q_a_proj.weight`,
`model.layers.3.mlp.experts.gate_up_proj` [E, 2I, H], `model.layers.3.attn_hc.fn`, `lm_head.weight`;
renames from transformers/conversion_mapping.py "deepseek_v4").
"""

from __future__ import annotations

import re
from enum import Enum

import torch

from lockstep.quant.errors import QuantFormatError


class ServingFormat(str, Enum):
    BF16 = "bf16"
    FP8 = "fp8"
    FP8_FP4 = "fp8-fp4"

    @classmethod
    def parse(cls, value: "str | ServingFormat") -> "ServingFormat":
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower().replace("_", "-"))
        except ValueError:
            raise ValueError(f"serving format must be one of {[f.value for f in cls]}, got {value!r}") from None


class Storage(str, Enum):
    BF16 = "bf16"
    FP8 = "fp8"  # float8_e4m3fn weight + block scale
    FP4 = "fp4"  # packed e2m1 weight + 1x32 e8m0 scale
    FP32 = "fp32"
    INT32 = "int32"

    @property
    def quantised(self) -> bool:
        return self in (Storage.FP8, Storage.FP4)


class Role(str, Enum):
    LINEAR = "linear"
    ROUTED_EXPERT = "routed_expert"
    BF16 = "bf16"
    FP32 = "fp32"
    INT32 = "int32"


class UnknownTensorError(QuantFormatError):
    """No serving-format rule matches the tensor's name."""


# Unquantised dtype of each plain storage (quantised ones carry their own dtypes).
STORAGE_DTYPE = {Storage.BF16: torch.bfloat16, Storage.FP32: torch.float32, Storage.INT32: torch.int32}

_NORM = r"(?:\w+\.)*\w*norm\.weight"  # attn_norm, q_norm, kv_norm, compressor.norm, enorm, input_layernorm, ...

# Patterns are matched (fullmatch) against the name with `model.` and `layers.{i}.` / `mtp.{i}.` removed.
_OFFICIAL = {
    Role.INT32: [r"ffn\.gate\.tid2eid"],
    Role.FP32: [
        r"hc_(?:attn|ffn|head)_(?:fn|base|scale)",
        r"attn\.(?:attn_sink|sinks)",
        r"attn\.(?:indexer\.)?compressor\.ape",
        r"ffn\.gate\.bias",
    ],
    Role.BF16: [
        r"attn\.(?:indexer\.)?compressor\.(?:wkv|wgate)\.weight",
        r"attn\.indexer\.weights_proj\.weight",
        r"ffn\.gate\.weight",
        r"embed\.weight",
        r"head\.weight",
        _NORM,
    ],
    Role.LINEAR: [
        r"attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b)\.weight",
        r"attn\.indexer\.wq_b\.weight",
        r"ffn\.shared_experts\.w[123]\.weight",
        r"[eh]_proj\.weight",  # MTP
    ],
    Role.ROUTED_EXPERT: [r"ffn\.experts\.\d+\.w[123]\.weight"],
}

_HF = {
    Role.INT32: [r"mlp\.gate\.tid2eid"],
    Role.FP32: [
        r"(?:attn|ffn)_hc\.(?:fn|base|scale)",
        r"hc_head\.hc_(?:fn|base|scale)",
        r"self_attn\.sinks",
        r"self_attn\.compressor\.(?:indexer\.)?position_bias",
        r"mlp\.gate\.e_score_correction_bias",
    ],
    Role.BF16: [
        r"self_attn\.compressor\.(?:indexer\.)?(?:kv_proj|gate_proj)\.weight",
        r"self_attn\.compressor\.indexer\.scorer\.weights_proj\.weight",
        r"mlp\.gate\.weight",
        r"embed_tokens\.weight",
        r"lm_head\.weight",
    ],
    Role.LINEAR: [
        r"self_attn\.(?:q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj)\.weight",
        r"self_attn\.compressor\.indexer\.q_b_proj\.weight",
        r"mlp\.shared_experts\.(?:gate_proj|up_proj|down_proj)\.weight",
    ],
    Role.ROUTED_EXPERT: [r"mlp\.experts\.(?:gate_up_proj|down_proj)"],
}

_RULES = [(re.compile(p), role) for table in (_OFFICIAL, _HF) for role, pats in table.items() for p in pats]
_PREFIX = re.compile(r"^(?:model\.)?(?:(?:layers|mtp)\.\d+\.)?")

_STORAGE = {
    Role.LINEAR: {ServingFormat.BF16: Storage.BF16, ServingFormat.FP8: Storage.FP8, ServingFormat.FP8_FP4: Storage.FP8},
    Role.ROUTED_EXPERT: {
        ServingFormat.BF16: Storage.BF16,
        ServingFormat.FP8: Storage.FP8,
        ServingFormat.FP8_FP4: Storage.FP4,
    },
    Role.BF16: dict.fromkeys(ServingFormat, Storage.BF16),
    Role.FP32: dict.fromkeys(ServingFormat, Storage.FP32),
    Role.INT32: dict.fromkeys(ServingFormat, Storage.INT32),
}


def local_name(name: str) -> str:
    """Strip `model.` and a `layers.{i}.` / `mtp.{i}.` prefix: `model.layers.3.attn.wkv.weight` -> `attn.wkv.weight`."""
    return _PREFIX.sub("", name, count=1)


def tensor_role(name: str) -> Role:
    """The role of a checkpoint tensor; raises UnknownTensorError for names no rule covers."""
    local = local_name(name)
    for pattern, role in _RULES:
        if pattern.fullmatch(local):
            return role
    raise UnknownTensorError(f"{name}: no serving-format rule for this tensor name")


def storage_for(name: str, fmt: "str | ServingFormat") -> Storage:
    """How tensor `name` is stored in serving format `fmt` (bf16 | fp8 | fp8-fp4)."""
    return _STORAGE[tensor_role(name)][ServingFormat.parse(fmt)]


def scale_names(weight_name: str) -> tuple[str, ...]:
    """Names a block scale of `weight_name` may have: DeepSeek V4's `X.scale`, then V3 / transformers'
    `X.weight_scale_inv` (and `Y_scale_inv` for transformers' fused expert parameters `Y`)."""
    if weight_name.endswith(".weight"):
        stem = weight_name[: -len(".weight")]
        return (f"{stem}.scale", f"{stem}.weight_scale_inv")
    return (f"{weight_name}_scale_inv",)
