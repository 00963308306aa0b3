"""Train/rollout mismatch: measure it, and correct for it with importance weights.

Inputs are packed per-token tensors [T] over the responses of B samples: logp_train (the trainer's
re-scored log-probs of the rollout tokens, with the weights that sampled them, i.e. "old"),
logp_rollout (the engine's), a 0/1 mask, and cu_seqlens [B + 1] (see aggregation.py). Lists of
per-sample tensors are accepted instead, with cu_seqlens=None. Let delta_t = logp_train - logp_rollout
and rho_t = exp(delta_t), the per-token importance ratio pi_train / pi_rollout.

Measures (per-sample mean over valid tokens, then mean over samples that have a valid token, as
slime / Miles report them):
    train/train_rollout_logprob_abs_diff = mean |delta_t|
    train/train_rollout_kl               = mean k3, k3 = rho_t - 1 - delta_t, clamped as losses.kl_penalty does.
        This is the low-variance estimator of KL(pi_rollout || pi_train) from tokens sampled by the
        rollout engine (Miles' choice: compute_approx_kl(rollout, train, "low_var_kl")); it is >= 0.

Correction weights w_t (always detached; 0 at masked positions):
    TIS (truncated IS):  w_t = clamp(rho_t, tis_clip_low, tis_clip)          defaults 0.0, 2.0
    MIS (masked IS), by level, in log space so a long sequence cannot overflow:
        token:      log w_t = delta_t
        sequence:   log w_t = sum_{t' in i} delta_t'    (product of the token ratios of sample i)
        geometric:  log w_t = mean_{t' in i} delta_t'   (their geometric mean)
      mode truncate: w = min(w, upper) (and max(w, lower) if lower > 0); mode mask: w = 0 outside
      [lower, upper]. Defaults: level token, mode mask, lower 0.5, upper 2.0.
    Veto (optional, both): a sample with any valid token rho_t < veto_threshold (e.g. 1e-4) gets
      w = 0 on all its tokens: such a token is one the trainer considers near impossible.

Metrics, named and defined as in Miles (miles/backends/training_utils/loss_hub/losses.py and
corrections.py, vanilla_tis_function; slime's megatron_utils/loss.py is the same), so dashboards
carry over. "Sample mean" = mean over a sample's valid tokens, then over samples with a valid token
(Miles' sum_of_sample_mean); "token mean" = over all valid tokens of the step. pi_old is the PPO
ratio's denominator (the trainer's logprobs before the step, or the rollout's with
use_rollout_logprobs); rho_t = pi_train / pi_rollout as above.

    metric                               value per token (dimensionless)     averaged      reported
    train/train_rollout_logprob_abs_diff |delta_t|                             sample mean   always
    train/train_rollout_kl               k3 = rho_t - 1 - delta_t              sample mean   always
    train/tis                            rho_t, raw, before truncation/mask    sample mean   TIS / MIS on
    train/tis_abs                        |rho_t - 1|                           sample mean   TIS / MIS on
    train/tis_clipfrac                   1 where w was truncated or masked     sample mean   TIS / MIS on
                                         (rho outside [lower, upper] at the level)
    train/tis_weight      (lockstep)     w_t, the weight applied to the loss   sample mean   TIS / MIS on
    train/tis_veto_frac   (lockstep)     1 per vetoed sample                   over samples  TIS / MIS on
    train/ess             (lockstep)     (sum w)^2 / (n sum w^2) over the level's units (valid tokens; samples
                                         for sequence / geometric); 0 when every weight is 0   TIS / MIS on
    train/ois             (trainer.py)   pi_theta / pi_old = exp(-ppo_kl)      sample mean   always
                                         (GSPO: the sequence-level ratio)

rho_t in the metrics is exp(min(delta_t, 80)) so that one runaway token cannot make them inf. The
trainer's loss diagnostics (train/pg_clipfrac, train/ppo_kl, train/entropy, train/dual_clipfrac)
are token means under every loss aggregation; train/pg_loss and train/kl_loss follow loss_agg.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from lockstep.train.aggregation import broadcast_to_tokens, pack, segment_sum
from lockstep.train.losses import kl_penalty

MIS_LEVELS = ("token", "sequence", "geometric")
MIS_MODES = ("truncate", "mask")

Packed = torch.Tensor | Sequence[torch.Tensor]


def _unpack(logp_train: Packed, logp_rollout: Packed, mask: Packed, cu_seqlens: torch.Tensor | None):
    """Bring list inputs to packed form; returns float32 tensors, bool mask, int64 cu_seqlens."""
    if not isinstance(logp_train, torch.Tensor):
        logp_train, cu_seqlens = pack(list(logp_train))
        logp_rollout, _ = pack(list(logp_rollout))
        mask, _ = pack(list(mask))
    elif cu_seqlens is None:
        cu_seqlens = torch.tensor([0, logp_train.numel()])  # one sample
    cu = torch.as_tensor(cu_seqlens, dtype=torch.int64)
    if int(cu[-1]) != logp_train.numel() or logp_rollout.shape != logp_train.shape or mask.shape != logp_train.shape:
        raise ValueError("logp_train, logp_rollout and mask must all be [T] with T = cu_seqlens[-1]")
    return logp_train.detach().float(), logp_rollout.detach().float(), mask.bool(), cu


def metric_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp(log_ratio) for the ratio metrics, the exponent capped at 80 so that one token cannot make
    a logged mean inf."""
    return torch.exp(log_ratio.detach().float().clamp(max=80.0))


