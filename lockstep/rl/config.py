"""RunConfig: what one RL run does (data, rollout, reward, eval, saving). Flags follow Miles.

The trainer's knobs live in `lockstep.train.config.TrainConfig` and the engine's in
`lockstep.config.EngineConfig`; `lockstep train` exposes all three as flags, one per field.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    model: str = ""  # HF-style directory; "" = the embedded tiny DeepSeek-V4
    prompt_data: str = ""  # jsonl / parquet; "" = the synthetic arithmetic task
    input_key: str = "prompt"
    label_key: str = "label"
    metadata_key: str = ""
    apply_chat_template: bool = True
    skip_bad_rows: bool = False
    rm_type: str = "arithmetic"  # dapo | math | gsm8k | arithmetic
    custom_reward_path: str = ""  # module:function, overrides rm_type
    num_rollout: int = 40
    rollout_batch_size: int = 16  # prompts per rollout
    n_samples_per_prompt: int = 8
    num_steps_per_rollout: int = 1
    rollout_temperature: float = 1.0
    rollout_top_p: float = 1.0
    rollout_max_response_len: int = 8
    dynamic_sampling: bool = False  # drop groups whose rewards all agree, over-sample to refill
    max_sampling_rounds: int = 4  # cap on over-sampling rounds per rollout
    eval_data: tuple[str, ...] = ()  # NAME PATH pairs, flattened
    eval_interval: int = 10
    n_samples_per_eval_prompt: int = 4
    eval_temperature: float = 1.0
    eval_max_response_len: int = 8
    eval_prompts_limit: int = 0  # 0 = all
    run_dir: str = ""  # "" = runs/<timestamp>
    save: str = ""
    load: str = ""
    save_interval: int = 0  # 0 = only at the end (when --save is set)
    seed: int = 1234
    tensorboard: bool = False
    wandb: bool = False
    plot: bool = True

    def __post_init__(self):
        def bad(field, why):
            raise ValueError(f"RunConfig.{field}: {why}")

        for f in ("num_rollout", "rollout_batch_size", "n_samples_per_prompt", "num_steps_per_rollout",
                  "rollout_max_response_len", "eval_interval", "n_samples_per_eval_prompt", "max_sampling_rounds"):
            if getattr(self, f) < 1:
                bad(f, f"must be >= 1, got {getattr(self, f)}")
        if len(self.eval_data) % 2:
            bad("eval_data", "takes NAME PATH pairs")
        if self.rollout_batch_size * self.n_samples_per_prompt % self.num_steps_per_rollout:
            bad("num_steps_per_rollout", "must divide rollout_batch_size * n_samples_per_prompt")
        if self.custom_reward_path and ":" not in self.custom_reward_path:
            bad("custom_reward_path", f"expected module:function, got {self.custom_reward_path!r}")

    @property
    def eval_sets(self) -> list[tuple[str, str]]:
        return list(zip(self.eval_data[0::2], self.eval_data[1::2]))
