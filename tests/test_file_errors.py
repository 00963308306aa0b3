"""Bad files and flags a user hands the CLI: one line naming the file (and field or line), exit 2
(issue 15 item 7). Each case corrupts a copy of the bundled tiny model, a prompt file or the
SmolLM2 GGUF in tmp_path and runs it through `lockstep.cli.main`."""

import json
import shutil
import socket

import pytest
import torch

from lockstep.cli import main
from lockstep.commands.generate import DEFAULT_MODEL


def _fails_naming(capsys, argv, *parts):
    """The command exits 2 with one stderr line that holds every one of `parts`."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for part in parts:
        assert str(part) in err, err
    return err


@pytest.fixture
def model_dir(tmp_path):
    return shutil.copytree(DEFAULT_MODEL, tmp_path / "model")


def _edit_config(model_dir, **changes):
    file = model_dir / "config.json"
    config = {**json.loads(file.read_text()), **changes}
    file.write_text(json.dumps({k: v for k, v in config.items() if v is not None}, indent=1))
    return file


def _generate(model_dir):
    return ["generate", "--model", str(model_dir), "--max-new-tokens", "1"]


def test_malformed_config_json_names_file_and_line(capsys, model_dir):
    file = model_dir / "config.json"
    file.write_text('{\n  "model_type": "deepseek_v4",\n  , "hidden_size": 64}')
    _fails_naming(capsys, _generate(model_dir), file, "line 3 column 3", "invalid JSON")


def test_malformed_tokenizer_json_names_the_file(capsys, model_dir):
    file = model_dir / "tokenizer.json"
    text = file.read_text()
    file.write_text(text[:40] + "{,}" + text[40:])
    _fails_naming(capsys, _generate(model_dir), file, "line", "invalid JSON")


@pytest.mark.parametrize("changes, field, why", [
    ({"hidden_size": "576"}, "hidden_size", "must be int, got '576'"),  # was a 29-line torch traceback
    ({"model_type": "llama4"}, "model_type", "unsupported 'llama4'"),
    ({"num_attention_heads": 0}, "num_attention_heads", "must be >= 1"),
    ({"o_groups": 3}, "o_groups", "3 does not divide"),
    # without an explicit schedule the model had no layers and the loader said "unexpected tensor"
    ({"num_hidden_layers": -1, "layer_types": None, "mlp_layer_types": None}, "num_hidden_layers", "must be >= 1"),
])
def test_bad_config_field_names_file_and_field(capsys, model_dir, changes, field, why):
    file = _edit_config(model_dir, **changes)
    _fails_naming(capsys, _generate(model_dir), f"{file}: field {field}: {why}")


def test_config_that_does_not_match_the_weights_names_both_files(capsys, model_dir):
    file = _edit_config(model_dir, num_attention_heads=3)  # valid on its own; the weights hold 4 heads
    _fails_naming(capsys, _generate(model_dir), model_dir / "model.safetensors", "expected [3], got [4]",
                  f"the model was built from {file}")


def test_non_utf8_jsonl_names_file_and_line(capsys, tmp_path):
    file = tmp_path / "prompts.jsonl"
    file.write_bytes(b'{"prompt": "1 + 1", "label": "2"}\n{"prompt": "\xff\xfe", "label": "2"}\n')
    _fails_naming(capsys, ["eval", "--eval-data", "x", str(file)], f"{file}, line 2: not UTF-8")


def test_garbage_parquet_names_the_file(capsys, tmp_path):
    file = tmp_path / "prompts.parquet"
    file.write_bytes(b"PAR1 this is not a parquet file PAR1")
    _fails_naming(capsys, ["eval", "--eval-data", "x", str(file)], f"{file}: not a readable parquet file")


@pytest.mark.parametrize("keep_bytes", [20_000_000, 1_000])  # tensor data cut short; the header cut short
def test_truncated_gguf_names_the_file(capsys, tmp_path, keep_bytes):
    from lockstep.models.gguf import smollm2_gguf_path

    file = tmp_path / "model.gguf"
    with open(smollm2_gguf_path(), "rb") as f:
        file.write_bytes(f.read(keep_bytes))
    _fails_naming(capsys, ["convert", "gguf", str(file), str(tmp_path / "out")], file, "truncated or corrupt")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without usable CUDA")
def test_device_cuda_without_cuda_is_one_line(capsys):
    _fails_naming(capsys, ["generate", "--device", "cuda", "--max-new-tokens", "1"], "--device cuda")


@pytest.mark.parametrize("make", ["missing", "directory"])
def test_layout_file_that_is_not_there_names_it(capsys, tmp_path, make):
    # was "[Errno 2] No such file or directory", not saying which flag or what the file is
    path = tmp_path / "plan.json"
    if make == "directory":
        path.mkdir()
    why = "file not found" if make == "missing" else "not a file"
    _fails_naming(capsys, ["train", "--layout", str(path), "--num-rollout", "1"], f"{path}: {why}")


def test_custom_reward_module_that_is_not_there_is_one_line(capsys):
    _fails_naming(capsys, ["train", "--custom-reward-path", "no_such_module:score", "--num-rollout", "1"],
                  "no_such_module:score", "cannot import no_such_module")


@pytest.mark.parametrize("flag", ["--prompt-data", "--eval-data"])
def test_a_prompt_longer_than_the_context_names_its_line(capsys, tmp_path, flag):
    # was "prompt of N tokens does not fit max_model_len=M", not saying which prompt or what to change
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "What is 2 + 2?", "label": "4"}, {"prompt": "What is " + " + ".join(["1"] * 40) + "?",
                                                        "label": "40"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = ["--prompt-data", str(data)] if flag == "--prompt-data" else ["--eval-data", "long", str(data)]
    _fails_naming(capsys, ["train", *sets, "--num-rollout", "1", "--rollout-batch-size", "2", "--max-model-len", "48",
                           "--run-dir", str(tmp_path / "run"), "--no-plot"],
                  f"{data}, line 2: prompt of", "does not fit max_model_len=48", "--max-model-len")


def test_an_input_key_the_training_file_lacks_is_named(capsys, tmp_path):
    # was read with another known layout's keys (here GSM8K's question / answer), the flag silently ignored
    data = tmp_path / "gsm8k.jsonl"
    data.write_text(json.dumps({"question": "What is 2 + 2?", "answer": "#### 4"}) + "\n")
    _fails_naming(capsys, ["train", "--prompt-data", str(data), "--input-key", "query", "--label-key", "answer",
                           "--num-rollout", "1"], f"{data}, line 1: missing key 'query'")


def test_serve_on_a_port_it_cannot_have_says_so_before_loading(capsys):
    # was a traceback (OverflowError) or uvicorn's exit after the model had loaded
    _fails_naming(capsys, ["serve", "--port", "99999"], "--port 99999: must be in [0, 65535]")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        _fails_naming(capsys, ["serve", "--port", str(port)],
                      f"--port {port}: cannot listen there (Address already in use)")


@pytest.mark.parametrize("flag, value, least", [("--steps", "0", 1), ("--batch-size", "-4", 1), ("--lr", "-0.1", 0)])
def test_sft_budget_below_its_least_is_refused_before_training(capsys, tmp_path, flag, value, least):
    # --steps 0 trained nothing and saved the untrained model (without --output: over the bundled one)
    _fails_naming(capsys, ["sft", flag, value, "--output", str(tmp_path / "out")],
                  f"{flag} {value}: must be >= {least}")
    assert not (tmp_path / "out").exists()
