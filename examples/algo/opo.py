"""Worked example of adding an estimator as a plugin (see docs/algo.md): OPO's length-weighted baseline.

OPO (On-Policy RL with Optimal reward baseline) weights each rollout's reward in its group's baseline
by the rollout's number of sampled tokens, b_g = sum_i len_i * r_i / sum_i len_i, which minimizes the
gradient variance for a sequence-sum loss. It is this file plus conf/algo/opo.yaml, which names it in
`algo.plugins` so that the driver and every trainer rank import it before the estimator name is checked.
"""

from __future__ import annotations

import torch

from molt.algo.estimators import Advantages, EstimatorInputs, register_estimator
from molt.algo.groups import group_sum, rollout_sum


@register_estimator("opo", group_baseline=True)
def opo(x: EstimatorInputs) -> Advantages:
    """A_i = r_i - sum_g(len_j * r_j) / sum_g(len_j); len_j = sampled tokens of rollout j (all segments);
    r includes the rollout's KL penalty when algo.kl.in_reward."""
    r = x.kl_rewards()
    lengths = rollout_sum(x.loss_mask.to(r.dtype), x.segment_rollout, x.loss_mask, r.numel())
    baseline = group_sum(lengths * r, x.group_ids) / group_sum(lengths, x.group_ids).clamp(min=1)
    return Advantages(x.to_tokens(r - baseline), None,
                      {"opo_baseline_mean": baseline.mean() if baseline.numel() else torch.zeros(())})
