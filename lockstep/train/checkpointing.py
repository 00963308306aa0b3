"""Trainer checkpoints: weights, optimiser state, RNG states, step counter.

Layout of a checkpoint directory:

    model.safetensors   every tensor of `Trainer.named_weights()` (parameters and policy buffers,
                        state-dict names, model dtype). Tied tensors are stored once; the other
                        names are listed in the metadata entry "aliases" (JSON {alias: stored name}).
    optimizer.pt        `MasterAdamW.state_dict()`: moments, fp32 masters (when they are copies), step
    trainer.pt          {"num_steps", "rng": torch / cuda / python / numpy states, "config": dict}
    trainer.rankR.pt    the same for trainer rank R > 0 of a multi-process save (`trainer_file`): each
                        rank's own RNG states; a rank without its file (another process count) takes
                        trainer.pt

The weights and the optimiser state are always the whole model's, whoever wrote them (one process,
FSDP's ranks, pipeline stages), so any process count loads any save.

Loading copies values into the existing tensors (same objects, same devices and dtypes), so the
model, its wrappers and the optimiser's references stay valid.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

WEIGHTS, OPTIMIZER, TRAINER = "model.safetensors", "optimizer.pt", "trainer.pt"


def save_weights(named: Iterable[tuple[str, torch.Tensor]], path: Path) -> None:
    tensors, aliases, by_storage = {}, {}, {}
    for name, t in named:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key in by_storage:
            aliases[name] = by_storage[key]
            continue
        by_storage[key] = name
        tensors[name] = t.detach().contiguous().cpu()
    save_file(tensors, str(path), metadata={"aliases": json.dumps(aliases)})


@torch.no_grad()
def load_weights(named: Iterable[tuple[str, torch.Tensor]], path: Path, partial: bool = False) -> list[str]:
    """Copy the file's tensors into `named` (name -> live tensor); every name must be present.
    The file's names that no target takes are an error, or with `partial` (a pipeline stage, which
    holds part of the model) returned, for the caller to check that another stage takes them."""
    targets = dict(named)
    with safe_open(str(path), framework="pt") as f:
        aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
        stored = set(f.keys())
        missing = [n for n in targets if n not in stored and aliases.get(n) not in stored]
        taken = set(targets) | {aliases[n] for n in targets if n in aliases}
        unexpected = [n for n in f.keys() if n not in taken]
        if missing or (unexpected and not partial):
            raise KeyError(f"{path}: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name, dst in targets.items():
            dst.copy_(f.get_tensor(aliases.get(name, name)))
    return unexpected


def trainer_file(rank: int) -> str:
    """The trainer-state file of trainer rank `rank` (ranks may draw different random numbers;
    rank 0's is the one-process file)."""
    return TRAINER if rank == 0 else f"trainer.rank{rank}.pt"


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_trainer_state(path: Path, num_steps: int, config: dict) -> None:
    torch.save({"num_steps": num_steps, "rng": rng_state(), "config": config}, path)


def load_trainer_state(path: Path) -> dict:
    state = torch.load(path, weights_only=False)
    set_rng_state(state["rng"])
    return state
