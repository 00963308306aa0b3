"""Which defaults a `lockstep train` / `lockstep eval` run gets, and what `--help` says about them.

    no --model    the embedded tiny DeepSeek-V4's preset (lockstep/rl/embedded.py RUN_RECIPE,
                  TRAIN_RECIPE, ENGINE_RECIPE) over the config classes' defaults
    --model DIR   the config classes' own defaults (real-run values, after Miles' DeepSeek-V4 run),
                  and an engine context sized for the run: max_model_len = PROMPT_ROOM + the
                  longest response the run samples
A flag given on the command line always wins over both.
"""

from __future__ import annotations

import dataclasses

from ..models.deepseek_v4_config import CSA, HCA, SLIDING, DeepseekV4Config
from ..rl.embedded import ENGINE_RECIPE

# Prompt tokens the engine's context leaves room for when --max-model-len is not given. Measured
# with the SmolLM2 tokenizer and chat template: DAPO-Math-17k median 106, max 1602 (first 3,000
# rows); MATH-500 median 82, max 943. The engine caps it at the model's max_position_embeddings.
PROMPT_ROOM = 2048


def is_embedded(args) -> bool:
    return not getattr(args, "model", "")


def preset(args, recipe: dict) -> dict:
    """The recipe's values of the fields not given as flags, when the run is the embedded one."""
    return {k: v for k, v in recipe.items() if k not in vars(args)} if is_embedded(args) else {}


def engine_preset(args, *response_lens: int) -> dict:
    """EngineConfig values set by the preset: the embedded recipe, or with --model a max_model_len
    that holds a prompt and the longest of `response_lens`."""
    if is_embedded(args):
        return preset(args, ENGINE_RECIPE)
    if "max_model_len" in vars(args):
        return {}
    return {"max_model_len": PROMPT_ROOM + max(response_lens)}


def default_text(cls, recipe: dict, with_model: dict[str, str] | None = None) -> dict[str, str]:
    """--help's shown default of each field the presets set: the value with --model, then the
    embedded one; `with_model` replaces the first where it is derived from other flags."""
    with_model = {**{f.name: f.default for f in dataclasses.fields(cls)}, **(with_model or {})}
    return {k: f"{with_model[k]} with --model; {v} without (the embedded preset)"
            for k, v in recipe.items() if with_model[k] != v}


def describe(args) -> str:
    """One line saying which defaults this run got."""
    if is_embedded(args):
        return "defaults: the embedded preset (lockstep/rl/embedded.py); flags given override it"
    return "defaults: the real-model defaults (lockstep train --help); flags given override them"


@dataclasses.dataclass(frozen=True)
class SFTPreset:
    """A `lockstep sft --preset NAME` run: a new random-init DeepSeek-V4 (`model`'s fields over
    DeepseekV4Config's defaults, vocab and special ids from the character tokenizer) trained on
    worked-step arithmetic (lockstep/rl/arithmetic.py worked_pairs) of `digits`-digit + and -."""
    model: dict
    digits: int
    split_sizes: dict  # worked pairs drawn from each split of arithmetic.SPLITS
    steps: int
    batch_size: int
    lr: float
    device: str
    autocast_dtype: str | None  # the forward's compute dtype; the weights and AdamW stay float32
    eval_every: int


# A trained model to measure the train / rollout agreement on (issue 16 item 4): random-init logits are
# near-flat and routing near-tied, which makes every gap figure pessimistic. The shape is grpo_step's
# gpu-848m (8 layers, hidden 1024, 64 experts top-6; 852.6M parameters with this vocab) but for HCA's
# compress rate, 16 instead of 128: the full-sequence forward fails on a batch shorter than one HCA
# block (benchmarks/grpo_step.py), and a worked 4-digit problem is ~95 tokens.
# Step budget: grpo_step gpu-848m's train step is 0.33 s for 64 completions of <= 128 tokens on one
# H200 (README); a batch of 64 worked problems is ~64 x 95 tokens, so ~0.3 s a step: 600 steps and
# 6 selection evals of 256 problems is ~3-4 minutes, plus ~1 minute to build and save 3.4 GB.
SFT_PRESETS = {
    "gpu-dsv4-0.85b": SFTPreset(
        model=dict(hidden_size=1024, moe_intermediate_size=512, num_hidden_layers=8, num_attention_heads=16,
                   head_dim=128, q_lora_rank=512, num_experts_per_tok=6, n_routed_experts=64, o_groups=4,
                   o_lora_rank=256, index_n_heads=16, index_head_dim=64, index_topk=64, sliding_window=64,
                   compress_rates={CSA: 4, HCA: 16}, max_position_embeddings=512,
                   layer_types=(SLIDING, CSA, HCA, CSA, HCA, CSA, HCA, CSA),
                   mlp_layer_types=("hash_moe",) * 2 + ("moe",) * 6),
        digits=4, split_sizes={"train": 40000, "select": 256, "eval": 256}, steps=600, batch_size=64, lr=3e-4,
        device="cuda", autocast_dtype="bfloat16", eval_every=100),
}


def sft_model_config(preset: SFTPreset, tokenizer, **overrides) -> DeepseekV4Config:
    """The preset's model config for `tokenizer`; `overrides` (tests) replace fields, e.g. a CPU-sized width."""
    ids = dict(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    return DeepseekV4Config(vocab_size=len(tokenizer), **ids, **{**preset.model, **overrides})
