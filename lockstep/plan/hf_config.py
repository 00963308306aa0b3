"""Read a model for the planner: a preset name or a Hugging Face `config.json`.

Accepted config.json shapes:

- DeepSeek-V4 (`model_type` "deepseek_v4", or any config with `hc_mult` / `compress_ratios` /
  `o_lora_rank`): hidden_size, num_hidden_layers, vocab_size, n_routed_experts,
  num_experts_per_tok, moe_intermediate_size, n_shared_experts, num_attention_heads, head_dim,
  q_lora_rank, o_groups, o_lora_rank, index_n_heads, index_head_dim, index_topk, hc_mult,
  sliding_window, and the layer schedule as `layer_types` (names) with `compress_rates`, or as
  the released per-layer `compress_ratios` list (0 / 4 / 128; extra trailing entries, e.g. for
  the MTP layer, are ignored). Without either, the V4-Flash schedule is assumed.
- Llama style (dense): hidden_size, num_hidden_layers, vocab_size, num_attention_heads,
  num_key_value_heads, head_dim (default hidden/heads), intermediate_size,
  tie_word_embeddings; MoE variants via n_routed_experts / num_experts / num_local_experts.
"""

from __future__ import annotations

from pathlib import Path

from lockstep.files import FieldError, naming, read_json
from lockstep.plan.model import PRESETS, ModelSpec, v4_layer_schedule

V4_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
V4_DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def load_model(name_or_path: str) -> ModelSpec:
    """A preset by name, else a config.json file (or a directory holding one)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        presets = ", ".join(PRESETS)
        raise ValueError(f"--model {name_or_path!r} is neither a preset ({presets}) nor a config.json")
    with naming(path):
        return spec_from_config(read_json(path), name=str(name_or_path))


def spec_from_config(cfg: dict, name: str = "config.json") -> ModelSpec:
    """Dispatch on the config's family (see module docstring)."""
    if not isinstance(cfg, dict):
        raise ValueError("must hold a JSON object")
    is_v4 = cfg.get("model_type") == "deepseek_v4" or any(k in cfg for k in ("hc_mult", "compress_ratios", "o_lora_rank"))
    return _v4_spec(cfg, name) if is_v4 else _llama_spec(cfg, name)


def _need(cfg: dict, key: str):
    if key not in cfg or cfg[key] is None:
        raise FieldError("config", key, "missing (required)")
    return cfg[key]


def _v4_schedule(cfg: dict, num_layers: int) -> tuple[int, ...]:
    """Per-layer compression ratios from `layer_types` + `compress_rates` or `compress_ratios`."""
    if cfg.get("layer_types"):
        rates = {**V4_DEFAULT_RATES, **(cfg.get("compress_rates") or {})}
        out = []
        for t in cfg["layer_types"][:num_layers]:
            if t not in V4_LAYER_TYPES:
                raise FieldError("config", "layer_types", f"entry {t!r} is not one of {V4_LAYER_TYPES}")
            out.append(0 if t == "sliding_attention" else int(rates[t]))
        if int(rates["compressed_sparse_attention"]) != 4:  # a layer's kind is read from its ratio (C4 = 4)
            raise FieldError("config", "compress_rates", "compressed_sparse_attention must be 4")
        return tuple(out)
    if cfg.get("compress_ratios"):
        return tuple(int(r) for r in cfg["compress_ratios"][:num_layers])
    return v4_layer_schedule(num_layers)


def _v4_spec(cfg: dict, name: str) -> ModelSpec:
    num_layers = int(_need(cfg, "num_hidden_layers"))
    mlp_types = cfg.get("mlp_layer_types")
    num_hash = sum(t == "hash_moe" for t in mlp_types) if mlp_types else int(cfg.get("num_hash_layers", 3))
    return ModelSpec(
        name=name,
        family="deepseek_v4",
        hidden_size=int(_need(cfg, "hidden_size")),
        num_layers=num_layers,
        vocab_size=int(_need(cfg, "vocab_size")),
        num_attention_heads=int(_need(cfg, "num_attention_heads")),
        head_dim=int(_need(cfg, "head_dim")),
        num_kv_heads=int(cfg.get("num_key_value_heads", 1)),
        n_routed_experts=int(_need(cfg, "n_routed_experts")),
        num_experts_per_tok=int(_need(cfg, "num_experts_per_tok")),
        moe_intermediate_size=int(_need(cfg, "moe_intermediate_size")),
        n_shared_experts=int(cfg.get("n_shared_experts", 1)),
        q_lora_rank=int(_need(cfg, "q_lora_rank")),
        o_groups=int(_need(cfg, "o_groups")),
        o_lora_rank=int(_need(cfg, "o_lora_rank")),
        index_n_heads=int(cfg.get("index_n_heads", 64)),
        index_head_dim=int(cfg.get("index_head_dim", 128)),
        index_topk=int(cfg.get("index_topk", 512)),
        hc_mult=int(cfg.get("hc_mult", 4)),
        sliding_window=int(cfg.get("sliding_window", 128)),
        compress_ratios=_v4_schedule(cfg, num_layers),
        num_hash_layers=min(num_hash, num_layers),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def _llama_spec(cfg: dict, name: str) -> ModelSpec:
    hidden = int(_need(cfg, "hidden_size"))
    heads = int(_need(cfg, "num_attention_heads"))
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    moe_inter = int(cfg.get("moe_intermediate_size") or (cfg.get("intermediate_size", 0) if experts else 0))
    return ModelSpec(
        name=name,
        family="llama",
        hidden_size=hidden,
        num_layers=int(_need(cfg, "num_hidden_layers")),
        vocab_size=int(_need(cfg, "vocab_size")),
        num_attention_heads=heads,
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        intermediate_size=0 if experts else int(_need(cfg, "intermediate_size")),
        n_routed_experts=experts,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0)) if experts else 0,
        moe_intermediate_size=moe_inter,
        n_shared_experts=int(cfg.get("n_shared_experts", 0)) if experts else 0,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