def _per_sample_mean(values: torch.Tensor, mask: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """Mean over valid tokens per sample, then over samples having at least one valid token."""
    maskf = mask.float()
    counts = segment_sum(maskf, cu)
    sums = segment_sum(values * maskf, cu)
    has = counts > 0
    if not bool(has.any()):
        return torch.tensor(0.0)
    return (sums[has] / counts[has]).mean()


def train_rollout_logprob_abs_diff(
    logp_train: Packed, logp_rollout: Packed, mask: Packed, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean |logp_train - logp_rollout|: per-sample mean over valid tokens, then mean over samples."""
    lt, lr, m, cu = _unpack(logp_train, logp_rollout, mask, cu_seqlens)
    return _per_sample_mean((lt - lr).abs(), m, cu)


def train_rollout_kl(
    logp_train: Packed, logp_rollout: Packed, mask: Packed, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """k3 estimate of KL(pi_rollout || pi_train), clamped per token to [-10, 10], averaged as above."""
    lt, lr, m, cu = _unpack(logp_train, logp_rollout, mask, cu_seqlens)
    # KL(rollout || train) from rollout tokens: the KL loss's k3 with pi = rollout, pi_ref = train
    return _per_sample_mean(kl_penalty(lr, lt, "low_var_kl"), m, cu)


def mismatch_metrics(
    logp_train: Packed, logp_rollout: Packed, mask: Packed, cu_seqlens: torch.Tensor | None = None
) -> dict[str, float]:
    """Both mismatch measures under their DESIGN.md names."""
    return {
        "train/train_rollout_logprob_abs_diff": float(train_rollout_logprob_abs_diff(logp_train, logp_rollout, mask, cu_seqlens)),
        "train/train_rollout_kl": float(train_rollout_kl(logp_train, logp_rollout, mask, cu_seqlens)),
    }


def _level_log_weights(delta: torch.Tensor, maskf: torch.Tensor, cu: torch.Tensor, level: str) -> torch.Tensor:
    if level == "token":
        return delta
    seq_sum = segment_sum(delta * maskf, cu)
    if level == "geometric":
        seq_sum = seq_sum / segment_sum(maskf, cu).clamp_min(1.0)
    elif level != "sequence":
        raise ValueError(f"unknown MIS level {level!r}; choose one of {MIS_LEVELS}")
    return broadcast_to_tokens(seq_sum, cu)


def _ess(weights: torch.Tensor) -> float:
    total_sq = float(weights.square().sum())
    if weights.numel() == 0 or total_sq == 0.0:
        return 0.0
    return float(weights.sum()) ** 2 / (weights.numel() * total_sq)


def importance_weights(
    logp_train: Packed,
    logp_rollout: Packed,
    mask: Packed,
    cu_seqlens: torch.Tensor | None = None,
    *,
    level: str = "token",
    mode: str = "truncate",
    lower: float = 0.0,
    upper: float = 2.0,
    veto_threshold: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """General TIS / MIS weights [T] (detached) and metrics; see the module docstring."""
    lt, lr, m, cu = _unpack(logp_train, logp_rollout, mask, cu_seqlens)
    delta = lt - lr
    w, outside, vetoed = _weights(delta, m, cu, level, mode, lower, upper, veto_threshold)
    maskf = m.float()
    if level == "token":
        ess = _ess(w[m])
    else:  # one weight per sample: the value at any of its tokens (samples without tokens excluded)
        has = segment_sum(maskf, cu) > 0
        ess = _ess(segment_sum(w, cu)[has] / segment_sum(maskf, cu)[has])
    rho = metric_ratio(delta)
    metrics = {
        "train/tis": float(_per_sample_mean(rho, m, cu)),
        "train/tis_abs": float(_per_sample_mean((rho - 1.0).abs(), m, cu)),
        "train/tis_clipfrac": float(_per_sample_mean(outside.float(), m, cu)),
        "train/tis_weight": float(_per_sample_mean(w, m, cu)),
        "train/tis_veto_frac": float(vetoed.float().mean()) if vetoed.numel() else 0.0,
        "train/ess": ess,
    }
    return w.detach(), metrics


def importance_weights_only(logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
                            cu_seqlens: torch.Tensor, **config) -> torch.Tensor:
    """`importance_weights`' weights alone (`config`: its keyword arguments), computed where the
    logprobs are with nothing read back: the loss's call, once per micro-batch (on a GPU a host read
    there would wait for the forward); the metrics come from `importance_weights` once per step."""
    lt, lr, m, cu = _unpack(logp_train, logp_rollout, mask, cu_seqlens)
    return _weights(lt - lr, m, cu, **config)[0].detach()


def _weights(delta: torch.Tensor, m: torch.Tensor, cu: torch.Tensor, level: str = "token", mode: str = "truncate",
             lower: float = 0.0, upper: float = 2.0, veto_threshold: float | None = None):
    """(weights [T], outside [T], vetoed [B]) from delta = logp_train - logp_rollout, on delta's device."""
    if mode not in MIS_MODES:
        raise ValueError(f"unknown MIS mode {mode!r}; choose one of {MIS_MODES}")
    if not 0.0 <= lower < upper:
        raise ValueError(f"need 0 <= lower < upper, got lower={lower}, upper={upper}")
    maskf = m.float()
    log_w = _level_log_weights(delta, maskf, cu, level)
    log_lo = math.log(lower) if lower > 0 else -math.inf
    log_hi = math.log(upper)
    outside = (log_w < log_lo) | (log_w > log_hi)
    if mode == "truncate":
        w = torch.exp(log_w.clamp(min=log_lo, max=log_hi))
    else:
        w = torch.where(outside, torch.zeros_like(log_w), torch.exp(log_w.clamp(max=log_hi)))
    vetoed = torch.zeros(len(cu) - 1, dtype=torch.bool, device=delta.device)
    if veto_threshold is not None:
        low_token = (m & (delta < math.log(veto_threshold))).float()
        vetoed = segment_sum(low_token, cu) > 0
        w = torch.where(broadcast_to_tokens(vetoed, cu), torch.zeros_like(w), w)
    return w * maskf, outside, vetoed


def tis_weights(
    logp_train: Packed,
    logp_rollout: Packed,
    mask: Packed,
    cu_seqlens: torch.Tensor | None = None,
    *,
    tis_clip: float = 2.0,
    tis_clip_low: float = 0.0,
    veto_threshold: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance sampling: w_t = clamp(exp(logp_train - logp_rollout), tis_clip_low, tis_clip)."""
    return importance_weights(
        logp_train, logp_rollout, mask, cu_seqlens,
        level="token", mode="truncate", lower=tis_clip_low, upper=tis_clip, veto_threshold=veto_threshold,
    )


def mis_weights(
    logp_train: Packed,
    logp_rollout: Packed,
    mask: Packed,
    cu_seqlens: torch.Tensor | None = None,
    *,
    level: str = "token",
    mode: str = "mask",
    lower: float = 0.5,
    upper: float = 2.0,
    veto_threshold: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Masked importance sampling at token / sequence / geometric level (defaults: token, mask, [0.5, 2])."""
    return importance_weights(
        logp_train, logp_rollout, mask, cu_seqlens,
        level=level, mode=mode, lower=lower, upper=upper, veto_threshold=veto_threshold,
    )
