"""`lockstep generate` end to end on a saved tiny DeepSeek-V4 with a word-level tokenizer."""

import pytest

from lockstep.cli import main
from lockstep.commands import generate as command
from lockstep.models.checkpoint import save_pretrained

from conftest import tiny_dsv4
from test_control import word_tokenizer


def test_generate_prints_completions(tmp_path, capsys):
    save_pretrained(tiny_dsv4(60), tmp_path)
    word_tokenizer().save_pretrained(tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--prompt", "w1 w2 w3", "--prompt", "w4",
                 "--max-new-tokens", "5", "--n", "2", "--temperature", "0.8", "--serving-format", "fp8"]) == 0
    out = capsys.readouterr().out
    assert out.count("=== prompt") == 4 and "finish_reason=length" in out
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1 2 3", "--max-new-tokens", "3"]) == 0


def test_missing_default_model_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(command, "DEFAULT_MODEL", tmp_path / "nowhere")
    with pytest.raises(SystemExit, match="embedded default model is missing"):
        main(["generate"])


@pytest.mark.skipif(not (command.DEFAULT_MODEL / "config.json").exists(), reason="embedded tiny model not built")
def test_embedded_default_model(capsys):
    assert main(["generate", "--max-new-tokens", "8", "--prompt", "What is 2 + 3?"]) == 0
    assert "finish_reason=" in capsys.readouterr().out


def test_served_path_flags_reach_the_engine(tmp_path, monkeypatch):
    """generate and serve name the served path's switches as train does (EngineConfig.PATH_FIELDS)."""
    from lockstep.config import EngineConfig
    from lockstep.engine import Engine

    seen = []

    def stop(path, config):
        seen.append(config)
        raise SystemExit("stop before loading")

    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(stop))
    save_pretrained(tiny_dsv4(60), tmp_path)
    flags = ["--no-compile-decode", "--no-triton-moe", "--compile-fallback", "--no-cuda-graph", "--no-async-scheduling"]
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tmp_path), *flags])
    with pytest.raises(SystemExit):
        main(["serve", "--model", str(tmp_path), *flags])
    for config in seen:
        assert (config.compile_decode, config.triton_moe, config.compile_fallback, config.cuda_graph,
                config.async_scheduling) == (False, False, True, False, False)
        assert config.triton_hc == EngineConfig.triton_hc  # not given: the field's own default
    assert len(seen) == 2
