"""Saving lockstep-named tensors as a Hugging Face style directory (see checkpoint.py for loading).

`save_state_dict` writes config.json (`config.to_hf_dict()`) and safetensors in the layout
transformers 5.23's `save_pretrained` writes (or DeepSeek's official one), sharded with
`model.safetensors.index.json` above `max_shard_size` (written by quant/safetensors_io.py's
`write_index`, as conversion writes it), so that `load_pretrained` and
`transformers.AutoModelForCausalLM.from_pretrained` both read it back to identical tensors.
"""

from __future__ import annotations

import json
import re
import shutil
from collections import defaultdict
from pathlib import Path

import torch
from safetensors.torch import save_file

from lockstep.models import registry
from lockstep.models.checkpoint import TOKENIZER_FILES, _expert_windows
from lockstep.models.key_maps import KEY_MAPS
from lockstep.models.precision import model_tensors
from lockstep.quant.safetensors_io import INDEX_NAME, write_index

def _parse_size(size) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B)\s*", str(size), re.I)
    if not m:
        raise ValueError(f"max_shard_size {size!r}: use bytes or e.g. '5GB', '500MB', '4GiB'")
    unit = m.group(2).upper()
    base = 1024 if "I" in unit else 1000
    return int(float(m.group(1)) * base ** "KMG".index(unit[0]) * base)


def _dedupe(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop tensors that alias an earlier one (tied lm_head), as transformers does on save."""
    seen, out = set(), {}
    for name, t in state_dict.items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
        if key not in seen:
            seen.add(key)
            out[name] = t
    return out


def _clear_old_weights(path: Path):
    for f in [*path.glob("model*.safetensors"), path / INDEX_NAME]:
        if f.exists():
            f.unlink()


def _config_dict(config, state_dict) -> dict:
    d = config.to_hf_dict()
    if "dtype" not in d:  # the dtype most of the weights are in, as transformers records it
        counts = defaultdict(int)
        for t in state_dict.values():
            if t.is_floating_point():
                counts[t.dtype] += t.numel()
        if counts:
            d["dtype"] = str(max(counts, key=counts.get)).removeprefix("torch.")
    return d


def save_state_dict(state_dict: dict[str, torch.Tensor], config, path, *, max_shard_size="5GB",
                    layout: str = "transformers", tokenizer_dir=None) -> None:
    """Write config.json + safetensors in `layout` ("transformers": what transformers 5.23's
    save_pretrained writes; "official": DeepSeek's release names) from lockstep-named tensors."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    key_map = KEY_MAPS[registry.entry(config.model_type).key_map]
    state_dict = _dedupe(state_dict)
    if getattr(config, "tie_word_embeddings", False):
        state_dict.pop("lm_head.weight", None)
    limit, shards, size = _parse_size(max_shard_size), [{}], 0
    for name, t in state_dict.items():
        for ckpt_name, part in key_map.to_checkpoint(name, t.detach(), layout):
            nbytes = part.numel() * part.element_size()
            if shards[-1] and size + nbytes > limit:
                shards.append({})
                size = 0
            shards[-1][ckpt_name] = part.to("cpu").contiguous()
            size += nbytes
    _clear_old_weights(path)
    (path / "config.json").write_text(json.dumps(_config_dict(config, state_dict), indent=2, sort_keys=True) + "\n")
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map, total = {}, 0
        for k, shard in enumerate(shards):
            file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
            total += sum(t.numel() * t.element_size() for t in shard.values())
        write_index(path, weight_map, total)
    if tokenizer_dir is not None and Path(tokenizer_dir).resolve() != path.resolve():
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).exists():
                shutil.copyfile(Path(tokenizer_dir) / name, path / name)


def save_pretrained(model: torch.nn.Module, path, *, max_shard_size="5GB", tokenizer_dir=None,
                    layout: str = "transformers") -> None:
    """Save a lockstep model so that `load_pretrained` and transformers' `from_pretrained` both read it.

    Tokenizer files are copied from `tokenizer_dir`, or from the directory the model was loaded from.
    """
    windows = _expert_windows(model)
    if windows:  # its experts would be written as experts 0.. of a smaller model
        name, experts = next(iter(windows.items()))
        raise ValueError(f"cannot save a model holding only experts {experts.rows} of {experts.n_experts} "
                         f"({name}): save the full model's tensors")
    tensors, _ = model_tensors(model)
    save_state_dict(tensors, model.config, path, max_shard_size=max_shard_size, layout=layout,
                    tokenizer_dir=tokenizer_dir or getattr(model, "source_dir", None))
