"""`lockstep serve`: binds loopback by default, refuses to listen beyond it without an admin token."""

import pytest

from lockstep.cli import main
from lockstep.commands import serve


@pytest.fixture
def no_env_token(monkeypatch):
    monkeypatch.delenv(serve.TOKEN_ENV, raising=False)


def fake_uvicorn(monkeypatch):
    calls = []
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append((app, kw)))
    return calls


def test_beyond_loopback_without_a_token_refuses_to_start(no_env_token, monkeypatch, capsys):
    calls = fake_uvicorn(monkeypatch)
    for host in ("0.0.0.0", "10.1.2.3", "myhost"):
        assert main(["serve", "--host", host]) == 2
        assert "without an admin token" in capsys.readouterr().err
    assert calls == []


def test_loopback_default_and_token_from_env(no_env_token, monkeypatch, tmp_path):
    calls = fake_uvicorn(monkeypatch)
    assert main(["serve", "--port", "30123", "--max-model-len", "128"]) == 0
    app, kw = calls[-1]
    assert kw["host"] == "127.0.0.1" and kw["port"] == 30123
    monkeypatch.setenv(serve.TOKEN_ENV, "from-env")
    assert main(["serve", "--host", "0.0.0.0", "--weights-dir", str(tmp_path)]) == 0
    assert calls[-1][1]["host"] == "0.0.0.0"


def test_bad_weights_dir_and_model_are_clear_errors(no_env_token, monkeypatch, tmp_path, capsys):
    fake_uvicorn(monkeypatch)
    assert main(["serve", "--weights-dir", str(tmp_path / "nope")]) == 2
    assert "--weights-dir" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_cache_is_sized_from_memory_and_reported(no_env_token, monkeypatch, capsys):
    """The cache takes --cache-memory-bytes (or a fraction of the available memory), not
    max_num_seqs x max_model_len whatever that costs (7.3 GB for a 135M model), and says so."""
    calls = fake_uvicorn(monkeypatch)
    from lockstep.engine import kv_cache

    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda device: 4 * 2**20)
    assert main(["serve", "--max-num-seqs", "64"]) == 0  # 25% of 4 MiB: a few slots, not 64
    engine = calls[-1][0].state.server.engine
    assert 1 <= engine.cache.num_blocks < 64 and engine.cache.nbytes <= 2**20
    err = capsys.readouterr().err
    assert f"room for {engine.cache.num_blocks} sequences of 256 tokens" in err
    assert main(["serve", "--cache-memory-bytes", str(3 * engine.cache.nbytes // engine.cache.num_blocks)]) == 0
    assert calls[-1][0].state.server.engine.cache.num_blocks == 3
    assert main(["serve", "--cache-memory-fraction", "0"]) == 2
    assert "--cache-memory-fraction" in capsys.readouterr().err


def test_sigterm_answers_or_aborts_in_flight_requests_within_the_grace_period(no_env_token, tmp_path):
    """A running request does not keep the server up after SIGTERM beyond --shutdown-grace (it
    kept running 13 s, issue 15)."""
    import signal
    import socket
    import subprocess
    import sys
    import threading
    import time

    import httpx

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([sys.executable, "-m", "lockstep.cli", "serve", "--port", str(port), "--shutdown-grace",
                             "1", "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read().decode()[-2000:]
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        answers = []

        def long_request():  # 128 samples to the end of the context: far longer than the grace period
            body = {"input_ids": [5, 7], "sampling_params": {"n": 128, "max_new_tokens": 250, "ignore_eos": True}}
            try:
                answers.append(httpx.post(f"{url}/generate", json=body, timeout=120).status_code)
            except httpx.TransportError as e:
                answers.append(type(e).__name__)

        client = threading.Thread(target=long_request)
        client.start()
        time.sleep(1.5)
        assert not answers
        start = time.time()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        took = time.time() - start
        client.join(10)
        assert took < 1 + 4, f"exited {took:.1f} s after SIGTERM"
        assert answers, "the client is still waiting"  # answered, or its connection closed when aborted
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
