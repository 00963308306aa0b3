"""Lightning indexer of the C4 (compressed sparse attention) layers.

The indexer is itself an overlapping compressor at `index_head_dim` (its own kv/gate/position
bias/norm), plus a query projection from the attention's low-rank c_q and per-head weights:
    q_I = RoPE(W_qI c_q)            [S, H_I, D_I]
    w   = W_w h * H_I^-0.5           [S, H_I]
    score(p, j) = sum_h w_h * ReLU(q_I,h . k_j) * D_I^-0.5
Entries a query may not see yet score -inf; each query keeps the top min(index_topk, E)
entries and picks that land on -inf entries are dropped. Ties are broken towards the lower
entry index (a stable sort), so every caller selects the same set whatever the tensor shape.
Where E <= index_topk (a cache or a sequence of at most 4 x index_topk positions) every visible
entry is picked whatever the scores: `select` and `select_indices` then compute none (no query
projection, no scoring GEMM, no sort; the scores feed no loss), the same set.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.triton_support import trainer_kernel_runs

from . import index_scores_triton
from .compressor import Compressor
from .rope import apply_rope, rope_cos_sin
from .whole_rows import apply_linear


class IndexerScorer(nn.Module):
    def __init__(self, hidden_size: int, n_heads: int):
        super().__init__()
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False)


class Indexer(Compressor):
    def __init__(self, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int, topk: int,
                 compress_rate: int, norm_eps: float):
        super().__init__(hidden_size, head_dim, compress_rate, overlap=True, norm_eps=norm_eps)
        self.n_heads, self.topk = n_heads, topk
        self.q_b_proj = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.scorer = IndexerScorer(hidden_size, n_heads)

    def query(self, q_res: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """q_res [..., q_lora_rank] at positions [...] -> roped index queries [..., H_I, D_I]."""
        cos, sin = rope_cos_sin(inv_freq, positions)
        q = apply_linear(self.q_b_proj, q_res).view(*positions.shape, self.n_heads, self.head_dim)
        return apply_rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2), self.kernels.on("triton_rope"))

    def scaled_head_weights(self, head_weights: torch.Tensor) -> torch.Tensor:
        """scorer.weights_proj(h) -> the per-head score weights, fp32 (w_h * H_I^-0.5)."""
        return head_weights.float() * self.n_heads**-0.5

    def visible(self, positions: torch.Tensor, num_entries: int) -> torch.Tensor:
        """[..., E] bool: entry j has closed for a query at position p (j < (p + 1) // m)."""
        return torch.arange(num_entries, device=positions.device) < self.closed_entries(positions).unsqueeze(-1)

    def top_entries(self, scores: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top min(index_topk, E) entries by score, ties to the lower index -> (their indices
        [..., k], whether each is visible: a row with fewer than k visible entries picks some that
        are not)."""
        E = scores.shape[-1]
        scores = scores.masked_fill(~visible, float("-inf"))
        picks = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :min(self.topk, E)]
        return picks, visible.gather(-1, picks)

    def picks_all(self, num_entries: int) -> bool:
        """Whether every visible entry of E = num_entries is picked, whatever the scores."""
        return num_entries <= self.topk

    def picked(self, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """[..., E] bool: the top min(index_topk, E) visible entries by score, ties to the lower index."""
        E = scores.shape[-1]
        picks, keep = self.top_entries(scores, visible)
        # invalid picks go to a spare column E that is dropped afterwards
        mask = torch.zeros(*scores.shape[:-1], E + 1, dtype=torch.bool, device=scores.device)
        mask.scatter_(-1, torch.where(keep, picks, torch.full_like(picks, E)), True)
        return mask[..., :E]

    def select(self, head_weights: torch.Tensor, q_res: torch.Tensor, positions: torch.Tensor,
               keys: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """Additive bias [N, S, E] over the compressed entries: 0 where selected, -inf elsewhere.
        head_weights [N, S, H_I] = scorer.weights_proj(h), q_res [N, S, q_lora_rank],
        positions [N, S], keys [N, E, D_I].
        """
        visible = self.visible(positions, keys.shape[1])
        chosen = visible if self.picks_all(keys.shape[1]) else \
            self.picked(self.scores(head_weights, q_res, positions, keys, inv_freq), visible)
        return torch.zeros(chosen.shape, device=keys.device).masked_fill(~chosen, float("-inf"))

    def select_indices(self, head_weights: torch.Tensor, q_res: torch.Tensor, positions: torch.Tensor,
                       keys: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """`select`'s entries as indices [N, S, min(index_topk, E)] (-1: a pick on an entry not
        visible yet, dropped), for attention that reads the picked entries only. Where every visible
        entry is picked they come in entry order, not by score."""
        E = keys.shape[1]
        visible = self.visible(positions, E)
        if self.picks_all(E):
            return torch.where(visible, torch.arange(E, device=keys.device), -1)
        picks, keep = self.top_entries(self.scores(head_weights, q_res, positions, keys, inv_freq), visible)
        return torch.where(keep, picks, -1)

    def scores(self, head_weights: torch.Tensor, q_res: torch.Tensor, positions: torch.Tensor,
               keys: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """score(p, j) [N, S, E] fp32 (module docstring); entries not visible yet score -inf through
        the kernel (the triton_index switch) and their value otherwise: callers mask them either way."""
        if index_scores_triton.triton is not None and trainer_kernel_runs(keys, self.kernels.on("triton_index")):
            return self.kernel_scores(head_weights, q_res, positions, keys, inv_freq)
        q = self.query(q_res, positions, inv_freq)
        dots = F.relu(torch.einsum("nshd,ned->nshe", q.float(), keys.float())) * self.head_dim**-0.5
        return (dots * self.scaled_head_weights(head_weights).unsqueeze(-1)).sum(dim=2)

    @torch.no_grad()  # the scores pick entries; no loss reads them, so no gradient through them
    def kernel_scores(self, head_weights: torch.Tensor, q_res: torch.Tensor, positions: torch.Tensor,
                      keys: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """`scores` through index_scores_triton's kernel: row (n, s) reads sequence n's E entries, the
        first closed_entries(p) of them (the rest -inf)."""
        N, S = positions.shape
        E = keys.shape[1]
        q = self.query(q_res, positions, inv_freq)
        dtype = torch.promote_types(q.dtype, keys.dtype)
        base = (torch.arange(N, device=keys.device) * E).repeat_interleave(S)
        count = self.closed_entries(positions).clamp(max=E).reshape(-1)
        out = index_scores_triton.index_scores(
            q.reshape(N * S, self.n_heads, self.head_dim).to(dtype),
            self.scaled_head_weights(head_weights).reshape(N * S, self.n_heads),
            keys.reshape(N * E, self.head_dim).to(dtype), base, count, E)
        return out.view(N, S, E)
