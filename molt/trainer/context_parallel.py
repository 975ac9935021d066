"""Context parallel (`parallel.cp_size`): each micro-batch's sequence is split over the cp ranks of the
trainer mesh, so a rank holds the activations and logits of its own share of the tokens only.

Layout (`Shard`): the sequence, right-padded to a multiple of 2 x cp, is cut into 2 x cp chunks and cp
rank r holds chunks r and 2 x cp - 1 - r (the head-tail pairing of AutoModel's `round_robin_local_indices`
and torch's context parallel, which evens out causal attention's work), with the global position ids,
routed experts and scoring fields of its tokens.

Attention is the only layer that mixes positions. `ulysses_attention`, registered with transformers as
CP_ATTENTION, trades the split over positions for a split over heads: an all-to-all over the cp group
(autograd-aware; gloo on CPU, NCCL on GPU) gives each rank every position of 1/cp of the heads, in global
order, where it runs the ordinary causal attention (the packing's per-sequence attention for a packed row);
a second all-to-all returns its own positions of every head. No mask is offset or built: the attention is
the one a cp=1 forward runs, on fewer heads.

Everything after the model runs on local positions: logits, logprobs (chunked or not), entropies and
values. Their [B, T] per-token results (4 bytes a token) are all-gathered (`Shard.gather`), so the loss,
its normalizers, the importance correction, KL and the gap metrics see the whole micro-batch exactly as at
cp=1, including every rule that reduces over a row (sequence-level correction, GSPO, seq-mean-token-mean).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

from molt.trainer.packing import varlen_attention

CP_ATTENTION = "molt_cp"   # the attn_implementation models are loaded with when cp_size > 1


def zigzag(length: int, size: int, rank: int) -> torch.Tensor:
    """The global positions cp rank `rank` of `size` holds in a sequence of `length` (a multiple of
    2 x size): chunk `rank`, then chunk 2 x size - 1 - rank."""
    chunk = length // (2 * size)
    head, tail = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat([torch.arange(head, head + chunk), torch.arange(tail, tail + chunk)])


@dataclass(frozen=True)
class Shard:
    """Where this rank's tokens sit in a micro-batch of `length` positions (padded: a multiple of 2 x cp)."""

    group: dist.ProcessGroup
    size: int
    length: int
    local: torch.Tensor     # [length / size] the global positions held here
    order: torch.Tensor     # [length] the global positions of every rank's share, ranks end to end
    inverse: torch.Tensor   # [length] where each global position sits in `order`

    @classmethod
    def of(cls, group: dist.ProcessGroup, length: int, device: torch.device) -> Shard:
        """The shard of this rank of `group` for a sequence of `length` real positions (padded up)."""
        size = dist.get_world_size(group)
        padded = -(-length // (2 * size)) * 2 * size
        order = torch.cat([zigzag(padded, size, r) for r in range(size)]).to(device)
        local = zigzag(padded, size, dist.get_rank(group)).to(device)
        return cls(group, size, padded, local, order, torch.argsort(order))

    def take(self, x: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """This rank's positions of a per-position tensor [B, T, ...] (T <= length; padded with `fill`)."""
        extra = self.length - x.shape[1]
        if extra:
            x = torch.cat([x, x.new_full((x.shape[0], extra, *x.shape[2:]), fill)], 1)
        return x.index_select(1, self.local)

    def gather(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """Every rank's [B, length / size] results as one [B, length] tensor in global order, on every
        rank. Its backward is this rank's slice of the gradient: every cp rank computes the same loss from
        the gathered tensor, so that slice is already the whole gradient of this rank's part."""
        return None if x is None else _GatherForReplicas.apply(x, self)


class _GatherForReplicas(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shard: Shard) -> torch.Tensor:
        ctx.local = shard.local
        parts = [torch.empty_like(x) for _ in range(shard.size)]
        dist.all_gather(parts, x.contiguous(), group=shard.group)
        return torch.cat(parts, 1).index_select(1, shard.inverse)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.index_select(1, ctx.local), None


def split(inputs: dict[str, torch.Tensor], shard: Shard) -> dict[str, torch.Tensor]:
    """This rank's share of a micro-batch's model inputs (`input_ids` [B, T], optional `position_ids`,
    `cu_seq_lens_q`, `routed_experts`): position ids stay global (a padded row's default 0..T-1 made
    explicit); a packed row's padding becomes one more sequence; the attention mask is dropped (causal
    attention over right-padded rows never lets a real token see padding)."""
    ids = inputs["input_ids"]
    positions = inputs.get("position_ids")
    if positions is None:
        positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
    out = {"input_ids": shard.take(ids), "position_ids": shard.take(positions)}
    if "cu_seq_lens_q" in inputs:
        bounds = inputs["cu_seq_lens_q"]
        tail = bounds.new_tensor([shard.length]) if shard.length > int(bounds[-1]) else bounds[:0]
        out["cu_seq_lens_q"] = torch.cat([bounds, tail])
    if "routed_experts" in inputs:   # padding routes to experts 0..k-1, as the inert rows do
        routes = inputs["routed_experts"]
        b, t, layers, k = routes.shape
        filler = torch.arange(k, dtype=routes.dtype, device=routes.device).expand(b, shard.length - t,
                                                                                  layers, k)
        out["routed_experts"] = shard.take(torch.cat([routes, filler], 1))
    return out


def ulysses_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, cp_shard: Shard | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """Causal attention of this rank's positions [B, heads, T/cp, dim] over the whole sequence: all-to-all
    to [B, heads/cp, T, dim] in global order, the ordinary attention there, all-to-all back."""
    if cp_shard is None:
        raise ValueError("a model loaded for context parallel ran a forward without its cp shard "
                         "(molt.trainer.context_parallel.split)")
    if kwargs.get("sliding_window") is not None:
        raise ValueError("parallel.cp_size > 1 does not support sliding-window attention layers")
    heads, size = query.shape[1], cp_shard.size
    if heads % size:
        raise ValueError(f"parallel.cp_size={size} must divide the attention heads a rank computes "
                         f"({heads}): context parallel splits them over the cp ranks")
    # each rank needs the key/value heads of its query heads: repeated until they split evenly too
    repeat = math.lcm(key.shape[1], size) // key.shape[1]
    q, k, v = (_to_heads(x, cp_shard) for x in (query, repeat_kv(key, repeat), repeat_kv(value, repeat)))
    groups = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], is_causal=True)
    out, _ = varlen_attention(groups, q, k, v, None, **kwargs)   # [B, T, heads/cp, dim]
    return _to_positions(out, cp_shard), None


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Block j of dim 0 goes to rank j; block s of the result came from rank s (differentiable)."""
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(x, None, None, group))


def _to_heads(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    """[B, h, T/cp, d] (this rank's positions, every head) -> [B, h/cp, T, d] (every position, in global
    order, of this rank's block of heads)."""
    b, h, t, d = x.shape
    got = _all_to_all(x.reshape(b, shard.size, h // shard.size, t, d).transpose(0, 1).contiguous(),
                      shard.group)
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // shard.size, shard.size * t, d) \
        .index_select(2, shard.inverse)


def _to_positions(out: torch.Tensor, shard: Shard) -> torch.Tensor:
    """[B, T, h/cp, d] (attention output of this rank's heads, global order) -> [B, T/cp, h, d]."""
    b, t, h, d = out.shape
    ranks = out.index_select(1, shard.order).reshape(b, shard.size, t // shard.size, h, d)
    got = _all_to_all(ranks.transpose(0, 1).contiguous(), shard.group)
    return got.permute(1, 2, 0, 3, 4).reshape(b, t // shard.size, shard.size * h, d)


# Registered on import (the trainer's model loader imports this module). No mask is built: the mask
# function is flash attention's, which gives none when the forward has no attention mask.
AttentionInterface.register(CP_ATTENTION, ulysses_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(CP_ATTENTION, flash_attention_mask)
