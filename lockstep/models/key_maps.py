"""Checkpoint tensor names <-> lockstep names, one readable table per layout.

lockstep's module and parameter names are exactly transformers 5.23's in-memory names, so a
`hf_model.state_dict()` loads as is. Released checkpoints use other layouts:

- DeepSeek-V4 "official" (DeepSeek's own release): unprefixed, `layers.{i}.attn.wq_a.weight`,
  one tensor per expert `layers.{i}.ffn.experts.{e}.w1.weight` (w1 = gate, w3 = up, w2 = down).
- DeepSeek-V4 "transformers": what `save_pretrained` of transformers 5.23 writes: the official
  layer names with a `model.` prefix, but `model.embed_tokens.weight`, `model.norm.weight`,
  `model.hc_head.hc_*` and `head.weight` (its reverse renames are anchored, so only some apply).
- GGUF (llama.cpp): `blk.{i}.attn_q.weight` ... (q/k rows are permuted; see `gguf.py`).

A row is (checkpoint template, lockstep template[, expert part]). Templates hold placeholders
`{i}` (layer), `{e}` (expert) and a few named alternations (`{hc}`, `{w}`...); the same row is
read left-to-right on load and right-to-left on save. Rows with a part ("gate" / "up" / "down")
are one expert's slice of a stacked tensor: `gate_up_proj` [E, 2F, D] (gate rows first, then
up) or `down_proj` [E, D, F].
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

# placeholder -> the regex it stands for; the matched text is substituted into the other side
PLACEHOLDERS = {
    "i": r"\d+", "e": r"\d+",
    "hc": "fn|base|scale",
    "w": "weight|bias",
    "qkvo": "q|k|v|o", "qk": "q|k", "mlp": "gate|up|down",
}
# compressor tensors: official spelling -> transformers spelling
_COMPRESSOR = {"wkv.weight": "kv_proj.weight", "wgate.weight": "gate_proj.weight", "ape": "position_bias",
               "norm.weight": "kv_norm.weight"}


@dataclass(frozen=True)
class Mapped:
    """Where one checkpoint tensor goes: a lockstep name, and for per-expert tensors the slice."""

    name: str
    expert: int | None = None
    part: str | None = None  # "gate" | "up" | "down"


def _compile(template: str) -> re.Pattern:
    pieces = re.split(r"\{(\w+)\}", template)
    out = []
    for k, piece in enumerate(pieces):
        out.append(f"(?P<{piece}>{PLACEHOLDERS[piece]})" if k % 2 else re.escape(piece))
    return re.compile("".join(out))


class Rule:
    def __init__(self, source: str, target: str, part: str | None = None):
        self.source, self.target, self.part = source, target, part
        self._src, self._tgt = _compile(source), _compile(target)

    def forward(self, name: str) -> Mapped | None:
        m = self._src.fullmatch(name)
        if m is None:
            return None
        groups = m.groupdict()
        expert = int(groups["e"]) if "e" in groups else None
        return Mapped(self.target.format(**groups), expert, self.part)

    def backward(self, name: str) -> dict | None:
        m = self._tgt.fullmatch(name)
        return None if m is None else m.groupdict()


def _under(src_prefix: str, dst_prefix: str, rows) -> tuple[Rule, ...]:
    return tuple(Rule(src_prefix + r[0], dst_prefix + r[1], *r[2:]) for r in rows)


# ---- DeepSeek-V4 -------------------------------------------------------------------------------

# (official name under "layers.{i}.", lockstep name under "model.layers.{i}.")
DSV4_LAYER = (
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("hc_attn_{hc}", "attn_hc.{hc}"),
    ("hc_ffn_{hc}", "ffn_hc.{hc}"),
    ("attn.attn_sink", "self_attn.sinks"),
    ("attn.wq_a.weight", "self_attn.q_a_proj.weight"),
    ("attn.q_norm.weight", "self_attn.q_a_norm.weight"),
    ("attn.wq_b.weight", "self_attn.q_b_proj.weight"),
    ("attn.wkv.weight", "self_attn.kv_proj.weight"),
    ("attn.norm.weight", "self_attn.kv_norm.weight"),
    ("attn.wo_a.weight", "self_attn.o_a_proj.weight"),
    ("attn.wo_b.weight", "self_attn.o_b_proj.weight"),
    *((f"attn.compressor.{k}", f"self_attn.compressor.{v}") for k, v in _COMPRESSOR.items()),
    # the indexer's compressor lives under the attention compressor in transformers
    *((f"attn.indexer.compressor.{k}", f"self_attn.compressor.indexer.{v}") for k, v in _COMPRESSOR.items()),
    ("attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight"),
    ("attn.indexer.weights_proj.weight", "self_attn.compressor.indexer.scorer.weights_proj.weight"),
    ("ffn.gate.weight", "mlp.gate.weight"),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.tid2eid", "mlp.gate.tid2eid"),
    ("ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"),
    ("ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"),
    ("ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"),
    ("ffn.experts.{e}.w1.weight", "mlp.experts.gate_up_proj", "gate"),
    ("ffn.experts.{e}.w3.weight", "mlp.experts.gate_up_proj", "up"),
    ("ffn.experts.{e}.w2.weight", "mlp.experts.down_proj", "down"),
)

DSV4_OFFICIAL = _under("layers.{i}.", "model.layers.{i}.", DSV4_LAYER) + _under("", "", (
    ("embed.weight", "model.embed_tokens.weight"),
    ("head.weight", "lm_head.weight"),
    ("norm.weight", "model.norm.weight"),
    ("hc_head_{hc}", "model.hc_head.hc_{hc}"),
))

DSV4_TRANSFORMERS = _under("model.layers.{i}.", "model.layers.{i}.", DSV4_LAYER) + _under("", "", (
    ("model.embed_tokens.weight", "model.embed_tokens.weight"),
    ("head.weight", "lm_head.weight"),
    ("model.norm.weight", "model.norm.weight"),
    ("model.hc_head.hc_{hc}", "model.hc_head.hc_{hc}"),
))

# ---- Llama / Qwen3 (transformers names on disk and in memory) ----------------------------------

LLAMA_LAYER = (
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("post_attention_layernorm.weight", "post_attention_layernorm.weight"),
    ("self_attn.{qkvo}_proj.{w}", "self_attn.{qkvo}_proj.{w}"),
    ("self_attn.{qk}_norm.weight", "self_attn.{qk}_norm.weight"),  # Qwen3 only
    ("mlp.{mlp}_proj.{w}", "mlp.{mlp}_proj.{w}"),
)
LLAMA_TRANSFORMERS = _under("model.layers.{i}.", "model.layers.{i}.", LLAMA_LAYER) + _under("", "", (
    ("model.embed_tokens.weight", "model.embed_tokens.weight"),
    ("model.norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
))

# llama.cpp GGUF names (load direction only; q/k permutation is undone in gguf.py)
GGUF_LLAMA = _under("blk.{i}.", "model.layers.{i}.", (
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("attn_q.{w}", "self_attn.q_proj.{w}"),
    ("attn_k.{w}", "self_attn.k_proj.{w}"),
    ("attn_v.{w}", "self_attn.v_proj.{w}"),
    ("attn_output.{w}", "self_attn.o_proj.{w}"),
    ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
)) + _under("", "", (
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
))
GGUF_SKIP = (r"rope_freqs\.weight",)  # llama3 GGUFs store the scaled inv_freq; we recompute it


class KeyMap:
    """All layouts of one model family. Load accepts any layout; save writes the one asked for."""

    def __init__(self, family: str, layouts: dict[str, tuple[Rule, ...]], skip: tuple[str, ...]):
        self.family, self.layouts = family, layouts
        self._skip = re.compile("|".join(skip)) if skip else None
        # lockstep names themselves are accepted on load: every rule's target, read as identity
        seen, identity = set(), []
        for rules in layouts.values():
            for r in rules:
                if r.target not in seen:
                    seen.add(r.target)
                    identity.append(Rule(r.target, r.target))
        self._load_rules = tuple(identity) + tuple(r for rules in layouts.values() for r in rules)

    def is_skipped(self, ckpt_name: str) -> bool:
        return self._skip is not None and self._skip.fullmatch(ckpt_name) is not None

    def to_lockstep(self, ckpt_name: str) -> Mapped | None:
        """The lockstep destination of a checkpoint tensor, or None if no table knows the name."""
        for rule in self._load_rules:
            mapped = rule.forward(ckpt_name)
            if mapped is not None:
                return mapped
        return None

    def to_checkpoint(self, name: str, tensor: torch.Tensor, layout: str = "transformers"):
        """[(checkpoint name, tensor)] for one lockstep tensor; stacked experts are split per expert."""
        rules = self.layouts[layout]
        plain = [(r, g) for r in rules if r.part is None and (g := r.backward(name)) is not None]
        if plain:
            rule, groups = plain[0]
            return [(rule.source.format(**groups), tensor)]
        parts = [(r, g) for r in rules if r.part is not None and (g := r.backward(name)) is not None]
        if not parts:
            raise KeyError(f"{self.family}: no {layout!r} checkpoint name for tensor {name!r}")
        out = []
        for e in range(tensor.shape[0]):
            for rule, groups in parts:
                out.append((rule.source.format(**groups, e=e), expert_slice(tensor, e, rule.part).clone()))
        return out

    def checkpoint_name(self, name: str, layout: str = "transformers", expert: int = 0, part: str | None = None) -> str:
        """The on-disk name of a lockstep tensor, or of one expert's part of a stacked one (for messages)."""
        for rule in self.layouts[layout]:
            groups = rule.backward(name)
            if groups is not None and (part is None or rule.part == part):
                return rule.source.format(**groups, e=expert)
        return name


def expert_slice(stacked: torch.Tensor, expert: int, part: str) -> torch.Tensor:
    """One expert's view of `gate_up_proj` [E, 2F, D] (gate rows, then up) or `down_proj` [E, D, F]."""
    if part == "down":
        return stacked[expert]
    half = stacked.shape[1] // 2
    return stacked[expert, :half] if part == "gate" else stacked[expert, half:]


EXPERT_PARTS = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}

_ROTARY_SKIP = r"(.*\.)?rotary_emb\..*"
KEY_MAPS = {
    "deepseek_v4": KeyMap("deepseek_v4", {"transformers": DSV4_TRANSFORMERS, "official": DSV4_OFFICIAL},
                          skip=(r"(model\.)?mtp\..*", _ROTARY_SKIP)),
    "llama": KeyMap("llama", {"transformers": LLAMA_TRANSFORMERS}, skip=(_ROTARY_SKIP,)),
    "gguf_llama": KeyMap("gguf_llama", {"gguf": GGUF_LLAMA}, skip=GGUF_SKIP),
}
