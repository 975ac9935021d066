"""KL estimators between the policy and a frozen reference, per sampled token.

With log r = logp - ref_logp for a token sampled from the policy (Schulman, "Approximating KL
divergence"): k1 = log r (unbiased, high variance, can be negative), k2 = (log r)^2 / 2 (biased, low
variance), k3 = exp(-log r) - 1 + log r (unbiased and always >= 0). `algo.kl.estimator` picks one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from molt.spec import AlgoSpec, KLSpec

# Ziegler et al.'s bound on the proportional error: coef changes by at most this share per horizon.
ADAPTIVE_KL_MAX_ERROR = 0.2


def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """[B, T] logprobs of the sampled tokens under policy and reference -> [B, T] k1 = log(pi / pi_ref)."""
    return logp - ref_logp


def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """[B, T] -> [B, T] k2 = 0.5 * log(pi / pi_ref)^2."""
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """[B, T] -> [B, T] k3 = pi_ref / pi - 1 - log(pi_ref / pi) (>= 0)."""
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - 1 - log_ratio


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def adaptive_kl_coef(coef: float, kl: float, rollouts: int, spec: KLSpec) -> float:
    """Next KL weight of the adaptive controller (Ziegler et al. 2019, arXiv 1909.08593; TRL's
    AdaptiveKLController): e = clip(kl / target - 1, -0.2, 0.2),
    coef <- coef * (1 + e * min(rollouts, horizon) / horizon).
    `kl` is the batch's mean KL per sampled token; `coef` is returned unchanged when spec.target is null."""
    if spec.target is None:
        return coef
    error = min(max(kl / spec.target - 1, -ADAPTIVE_KL_MAX_ERROR), ADAPTIVE_KL_MAX_ERROR)
    # A step counts as at most one horizon, so it moves coef by at most the 20% Ziegler allows per horizon:
    # unbounded, a step of 5 horizons of rollouts or more makes the factor <= 0, and the KL switches off
    # or flips its sign (TRL has no such bound: its steps are small against its horizon).
    return coef * (1 + error * min(rollouts, spec.horizon) / spec.horizon)


def with_kl_coef(algo: AlgoSpec, coef: float | None) -> AlgoSpec:
    """`algo` with algo.kl.coef replaced by `coef` (the controller's value); `algo` itself when None."""
    if coef is None:
        return algo
    return algo.model_copy(update={"kl": algo.kl.model_copy(update={"coef": coef})})
