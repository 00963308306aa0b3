"""Activation recomputation, applied from outside the model (DESIGN principle 3).

`apply_recompute(model)` makes every decoder layer in `model.model.layers` run under
`torch.utils.checkpoint` (non-reentrant): its forward keeps only the layer's inputs, and the
backward pass runs the layer again to rebuild the activations. Memory for activations drops
from O(layers x activations per layer) to O(layers x layer input + one layer's activations)
for the price of one extra forward (about +33% compute).

The layer object stays where it is: its class is swapped for a subclass whose `forward`
checkpoints the original (the same device torch.nn.utils.parametrize uses), so parameter and
state-dict names are unchanged and `remove_recompute` restores the class.

MoE layers: the recomputation must route every token to the experts it went to the first time,
or the rebuilt activations (even their shapes) differ; it takes the same code path (forced or
own routing) because non-reentrant checkpointing pairs saved tensors by order. Layers that take a
`routing` argument (DeepSeek-V4) run with a private `Routing` per call, so the recomputation's
choice is not appended to the caller's `Routing.chosen` a second time; it is compared with the
first run's and a difference (a non-deterministic router input) raises instead of giving wrong
gradients.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lockstep.models.deepseek_v4 import Routing

_CLASSES: dict[type, type] = {}


def _recompute_forward(self, *args, **kwargs):
    base_forward = _base_class(type(self)).forward
    if not torch.is_grad_enabled():
        return base_forward(self, *args, **kwargs)
    signature = inspect.signature(base_forward)
    if "routing" not in signature.parameters:
        return checkpoint(base_forward, self, *args, use_reentrant=False, **kwargs)
    caller: Routing | None = signature.bind(self, *args, **kwargs).arguments.get("routing")
    first: dict[str, torch.Tensor] = {}

    def run(*a, **kw):
        b = signature.bind(*a, **kw)
        local = Routing(forced=caller.forced if caller is not None else None)
        b.arguments["routing"] = local
        out = base_forward(*b.args, **b.kwargs)
        if "chosen" not in first:
            first["chosen"] = local.chosen[0]
        elif not torch.equal(first["chosen"], local.chosen[0]):
            raise RuntimeError(f"recomputation of layer {self.layer_idx} routed tokens to different experts "
                               "than its forward (non-deterministic router inputs); use routing replay")
        return out

    out = checkpoint(run, self, *args, use_reentrant=False, **kwargs)
    if caller is not None:
        caller.chosen.append(first["chosen"])
    return out


def _base_class(cls: type) -> type:
    return cls.__bases__[0] if cls in _CLASSES.values() else cls


def _recompute_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Recompute{cls.__name__}", (cls,), {"forward": _recompute_forward})
    return _CLASSES[cls]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no model.layers ModuleList to recompute")
    return layers


def apply_recompute(model: nn.Module) -> nn.Module:
    """Checkpoint every decoder layer of `model` (in place; idempotent). Returns the model."""
    layers = decoder_layers(model)
    for layer in layers:
        if type(layer) not in _CLASSES.values():
            layer.__class__ = _recompute_class(type(layer))
    return model


def remove_recompute(model: nn.Module) -> nn.Module:
    for layer in decoder_layers(model):
        layer.__class__ = _base_class(type(layer))
    return model


def is_recomputed(model: nn.Module) -> bool:
    return any(type(layer) in _CLASSES.values() for layer in decoder_layers(model))
