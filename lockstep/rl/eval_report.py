"""What `lockstep eval` prints besides the metrics, so that a broken setup and a weak model look
different: each set's summary (data, prompts x samples, reward, time), a few completions with their
labels and rewards, and a warning when most reward calls failed.

A reward call fails (rl/rewards safe_reward: it raised, or returned a non-finite number) when the
reward cannot read the set's labels, e.g. `--eval-data NAME:arithmetic` on GSM8K's "... #### 72"
answers, or an unknown set scored by a --rm-type written for another one. Failed calls score 0, so
pass@k is then 0.0 whatever the model; above ERROR_WARN_FRACTION of the calls the warning names the
reward, a label and the error, and how to give the set its own reward.
"""

from __future__ import annotations

from .evaluate import EvalSet, SetResult
from .rewards import BUILTIN_REWARDS, safe_reward

ERROR_WARN_FRACTION = 0.5  # more failed reward calls than this: the setup is broken, not the model
SHOWN_PROMPTS = 3  # prompts whose first completion is printed
TEXT_CHARS = 160  # prompts and completions are cut to this many characters


def _clip(text: str) -> str:
    return repr(text if len(text) <= TEXT_CHARS else text[:TEXT_CHARS] + "...")


def _prompt_text(prompt) -> str:
    """A prompt row's text: the string, or the last message's content of a chat."""
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


def _text_and_label(sample) -> tuple[str, str]:
    return sample.metadata.get("text", ""), sample.metadata.get("label", "")


def set_header(name: str, data: str, eval_set: EvalSet, spec) -> str:
    return (f"{name}: {len(eval_set.prompts)} prompts from {data} x {spec.n_samples} samples (temperature "
            f"{spec.temperature:g}, at most {spec.max_response_len} tokens), scored by reward {eval_set.reward}")


def set_footer(name: str, result: SetResult) -> str:
    total = len(result.samples)
    return (f"{name}: {total} completions in {result.seconds:.1f} s, {result.reward_errors} of {total} "
            f"reward calls failed")


def sample_lines(eval_set: EvalSet, result: SetResult, n_samples: int) -> list[str]:
    """The first completion of each of the first SHOWN_PROMPTS prompts, with label and reward."""
    lines = []
    for i, prompt in enumerate(eval_set.prompts[:SHOWN_PROMPTS]):
        sample = result.samples[i * n_samples]
        text, label = _text_and_label(sample)
        failed = safe_reward(eval_set.reward_fn, text, label)[1]
        lines.append(f"  prompt {i}: {_clip(_prompt_text(prompt.prompt))}  label {_clip(label)}")
        lines.append(f"    completion ({sample.finish_reason}, reward {sample.reward:g}"
                     f"{', the reward call failed' if failed else ''}): {_clip(text)}")
    return lines


def _failure(fn, text: str, label: str) -> str:
    """Why a reward call failed, from calling it again (safe_reward keeps only the flag)."""
    try:
        value = fn(text, label)
    except Exception as e:  # noqa: BLE001 - any error is what the user needs to see
        return f"{type(e).__name__}: {e}"
    return f"it returned {value!r}"


def reward_warning(name: str, eval_set: EvalSet, result: SetResult) -> str | None:
    """A warning when more than ERROR_WARN_FRACTION of the set's reward calls failed, else None."""
    total = len(result.samples)
    if not total or result.reward_errors <= ERROR_WARN_FRACTION * total:
        return None
    failed = next(s for s in result.samples if safe_reward(eval_set.reward_fn, *_text_and_label(s))[1])
    text, label = _text_and_label(failed)
    return (f"WARNING: {name}: {result.reward_errors} of {total} reward calls failed "
            f"({result.reward_errors / total:.0%}), so its pass@k measures the setup, not the model. Reward "
            f"{eval_set.reward!r} on label {_clip(label)}: {_failure(eval_set.reward_fn, text, label)}. Give the set "
            f"the reward its labels are written for, --eval-data {name}:RM PATH with RM one of "
            f"{', '.join(BUILTIN_REWARDS)} or module:function (a set lockstep does not know by name or path gets "
            f"--rm-type), or check --label-key.")
