"""Sequence packing: the rows of a micro-batch concatenated into one padding-free row.

A padded micro-batch computes every layer on pad positions; a packed one holds only real tokens. Rows
are right-padded (`make_batch`), so a row's real tokens are its attention-masked prefix. The packed row
carries `position_ids` that restart at 0 for every sequence and no attention mask: transformers then
derives a block-diagonal causal mask from the restarts (sdpa) or varlen boundaries (flash attention),
so no token attends across sequences. Scores computed on the packed row go back to the padded layout
(`unpack`), where the losses and their normalizer see exactly the tensors an unpacked forward gives.
"""

from __future__ import annotations

import torch


def token_budget_groups(lengths: list[int], budget: int) -> list[range]:
    """Consecutive row ranges holding at most `budget` real tokens each (a longer row goes alone).

    Consecutive, in order, so scores of a shard can be written back row range by row range.
    """
    groups, start, used = [], 0, 0
    for i, length in enumerate(lengths):
        if i > start and used + length > budget:
            groups.append(range(start, i))
            start, used = i, 0
        used += length
    if lengths:
        groups.append(range(start, len(lengths)))
    return groups


def pack(mb: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Every per-token field of a padded micro-batch [B, T, ...] as one row [1, N, ...] of its N real
    tokens, plus `position_ids` [1, N]; also returns the [B, T] mask of real tokens that `unpack` needs."""
    real = mb["attention_mask"] > 0
    packed = {k: v[real][None] for k, v in mb.items()}
    lengths = real.sum(-1)
    starts = torch.cumsum(lengths, 0) - lengths
    flat = torch.arange(int(lengths.sum()), device=real.device)
    packed["position_ids"] = (flat - starts.repeat_interleave(lengths))[None]
    return packed, real


def unpack(scores: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Per-token scores of a packed row [1, N] back to the padded layout [B, T] (0 on padding)."""
    out = scores.new_zeros(real.shape)
    out[real] = scores[0]
    return out
