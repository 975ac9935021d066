"""Advantage estimators, selected by `algo.estimator`.

Every estimator takes one `EstimatorInputs`, so the loop calls `ESTIMATORS[algo.estimator](inputs)` (or
`compute_advantages`, which adds shape checks and common metrics) without branching; an estimator
ignores the optional inputs it does not need. Its fields, for R rollouts and S segments of T tokens:

    rewards          [R]     float, one reward per rollout
    group_ids        [R]     int, rollouts with the same id answered the same prompt
    segment_rollout  [S]     int in [0, R): the rollout of each segment (a rollout's segments in order)
    loss_mask        [S, T]  1 on tokens the engine sampled
    algo             AlgoSpec
    values           [S, T]  critic V(tokens < t): only with model.critic (needs_critic, e.g. gae)
    logp, ref_logp   [S, T]  policy / reference logprobs of the sampled tokens (KL, distillation): only
                             with model.reference (needs_reference), None otherwise
    turn_returns     [S, T]  algo.turn_credit=turn only, and only to estimators registered with
                             turn_credit=True: each sampled token's return from its turn on; `rewards`
                             are then each rollout's return from its first turn (the baseline's)

Output: `Advantages(advantages [S, T], returns [S, T] or None, metrics {name: 0-dim tensor})`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from molt.algo.groups import group_mean, group_sum, rollout_sum, to_tokens, token_gae
from molt.algo.kl import KL_ESTIMATORS
from molt.algo.masked import masked_max, masked_mean, masked_whiten

if TYPE_CHECKING:
    from molt.spec import AlgoSpec

EPS = 1e-6


class Advantages(NamedTuple):
    advantages: Tensor              # [S, T], 0 off the loss mask
    returns: Tensor | None          # [S, T] value targets (gae), else None
    metrics: dict[str, Tensor]


@dataclass(frozen=True)
class EstimatorInputs:
    """What an estimator reads (shapes in the module docstring); the optional fields are None when the
    run has no critic, no reference, or no turn credit."""
    rewards: Tensor
    group_ids: Tensor
    segment_rollout: Tensor
    loss_mask: Tensor
    algo: AlgoSpec
    values: Tensor | None = None
    logp: Tensor | None = None
    ref_logp: Tensor | None = None
    turn_returns: Tensor | None = None

    def to_tokens(self, x: Tensor) -> Tensor:
        """[R] per-rollout values as [S, T] on each rollout's sampled tokens."""
        return to_tokens(x, self.segment_rollout, self.loss_mask)

    def kl_rewards(self) -> Tensor:
        """[R] rewards with the KL penalty of each rollout's tokens folded in (when algo.kl.in_reward)."""
        return rollout_rewards(self.rewards, self.segment_rollout, self.loss_mask, self.algo, self.logp,
                               self.ref_logp)


Estimator = Callable[[EstimatorInputs], Advantages]
ESTIMATORS: dict[str, Estimator] = {}


@dataclass(frozen=True)
class EstimatorNeeds:
    """What an estimator needs of the run, which the driver checks a spec against (molt.driver.compose), so
    that a plugin's needs are its own decorator's and not rules in the spec. `logp` and `ref_logp` are
    computed only when the run has a reference model: an estimator that reads them says needs_reference."""
    group_baseline: bool = False    # compares the samples of one prompt: refused with samples_per_prompt=1
    turn_credit: bool = False       # takes `turn_returns` (algo.turn_credit=turn is refused with any other)
    needs_critic: bool = False      # reads `values`, returns value targets: model.critic=true (and only it)
    needs_reference: bool = False   # reads `logp` / `ref_logp`: model.reference must be set
    whitens: bool = False           # standardizes its advantages over the batch or group (with algo.gamma=1
                                    # an affine map of the rewards changes nothing: a batch reward
                                    # normalization before it is warned about)


ESTIMATOR_NEEDS: dict[str, EstimatorNeeds] = {}


