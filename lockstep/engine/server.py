"""The rollout engine over HTTP: a thin FastAPI layer over `Engine` (DESIGN.md, "The seams").

    app = create_app(engine, admin_token=None, weights_dir="/ckpts", require_admin=False)
    uvicorn.run(app, host="127.0.0.1", port=30000)          # or `lockstep serve`

Endpoints (names after SGLang; every answer is JSON, or server-sent events where a request asks for
`stream: true`, streaming.py). This file holds the routes; what they share (checks, limits, the
requests in flight) is server_state.py's:

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
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, Request

from lockstep.config import SamplingParams
from lockstep.engine.api_errors import APIError, BodyLimit, document_errors, install_error_handlers, responses
from lockstep.engine.engine import Engine
from lockstep.engine.limits import ServerLimits
from lockstep.engine.protocol import (AbortIn, ChatCompletionIn, CompletionIn, DetokenizeIn, GenerateIn, TokenizeIn,
                                      UpdateWeightsFromDiskIn, chat_logprobs, chat_turns, completion_logprobs,
                                      completion_response, native_output, non_text_parts, stop_strings, usage)
from lockstep.engine.server_state import ServerState
from lockstep.engine.streaming import native_stream, openai_stream
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


def _refuse(body) -> None:
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options: only with stream: true", "stream_options")
    bad = body.unsupported()
    if bad:
        _not_supported(bad[0])


def _not_supported(field: str):
    fix = "send text parts only" if field.startswith("messages.") else "leave it unset"
    raise APIError(400, f"{field}: not supported by this server ({fix})", field)


def _completion_choice(srv: ServerState, index: int, sample, echoed: dict | None, logprobs: bool) -> dict:
    """One /v1/completions choice: the echoed prompt (ServerState.echoed) where the request asked for echo,
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


def _openai_sampling(srv: ServerState, body, max_new_tokens: int, max_tokens_field="max_tokens",
                     top_logprobs: int = 0) -> SamplingParams:
    return srv.sampling(
        {"max_new_tokens": max_tokens_field}, top_logprobs=top_logprobs,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=-1 if body.top_k is None else body.top_k,
        n=body.n, seed=body.seed, max_new_tokens=max_new_tokens, ignore_eos=body.ignore_eos,
        stop=stop_strings(body.stop), stop_token_ids=body.stop_token_ids or ())


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
    srv = ServerState(engine, name, limits)

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
            return openai_stream(srv, request, prompts, params, rids, chat=False, include_usage=body.include_usage(),
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
        ids = await srv.encode(chat_turns(body.messages), "messages", chat=True)
        srv.check_work([ids], body.n, "messages")
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        sp = _openai_sampling(srv, body, srv.max_new_tokens(limit, ids, field), field,
                              top_logprobs=(body.top_logprobs or 0) if body.logprobs else 0)
        rids = [f"chatcmpl-{_uid()}"]
        if body.stream:
            return openai_stream(srv, request, [ids], [sp], rids, chat=True, include_usage=body.include_usage(),
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
                          stop=stop_strings(spi.stop),
                          stop_token_ids=spi.stop_token_ids or (), return_routed_experts=body.return_routed_experts,
                          top_logprobs=body.top_logprobs_num)
        if body.stream:
            return native_stream(srv, request, prompts, sp, rids, body.return_logprob, body.return_routed_experts)
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
            ids = await srv.tokenize(chat_turns(body.messages), "messages", chat=True)
        else:
            ids = await srv.tokenize(body.prompt, "prompt", chat=False)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize", responses=gen)
    async def detokenize(body: DetokenizeIn):
        if engine.tokenizer is None:
            raise APIError(400, "tokens: this model has no tokenizer", "tokens")
        return {"prompt": srv.text(srv.check_vocabulary(body.tokens, "tokens"))}

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
