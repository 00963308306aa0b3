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
SGLang's /generate streams the same text another way (server.native_stream): each event is a
sample's output so far (text, ids, logprobs), the last its whole answer.
"""

from __future__ import annotations

import json

from lockstep.engine.protocol import chat_logprobs, chunk_choice, completion_logprobs
from lockstep.engine.request import TokensAdded

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
