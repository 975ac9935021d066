"""Reward transforms, the adaptive KL controller and dynamic sampling against hand computations."""

from __future__ import annotations

import asyncio

import pytest
import torch
from poollib import FnGroups

from molt.algo import adaptive_kl_coef, shape_rewards, with_kl_coef
from molt.driver.select import filter_rollouts, take_batch
from molt.rollout.pool import RolloutPool
from molt.spec import AlgoSpec, KLSpec, RunSpec
from molt.trajectory import Rollout, Segment


def algo(**kw) -> AlgoSpec:
    return AlgoSpec.model_validate(kw)


def test_overlong_penalty_clip_and_normalize_by_hand():
    # budget 10, band 0.2 -> the last 2 tokens: length 8 is free, 9 is half-way (-0.5 * p), 10 is -p.
    spec = algo(reward={"overlong_buffer_frac": 0.2, "overlong_penalty": 0.6})
    rewards, lengths = torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([3.0, 8.0, 9.0, 10.0])
    out, m = shape_rewards(rewards, lengths, spec, budget=10)
    assert out.tolist() == pytest.approx([1.0, 1.0, -0.3, -0.6])
    assert m["reward/overlong_frac"].item() == 0.5 and m["reward/shaped_mean"].item() == pytest.approx(0.275)
    # then clip to [-0.5, 0.5] and normalize over the batch: [0.5, 0.5, -0.3, -0.5] has mean 0.05
    spec = algo(reward={"overlong_buffer_frac": 0.2, "overlong_penalty": 0.6, "clip": 0.5,
                        "normalize": "batch"})
    out, _ = shape_rewards(rewards, lengths, spec, budget=10)
    clipped = torch.tensor([0.5, 0.5, -0.3, -0.5])
    expected = (clipped - 0.05) / (clipped.std(correction=0) + 1e-6)
    assert out.tolist() == pytest.approx(expected.tolist())
    # defaults: nothing changes, no metric
    same, m = shape_rewards(rewards, lengths, algo(), budget=10)
    assert same is rewards and m == {}


def test_the_overlong_band_lies_below_what_max_total_tokens_leaves():
    """max_tokens 64, but a 30-token prompt under max_total_tokens 80 leaves 50: the band is (40, 50], so
    45 sampled tokens cost half the penalty (with the budget 64 the band would start at 51.2)."""
    from molt.driver.select import shaped_rewards

    spec = RunSpec.model_validate({"rollout": {"max_tokens": 64}, "model": {"max_model_len": 128},
                                   "agent": {"max_total_tokens": 80}, "algo": {"reward": {
                                       "overlong_buffer_frac": 0.2, "overlong_penalty": 1.0}}})
    rollouts = []
    for i, sampled in enumerate((30, 45, 50)):
        seg = Segment(token_ids=[5] * (30 + sampled), loss_mask=[0] * 30 + [1] * sampled,
                      logprobs=[0.0] * 30 + [-1.0] * sampled, versions=[-1] * 30 + [0] * sampled,
                      rollout_id=f"r{i}", group_id="g", prompt_len=30)
        rollouts.append(Rollout(rollout_id=f"r{i}", group_id="g", segments=[seg], reward=1.0))
    rewards, metrics = shaped_rewards(spec, rollouts)
    assert rewards.tolist() == pytest.approx([1.0, 0.5, 0.0])
    assert metrics["reward/overlong_frac"] == pytest.approx(2 / 3)

    # two turns of 32 tokens and room to spare: the band sits below the rollout's budget 2 x 32 = 64
    spec = RunSpec.model_validate({"rollout": {"max_tokens": 32}, "model": {"max_model_len": 128},
                                   "agent": {"max_total_tokens": 128, "max_turns": 2}, "algo": {"reward": {
                                       "overlong_buffer_frac": 0.2, "overlong_penalty": 1.0}}})
    assert spec.response_budget == 64
    assert shaped_rewards(spec, rollouts)[0].tolist() == [1.0, 1.0, 1.0]   # 30, 45, 50 < 51.2


