"""An in-process weight update's device work replayed from a CUDA graph.

A colocated RL loop pushes the same tensors (the trainer's parameters, updated in place: the same
names, dtypes, shapes and addresses) into the same engine every step. The update's device work then
does not change from one push to the next: reset the gate, the finiteness kernel, the hash tables'
range check, the write gated on them (weight_update.update_weights). Launched one by one, that is
host work the device waits on before its first kernel: each Triton launch binds its arguments in
Python, each torch op dispatches. Captured once in a CUDA graph, a later update with the same key
is one graph launch; the host then reads the gate as before, so every failure is still reported and
still leaves the model untouched (the graph's write is gated on its checks).

The key (`replay_key`) is all the captured launches depend on: the serving format, the update's
Layout (names, dtypes, devices, shapes: its host checks were made for it), whether it is partial,
its Sources (every tensor's address, and whether all are contiguous: with the shapes, their
strides) and the switches that choose its kernels. The engine's own tensors never move. A key is
captured the second time it is seen (the first run compiled every kernel and kept their launches)
and replayed from the third.

Off CUDA (the CPU tests, the update's kernels under Triton's interpreter) the stand-in for the graph
is the captured launch function itself, called again with the tensors it captured (as the graph reads
their addresses); its fresh checks are returned. REPLAY on: on one H100 (2026-12-05,
benchmarks/weight_update_parts.py --config gpu-848m) the update with the walk took 1.983 ms replayed
against 2.167 launched (1.76 / 1.92 of the copy bound), fp8 --packed 2.192 against 2.549 (1.94 / 2.26).
"""

from __future__ import annotations

from typing import Callable

import torch

from lockstep import tensor_tables
from lockstep.engine.value_checks import DeviceChecks

REPLAY = True  # update_weights replays repeated updates (UpdateTargets.replays)
MAX_KEYS = 4  # keys seen or captured per engine: a push sends one layout from one set of tensors

Launch = Callable[[], tuple[DeviceChecks, bool]]  # an update's launches -> (its checks, whether it wrote)


def replay_key(fmt: str, layout: tuple, partial: bool, sources, switches: tuple) -> tuple:
    """What an update's captured launches depend on (module docstring); `switches`: the module flags
    that choose its launches (a benchmark or test turning one off must not replay a graph of the other)."""
    return fmt, layout, partial, sources, switches


def replayable(checks: DeviceChecks, written: bool) -> bool:
    """An update whose whole device work can be replayed: its write was made gated on its checks."""
    return written and checks.gate is not None


class UpdateReplays:
    """Per replay key: seen once, or captured (a CUDA graph, or off CUDA the launch function) with
    the checks the capture's launches fill."""

    def __init__(self):
        self._seen: set[tuple] = set()
        self._kept: dict[tuple, tuple] = {}  # key -> (a CUDA graph or the launch function, its checks, held)
        self.replays = 0  # updates replayed (the tests read it)

    def run(self, key: tuple, launch: Launch) -> tuple[DeviceChecks, bool]:
        """The update's checks and whether its write was made (launched, not read): replayed where
        `key` was captured, else launch() (captured for the next update the second time)."""
        kept = self._kept.get(key)
        if kept is not None:
            self.replays += 1
            return self._replay(*kept[:2]), True
        checks, written = launch()
        if replayable(checks, written):
            self._note(key, launch, checks.gate.is_cuda)
        return checks, written

    def _replay(self, graph, checks: DeviceChecks) -> DeviceChecks:
        if isinstance(graph, torch.cuda.CUDAGraph):
            graph.replay()
            return checks
        return graph()[0]  # the stand-in: the captured launches again, their fresh checks

    def _note(self, key: tuple, launch: Launch, on_cuda: bool) -> None:
        """A replayable update launched: the second of its key is captured for the next (the first
        compiled its kernels and kept their launches)."""
        if key not in self._seen:
            if len(self._seen) >= MAX_KEYS:
                self._seen.clear()
            self._seen.add(key)
            return
        if len(self._kept) >= MAX_KEYS:
            self._kept.pop(next(iter(self._kept)))
        self._kept[key] = self._capture(launch) if on_cuda else (launch, None, [])

    @staticmethod
    def _capture(launch: Launch) -> tuple[torch.cuda.CUDAGraph, DeviceChecks, list]:
        """launch() recorded, not run (the update it stands for was just launched eagerly). What the
        graph reads outside its own memory pool: the update's tensors (the key's addresses), the
        engine's, and the kernels' device tables, held with the graph (tensor_tables.holding)."""
        graph = torch.cuda.CUDAGraph()
        # thread-local: another thread's CUDA calls (a server's) must not void the capture, nor it them
        with tensor_tables.holding() as held, torch.cuda.graph(graph, capture_error_mode="thread_local"):
            checks, _ = launch()
        return graph, checks, held
