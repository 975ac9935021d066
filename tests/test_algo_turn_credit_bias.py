"""Credit over turns, the estimators' bias measured: on a small decision problem whose exact policy
gradient is known, the Monte Carlo mean and the exact expectation of each estimator's update through the
loop's own turn_credit, against that gradient (docs/algo.md#which-baselines-keep-the-gradient-unbiased)."""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import numpy as np
import pytest
import torch

from molt.algo import compute_advantages
from molt.driver.select import turn_credit
from molt.spec import RunSpec
from molt.trainer.batch import make_batch
from molt.trajectory import Rollout, Segment

F64 = torch.float64


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


GROUPS, N = 2000, 4
GRPO_BIAS = {1.0: (1.257, 0.9985), 0.5: (2.335, 0.9597)}   # grpo's expected update: length / target's, cosine


class Batch(NamedTuple):
    """Groups of N rollouts: the path of each [G, N], each rollout's whole return [G * N], every token's
    turn return and the loss mask [G * N, 1 + TURNS] (token 0 the prompt, token 1 + k turn k's action),
    and each group's weight in the mean [G]."""
    drawn: torch.Tensor
    first: torch.Tensor
    returns: torch.Tensor
    mask: torch.Tensor
    weight: torch.Tensor


def sampled_batch(d: float, seed: int = 0) -> Batch:
    """GROUPS groups drawn from the policy, each rollout through the loop's turn_credit; weight 1/GROUPS."""
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
    return Batch(torch.as_tensor(drawn), first, extra["turn_returns"], mask,
                 torch.full((GROUPS,), 1 / GROUPS, dtype=F64))


def every_group(sampled: Batch, prob: torch.Tensor) -> Batch:
    """All len(PATHS)^N ordered groups, each weighted by its probability, every path's rollout as turn_credit
    gave it in `sampled`: the mean update over them is the exact expectation."""
    drawn = torch.tensor(list(itertools.product(range(len(PATHS)), repeat=N)))
    one = [int((sampled.drawn.flatten() == p).nonzero()[0]) for p in range(len(PATHS))]   # a rollout per path
    rows = torch.tensor(one)[drawn.flatten()]
    return Batch(drawn, sampled.first[rows], sampled.returns[rows], sampled.mask[rows], prob[drawn].prod(1))


