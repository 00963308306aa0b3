"""Which tensors stay fp32 when a model runs in a lower dtype: the one rule for engine, trainer and loader.

The rule is transformers 5.23's (`PreTrainedModel._get_dtype_plan` + `core_model_loading`), so
that a lockstep model and `from_pretrained(dtype=...)` of the same checkpoint hold every tensor
in the same dtype:

  * a model declares name patterns in `_keep_in_fp32_modules_strict` (kept fp32 under bf16 and
    fp16) and `_keep_in_fp32_modules` (kept fp32 under fp16 only: transformers uses it to avoid
    bf16 -> fp16 overflow, and it has no effect at bf16);
  * a pattern is a regular expression with `*` standing for `.*`, searched anywhere in the
    tensor's full name (`re.search`), e.g. "norm" keeps `model.layers.0.self_attn.kv_norm.weight`;
  * parameters and persistent buffers are cast; non-persistent buffers are derived values
    (transformers leaves RoPE `inv_freq` in fp32 as it was built) and keep their dtype.
"""

from __future__ import annotations

import re
from functools import lru_cache

import torch

_STRICT = "_keep_in_fp32_modules_strict"
_FP16_ONLY = "_keep_in_fp32_modules"


def _model_or_class(model_or_type):
    """A model (or class) as given; a config.json `model_type` string -> its registered class."""
    if not isinstance(model_or_type, str):
        return model_or_type
    from lockstep.models import registry

    return registry.model_class(model_or_type)


def fp32_patterns(model_or_type, dtype: torch.dtype) -> tuple[str, ...]:
    """The name patterns kept in fp32 when the model is cast to `dtype` (none for fp32 itself)."""
    owner = _model_or_class(model_or_type)
    attrs = {torch.bfloat16: (_STRICT,), torch.float16: (_STRICT, _FP16_ONLY)}.get(dtype, ())
    pats = [p for attr in attrs for p in (getattr(owner, attr, None) or ())]
    return tuple(dict.fromkeys(pats))


@lru_cache(maxsize=256)
def _compiled(patterns: tuple[str, ...]) -> re.Pattern | None:
    return re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in patterns)) if patterns else None


def keeps_fp32(model_or_type, name: str, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether tensor `name` (in-memory name) stays fp32 when the model is cast to `dtype`."""
    regex = _compiled(fp32_patterns(model_or_type, dtype))
    return regex is not None and regex.search(name) is not None


def storage_dtype(model_or_type, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a floating tensor `name` is held in when the model is cast to `dtype`."""
    return torch.float32 if keeps_fp32(model_or_type, name, dtype) else dtype


def model_tensors(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], set[str]]:
    """(parameters + persistent buffers, de-duplicated; names that alias another, e.g. tied lm_head)."""
    tensors = {n: p.data for n, p in model.named_parameters()}
    for name, buf in model.named_buffers():
        mod, _, leaf = name.rpartition(".")
        owner = model.get_submodule(mod) if mod else model
        if leaf not in owner._non_persistent_buffers_set:
            tensors[name] = buf
    return tensors, set(model.state_dict().keys()) - set(tensors)


@torch.no_grad()
def cast_model(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast floating parameters and persistent buffers to `dtype`, except those kept in fp32."""
    tensors, _ = model_tensors(model)
    for name, t in tensors.items():
        if t.is_floating_point():
            target = storage_dtype(model, name, dtype)
            mod, _, leaf = name.rpartition(".")
            owner = model.get_submodule(mod) if mod else model
            param = owner._parameters.get(leaf)
            if param is not None and type(t) is not torch.Tensor:
                # a tensor subclass (a DTensor shard of expert-parallel experts): assigning .data
                # changes its declared dtype but not its local tensor, so it gets a new Parameter
                owner._parameters[leaf] = torch.nn.Parameter(t.to(target), requires_grad=param.requires_grad)
            elif param is not None:
                param.data = t.to(target)
            else:
                owner._buffers[leaf] = t.to(target)
    return model
