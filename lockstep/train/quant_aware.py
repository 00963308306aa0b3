"""Quantisation-aware forward: the trainer multiplies by the weights the engine will serve.

`apply_quant_aware(model, fmt)` registers a `torch.nn.utils.parametrize` parametrisation on
every floating parameter that the serving format quantises. The storage rule is the engine's
(`lockstep.quant.serving_format.serving_storage`: DeepSeek-V4 names per
`lockstep.quant.formats`, dense Llama / Qwen3 names by their own rule), so both sides agree:

    storage   forward uses                                    tensors
    FP8       dequant(quant_fp8(w)), 128x128 blocks, ue8m0      attention / indexer / shared linears;
                                                                routed experts under "fp8"
    FP4       dequant(quant_fp4(w)), 1x32 blocks, e8m0          routed experts under "fp8-fp4"
    BF16/FP32 w (untouched)                                     embeddings, head, norms, router, mHC, ...

BF16 / FP32 storage is served unquantised in the engine's dtype (`served_value`), which is the
trainer's dtype, so those tensors need nothing. Stacked experts [E, out, in] are quantised per
expert (blocks never cross experts). Gradients are straight-through: dL/dw = dL/dq, so the
update lands on the unquantised master weight.

Parametrisation moves `x.weight` to `x.parametrizations.weight.original`; `canonical_name` maps
such names back, so state dicts, weight sync and checkpoints keep the original names.
"""

from __future__ import annotations

import re

import torch
from torch import nn
from torch.nn.utils import parametrize

from lockstep.quant.serving_format import serving_storage as served_storage
from lockstep.quant.fake_quant import fake_quant_fp4, fake_quant_fp8
from lockstep.quant.formats import Storage, UnknownTensorError

_PARAMETRIZED = re.compile(r"\.parametrizations\.(\w+)\.original$")


def canonical_name(name: str) -> str:
    """`a.parametrizations.weight.original` -> `a.weight`; other names unchanged."""
    return _PARAMETRIZED.sub(r".\1", name)


class FakeQuant(nn.Module):
    """Parametrisation: w -> the served weight (see the module docstring), straight-through."""

    def __init__(self, storage: Storage):
        super().__init__()
        self.storage = storage

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        if self.storage == Storage.FP8:
            return fake_quant_fp8(w)
        if self.storage == Storage.FP4:
            return fake_quant_fp4(w)
        return w

    def extra_repr(self) -> str:
        return f"storage={self.storage.value}"


def serving_storage(name: str, fmt: str) -> Storage:
    """Storage of parameter `name` when served in `fmt` (the engine's rule; unknown names: BF16)."""
    try:
        return served_storage(name, fmt)
    except UnknownTensorError:
        return Storage.BF16


def apply_quant_aware(model: nn.Module, fmt: str) -> nn.Module:
    """Parametrise `model` (in place) so its forward uses `fmt`-served weights. Returns the model."""
    if is_quant_aware(model):
        raise ValueError("model already has a quantisation-aware forward")
    for mod_name, module in list(model.named_modules()):
        for p_name, param in list(module.named_parameters(recurse=False)):
            if not param.is_floating_point():
                continue
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            storage = serving_storage(name, fmt)
            if storage in (Storage.FP8, Storage.FP4):
                parametrize.register_parametrization(module, p_name, FakeQuant(storage), unsafe=True)
    return model


def remove_quant_aware(model: nn.Module) -> nn.Module:
    """Undo `apply_quant_aware`, keeping the unquantised (master) weights."""
    for module in list(model.modules()):
        if parametrize.is_parametrized(module):
            for p_name in list(module.parametrizations.keys()):
                parametrize.remove_parametrizations(module, p_name, leave_parametrized=False)
    return model


def is_quant_aware(model: nn.Module) -> bool:
    return any(parametrize.is_parametrized(m) for m in model.modules())
