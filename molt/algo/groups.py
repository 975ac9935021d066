"""Reductions between the three index spaces of a batch: groups, rollouts and segment tokens.

Rewards live per rollout [R]; a group id per rollout [R] says which prompt it answered; a
segment->rollout index [S] says which rollout each token row [S, T] belongs to. A rollout may have
several segments (an agent that compacts its context), but it has ONE reward, so group baselines are
taken over rollouts, and each segment then carries its rollout's advantage on its own sampled tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_sum(x: Tensor, group_ids: Tensor) -> Tensor:
    """[R] values, [R] integer group ids -> [R]: the sum of x over each rollout's own group."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    totals = torch.zeros(int(inverse.max()) + 1 if x.numel() else 0, dtype=x.dtype, device=x.device)
    return totals.index_add_(0, inverse, x)[inverse]


def group_mean(x: Tensor, group_ids: Tensor) -> Tensor:
    """[R] -> [R]: mean of x over each rollout's group."""
    return group_sum(x, group_ids) / group_sum(torch.ones_like(x), group_ids)


def rollout_sum(x: Tensor, segment_rollout: Tensor, loss_mask: Tensor, num_rollouts: int) -> Tensor:
    """[S, T] token values -> [R]: sum over the sampled tokens of all of a rollout's segments."""
    per_segment = torch.where(loss_mask > 0, x, torch.zeros_like(x)).sum(-1)
    out = torch.zeros(num_rollouts, dtype=per_segment.dtype, device=x.device)
    return out.index_add_(0, segment_rollout, per_segment)


def to_tokens(per_rollout: Tensor, segment_rollout: Tensor, loss_mask: Tensor) -> Tensor:
    """[R] -> [S, T]: every sampled token of a segment gets its rollout's value; 0 elsewhere."""
    values = per_rollout[segment_rollout][:, None].expand(loss_mask.shape)
    return torch.where(loss_mask > 0, values, torch.zeros_like(values))


def token_gae(token_rewards: Tensor, values: Tensor | None, rewards: Tensor, segment_rollout: Tensor,
              loss_mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over the sampled tokens of each rollout, in order.

    The time steps of a rollout are its sampled tokens (observations and tool output between turns are
    not actions), chained across its segments in the order they appear in the batch. `token_rewards`
    [S, T] (e.g. a KL penalty) plus the rollout's `rewards` [R] on its last sampled token;
    `values` [S, T] is V(tokens < t) at each sampled token, or None for 0 (then lam=1 gives the
    discounted reward-to-go). With delta_t = r_t + gamma * V_{t+1} - V_t (V after the last token = 0):
        A_t = delta_t + gamma * lam * A_{t+1},   returns_t = A_t + V_t.
    Returns (advantages, returns), both [S, T], 0 off the mask.
    """
    mask = loss_mask > 0
    num_rollouts = rewards.numel()
    offsets, lengths = [], [0] * num_rollouts
    for r, n in zip(segment_rollout.tolist(), mask.sum(-1).tolist(), strict=True):
        offsets.append(lengths[r])
        lengths[r] += n
    dev = loss_mask.device
    offsets_t = torch.tensor(offsets, dtype=torch.long, device=dev).view(-1, 1)
    position = offsets_t + mask.long().cumsum(-1) - 1
    rows, cols = segment_rollout.view(-1, 1).expand(mask.shape)[mask], position[mask]
    steps = max(lengths, default=0)

    r = torch.zeros(num_rollouts, steps, dtype=rewards.dtype, device=dev)
    r[rows, cols] = token_rewards[mask].to(rewards.dtype)
    last = torch.tensor(lengths, dtype=torch.long, device=dev) - 1
    has = (last >= 0).nonzero().flatten()
    r[has, last[has]] += rewards[has]
    v = torch.zeros(num_rollouts, steps + 1, dtype=rewards.dtype, device=dev)  # last column: terminal V = 0
    if values is not None:
        v[rows, cols] = values[mask].to(rewards.dtype)
    # Steps past a rollout's end have r = V = 0, so the recursion stays 0 there without a mask.
    adv = torch.zeros_like(r)
    running = torch.zeros(num_rollouts, dtype=rewards.dtype, device=dev)
    for t in reversed(range(steps)):
        running = r[:, t] + gamma * v[:, t + 1] - v[:, t] + gamma * lam * running
        adv[:, t] = running
    out_adv = torch.zeros(mask.shape, dtype=rewards.dtype, device=dev)
    out_ret = torch.zeros_like(out_adv)
    out_adv[mask] = adv[rows, cols]
    out_ret[mask] = adv[rows, cols] + v[rows, cols]
    return out_adv, out_ret
