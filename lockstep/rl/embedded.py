"""The embedded default: a tiny DeepSeek-V4 on a synthetic arithmetic task, CPU-sized.

`lockstep sft` (no arguments) builds it: a character-level tokenizer, a randomly initialised
tiny DeepSeek-V4 in which every layer kind appears, warm-started by supervised fine-tuning
on arithmetic prompts until it solves some but not most of them; the result is bundled at
`lockstep/assets/tiny-dsv4/`. `lockstep train` (no arguments) then runs GRPO on it.

Its three prompt sets come from disjoint splits of the problem space (lockstep/rl/arithmetic.py):
SFT and RL train on "train", SFT stops on its greedy accuracy on "select", and the RL run's
held-out pass@k (and `lockstep eval`'s) is measured on "eval", which neither stage saw.
"""

from __future__ import annotations

from pathlib import Path

from ..models.deepseek_v4_config import CSA, HCA, SLIDING, DeepseekV4Config
from .arithmetic import arithmetic_prompts

ASSET_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny-dsv4"
TASK = dict(digits=2, operators=("+",))
PROMPT_SEED = 0
# prompts drawn from each split: SFT and RL train on 5000 of the ~6,500 "train" additions, SFT selects
# on 200 of the ~810 "select" ones and every run evaluates on 128 of the ~810 "eval" ones
SPLIT_SIZES = {"train": 5000, "select": 200, "eval": 128}

# What `lockstep train` with no arguments runs (any flag given on the command line wins; with --model the
# config classes' own defaults apply instead: lockstep/commands/presets.py).
# GRPO with TIS and clip-higher, dynamic sampling; measured on 2 CPU cores: see README.
RUN_RECIPE = dict(num_rollout=120, rollout_batch_size=32, n_samples_per_prompt=8, rollout_max_response_len=8,
                  eval_max_response_len=8, dynamic_sampling=True, eval_interval=10, n_samples_per_eval_prompt=4)
TRAIN_RECIPE = dict(lr=1e-3, use_tis=True, eps_clip_high=0.28, max_tokens_per_gpu=8192)
ENGINE_RECIPE = dict(max_num_seqs=256, max_model_len=64)


def embedded_prompts(split: str) -> list:
    """The embedded task's prompt set of `split` ("train", "select" or "eval")."""
    return arithmetic_prompts(SPLIT_SIZES[split], seed=PROMPT_SEED, split=split, **TASK)


def tiny_model_config(vocab_size: int, eos_token_id: int, bos_token_id: int, pad_token_id: int) -> DeepseekV4Config:
    return DeepseekV4Config(
        vocab_size=vocab_size, hidden_size=64, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, head_dim=32, q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=8,
        o_groups=2, o_lora_rank=32, index_n_heads=16, index_head_dim=16, index_topk=2, sliding_window=16,
        compress_rates={CSA: 4, HCA: 8}, partial_rotary_factor=0.25,
        layer_types=(SLIDING, CSA, HCA, CSA), mlp_layer_types=("hash_moe", "moe", "moe", "moe"),
        max_position_embeddings=256, eos_token_id=eos_token_id, bos_token_id=bos_token_id,
        pad_token_id=pad_token_id,
    )
