"""The architecture the planner reasons about, and the built-in presets.

`ModelSpec` keeps only the fields that change memory or traffic: widths, layer count and
per-layer attention kind, MoE shape, the DeepSeek-V4 extras (low-rank q, grouped output,
compressors, indexer, mHC streams). Two families are covered:

- ``deepseek_v4``: every layer MoE; `compress_ratios[i]` is 0 (sliding window only),
  4 (C4: compressed 4:1 + indexer) or 128 (C128: compressed 128:1, dense); any heavy ratio
  above 4 is a C128-kind layer (lockstep's tiny-dsv4 asset compresses 8:1), the formulas take m.
- ``llama``: dense Llama / Qwen / SmolLM style (grouped-query attention, SwiGLU MLP);
  an optional MoE MLP (Mixtral / Qwen-MoE style) when `n_routed_experts > 0`.

Presets (`PRESETS`) are written from public configs; `deepseek-v4-flash` follows
/work/shared/DSV4_SPEC.md (the layer schedule: layers 0-1 window only, then C4 and C128
alternating starting with C4, as in the released `compress_ratios = [0, 0, 4, 128, ...]`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

FAMILIES = ("deepseek_v4", "llama")
COMPRESS_KINDS = (0, 4, 128)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Architecture fields that the memory and communication models read.

    Sizes are element counts (not bytes). `compress_ratios` has one entry per decoder
    layer for ``deepseek_v4`` and is empty for ``llama`` (full causal attention).
    """

    name: str
    family: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    num_attention_heads: int
    head_dim: int
    num_kv_heads: int = 1
    intermediate_size: int = 0  # dense MLP width (llama family)
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    q_lora_rank: int = 0
    o_groups: int = 0
    o_lora_rank: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    hc_mult: int = 1
    sliding_window: int = 0
    compress_ratios: tuple[int, ...] = field(default_factory=tuple)
    num_hash_layers: int = 0
    tie_word_embeddings: bool = False

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"ModelSpec.family must be one of {FAMILIES}, got {self.family!r}")
        for name in ("hidden_size", "num_layers", "vocab_size", "num_attention_heads", "head_dim", "num_kv_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_routed_experts < 0 or self.num_experts_per_tok < 0:
            raise ValueError("ModelSpec.n_routed_experts and num_experts_per_tok must be >= 0")
        if self.n_routed_experts and not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(
                f"ModelSpec.num_experts_per_tok must be in [1, n_routed_experts={self.n_routed_experts}], "
                f"got {self.num_experts_per_tok}"
            )
        if self.n_routed_experts and self.moe_intermediate_size < 1:
            raise ValueError("ModelSpec.moe_intermediate_size must be >= 1 for an MoE model")
        if self.family == "llama" and not self.n_routed_experts and self.intermediate_size < 1:
            raise ValueError("ModelSpec.intermediate_size must be >= 1 for a dense llama-family model")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelSpec.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.hc_mult < 1:
            raise ValueError(f"ModelSpec.hc_mult must be >= 1, got {self.hc_mult}")
        if self.family == "deepseek_v4":
            self._check_v4()

    def _check_v4(self):
        if not self.n_routed_experts:
            raise ValueError("ModelSpec.n_routed_experts must be >= 1 for deepseek_v4")
        if len(self.compress_ratios) != self.num_layers:
            raise ValueError(
                f"ModelSpec.compress_ratios has {len(self.compress_ratios)} entries, "
                f"num_layers is {self.num_layers}"
            )
        bad = sorted({r for r in self.compress_ratios if r not in COMPRESS_KINDS and r <= 4})
        if bad:
            raise ValueError(f"ModelSpec.compress_ratios entries must be in {COMPRESS_KINDS} "
                             f"(or another heavy ratio > 4), got {bad}")
        for name in ("q_lora_rank", "o_groups", "o_lora_rank", "sliding_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelSpec.{name} must be >= 1 for deepseek_v4, got {getattr(self, name)}")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ValueError("ModelSpec.o_groups must divide num_attention_heads * head_dim")
        if 4 in self.compress_ratios and (self.index_n_heads < 1 or self.index_head_dim < 1):
            raise ValueError("ModelSpec.index_n_heads and index_head_dim must be >= 1 when C4 layers exist")
        if not 0 <= self.num_hash_layers <= self.num_layers:
            raise ValueError(f"ModelSpec.num_hash_layers must be in [0, num_layers], got {self.num_hash_layers}")

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0

    def layer_kind(self, i: int) -> int:
        """Compression ratio of layer i (0 = window only / full attention)."""
        return self.compress_ratios[i] if self.compress_ratios else 0


def v4_layer_schedule(num_layers: int, window_layers: int = 2) -> tuple[int, ...]:
    """`[0] * window_layers` then 4, 128, 4, 128, ... (DSV4_SPEC.md 'layer schedule')."""
    tail = [4 if i % 2 == 0 else 128 for i in range(max(num_layers - window_layers, 0))]
    return tuple([0] * min(num_layers, window_layers) + tail)


DEEPSEEK_V4_FLASH = ModelSpec(
    name="deepseek-v4-flash",
    family="deepseek_v4",
    hidden_size=4096,
    num_layers=43,
    vocab_size=129280,
    num_attention_heads=64,
    head_dim=512,
    num_kv_heads=1,
    n_routed_experts=256,
    num_experts_per_tok=6,
    moe_intermediate_size=2048,
    n_shared_experts=1,
    q_lora_rank=1024,
    o_groups=8,
    o_lora_rank=1024,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    hc_mult=4,
    sliding_window=128,
    compress_ratios=v4_layer_schedule(43),
    num_hash_layers=3,
)
"""DeepSeek-V4-Flash (DSV4_SPEC.md). The MTP layer is not modelled (RL trains the 43 decoder
layers). `lockstep.plan.params` counts 284,332,230,231 parameters (277,025,390,592 in routed
experts) and 13,799,622,231 active per token (top-6 of 256 plus everything dense; 13,270,091,351
without the input embedding) -- the spec's "284B total, ~13B active". The total equals the
parameter count of transformers 5.23's `DeepseekV4ForCausalLM` built on the meta device with
this config (checked once by hand; the test pins the figure)."""

SMOLLM2_135M = ModelSpec(
    name="smollm2-135m",
    family="llama",
    hidden_size=576,
    num_layers=30,
    vocab_size=49152,
    num_attention_heads=9,
    head_dim=64,
    num_kv_heads=3,
    intermediate_size=1536,
    tie_word_embeddings=True,
)
"""SmolLM2-135M (HuggingFaceTB/SmolLM2-135M config.json): 134,515,008 parameters."""

PRESETS: dict[str, ModelSpec] = {m.name: m for m in (DEEPSEEK_V4_FLASH, SMOLLM2_135M)}
