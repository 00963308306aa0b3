"""The HTTP server under load and abuse (issue 15): limits answered with 400 / 413 / 429 in OpenAI's
error shape, aborts on client disconnect, /health that reports a stalled or full server, no
event-loop stall while a prompt is tokenised, all-or-nothing weight pushes. A live uvicorn
server with small limits, the real `openai` client and httpx."""

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest
from openai import OpenAI

from lockstep.engine.limits import ServerLimits
from lockstep.engine.server import create_app

from test_server import MODEL, QUESTIONS, Served, new_engine

LIMITS = ServerLimits(max_n=4, max_request_tokens=400, max_queued_requests=2, max_request_bytes=20_000,
                      stall_seconds=1.0)
LONG = {"max_new_tokens": 200, "ignore_eos": True}  # about a second of decoding on the CPU


@pytest.fixture(scope="module")
def engine():
    return new_engine()


@pytest.fixture(scope="module")
def served(engine):
    s = Served(create_app(engine, admin_token=None, weights_dir=None, require_admin=False, limits=LIMITS))
    yield s
    s.stop()


def error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


def wait_until(condition, timeout=20.0):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


def idle(engine):
    return not engine._requests and not engine.scheduler.has_work()


@pytest.mark.parametrize("path,body,param", [
    ("/generate", {"input_ids": [5, 7], "sampling_params": {"n": 5}}, "sampling_params.n"),
    ("/v1/completions", {"prompt": [5, 7], "n": 5}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 1000000}, "n"),
])
def test_n_beyond_max_n_is_a_400(served, path, body, param):
    err = error(served.http.post(path, json=body), 400)
    assert err["param"] == param and "at most 4" in err["message"] and "--max-n" in err["message"]


def test_prompt_tokens_times_n_beyond_the_limit_is_a_400(served):
    err = error(served.http.post("/generate", json={"input_ids": [[7] * 60] * 2, "sampling_params": {"n": 4}}), 400)
    assert err["param"] == "input_ids" and "480" in err["message"] and "at most 400" in err["message"]
    err = error(served.http.post("/v1/completions", json={"prompt": [[5] * 101] * 4}), 400)
    assert "404" in err["message"] and "--max-request-tokens" in err["message"]
    assert served.http.post("/generate", json={"input_ids": [[7] * 50] * 2, "sampling_params": {
        "n": 4, "max_new_tokens": 1}}).status_code == 200


