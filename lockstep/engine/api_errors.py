"""How the HTTP server answers errors: OpenAI's shape everywhere, as its OpenAPI schema documents.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "n", "code": 400}}

`APIError` is what routes raise; `install_error_handlers` turns it, pydantic's validation errors
(400, not FastAPI's 422), Starlette's 404 / 405 / 413 and any other exception (500, traceback to the
log only, the connection kept open: `InternalErrors`) into that shape; `BodyLimit` answers 413 before
a large body is read; `responses` and `document_errors` make the schema list exactly these answers.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from lockstep.engine.protocol import ErrorOut, error_body

log = logging.getLogger("lockstep.server")

# HTTP status -> OpenAI's error `type`
_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
          429: "rate_limit_error", 499: "client_closed_request", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or _KINDS.get(status, "invalid_request_error")


_TYPE_TAG = re.compile(r"^(str|int|float|bool|dict|list|none)$|\[")


def _validation_error(errors) -> tuple[str, str | None]:
    """pydantic errors -> one message naming the fields (union member tags left out) and the first field."""
    parts, first = [], None
    for e in errors:
        if e.get("type") == "json_invalid":
            return f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}", None
        loc = [str(x) for x in e.get("loc", ()) if x != "body" and not _TYPE_TAG.search(str(x))]
        field = ".".join(loc) or "body"
        first = first or field
        part = f"{field}: {e.get('msg')}"
        if part not in parts:
            parts.append(part)
    return "; ".join(parts[:4]), first


def responses(*codes: int) -> dict:
    """The error answers a route documents (OpenAPI), all in OpenAI's shape."""
    return {code: {"model": ErrorOut, "description": _KINDS.get(code, "error")} for code in codes}


def document_errors(app: FastAPI) -> None:
    """FastAPI documents 422 for a body that fails validation; this server answers 400 (OpenAI's
    code) in OpenAI's shape, which each route documents itself (`responses`). The schema says what is sent."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            for ops in schema["paths"].values():
                for op in ops.values():
                    op.get("responses", {}).pop("422", None)
            for unused in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(unused, None)
        return app.openapi_schema

    app.openapi = openapi


# A client sends its whole body before it reads the answer, and a server that closes with body bytes
# still unread resets the connection (TCP RST): the client can lose the 413 with it ("connection reset
# by peer", tests/engine/test_server_limits.py on a loaded CI machine). So up to this many bytes past
# the limit are read and dropped before the answer, as Go's net/http does (256 KiB); a longer body is
# answered at once with "Connection: close" (reading it all would be the cost the limit exists to avoid).
DRAIN_BYTES = 256 * 1024


async def _drain(receive, budget: int) -> bool:
    """Reads and drops the rest of the request body, at most `budget` bytes; True if it all came."""
    while budget >= 0:
        message = await receive()
        if message["type"] != "http.request":
            return False  # the client went away
        budget -= len(message.get("body", b""))
        if not message.get("more_body", False):
            return budget >= 0
    return False


def _closing(drained: bool) -> dict | None:
    return None if drained else {"Connection": "close"}  # the unread body makes the connection unusable


class BodyLimit:
    """ASGI middleware: 413 for a body over max_bytes, from its Content-Length before any of it is
    kept, or as soon as a body sent without one (chunked) passes the limit."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self) -> str:
        return f"body: the request body is larger than {self.max_bytes} bytes (--max-request-bytes)"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            drained = int(declared) <= self.max_bytes + DRAIN_BYTES and await _drain(receive, int(declared))
            response = JSONResponse(error_body(self._too_large(), param="body", code=413), 413, _closing(drained))
            return await response(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:  # an HTTPException: the error handlers answer it (FastAPI re-raises it)
                drained = not message.get("more_body", False) or await _drain(receive, DRAIN_BYTES)
                raise HTTPException(413, self._too_large(), _closing(drained))
            return message

        await self.app(scope, counted, send)


def _internal_error() -> JSONResponse:
    return JSONResponse(error_body("internal server error; the server log has the details", code=500,
                                   kind="internal_error"), 500)


class InternalErrors:
    """A route's unexpected exception answered as a 500 here, logged, and not raised further. Starlette's
    own handler for `Exception` answers and then re-raises (so that the server logs it), and uvicorn
    then closes the connection: a keep-alive client whose next request went out on it read
    "connection reset by peer" (tests/engine/test_server_limits.py, once, on a loaded CI machine). An
    exception after the answer has started still propagates: closing is the only way to tell the
    client that it is incomplete."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            if started:
                raise
            log.exception("internal error answering %s %s", scope.get("method"), scope.get("path"))
            await _internal_error()(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    app.add_middleware(InternalErrors)

    @app.exception_handler(APIError)
    async def api_error(_request, e: APIError):
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        if e.status == 429:
            headers = {"Retry-After": "1"}
        return JSONResponse(error_body(e.message, param=e.param, code=e.status, kind=e.kind), e.status, headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, e: RequestValidationError):
        message, param = _validation_error(e.errors())
        return JSONResponse(error_body(message, param=param), 400)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):  # 404, 405, 413 from the body limit: OpenAI's shape too
        message = e.detail if e.status_code == 413 else f"{request.method} {request.url.path}: {e.detail}"
        param = "body" if e.status_code == 413 else None
        return JSONResponse(error_body(message, param=param, code=e.status_code,
                                       kind=_KINDS.get(e.status_code, "invalid_request_error")),
                            e.status_code, e.headers)

    @app.exception_handler(Exception)
    async def internal(request, e: Exception):  # what InternalErrors does not see: a middleware's own failure
        # the traceback goes to the server's log, not to the client (no internals in answers)
        log.exception("internal error answering %s %s", request.method, request.url.path)
        return _internal_error()
