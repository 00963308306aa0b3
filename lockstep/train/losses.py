"""Policy-gradient losses, KL estimators and entropy: small pure per-token functions.

All functions return per-token tensors [T]; reduce them with `lockstep.train.aggregation`.
Notation: logp = log pi_theta(y_t) (with grad), old_logp = log pi_old(y_t) (no grad), A = advantage.

PPO clipped loss (per token), with r = exp(log_ratio), log_ratio = logp - old_logp:

    l1 = -A * r
    l2 = -A * clamp(r, 1 - eps_clip, 1 + eps_clip_high)      eps_clip = 0.2, eps_clip_high = eps_clip
    l  = max(l1, l2)                                          clipfrac = 1[l2 > l1]
    dual clip (A < 0 only):  l = min(l, -A * clip_c)          clip_c = 3.0 (None disables; must be > 1)
    ppo_kl = old_logp - logp                                  (k1 estimate of KL(old || new))

DAPO's clip-higher is eps_clip_high > eps_clip (e.g. 0.2 / 0.28). Dual clip (Ye et al. 2020) bounds
the loss of a negative-advantage token whose ratio has exploded.

GSPO (Zheng et al. 2025) uses the sequence-level ratio s_i = (prod_t r_it)^(1/|y_i|), the
geometric mean of the token ratios, in place of r. To keep per-token gradients as in the paper,
each token uses log s_it = sg[log s_i] + logp_t - sg[logp_t]: its value is log s_i, its gradient
is that of logp_t (times s_i after exp). `gspo_log_ratio` returns that [T] tensor; feed it to
`ppo_policy_loss` as `log_ratio`, with GRPO advantages. The paper's clip range is tiny (3e-4/4e-4).

KL penalty estimators of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL"),
with d = ref_logp - logp:
    k1 = -d              k2 = d^2 / 2              k3 = exp(d') - 1 - d', d' = clamp(d, -20, 20)   (low_var_kl)
As verl does, d is clamped to [-20, 20] before exp and k3 to [-10, 10] after: without the first
clamp exp(d) overflows float32 for d > ~88, and the second clamp's zero gradient times inf is a
NaN gradient.

Entropy from logits [..., V]: H = logsumexp(z) - sum softmax(z) * z, in float32; tokens with
-inf logits (masked vocabulary) contribute 0 rather than 0 * inf = NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lockstep.train.aggregation import segment_ids, segment_sum

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
LOG_RATIO_CLAMP = 20.0  # |ref_logp - logp| bound inside k3's exp (verl's value)


@dataclass
class PolicyLossOutput:
    """Per-token [T] results of `ppo_policy_loss`."""

    loss: torch.Tensor  # to be aggregated and minimised
    clipfrac: torch.Tensor  # 1.0 where the clipped (eps) branch was taken, else 0.0
    dual_clipfrac: torch.Tensor  # 1.0 where the dual clip (clip_c) bound was taken
    ppo_kl: torch.Tensor  # old_logp - logp, detached


def ppo_policy_loss(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    clip_c: float | None = 3.0,
    is_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate (with clip-higher and dual clip) per token.

    log_ratio: logp - old_logp [T] (or `gspo_log_ratio(...)`); advantages: [T] (broadcast a
    per-sample scalar first). is_weights: optional detached per-token weights [T] (TIS / MIS from
    `lockstep.train.mismatch`) that multiply the loss.
    """
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(f"clip_c must be > 1 for dual clip, got {clip_c}")
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    loss = torch.maximum(loss1, loss2)
    clipfrac = (loss2 > loss1).float()
    dual_clipfrac = torch.zeros_like(clipfrac)
    if clip_c is not None:
        loss3 = -advantages * clip_c
        # Only negative advantages: their loss -A*r grows without bound as r grows.
        dual = (advantages < 0) & (loss3 < loss)
        loss = torch.where(advantages < 0, torch.minimum(loss, loss3), loss)
        dual_clipfrac = dual.float()
    if is_weights is not None:
        loss = loss * is_weights.detach()
    return PolicyLossOutput(loss=loss, clipfrac=clipfrac, dual_clipfrac=dual_clipfrac, ppo_kl=(-log_ratio).detach())


def gspo_log_ratio(
    logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """Per-token GSPO log ratio [T]: value = mean of (logp - old_logp) over the sample's valid tokens,
    gradient = d logp_t (stop-gradient trick)."""
    maskf = mask.to(logp.dtype)
    diff = (logp - old_logp).detach() * maskf
    per_sample = segment_sum(diff, cu_seqlens) / segment_sum(maskf, cu_seqlens).clamp_min(1.0)
    seq_log_ratio = per_sample[segment_ids(cu_seqlens).to(logp.device)]
    return seq_log_ratio + logp - logp.detach()


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3", clamp: float = 10.0) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled by pi: k1, k2 or k3 (= low_var_kl)."""
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):
        # verl kl_penalty_forward "low_var_kl" (verl/trainer/ppo/core_algos.py, commit b178a3c):
        # log-ratio clamped to [-20, 20] "for numerical stability" before exp, the estimate to [-10, 10]
        d = (-log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return (torch.exp(d) - 1.0 - d).clamp(-clamp, clamp)
    raise ValueError(f"unknown KL estimator {kind!r}; choose one of {KL_ESTIMATORS}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim, float32, safe for -inf logits. [...]"""
    z = logits.float()
    # Entropy is shift-invariant; shifting by the max keeps lse and sum(p * z) small, so their
    # difference does not cancel catastrophically for large logits.
    z = z - z.max(dim=-1, keepdim=True).values.detach()
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    p = torch.exp(z - lse)
    # Zero the logit itself (not the product) where p == 0, so neither the value nor the
    # gradient sees 0 * -inf.
    z_safe = torch.where(p > 0, z, torch.zeros_like(z))
    return lse.squeeze(-1) - (p * z_safe).sum(dim=-1)
