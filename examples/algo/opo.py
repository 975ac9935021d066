"""Worked example of adding an estimator as a plugin (see docs/algo.md): OPO's length-weighted baseline.

OPO (On-Policy RL with Optimal reward baseline) weights each rollout's reward in its group's baseline
by the rollout's number of sampled tokens, b_g = sum_i len_i * r_i / sum_i len_i, which minimizes the
gradient variance for a sequence-sum loss. It is this file plus conf/algo/opo.yaml, which names it in
`algo.plugins` so that the driver and every trainer rank import it before the estimator name is checked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from molt.algo.estimators import Advantages, register_estimator, rollout_rewards
from molt.algo.groups import group_sum, rollout_sum, to_tokens

if TYPE_CHECKING:
    from molt.spec import AlgoSpec


@register_estimator("opo", group_baseline=True)
def opo(rewards: Tensor, group_ids: Tensor, segment_rollout: Tensor, loss_mask: Tensor, algo: AlgoSpec,
        values: Tensor | None = None, logp: Tensor | None = None,
        ref_logp: Tensor | None = None) -> Advantages:
    """A_i = r_i - sum_g(len_j * r_j) / sum_g(len_j); len_j = sampled tokens of rollout j (all segments);
    r includes the rollout's KL penalty when algo.kl.in_reward."""
    r = rollout_rewards(rewards, segment_rollout, loss_mask, algo, logp, ref_logp)
    lengths = rollout_sum(loss_mask.to(r.dtype), segment_rollout, loss_mask, r.numel())
    baseline = group_sum(lengths * r, group_ids) / group_sum(lengths, group_ids).clamp(min=1)
    adv = r - baseline
    return Advantages(to_tokens(adv, segment_rollout, loss_mask), None,
                      {"opo_baseline_mean": baseline.mean() if baseline.numel() else torch.zeros(())})