def register_estimator(name: str, group_baseline: bool = False, turn_credit: bool = False,
                       needs_critic: bool = False, needs_reference: bool = False,
                       whitens: bool = False) -> Callable[[Estimator], Estimator]:
    """Decorator: make `fn` the estimator for `algo.estimator: name`, with what it needs of the run
    (`EstimatorNeeds`: a critic, a reference, several samples per prompt, per-turn returns)."""
    def add(fn: Estimator) -> Estimator:
        if name in ESTIMATORS:
            raise ValueError(f"estimator {name!r} is already registered")
        ESTIMATORS[name] = fn
        ESTIMATOR_NEEDS[name] = EstimatorNeeds(group_baseline, turn_credit, needs_critic, needs_reference,
                                               whitens)
        return fn
    return add


def _returns(r: Tensor, segment_rollout: Tensor, loss_mask: Tensor, turn_returns: Tensor | None) -> Tensor:
    """[S, T] each sampled token's return: its rollout's `r`, or with turn credit its turn's return."""
    return to_tokens(r, segment_rollout, loss_mask) if turn_returns is None else \
        torch.where(loss_mask > 0, turn_returns.to(r.dtype), torch.zeros_like(turn_returns, dtype=r.dtype))


def kl_penalty(loss_mask: Tensor, algo: AlgoSpec, logp: Tensor | None, ref_logp: Tensor | None) -> Tensor:
    """KL folded into the reward: [S, T] token rewards -kl.coef * KL_t on sampled tokens.

    Zeros unless algo.kl.in_reward and algo.kl.coef > 0 (then logp and ref_logp are required).
    """
    if not (algo.kl.in_reward and algo.kl.coef > 0):
        return torch.zeros(loss_mask.shape, device=loss_mask.device)
    if logp is None or ref_logp is None:
        raise ValueError("algo.kl.in_reward needs logp and ref_logp")
    kl = KL_ESTIMATORS[algo.kl.estimator](logp, ref_logp)
    return torch.where(loss_mask > 0, -algo.kl.coef * kl, torch.zeros_like(kl))


def rollout_rewards(rewards: Tensor, segment_rollout: Tensor, loss_mask: Tensor, algo: AlgoSpec,
                     logp: Tensor | None, ref_logp: Tensor | None) -> Tensor:
    """Rewards [R] with the KL penalty of all of a rollout's tokens folded in (group estimators)."""
    penalty = kl_penalty(loss_mask, algo, logp, ref_logp)
    return rewards + rollout_sum(penalty, segment_rollout, loss_mask, rewards.numel()).to(rewards.dtype)


def _group_size(rewards: Tensor, group_ids: Tensor) -> Tensor:
    return group_sum(torch.ones_like(rewards), group_ids)


@register_estimator("reinforce_pp", whitens=True)
def reinforce_pp(x: EstimatorInputs) -> Advantages:
    """REINFORCE++: A_t = whiten(G_t) over all sampled tokens of the batch, G_t = sum_{k>=t} gamma^(k-t) r_k
    with r_k = -kl.coef * KL_k (when kl.in_reward) plus the rollout reward on its last sampled token."""
    penalty = kl_penalty(x.loss_mask, x.algo, x.logp, x.ref_logp)
    _, returns = token_gae(penalty, None, x.rewards, x.segment_rollout, x.loss_mask, x.algo.gamma, 1.0)
    return Advantages(masked_whiten(returns, x.loss_mask), None, {})


@register_estimator("reinforce_baseline", group_baseline=True, whitens=True)
def reinforce_baseline(x: EstimatorInputs) -> Advantages:
    """REINFORCE++-baseline: as reinforce_pp, with the rollout reward replaced by r - mean_group(r)."""
    return reinforce_pp(dataclasses.replace(x, rewards=x.rewards - group_mean(x.rewards, x.group_ids)))


