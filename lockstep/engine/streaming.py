"""Streamed answers (`stream: true`): OpenAI's server-sent events, text sent as tokens are sampled.

Each choice's text is decoded whole after every token batch the engine hands over (one token, or a
multi-step window's several) and what is new is sent, holding back two kinds of tail:
- an unfinished UTF-8 character (the decode ends in U+FFFD until its last byte's token comes);
- the start of a stop string ("\\n\\nQ" while "\\n\\nQuestion:" is a stop), and anything from a whole
  stop string on: the answer ends before it, as the non-streamed text does (output.StopChecker).
When the request ends, the rest of the final text (the non-streamed answer's) follows with the
finish reason, so the concatenated deltas equal the non-streamed text. Where the request asks for
logprobs, each batch of tokens is one chunk carrying their logprobs (and alternatives), with whatever
text can be sent (possibly none): the chunks' logprobs, joined, are the non-streamed answer's.

Events: `data: {chunk}` per delta, then a chunk with each choice's finish_reason, then, where
`stream_options.include_usage`, one with the usage and no choices, then `data: [DONE]`. A failure
after the first event is sent as a last `data: {"error": ...}` event (the status is already 200).
SGLang's /generate streams the same text another way (`native_stream`): each event is a sample's
output so far (text, ids, logprobs), the last its whole answer. Both read the engine through
`token_events`, one generator per answer.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import StreamingResponse

from lockstep.config import SamplingParams
from lockstep.engine.api_errors import log
from lockstep.engine.protocol import (chat_logprobs, chunk_choice, completion_logprobs, error_body, native_logprobs,
                                      native_output, new_id, stream_chunk, usage)
from lockstep.engine.request import GenerateRequest, TokensAdded

if TYPE_CHECKING:
    from lockstep.engine.server_state import ServerState

UNFINISHED_CHARACTER = "\ufffd"


def sendable_end(text: str, stops: tuple[str, ...]) -> int:
    """How much of `text` may be sent now: up to an unfinished character, a whole stop string or the
    start of one at the end."""
    end = len(text)
    while end and text[end - 1] == UNFINISHED_CHARACTER:
        end -= 1
    for stop in stops:
        at = text.find(stop)
        if at >= 0:
            end = min(end, at)
        for k in range(min(len(stop) - 1, len(text)), 0, -1):  # the longest stop prefix ending the text
            if text.endswith(stop[:k]):
                end = min(end, len(text) - k)
                break
    return end


class TextStream:
    """One choice's text deltas: `add` the sampled ids as they come, `finish` with the final text."""

    def __init__(self, decode, stops: tuple[str, ...]):
        self.decode, self.stops = decode, stops
        self.ids: list[int] = []
        self.text = ""  # what has been sent

    def add(self, ids: list[int]) -> str:
        self.ids += ids
        if self.decode is None:  # no tokenizer: the text is empty
            return ""
        text = self.decode(self.ids)
        end = sendable_end(text, self.stops)
        delta = text[len(self.text):end] if end > len(self.text) else ""
        self.text += delta
        return delta

    def finish(self, final_text: str) -> str:
        delta = final_text[len(self.text):]
        self.text = final_text
        return delta


def event(payload: dict | str) -> str:
    """One server-sent event."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


DONE = event("[DONE]")


class StreamedChoices:
    """Every choice's stream of one answer: `tokens` turns a batch of sampled tokens into a choice
    of a chunk (None: nothing to send yet), `finish` a finished sample into its last one.
    pieces(ids) -> each token's own text; named(alternatives) -> (text, logprob) pairs."""

    def __init__(self, decode, pieces, named, stops: list[tuple[str, ...]], chat: bool, logprobs: bool):
        self.texts = [TextStream(decode, s) for s in stops]
        self.pieces, self.named, self.chat, self.logprobs = pieces, named, chat, logprobs
        self.offsets = [0] * len(stops)  # completions' text_offset of each choice's next token

    def tokens(self, i: int, added: TokensAdded) -> dict | None:
        delta = self.texts[i].add(added.ids)
        lp = None
        if self.logprobs:
            pieces = self.pieces(added.ids)
            alternatives = self.named(added.alternatives)
            lp = (chat_logprobs(pieces, added.logprobs, alternatives) if self.chat else
                  completion_logprobs(pieces, added.logprobs, alternatives, start=self.offsets[i]))
            self.offsets[i] += sum(map(len, pieces))
        elif not delta:
            return None
        return chunk_choice(i, delta, None, self.chat, logprobs=lp)

    def finish(self, i: int, sample) -> dict:
        return chunk_choice(i, self.texts[i].finish(sample.metadata.get("text", "")), sample.finish_reason, self.chat)


