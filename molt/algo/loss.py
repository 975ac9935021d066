"""Policy and value losses, normalized so that the result does not depend on how the batch is split.

Each loss returns SUM(per-token loss over this micro-batch) / `norm`, where `norm` is the GLOBAL
normalizer: the trainer sums `loss_normalizer(...)` over all micro-batches and ranks first. Summing the
returned losses over micro-batches and ranks then gives exactly the global mean — a per-micro-batch
mean would weight a short micro-batch's tokens more than a long one's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from molt.algo.correction import importance_weights
from molt.algo.kl import KL_ESTIMATORS
from molt.algo.masked import masked_fraction, masked_mean, masked_sum
from molt.algo.surrogates import POLICY_LOSSES

if TYPE_CHECKING:
    from molt.spec import AlgoSpec


def _token_norm(loss_mask: Tensor, max_tokens: int) -> float:
    return float((loss_mask > 0).sum())


def _seq_norm(loss_mask: Tensor, max_tokens: int) -> float:
    return float(((loss_mask > 0).sum(-1) > 0).sum()) * max_tokens


def _rows_norm(loss_mask: Tensor, max_tokens: int) -> float:
    return float(((loss_mask > 0).sum(-1) > 0).sum())


def _row_mean_scale(loss_mask: Tensor) -> Tensor:
    return 1.0 / (loss_mask > 0).sum(-1, keepdim=True).clamp(min=1)


class Aggregation(NamedTuple):
    normalizer: Callable[[Tensor, int], float]      # additive share of one micro-batch
    token_scale: Callable[[Tensor], Tensor] | None  # [B, T] or [B, 1] per-token factor (None: 1)


# algo.loss.norm -> how per-token losses become one number. A row is one segment, always whole inside
# a micro-batch, so a per-row factor is local and the sum over micro-batches stays exact.
LOSS_NORMS: dict[str, Aggregation] = {
    "token": Aggregation(_token_norm, None),
    "seq": Aggregation(_seq_norm, None),
    "seq-mean-token-mean": Aggregation(_rows_norm, _row_mean_scale),
}


def loss_normalizer(loss_mask: Tensor, algo: AlgoSpec, max_tokens: int) -> float:
    """This micro-batch's additive share of the global loss normalizer.

    `loss_mask` [B, T]. token norm: number of unmasked tokens. seq norm (Dr.GRPO): number of sequences
    with at least one unmasked token times the constant `max_tokens` (the response budget), so a long
    response does not dilute its tokens' gradient. seq-mean-token-mean (the original GRPO: Shao et al.
    2024, DeepSeekMath; verl's loss_agg_mode of that name): number of sequences with an unmasked token,
    each token's loss scaled by 1/(its sequence's unmasked tokens) (`token_scale`). Sum over micro-batches
    and all-reduce over ranks.
    """
    return LOSS_NORMS[algo.loss.norm].normalizer(loss_mask, max_tokens)


def token_scale(per_token: Tensor, loss_mask: Tensor, algo: AlgoSpec) -> Tensor:
    """`per_token` [B, T] times the aggregation's per-token factor (seq-mean-token-mean: 1/row length)."""
    scale = LOSS_NORMS[algo.loss.norm].token_scale
    return per_token if scale is None else per_token * scale(loss_mask).to(per_token.dtype)


