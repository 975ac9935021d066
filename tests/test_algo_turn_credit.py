"""Credit over turns (algo.turn_credit=turn): cases by hand, a numpy reference on random batches, the
refusals (docs/algo.md#credit-over-turns-algoturn_credit-algoturn_discount). The estimators' bias, measured
on a decision problem with a known gradient: tests/test_algo_turn_credit_bias.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from molt.algo import compute_advantages
from molt.driver.compose import compose
from molt.driver.select import group_ids, turn_credit
from molt.spec import RunSpec, SpecError
from molt.trainer.batch import make_batch
from molt.trajectory import Rollout, Segment

F64 = torch.float64


# Credit over turns (algo.turn_credit=turn, turn_discount d = 0.5), one group of three Env rollouts and one
# rollout alone. Per-turn rewards and returns G_k = r_k + d * G_{k+1}:
#   A: one segment, two turns, rewards [1.0, 0.5]            -> G = [1.25, 0.5]
#   B: two segments (a re-rendered prompt after its first turn), rewards [0.0, 1.0] -> G = [0.5, 1.0]
#   C: one turn, reward 0.25                                  -> G = [0.25]
#   D: alone in its group, two turns, rewards [1.0, 1.0]     -> G = [1.5, 1.0]
# The group's baseline is over whole-rollout returns G_0 (A 1.25, B 0.5, C 0.25): mean 2/3, unbiased std
# sqrt((7/12)^2 + (1/6)^2 + (5/12)^2) / 2) = sqrt(0.2708333) = 0.5204165.
def turn_rollouts():
    def seg(rid, mask, turns, index=0):
        return Segment(list(range(len(mask))), mask, [0.0] * len(mask), [0 if m else -1 for m in mask], rid,
                       rid[0], index, turns=turns)
    a = Rollout("A", "g", [seg("A", [0, 0, 1, 1, 1, 0, 0, 1, 1], [[0, 2], [1, 7]])], 1.5,
                turn_rewards=[1.0, 0.5])
    b = Rollout("B", "g", [seg("B", [0, 0, 1, 1], [[0, 2]]), seg("B", [0, 0, 0, 0, 1, 1, 1], [[1, 4]], 1)],
                1.0, turn_rewards=[0.0, 1.0])
    c = Rollout("C", "g", [seg("C", [0, 1, 1], [[0, 1]])], 0.25, turn_rewards=[0.25])
    d = Rollout("D", "h", [seg("D", [0, 1, 0, 1], [[0, 1], [1, 3]])], 2.0, turn_rewards=[1.0, 1.0])
    return [a, b, c, d]


STD = math.sqrt(((7 / 12) ** 2 + (1 / 6) ** 2 + (5 / 12) ** 2) / 2)
TURN_EXPECTED = {   # per segment row: the value on each sampled token, in order (turn 0's, then turn 1's)
    "dr_grpo": [[7 / 12] * 3 + [0.5 - 2 / 3] * 2, [-1 / 6] * 2, [1.0 - 2 / 3] * 3, [-5 / 12] * 2, [0.0] * 2],
    "grpo": [[7 / 12 / (STD + 1e-6)] * 3 + [(0.5 - 2 / 3) / (STD + 1e-6)] * 2, [-1 / 6 / (STD + 1e-6)] * 2,
             [(1 - 2 / 3) / (STD + 1e-6)] * 3, [-5 / 12 / (STD + 1e-6)] * 2, [0.0] * 2],
    # G minus the mean of the OTHER rollouts' G_0: A (0.5 + 0.25) / 2, B (1.25 + 0.25) / 2, C (1.25 + 0.5) / 2
    "rloo": [[0.875] * 3 + [0.125] * 2, [-0.25] * 2, [0.25] * 3, [-0.625] * 2, [0.0] * 2],
}


@pytest.mark.parametrize("name", sorted(TURN_EXPECTED))
def test_turn_credit_by_hand_on_two_turn_trajectories(name):

    spec = RunSpec.model_validate({"algo": {"estimator": name, "turn_credit": "turn", "turn_discount": 0.5}})
    rollouts = turn_rollouts()
    segments = [s for r in rollouts for s in r.segments]
    mask = make_batch(segments)["loss_mask"].to(F64)
    rewards = torch.tensor([r.reward for r in rollouts], dtype=F64)
    first, extra = turn_credit(spec, rollouts, rewards, segments, mask.shape)
    assert first.tolist() == [1.25, 0.5, 0.25, 1.5]
    out = compute_advantages(first, torch.tensor([0, 0, 0, 1]), torch.tensor([0, 1, 1, 2, 3]), mask,
                             spec.algo, **extra)
    for row, expected in enumerate(TURN_EXPECTED[name]):
        got = out.advantages[row][mask[row] > 0].tolist()
        assert max(abs(g - e) for g, e in zip(got, expected, strict=True)) < 1e-12, (row, got, expected)
    assert float(out.advantages[mask == 0].abs().max()) == 0.0
    # rollout credit: the same batch, every token of a rollout gets its summed reward's advantage
    rollout_spec = RunSpec.model_validate({"algo": {"estimator": name}})
    same, none = turn_credit(rollout_spec, rollouts, rewards, segments, mask.shape)
    assert same is rewards and none == {}


def test_turn_credit_with_only_a_final_reward_and_no_discount_is_rollout_credit():

    rollouts = turn_rollouts()
    for r in rollouts:
        r.turn_rewards = [0.0] * (len(r.turn_rewards) - 1) + [r.reward]
    segments = [s for r in rollouts for s in r.segments]
    mask = make_batch(segments)["loss_mask"].to(F64)
    rewards = torch.tensor([r.reward for r in rollouts], dtype=F64)
    args = torch.tensor([0, 0, 0, 1]), torch.tensor([0, 1, 1, 2, 3]), mask
    for name in TURN_EXPECTED:
        turn = RunSpec.model_validate({"algo": {"estimator": name, "turn_credit": "turn"}})
        first, extra = turn_credit(turn, rollouts, rewards, segments, mask.shape)
        by_turn = compute_advantages(first, *args, turn.algo, **extra).advantages
        by_rollout = compute_advantages(rewards, *args, turn.algo).advantages
        assert float((by_turn - by_rollout).abs().max()) < 1e-12, name


@pytest.mark.parametrize("dtype, d", [(F64, 0.5), (torch.float32, 0.9)])
def test_turn_credit_gives_a_group_of_equal_returns_no_advantage(dtype, d):
    """Eight rollouts that each call a tool (reward 0) and then answer right (reward 1), discount d: whole
    returns all d (std 0, or ~4e-8 in float32 at d = 0.9: rounding). Their answer turn's G = 1 is above the
    group mean d only by the discount: GRPO gives every token 0 (as rollout credit does), not
    (1 - d) / (std + 1e-6); dr_grpo and rloo, which do not divide by the std, give the answer turn the
    discount's 1 - d and the call turn 0."""

    def rollout(rid):
        mask = [0, 1, 1, 0, 1]
        segment = Segment(list(range(5)), mask, [0.0] * 5, [0 if m else -1 for m in mask], rid, "g", 0,
                          turns=[[0, 1], [1, 4]])
        return Rollout(rid, "g", [segment], 1.0, turn_rewards=[0.0, 1.0])
    rollouts = [rollout(str(i)) for i in range(8)]
    segments = [s for r in rollouts for s in r.segments]
    mask = make_batch(segments)["loss_mask"].to(dtype)
    for name, answer in (("grpo", 0.0), ("dr_grpo", 1 - d), ("rloo", 1 - d)):
        algo = {"estimator": name, "turn_credit": "turn", "turn_discount": d}
        spec = RunSpec.model_validate({"algo": algo})
        first, extra = turn_credit(spec, rollouts, torch.ones(8, dtype=dtype), segments, mask.shape)
        adv = compute_advantages(first, torch.zeros(8, dtype=torch.long), torch.arange(8), mask, spec.algo,
                                 **extra).advantages
        assert adv[:, 1:3].abs().max().item() < 1e-6 and (adv[:, 4] - answer).abs().max().item() < 1e-6, \
            (name, adv)


