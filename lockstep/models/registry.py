"""config.json `model_type` -> (model class, config class, key map family).

Classes are named as "module:attr" strings and imported on first use, so loading a Llama
checkpoint never imports the DeepSeek-V4 model (and works before that module exists).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from lockstep.files import FieldError, naming, read_json


@dataclass(frozen=True)
class ModelEntry:
    model_cls: str
    config_cls: str
    key_map: str


_LLAMA = ModelEntry("lockstep.models.llama:LlamaForCausalLM", "lockstep.models.llama_config:LlamaConfig", "llama")
REGISTRY: dict[str, ModelEntry] = {
    "llama": _LLAMA,
    "qwen3": _LLAMA,
    "deepseek_v4": ModelEntry("lockstep.models.deepseek_v4:DeepseekV4ForCausalLM",
                              "lockstep.models.deepseek_v4_config:DeepseekV4Config", "deepseek_v4"),
}


def entry(model_type: str) -> ModelEntry:
    try:
        return REGISTRY[model_type]
    except KeyError:
        raise FieldError("config", "model_type", f"unsupported {model_type!r}; known: {sorted(REGISTRY)}") from None


def _import(spec: str):
    module, attr = spec.split(":")
    return getattr(importlib.import_module(module), attr)


def model_class(model_type: str):
    return _import(entry(model_type).model_cls)


def config_class(model_type: str):
    return _import(entry(model_type).config_cls)


def config_from_hf_dict(d: dict):
    """The lockstep config for a config.json dict, chosen by its `model_type`."""
    if not isinstance(d, dict):
        raise ValueError(f"must hold a JSON object, got {type(d).__name__}")
    if "model_type" not in d:
        raise FieldError("config", "model_type", "missing (it names the architecture, e.g. 'llama')")
    return config_class(d["model_type"]).from_hf_dict(d)


def config_from_file(file: str | Path):
    """The lockstep config a config.json file describes; any problem is a FileError naming the file."""
    with naming(file):
        return config_from_hf_dict(read_json(file))

