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