def test_adaptive_kl_controller_by_hand():
    spec = KLSpec(coef=0.1, target=0.02, horizon=1000)
    # kl 0.03: error 0.5 clipped to 0.2; 64 rollouts: coef * (1 + 0.2 * 64 / 1000)
    assert adaptive_kl_coef(0.1, 0.03, 64, spec) == pytest.approx(0.1 * 1.0128)
    # kl 0.019: error -0.05
    assert adaptive_kl_coef(0.1, 0.019, 100, spec) == pytest.approx(0.1 * (1 - 0.05 * 0.1))
    assert adaptive_kl_coef(0.1, 5.0, 100, KLSpec(coef=0.1)) == 0.1   # no target: fixed
    assert with_kl_coef(algo(kl={"coef": 0.1}), 0.3).kl.coef == 0.3
    # the loop's step: the reward's KL when folded in, else the loss's; a step without one keeps coef
    from molt.driver.loop import next_kl_coef

    run = RunSpec.model_validate({"model": {"reference": "policy"},
                                  "algo": {"kl": {"coef": 0.1, "target": 0.02, "horizon": 1000}}})
    step = {"rollout/count": 64.0, "train/kl": 0.019, "adv/kl_in_reward": 0.03}
    assert next_kl_coef(run, 0.1, step) == pytest.approx(0.1 * 1.0128)
    step.pop("adv/kl_in_reward")
    assert next_kl_coef(run, 0.1, step) == pytest.approx(0.1 * (1 - 0.05 * 0.064))
    assert next_kl_coef(run, 0.1, {"rollout/count": 64.0}) == 0.1
    with pytest.raises(ValueError, match="initial algo.kl.coef"):
        KLSpec(target=0.1)


# Dynamic sampling on the loop's own pool, with an agent whose reward is fixed by the prompt item:
# "mixed" groups have rewards 0 and 1 (informative), "flat" groups all 1 (dropped by drop_equal_rewards).
KINDS = ["flat", "mixed", "flat", "flat", "mixed", "flat", "mixed", "mixed", "flat", "flat"]


async def _rollout(item: dict, group_id: str, index: int) -> Rollout:
    rid = f"{group_id}-{index}"
    seg = Segment(token_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0, -1.0, -1.0], versions=[-1, 0, 0],
                  rollout_id=rid, group_id=group_id)
    reward = float(index % 2) if item["kind"] == "mixed" else 1.0
    return Rollout(rollout_id=rid, group_id=group_id, segments=[seg], reward=reward)


def _take(refill: int) -> tuple[list[list[Rollout]], dict[str, float], RunSpec]:
    spec = RunSpec.model_validate({
        "train": {"prompts_per_step": 4},
        "rollout": {"samples_per_prompt": 2},
        "algo": {"filters": {"drop_equal_rewards": True, "refill_max_groups": refill}},
    })

    async def run():
        pool = RolloutPool(iter([{"kind": k} for k in KINDS]), FnGroups(_rollout, 2), 4, 1,
                           refill_during_batch=False)
        try:
            return await take_batch(pool, spec)
        finally:
            await pool.close()

    groups, metrics = asyncio.run(run())
    return groups, metrics, spec


def test_dynamic_sampling_refills_to_the_informative_target():
    # first batch: items 0-3, one mixed; refill 3 (items 4-6): two mixed; refill 1 (item 7): mixed -> 4.
    groups, metrics, spec = _take(refill=8)
    assert [g[0].group_id for g in groups] == [f"g{i}" for i in range(8)]
    assert metrics == {"filter/refill_groups": 4.0, "filter/informative_groups": 4.0,
                       "filter/short_groups": 0.0}
    kept, filter_metrics = filter_rollouts(spec, [r for g in groups for r in g])
    assert sorted({r.group_id for r in kept}) == ["g1", "g4", "g6", "g7"] and len(kept) == 8
    assert filter_metrics["filter/drop_equal_rewards_dropped"] == 8.0


def test_dynamic_sampling_is_bounded_and_reports_the_shortfall():
    # bound 2: one refill of 2 (items 4, 5), one of them mixed: 2 informative groups, 2 short
    groups, metrics, _ = _take(refill=2)
    assert len(groups) == 6
    assert metrics == {"filter/refill_groups": 2.0, "filter/informative_groups": 2.0,
                       "filter/short_groups": 2.0}
    groups, metrics, _ = _take(refill=0)   # off: today's batch, no metric
    assert len(groups) == 4 and metrics == {}
