"""Supervised fine-tuning: cross-entropy on response tokens of (prompt, answer) pairs.

Used as the warm start of the embedded default (a model that solves some arithmetic but not
most, so RL has something to learn). Loss = mean over response tokens of -log p(token);
prompts go through the tokenizer's chat template exactly as the rollout engine sends them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from lockstep.prompt_encoding import encode_prompt


@dataclass
class SFTExample:
    prompt_ids: list[int]
    response_ids: list[int]  # ends with eos


def make_examples(tokenizer, pairs: Sequence[tuple[object, str]]) -> list[SFTExample]:
    eos = tokenizer.eos_token_id
    return [SFTExample(encode_prompt(tokenizer, p), tokenizer.encode(a, add_special_tokens=False) + [eos])
            for p, a in pairs]


def collate(batch: Sequence[SFTExample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [B, S] tokens and a [B, S-1] mask of the positions that predict response tokens."""
    seqs = [e.prompt_ids + e.response_ids for e in batch]
    S = max(map(len, seqs))
    ids = torch.full((len(batch), S), pad_id, dtype=torch.long)
    mask = torch.zeros(len(batch), S - 1)
    for i, (e, s) in enumerate(zip(batch, seqs)):
        ids[i, : len(s)] = torch.tensor(s)
        p = len(e.prompt_ids)
        mask[i, p - 1: len(s) - 1] = 1  # position t predicts token t+1
    return ids, mask


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _forward(model, ids: torch.Tensor, autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """Logits of `ids` moved to the model's device; with `autocast_dtype` the matmuls run in it while
    the weights (and so AdamW's updates) stay in their own, float32, dtype."""
    device = _device(model)
    with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        return model(ids.to(device))


def sft_loss(model, ids: torch.Tensor, mask: torch.Tensor, autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    ids, mask = ids.to(_device(model)), mask.to(_device(model))
    logits = _forward(model, ids, autocast_dtype)[:, :-1].float()
    logp = F.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return -(logp * mask).sum() / mask.sum()


def run_sft(model, examples: list[SFTExample], *, steps: int, batch_size: int, lr: float, pad_id: int,
            seed: int = 0, on_step: Callable[[int, float], bool | None] | None = None,
            autocast_dtype: torch.dtype | None = None) -> None:
    """AdamW over shuffled mini-batches on the model's device; `on_step(step, loss)` may return True
    to stop early."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
    model.train()
    for step in range(steps):
        ids, mask = collate(rng.sample(examples, batch_size), pad_id)
        loss = sft_loss(model, ids, mask, autocast_dtype)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if on_step is not None and on_step(step, loss.item()):
            break
    model.eval()


@torch.no_grad()
def greedy_accuracy(model, examples: list[SFTExample], pad_id: int, batch_size: int = 256,
                    autocast_dtype: torch.dtype | None = None) -> float:
    """Fraction of examples whose whole response is the argmax at every position under teacher
    forcing — exactly the examples greedy decoding reproduces token for token."""
    model.eval()
    hits = 0
    for i in range(0, len(examples), batch_size):
        ids, mask = collate(examples[i:i + batch_size], pad_id)
        pred = _forward(model, ids, autocast_dtype)[:, :-1].argmax(-1).cpu()
        hits += int(((pred == ids[:, 1:]) | (mask == 0)).all(-1).sum())
    return hits / max(len(examples), 1)
