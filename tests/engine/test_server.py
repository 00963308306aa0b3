"""The HTTP server end to end: a real uvicorn server on a free port, the bundled tiny DeepSeek-V4 in
float32 on CPU, the real `openai` client and httpx; answers must equal the engine's own."""

import asyncio
import socket
import threading
import time

import httpx
import pytest
import torch
import uvicorn
from openai import OpenAI

from lockstep.commands.serve import DEFAULT_MODEL
from lockstep.config import EngineConfig, SamplingParams
from lockstep.engine import Engine, GenerateRequest
from lockstep.engine.server import create_app

MODEL = DEFAULT_MODEL
QUESTIONS = ["What is 23 + 58?", "What is 7 + 5?", "What is 40 + 41?", "What is 99 + 1?",
             "What is 12 + 30?", "What is 8 + 8?", "What is 61 + 17?", "What is 3 + 94?"]


def new_engine(path=MODEL):
    return Engine.from_pretrained(path, EngineConfig(max_num_seqs=16, max_model_len=256, max_prefill_tokens=64))


class Served:
    """A uvicorn server in a background thread on a port the OS picked."""

    def __init__(self, app):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)
        self.http = httpx.Client(base_url=self.url, timeout=60)

    def stop(self):
        self.http.close()
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def engine():
    return new_engine()


@pytest.fixture(scope="module")
def reference():
    """A second engine on the same weights, driven directly (no server)."""
    return new_engine()


@pytest.fixture(scope="module")
def served(engine):
    s = Served(create_app(engine, admin_token=None, weights_dir=None, require_admin=False))
    yield s
    s.stop()
    assert not engine._loop.running  # the lifespan stopped the engine's loop


def ref_sample(reference, ids, **kw):
    return reference.generate([GenerateRequest(ids, SamplingParams(**kw))])


def test_health_version_models(served):
    assert served.http.get("/health").json() == {"status": "ok", "paused": False, "weight_version": 0}
    assert served.http.get("/get_weight_version").json() == {"weight_version": 0}
    models = OpenAI(base_url=f"{served.url}/v1", api_key="x").models.list()
    assert [m.id for m in models.data] == ["tiny-dsv4"]


def test_openai_completions_with_logprobs(served, engine, reference):
    client = OpenAI(base_url=f"{served.url}/v1", api_key="x")
    text = "<|user|>What is 23 + 58?<|assistant|>"
    ids = engine.tokenize_prompt(text, chat_template=False)
    (ref,) = ref_sample(reference, ids, temperature=0.0, max_new_tokens=8)
    for prompt in (text, ids):
        r = client.completions.create(model="tiny-dsv4", prompt=prompt, max_tokens=8, temperature=0, logprobs=1)
        (c,) = r.choices
        assert c.text == ref.metadata["text"] and c.finish_reason == ref.finish_reason == "stop"
        assert c.logprobs.token_logprobs == ref.rollout_logprobs.tolist()
        assert c.logprobs.tokens == [engine.tokenizer.decode([t]) for t in ref.response_ids.tolist()]
        assert c.logprobs.text_offset[0] == 0
        # logprobs=1: each position's likeliest token, which greedy decoding sampled
        assert c.logprobs.top_logprobs == [{t: lp} for t, lp in zip(c.logprobs.tokens, c.logprobs.token_logprobs)]
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), ref.response_len)
        assert r.model == "tiny-dsv4" and r.id.startswith("cmpl-") and r.object == "text_completion"
    # two prompts, n = 2, seeded sampling: choice index = prompt * n + sample, sample i uses seed + i
    r = client.completions.create(model="m", prompt=[text, "<|user|>What is 7 + 5?<|assistant|>"], n=2, seed=11,
                                  temperature=0.9, max_tokens=6, extra_body={"top_k": 20})
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and r.usage.prompt_tokens == 2 * len(ids) - 2
    for i, c in enumerate(r.choices[:2]):
        (ref,) = ref_sample(reference, ids, temperature=0.9, seed=11 + i, max_new_tokens=6, top_k=20)
        assert c.text == ref.metadata["text"]