def policy_loss(logp: Tensor, batch: dict[str, Tensor], algo: AlgoSpec,
                norm: float) -> tuple[Tensor, dict[str, Tensor]]:
    """The surrogate `POLICY_LOSSES[algo.loss.policy]` with importance correction, optional KL loss and
    entropy bonus, aggregated by `algo.loss.norm`.

    `logp` [B, T]: log pi(token t | tokens < t) from the current forward (with grad). `batch` [B, T]:
    old_logp (trainer logprobs before the update), behaviour_logp (engine), advantages, loss_mask;
    optional ref_logp (needed when algo.kl.coef > 0 and not in_reward) and entropy (needed when
    algo.loss.entropy_coef > 0; always logged when given).

        pg_t    = surrogate (ppo: max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - eps_low, 1 + eps_high)))
        loss_t  = w_t * pg_t + kl.coef * KL_t - entropy_coef * H_t   (w_t: importance weight)
        loss    = sum_t mask_t * scale_t * loss_t / norm              (scale_t: 1, or 1/row length)

    Returns the 0-dim loss and 0-dim detached metrics, means over this micro-batch's sampled tokens:
    pg_loss, approx_kl (k3 of old vs current), the surrogate's ratio_mean / clip_frac_low /
    clip_frac_high (/ dual_clip_frac), the is_* metrics of `importance_weights`, and kl / entropy when
    their inputs are given.
    """
    spec = algo.loss
    mask = batch["loss_mask"] > 0
    # Zero every input off the mask first: padding may hold -inf, and inf * 0 would turn grads into NaN.
    logp, adv, old_logp = (torch.where(mask, x, torch.zeros_like(x))
                           for x in (logp, batch["advantages"], batch["old_logp"]))
    pg, surrogate_metrics = POLICY_LOSSES[spec.policy](logp, old_logp, adv, mask, spec)
    weights, metrics = importance_weights(old_logp, batch["behaviour_logp"], batch["loss_mask"],
                                          algo.correction)
    metrics.update(surrogate_metrics)
    per_token = weights * pg
    with torch.no_grad():
        metrics["pg_loss"] = masked_mean(per_token, mask)
        metrics["approx_kl"] = masked_mean(KL_ESTIMATORS["k3"](logp, old_logp), mask)
    if "ref_logp" in batch:
        ref_logp = torch.where(mask, batch["ref_logp"], torch.zeros_like(logp))
        kl = KL_ESTIMATORS[algo.kl.estimator](logp, ref_logp)
        metrics["kl"] = masked_mean(kl.detach(), mask)
        if algo.kl.coef > 0 and not algo.kl.in_reward:
            per_token = per_token + algo.kl.coef * kl
    elif algo.kl.coef > 0 and not algo.kl.in_reward:
        raise ValueError("algo.kl.coef > 0 as a loss term needs batch['ref_logp']")
    if "entropy" in batch:
        entropy = torch.where(mask, batch["entropy"], torch.zeros_like(logp))
        metrics["entropy"] = masked_mean(entropy.detach(), mask)
        if spec.entropy_coef:
            per_token = per_token - spec.entropy_coef * entropy
    elif spec.entropy_coef:
        raise ValueError("algo.loss.entropy_coef != 0 needs batch['entropy']")
    # norm 0: nothing in the batch is sampled
    return masked_sum(token_scale(per_token, mask, algo), mask) / (norm or 1.0), metrics


def value_loss(values: Tensor, batch: dict[str, Tensor], algo: AlgoSpec,
               norm: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss (PPO): the critic may not move further than value_clip from old_values.

    `values` [B, T] (with grad); `batch` [B, T]: old_values, returns, loss_mask.
        v_clip_t = old_t + clip(v_t - old_t, -value_clip, value_clip)
        loss     = sum_t mask_t * scale_t * 0.5 * max((v_t - R_t)^2, (v_clip_t - R_t)^2) / norm
    Metrics: value_loss (token mean), value_clip_frac, value_mean, value_error (mean |v - R|).
    """
    mask = batch["loss_mask"] > 0
    values, old, returns = (torch.where(mask, x, torch.zeros_like(x))
                            for x in (values, batch["old_values"], batch["returns"]))
    c = algo.loss.value_clip
    v_clip = old + (values - old).clamp(-c, c)
    per_token = 0.5 * torch.maximum((values - returns) ** 2, (v_clip - returns) ** 2)
    with torch.no_grad():
        metrics = {
            "value_loss": masked_mean(per_token, mask),
            "value_clip_frac": masked_fraction((values - returns) ** 2 < (v_clip - returns) ** 2, mask),
            "value_mean": masked_mean(values, mask),
            "value_error": masked_mean((values - returns).abs(), mask),
        }
    return masked_sum(token_scale(per_token, mask, algo), mask) / (norm or 1.0), metrics


def sft_loss(logp: Tensor, batch: dict[str, Tensor], norm: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Supervised fine-tuning: negative log-likelihood of the target tokens (loss_mask 1: the assistant's).

        loss = -sum_t w_t * logp_t / norm      (norm: the global number of target tokens)
    w_t is loss_mask: 1 on targets in SFT; a client of molt.tinker may weight tokens (any real number:
    forward_backward_custom sends the gradient of its own loss here). Tokens with w_t = 0 are left out.
    Metrics: nll (unweighted mean over this micro-batch's target tokens).
    """
    weight = batch["loss_mask"]
    mask = weight != 0
    nll = -torch.where(mask, logp, torch.zeros_like(logp))
    with torch.no_grad():
        metrics = {"nll": masked_mean(nll, mask)}
    return masked_sum(nll * weight.to(nll.dtype), mask) / (norm or 1.0), metrics
