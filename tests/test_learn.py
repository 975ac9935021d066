"""`learn` feeds the real trainer exactly what the algorithm prescribes for the rollouts it keeps.

The expected advantages are written out here from the definitions (not through `compute_advantages`),
per rollout and group, and matched to the batch rows by token ids: a flipped sign, a rollout given
another group's baseline, a dropped group that still trains or a critic value read one token late fails.
"""

from __future__ import annotations

import asyncio
import random
import statistics

import pytest
import torch

from molt.driver.compose import compose
from molt.driver.loop import learn
from molt.trainer import TrainerRanks
from molt.trainer.ranks import Trainers
from molt.trajectory import NO_VERSION, Rollout, Segment

pytestmark = pytest.mark.timeout(300)
SMALL = ["train.prompts_per_step=3", "rollout.samples_per_prompt=3", "train.micro_batch_size=4",
         "logging.wandb.mode=disabled"]


class Recording:
    """A real TrainerRanks whose calls (arguments and answers) are kept."""

    def __init__(self, group: TrainerRanks) -> None:
        self.group, self.calls = group, {}

    def __getattr__(self, name: str):
        def call(*args):
            out = getattr(self.group, name)(*args)
            self.calls.setdefault(name, []).append((args, out))
            return out
        return call


def rollouts() -> list[Rollout]:
    """3 groups x 3 rollouts, interleaved across groups; g0-1 has two segments, g1-2 failed (its group is
    dropped: agent.on_failure=drop_group). Every segment's token ids are unique, to find its batch row."""
    rng, out, next_id = random.Random(0), [], 10
    for i in range(3):
        for g in range(3):
            rid, segments = f"g{g}-{i}", []
            for k in range(2 if rid == "g0-1" else 1):
                prompt, response = rng.randint(1, 3), rng.randint(2, 5)
                ids = list(range(next_id, next_id + prompt + response))
                next_id += len(ids)
                mask = [0] * prompt + [1] * response
                segments.append(Segment(ids, mask, [-rng.uniform(1, 3) * m for m in mask],
                                        [0 if m else NO_VERSION for m in mask], rid, f"g{g}", k, prompt))
            error = "agent failed" if rid == "g1-2" else None
            out.append(Rollout(rid, f"g{g}", [] if error else segments, round(rng.random(), 3), error=error))
    return out


def uneven_rollouts() -> list[Rollout]:
    """Three kept groups of 4, 2 and 3 rollouts in a non-periodic order (g0 g1 g0 g2 g2 g0 g1 g2 g0), with
    distinct rewards: a shift, rotation or mix-up of group ids gives some rollout another group's baseline
    (an alternating order of equal groups only renames them under a rotation). g3 failed and is dropped."""
    order = ["g0", "g1", "g0", "g2", "g2", "g0", "g1", "g2", "g0", "g3"]
    rewards = [0.9, 0.1, 0.3, 0.7, 0.2, 0.0, 0.6, 0.45, 0.55, 0.5]
    out, next_id, seen = [], 10, {}
    for g, reward in zip(order, rewards, strict=True):
        i = seen[g] = seen.get(g, -1) + 1
        ids = list(range(next_id, next_id + 3 + i + len(out) % 3))   # 2 prompt tokens, 1+ response
        next_id += len(ids)
        mask = [0, 0] + [1] * (len(ids) - 2)
        segment = Segment(ids, mask, [-0.5 * m for m in mask], [0 if m else NO_VERSION for m in mask],
                          f"{g}-{i}", g, 0, 2)
        error = "agent failed" if g == "g3" else None
        out.append(Rollout(f"{g}-{i}", g, [] if error else [segment], reward, error=error))
    return out


def rows_by_rollout(batch: dict[str, torch.Tensor], kept: list[Rollout]) -> dict[str, list[int]]:
    """Batch row indexes of each rollout's segments (in segment order), found by their token ids."""
    first_ids = {int(batch["input_ids"][row, 0]): row for row in range(batch["input_ids"].shape[0])}
    return {r.rollout_id: [first_ids[s.token_ids[0]] for s in r.segments] for r in kept}


@pytest.fixture(scope="module")
def critic(ray_session):
    """A critic rank; the policy is the session's `trainer` (the trainer's loss settings do not change
    what `learn` feeds it)."""
    group = TrainerRanks(compose([*SMALL, "algo=gae", "model.critic=true"]), "critic")
    yield group
    group.shutdown()


@pytest.mark.parametrize("make, dropped, rows", [(rollouts, "g1", 7), (uneven_rollouts, "g3", 9)])
def test_learn_trains_exactly_the_estimators_advantages(trainer, make, dropped, rows):
    spec = compose([*SMALL, "algo=grpo"])
    policy = Recording(trainer)
    batch_in = make()
    metrics = asyncio.run(learn(spec, batch_in, Trainers(policy), 0))
    [((batch, *_), _)] = policy.calls["update"]   # (batch, algo)
    kept = [r for r in batch_in if r.group_id != dropped]
    assert batch["input_ids"].shape[0] == sum(len(r.segments) for r in kept) == rows
    rows = rows_by_rollout(batch, kept)
    for r in kept:
        group = [x.reward for x in kept if x.group_id == r.group_id]
        expected = (r.reward - statistics.fmean(group)) / (statistics.stdev(group) + 1e-6)
        for row in rows[r.rollout_id]:
            sampled = batch["loss_mask"][row] > 0
            assert torch.allclose(batch["advantages"][row][sampled], torch.tensor(expected), atol=1e-5)
            assert (batch["advantages"][row][~sampled] == 0).all()
    assert metrics["tokens/trained"] == float(batch["loss_mask"].sum())


