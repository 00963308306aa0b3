"""Prompt -> token ids: the one rule the server, the rollout and SFT all use.

A prompt is a string or a list of chat messages (`[{"role": "user", "content": "..."}]`).

    string,   chat_template=True and the tokenizer has one  -> template([user: string]) + generation prompt
    string,   otherwise                                     -> tokenizer.encode(string)
    messages, the tokenizer has a chat template              -> template(messages) + generation prompt
    messages, no chat template                               -> ValueError (there is no faithful way to
                                                                flatten roles into text; say so)

Messages always go through the template, whatever `chat_template` says: it only decides whether a
plain string is wrapped as one user turn. So a prompt file row and an HTTP request carrying the
same prompt give the same token ids.
"""

from __future__ import annotations


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer, prompt, chat_template: bool = True) -> list[int]:
    """Token ids of `prompt` (a string or a list of chat messages); see the module docstring."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer")
    if isinstance(prompt, str) and not (chat_template and has_chat_template(tokenizer)):
        return list(tokenizer.encode(prompt))
    if not isinstance(prompt, (str, list)):
        raise ValueError(f"a prompt is a string or a list of chat messages, got {type(prompt).__name__}")
    if not has_chat_template(tokenizer):
        raise ValueError("chat messages need a chat template, and this tokenizer has none; send a plain string")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)