async def token_events(state: "ServerState", prompts: list[list[int]], params: list[SamplingParams], rids: list[str]):
    """Every prompt through the engine at once, as it goes: ("tokens", choice index, TokensAdded) as
    tokens are sampled (choice index = prompt * n + sample), ("done", prompt index, its samples) as a
    request ends (after its tokens). Closing the generator (the client left, a failure) aborts what
    still runs."""
    n = params[0].n
    queue: asyncio.Queue = asyncio.Queue()
    with state.admitted(rids):
        tasks = {asyncio.ensure_future(state.engine.generate_async(
            GenerateRequest(p, sp, request_id=r), on_tokens=lambda i, got, k=k: queue.put_nowait((k * n + i, got))
        )): k for k, (p, sp, r) in enumerate(zip(prompts, params, rids))}
        try:
            pending = set(tasks)
            while pending or not queue.empty():
                getter = asyncio.ensure_future(queue.get())
                done, pending = await asyncio.wait(pending | {getter}, return_when=asyncio.FIRST_COMPLETED)
                pending.discard(getter)
                if getter in done:
                    yield ("tokens", *getter.result())
                else:
                    getter.cancel()
                ended = done - {getter}
                while ended and not queue.empty():  # a request ended: its tokens were queued before its samples
                    yield ("tokens", *queue.get_nowait())
                for t in ended:
                    yield "done", tasks[t], t.result()  # raises the engine's error
        finally:
            for t in tasks:
                t.cancel()  # generate_async aborts its request when cancelled


def event_stream(state: "ServerState", request: Request, events) -> StreamingResponse:
    """Server-sent events; a failure after the first (the status, 200, is sent) is the last event."""
    state.refuse_when_full()

    async def guarded():
        try:
            async for e in events:
                yield e
        except ValueError as e:  # the engine's checks
            yield event(error_body(str(e)))
        except Exception:
            log.exception("internal error streaming %s", request.url.path)
            yield event(error_body("internal error; see the server log", code=500, kind="internal_error"))

    return StreamingResponse(guarded(), media_type="text/event-stream")


def openai_stream(state: "ServerState", request: Request, prompts: list[list[int]], params: list[SamplingParams],
                  rids: list[str], chat: bool, include_usage: bool, logprobs: bool) -> StreamingResponse:
    """An OpenAI answer as server-sent events, choice index = prompt * n + sample."""
    cid, created = new_id("chatcmpl" if chat else "cmpl"), int(time.time())
    n = params[0].n
    streams = StreamedChoices(state.decode, state.pieces, state.named_alternatives,
                              [sp.stop for sp in params for _ in range(sp.n)], chat, logprobs)

    def chunk(choices: list[dict], use: dict | None = None) -> str:
        return event(stream_chunk(cid, created, state.model_name, chat, choices, use))

    async def events():
        samples: list = [None] * len(prompts)
        if chat:
            yield chunk([chunk_choice(i, "", None, chat, role=True) for i in range(len(prompts) * n)])
        async for kind, i, got in token_events(state, prompts, params, rids):
            if kind == "tokens":
                choice = streams.tokens(i, got)
                if choice is not None:
                    yield chunk([choice])
            else:
                samples[i] = got
                yield chunk([streams.finish(i * n + j, s) for j, s in enumerate(got)])
        if include_usage:
            yield chunk([], usage([len(p) for p in prompts], [s for group in samples for s in group]))
        yield DONE

    return event_stream(state, request, events())


def native_stream(state: "ServerState", request: Request, prompts: list[list[int]], sp: SamplingParams,
                  rids: list[str], return_logprob: bool, return_routed_experts: bool) -> StreamingResponse:
    """SGLang's /generate with stream: for each token batch of a sample an event with its output so far
    (text, output_ids, and with return_logprob output_token_logprobs; finish_reason null), then its
    whole answer as /generate gives it; `index` = prompt * n + sample."""
    n = sp.n
    texts = [TextStream(state.decode, sp.stop) for _ in range(len(prompts) * n)]
    ids, logprobs = [[] for _ in texts], [[] for _ in texts]

    def so_far(i: int) -> dict:
        meta = {"id": rids[i // n], "finish_reason": None, "prompt_tokens": len(prompts[i // n]),
                "completion_tokens": len(ids[i])}
        if return_logprob:
            meta["output_token_logprobs"] = native_logprobs(logprobs[i], ids[i])
        return {"text": texts[i].text, "output_ids": ids[i], "meta_info": meta, "index": i}

    async def events():
        async for kind, i, got in token_events(state, prompts, [sp] * len(prompts), rids):
            if kind == "tokens":
                texts[i].add(got.ids)
                ids[i] += got.ids
                logprobs[i] += got.logprobs
                yield event(so_far(i))
            else:
                for j, s in enumerate(got):
                    out = native_output(s, rids[i], return_logprob, return_routed_experts)
                    yield event({**out, "index": i * n + j})
        yield DONE

    return event_stream(state, request, events())