def test_learn_gae_uses_the_critics_values_and_trains_it_on_the_returns(trainer, critic):
    """GAE by hand over each rollout's sampled tokens (across its segments) with the values the critic
    returned; the policy gets them whitened, the critic is trained towards A + V on the same positions."""
    spec = compose([*SMALL, "algo=gae", "model.critic=true", "algo.lam=0.9"])
    policy, critic = Recording(trainer), Recording(critic)
    batch_in = rollouts()
    asyncio.run(learn(spec, batch_in, Trainers(policy, critic=critic), 0))
    [((batch, *_), _)] = policy.calls["update"]   # (batch, algo)
    [(_, values)] = critic.calls["values"]
    [((critic_batch, *_), _)] = critic.calls["update"]
    kept = [r for r in batch_in if r.group_id != "g1"]
    rows = rows_by_rollout(batch, kept)
    advantages, returns = torch.zeros_like(values), torch.zeros_like(values)
    for r in kept:
        cells = [(row, t) for row in rows[r.rollout_id] for t in range(batch["input_ids"].shape[1])
                 if batch["loss_mask"][row, t] > 0]
        v = [float(values[c]) for c in cells] + [0.0]
        running = 0.0
        for i in reversed(range(len(cells))):
            reward = r.reward if i == len(cells) - 1 else 0.0
            running = reward + spec.algo.gamma * v[i + 1] - v[i] + spec.algo.gamma * spec.algo.lam * running
            advantages[cells[i]], returns[cells[i]] = running, running + v[i]
    sampled = batch["loss_mask"] > 0
    mean, std = advantages[sampled].mean(), advantages[sampled].std(correction=0)
    assert torch.allclose(batch["advantages"][sampled], (advantages[sampled] - mean) / std, atol=1e-4)
    assert torch.allclose(critic_batch["returns"][sampled], returns[sampled], atol=1e-5)
    assert torch.equal(critic_batch["old_values"], values)


def test_a_plugin_estimator_with_a_critic_gets_its_values_and_trains_it_on_its_returns(trainer, critic):
    """examples/algo/mc_value.py registers `needs_critic=True` and nothing else: no edit to molt/spec/. The
    driver then requires model.critic (refused without), `learn` hands it the critic's values, the policy its
    advantages G_t - V_t (not whitened) and the critic its returns G_t (gamma 0.9, by hand)."""
    from molt.spec import SpecError

    plugin = ["algo.plugins=[examples/algo/mc_value.py]", "algo.estimator=mc_value", "algo.gamma=0.9"]
    with pytest.raises(SpecError, match="algo.estimator=mc_value needs a critic: set model.critic=true"):
        compose([*SMALL, *plugin])
    spec = compose([*SMALL, *plugin, "model.critic=true"])
    policy, critic = Recording(trainer), Recording(critic)
    batch_in = rollouts()
    metrics = asyncio.run(learn(spec, batch_in, Trainers(policy, critic=critic), 0))
    [((batch, *_), _)] = policy.calls["update"]
    [(_, values)] = critic.calls["values"]
    [((critic_batch, *_), _)] = critic.calls["update"]
    kept = [r for r in batch_in if r.group_id != "g1"]
    rows = rows_by_rollout(batch, kept)
    returns = torch.zeros_like(values)
    for r in kept:
        cells = [(row, t) for row in rows[r.rollout_id] for t in range(batch["input_ids"].shape[1])
                 if batch["loss_mask"][row, t] > 0]
        for i, cell in enumerate(cells):
            returns[cell] = r.reward * 0.9 ** (len(cells) - 1 - i)
    sampled = batch["loss_mask"] > 0
    assert torch.allclose(critic_batch["returns"][sampled], returns[sampled], atol=1e-5)
    assert torch.allclose(batch["advantages"][sampled], (returns - values)[sampled], atol=1e-5)
    assert "adv/mc_value_baseline" in metrics and "critic/value_loss" in metrics


def test_learn_logs_the_trainers_metrics_under_the_names_they_produce(trainer, critic):
    """Each trainer metric is produced once, under its final name, by the rank that computes it: the
    policy's under train/ (its trainer/engine gap under mismatch/), the critic's under critic/, and `learn`
    merges them as they are. A loop that renamed them again (train/train/loss) or a rank that returned
    bare names (loss) fails here."""
    spec = compose([*SMALL, "algo=gae", "model.critic=true"])
    policy, critic = Recording(trainer), Recording(critic)
    metrics = asyncio.run(learn(spec, rollouts(), Trainers(policy, critic=critic), 0))
    [(_, trained)] = policy.calls["update"]
    [(_, critic_trained)] = critic.calls["update"]
    assert {"train/loss", "train/grad_norm", "mismatch/max_abs"} <= trained.keys()
    assert all(key.startswith(("train/", "mismatch/")) for key in trained), sorted(trained)
    assert {"critic/loss", "critic/value_error"} <= critic_trained.keys()
    assert all(key.startswith("critic/") for key in critic_trained), sorted(critic_trained)
    both = {**trained, **critic_trained}
    assert {key: metrics.get(key) for key in both} == both
