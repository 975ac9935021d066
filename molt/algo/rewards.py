"""Reward transforms (keys of `algo.reward`), applied to the kept rollouts' rewards after the filters.

Each takes rewards [R], response lengths [R] (sampled tokens of the whole rollout), the AlgoSpec and the
response budget per rollout (rollout.max_tokens * agent.max_turns, or less where agent.max_total_tokens
leaves less after the prompt: molt.driver.select.shaped_rewards) and returns new rewards [R].
`shape_rewards` runs the enabled ones in the order of REWARD_TRANSFORMS: overlong penalty, clip,
normalize. The filters judge the raw task rewards, so shaping never changes which groups dynamic
sampling keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from molt.spec import AlgoSpec

EPS = 1e-6


def overlong_penalty(rewards: Tensor, lengths: Tensor, algo: AlgoSpec, budget: Tensor | float) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476), added to the reward;
    with L_max = budget, L_cache = overlong_buffer_frac * budget, p = overlong_penalty:

        0                                   |y| <= L_max - L_cache
        p * ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max
        -p                                  |y| > L_max
    """
    spec = algo.reward
    buffer = spec.overlong_buffer_frac * budget
    excess = (lengths.to(rewards.dtype) - (budget - buffer)).clamp(min=0) / buffer
    return rewards - spec.overlong_penalty * excess.clamp(max=1.0)


def clip(rewards: Tensor, lengths: Tensor, algo: AlgoSpec, budget: Tensor | float) -> Tensor:
    """Clamp each reward to [-clip, clip]."""
    return rewards.clamp(-algo.reward.clip, algo.reward.clip)


def normalize(rewards: Tensor, lengths: Tensor, algo: AlgoSpec, budget: Tensor | float) -> Tensor:
    """batch: (r - mean) / (std + 1e-6) over the batch's rollouts (population std: one rollout gives 0)."""
    return (rewards - rewards.mean()) / (rewards.std(correction=0) + EPS)


Transform = Callable[[Tensor, Tensor, "AlgoSpec", "Tensor | float"], Tensor]
# algo.reward.<key> enables REWARD_TRANSFORMS[key] when set (overlong_buffer_frac > 0, clip, normalize on).
REWARD_TRANSFORMS: dict[str, Transform] = {
    "overlong_buffer_frac": overlong_penalty, "clip": clip, "normalize": normalize,
}


def shape_rewards(rewards: Tensor, lengths: Tensor, algo: AlgoSpec,
                  budget: Tensor | float) -> tuple[Tensor, dict[str, Tensor]]:
    """Run the enabled transforms in order. Metrics when any is on, under the names the loop logs:
    `reward/shaped_mean` (after all of them); with the overlong penalty, `reward/overlong_frac` (rollouts
    in the penalized band or past it)."""
    enabled = [fn for key, fn in REWARD_TRANSFORMS.items()
               if getattr(algo.reward, key) not in (None, 0, "off")]
    if not enabled or not rewards.numel():
        return rewards, {}
    metrics = {}
    if algo.reward.overlong_buffer_frac:
        free = budget * (1 - algo.reward.overlong_buffer_frac)
        metrics["reward/overlong_frac"] = (lengths > free).float().mean()
    for fn in enabled:
        rewards = fn(rewards, lengths, algo, budget)
    metrics["reward/shaped_mean"] = rewards.mean()
    return rewards, metrics