def test_max_tokens_beyond_the_context_is_a_400_not_a_silent_cut(served, engine):
    client = OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0)
    ids = [7] * 248  # max_model_len is 256: 8 tokens of room
    for asked in (100, 10**12):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="m", prompt=ids, max_tokens=asked)
        err = e.value.body
        assert err["param"] == "max_tokens" and "maximum context length is 256 tokens" in err["message"]
        assert "248" in err["message"] and "at most 8" in err["message"]
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1 + 1"}],
                                       max_completion_tokens=300)
    err = error(served.http.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 9}}), 400)
    assert err["param"] == "sampling_params.max_new_tokens"
    # what fits is served to the end; an unset limit takes the default, capped by the room left
    r = client.completions.create(model="m", prompt=ids, max_tokens=8, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    out = served.http.post("/generate", json={"input_ids": ids, "sampling_params": {"ignore_eos": True}}).json()
    assert out["meta_info"]["completion_tokens"] == 8


@pytest.mark.parametrize("sampling,param", [
    (b'"temperature": Infinity', "temperature"), (b'"temperature": 1e6', "temperature"),
    (b'"temperature": NaN', "temperature"), (b'"stop": [""]', "stop"), (b'"stop": ["a", ""]', "stop"),
])
def test_unusable_sampling_values_are_refused(served, sampling, param):
    body = b'{"prompt": [5, 7], ' + sampling + b"}"
    err = error(served.http.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 400)
    assert err["param"] == param and param in err["message"]
    body = b'{"input_ids": [5, 7], "sampling_params": {' + sampling + b"}}"
    err = error(served.http.post("/generate", content=body, headers={"content-type": "application/json"}), 400)
    assert err["param"] == f"sampling_params.{param}"


def test_every_error_has_openai_shape_and_no_internals(served, engine, monkeypatch):
    err = error(served.http.get("/nope"), 404)
    assert err["type"] == "not_found_error" and "/nope" in err["message"]
    r = served.http.get("/generate")
    err = error(r, 405)
    assert r.headers["allow"] == "POST"
    err = error(served.http.post("/generate", json={"text": []}), 400)
    assert err["param"] == "text" and "no prompt" in err["message"]
    err = error(served.http.post("/generate", json={"input_ids": [[]]}), 400)
    assert err["param"] == "input_ids"

    async def broken(_request):
        raise RuntimeError("secret internal state /home/x/lockstep/engine.py line 12")

    monkeypatch.setattr(engine, "generate_async", broken)
    err = error(served.http.post("/generate", json={"input_ids": [5, 7]}), 500)
    assert "secret" not in err["message"] and "RuntimeError" not in err["message"]
    assert err["type"] == "internal_error"
    # the connection stays open after a 500 (api_errors.InternalErrors): a second request on the same
    # socket is answered, where a closed connection left a keep-alive client's next request reset
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as sock:
        body = b'{"input_ids": [5, 7]}'
        request = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        sock.sendall(request)
        first = _read_response(sock)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        second = _read_response(sock)
    assert first.startswith(b"HTTP/1.1 500") and second.startswith(b"HTTP/1.1 200"), (first, second)


def _read_response(sock) -> bytes:
    """One HTTP/1.1 response with a Content-Length body (b"" if the server closed the connection)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return head + b"\r\n\r\n" + rest


def test_openapi_documents_the_codes_sent(served):
    schema = served.http.get("/openapi.json").json()
    ops = {(p, m): op for p, ms in schema["paths"].items() for m, op in ms.items()}
    assert not [k for k, op in ops.items() if "422" in op["responses"]]
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        assert {"400", "413", "429"} <= set(ops[(path, "post")]["responses"])
    assert "503" in ops[("/health", "get")]["responses"]
    assert "ErrorOut" in schema["components"]["schemas"] and "HTTPValidationError" not in schema["components"]["schemas"]


def test_body_over_the_limit_is_a_413(served):
    big = json.dumps({"text": "1" * 30_000}).encode()
    r = served.http.post("/generate", content=big, headers={"content-type": "application/json"})
    err = error(r, 413)
    assert err["param"] == "body" and "20000 bytes" in err["message"]
    assert r.headers.get("connection") != "close"  # the body was read and dropped: the connection stays usable

    def chunks():  # no Content-Length: counted as it streams in
        yield b'{"text": "'
        for _ in range(30):
            yield b"1" * 1000
        yield b'"}'

    r = served.http.post("/generate", content=chunks(), headers={"content-type": "application/json"})
    assert "--max-request-bytes" in error(r, 413)["message"] and r.headers.get("connection") != "close"
    assert served.http.get("/health").status_code == 200


def test_health_answers_while_a_prompt_is_tokenised(engine, monkeypatch):
    """The tokenizer runs in a worker thread: the event loop (and /health) does not wait for it."""
    tokenize = engine.tokenize_prompt

    def slow(prompt, chat_template=True):
        time.sleep(2.0)
        return tokenize(prompt, chat_template)

    monkeypatch.setattr(engine, "tokenize_prompt", slow)
    s = Served(create_app(engine, admin_token=None, weights_dir=None, require_admin=False))
    try:
        async def scenario():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                gen = asyncio.create_task(c.post("/generate", json={"text": QUESTIONS[0],
                                                                    "sampling_params": {"max_new_tokens": 2}}))
                await asyncio.sleep(0.3)
                start = time.perf_counter()
                assert (await c.get("/health")).status_code == 200
                waited = time.perf_counter() - start
                assert not gen.done()
                assert (await gen).status_code == 200
                return waited

        assert asyncio.run(scenario()) < 0.5
    finally:
        s.stop()


def test_full_queue_is_a_429_and_health_says_503(served, engine):
    ids = engine.tokenize_prompt(QUESTIONS[1])

    async def scenario():
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as c:
            await c.post("/pause_generation")
            held = [asyncio.create_task(c.post("/generate", json={"input_ids": ids, "sampling_params": {
                "max_new_tokens": 3}})) for _ in range(2)]
            await asyncio.sleep(0.5)
            err = error(await c.post("/generate", json={"input_ids": ids}), 429)
            assert "--max-queued-requests" in err["message"] and err["type"] == "rate_limit_error"
            health = await c.get("/health")
            assert health.status_code == 503 and "full" in health.json()["error"]["message"]
            await c.post("/continue_generation")
            assert [(await t).status_code for t in held] == [200, 200]
            assert (await c.get("/health")).status_code == 200
            assert (await c.post("/generate", json={"input_ids": ids})).status_code == 200

    asyncio.run(scenario())
    client = OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0)
    assert client.completions.create(model="m", prompt=ids, max_tokens=2).choices[0].text is not None


def test_health_reports_a_stalled_engine(served, engine, monkeypatch):
    release = threading.Event()
    execute = engine.runner.execute

    def stuck(scheduled):
        release.wait(30)
        return execute(scheduled)

    monkeypatch.setattr(engine.runner, "execute", stuck)
    with httpx.Client(base_url=served.url, timeout=60) as c:
        done = []
        t = threading.Thread(target=lambda: done.append(c.post("/generate", json={"input_ids": [5, 7]})))
        t.start()
        wait_until(lambda: served.http.get("/health").status_code == 503)
        err = served.http.get("/health").json()["error"]
        assert "finished no step" in err["message"] and err["code"] == 503
        release.set()
        t.join(30)
        assert done[0].status_code == 200
        wait_until(lambda: served.http.get("/health").status_code == 200)


def raw_post(url: str, path: str, body: dict) -> socket.socket:
    """A POST sent over a plain socket, left unread: the test closes it to play a client that leaves."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize("path,body", [
    ("/generate", {"input_ids": [5, 7], "rid": "leaver", "sampling_params": {"n": 4, **LONG}}),
    ("/v1/completions", {"prompt": [5, 7], "n": 4, "max_tokens": 200, "ignore_eos": True}),
])
def test_a_client_that_disconnects_has_its_request_aborted(served, engine, path, body):
    sock = raw_post(served.url, path, body)
    wait_until(lambda: len(engine.scheduler.running) == 4)
    sock.close()
    start = time.time()
    wait_until(lambda: idle(engine), timeout=5)
    took = time.time() - start
    assert took < 2 and served.http.get("/health").status_code == 200


