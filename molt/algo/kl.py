"""KL estimators between the policy and a frozen reference, per sampled token.

With log r = logp - ref_logp for a token sampled from the policy (Schulman, "Approximating KL
divergence"): k1 = log r (unbiased, high variance, can be negative), k2 = (log r)^2 / 2 (biased, low
variance), k3 = exp(-log r) - 1 + log r (unbiased and always >= 0). `algo.kl.estimator` picks one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


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
