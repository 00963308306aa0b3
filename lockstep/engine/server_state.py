"""What the HTTP server's endpoints share (server.py): the engine and the limits, the checks of a
request's prompts and sampling that answer 400 naming the field, the text of tokens for logprobs, and
the generation requests in flight (counted against --max-queued-requests, aborted when the client
goes). The streamed answers' engine loop is streaming.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections import Counter

from fastapi import Request

from lockstep.config import SamplingParams
from lockstep.engine.api_errors import APIError
from lockstep.engine.engine import Engine
from lockstep.engine.limits import ServerLimits
from lockstep.engine.request import GenerateRequest

_SAMPLING_FIELD = re.compile(r"^SamplingParams\.(\w+):")


async def _client_gone(request: Request) -> None:
    """Returns once the client has closed the connection: with the body read, the next ASGI
    message is `http.disconnect` (sent when the client goes, or after the response)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ServerState:
    """What the endpoints share: the engine, the limits, prompt checks, and the requests in flight."""

    def __init__(self, engine: Engine, model_name: str, limits: ServerLimits):
        self.engine, self.model_name, self.limits = engine, model_name, limits
        self.active: Counter[str] = Counter()  # rid -> requests holding it (a duplicate rid is refused later)
        self.in_flight = 0  # generation requests between admission and answer

    def check_vocabulary(self, ids: list[int], field: str) -> list[int]:
        vocab = self.engine.model.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"{field}: token id {bad} is outside the vocabulary [0, {vocab})", field)
        return ids

    def check_ids(self, ids: list[int], field: str) -> list[int]:
        """A prompt the engine can take: not empty, in the vocabulary, room left for a new token."""
        if not ids:
            raise APIError(400, f"{field}: the prompt is empty", field)
        self.check_vocabulary(ids, field)
        if len(ids) >= self.engine.max_model_len:
            raise APIError(400, f"{field}: the prompt has {len(ids)} tokens; it must be shorter than max_model_len="
                                f"{self.engine.max_model_len} to leave room for a new token", field)
        return ids

    async def encode(self, prompt, field: str, chat: bool) -> list[int]:
        """Token ids of a text prompt that the engine can take (check_ids)."""
        return self.check_ids(await self.tokenize(prompt, field, chat), field)

    async def tokenize(self, prompt, field: str, chat: bool) -> list[int]:
        """Token ids of a text prompt (chat: messages through the chat template), tokenised in a worker
        thread: a long text must not hold the event loop (a 5M-character body held it, /health too, for 3 s)."""
        if self.engine.tokenizer is None:
            raise APIError(400, f"{field}: this model has no tokenizer; send token ids", field)
        try:
            return await asyncio.to_thread(self.engine.tokenize_prompt, prompt, chat)
        except ValueError as e:
            raise APIError(400, f"{field}: {e}", field) from e

    def check_n(self, n: int, field: str) -> None:
        if n > self.limits.max_n:
            raise APIError(400, f"{field}: {n} samples asked for; this server allows at most {self.limits.max_n} "
                                "per request (--max-n)", field)

    def check_work(self, prompts: list[list[int]], n: int, field: str) -> None:
        tokens = sum(map(len, prompts)) * n
        if tokens > self.limits.max_request_tokens:
            raise APIError(400, f"{field}: prompt tokens x n = {tokens}; this server allows at most "
                                f"{self.limits.max_request_tokens} per request (--max-request-tokens)", field)

    def max_new_tokens(self, asked: int | None, ids: list[int], field: str, default: int | None = None) -> int:
        """The completion length for a prompt. Asked for: it must fit max_model_len with the prompt
        (400 in OpenAI's words otherwise; silently cutting it short looked like a real "length"
        finish). Not asked for: `default`, or all the room left, capped by the room left."""
        room = self.engine.max_model_len - len(ids)
        if asked is None:
            return room if default is None else min(default, room)
        if asked > room:  # (below 1, SamplingParams names the field)
            total = self.engine.max_model_len
            raise APIError(400, f"{field}: this model's maximum context length is {total} tokens; the prompt has "
                                f"{len(ids)} tokens and {field} asks for {asked} more ({len(ids) + asked} in all). "
                                f"Ask for at most {room}, or shorten the prompt.", field)
        return asked

    def sampling(self, names: dict[str, str], **kw) -> SamplingParams:
        """SamplingParams, with its ValueError turned into a 400 under the request's own field names."""
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            m = _SAMPLING_FIELD.match(str(e))
            field = names.get(m.group(1), m.group(1)) if m else None
            msg = f"{field}:{str(e)[m.end():]}" if m else str(e)
            raise APIError(400, msg, field) from e

    def pieces(self, ids: list[int]) -> list[str]:
        """Each token's own text (special tokens included), for logprobs."""
        tok = self.engine.tokenizer
        if tok is None:
            return [f"token_id:{t}" for t in ids]
        return [tok.decode([t], skip_special_tokens=False) for t in ids]

    @property
    def decode(self):
        """The engine's decode of a response (special tokens skipped), None without a tokenizer."""
        return self.engine.decode if self.engine.tokenizer is not None else None

    def text(self, ids: list[int]) -> str:
        """Token ids as text, special tokens kept ("" without a tokenizer): an echoed prompt, /detokenize."""
        tok = self.engine.tokenizer
        return "" if tok is None else tok.decode(ids, skip_special_tokens=False)

    def named_alternatives(self, alternatives) -> list[list[tuple[str, float]]] | None:
        """Each position's (token id, logprob) alternatives as (text, logprob); None stays None."""
        if alternatives is None:
            return None
        return [list(zip(self.pieces([t for t, _ in alts]), [lp for _, lp in alts])) for alts in alternatives]

    async def echoed(self, given, ids: list[int], sampling: SamplingParams, logprobs: bool) -> dict:
        """What `echo` puts before a completion: the prompt's text (as given, or its ids decoded)
        and, with logprobs, its tokens' (the first has none: nothing comes before it)."""
        text = given if isinstance(given, str) else self.text(ids)
        out = {"text": text, "pieces": [], "logprobs": [], "alternatives": None}
        if logprobs:
            lps, alts = await asyncio.to_thread(self.engine.prompt_logprobs, ids, sampling)
            out.update(pieces=self.pieces(ids), logprobs=[None] + lps,
                       alternatives=None if alts is None else [None] + self.named_alternatives(alts))
        return out

    def refuse_when_full(self) -> None:
        full = self.overloaded()
        if full:
            raise APIError(429, full)

    @contextlib.contextmanager
    def admitted(self, rids: list[str]):
        """A generation request in flight while the block runs (counted against --max-queued-requests;
        its rids are what /abort_request's abort_all reports)."""
        self.active.update(rids)
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            self.active.subtract(rids)
            self.active = +self.active  # drop the zeros

    def overloaded(self) -> str | None:
        if self.in_flight >= self.limits.max_queued_requests:
            return (f"the server is full: {self.in_flight} requests in flight, at most "
                    f"{self.limits.max_queued_requests} (--max-queued-requests); retry shortly")
        return None

    def health_problem(self) -> str | None:
        """Why the server cannot take work now (/health answers 503), or None."""
        stalled = self.engine.stalled_for()
        if stalled > self.limits.stall_seconds:
            return (f"the engine has finished no step for {stalled:.0f} s while requests wait "
                    f"(--stall-seconds {self.limits.stall_seconds:g})")
        return self.overloaded()

    async def run(self, request: Request, prompts: list[list[int]], params: list[SamplingParams], rids: list[str]):
        """Every prompt through the engine at once; samples per prompt. A failure aborts the rest,
        and so does the client closing its connection (nobody would read the answer)."""
        self.refuse_when_full()
        reqs = [GenerateRequest(p, sp, request_id=r) for p, sp, r in zip(prompts, params, rids)]
        with self.admitted(rids):
            tasks = [asyncio.ensure_future(self.engine.generate_async(r)) for r in reqs]
            work, gone = asyncio.gather(*tasks), asyncio.ensure_future(_client_gone(request))
            try:
                await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
                client_left = not work.done()
                if client_left or work.exception() is not None:  # the rest of the answer is not wanted
                    for rid, t in zip(rids, tasks):
                        if not t.done():
                            self.engine.abort(rid)
                    await asyncio.wait(tasks)
                if client_left:
                    raise APIError(499, "the client closed the connection; its request was aborted")
                return work.result()  # raises the first failure
            except ValueError as e:  # the engine's checks (e.g. a rid already running)
                raise APIError(400, str(e)) from e
            except asyncio.CancelledError:  # shutdown past its grace period: generate_async aborts on cancel
                for t in tasks:
                    t.cancel()
                raise
            finally:
                gone.cancel()