def test_abort_all_frees_the_engine_for_later_requests(served, engine):
    async def scenario():
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as c:
            long = [asyncio.create_task(c.post("/generate", json={"input_ids": [5, 7], "sampling_params": {
                "n": 4, **LONG}})) for _ in range(2)]
            await asyncio.sleep(0.5)
            assert (await c.post("/abort_request", json={"abort_all": True})).status_code == 200
            outs = [(await t).json() for t in long]
            assert {o["meta_info"]["finish_reason"]["type"] for out in outs for o in out} == {"abort"}
            start = time.perf_counter()
            r = await c.post("/generate", json={"input_ids": [5, 7], "sampling_params": {"max_new_tokens": 4}})
            assert r.status_code == 200 and time.perf_counter() - start < 5

    asyncio.run(scenario())
    assert idle(engine)


def test_weight_pushes_must_cover_the_model_and_raise_the_version(tmp_path):
    from safetensors.torch import save_file

    from lockstep.models import load_pretrained

    model = load_pretrained(MODEL)
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "config.json").write_text((MODEL / "config.json").read_text())
    name, tensor = next(iter(model.state_dict().items()))
    save_file({name: tensor.contiguous()}, str(tmp_path / "one" / "model.safetensors"))
    engine = new_engine()
    s = Served(create_app(engine, admin_token=None, weights_dir=str(tmp_path), require_admin=False))
    try:
        err = error(s.http.post("/update_weights_from_disk", json={"model_path": "one"}), 400)
        assert err["param"] == "model_path" and "missing from the update" in err["message"]
        assert "partial" in err["message"]
        assert s.http.post("/update_weights_from_disk", json={"model_path": "one", "partial": True}).json()[
            "weight_version"] == 1
        for version in (-7, 0):
            err = error(s.http.post("/update_weights_from_disk", json={"model_path": "one", "partial": True,
                                                                        "weight_version": version}), 409)
            assert err["param"] == "weight_version" and "only increase" in err["message"]
        err = error(s.http.post("/update_weights_from_disk", json={"model_path": "a\x00b"}), 400)
        assert err["param"] == "model_path"
        assert s.http.get("/get_weight_version").json() == {"weight_version": 1}
    finally:
        s.stop()


def test_a_body_far_over_the_limit_closes_the_connection(served):
    """Past DRAIN_BYTES beyond the limit the body is not read at all: answered at once, the connection
    closed. A raw socket sends only the headers, so no client races the close."""
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 10000000\r\n\r\n")
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == 413