def test_turn_credit_is_refused_where_it_cannot_act_and_taken_from_both_agent_paths():
    from molt.driver.compose import check_algorithm

    with pytest.raises(SpecError, match="turn_discount=0.9 discounts turns only with algo.turn_credit=turn"):
        compose(["algo.turn_discount=0.9"])
    with pytest.raises(SpecError, match="act on whole-rollout rewards"):
        compose(["algo.turn_credit=turn", "algo.reward.clip=1.0"])
    with pytest.raises(ValueError, match="estimator=reinforce_pp: per-turn returns feed only .*grpo, rloo"):
        check_algorithm(RunSpec.model_validate({"algo": {"estimator": "reinforce_pp",
                                                         "turn_credit": "turn"}}))
    check_algorithm(RunSpec.model_validate({"algo": {"estimator": "rloo", "turn_credit": "turn"}}))
    # a ChatAgent reports its turns' rewards (ChatContext.reward_turn; tests/test_agents_chat.py)
    assert compose(["agent=chat_minimal", "algo.turn_credit=turn"]).algo.turn_credit == "turn"


# A numpy reference, written from docs/algo.md's definitions and nothing of Molt's: each rollout's
# returns G_k = sum_{j>=k} d^(j-k) r_j, the group's statistics over its whole returns G_0, and per turn
#   grpo    (G_k - mean) / (std + 1e-6), 0 for a group of one or whose G_0 are all equal (std within
#           1e-6 of their size),
#   dr_grpo G_k - mean, 0 for a group of one,
#   rloo    G_k - mean of the other rollouts' G_0, 0 for a group of one.
def reference(turn_rewards: list[list[float]], groups: list[int], estimator: str,
              d: float) -> list[list[float]]:
    returns = []
    for rewards in turn_rewards:
        g, out = 0.0, []
        for r in reversed(rewards):
            g = r + d * g
            out.append(g)
        returns.append(out[::-1])
    adv = []
    for i, g in enumerate(groups):
        whole = np.array([returns[j][0] for j in range(len(groups)) if groups[j] == g])
        n, mean = len(whole), whole.mean()
        std = whole.std(ddof=1) if n > 1 else 0.0
        if n == 1 or (estimator == "grpo" and std <= 1e-6 * (1 + abs(mean))):
            adv.append([0.0] * len(returns[i]))
        elif estimator == "grpo":
            adv.append([(x - mean) / (std + 1e-6) for x in returns[i]])
        elif estimator == "dr_grpo":
            adv.append([x - mean for x in returns[i]])
        else:
            others = (whole.sum() - returns[i][0]) / (n - 1)
            adv.append([x - others for x in returns[i]])
    return adv


