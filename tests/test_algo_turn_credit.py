"""Credit over turns (algo.turn_credit=turn): cases by hand, a numpy reference on random batches, and the
estimators' bias measured on a small decision problem whose exact policy gradient is known
(docs/algo.md#credit-over-turns-algoturn_credit-algoturn_discount)."""

from __future__ import annotations

import itertools
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
    from molt.algo import load_plugins

    with pytest.raises(SpecError, match="turn_discount=0.9 discounts turns only with algo.turn_credit=turn"):
        compose(["algo.turn_discount=0.9"])
    with pytest.raises(SpecError, match="act on whole-rollout rewards"):
        compose(["algo.turn_credit=turn", "algo.reward.clip=1.0"])
    with pytest.raises(ValueError, match="estimator=reinforce_pp: per-turn returns feed only .*grpo, rloo"):
        load_plugins(RunSpec.model_validate({"algo": {"estimator": "reinforce_pp", "turn_credit": "turn"}}))
    load_plugins(RunSpec.model_validate({"algo": {"estimator": "rloo", "turn_credit": "turn"}}))
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


# Unbiasedness, measured. A tabular policy (a softmax per state, its logits the parameters) decides in up
# to three turns; each turn's action is one sampled token and earns a reward at once. Turn 0: answer now
# (0.2, stop), a good call (0.5) or a bad call (0.0); after a call: answer (1.0 after the good one, 0.1
# after the bad one, stop) or call again (0.3); after a second call: answer (0.6) or give up (0.0), and
# the episode ends. So rollouts of one group take 1, 2 or 3 turns, the policy decides when to stop, and
# intermediate rewards differ by action: where a biased baseline shows. Seven trajectories: the exact
# gradient of J = E[sum of rewards] is a sum over them.
STATES = {"s0": [(0.2, None), (0.5, "good"), (0.0, "bad")], "good": [(1.0, None), (0.3, "s2")],
          "bad": [(0.1, None), (0.3, "s2")], "s2": [(0.6, None), (0.0, None)]}
LOGITS = [0.0, 0.3, -0.2, 0.2, -0.1, -0.3, 0.4, 0.1, 0.0]   # the parameters, state by state
FIRST = dict(zip(STATES, itertools.accumulate([0] + [len(a) for a in STATES.values()]), strict=False))


def paths(state: str = "s0", before: tuple = ()) -> list[tuple]:
    """Every trajectory: a tuple of (state, action, reward) per turn."""
    out = []
    for action, (reward, after) in enumerate(STATES[state]):
        path = (*before, (state, action, reward))
        out += [path] if after is None else paths(after, path)
    return out


PATHS = paths()
TURNS = 3


def log_pi(theta: torch.Tensor, state: str, action: int) -> torch.Tensor:
    first = FIRST[state]
    return torch.log_softmax(theta[first:first + len(STATES[state])], 0)[action]


def returns_of(path: tuple, d: float) -> list[float]:
    g, out = 0.0, []
    for *_, reward in reversed(path):
        g = reward + d * g
        out.append(g)
    return out[::-1]