@register_estimator("grpo", group_baseline=True, turn_credit=True, whitens=True)
def grpo(x: EstimatorInputs) -> Advantages:
    """GRPO: A = (r - mean_g) / (std_g + 1e-6), std unbiased; a group of one gets A = 0. With turn credit a
    token's A = (G_turn - mean_g) / (std_g + 1e-6), mean and std over the group's whole-rollout returns, and
    a group whose whole returns are all equal gets A = 0: its turns differ only by the discount, which is no
    comparison between samples, and dividing that difference by 1e-6 would make it the whole update. Equal
    means a std within rounding (1e-6 of the returns' size): eight float32 returns of 0.9 have std ~4e-8."""
    r = x.kl_rewards()
    n = _group_size(r, x.group_ids)
    mean = group_mean(r, x.group_ids)
    centered = r - mean
    std = (group_sum(centered**2, x.group_ids) / (n - 1).clamp(min=1)).sqrt()
    zero_std = (std <= EPS * (1 + mean.abs())) | (n == 1)
    metrics = {"zero_std_frac": zero_std.float().mean()}
    if x.turn_returns is None:
        adv = torch.where(n > 1, centered / (std + EPS), torch.zeros_like(r))
        return Advantages(x.to_tokens(adv), None, metrics)
    adv = (_returns(r, x.segment_rollout, x.loss_mask, x.turn_returns) - x.to_tokens(mean)) / \
        (x.to_tokens(std) + EPS)
    compared = x.to_tokens((~zero_std).to(r.dtype)) > 0
    return Advantages(torch.where(compared, adv, torch.zeros_like(adv)), None, metrics)


@register_estimator("dr_grpo", group_baseline=True, turn_credit=True)
def dr_grpo(x: EstimatorInputs) -> Advantages:
    """Dr.GRPO: A = r - mean_g (no std; pair with loss.norm=seq for the constant length normalizer); with
    turn credit a token's A = G_turn - mean_g, and a group of one (no baseline but itself) gets 0."""
    r = x.kl_rewards()
    if x.turn_returns is None:
        return Advantages(x.to_tokens(r - group_mean(r, x.group_ids)), None, {})
    mean = x.to_tokens(group_mean(r, x.group_ids))
    adv = _returns(r, x.segment_rollout, x.loss_mask, x.turn_returns) - mean
    alone = x.to_tokens((_group_size(r, x.group_ids) == 1).to(r.dtype)) > 0
    return Advantages(torch.where(alone, torch.zeros_like(adv), adv), None, {})


@register_estimator("rloo", group_baseline=True, turn_credit=True)
def rloo(x: EstimatorInputs) -> Advantages:
    """RLOO: A_i = r_i - mean_{j != i in group} r_j = n / (n - 1) * (r_i - mean_g); a group of one gets 0.
    With turn credit a token's A = G_turn - mean_{j != i} r_j (the other rollouts' whole returns)."""
    r = x.kl_rewards()
    n = _group_size(r, x.group_ids)
    if x.turn_returns is None:
        adv = (r - group_mean(r, x.group_ids)) * n / (n - 1).clamp(min=1)
        adv = torch.where(n > 1, adv, torch.zeros_like(adv))
        return Advantages(x.to_tokens(adv), None, {})
    others = torch.where(n > 1, (group_sum(r, x.group_ids) - r) / (n - 1).clamp(min=1), r)   # one: A = 0
    adv = _returns(r, x.segment_rollout, x.loss_mask, x.turn_returns) - x.to_tokens(others)
    single = x.to_tokens((n == 1).to(r.dtype)) > 0
    return Advantages(torch.where(single, torch.zeros_like(adv), adv), None, {})


@register_estimator("gae", needs_critic=True)
def gae(x: EstimatorInputs) -> Advantages:
    """PPO-GAE(gamma, lam) over each rollout's sampled tokens with the critic's values; advantages are
    whitened over the batch, returns (A_t + V_t before whitening) are the value targets."""
    if x.values is None:
        raise ValueError("algo.estimator=gae needs values from a critic")
    penalty = kl_penalty(x.loss_mask, x.algo, x.logp, x.ref_logp)
    adv, returns = token_gae(penalty, x.values, x.rewards, x.segment_rollout, x.loss_mask, x.algo.gamma,
                             x.algo.lam)
    return Advantages(masked_whiten(adv, x.loss_mask), returns,
                      {"returns_mean": masked_mean(returns, x.loss_mask),
                       "values_mean": masked_mean(x.values.to(returns.dtype), x.loss_mask)})


