"""RunConfig: what one RL run does (data, rollout, reward, eval, saving). Flags follow Miles.

The trainer's knobs live in `lockstep.train.config.TrainConfig` and the engine's in
`lockstep.config.EngineConfig`; `lockstep train` exposes all three as flags, one per field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..config import SamplingParams, check_choices
from ..files import FieldError
from .rewards import BUILTIN_REWARDS, natural_reward


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One RL run; each field's documentation is the string below it (also its --help)."""

    CHOICES: ClassVar[dict[str, tuple]] = {"rm_type": BUILTIN_REWARDS}

    model: str = ""
    """Hugging Face style checkpoint directory; "": the embedded tiny DeepSeek-V4 (and its preset)."""
    prompt_data: str = ""
    """Training prompts, jsonl or parquet; "": the synthetic arithmetic task."""
    input_key: str = "prompt"
    """Column of the prompt in prompt_data and eval_data rows (a.b reads a nested key). A file whose rows lack
    it (and label_key) is read with its known layout (GSM8K, MATH-500, DAPO), except prompt_data when either key
    was set: then it is an error."""
    label_key: str = "label"
    """Column of the reference answer the reward checks against (a.b reads a nested key)."""
    metadata_key: str = ""
    """Column of a dict carried into each sample's metadata; "": none."""
    apply_chat_template: bool = True
    """Wrap string prompts as one user turn of the tokenizer's chat template."""
    skip_bad_rows: bool = False
    """Skip malformed data rows (counted in data/skipped_rows) instead of stopping."""
    rm_type: str = "arithmetic"
    """Reward: dapo (DAPO string match), math (math-verify), gsm8k (last number) or arithmetic."""
    custom_reward_path: str = ""
    """Custom reward module:function (or path/file.py:function), fn(response, label) -> float; overrides
    rm_type."""
    num_rollout: int = 40
    """Rollouts (generate + train steps) in the run."""
    rollout_batch_size: int = 16
    """Prompts per rollout."""
    n_samples_per_prompt: int = 8
    """Responses sampled per prompt (the GRPO group size)."""
    num_steps_per_rollout: int = 1
    """Optimizer steps per rollout; the rollout's samples are split evenly between them."""
    rollout_temperature: float = 1.0
    """Sampling temperature of the rollout (also the trainer's logprob temperature)."""
    rollout_top_p: float = 1.0
    """Top-p of the rollout's sampling."""
    rollout_max_response_len: int = 4096
    """Longest response sampled in a rollout, in tokens (Miles' DeepSeek-V4 DAPO run uses 4096)."""
    dynamic_sampling: bool = False
    """Drop prompt groups whose rewards all agree and over-sample prompts to refill the batch (DAPO)."""
    max_sampling_rounds: int = 4
    """Dynamic sampling: at most this many batches of prompts drawn per rollout."""
    eval_data: tuple[str, ...] = ()
    """Held-out sets as NAME[:RM] PATH pairs, e.g. math500 data/math500/test.jsonl. Each set is scored by
    its own reward: RM if given (a built-in or module:function, e.g. math500:math), else the data set's
    checker known from NAME or PATH (math500 / aime: math, gsm8k: gsm8k, dapo: dapo, arithmetic), else
    the run's reward (custom_reward_path or rm_type)."""
    eval_interval: int = 10
    """Evaluate every this many rollouts (and after the last)."""
    n_samples_per_eval_prompt: int = 4
    """Responses sampled per eval prompt (pass@k up to this k)."""
    eval_temperature: float = 1.0
    """Sampling temperature of evaluation."""
    eval_max_response_len: int = 4096
    """Longest response sampled in evaluation, in tokens."""
    eval_prompts_limit: int = 0
    """Evaluate on at most this many prompts per set; 0: all."""
    max_prompt_len: int = 0
    """Leave out training and held-out prompts longer than this many tokens (chat template included), counted
    at the start; 0: keep every prompt (one too long for the engine's context stops the run when drawn)."""
    run_dir: str = ""
    """Directory for metrics.jsonl, config.json and plots; "": runs/<timestamp>."""
    layout: str = ""
    """A `lockstep plan --json` file: its best-ranked layout that fits and that lockstep can run gives this
    run its flags (processes, EP, micro-batch tokens, recompute, offload); a flag also given here must agree
    with the layout's; "": none."""
    save: str = ""
    """Directory to save the run to (trainer state, data cursor, RNG); "": no saving."""
    load: str = ""
    """Directory of a --save to resume from; "": start fresh."""
    ref_load: str = ""
    """Reference model of the KL loss (--kl-loss-coef > 0), a model directory as --model takes; "": a frozen
    copy of --model's weights (the run's initial policy, also when resuming with --load)."""
    save_interval: int = 0
    """Save every this many rollouts; 0: only at the end (when save is set)."""
    seed: int = 1234
    """Seed of the data order, sampling and trainer."""
    tensorboard: bool = False
    """Also log metrics to TensorBoard under run_dir."""
    wandb: bool = False
    """Also log metrics to Weights & Biases."""
    plot: bool = True
    """Draw the run's plots into run_dir/plots at the end."""

    def __post_init__(self):
        def bad(field, why):
            raise ValueError(f"RunConfig.{field}: {why}")

        check_choices(self)

        for f in ("num_rollout", "rollout_batch_size", "n_samples_per_prompt", "num_steps_per_rollout",
                  "rollout_max_response_len", "eval_interval", "n_samples_per_eval_prompt", "max_sampling_rounds"):
            if getattr(self, f) < 1:
                bad(f, f"must be >= 1, got {getattr(self, f)}")
        if len(self.eval_data) % 2:
            bad("eval_data", "takes NAME[:RM] PATH pairs")
        names = [spec.partition(":")[0] for spec in self.eval_data[0::2]]
        if len(set(names)) < len(names) or not all(names):
            bad("eval_data", f"set names must be non-empty and distinct, got {names}")
        for spec in self.eval_data[0::2]:
            rm = spec.partition(":")[2]
            if spec.endswith(":") or rm and rm not in BUILTIN_REWARDS and ":" not in rm:
                bad("eval_data", f"{spec!r}: RM after ':' must be one of {BUILTIN_REWARDS} or module:function")
        if self.rollout_batch_size * self.n_samples_per_prompt % self.num_steps_per_rollout:
            bad("num_steps_per_rollout", "must divide rollout_batch_size * n_samples_per_prompt")
        if self.custom_reward_path and ":" not in self.custom_reward_path:
            bad("custom_reward_path", f"expected module:function, got {self.custom_reward_path!r}")
        for f in ("eval_prompts_limit", "save_interval", "max_prompt_len"):  # 0: every prompt / at the end / off
            if getattr(self, f) < 0:
                bad(f, f"must be >= 0, got {getattr(self, f)}")
        # the rollout's and the eval's sampling, by SamplingParams' rule, before the run rather than at its first draw
        for prefix, top_p in (("rollout", self.rollout_top_p), ("eval", 1.0)):
            try:
                SamplingParams(temperature=getattr(self, f"{prefix}_temperature"), top_p=top_p,
                               max_new_tokens=getattr(self, f"{prefix}_max_response_len"))
            except FieldError as e:
                bad(f"{prefix}_" + {"max_new_tokens": "max_response_len"}.get(e.field, e.field), e.why)

    @property
    def eval_sets(self) -> list[tuple[str, str, str]]:
        """(name, path, reward) of each eval_data set, its reward resolved as eval_data says."""
        return [(name, path, self.eval_reward(name, path, rm))
                for (name, _, rm), path in zip((s.partition(":") for s in self.eval_data[0::2]), self.eval_data[1::2])]

    def eval_reward(self, name: str, path: str = "", rm: str = "") -> str:
        """The reward (a get_reward_fn name) of eval set `name` at `path`: the one home of the rule."""
        return rm or natural_reward(name, path) or self.custom_reward_path or self.rm_type
