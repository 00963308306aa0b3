"""The rollout engine over HTTP: a thin FastAPI layer over `Engine` (DESIGN.md, "The seams").

    app = create_app(engine, admin_token=None, weights_dir="/ckpts", require_admin=False)
    uvicorn.run(app, host="127.0.0.1", port=30000)          # or `lockstep serve`

Endpoints (names after SGLang; every answer is JSON, or server-sent events where the OpenAI ones ask
for `stream: true`, streaming.py):

    POST /v1/completions          OpenAI completions: prompt str | [ids] | [str] | [[ids]]; max_tokens (16),
                                  temperature, top_p, top_k*, n, seed, stop, stop_token_ids*, ignore_eos*,
                                  logprobs (int k <= 20: choices[i].logprobs = {tokens, token_logprobs,
                                  text_offset, top_logprobs: [{text: logprob}] of the k likeliest tokens a
                                  position, null for k = 0}), echo (the prompt's text first and, with
                                  logprobs, its tokens' too, the first null; max_tokens 0: the prompt
                                  alone, scored: scoring.py); choice index = prompt * n + sample
    POST /v1/chat/completions     OpenAI chat: messages through the tokenizer's chat template; max_tokens /
                                  max_completion_tokens (default: up to max_model_len), logprobs: bool,
                                  top_logprobs (k <= 20, needs logprobs) -> choices[i].logprobs.content =
                                  [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}] x k}]
    GET  /v1/models               the one served model
    POST /tokenize                {prompt | messages (through the chat template)} -> {tokens, count,
                                  max_model_len} (vLLM's; a prompt too long to serve is still counted)
    POST /detokenize              {tokens} -> {prompt} (special tokens kept)
    POST /generate                native: {input_ids | text, sampling_params: {temperature, top_p, top_k,
                                  max_new_tokens, stop, stop_token_ids, seed, n, ignore_eos}, return_logprob,
                                  top_logprobs_num (k <= 20, with return_logprob), return_routed_experts,
                                  rid} -> {text, output_ids, meta_info: {id, finish_reason: {type},
                                  prompt_tokens, completion_tokens, weight_version, output_token_logprobs:
                                  [[logprob, id, null]], output_top_logprobs: [[[logprob, id, null]] x k]
                                  (k > 0), routed_experts: [R][L][k]}};
                                  a list of those for a batch (list of prompts) or n > 1
    POST /update_weights_from_disk  {model_path, weight_version?, partial?} (admin; only under --weights-dir);
                                  every tensor of the model unless partial: true (400), the version above the
                                  serving one (409)
    POST /pause_generation        (admin) finish the current step, then hold; requests in flight stay
    POST /continue_generation     (admin)
    POST /flush_cache             (admin) 200 when flushed, 409 while requests run or wait
    POST /abort_request           (admin) {rid} or {abort_all: true}; aborted samples end with "abort"
    GET  /get_weight_version, GET /health
    (* extensions to OpenAI's schema; answers also carry `weight_version`)

finish_reason is "stop", "length" or "abort". Logprobs are the engine's rollout logprobs (see
protocol.py): one per sampled token, including tokens after a stop string that the text leaves out
and a final EOS. The alternatives (`top_logprobs`) are the most likely tokens under that same
distribution, most likely first (a request that asks for them decodes one step at a time, not in
multi-step windows); `text_offset` counts from the start of the completion. The request's `model` is
not checked (one model is served). `stream: true` streams the text (with
`stream_options.include_usage`, a last usage chunk; with logprobs, each chunk carries its tokens');
/generate streams SGLang's way (each event a sample's output so far, then its answer); a client that
closes its connection has its request aborted. Errors use OpenAI's shape `{"error": {"message",
"type", "param", "code"}}`, every one of them (404 and 405 too), with no internals (a 500 says to
read the server log): malformed JSON, missing or mistyped fields, prompts that do not fit
max_model_len, a max_tokens that does not fit with the prompt ("This model's maximum context length
is ..."), token ids outside the vocabulary and bad sampling values are 400 and name the field; the
server keeps serving everything else. The OpenAPI schema (/openapi.json) documents these codes (400,
not FastAPI's 422); api_errors.py holds that machinery.

Limits (`ServerLimits`, limits.py; each a `lockstep serve` flag): n per request, prompt tokens x n
per request (400), requests held at once (429, and /health 503), body bytes (413, checked before the
body is read). /health also answers 503 when the engine has had work and finished no step for
`stall_seconds`. Text is tokenised in a worker thread, so a long prompt never holds the event loop.

Security. State-changing endpoints (marked admin) need `Authorization: Bearer <admin_token>` when
`require_admin` (the server listens beyond loopback) or when an admin token is configured;
`require_admin` without a token refuses to build the app. Generation endpoints are open: keep a
server that listens beyond loopback behind a trusted network. `/update_weights_from_disk` resolves
`model_path` (relative paths are taken under `weights_dir`; symlinks and `..` are resolved) and
answers 403 when it leaves `weights_dir` or when no `weights_dir` was configured.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import re
import time
import uuid
from collections import Counter
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.responses import StreamingResponse

from lockstep.config import SamplingParams
from lockstep.engine.api_errors import APIError, BodyLimit, document_errors, install_error_handlers, log, responses
from lockstep.engine.engine import Engine
from lockstep.engine.limits import ServerLimits
from lockstep.engine.protocol import (AbortIn, ChatCompletionIn, CompletionIn, DetokenizeIn, GenerateIn, TokenizeIn,
                                      UpdateWeightsFromDiskIn, chat_logprobs, chunk_choice, completion_logprobs,
                                      completion_response, error_body, native_output, new_id, non_text_parts,
                                      stream_chunk, usage)
from lockstep.engine.request import GenerateRequest
from lockstep.engine.streaming import DONE, StreamedChoices, TextStream, event
from lockstep.engine.weight_update import WeightUpdateError, WeightVersionError


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost may resolve to anything
        return False


def resolve_weights_path(weights_dir: Path | None, model_path: str) -> Path:
    """model_path with symlinks and `..` resolved; 403 unless it lies inside weights_dir."""
    if weights_dir is None:
        raise APIError(403, "model_path: loading weights from disk is disabled; start the server with "
                            "--weights-dir DIR to allow checkpoints under DIR", "model_path")
    try:
        path = (weights_dir / model_path).resolve()  # an absolute model_path replaces weights_dir
    except (ValueError, OSError, RuntimeError) as e:  # a NUL byte, a symlink loop
        raise APIError(400, f"model_path: not a usable path ({e})", "model_path") from e
    if not path.is_relative_to(weights_dir):
        raise APIError(403, f"model_path: {model_path!r} resolves to {path}, outside the weights directory "
                            f"{weights_dir}", "model_path")
    return path


_SAMPLING_FIELD = re.compile(r"^SamplingParams\.(\w+):")



async def _client_gone(request: Request) -> None:
    """Returns once the client has closed the connection: with the body read, the next ASGI
    message is `http.disconnect` (sent when the client goes, or after the response)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Server:
    """What the endpoints share: the engine, the limits, prompt checks, and the requests in flight."""

    def __init__(self, engine: Engine, model_name: str, limits: ServerLimits):
        self.engine, self.model_name, self.limits = engine, model_name, limits
        self.active: Counter[str] = Counter()  # rid -> requests holding it (a duplicate rid is refused later)
        self.in_flight = 0  # generation requests between admission and answer

    def check_ids(self, ids: list[int], field: str) -> list[int]:
        if not ids:
            raise APIError(400, f"{field}: the prompt is empty", field)
        vocab = self.engine.model.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"{field}: token id {bad} is outside the vocabulary [0, {vocab})", field)
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

    def named_alternatives(self, alternatives) -> list[list[tuple[str, float]]] | None:
        """Each position's (token id, logprob) alternatives as (text, logprob); None stays None."""
        if alternatives is None:
            return None
        return [list(zip(self.pieces([t for t, _ in alts]), [lp for _, lp in alts])) for alts in alternatives]

    async def echoed(self, given, ids: list[int], sampling: SamplingParams, logprobs: bool) -> dict:
        """What `echo` puts before a completion: the prompt's text (as given, or its ids decoded)
        and, with logprobs, its tokens' (the first has none: nothing comes before it)."""
        text = given if isinstance(given, str) else "" if self.engine.tokenizer is None else (
            self.engine.tokenizer.decode(ids, skip_special_tokens=False))
        out = {"text": text, "pieces": [], "logprobs": [], "alternatives": None}
        if logprobs:
            lps, alts = await asyncio.to_thread(self.engine.prompt_logprobs, ids, sampling)
            out.update(pieces=self.pieces(ids), logprobs=[None] + lps,
                       alternatives=None if alts is None else [None] + self.named_alternatives(alts))
        return out

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

    async def token_events(self, prompts: list[list[int]], params: list[SamplingParams], rids: list[str]):
        """Every prompt through the engine at once, as it goes: ("tokens", choice index, TokensAdded) as
        tokens are sampled (choice index = prompt * n + sample), ("done", prompt index, its samples)
        as a request ends (after its tokens). Closing the generator (the client left, a failure)
        aborts what still runs."""
        n = params[0].n
        queue: asyncio.Queue = asyncio.Queue()
        self.active.update(rids)
        self.in_flight += 1
        tasks = {asyncio.ensure_future(self.engine.generate_async(
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
            self.in_flight -= 1
            self.active.subtract(rids)
            self.active = +self.active

    def event_stream(self, request: Request, events) -> StreamingResponse:
        """Server-sent events; a failure after the first (the status, 200, is sent) is the last event."""
        full = self.overloaded()
        if full:
            raise APIError(429, full)

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

    def stream(self, request: Request, prompts: list[list[int]], params: list[SamplingParams], rids: list[str],
               chat: bool, include_usage: bool, logprobs: bool) -> StreamingResponse:
        """An OpenAI answer as server-sent events (streaming.py), choice index = prompt * n + sample."""
        cid, created = new_id("chatcmpl" if chat else "cmpl"), int(time.time())
        n = params[0].n
        decode = self.engine.decode if self.engine.tokenizer is not None else None
        streams = StreamedChoices(decode, self.pieces, self.named_alternatives,
                                  [sp.stop for sp in params for _ in range(sp.n)], chat, logprobs)

        def chunk(choices: list[dict], use: dict | None = None) -> str:
            return event(stream_chunk(cid, created, self.model_name, chat, choices, use))

        async def events():
            samples: list = [None] * len(prompts)
            if chat:
                yield chunk([chunk_choice(i, "", None, chat, role=True) for i in range(len(prompts) * n)])
            async for kind, i, got in self.token_events(prompts, params, rids):
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

        return self.event_stream(request, events())

    def native_stream(self, request: Request, prompts: list[list[int]], sp: SamplingParams, rids: list[str],
                      return_logprob: bool, return_routed_experts: bool) -> StreamingResponse:
        """SGLang's /generate with stream: for each token batch of a sample an event with its output so
        far (text, output_ids, and with return_logprob output_token_logprobs; finish_reason null), then
        its whole answer as /generate gives it; `index` = prompt * n + sample."""
        n = sp.n
        decode = self.engine.decode if self.engine.tokenizer is not None else None
        texts = [TextStream(decode, sp.stop) for _ in range(len(prompts) * n)]
        ids, logprobs = [[] for _ in texts], [[] for _ in texts]

        def so_far(i: int) -> dict:
            meta = {"id": rids[i // n], "finish_reason": None, "prompt_tokens": len(prompts[i // n]),
                    "completion_tokens": len(ids[i])}
            if return_logprob:
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs[i], ids[i])]
            return {"text": texts[i].text, "output_ids": ids[i], "meta_info": meta, "index": i}

        async def events():
            async for kind, i, got in self.token_events(prompts, [sp] * len(prompts), rids):
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

        return self.event_stream(request, events())

    async def run(self, request: Request, prompts: list[list[int]], params: list[SamplingParams], rids: list[str]):
        """Every prompt through the engine at once; samples per prompt. A failure aborts the rest,
        and so does the client closing its connection (nobody would read the answer)."""
        full = self.overloaded()
        if full:
            raise APIError(429, full)
        reqs = [GenerateRequest(p, sp, request_id=r) for p, sp, r in zip(prompts, params, rids)]
        self.active.update(rids)
        self.in_flight += 1
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
            self.in_flight -= 1
            self.active.subtract(rids)
            self.active = +self.active  # drop the zeros


def _refuse(body) -> None:
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options: only with stream: true", "stream_options")
    bad = body.unsupported()
    if bad:
        _not_supported(bad[0])


def _not_supported(field: str):
    fix = "send text parts only" if field.startswith("messages.") else "leave it unset"
    raise APIError(400, f"{field}: not supported by this server ({fix})", field)


def _completion_choice(srv: _Server, index: int, sample, echoed: dict | None, logprobs: bool) -> dict:
    """One /v1/completions choice: the echoed prompt (_Server.echoed) where the request asked for echo,
    then the sample (None: nothing generated, echo with max_tokens 0)."""
    parts = [echoed] if echoed is not None else []
    if sample is not None:
        parts.append({"text": sample.metadata.get("text", ""), "pieces": srv.pieces(sample.response_ids.tolist()),
                      "logprobs": sample.rollout_logprobs.tolist(),
                      "alternatives": srv.named_alternatives(sample.top_logprobs)})
    lp = None
    if logprobs:
        alts = [p["alternatives"] for p in parts]
        lp = completion_logprobs(sum((p["pieces"] for p in parts), []), sum((p["logprobs"] for p in parts), []),
                                 None if any(a is None for a in alts) else sum(alts, []))
    return {"index": index, "text": "".join(p["text"] for p in parts), "logprobs": lp,
            "finish_reason": "length" if sample is None else sample.finish_reason}


def _openai_sampling(srv: _Server, body, max_new_tokens: int, max_tokens_field="max_tokens",
                     top_logprobs: int = 0) -> SamplingParams:
    return srv.sampling(
        {"max_new_tokens": max_tokens_field}, top_logprobs=top_logprobs,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=-1 if body.top_k is None else body.top_k,
        n=body.n, seed=body.seed, max_new_tokens=max_new_tokens, ignore_eos=body.ignore_eos,
        stop=[body.stop] if isinstance(body.stop, str) else (body.stop or ()), stop_token_ids=body.stop_token_ids or ())


def _admin_guard(admin_token: str | None, require_admin: bool):
    async def guard(request: Request) -> None:
        if admin_token is None and not require_admin:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {admin_token}".encode()):
            raise APIError(401, "this endpoint needs the header 'Authorization: Bearer <admin token>'",
                           None, "authentication_error")
    return guard


def create_app(engine: Engine, *, admin_token: str | None, weights_dir: str | None, require_admin: bool,
               model_name: str | None = None, limits: ServerLimits | None = None) -> FastAPI:
    """The FastAPI app; its lifespan starts the engine's background loop and shuts it down."""
    if require_admin and not admin_token:
        raise ValueError("refusing to serve beyond loopback without an admin token: pass --admin-token or set "
                         "LOCKSTEP_ADMIN_TOKEN (or bind 127.0.0.1)")
    root = None
    if weights_dir is not None:
        root = Path(weights_dir).resolve()
        if not root.is_dir():
            raise ValueError(f"--weights-dir {weights_dir}: not a directory")
    name = model_name or Path(getattr(engine.model, "source_dir", "lockstep")).name
    limits = limits or ServerLimits()
    srv = _Server(engine, name, limits)

    @asynccontextmanager
    async def lifespan(_app):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="lockstep", lifespan=lifespan)
    app.state.server = srv
    app.add_middleware(BodyLimit, max_bytes=limits.max_request_bytes)
    admin = [Depends(_admin_guard(admin_token, require_admin))]
    install_error_handlers(app)
    gen, adm = responses(400, 413, 429), responses(400, 401, 413)
    # stream: true answers server-sent events (streaming.py) beside the JSON answer
    event_schema = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
    streamed = {**gen, 200: {"content": {"text/event-stream": {"schema": event_schema}}}}  # per event

    @app.get("/health", responses=responses(503))
    async def health():
        problem = srv.health_problem()
        if problem is not None:
            raise APIError(503, problem)
        return {"status": "ok", "paused": engine.paused, "weight_version": engine.weight_version}

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": engine.weight_version}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                            "owned_by": "lockstep", "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions", responses=streamed)
    async def completions(body: CompletionIn, request: Request):
        _refuse(body)
        srv.check_n(body.n, "n")
        p = body.prompt
        if not p:
            raise APIError(400, "prompt: the prompt is empty", "prompt")
        given = [p] if isinstance(p, str) or isinstance(p[0], int) else p  # each prompt as the request gave it
        prompts = [await srv.encode(x, "prompt", False) if isinstance(x, str) else srv.check_ids(list(x), "prompt")
                   for x in given]
        srv.check_work(prompts, body.n, "prompt")
        if body.echo and body.stream:
            raise APIError(400, "echo: not with stream: true", "echo")
        score_only = body.echo and body.max_tokens == 0  # the prompt's logprobs, nothing generated
        default = None if "max_tokens" in body.model_fields_set else 16  # OpenAI's default, when it fits
        lengths = [1 if score_only else srv.max_new_tokens(body.max_tokens, ids, "max_tokens", default)
                   for ids in prompts]  # score_only: a length SamplingParams takes; nothing is generated
        params = [_openai_sampling(srv, body, m, top_logprobs=body.logprobs or 0) for m in lengths]
        rids = [f"cmpl-{i}-{_uid()}" for i in range(len(prompts))]
        if body.stream:
            return srv.stream(request, prompts, params, rids, chat=False, include_usage=body.include_usage(),
                              logprobs=body.logprobs is not None)
        results = [[None] * body.n for _ in prompts] if score_only else await srv.run(request, prompts, params, rids)
        choices, flat = [], [s for samples in results for s in samples if s is not None]
        for k, samples in enumerate(results):
            echoed = await srv.echoed(given[k], prompts[k], params[k], body.logprobs is not None) if body.echo else None
            for s in samples:
                choices.append(_completion_choice(srv, len(choices), s, echoed, body.logprobs is not None))
        version = max((s.weight_version for s in flat), default=engine.weight_version)
        return completion_response(name, choices, usage([len(x) for x in prompts], flat), version, chat=False)

    @app.post("/v1/chat/completions", responses=streamed)
    async def chat_completions(body: ChatCompletionIn, request: Request):
        _refuse(body)
        srv.check_n(body.n, "n")
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
        ids = await srv.encode([{"role": m.role, "content": m.text()} for m in body.messages], "messages", chat=True)
        srv.check_work([ids], body.n, "messages")
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        sp = _openai_sampling(srv, body, srv.max_new_tokens(limit, ids, field), field,
                              top_logprobs=(body.top_logprobs or 0) if body.logprobs else 0)
        rids = [f"chatcmpl-{_uid()}"]
        if body.stream:
            return srv.stream(request, [ids], [sp], rids, chat=True, include_usage=body.include_usage(),
                              logprobs=body.logprobs)
        (samples,) = await srv.run(request, [ids], [sp], rids)
        choices = [{"index": i, "message": {"role": "assistant", "content": s.metadata.get("text", "")},
                    "logprobs": chat_logprobs(srv.pieces(s.response_ids.tolist()), s.rollout_logprobs.tolist(),
                                              srv.named_alternatives(s.top_logprobs)) if body.logprobs else None,
                    "finish_reason": s.finish_reason} for i, s in enumerate(samples)]
        version = max(s.weight_version for s in samples)
        return completion_response(name, choices, usage([len(ids)], samples), version, chat=True)

    @app.post("/generate", responses=streamed)
    async def generate(body: GenerateIn, request: Request):
        if (body.input_ids is None) == (body.text is None):
            raise APIError(400, "input_ids: give exactly one of input_ids or text", "input_ids")
        spi = body.sampling_params
        srv.check_n(spi.n, "sampling_params.n")
        if body.top_logprobs_num and not body.return_logprob:
            raise APIError(400, "top_logprobs_num: needs return_logprob: true", "top_logprobs_num")
        field = "input_ids" if body.input_ids is not None else "text"
        if body.input_ids is not None:
            batch = bool(body.input_ids) and isinstance(body.input_ids[0], list)
            prompts = [srv.check_ids(list(x), "input_ids") for x in (body.input_ids if batch else [body.input_ids])]
        else:
            batch = isinstance(body.text, list)
            prompts = [await srv.encode(x, "text", chat=False) for x in (body.text if batch else [body.text])]
        if not prompts:
            raise APIError(400, f"{field}: the batch holds no prompt", field)
        srv.check_work(prompts, spi.n, field)
        rids = body.rid if isinstance(body.rid, list) else [body.rid] if body.rid is not None else None
        if rids is not None and len(rids) != len(prompts):
            raise APIError(400, f"rid: {len(rids)} ids for {len(prompts)} prompts", "rid")
        rids = rids or [_uid() for _ in prompts]
        names = {k: f"sampling_params.{k}" for k in type(spi).model_fields}
        asked = spi.max_new_tokens if "max_new_tokens" in spi.model_fields_set else None
        longest = max(prompts, key=len)  # one SamplingParams for the batch: the longest prompt bounds it
        max_new = srv.max_new_tokens(asked, longest, "sampling_params.max_new_tokens", spi.max_new_tokens)
        sp = srv.sampling(names, temperature=spi.temperature, top_p=spi.top_p, top_k=spi.top_k, seed=spi.seed,
                          max_new_tokens=max_new, n=spi.n, ignore_eos=spi.ignore_eos,
                          stop=[spi.stop] if isinstance(spi.stop, str) else (spi.stop or ()),
                          stop_token_ids=spi.stop_token_ids or (), return_routed_experts=body.return_routed_experts,
                          top_logprobs=body.top_logprobs_num)
        if body.stream:
            return srv.native_stream(request, prompts, sp, rids, body.return_logprob, body.return_routed_experts)
        results = await srv.run(request, prompts, [sp] * len(prompts), rids)
        outs = [native_output(s, rid, body.return_logprob, body.return_routed_experts)
                for rid, samples in zip(rids, results) for s in samples]
        return outs if batch or sp.n > 1 else outs[0]

    @app.post("/tokenize", responses=gen)
    async def tokenize(body: TokenizeIn):
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt: give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            for field in non_text_parts(body.messages)[:1]:
                _not_supported(field)
            ids = await srv.tokenize([{"role": m.role, "content": m.text()} for m in body.messages], "messages", True)
        else:
            ids = await srv.tokenize(body.prompt, "prompt", chat=False)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize", responses=gen)
    async def detokenize(body: DetokenizeIn):
        if engine.tokenizer is None:
            raise APIError(400, "tokens: this model has no tokenizer", "tokens")
        vocab = engine.model.config.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens: token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.post("/update_weights_from_disk", dependencies=admin, responses=responses(400, 401, 403, 409, 413))
    async def update_weights_from_disk(body: UpdateWeightsFromDiskIn):
        path = resolve_weights_path(root, body.model_path)
        try:
            await asyncio.to_thread(engine.update_weights_from_disk, path, body.weight_version, body.partial)
        except WeightVersionError as e:
            raise APIError(409, f"weight_version: {e}", "weight_version") from e
        except WeightUpdateError as e:
            raise APIError(400, f"model_path: {e}", "model_path") from e
        return {"success": True, "message": f"loaded weights from {path}", "weight_version": engine.weight_version}

    @app.post("/pause_generation", dependencies=admin, responses=responses(401, 413))
    async def pause_generation():
        await asyncio.to_thread(engine.pause)
        return {"success": True, "paused": True}

    @app.post("/continue_generation", dependencies=admin, responses=responses(401, 413))
    async def continue_generation():
        engine.resume()
        return {"success": True, "paused": False}

    @app.post("/flush_cache", dependencies=admin, responses=responses(401, 409, 413))
    async def flush_cache():
        if not await asyncio.to_thread(engine.flush_cache):
            raise APIError(409, "cache not flushed: requests are running or waiting; retry when idle")
        return {"success": True, "message": "cache flushed"}

    @app.post("/abort_request", dependencies=admin, responses=adm)
    async def abort_request(body: AbortIn):
        if body.abort_all:
            rids = sorted(srv.active)  # the requests this server has in flight
            engine.abort_all()  # the engine's every request, in one pass
            return {"success": True, "aborted": rids}
        if body.rid is None:
            raise APIError(400, "rid: give the request id to abort (or abort_all: true)", "rid")
        return {"success": True, "aborted": [body.rid] if engine.abort(body.rid) else []}

    document_errors(app)
    return app


def _uid() -> str:
    return uuid.uuid4().hex
