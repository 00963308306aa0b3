"""A module's state-dict tensors read where they live, without walking `state_dict()` each time.

A weight push reads every parameter and persistent buffer of the trainer's model by its state-dict
name, once per push. `model.state_dict()` builds that mapping anew each call by recursing through
every module (hooks, prefixes, an OrderedDict): ~0.5-1.2 ms of host time for gpu-848m's 242
tensors on this project's CPU machine, before the push's first launch, where the push's device
work is ~1 ms. `LiveState` walks once and keeps, per name, the module's own `_parameters` /
`_buffers` table and the attribute: reading through the table sees a parameter replaced
(`module.weight = ...`) or its data swapped (`param.data = ...`) as state_dict would.

Where state_dict's result is not the plain walk (a module overriding `_save_to_state_dict`, state-dict
hooks, e.g. FSDP's), `LiveState.of` returns None and the caller walks state_dict itself. A name whose
attribute is gone (a parametrization registered since: the weight moved to
`parametrizations.weight.original`) raises `StaleLiveState`; a module replaced in the tree is not
seen (the caller builds a new LiveState when it changes the tree).
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn


class StaleLiveState(RuntimeError):
    """A kept name's attribute is gone from its module: the tree changed since LiveState.of."""


def _plain_state_dict(module: nn.Module) -> bool:
    """state_dict of this module is its tables' entries, nothing added, dropped or renamed."""
    return (type(module)._save_to_state_dict is nn.Module._save_to_state_dict
            and not module._state_dict_hooks and not module._state_dict_pre_hooks)


class LiveState:
    def __init__(self, slots: list[tuple[str, dict, str]]):
        self.slots = slots  # (state-dict name, the module's _parameters or _buffers, attribute)

    @classmethod
    def of(cls, model: nn.Module) -> "LiveState | None":
        """The model's state-dict names in state_dict's order with where each lives, or None where a
        module's state_dict is not the plain walk (module docstring)."""
        where: dict[str, tuple[dict, str]] = {}
        for prefix, module in model.named_modules(remove_duplicate=False):
            if not _plain_state_dict(module):
                return None
            dot = prefix + "." if prefix else ""
            for attr in module._parameters:
                where[dot + attr] = (module._parameters, attr)
            for attr in module._buffers:
                if attr not in module._non_persistent_buffers_set:
                    where[dot + attr] = (module._buffers, attr)
        names = list(model.state_dict(keep_vars=True))
        if not set(names) <= set(where):
            return None
        return cls([(name, *where[name]) for name in names])

    def items(self, detached: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) as state_dict(keep_vars=True) gives them now (parameters as themselves), one
        at a time (nothing held past its turn); `detached`: each tensor's `.data`, as state_dict()
        gives them (in the same pass: a second generator over this one was a fifth of the trainer's walk). Every
        kept attribute is checked first, so a stale LiveState raises before anything is yielded."""
        for name, table, attr in self.slots:
            if attr not in table:
                raise StaleLiveState(f"{name}: no longer an attribute of its module (the module tree changed "
                                     f"since LiveState.of)")
        if detached:
            return ((name, table[attr].data) for name, table, attr in self.slots if table[attr] is not None)
        return ((name, table[attr]) for name, table, attr in self.slots if table[attr] is not None)
