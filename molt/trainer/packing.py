"""Sequence packing: the rows of a micro-batch concatenated into one padding-free row.

A padded micro-batch computes every layer on pad positions; a packed one holds only real tokens. Rows
are right-padded (`make_batch`), so a row's real tokens are its attention-masked prefix. The packed row
carries `position_ids` that restart at 0 for every sequence and the sequence bounds `cu_seq_lens_q`.
A dense block-diagonal mask over the row would cost attention over the whole row squared (measured
slower than padding on CPU), so the model runs the `VARLEN` attention registered here: one causal sdpa
call per sequence, i.e. each sequence's own attention cost and nothing across sequences. Scores
computed on the packed row go back to the padded layout (`unpack`), where the losses and their normalizer
see exactly the tensors an unpacked forward gives.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

VARLEN = "molt_varlen"   # the attn_implementation name models are loaded with when packing


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, cu_seq_lens_q: torch.Tensor | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of a packed row [1, heads, N, dim]: causal sdpa over each sequence between the bounds
    `cu_seq_lens_q` on its own; without bounds (an unpacked forward) plain sdpa."""
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    bounds = cu_seq_lens_q.tolist()
    kwargs["is_causal"] = True
    outs = [sdpa_attention_forward(module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], None,
                                   **kwargs)[0] for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    return torch.cat(outs, dim=1), None


# Registered on import (the trainer worker imports this module before it loads a model). The mask
# function is flash attention's: no mask at all when none is given, which is the packed case.
AttentionInterface.register(VARLEN, varlen_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN, flash_attention_mask)


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
    tokens, plus `position_ids` [1, N] and the sequence bounds `cu_seq_lens_q` [B + 1]; also returns the
    [B, T] mask of real tokens that `unpack` needs."""
    real = mb["attention_mask"] > 0
    packed = {k: v[real][None] for k, v in mb.items()}
    lengths = real.sum(-1)
    starts = torch.cumsum(lengths, 0) - lengths
    flat = torch.arange(int(lengths.sum()), device=real.device)
    packed["position_ids"] = (flat - starts.repeat_interleave(lengths))[None]
    packed["cu_seq_lens_q"] = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).int()
    return packed, real


def unpack(scores: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Per-token scores of a packed row [1, N] back to the padded layout [B, T] (0 on padding)."""
    out = scores.new_zeros(real.shape)
    out[real] = scores[0]
    return out