def mean_update(batch: Batch, adv: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy-gradient update of each group, (1/N) sum over its rollouts and turns of A_k grad log pi_k
    (the loss's `seq` aggregation: a constant normalizer), its weighted mean over the groups, and (for a
    sample) the mean's standard error."""
    per_token = adv.view(len(batch.drawn), N, 1 + TURNS)[..., 1:]
    update = torch.einsum("gnk,gnkp->gp", per_token, scores[batch.drawn]) / N
    return batch.weight @ update, update.std(0) / math.sqrt(len(update))


def estimate(name: str, d: float, batch: Batch, turn_returns: torch.Tensor | None = None) -> torch.Tensor:
    spec = RunSpec.model_validate({"algo": {"estimator": name, "turn_credit": "turn", "turn_discount": d}})
    groups = torch.arange(len(batch.drawn)).repeat_interleave(N)
    return compute_advantages(batch.first, groups, torch.arange(len(batch.first)), batch.mask, spec.algo,
                              turn_returns=batch.returns if turn_returns is None else turn_returns).advantages


def broken(d: float, batch: Batch) -> dict[str, torch.Tensor]:
    """Three broken estimators' advantages (test_the_check_fails_...)."""
    rewards = torch.zeros(len(PATHS), TURNS, dtype=F64)
    reached = torch.zeros(len(PATHS), TURNS, dtype=F64)
    for i, path in enumerate(PATHS):
        rewards[i, :len(path)] = torch.tensor([r for *_, r in path], dtype=F64)
        reached[i, :len(path)] = 1
    r, m = rewards[batch.drawn], reached[batch.drawn]            # [G, N, TURNS]
    b = (r * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
    per_position = torch.nn.functional.pad((((r - b) * m).flip(-1).cumsum(-1).flip(-1) * m).view(-1, TURNS),
                                           (1, 0))
    later = torch.zeros_like(batch.returns)
    later[:, 1:TURNS] = batch.returns[:, 2:]
    earlier = batch.returns.clone()
    earlier[:, 2:] = batch.returns[:, 1:TURNS] * (batch.mask[:, 2:] > 0)
    return {"per-position baseline": per_position, "turn k + 1's return": estimate("rloo", d, batch, later),
            "turn k - 1's return": estimate("rloo", d, batch, earlier)}


def z_max(mean: torch.Tensor, se: torch.Tensor, target: torch.Tensor) -> float:
    return float(((mean - target) / se).abs().max())


@pytest.fixture(scope="module", params=[1.0, 0.5], ids=["d=1", "d=0.5"])
def problem(request):
    prob, scores, per_turn = exact_terms(request.param)
    sampled = sampled_batch(request.param)
    return request.param, scores, per_turn, sampled, every_group(sampled, prob)


def test_the_exact_gradient_is_the_sum_of_the_turn_terms():
    """The policy-gradient theorem on this problem: sum_k E[grad log pi_k * G_k] at d = 1 is grad J, by
    autograd through J = sum over paths of P(path) * its summed reward."""
    theta = torch.tensor(LOGITS, dtype=F64, requires_grad=True)
    total = sum(sum(log_pi(theta, s, a) for s, a, _ in path).exp() * sum(r for *_, r in path)
                for path in PATHS)
    assert float((exact_terms(1.0)[2].sum(0) - torch.autograd.grad(total, theta)[0]).abs().max()) < 1e-12


def test_turn_credit_is_unbiased_where_its_baseline_leaves_the_turn_alone(problem):
    """The Monte Carlo mean of rloo's update over 2,000 groups of 4 matches sum_k E[grad log pi_k * G_k]
    (at d = 1: the exact gradient of J) within 4.5 standard errors in every parameter; dr_grpo's baseline
    holds the rollout's own G_0 = (rewards before turn k) + d^k G_k with weight 1/N, so it matches
    sum_k (1 - d^k / N) E[grad log pi_k * G_k]: at d = 1 the gradient times (N - 1) / N. Over every
    possible group, weighted by its probability (the exact expectation), both hold to rounding."""
    d, scores, per_turn, sampled, exact = problem
    shrink = torch.tensor([1 - d**k / N for k in range(TURNS)], dtype=F64)
    for name, target in (("rloo", per_turn.sum(0)), ("dr_grpo", (shrink[:, None] * per_turn).sum(0))):
        mean, se = mean_update(sampled, estimate(name, d, sampled), scores)
        assert z_max(mean, se, target) < 4.5, name
        expected = mean_update(exact, estimate(name, d, exact), scores)[0]
        assert float((expected - target).abs().max()) < 1e-12, name


def test_grpo_turn_credit_is_biased_by_what_the_docs_say(problem):
    """grpo divides by the group's std of G_0 (its own rollout's included) and gives a group of equal G_0 0
    (at d < 1 an event the actions decide): its exact expected update, over every group, against the
    target sum_k E[grad log pi_k * G_k], has the length ratio and cosine docs/algo.md gives."""
    d, scores, per_turn, _, exact = problem
    mean, target = mean_update(exact, estimate("grpo", d, exact), scores)[0], per_turn.sum(0)
    length, cosine = float(mean.norm() / target.norm()), float(mean @ target / mean.norm() / target.norm())
    assert abs(length - GRPO_BIAS[d][0]) < 0.001 and abs(cosine - GRPO_BIAS[d][1]) < 0.0001, (length, cosine)


def test_the_check_fails_on_a_per_position_baseline_and_on_a_turn_off_by_one(problem):
    """The same check rejects (by more than 10 standard errors) three broken estimators, so it can fail:
    - verl issue #7244's per-position baseline: turn t's tokens get sum_{k=t}^{K-1} (r_k - b_k), b_k the
      group's mean reward at turn index k over the rollouts that reached it; its baseline sums as many
      terms as the rollout has turns, which the policy's own stopping decides;
    - turn k's tokens given the return from turn k + 1 on (the turn's own reward lost);
    - turn k's tokens given the return from turn k - 1 on: a reward earned before the action, which at
      d = 1 averages out (so that shift is caught at d = 0.5 only, as the discount scales the rest)."""
    d, scores, per_turn, sampled, exact = problem
    target = per_turn.sum(0)
    for name, adv in broken(d, sampled).items():
        mean, se = mean_update(sampled, adv, scores)
        expected = mean_update(exact, broken(d, exact)[name], scores)[0]
        if name == "turn k - 1's return" and d == 1.0:   # unbiased, as said above
            assert z_max(mean, se, target) < 4.5 and float((expected - target).abs().max()) < 1e-12
        else:
            assert z_max(mean, se, target) > 10 and float((expected - target).abs().max()) > 1e-3, name