def random_batch(rng: np.random.Generator) -> tuple[list[Rollout], list[list[int]]]:
    """Groups of 1-5 rollouts of 1-4 turns each, interleaved in the batch; a rollout's turns split over one or
    two segments, each turn 1-3 sampled tokens after 0-2 tokens of observation; rewards from a small grid
    (ties are common) and one group of identical rollouts. Returns the rollouts and, per segment, the turn
    of each token (-1 where not sampled)."""
    sizes = [int(rng.integers(1, 6)) for _ in range(int(rng.integers(2, 6)))]
    rewards = {g: [list(rng.choice([-0.5, 0.0, 0.25, 0.5, 1.0], size=int(rng.integers(1, 5))))
                   for _ in range(n)] for g, n in enumerate(sizes)}
    rewards[len(sizes)] = [[0.0, 1.0]] * 4   # whole returns all equal: grpo gives 0, not (1 - d) / 1e-6
    order = [(g, k) for g, rs in rewards.items() for k in range(len(rs))]
    rng.shuffle(order)
    rollouts, turn_of = [], []
    for g, k in order:
        rid, turns = f"{g}-{k}", rewards[g][k]
        split = int(rng.integers(1, len(turns) + 1))   # turns before it in the first segment
        segments = []
        for index, span in enumerate((range(split), range(split, len(turns)))):
            if not span:
                continue
            mask, marks = [0] * int(rng.integers(1, 4)), []
            for turn in span:
                mask += [0] * int(rng.integers(0, 3))
                marks.append([turn, len(mask)])
                mask += [1] * int(rng.integers(1, 4))
            owner = [-1] * len(mask)
            for (turn, start), end in zip(marks, [m[1] for m in marks[1:]] + [len(mask)], strict=True):
                owner[start:end] = [turn if m else -1 for m in mask[start:end]]
            segments.append(Segment(list(range(len(mask))), mask, [0.0] * len(mask),
                                    [0 if m else -1 for m in mask], rid, str(g), index, turns=marks))
            turn_of.append(owner)
        rollouts.append(Rollout(rid, str(g), segments, float(sum(turns)),
                                turn_rewards=[float(r) for r in turns]))
    return rollouts, turn_of


@pytest.mark.parametrize("dtype, d", [(F64, 1.0), (F64, 0.5), (torch.float32, 0.9)])
def test_turn_credit_matches_a_numpy_reference_on_random_batches(dtype, d):
    """Forty random batches (groups of unequal turn counts, interleaved, rollouts over two segments, one
    all-equal group) through turn_credit and the estimators, against the reference token by token, by the
    max. The all-equal group under grpo in float32 at d = 0.9 is the past 9.4e4-advantage bug."""
    rng = np.random.default_rng(7)
    tolerance = 1e-12 if dtype == F64 else 2e-5
    for _ in range(40):
        rollouts, turn_of = random_batch(rng)
        segments = [s for r in rollouts for s in r.segments]
        mask = make_batch(segments)["loss_mask"].to(dtype)
        segment_rollout = torch.tensor([i for i, r in enumerate(rollouts) for _ in r.segments])
        groups = group_ids(rollouts)
        for name in ("grpo", "dr_grpo", "rloo"):
            spec = RunSpec.model_validate({"algo": {"estimator": name, "turn_credit": "turn",
                                                    "turn_discount": d}})
            rewards = torch.tensor([r.reward for r in rollouts], dtype=dtype)
            first, extra = turn_credit(spec, rollouts, rewards, segments, mask.shape)
            adv = compute_advantages(first, groups, segment_rollout, mask, spec.algo, **extra).advantages
            want = reference([r.turn_rewards for r in rollouts], groups.tolist(), name, d)
            expected = torch.zeros(mask.shape, dtype=F64)
            for row, owner in enumerate(turn_of):
                for t, turn in enumerate(owner):
                    if turn >= 0:
                        expected[row, t] = want[int(segment_rollout[row])][turn]
            scale = max(1.0, float(expected.abs().max()))
            assert float((adv.to(F64) - expected).abs().max()) < tolerance * scale, name
