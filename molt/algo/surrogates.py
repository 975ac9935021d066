"""Policy-gradient surrogates, selected by `algo.loss.policy` (docs/algo.md, "Policy losses").

Each takes, all [B, T] and already zero off the mask: `logp` (current forward, with grad), `old_logp`
(trainer before the update), `adv`, `mask` (bool), and the LossSpec, and returns the per-token loss
pg_t [B, T] (before importance weights, KL, entropy and aggregation, which `policy_loss` adds) and
0-dim detached metrics: ratio_mean, clip_frac_low, clip_frac_high (and dual_clip_frac for ppo).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from molt.algo.masked import masked_fraction, masked_mean

if TYPE_CHECKING:
    from molt.spec import LossSpec

# GSPO's log sequence ratio is capped before exp, as verl does, so one long off-policy row cannot overflow.
GSPO_MAX_LOG_RATIO = 10.0


def ppo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor,
        spec: LossSpec) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip per token (Schulman et al. 2017, L^CLIP), with optional dual clip (Ye et al. 2020):

        ratio_t = exp(logp_t - old_logp_t)
        pg_t    = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - eps_low, 1 + eps_high))
        pg_t    = min(pg_t, -dual_clip * A_t)               where A_t < 0 and dual_clip is set
    """
    ratio = (logp - old_logp).exp()
    clipped = ratio.clamp(1 - spec.eps_low, 1 + spec.eps_high)
    pg = torch.maximum(-adv * ratio, -adv * clipped)
    dual = torch.zeros_like(mask)
    if spec.dual_clip is not None:
        bound = -spec.dual_clip * adv
        dual = (adv < 0) & (pg > bound)
        pg = torch.where(dual, bound, pg)
    with torch.no_grad():
        metrics = {"ratio_mean": masked_mean(ratio, mask),
                   "clip_frac_low": masked_fraction((ratio < 1 - spec.eps_low) & (adv < 0), mask),
                   "clip_frac_high": masked_fraction((ratio > 1 + spec.eps_high) & (adv > 0), mask),
                   "dual_clip_frac": masked_fraction(dual, mask)}
    return pg, metrics


def gspo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor,
         spec: LossSpec) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-token, the token-level form of GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization",
    arXiv 2507.18071; verl's compute_policy_loss_gspo): the ratio is the sequence's length-normalized
    likelihood ratio,

        s_i     = exp( (1/|y_i|) * sum_t (logp_t - old_logp_t) )            (one per row, detached)
        s_i,t   = sg[s_i] * exp(logp_t - sg[logp_t])                         (value s_i, grad per token)
        pg_t    = max(-A_t * s_i,t, -A_t * clip(s_i,t, 1 - eps_low, 1 + eps_high))

    so a whole sequence is clipped or not. With A_t constant over a row this is GSPO's sequence objective;
    aggregate with loss.norm=seq-mean-token-mean for the paper's 1/G sum_i 1/|y_i| sum_t. The paper's
    clip range is far smaller than PPO's (conf/algo/gspo.yaml: 3e-4 / 4e-4)."""
    count = mask.sum(-1, keepdim=True).clamp(min=1)
    log_seq = ((logp - old_logp).detach().sum(-1, keepdim=True) / count).clamp(max=GSPO_MAX_LOG_RATIO)
    ratio = (logp - logp.detach() + log_seq).exp()
    clipped = ratio.clamp(1 - spec.eps_low, 1 + spec.eps_high)
    pg = torch.maximum(-adv * ratio, -adv * clipped)
    with torch.no_grad():
        metrics = {"ratio_mean": masked_mean(ratio, mask),
                   "clip_frac_low": masked_fraction((ratio < 1 - spec.eps_low) & (adv < 0), mask),
                   "clip_frac_high": masked_fraction((ratio > 1 + spec.eps_high) & (adv > 0), mask)}
    return pg, metrics


def cispo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor,
          spec: LossSpec) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance weight, not the update, so no token
    loses its gradient:

        r_t  = exp(logp_t - old_logp_t),   w_t = sg[clip(r_t, 1 - eps_low, 1 + eps_high)]
        pg_t = -w_t * A_t * logp_t                                   (grad: -w_t * A_t * d logp_t)

    The paper sets no lower bound (eps_low >= 1) and tunes only eps_high. clip_frac_low / _high count
    the tokens whose weight was clipped (their gradient is scaled, never dropped)."""
    ratio = (logp - old_logp).exp()
    weight = ratio.clamp(1 - spec.eps_low, 1 + spec.eps_high).detach()
    pg = -weight * adv * logp
    with torch.no_grad():
        metrics = {"ratio_mean": masked_mean(ratio, mask),
                   "clip_frac_low": masked_fraction(ratio < 1 - spec.eps_low, mask),
                   "clip_frac_high": masked_fraction(ratio > 1 + spec.eps_high, mask)}
    return pg, metrics


def dro(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor,
        spec: LossSpec) -> tuple[Tensor, dict[str, Tensor]]:
    """DRO (Richemond et al. 2024, arXiv 2405.19107; Kimi k1.5, arXiv 2501.12599): no ratio and no clip; a
    quadratic penalty on the log-ratio keeps the policy near the one that sampled, so it suits off-policy
    data:

        pg_t = -(A_t * logp_t - dro_beta / 2 * (logp_t - old_logp_t)^2)

    ratio_mean is logged as for the others; no token is clipped (clip fractions 0)."""
    log_ratio = logp - old_logp
    pg = -(adv * logp - 0.5 * spec.dro_beta * log_ratio ** 2)
    with torch.no_grad():
        zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
        metrics = {"ratio_mean": masked_mean(log_ratio.exp(), mask), "clip_frac_low": zero,
                   "clip_frac_high": zero}
    return pg, metrics


Surrogate = Callable[[Tensor, Tensor, Tensor, Tensor, "LossSpec"], tuple[Tensor, dict[str, Tensor]]]
# algo.loss.policy -> per-token surrogate.
POLICY_LOSSES: dict[str, Surrogate] = {"ppo": ppo, "gspo": gspo, "cispo": cispo, "dro": dro}