def exact_terms(d: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each path's probability [paths], the score grad log pi of each of its turns [paths, TURNS, params]
    (0 past its end), and the exact E[grad log pi_k * G_k] of each turn k [TURNS, params]."""
    theta = torch.tensor(LOGITS, dtype=F64, requires_grad=True)
    scores = torch.zeros(len(PATHS), TURNS, len(LOGITS), dtype=F64)
    for i, path in enumerate(PATHS):
        for k, (state, action, _) in enumerate(path):
            scores[i, k] = torch.autograd.grad(log_pi(theta, state, action), theta)[0]
    with torch.no_grad():
        prob = torch.stack([sum(log_pi(theta, s, a) for s, a, _ in path).exp() for path in PATHS])
    g = torch.zeros(len(PATHS), TURNS, dtype=F64)
    for i, path in enumerate(PATHS):
        g[i, :len(path)] = torch.tensor(returns_of(path, d), dtype=F64)
    return prob, scores, torch.einsum("p,pk,pkn->kn", prob, g, scores)


GROUPS, N = 4000, 4
GRPO_BIAS = {1.0: (1.27, 0.998), 0.5: (2.34, 0.961)}   # grpo's mean update: length / target's, cosine


def sampled_batch(d: float, seed: int = 0) -> tuple[np.ndarray, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GROUPS groups of N rollouts drawn from the policy, through the loop's own turn_credit: the paths
    drawn [GROUPS, N], each rollout's whole return [R], every token's turn return and the loss mask [R, 1 +
    TURNS] (token 0 the prompt, token 1 + k turn k's action)."""
    prob, _, _ = exact_terms(d)
    drawn = np.random.default_rng(seed).choice(len(PATHS), size=(GROUPS, N), p=prob.numpy())
    rollouts = []
    for index in np.ndindex(drawn.shape):
        path, rid = PATHS[drawn[index]], f"{index[0]}-{index[1]}"
        length = 1 + len(path)
        segment = Segment(list(range(length)), [0] + [1] * len(path), [0.0] * length, [-1] + [0] * len(path),
                          rid, str(index[0]), turns=[[k, 1 + k] for k in range(len(path))])
        rewards = [r for *_, r in path]
        rollouts.append(Rollout(rid, str(index[0]), [segment], sum(rewards), turn_rewards=rewards))
    segments = [r.segments[0] for r in rollouts]
    mask = make_batch(segments)["loss_mask"].to(F64)   # [R, 1 + TURNS]: some rollouts take three turns
    spec = RunSpec.model_validate({"algo": {"estimator": "rloo", "turn_credit": "turn", "turn_discount": d}})
    first, extra = turn_credit(spec, rollouts, torch.zeros(len(rollouts), dtype=F64), segments, mask.shape)
    return drawn, first, extra["turn_returns"], mask


def mean_update(drawn: np.ndarray, adv: torch.Tensor,
                scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy-gradient update of each group, (1/N) sum over its rollouts and turns of A_k grad log pi_k
    (the loss's `seq` aggregation: a constant normalizer), averaged over groups, and its standard error."""
    per_token = adv.view(GROUPS, N, 1 + TURNS)[..., 1:]
    update = torch.einsum("gnk,gnkp->gp", per_token, scores[torch.as_tensor(drawn)]) / N
    return update.mean(0), update.std(0) / math.sqrt(GROUPS)


def estimate(name: str, d: float, batch, turn_returns: torch.Tensor | None = None) -> torch.Tensor:
    drawn, first, returns, mask = batch
    spec = RunSpec.model_validate({"algo": {"estimator": name, "turn_credit": "turn", "turn_discount": d}})
    groups = torch.arange(GROUPS).repeat_interleave(N)
    return compute_advantages(first, groups, torch.arange(len(first)), mask, spec.algo,
                              turn_returns=returns if turn_returns is None else turn_returns).advantages


def z_max(mean: torch.Tensor, se: torch.Tensor, target: torch.Tensor) -> float:
    return float(((mean - target) / se).abs().max())


@pytest.fixture(scope="module", params=[1.0, 0.5], ids=["d=1", "d=0.5"])
def problem(request):
    _, scores, per_turn = exact_terms(request.param)
    return request.param, scores, per_turn, sampled_batch(request.param)


def test_the_exact_gradient_is_the_sum_of_the_turn_terms():
    """The policy-gradient theorem on this problem: sum_k E[grad log pi_k * G_k] at d = 1 is grad J, by
    autograd through J = sum over paths of P(path) * its summed reward."""
    theta = torch.tensor(LOGITS, dtype=F64, requires_grad=True)
    total = sum(sum(log_pi(theta, s, a) for s, a, _ in path).exp() * sum(r for *_, r in path)
                for path in PATHS)
    assert float((exact_terms(1.0)[2].sum(0) - torch.autograd.grad(total, theta)[0]).abs().max()) < 1e-12


def test_turn_credit_is_unbiased_where_its_baseline_leaves_the_turn_alone(problem):
    """The Monte Carlo mean of rloo's update over 4,000 groups of 4 matches sum_k E[grad log pi_k * G_k]
    (at d = 1: the exact gradient of J) within 4.5 standard errors in every parameter; dr_grpo's baseline
    holds the rollout's own G_0 = (rewards before turn k) + d^k G_k with weight 1/N, so it matches
    sum_k (1 - d^k / N) E[grad log pi_k * G_k]: at d = 1 the gradient times (N - 1) / N. grpo's division by
    the group's std (and its 0 for a group of equal G_0, which at d < 1 depends on the actions) is biased:
    its mean update's length and direction against the target are the numbers docs/algo.md gives."""
    d, scores, per_turn, batch = problem
    target = per_turn.sum(0)
    mean, se = mean_update(batch[0], estimate("rloo", d, batch), scores)
    assert z_max(mean, se, target) < 4.5
    shrink = torch.tensor([1 - d**k / N for k in range(TURNS)], dtype=F64)
    mean, se = mean_update(batch[0], estimate("dr_grpo", d, batch), scores)
    assert z_max(mean, se, (shrink[:, None] * per_turn).sum(0)) < 4.5
    mean, se = mean_update(batch[0], estimate("grpo", d, batch), scores)
    length, cosine = float(mean.norm() / target.norm()), float(mean @ target / mean.norm() / target.norm())
    assert z_max(mean, se, target) > 10
    assert abs(length - GRPO_BIAS[d][0]) < 0.01 and abs(cosine - GRPO_BIAS[d][1]) < 0.001, (length, cosine)


def test_the_check_fails_on_a_per_position_baseline_and_on_a_turn_off_by_one(problem):
    """The same check rejects (by more than 10 standard errors) three broken estimators, so it can fail:
    - verl issue #7244's per-position baseline: turn t's tokens get sum_{k=t}^{K-1} (r_k - b_k), b_k the
      group's mean reward at turn index k over the rollouts that reached it; its baseline sums as many
      terms as the rollout has turns, which the policy's own stopping decides;
    - turn k's tokens given the return from turn k + 1 on (the turn's own reward lost);
    - turn k's tokens given the return from turn k - 1 on: a reward earned before the action, which at
      d = 1 averages out (so that shift is caught at d = 0.5 only, as the discount scales the rest)."""
    d, scores, per_turn, batch = problem
    drawn, first, returns, mask = batch
    target = per_turn.sum(0)
    rewards = torch.zeros(len(PATHS), TURNS, dtype=F64)
    reached = torch.zeros(len(PATHS), TURNS, dtype=F64)
    for i, path in enumerate(PATHS):
        rewards[i, :len(path)] = torch.tensor([r for *_, r in path], dtype=F64)
        reached[i, :len(path)] = 1
    r, m = rewards[torch.as_tensor(drawn)], reached[torch.as_tensor(drawn)]            # [GROUPS, N, TURNS]
    b = (r * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
    per_position = (((r - b) * m).flip(-1).cumsum(-1).flip(-1) * m).view(-1, TURNS)
    per_position = torch.nn.functional.pad(per_position, (1, 0))
    later = torch.zeros_like(returns)
    later[:, 1:TURNS] = returns[:, 2:]
    earlier = returns.clone()
    earlier[:, 2:] = returns[:, 1:TURNS] * (mask[:, 2:] > 0)
    broken = {"per-position baseline": per_position,
              "turn k + 1's return": estimate("rloo", d, batch, later),
              "turn k - 1's return": estimate("rloo", d, batch, earlier)}
    for name, adv in broken.items():
        mean, se = mean_update(drawn, adv, scores)
        if name == "turn k - 1's return" and d == 1.0:
            assert z_max(mean, se, target) < 4.5   # unbiased, as said above
        else:
            assert z_max(mean, se, target) > 10, name
