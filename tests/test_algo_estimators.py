"""Advantage estimators, KL estimators and filters against hand computations and their definitions."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from molt.algo import ESTIMATORS, KL_ESTIMATORS, EstimatorInputs, apply_filters, compute_advantages
from molt.algo.filters import FILTERS
from molt.driver.compose import compose
from molt.spec import AlgoSpec, SpecError

compose(["algo=opo"])   # registers the worked example's estimator (its algo.plugins) for the tests below

F64 = torch.float64


def algo(**kw) -> AlgoSpec:
    return AlgoSpec.model_validate(kw)


# Six rollouts in four groups: group 0 = rollouts 0-2 (rollout 0 has TWO segments, rollout 1 sampled
# nothing), group 1 = rollout 3 alone, group 2 = rollouts 4-5 with equal rewards.
REWARDS = torch.tensor([1.0, 2.0, 3.0, 5.0, 2.0, 2.0], dtype=F64)
GROUPS = torch.tensor([0, 0, 0, 1, 2, 2])
SEG_ROLLOUT = torch.tensor([0, 0, 1, 2, 3, 4, 5])
MASK = torch.tensor([[0, 1, 1, 0], [1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0],
                     [1, 0, 0, 0], [0, 1, 0, 0], [1, 1, 1, 1]], dtype=F64)


@pytest.mark.parametrize("name, per_rollout", [
    ("grpo", [-1.0 / (1 + 1e-6), 0.0, 1.0 / (1 + 1e-6), 0.0, 0.0, 0.0]),  # mean 2, unbiased std 1
    ("dr_grpo", [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]),
    ("rloo", [1 - 2.5, 2 - 2.0, 3 - 1.5, 0.0, 0.0, 0.0]),                # r_i - mean of the others
])
def test_group_estimators_by_hand(name, per_rollout):
    out = compute_advantages(REWARDS, GROUPS, SEG_ROLLOUT, MASK, algo(estimator=name))
    expected = torch.tensor(per_rollout, dtype=F64)[SEG_ROLLOUT][:, None] * MASK
    assert torch.allclose(out.advantages, expected, atol=1e-12)
    assert out.returns is None
    assert out.metrics["reward_mean"].item() == pytest.approx(15 / 6)
    if name == "grpo":
        assert out.metrics["zero_std_frac"].item() == pytest.approx(3 / 6)  # rollouts 3, 4, 5


def test_grpo_divides_by_each_groups_unbiased_std():
    """Groups of unequal sizes whose stds are not 1, in an interleaved order: a missing std division, a
    biased (n) std, or one group's std applied to another changes every value by far more than 1e-12.
    Group a = rewards 0, 1, 5 (mean 2, unbiased var (4 + 1 + 9) / 2 = 7); group b = 1, 4 (mean 2.5, var
    (2.25 + 2.25) / 1 = 4.5); rollout order a, b, a, b, a."""
    rewards = torch.tensor([0.0, 1.0, 1.0, 4.0, 5.0], dtype=F64)
    groups = torch.tensor([0, 1, 0, 1, 0])
    mask = torch.tensor([[1, 1], [1, 0], [0, 1], [1, 1], [1, 0]], dtype=F64)
    sa, sb = math.sqrt(7.0) + 1e-6, math.sqrt(4.5) + 1e-6
    per_rollout = [-2.0 / sa, -1.5 / sb, -1.0 / sa, 1.5 / sb, 3.0 / sa]
    out = compute_advantages(rewards, groups, torch.arange(5), mask, algo(estimator="grpo"))
    expected = torch.tensor(per_rollout, dtype=F64)[:, None] * mask
    assert (out.advantages - expected).abs().max().item() <= 1e-12


def test_reinforce_pp_whitens_reward_to_go_with_kl_in_reward():
    # One rollout in two segments: its sampled tokens in order are seg0[1], seg0[2], seg1[0].
    mask = torch.tensor([[0, 1, 1], [1, 0, 0]], dtype=F64)
    logp = torch.tensor([[0.0, -1.0, -1.0], [-1.0, 0.0, 0.0]], dtype=F64)
    ref = logp - torch.tensor([[9.0, 1.0, 2.0], [3.0, 9.0, 9.0]], dtype=F64)  # k1 = 1, 2, 3
    spec = algo(estimator="reinforce_pp", kl={"estimator": "k1", "coef": 0.1, "in_reward": True})
    out = compute_advantages(torch.tensor([1.0], dtype=F64), torch.tensor([0]), torch.tensor([0, 0]), mask,
                             spec, logp=logp, ref_logp=ref)
    to_go = [1 - 0.1 * 6, 1 - 0.1 * 5, 1 - 0.1 * 3]
    mu, sd = statistics.fmean(to_go), statistics.pstdev(to_go)
    whitened = [(g - mu) / (sd + 1e-8) for g in to_go]
    assert out.advantages[0, 1:].tolist() == pytest.approx(whitened[:2])
    assert out.advantages[1].tolist() == pytest.approx([whitened[2], 0.0, 0.0])
    assert out.metrics["kl_in_reward"].item() == pytest.approx(2.0)


def test_reinforce_pp_discount_and_baseline():
    # Rollout 0 (3 tokens, reward 1) and rollout 1 (1 token, reward 0), one group; gamma = 0.5.
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=F64)
    rewards, groups, seg = torch.tensor([1.0, 0.0], dtype=F64), torch.tensor([7, 7]), torch.tensor([0, 1])

    def whiten(xs):
        mu, sd = statistics.fmean(xs), statistics.pstdev(xs)
        return [(x - mu) / (sd + 1e-8) for x in xs]

    out = compute_advantages(rewards, groups, seg, mask, algo(estimator="reinforce_pp", gamma=0.5))
    assert out.advantages[mask > 0].tolist() == pytest.approx(whiten([0.25, 0.5, 1.0, 0.0]))
    base = compute_advantages(rewards, groups, seg, mask, algo(estimator="reinforce_baseline"))
    assert base.advantages[mask > 0].tolist() == pytest.approx(whiten([0.5, 0.5, 0.5, -0.5]))


def test_gae_by_hand_and_across_segments():
    gamma, lam = 0.9, 0.8
    # deltas: 0.9*0.2-0.5 = -0.32, 0.9*0.1-0.2 = -0.11, 1-0.1 = 0.9; A_t = delta_t + 0.72 * A_{t+1}.
    a2 = 0.9
    a1 = -0.11 + gamma * lam * a2
    a0 = -0.32 + gamma * lam * a1
    returns = [a0 + 0.5, a1 + 0.2, a2 + 0.1]
    spec = algo(estimator="gae", gamma=gamma, lam=lam)
    one = compute_advantages(torch.tensor([1.0, 0.0], dtype=F64), torch.tensor([0, 0]), torch.tensor([0, 1]),
                             torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=F64), spec,
                             values=torch.tensor([[0.5, 0.2, 0.1], [0.3, 0.0, 0.0]], dtype=F64))
    assert one.returns[0].tolist() == pytest.approx(returns)
    assert one.returns[1, 0].item() == pytest.approx(0.0)  # second rollout: reward 0, A = -0.3, R = 0
    raw = [a0, a1, a2, -0.3]
    mu, sd = statistics.fmean(raw), statistics.pstdev(raw)
    whitened = [(x - mu) / (sd + 1e-8) for x in raw]
    assert one.advantages[one.advantages != 0].tolist() == pytest.approx(whitened)
    # The same rollout as two segments with an unsampled observation token (value ignored) in between.
    split = compute_advantages(torch.tensor([1.0, 0.0], dtype=F64), torch.tensor([0, 0]),
                               torch.tensor([0, 0, 1]),
                               torch.tensor([[1, 0, 0], [0, 1, 1], [1, 0, 0]], dtype=F64), spec,
                               values=torch.tensor([[0.5, 9, 9], [9, 0.2, 0.1], [0.3, 0, 0]], dtype=F64))
    assert split.returns[0, 0].item() == pytest.approx(returns[0])
    assert split.returns[1, 1:].tolist() == pytest.approx(returns[1:])
    with pytest.raises(ValueError, match="values"):
        compute_advantages(REWARDS, GROUPS, SEG_ROLLOUT, MASK, spec)


def test_on_policy_distill_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -3.0]], dtype=F64)
    teacher = torch.tensor([[-0.5, -2.5, -9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]], dtype=F64)
    out = compute_advantages(torch.tensor([0.0], dtype=F64), torch.tensor([0]), torch.tensor([0]), mask,
                             algo(estimator="on_policy_distill", distill_coef=2.0), logp=logp,
                             ref_logp=teacher)
    assert out.advantages.tolist() == [[pytest.approx(1.0), pytest.approx(-1.0), 0.0]]


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0])  # log(pi / pi_ref) = 1, -1
    assert KL_ESTIMATORS["k1"](logp, ref).tolist() == pytest.approx([1.0, -1.0])
    assert KL_ESTIMATORS["k2"](logp, ref).tolist() == pytest.approx([0.5, 0.5])
    assert KL_ESTIMATORS["k3"](logp, ref).tolist() == pytest.approx([math.exp(-1), math.exp(1) - 2])


def test_shape_errors_and_empty_rows():
    with pytest.raises(ValueError, match="segment_rollout"):
        compute_advantages(REWARDS, GROUPS, torch.tensor([0, 9, 1, 2, 3, 4, 5]), MASK, algo())
    with pytest.raises(ValueError, match="values"):
        compute_advantages(REWARDS, GROUPS, SEG_ROLLOUT, MASK, algo(), values=torch.zeros(2, 2))
    # Every estimator leaves the zero-length rollout's row at exactly 0 and produces finite metrics.
    extra = {"values": torch.zeros_like(MASK), "logp": -torch.ones_like(MASK), "ref_logp": -2 * MASK}
    for name in ESTIMATORS:
        out = compute_advantages(REWARDS, GROUPS, SEG_ROLLOUT, MASK, algo(estimator=name), **extra)
        assert (out.advantages[2] == 0).all() and (out.advantages[MASK == 0] == 0).all(), name
        assert all(torch.isfinite(v) for v in out.metrics.values()), name


def test_unknown_estimator_names_the_nearest():
    with pytest.raises(SpecError, match="did you mean 'rloo'.*registered: dr_grpo, gae, grpo"):
        compose(["algo.estimator=rlooo"])


@st.composite
def grouped_batch(draw):
    """Random groups of rollouts, each with 1-3 segments holding at least one sampled token."""
    sizes = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    rewards = draw(st.lists(st.floats(-3, 3, allow_nan=False), min_size=sum(sizes), max_size=sum(sizes)))
    groups = [g for g, n in enumerate(sizes) for _ in range(n)]
    seg_rollout, rows = [], []
    for r in range(len(rewards)):
        for _ in range(draw(st.integers(1, 3))):
            row = draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=4, max_size=4))
            seg_rollout.append(r)
            rows.append(row[:3] + [1.0])  # the last token is always sampled
    return (torch.tensor(rewards, dtype=F64), torch.tensor(groups), torch.tensor(seg_rollout),
            torch.tensor(rows, dtype=F64))


def per_rollout(adv, seg_rollout, num):
    out = torch.zeros(num, dtype=F64)
    out[seg_rollout] = adv[:, -1]  # every segment of a rollout carries the same value; the last is sampled
    return out


@settings(max_examples=60, deadline=None)
@given(grouped_batch(), st.sampled_from(["grpo", "dr_grpo", "rloo", "opo"]))
def test_group_baselines_sum_to_zero(batch, name):
    rewards, groups, seg, mask = batch
    out = ESTIMATORS[name](EstimatorInputs(rewards, groups, seg, mask, algo(estimator=name)))
    adv = per_rollout(out.advantages, seg, len(rewards))
    for g in groups.unique():
        members = groups == g
        weights = torch.ones(int(members.sum()), dtype=F64)
        if name == "opo":  # OPO's baseline is length-weighted: sum_i len_i * A_i = 0
            weights = torch.stack([mask[seg == i].sum() for i in members.nonzero().flatten()])
        assert (weights * adv[members]).sum().item() == pytest.approx(0.0, abs=1e-9)
        # every segment of the rollout carries the rollout's advantage on its sampled tokens
        for i in members.nonzero().flatten():
            assert torch.allclose(out.advantages[seg == i], adv[i] * mask[seg == i])


@settings(max_examples=60, deadline=None)
@given(grouped_batch())
def test_rloo_is_leave_one_out(batch):
    rewards, groups, seg, mask = batch
    out = ESTIMATORS["rloo"](EstimatorInputs(rewards, groups, seg, mask, algo()))
    adv = per_rollout(out.advantages, seg, len(rewards))
    r, g = rewards.tolist(), groups.tolist()
    for i in range(len(r)):
        others = [r[j] for j in range(len(r)) if g[j] == g[i] and j != i]
        expected = r[i] - sum(others) / len(others) if others else 0.0
        assert adv[i].item() == pytest.approx(expected, abs=1e-9)


def test_filters_by_hand():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 2.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 3])
    truncated = torch.tensor([False, False, False, True, False, False])
    spec = algo(filters={"score_range": (0.4, 0.6)})
    run = {name: FILTERS[name](rewards, rewards, groups, truncated, spec) for name in FILTERS}
    assert run["drop_truncated"][0].tolist() == [0, 1, 2, 4, 5] and run["drop_truncated"][1] == 1
    # group 0 all equal, groups 2 and 3 have one rollout: only group 1 (0 vs 1) keeps a signal
    assert run["drop_equal_rewards"][0].tolist() == [2, 3] and run["drop_equal_rewards"][1] == 4
    # group means: 1, 0.5, 0.5, 2
    assert run["score_range"][0].tolist() == [2, 3, 4] and run["score_range"][1] == 3
    both = algo(filters={"drop_equal_rewards": True, "score_range": (0.4, 0.6)})
    kept, m = apply_filters(rewards, rewards, groups, truncated, both)
    assert kept.tolist() == [2, 3]
    assert m["filter/drop_equal_rewards_dropped"].item() == 4 and m["filter/score_range_dropped"].item() == 0
    assert "filter/drop_truncated_dropped" not in m and m["filter/kept_frac"].item() == pytest.approx(2 / 6)
    # Filters chain: once the truncated rollout 3 is gone, group 1 has one rollout left and is dropped too.
    kept, m = apply_filters(rewards, rewards, groups, truncated, algo(filters={"drop_truncated": True,
                                                                             "drop_equal_rewards": True}))
    assert kept.tolist() == [] and m["filter/drop_truncated_dropped"].item() == 1
    assert m["filter/drop_equal_rewards_dropped"].item() == 5
