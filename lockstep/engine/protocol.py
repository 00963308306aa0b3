"""Request bodies of the HTTP server (pydantic) and the JSON shapes of its answers.

OpenAI-compatible bodies (`CompletionIn`, `ChatCompletionIn`) ignore fields they do not know
(clients send `user`, `metadata`, ...) but refuse the known ones this server cannot honour
(penalties, `logit_bias`, `tools` / `functions`, JSON `response_format`, audio, image parts of a
message, `best_of` != n) instead of silently dropping them. Native bodies (`GenerateIn`, SGLang's
`/generate`) refuse every unknown field.

Logprobs everywhere are the engine's rollout logprobs (lockstep.config.SamplingParams): the
log-probability of the sampled token under softmax(logits / temperature) over the full
vocabulary, before top-p / top-k; temperature 0 (greedy) reports temperature-1 logprobs.
"""

from __future__ import annotations

import time
import uuid

from pydantic import BaseModel, ConfigDict, Field

from lockstep.config import MAX_TOP_LOGPROBS
from lockstep.sample import Sample

Stop = str | list[str] | None


# strict: a value of the wrong JSON type is a 400, as the OpenAPI schema says (lax pydantic read
# `false` as token id 0 and "3" as n = 3); integers are still accepted where a float is expected
class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _OpenAISampling(_Lenient):
    model: str | None = None
    temperature: float | None = None  # None: 1.0, as OpenAI
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM / SGLang name); -1 or None: off
    n: int = 1
    seed: int | None = None
    stop: Stop = None
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool = False  # extension
    stream: bool = False
    stream_options: dict | None = None  # {"include_usage": bool}: a last chunk with the usage
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> list[str]:
        """Known OpenAI fields set to something this server does not implement."""
        bad = [f for f in ("presence_penalty", "frequency_penalty") if getattr(self, f)]
        if self.logit_bias:
            bad.append("logit_bias")
        return bad

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionIn(_OpenAISampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default
    # the sampled token's logprob per token, and the `logprobs` most likely tokens' at each position
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        bad += ["suffix"] if self.suffix else []
        bad += ["best_of"] if self.best_of not in (None, self.n) else []
        return bad


class ChatMessage(_Lenient):
    role: str
    content: str | list[dict] | None = None

    def has_other_parts(self) -> bool:
        """Content parts other than text (images, audio, files): this server reads text only."""
        return isinstance(self.content, list) and any(p.get("type", "text") != "text" for p in self.content)

    def text(self) -> str:
        """Content as one string: the text parts of a list of parts, joined."""
        if isinstance(self.content, list):
            return "".join(str(p.get("text", "")) for p in self.content if p.get("type", "text") == "text")
        return self.content or ""


def non_text_parts(messages: list[ChatMessage]) -> list[str]:
    """The fields of messages holding parts other than text (this server reads text only)."""
    return [f"messages.{i}.content" for i, m in enumerate(messages) if m.has_other_parts()]


class ChatCompletionIn(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to max_model_len
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # needs logprobs: true
    tools: list[dict] | None = None
    functions: list[dict] | None = None  # the older name of tools
    response_format: dict | None = None  # {"type": "text"} only: no JSON mode
    modalities: list[str] | None = None  # ["text"] only
    audio: dict | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        bad += [f for f in ("tools", "functions", "audio") if getattr(self, f)]
        bad += ["response_format"] if (self.response_format or {}).get("type", "text") != "text" else []
        bad += ["modalities"] if set(self.modalities or ()) - {"text"} else []
        # an image or audio part would be dropped from the prompt without a word: refused instead
        return bad + non_text_parts(self.messages)


class TokenizeIn(_Lenient):
    """vLLM's /tokenize: a text prompt, or chat messages through the chat template."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = None


class DetokenizeIn(_Lenient):
    tokens: list[int]


class NativeSamplingIn(_Strict):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop: Stop = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = 1
    ignore_eos: bool = False


class GenerateIn(_Strict):
    """SGLang's /generate: one prompt (or a batch: a list of them), token ids or text."""

    input_ids: list[int] | list[list[int]] | None = None
    text: str | list[str] | None = None
    sampling_params: NativeSamplingIn = Field(default_factory=NativeSamplingIn)
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)  # with return_logprob
    return_routed_experts: bool = False
    rid: str | list[str] | None = None
    stream: bool = False


class UpdateWeightsFromDiskIn(_Lenient):  # SGLang also sends load_format, flush_cache, ...
    model_path: str
    weight_version: int | None = None  # None: the current version + 1; otherwise above the current one
    partial: bool = False  # True: the checkpoint may hold only some of the model's tensors


class AbortIn(_Strict):
    rid: str | None = None
    abort_all: bool = False


# ---- answers ----------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorOut(BaseModel):
    """Every error answer (OpenAI's shape): the OpenAPI schema documents it per status code."""

    error: ErrorDetail


def error_body(message: str, *, param: str | None = None, code: int = 400, kind: str = "invalid_request_error"):
    """OpenAI's error object, used by every endpoint."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_lens: list[int], samples: list[Sample]) -> dict:
    """The prompt counts once per prompt (not per sample), as OpenAI counts it."""
    p, c = sum(prompt_lens), sum(s.response_len for s in samples)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def native_logprobs(logprobs: list[float], ids: list[int]) -> list[list]:
    """SGLang's (logprob, token_id, token_text) triples; the text is left null."""
    return [[lp, t, None] for lp, t in zip(logprobs, ids)]


def stop_strings(stop: Stop) -> list[str] | tuple:
    """A request's `stop` (a string, a list of them, or null) as SamplingParams takes it."""
    return [stop] if isinstance(stop, str) else (stop or ())


def chat_turns(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The messages as the chat template takes them: role and text."""
    return [{"role": m.role, "content": m.text()} for m in messages]


def native_output(sample: Sample, rid: str, return_logprob: bool, return_routed_experts: bool) -> dict:
    """One sample in SGLang's /generate shape."""
    ids = sample.response_ids.tolist()
    meta = {"id": rid, "finish_reason": {"type": sample.finish_reason},
            "prompt_tokens": sample.prompt_ids.numel(), "completion_tokens": len(ids),
            "weight_version": sample.weight_version}
    if return_logprob:
        meta["output_token_logprobs"] = native_logprobs(sample.rollout_logprobs.tolist(), ids)
        if sample.top_logprobs is not None:
            meta["output_top_logprobs"] = [native_logprobs([lp for _, lp in alts], [t for t, _ in alts])
                                           for alts in sample.top_logprobs]
    if return_routed_experts:  # [R][n_moe_layers][top_k]; null when the model records no routing
        re = sample.routed_experts
        meta["routed_experts"] = None if re is None else re.tolist()
    return {"text": sample.metadata.get("text"), "output_ids": ids, "meta_info": meta}


def completion_logprobs(pieces: list[str], logprobs: list[float | None],
                        top: list[list[tuple[str, float]] | None] | None, start: int = 0) -> dict:
    """OpenAI's legacy completions logprobs object; `text_offset` counts from the completion's start
    (`start`: where the first piece is, for a streamed chunk). top: each position's alternatives as
    (text, logprob), or None (`top_logprobs` is then null)."""
    offsets, pos = [], start
    for p in pieces:
        offsets.append(pos)
        pos += len(p)
    # texts that repeat keep one entry; an echoed prompt's first token has none (None)
    alternatives = None if top is None else [None if alts is None else dict(alts) for alts in top]
    return {"tokens": pieces, "token_logprobs": logprobs, "text_offset": offsets, "top_logprobs": alternatives}


def chat_logprobs(pieces: list[str], logprobs: list[float], top: list[list[tuple[str, float]]] | None) -> dict:
    def entry(p: str, lp: float) -> dict:
        return {"token": p, "logprob": lp, "bytes": list(p.encode("utf-8"))}

    alternatives = top if top is not None else [[] for _ in pieces]
    content = [{**entry(p, lp), "top_logprobs": [entry(*a) for a in alts]}
               for p, lp, alts in zip(pieces, logprobs, alternatives)]
    return {"content": content, "refusal": None}


def completion_response(model: str, choices: list[dict], use: dict, weight_version: int, chat: bool) -> dict:
    """`weight_version` is an extension field: the version that sampled the last token of the answer."""
    return {"id": new_id("chatcmpl" if chat else "cmpl"), "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices, "usage": use,
            "system_fingerprint": None, "weight_version": weight_version}


def stream_chunk(cid: str, created: int, model: str, chat: bool, choices: list[dict], use: dict | None = None) -> dict:
    """One streamed event's chunk (OpenAI's `chat.completion.chunk` / `text_completion` shape)."""
    out = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
           "model": model, "choices": choices, "system_fingerprint": None}
    if use is not None:
        out["usage"] = use
    return out


def chunk_choice(index: int, text: str | None, finish_reason: str | None, chat: bool, role: bool = False,
                 logprobs: dict | None = None) -> dict:
    """One choice of a chunk: chat's `delta` (the first of a choice names the role), or completions' text;
    `logprobs`: its tokens' (completion_logprobs / chat_logprobs of those tokens)."""
    if not chat:
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
    delta = {"role": "assistant"} if role else {}
    if text is not None:
        delta["content"] = text
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
