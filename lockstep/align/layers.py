"""Layer-level agreement: where along the depth do the training and rollout paths drift apart?

Runs the same tokens through the full-sequence forward (what the trainer computes) and through
the incremental forward one chunk at a time (what the engine computes), records every decoder
layer's output residual streams, and reports per layer the max and mean |difference|. The first
layer whose drift jumps is where to look (a kernel that depends on the chunking, a cache bug).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerDrift:
    layer: int
    max_abs: float
    mean_abs: float


def _record(model, store: list):
    def hook(module, args, output):
        store.append((module.layer_idx, output.detach().float()))
    return [layer.register_forward_hook(hook) for layer in model.model.layers]


@torch.no_grad()
def layer_drift(model, token_ids: list[int], chunk: int = 1) -> list[LayerDrift]:
    """Per-layer drift of a DeepSeek-V4 model between the full and the incremental path
    (chunks of `chunk` tokens) for one sequence."""
    from ..models.deepseek_v4 import StepBatch

    ids = torch.tensor([token_ids], device=model.lm_head.weight.device)
    full, steps = [], []
    handles = _record(model, full)
    try:
        model(ids)
    finally:
        for h in handles:
            h.remove()
    cache = model.new_cache(num_slots=1, max_len=len(token_ids) + 1)
    handles = _record(model, steps)
    try:
        for start in range(0, len(token_ids), chunk):
            piece = ids[:, start:start + chunk]
            batch = StepBatch(slots=torch.tensor([0], device=ids.device), start_pos=torch.tensor([start], device=ids.device),
                              num_new=torch.tensor([piece.shape[1]], device=ids.device))
            model.forward_step(piece, batch, cache)
    finally:
        for h in handles:
            h.remove()
    n_layers = len(model.model.layers)
    out = []
    for i in range(n_layers):
        a = next(t for j, t in full if j == i)
        b = torch.cat([t for j, t in steps if j == i], dim=1)
        d = (a - b).abs()
        out.append(LayerDrift(i, float(d.max()), float(d.mean())))
    return out
