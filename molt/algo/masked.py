"""Masked reductions shared by every algorithm function.

Positions outside the mask may hold anything (padding, -inf logprobs), so values are selected with
`torch.where` rather than multiplied by the mask: 0 * inf would poison the sum with NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """Sum of `x` where `mask` > 0 (any shape that broadcasts)."""
    return torch.where(mask > 0, x, torch.zeros_like(x)).sum()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of `x` over `mask` > 0; 0 (not NaN) when nothing is unmasked, so metrics stay finite."""
    return masked_sum(x, mask) / (mask > 0).sum().clamp(min=1)


def masked_fraction(x: Tensor, mask: Tensor) -> Tensor:
    """The fraction of unmasked positions where the condition `x` holds (clip fractions and the like)."""
    return masked_mean(x.float(), mask)


def masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """Max of `x` over `mask` > 0; 0 when nothing is unmasked."""
    if not (mask > 0).any():
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.where(mask > 0, x, torch.full_like(x, -torch.inf)).max()


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / (std + eps) over `mask` > 0, 0 elsewhere (population std: one token gives 0, not NaN)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return torch.where(mask > 0, (x - mean) / (var.sqrt() + eps), torch.zeros_like(x))