def test_openai_chat_with_logprobs(served, engine, reference):
    client = OpenAI(base_url=f"{served.url}/v1", api_key="x")
    messages = [{"role": "user", "content": "What is 40 + 41?"}]
    ids = engine.tokenize_prompt(messages)
    (ref,) = ref_sample(reference, ids, temperature=0.0, max_new_tokens=16)
    r = client.chat.completions.create(model="tiny-dsv4", messages=messages, temperature=0, logprobs=True,
                                       top_logprobs=2)
    (c,) = r.choices
    assert c.message.role == "assistant" and c.message.content == ref.metadata["text"]
    assert c.finish_reason == "stop" and r.object == "chat.completion"
    assert [x.logprob for x in c.logprobs.content] == ref.rollout_logprobs.tolist()
    assert [x.token for x in c.logprobs.content] == [engine.tokenizer.decode([t]) for t in ref.response_ids.tolist()]
    assert all(x.bytes == list(x.token.encode()) for x in c.logprobs.content)
    for x in c.logprobs.content:  # top_logprobs=2: the sampled (greedy) token, then the runner-up
        first, second = x.top_logprobs
        assert (first.token, first.logprob, first.bytes) == (x.token, x.logprob, x.bytes)
        assert second.logprob <= first.logprob and second.bytes == list(second.token.encode())
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == ref.response_len
    # max_tokens cut: "length"; without logprobs, none come back
    r = client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=1)
    assert r.choices[0].finish_reason == "length" and r.choices[0].logprobs is None
    assert r.choices[0].message.content == ref.metadata["text"][:1]


def test_generate_equals_the_engine(served, engine, reference):
    ids = engine.tokenize_prompt(QUESTIONS[0])
    for sp in ({"temperature": 0.0, "max_new_tokens": 10}, {"temperature": 0.8, "seed": 3, "max_new_tokens": 10}):
        out = served.http.post("/generate", json={"input_ids": ids, "sampling_params": sp, "return_logprob": True,
                                                  "return_routed_experts": True}).json()
        (ref,) = ref_sample(reference, ids, return_routed_experts=True, **sp)
        meta = out["meta_info"]
        assert out["output_ids"] == ref.response_ids.tolist() and out["text"] == ref.metadata["text"]
        assert [x[0] for x in meta["output_token_logprobs"]] == ref.rollout_logprobs.tolist()
        assert [x[1] for x in meta["output_token_logprobs"]] == out["output_ids"]
        assert meta["finish_reason"] == {"type": ref.finish_reason} and meta["weight_version"] == 0
        assert "output_top_logprobs" not in meta
        assert meta["routed_experts"] == ref.routed_experts.tolist()
        assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(ids), ref.response_len)
    # top_logprobs_num: the engine's alternatives, [logprob, id, null] triples, most likely first
    sp = {"temperature": 0.8, "seed": 3, "max_new_tokens": 10}
    out = served.http.post("/generate", json={"input_ids": ids, "sampling_params": sp, "return_logprob": True,
                                              "top_logprobs_num": 3}).json()
    (ref,) = ref_sample(reference, ids, top_logprobs=3, **sp)
    assert out["output_ids"] == ref.response_ids.tolist()
    assert out["meta_info"]["output_top_logprobs"] == [[[lp, t, None] for t, lp in a] for a in ref.top_logprobs]
    # text in, n = 3: a list; a batch of two prompts with rids: a list in prompt order
    outs = served.http.post("/generate", json={"text": "<|user|>What is 8 + 8?<|assistant|>",
                                               "sampling_params": {"n": 3, "seed": 5, "max_new_tokens": 4}}).json()
    assert len(outs) == 3 and all("output_token_logprobs" not in o["meta_info"] for o in outs)
    outs = served.http.post("/generate", json={"input_ids": [ids, ids[:-3] + ids[-1:]], "rid": ["a", "b"],
                                               "sampling_params": {"temperature": 0, "max_new_tokens": 4}}).json()
    assert [o["meta_info"]["id"] for o in outs] == ["a", "b"]


