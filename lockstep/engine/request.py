"""What a caller asks for (`GenerateRequest`) and the engine's runtime state of each sample (`Sequence`).

One request with `sampling.n = n` becomes n sequences (sample_index 0..n-1) that share a
`RequestState`. Sample 0 is the group's leader: it prefills the prompt, and its siblings are
`parked` on it until the prefill is done, then start from a copy of its cache state.

Token bookkeeping of a sequence (vLLM vocabulary):
    tokens        prompt + generated so far                       [prompt_len + num_output]
    num_computed  leading tokens whose KV/compressor state is in the cache
A step feeds tokens[num_computed : num_computed + num_new]; when that reaches the end of
`tokens` the last position's logits sample the next token. Preemption by recompute only
sets num_computed back to 0: prompt and generated tokens are fed again as a prefill.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch

from lockstep.config import SamplingParams


@dataclass
class GenerateRequest:
    prompt_ids: list[int]
    sampling: SamplingParams
    request_id: str | None = None  # None: a fresh uuid
    group_id: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.prompt_ids, torch.Tensor):
            self.prompt_ids = self.prompt_ids.tolist()
        self.prompt_ids = [int(t) for t in self.prompt_ids]
        if not self.prompt_ids:
            raise ValueError("GenerateRequest.prompt_ids: must hold at least one token")
        if self.request_id is None:
            self.request_id = uuid.uuid4().hex


class PromptTooLong(ValueError):
    """A request whose prompt leaves no room in max_model_len for one new token; `request` says which
    (the RL loop names the prompt's data row from it)."""

    def __init__(self, request: GenerateRequest, max_model_len: int):
        super().__init__(f"prompt of {len(request.prompt_ids)} tokens does not fit max_model_len={max_model_len} "
                         "(it must leave room for at least one new token)")
        self.request = request


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted: recompute from scratch)
    PARKED = "parked"  # a sibling waiting for its leader's prefill, to fork from it
    RUNNING = "running"  # holds cache memory
    FINISHED = "finished"


def sequence_seed(seed: int | None, sample_index: int) -> int:
    """Sample i of a request draws from its own stream, seed + i (see sampler.py), so what it
    samples does not depend on which other sequences share the batch. No seed: a random 62-bit one."""
    if seed is None:
        return int(torch.randint(0, 2**62, (1,)).item()) + sample_index
    return int(seed) + sample_index


class Sequence:
    """Runtime state of one sample of a request."""

    def __init__(self, request: GenerateRequest, sample_index: int, group: "RequestState", device="cpu"):
        self.request, self.sample_index, self.group = request, sample_index, group
        self.seq_id = f"{request.request_id}-{sample_index}"
        self.tokens: list[int] = list(request.prompt_ids)
        self.prompt_len = len(self.tokens)
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []  # per token, where sampling.top_logprobs > 0
        # routed experts as recorded: (first position, [S, L, k]) blocks of the positions from
        # prompt_len - 1 on, in the order computed (a recompute after preemption records again;
        # the later block wins). Row t of `routed_experts()` is position prompt_len - 1 + t,
        # the forward that produced response token t. Blocks, not rows: a decode window records
        # one block per sequence instead of K tensors.
        self.routed: list[tuple[int, torch.Tensor]] = []
        self.slot: int | None = None  # cache slot (DeepSeek-V4) or None
        self.block_table: list[int] = []  # paged caches (Llama)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.num_computed = 0
        self.weight_version = 0  # version that sampled the last token
        self.text: str | None = None  # decoded response, cut at a stop string
        self.seed = sequence_seed(request.sampling.seed, sample_index)  # draws: sampler.uniform(seed, t)
        self.parked: list[Sequence] = []  # siblings waiting to fork from this leader's prefill

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token: int, logprob: float, version: int,
                     alternatives: list[tuple[int, float]] | None = None) -> None:
        self.tokens.append(int(token))
        self.logprobs.append(float(logprob))
        if alternatives is not None:
            self.top_logprobs.append(alternatives)
        self.weight_version = version
        self.group.tokens_added(self, 1)

    def extend_tokens(self, tokens: list[int], logprobs: list[float], version: int) -> None:
        """append_token for several tokens at once (multi-step decode)."""
        self.tokens += tokens
        self.logprobs += logprobs
        self.weight_version = version
        self.group.tokens_added(self, len(tokens))

    def record_routing(self, first_pos: int, experts_SLk: torch.Tensor) -> None:
        """experts [S, L, k] of positions first_pos .. first_pos + S - 1; keep the response-producing ones."""
        skip = max(0, self.prompt_len - 1 - first_pos)
        if skip < experts_SLk.shape[0]:
            self.routed.append((first_pos + skip, experts_SLk[skip:]))

    def routed_experts(self, n_layers: int, top_k: int) -> torch.Tensor:
        """[R, L, k] int32: row t is the routing of position prompt_len - 1 + t."""
        lo, R = self.prompt_len - 1, self.num_output
        out = torch.full((R, n_layers, top_k), -1, dtype=torch.int32)
        for first, block in self.routed:  # in recording order: a recompute overwrites
            a, b = first - lo, min(first - lo + block.shape[0], R)
            if a < b:
                out[a:b] = block[:b - a]
        if R and (out[:, 0, 0] < 0).any():
            raise RuntimeError(f"{self.seq_id}: routed experts missing for some response positions")
        return out

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, {self.status.value}, tokens={len(self.tokens)}, "
                f"computed={self.num_computed}, slot={self.slot})")


class TokensAdded(NamedTuple):
    """The tokens a sequence just sampled (copies: the engine's thread goes on appending)."""

    ids: list[int]
    logprobs: list[float]
    alternatives: list[list[tuple[int, float]]] | None  # where the request asked for top_logprobs


class RequestState:
    """The n sequences of one request and who to tell when all of them have finished."""

    def __init__(self, request: GenerateRequest, device="cpu",
                 on_done: Callable[["RequestState"], None] | None = None,
                 on_tokens: Callable[[int, "TokensAdded"], None] | None = None):
        self.request = request
        self.on_done = on_done
        self.on_tokens = on_tokens  # (sample index, TokensAdded), in the engine's thread (streaming)
        self.sequences = [Sequence(request, i, self, device) for i in range(request.sampling.n)]
        self.samples: list | None = None  # filled by the engine when done
        self.error: BaseException | None = None  # or this, if the engine failed it
        self.num_finished = 0  # a count, not a scan: `finished` is asked once per finishing sequence

    def tokens_added(self, seq: Sequence, n: int) -> None:
        if self.on_tokens is not None and n:
            alternatives = seq.top_logprobs[-n:] if seq.sampling.top_logprobs else None
            self.on_tokens(seq.sample_index, TokensAdded(seq.tokens[-n:], seq.logprobs[-n:], alternatives))

    def mark_finished(self, seq: Sequence, reason: str | None) -> None:
        if not seq.is_finished:
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
            self.num_finished += 1

    @property
    def done(self) -> bool:
        return self.samples is not None or self.error is not None

    def result(self) -> list:
        if self.error is not None:
            raise self.error
        return self.samples

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.sequences)
