"""lockstep.models: the model definitions and their checkpoints.

Public names are imported on first use (PEP 562), so `import lockstep.models` stays cheap and
a model module that is still missing never breaks the others.
"""

import importlib

_EXPORTS = {
    "load_pretrained": "checkpoint",
    "load_state_dict": "checkpoint",
    "load_into": "checkpoint",
    "save_pretrained": "checkpoint",
    "save_state_dict": "checkpoint",
    "CheckpointError": "checkpoint",
    "LlamaForCausalLM": "llama",
    "PagedKVCache": "llama",
    "BatchMeta": "llama",
    "prepare_step": "llama",
    "LlamaConfig": "llama_config",
    "convert_gguf": "gguf",
    "smollm2_gguf_path": "gguf",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"lockstep.models.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'lockstep.models' has no attribute {name!r}")
