"""The trainer's weights by their canonical names, walked every push (Trainer.named_weights).

A push walks every weight each step; `model.state_dict()` builds its mapping anew per call (~0.5-1
ms of host time on gpu-848m's 242 tensors, before the push's first launch). `WeightWalk` keeps a
`LiveState` (models/live_state.py) under the canonical names (a QAT weight's
`a.parametrizations.weight.original` is `a.weight`), in the model's own state-dict order, and walks
state_dict where the model's is not plain or a name is not found; a module tree changed since (a
parametrization registered) is walked anew.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from lockstep.models.live_state import LiveState, StaleLiveState
from lockstep.train.quant_aware import canonical_name


class WeightWalk:
    def __init__(self, model: nn.Module):
        self.model = model
        self.names = list(model.state_dict())  # the model's own order, before any wrapper
        self._live: LiveState | None | bool = None  # built at the first walk; False: state_dict each time

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(canonical name, `.data` of the tensor) in `names`' order, one at a time (nothing held past
        its turn)."""
        if self._live is None:
            self._live = self._live_state() or False
        if self._live:
            try:
                return self._live.items(detached=True)
            except StaleLiveState:  # the module tree changed: walk it anew
                self._live = self._live_state() or False
                return self.items()
        return self._state_dict_walk()

    def _state_dict_walk(self) -> Iterator[tuple[str, torch.Tensor]]:
        by_name = {canonical_name(n): t.data for n, t in self.model.state_dict(keep_vars=True).items()}
        for name in self.names:
            yield name, by_name.pop(name)

    def _live_state(self) -> LiveState | None:
        state = LiveState.of(self.model)
        if state is None:
            return None
        slot = {canonical_name(name): rest for name, *rest in state.slots}
        if not all(name in slot for name in self.names):
            return None  # names a wrapper changed: state_dict's walk
        return LiveState([(name, *slot[name]) for name in self.names])
