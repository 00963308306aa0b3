"""Core attention of DeepSeek-V4: one shared K=V head, a learnable per-head sink logit.

    out_h(p) = sum_k softmax_k([l_h(p, k)..., sink_h]) v_k       (the sink only adds mass
                                                                  to the denominator)
with l_h(p, k) = q_h(p) . k_k * scale + bias(p, k). The softmax runs in fp32 with the max
subtracted. The attended set is given entirely by the additive bias (0 or -inf), built from
positions, so the training forward, a prefill chunk and a decode step use the same function.

The training forward (`banded_sink_attention`) calls it per block of query positions, over the
keys that block can see: a query sees at most `window` positions, so scoring it against all S
positions (as the first trainer did) spent ~S / (2 * window) times the work and memory on masked
keys (1b config, 8 x 2048 tokens: an fp32 score matrix of 2.7 GB per layer, ~40% of the step).
"""

from __future__ import annotations

import torch


def window_bias(q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor, window: int) -> torch.Tensor:
    """[N, Sq, Sk] bias: key k is visible from query q iff q - window < k <= q (and k is valid)."""
    diff = q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)
    ok = (diff >= 0) & (diff < window) & k_valid.unsqueeze(-2)
    return torch.zeros(ok.shape, device=q_pos.device).masked_fill(~ok, float("-inf"))


def closed_block_bias(q_pos: torch.Tensor, num_entries: int, m: int) -> torch.Tensor:
    """[N, Sq, E] bias: entry j is visible from position p iff its block closed: j < (p+1) // m."""
    j = torch.arange(num_entries, device=q_pos.device)
    ok = j < ((q_pos + 1) // m).unsqueeze(-1)
    return torch.zeros(ok.shape, device=q_pos.device).masked_fill(~ok, float("-inf"))


def pad_keys(kv: torch.Tensor, bias: torch.Tensor, multiple: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad the key axis to a multiple of 8 with zero keys that no query sees (bias -inf). A decode
    step attends to window + 1 (+ compressed entries) keys, 129 in a window layer; with an odd
    count the [.., Sk] scores have unaligned rows and cuBLAS falls back to slow align-1 kernels
    (~7 us for a 64-token step's scores on an H200). Masked keys add exact zeros: same output."""
    pad = -kv.shape[1] % multiple  # no branch on it: under compile it would guard on the length
    return (torch.nn.functional.pad(kv, (0, 0, 0, pad)),
            torch.nn.functional.pad(bias, (0, pad), value=float("-inf")))


def sink_attention(q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, sinks: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [N, Sq, H, D], kv [N, Sk, D], bias [N, Sq, Sk], sinks [H] -> [N, Sq, H, D]."""
    N, Sq, H, _ = q.shape
    logits = torch.einsum("nqhd,nkd->nhqk", q, kv).float() * scale + bias.unsqueeze(1)
    sink = sinks.float().view(1, H, 1, 1).expand(N, H, Sq, 1)
    logits = torch.cat([logits, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.einsum("nhqk,nkd->nqhd", probs.to(kv.dtype), kv)


def banded_sink_attention(q: torch.Tensor, kv: torch.Tensor, window: int, sinks: torch.Tensor, scale: float,
                          entries: torch.Tensor | None = None, entry_bias: torch.Tensor | None = None) -> torch.Tensor:
    """`sink_attention` over whole sequences from position 0, computed block by block.

    q [N, S, H, D], kv [N, S, D] at positions 0..S-1; entries [N, E, D] (compressed keys every
    query may see) with entry_bias [N, S, E]. Queries go in blocks of B = W positions, the last
    padded (one block size whatever S: a compiled caller does not specialise on how S compares to
    the window); block b scores the 2W positions [bB - W, bB + B) (masked by `window_bias`, so the
    same rule as a decode step) plus the entries. A key outside a query's window is an exact zero in
    the dense form too, so each query's softmax holds the same terms. Where the blocks would score
    more keys than the dense form (S below ~2.4 W, e.g. RL's short responses), the dense form runs.
    """
    N, S, H, D = q.shape
    block = window
    nb = -(-S // block)
    pad = nb * block - S  # queries padded to whole blocks; their rows are dropped at the end
    span = window + block
    if nb * block * span >= S * S:  # short sequences (S below ~2.4 W): the blocks would score more
        return _dense_sink_attention(q, kv, window, sinks, scale, entries, entry_bias)
    q_pos = torch.arange(nb * block, device=q.device).view(nb, block)
    k_pos = (torch.arange(nb, device=q.device) * block - window).unsqueeze(-1) + torch.arange(span, device=q.device)
    bias = window_bias(q_pos, k_pos, k_pos >= 0, window).expand(N, nb, block, span)
    keys = torch.nn.functional.pad(kv, (0, 0, window, pad)).unfold(1, span, block).transpose(-1, -2)
    if entries is not None:
        E = entries.shape[1]
        keys = torch.cat([keys, entries.unsqueeze(1).expand(N, nb, E, D)], dim=2)
        entry_bias = torch.nn.functional.pad(entry_bias, (0, 0, 0, pad)).view(N, nb, block, E)
        bias = torch.cat([bias, entry_bias], dim=-1)
    qb = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, pad)).reshape(N * nb, block, H, D)
    out = sink_attention(qb, keys.reshape(N * nb, -1, D), bias.reshape(N * nb, block, -1), sinks, scale)
    return out.view(N, nb * block, H, D)[:, :S]


def _dense_sink_attention(q, kv, window, sinks, scale, entries, entry_bias) -> torch.Tensor:
    """banded_sink_attention's arguments, every query scored against all S positions + the entries."""
    pos = torch.arange(q.shape[1], device=q.device)
    bias = window_bias(pos, pos, torch.ones_like(pos, dtype=torch.bool), window).expand(q.shape[0], -1, -1)
    if entries is not None:
        kv, bias = torch.cat([kv, entries], dim=1), torch.cat([bias, entry_bias], dim=2)
    return sink_attention(q, kv, bias, sinks, scale)