def test_concurrent_requests_equal_one_at_a_time(served, engine, monkeypatch):
    widths = []  # sequences per engine step: the concurrent requests must really share steps
    execute = engine.runner.execute
    monkeypatch.setattr(engine.runner, "execute", lambda sched: (widths.append(len(sched)), execute(sched))[1])
    prompts = [engine.tokenize_prompt(q) for q in QUESTIONS]
    bodies = [{"input_ids": p, "return_logprob": True,
               "sampling_params": {"temperature": 0.0 if i % 2 else 1.0, "seed": i, "max_new_tokens": 6 + i}}
              for i, p in enumerate(prompts)]
    bad = {"input_ids": prompts[0], "sampling_params": {"top_p": 0}}

    async def together():
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as c:
            rs = await asyncio.gather(*(c.post("/generate", json=b) for b in bodies[:4] + [bad] + bodies[4:]))
        return [r.status_code for r in rs], [r.json() for r in rs]

    codes, outs = asyncio.run(together())
    assert codes == [200] * 4 + [400] + [200] * 4
    assert outs[4]["error"]["param"] == "sampling_params.top_p"
    assert max(widths) >= 4, widths
    widths.clear()
    alone = [served.http.post("/generate", json=b).json() for b in bodies]
    assert max(widths) == 1
    for a, b in zip(outs[:4] + outs[5:], alone):
        assert a["output_ids"] == b["output_ids"] and a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]
        la, lb = (torch.tensor([x[0] for x in o["meta_info"]["output_token_logprobs"]]) for o in (a, b))
        assert torch.allclose(la, lb, atol=1e-5, rtol=0)


@pytest.mark.parametrize("path,body,param", [
    ("/generate", b"{not json", None),
    ("/generate", b"[1, 2]", "body"),
    ("/generate", b"{}", "input_ids"),
    ("/generate", b'{"input_ids": "abc"}', "input_ids"),
    ("/generate", b'{"input_ids": [1, 2, 103]}', "input_ids"),
    ("/generate", b'{"input_ids": [-1]}', "input_ids"),
    ("/generate", b'{"input_ids": []}', "input_ids"),
    ("/generate", b'{"input_ids": [7], "sampling_params": {"temperature": -1}}', "sampling_params.temperature"),
    ("/generate", b'{"input_ids": [7], "sampling_params": {"top_k": 0}}', "sampling_params.top_k"),
    ("/generate", b'{"input_ids": [7], "sampling_params": {"n": 0}}', "sampling_params.n"),
    ("/generate", b'{"input_ids": [7], "sampling_params": {"typo": 1}}', "sampling_params.typo"),
    ("/generate", b'{"input_ids": [7], "top_logprobs_num": 2}', "top_logprobs_num"),
    ("/generate", b'{"input_ids": [7], "return_logprob": true, "top_logprobs_num": 21}', "top_logprobs_num"),
    ("/v1/completions", b'{"prompt": "12", "logprobs": 21}', "logprobs"),
    ("/v1/completions", b'{"prompt": "12", "max_tokens": 0}', "max_tokens"),
    ("/v1/completions", b'{"max_tokens": 3}', "prompt"),
    ("/v1/chat/completions", b'{"messages": []}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"content": "hi"}]}', "messages.0.role"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "1"}], "top_p": 1.5}', "top_p"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "1"}], "top_logprobs": 2}', "top_logprobs"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "1"}], "response_format": '
                             b'{"type": "json_object"}}', "response_format"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "1"}], "functions": [{"name": "f"}]}',
     "functions"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "1"}], "modalities": ["text", "audio"]}',
     "modalities"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "what is"}, '
                             b'{"type": "image_url", "image_url": {"url": "x"}}]}]}', "messages.0.content"),
])
def test_bad_requests_are_4xx_and_name_the_field(served, path, body, param):
    r = served.http.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == 400
    assert (param or "JSON").split(".")[-1] in err["message"]