@register_estimator("on_policy_distill", needs_reference=True)
def on_policy_distill(x: EstimatorInputs) -> Advantages:
    """On-policy distillation: A_t = -distill_coef * (logp_t - ref_logp_t), the teacher as reference
    (per-token reverse KL as a dense reward); rewards are ignored."""
    if x.logp is None or x.ref_logp is None:
        raise ValueError("algo.estimator=on_policy_distill needs logp and ref_logp (the teacher)")
    gap = torch.where(x.loss_mask > 0, x.logp - x.ref_logp, torch.zeros_like(x.logp))
    return Advantages(-x.algo.distill_coef * gap, None, {"teacher_gap": masked_mean(gap, x.loss_mask)})


def compute_advantages(rewards: Tensor, group_ids: Tensor, segment_rollout: Tensor, loss_mask: Tensor,
                       algo: AlgoSpec, values: Tensor | None = None, logp: Tensor | None = None,
                       ref_logp: Tensor | None = None, turn_returns: Tensor | None = None) -> Advantages:
    """Check shapes, run `ESTIMATORS[algo.estimator]`, and add the common metrics.

    Inputs as in this module's docstring. Metrics added: advantage_mean / advantage_std /
    advantage_min / advantage_max (over sampled tokens), reward_mean / reward_std (per rollout), and
    kl_in_reward (mean token KL penalty, when folded into the reward), beside the estimator's own.
    """
    num_rollouts, num_segments = rewards.shape[0], loss_mask.shape[0]
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be [R]")
    if loss_mask.dim() != 2 or segment_rollout.shape != (num_segments,):
        raise ValueError(f"loss_mask {tuple(loss_mask.shape)} must be [S, T] and segment_rollout "
                         f"{tuple(segment_rollout.shape)} must be [S]")
    if num_segments and not (0 <= int(segment_rollout.min()) and int(segment_rollout.max()) < num_rollouts):
        raise ValueError(f"segment_rollout must index the {num_rollouts} rollouts")
    inputs = (("values", values), ("logp", logp), ("ref_logp", ref_logp), ("turn_returns", turn_returns))
    for name, x in inputs:
        if x is not None and x.shape != loss_mask.shape:
            raise ValueError(f"{name} {tuple(x.shape)} must match loss_mask {tuple(loss_mask.shape)}")
    if turn_returns is not None and not ESTIMATOR_NEEDS[algo.estimator].turn_credit:
        raise ValueError(f"algo.estimator={algo.estimator} takes no turn_returns (algo.turn_credit=turn)")
    out = ESTIMATORS[algo.estimator](EstimatorInputs(rewards, group_ids, segment_rollout, loss_mask, algo,
                                                     values, logp, ref_logp, turn_returns))
    adv, mask = out.advantages, loss_mask > 0
    mean = masked_mean(adv, mask)
    metrics = {
        "advantage_mean": mean,
        "advantage_std": masked_mean((adv - mean) ** 2, mask).sqrt(),
        "advantage_min": -masked_max(-adv, mask),
        "advantage_max": masked_max(adv, mask),
        "reward_mean": rewards.float().mean() if num_rollouts else torch.zeros(()),
        "reward_std": rewards.float().std(correction=0) if num_rollouts else torch.zeros(()),
    }
    if algo.kl.in_reward and algo.kl.coef > 0:
        penalty = kl_penalty(loss_mask, algo, logp, ref_logp)
        metrics["kl_in_reward"] = -masked_mean(penalty, mask) / algo.kl.coef
    return Advantages(adv, out.returns, {**metrics, **out.metrics})
