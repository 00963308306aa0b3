"""Per-token logprobs of response tokens, and micro-batch packing.

Logprob definition (shared with the engine, `lockstep.config.SamplingParams`): for sample i with
prompt length P and response length R, the response token y_t (t = 0..R-1) sits at packed
position P + t and is predicted by the logits z of position P - 1 + t:

    logp_t = log_softmax(z / temperature)[y_t]            over the FULL vocabulary, in float32
    H_t    = logsumexp(z') - sum softmax(z') * z'          z' = z / temperature (entropy, float32)

Packing: `pack_microbatches(samples, max_tokens_per_gpu)` walks the samples in order and starts a
new micro-batch when the next sample's P + R tokens would push the current one past the budget;
a sample longer than the budget gets a micro-batch of its own. Sequences are concatenated, with
`cu_seqlens` [b + 1] marking where each starts, and the response tokens of the micro-batch form
a second packed layout (`response_cu_seqlens`) that the loss and aggregation functions use.
Loss normalisers are computed once over the global batch (trainer), so the update does not depend
on how the samples were split.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from lockstep.models.layers import logprob_entropy_triton
from lockstep.sample import Sample
from lockstep.train.aggregation import pack
from lockstep.train.losses import entropy_from_logits
from lockstep.transfer import to_device


@dataclass
class MicroBatch:
    """Samples `indices` of the global batch, packed (b samples, T tokens, T_r response tokens).

    input_ids [T] int64, cu_seqlens [b + 1]; logit_index [T_r]: packed position whose logits
    predict each response token; targets [T_r]; loss_mask [T_r] float32; response_cu_seqlens
    [b + 1]; prompt_lens / response_lens: python ints per sample."""

    indices: list[int]
    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    logit_index: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    response_cu_seqlens: torch.Tensor
    prompt_lens: list[int]
    response_lens: list[int]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def split_responses(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Packed per-response-token values [T_r] -> one [R_i] tensor per sample."""
        return list(values.split(self.response_lens))

    def gather(self, per_sample: Sequence[torch.Tensor], device=None) -> torch.Tensor:
        """Per-sample [R_i] tensors of the global batch -> this micro-batch's packed [T_r]."""
        flat, _ = pack([torch.as_tensor(per_sample[i]).reshape(-1) for i in self.indices])
        return to_device(flat, device, flat.dtype) if device is not None else flat


def _make_microbatch(samples: Sequence[Sample], indices: list[int]) -> MicroBatch:
    chosen = [samples[i] for i in indices]
    input_ids, cu = pack([s.tokens for s in chosen])
    starts = cu[:-1].tolist()
    logit_index = torch.cat([torch.arange(st + s.prompt_ids.numel() - 1, st + s.num_tokens - 1)
                             for st, s in zip(starts, chosen)])
    targets, response_cu = pack([s.response_ids for s in chosen])
    mask, _ = pack([s.loss_mask for s in chosen])
    return MicroBatch(indices=indices, input_ids=input_ids.long(), cu_seqlens=cu, logit_index=logit_index,
                      targets=targets.long(), loss_mask=mask.float(), response_cu_seqlens=response_cu,
                      prompt_lens=[s.prompt_ids.numel() for s in chosen], response_lens=[s.response_len for s in chosen])


def pack_microbatches(samples: Sequence[Sample], max_tokens_per_gpu: int) -> list[MicroBatch]:
    """Greedy in-order packing: no micro-batch holds more than max_tokens_per_gpu tokens unless it
    is a single sample longer than the budget."""
    if max_tokens_per_gpu < 1:
        raise ValueError(f"max_tokens_per_gpu must be >= 1, got {max_tokens_per_gpu}")
    for i, s in enumerate(samples):
        if s.prompt_ids.numel() < 1 or s.response_len < 1:
            raise ValueError(f"sample {i}: needs at least one prompt and one response token")
    groups: list[list[int]] = []
    used = 0
    for i, s in enumerate(samples):
        if groups and used + s.num_tokens <= max_tokens_per_gpu:
            groups[-1].append(i)
            used += s.num_tokens
        else:
            groups.append([i])
            used = s.num_tokens
    return [_make_microbatch(samples, g) for g in groups]


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   fused: bool | None = False) -> torch.Tensor:
    """log softmax(logits / temperature)[targets] in float32; logits [T, V], targets [T] -> [T].
    fused: the fused_logprobs switch (KernelSwitches: None on CUDA, True also the interpreter): one
    Triton kernel where it runs (logprob_entropy_triton.py)."""
    if logprob_entropy_triton.applies(logits, fused):
        return logprob_entropy_triton.token_logprobs_and_entropy(logits, targets, temperature)[0]
    z = logits.float() / temperature
    return torch.log_softmax(z, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_logprobs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, with_entropy_grad: bool = False,
    fused: bool | None = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp [T], entropy [T]) of the temperature-scaled distribution; the entropy carries a
    gradient only when with_entropy_grad (an entropy bonus is being trained). fused: as token_logprobs."""
    if logprob_entropy_triton.applies(logits, fused):
        return logprob_entropy_triton.token_logprobs_and_entropy(logits, targets, temperature, with_entropy_grad)
    logp = token_logprobs(logits, targets, temperature)
    if with_entropy_grad:
        return logp, entropy_from_logits(logits.float() / temperature)
    with torch.no_grad():
        return logp, entropy_from_logits(logits.detach().float() / temperature)


def accepts(model: nn.Module, arg: str) -> bool:
    """Whether model.forward takes keyword `arg` (e.g. routing, cu_seqlens)."""
    return arg in inspect.signature(model.forward).parameters


def forward_packed(model: nn.Module, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, routing=None,
                   logit_index: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [T, V] of packed sequences, or [len(logit_index), V] of those packed positions. Models
    that take `cu_seqlens` get the packed ids (and `logit_index` where they take it: their head
    then runs on those rows only); others get a right-padded [b, S] batch (causal rows from
    position 0: padding never reaches a real token)."""
    if accepts(model, "cu_seqlens"):
        kwargs = {"routing": routing} if routing is not None else {}
        if logit_index is not None and accepts(model, "logit_index"):
            return model(input_ids, cu_seqlens=cu_seqlens, logit_index=logit_index, **kwargs)
        logits = model(input_ids, cu_seqlens=cu_seqlens, **kwargs)
    else:
        if routing is not None:
            raise ValueError(f"{type(model).__name__} does not take a routing argument")
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        padded = nn.utils.rnn.pad_sequence(list(input_ids.split(lens)), batch_first=True)
        keep = torch.arange(padded.shape[1], device=input_ids.device) < torch.tensor(lens, device=input_ids.device)[:, None]
        logits = model(padded)[keep]
    return logits if logit_index is None else logits[logit_index.to(logits.device)]


def microbatch_logits(model: nn.Module, mb: MicroBatch, device, routing=None) -> torch.Tensor:
    """Logits [T_r, V] that predict the micro-batch's response tokens."""
    # cu_seqlens and logit_index stay on the host: the model reads lengths and rows from them
    return forward_packed(model, to_device(mb.input_ids, device), mb.cu_seqlens, routing, mb.logit_index)