def test_too_long_prompts_are_refused(served, engine):
    for path, body in (("/generate", {"input_ids": [7] * 256}), ("/v1/completions", {"prompt": "1" * 300}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1" * 300}]})):
        err = served.http.post(path, json=body).json()["error"]
        assert "max_model_len=256" in err["message"] and err["param"] in ("input_ids", "prompt", "messages")
    assert served.http.post("/generate", json={"input_ids": [7] * 255}).status_code == 200  # one token of room


def test_pause_continue_flush_abort(served, engine):
    ids = engine.tokenize_prompt(QUESTIONS[1])

    async def scenario():
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as c:
            assert (await c.post("/flush_cache")).json()["success"] is True  # idle
            assert (await c.post("/pause_generation")).json() == {"success": True, "paused": True}
            assert (await c.get("/health")).json()["paused"] is True
            held = asyncio.create_task(c.post("/generate", json={"input_ids": ids, "rid": "held"}))
            doomed = asyncio.create_task(c.post("/generate", json={
                "input_ids": ids, "rid": "doomed", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}))
            await asyncio.sleep(0.5)
            dup = await c.post("/generate", json={"input_ids": ids, "rid": "held"})
            assert dup.status_code == 400 and "already running" in dup.json()["error"]["message"]
            assert not held.done() and not doomed.done()  # paused: nothing runs
            busy = await c.post("/flush_cache")
            assert busy.status_code == 409 and "retry" in busy.json()["error"]["message"]
            aborted = await c.post("/abort_request", json={"rid": "doomed"})
            assert aborted.json() == {"success": True, "aborted": ["doomed"]}
            assert (await doomed).json()["meta_info"]["finish_reason"] == {"type": "abort"}
            late = asyncio.create_task(c.post("/generate", json={"input_ids": ids, "rid": "late"}))
            await asyncio.sleep(0.2)
            everything = (await c.post("/abort_request", json={"abort_all": True})).json()
            assert everything == {"success": True, "aborted": ["held", "late"]}
            for task in (held, late):
                assert (await task).json()["meta_info"]["finish_reason"] == {"type": "abort"}
            held = asyncio.create_task(c.post("/generate", json={"input_ids": ids, "rid": "held"}))  # free again
            await asyncio.sleep(0.2)
            assert not held.done()
            assert (await c.post("/continue_generation")).json()["paused"] is False
            out = (await held).json()
            assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length")
            assert (await c.post("/flush_cache")).status_code == 200
            assert (await c.post("/abort_request", json={"rid": "gone"})).json()["aborted"] == []
            assert (await c.post("/abort_request", json={})).status_code == 400

    asyncio.run(scenario())


def test_update_weights_from_disk(tmp_path):
    from lockstep.models import load_pretrained, save_pretrained

    model = load_pretrained(MODEL)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * 0.5)
    (tmp_path / "weights").mkdir()
    save_pretrained(model, tmp_path / "weights" / "v1")
    (tmp_path / "outside").mkdir()
    save_pretrained(model, tmp_path / "outside" / "v1")
    (tmp_path / "weights" / "link").symlink_to(tmp_path / "outside" / "v1")

    engine = new_engine()
    prompts = [engine.tokenize_prompt(q) for q in QUESTIONS[:4]]
    def body(p):
        return {"input_ids": p, "return_logprob": True, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}

    # an admin token configured on loopback is required too
    s = Served(create_app(engine, admin_token="t2", weights_dir=str(tmp_path / "weights"), require_admin=False))
    try:
        auth = {"Authorization": "Bearer t2"}
        before = [s.http.post("/generate", json=body(p)).json() for p in prompts]
        assert s.http.post("/update_weights_from_disk", json={"model_path": "v1"}).status_code == 401
        for bad in ("../outside/v1", str(tmp_path / "outside" / "v1"), "link", "v1/../../outside/v1"):
            r = s.http.post("/update_weights_from_disk", json={"model_path": bad}, headers=auth)
            assert r.status_code == 403 and "outside the weights directory" in r.json()["error"]["message"], bad
        r = s.http.post("/update_weights_from_disk", json={"model_path": "missing"}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model_path"
        assert s.http.get("/get_weight_version").json()["weight_version"] == 0
        r = s.http.post("/update_weights_from_disk", json={"model_path": "v1"}, headers=auth)
        assert r.json()["weight_version"] == 1 and s.http.get("/get_weight_version").json()["weight_version"] == 1
        after = [s.http.post("/generate", json=body(p)).json() for p in prompts]
        r = s.http.post("/update_weights_from_disk", headers=auth,
                        json={"model_path": str(tmp_path / "weights" / "v1"), "weight_version": 7})
        assert r.json()["weight_version"] == 7
    finally:
        s.stop()
    fresh = new_engine(tmp_path / "weights" / "v1")
    ref = [fresh.generate([GenerateRequest(p, SamplingParams(temperature=0.0, max_new_tokens=8))])[0] for p in prompts]
    assert [o["output_ids"] for o in after] == [x.response_ids.tolist() for x in ref]
    assert [o["output_ids"] for o in after] != [o["output_ids"] for o in before]
    for o, x in zip(after, ref):
        assert o["meta_info"]["weight_version"] == 1
        assert [y[0] for y in o["meta_info"]["output_token_logprobs"]] == x.rollout_logprobs.tolist()


def test_weight_updates_refused_without_weights_dir(served):
    r = served.http.post("/update_weights_from_disk", json={"model_path": str(MODEL)})
    assert r.status_code == 403 and "--weights-dir" in r.json()["error"]["message"]


def test_admin_token_required_beyond_loopback(engine):
    with pytest.raises(ValueError, match="admin token"):
        create_app(engine, admin_token=None, weights_dir=None, require_admin=True)
    s = Served(create_app(new_engine(), admin_token="s3cret", weights_dir=None, require_admin=True))
    try:
        for path in ("/pause_generation", "/continue_generation", "/flush_cache", "/update_weights_from_disk"):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                r = s.http.post(path, json={"model_path": "x", "rid": "x"}, headers=headers)
                assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (path, headers)
        assert s.http.post("/abort_request", json={"rid": "x"}).status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert s.http.post("/pause_generation", headers=ok).status_code == 200
        assert s.http.post("/continue_generation", headers=ok).status_code == 200
        assert s.http.post("/abort_request", json={"rid": "x"}, headers=ok).status_code == 200
        r = s.http.post("/generate", json={"input_ids": [5, 7], "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200  # generation itself is open
    finally:
        s.stop()


def test_tokenize_and_detokenize(served, engine):
    text, messages = "What is 7 + 5?", [{"role": "user", "content": "What is 7 + 5?"}]
    r = served.http.post("/tokenize", json={"prompt": text}).json()
    assert r["tokens"] == engine.tokenize_prompt(text, chat_template=False) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == engine.max_model_len
    chat = served.http.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == engine.tokenize_prompt(messages) and chat["count"] > r["count"]  # the template's tokens
    long = served.http.post("/tokenize", json={"prompt": "1 + " * 400}).json()
    assert long["count"] > engine.max_model_len  # counted, though too long to serve
    back = served.http.post("/detokenize", json={"tokens": chat["tokens"]}).json()
    assert back["prompt"] == engine.tokenizer.decode(chat["tokens"], skip_special_tokens=False)
    image = [{"role": "user", "content": [{"type": "image_url"}]}]
    both = {"prompt": "a", "messages": messages}
    for path, body, param in (("/tokenize", {}, "prompt"), ("/tokenize", both, "prompt"),
                              ("/detokenize", {"tokens": [10 ** 6]}, "tokens"), ("/detokenize", {}, "tokens"),
                              ("/tokenize", {"messages": image}, "messages.0.content")):
        err = served.http.post(path, json=body)
        assert err.status_code == 400 and err.json()["error"]["param"] == param, (path, body, err.text)
