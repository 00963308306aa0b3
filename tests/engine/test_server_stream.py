"""`stream: true` (engine/streaming.py): a real uvicorn server and the real `openai` client; the
streamed deltas of every choice add up to the non-streamed answer, each choice ends once with its
finish reason, a stop string never shows, and a client that goes away has its request aborted."""

import json
import time

import httpx
import pytest
from openai import OpenAI

from lockstep.engine.streaming import TextStream, sendable_end

from test_server import engine, served  # noqa: F401 (the server's fixtures, one per module)


def joined(chunks, index, chat):
    return "".join((c.choices[0].delta.content or "") if chat else c.choices[0].text
                   for c in chunks if c.choices and c.choices[0].index == index)


def finishes(chunks):
    return [(ch.index, ch.finish_reason) for c in chunks for ch in c.choices if ch.finish_reason is not None]


def test_chat_stream_adds_up_to_the_answer(served):
    client = OpenAI(base_url=f"{served.url}/v1", api_key="x")
    kw = dict(model="m", messages=[{"role": "user", "content": "What is 40 + 41?"}], temperature=0.9, seed=4, n=3,
              max_tokens=30)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert [ch.delta.role for ch in chunks[0].choices] == ["assistant"] * 3  # the first chunk names the role
    assert sorted(finishes(chunks)) == [(i, c.finish_reason) for i, c in enumerate(full.choices)]
    for i, c in enumerate(full.choices):
        assert joined(chunks[1:], i, chat=True) == c.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert len(chunks) > 6  # text came in pieces, not as one answer at the end


def test_completion_stream_holds_back_a_stop_string(served):
    client = OpenAI(base_url=f"{served.url}/v1", api_key="x")
    prompts = ["<|user|>What is 23 + 58?<|assistant|>", "<|user|>What is 7 + 5?<|assistant|>"]
    kw = dict(model="m", prompt=prompts, temperature=1.0, seed=2, max_tokens=24, stop=["1", "+ "])
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True))
    assert all(c.object == "text_completion" for c in chunks)
    assert sorted(finishes(chunks)) == [(i, c.finish_reason) for i, c in enumerate(full.choices)]
    for i, c in enumerate(full.choices):
        assert joined(chunks, i, chat=False) == c.text
    assert not any("1" in ch.text or "+ " in ch.text for c in chunks for ch in c.choices)
    assert "stop" in [c.finish_reason for c in full.choices]  # a stop string was met


def test_streamed_logprobs_join_into_the_answers(served):
    client = OpenAI(base_url=f"{served.url}/v1", api_key="x")
    kw = dict(model="m", prompt="<|user|>What is 7 + 5?<|assistant|>", temperature=0.8, seed=6, n=2, max_tokens=12,
              logprobs=2, stop=["1"])
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True))
    for i, c in enumerate(full.choices):
        mine = [ch.logprobs for x in chunks for ch in x.choices if ch.index == i and ch.logprobs is not None]
        assert sum((lp.tokens for lp in mine), []) == c.logprobs.tokens
        assert sum((lp.token_logprobs for lp in mine), []) == c.logprobs.token_logprobs
        assert sum((lp.top_logprobs for lp in mine), []) == c.logprobs.top_logprobs
        assert sum((lp.text_offset for lp in mine), []) == c.logprobs.text_offset  # from the completion's start
        assert joined(chunks, i, chat=False) == c.text
    chat = dict(model="m", messages=[{"role": "user", "content": "What is 40 + 41?"}], temperature=0, max_tokens=8,
                logprobs=True, top_logprobs=1)
    full = client.chat.completions.create(**chat)
    chunks = list(client.chat.completions.create(**chat, stream=True))
    content = [e for x in chunks for ch in x.choices if ch.logprobs is not None for e in ch.logprobs.content]
    assert content == full.choices[0].logprobs.content


def test_generate_streams_each_samples_output_so_far(served, engine):
    ids = [engine.tokenize_prompt(q) for q in ("What is 2 + 3?", "What is 9 + 9?")]
    body = {"input_ids": ids, "rid": ["a", "b"], "return_logprob": True,
            "sampling_params": {"n": 2, "seed": 8, "temperature": 0.9, "max_new_tokens": 12, "stop": ["= "],
                                "ignore_eos": True}}
    whole = served.http.post("/generate", json=body).json()
    with served.http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        lines = [x for x in r.iter_lines() if x]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(x.removeprefix("data: ")) for x in lines[:-1]]
    for i, answer in enumerate(whole):  # index = prompt * n + sample, as the list without stream
        mine = [e for e in events if e["index"] == i]
        assert {k: v for k, v in mine[-1].items() if k != "index"} == answer  # the last: the whole answer
        assert all(e["meta_info"]["finish_reason"] is None for e in mine[:-1]) and len(mine) > 2
        for before, after in zip(mine, mine[1:]):  # each event: the output so far
            assert after["text"].startswith(before["text"]) and answer["text"].startswith(before["text"])
            assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
        assert mine[-2]["meta_info"]["output_token_logprobs"] == answer["meta_info"]["output_token_logprobs"]


def test_the_text_sent_stops_short_of_what_may_change():
    assert sendable_end("abc\ufffd", ()) == 3  # an unfinished UTF-8 character
    assert sendable_end("the answer is\n\nQ", ("\n\nQuestion:",)) == len("the answer is")
    assert sendable_end("x STOP y", ("STOP",)) == 2 and sendable_end("x ST", ("T",)) == 3
    assert sendable_end("x ST", ("STOP", "T")) == 2  # the earliest of a whole stop and a stop's start
    stream = TextStream(lambda ids: "".join(map(chr, ids)), ("##",))
    assert [stream.add([ord(c) for c in part]) for part in ("ab", "c#", "d#", "#", "e")] == ["ab", "c", "#d", "", ""]
    assert stream.finish("abc#d") == ""  # the answer ends before the stop string
    assert TextStream(None, ()).add([1, 2]) == ""  # no tokenizer: no text


def test_a_client_that_leaves_has_its_request_aborted(served, monkeypatch):
    engine = served.server.config.app.state.server.engine
    aborted = []
    monkeypatch.setattr(engine, "abort", lambda rid, abort=engine.abort: aborted.append(rid) or abort(rid))
    body = {"prompt": "What", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=served.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            first = next(r.iter_lines())
            assert first.startswith("data: {")
    deadline = time.time() + 30
    while engine._requests and time.time() < deadline:
        time.sleep(0.05)
    assert not engine._requests and served.server.config.app.state.server.in_flight == 0
    assert len(aborted) == 1 and aborted[0].startswith("cmpl-")  # not run to its 200 tokens


@pytest.mark.parametrize("body,param", [
    ({"prompt": "12", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "12", "stream": True, "echo": True}, "echo"),
])
def test_what_a_stream_cannot_carry_is_refused(served, body, param):
    r = served.http.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
