"""Streaming pool on the shared real engine: depth, complete groups, staleness, idle fraction."""

from __future__ import annotations

import asyncio

import pytest
from poollib import FnGroups

from molt.rollout.dispatch import Dispatcher
from molt.rollout.pool import RolloutPool
from molt.trajectory import NO_VERSION, Rollout, Segment

SAMPLING = {"temperature": 1.0, "max_tokens": 6}
N = 2


def make_rollout_fn(dispatcher: Dispatcher, live: dict):
    """A one-turn agent: generate once, reward = fraction of sampled tokens equal to the prompt's last id.

    `live` tracks how many groups have a rollout running, to observe the pool's depth from outside.
    """
    async def rollout_fn(item: dict, group_id: str, index: int) -> Rollout:
        live.setdefault(group_id, 0)
        live[group_id] += 1
        live["max"] = max(live.get("max", 0), sum(1 for k, v in live.items() if k != "max" and v > 0))
        rid = f"{group_id}-{index}"
        prompt = item["prompt_ids"]
        try:
            out = await dispatcher.generate(prompt, {**SAMPLING, "seed": index}, key=rid)
        finally:
            live[group_id] -= 1
            dispatcher.release(rid)
        ids = out["token_ids"]
        seg = Segment(token_ids=prompt + ids, loss_mask=[0] * len(prompt) + [1] * len(ids),
                      logprobs=[0.0] * len(prompt) + out["logprobs"],
                      versions=[NO_VERSION] * len(prompt) + out["versions"], rollout_id=rid,
                      group_id=group_id, prompt_len=len(prompt), finish_reason=out["finish_reason"])
        reward = sum(t == prompt[-1] for t in ids) / max(len(ids), 1)
        return Rollout(rollout_id=rid, group_id=group_id, segments=[seg], reward=reward, label=item["label"])

    return rollout_fn


def items(count: int):
    return ({"prompt_ids": [1, 30 + i, 31 + i], "label": i} for i in range(count))


def test_pool_depth_batches_and_exhaustion(engine):
    async def main():
        live: dict = {}
        pool = RolloutPool(items(7), FnGroups(make_rollout_fn(Dispatcher([engine]), live), N),
                           groups_in_flight=3, max_staleness=1, engines=[engine])
        first = await pool.next_batch(2)
        assert pool.in_flight == 3          # refilled at once: the engine does not run dry
        rest = [await pool.next_batch(2), await pool.next_batch(2), await pool.next_batch(2)]
        return pool, live, first, rest

    pool, live, first, rest = asyncio.run(main())
    assert live["max"] == 3                 # kept exactly groups_in_flight groups going, never more
    assert [len(b) for b in [first, *rest]] == [2, 2, 2, 1]   # 7 items, the last batch is short
    groups = [g for b in [first, *rest] for g in b]
    assert sorted(g[0].label for g in groups) == list(range(7))   # each item once
    for group in groups:
        assert len(group) == N and len({r.group_id for r in group}) == 1
        assert sorted(r.rollout_id for r in group) == [f"{group[0].group_id}-{i}" for i in range(N)]
        for r in group:
            seg = r.segments[0]
            assert r.ok and sum(seg.loss_mask) == len(seg.token_ids) - seg.prompt_len > 0
            assert set(seg.versions[seg.prompt_len:]) == {0}
    assert pool.counts["groups_done"] == 7 and pool.in_flight == 0


def test_staleness_requeues_old_groups_and_idle_fraction(engine, tiny_model_path, push_weights):
    from safetensors.torch import load_file

    weights = load_file(f"{tiny_model_path}/model.safetensors")

    async def main():
        pool = RolloutPool(items(100), FnGroups(make_rollout_fn(Dispatcher([engine]), {}), N),
                           groups_in_flight=4, max_staleness=1, engines=[engine])
        await pool.stats()                  # start a fresh measurement window
        await pool.next_batch(1)
        while len(pool.done) < 3:             # the refilled groups finish on version 0
            await asyncio.sleep(0.05)
        await asyncio.to_thread(push_weights, [engine], weights, 2)   # same weights, new version label
        pool.set_version(2)
        try:
            batch = await pool.next_batch(4)
        finally:
            await asyncio.to_thread(push_weights, [engine], weights, 0)
        await pool.close()
        await asyncio.sleep(1.0)            # the cancelled groups' last requests end, then idle time
        return pool, batch, await pool.stats()

    pool, batch, stats = asyncio.run(main())
    assert stats["stale_requeued"] >= 1
    for group in batch:                     # only groups within the staleness bound are handed out
        assert min(v for r in group for v in r.segments[0].versions if v != -1) >= 2 - 1
    assert 0.0 < stats["engine_idle_frac"] < 1.0
    assert stats["generated_tokens"] > 0


def versions_of(group: list[Rollout]) -> set[int]:
    return {v for r in group for v in r.segments[0].versions if v != NO_VERSION}


def test_async_hands_out_the_freshest_groups_and_one_of_the_current_policy(engine, tiny_model_path,
                                                                            push_weights):
    """Every batch holds tokens of the current policy (where the trainer measures its gap to the engine),
    the freshest waiting groups go first, and groups beyond the staleness bound are re-queued at the refit.
    `on_generating` hears each change between some group running and none (the trainer's thread lending)."""
    from safetensors.torch import load_file

    weights = load_file(f"{tiny_model_path}/model.safetensors")
    reports: list[bool] = []

    async def drain(pool: RolloutPool) -> None:
        while pool.tasks:
            await asyncio.sleep(0.05)
        assert reports[-1] is False     # told as soon as the last running group finished

    async def refit(pool: RolloutPool, version: int) -> None:
        await asyncio.to_thread(push_weights, [engine], weights, version)   # same weights, new label
        pool.set_version(version)

    async def main():
        pool = RolloutPool(items(100), FnGroups(make_rollout_fn(Dispatcher([engine]), {}), N),
                           groups_in_flight=4, max_staleness=1, engines=[engine],
                           on_generating=reports.append)
        try:
            await pool.next_batch(2)
            await drain(pool)                      # 4 groups of version 0 wait
            await refit(pool, 1)
            second = await pool.next_batch(2)      # one of them, then one sampled after the refit
            await drain(pool)                      # 3 of version 0 and 1 of version 1 wait
            third = await pool.next_batch(1)
            await refit(pool, 2)                   # version 0 is now 2 versions old
            counts, pending = dict(pool.counts), len(pool.pending_items())
            await drain(pool)                      # the re-queued items, sampled again, wait at version 2
            await refit(pool, 3)
            probed = await pool.next_batch(2, need_current=False)   # the 2 freshest waiting, at once
            return second, third, counts, pending, probed
        finally:
            await asyncio.to_thread(push_weights, [engine], weights, 0)
            await pool.close()

    second, third, counts, pending, probed = asyncio.run(main())
    assert sorted(map(min, map(versions_of, second))) == [0, 1]
    assert [versions_of(g) for g in third] == [{1}]           # not the older groups that finished first
    assert counts["stale_requeued"] == 3 and pending == 4     # re-queued items start again at once
    # with a probe of the current policy the loop does not need one of its groups: no wait for one
    assert [versions_of(g) for g in probed] == [{2}, {2}]    # (need_current=True: one of version 3)
    assert len(reports) >= 8 and reports[::2] == [True] * len(reports[::2]) and not any(reports[1::2])
    assert reports[-1] is False      # closed: nothing runs


def test_sync_batches_hold_only_current_policy_tokens_across_a_refill(engine, tiny_model_path, push_weights):
    """Sync mode as `loop.begin` builds it (depth = prompts_per_step, nothing starts during a batch): a
    dynamic-sampling refill (`take_batch` asks the pool for fewer groups than its depth) starts only the
    groups it hands out, so nothing generates through the train step and every trained token of every
    batch was sampled by the current policy (policy/lag_max 0, as docs/loop.md says)."""
    from safetensors.torch import load_file

    from molt.driver.select import take_batch
    from molt.spec import RunSpec

    weights = load_file(f"{tiny_model_path}/model.safetensors")
    spec = RunSpec.model_validate({"train": {"prompts_per_step": 4}, "rollout": {"samples_per_prompt": N},
                                   "algo": {"filters": {"drop_equal_rewards": True, "refill_max_groups": 1}}})

    async def main():
        pool = RolloutPool(items(100), FnGroups(make_rollout_fn(Dispatcher([engine]), {}), N),
                           spec.train.prompts_per_step, spec.rollout.max_staleness, [engine],
                           refill_during_batch=False)
        steps = []
        try:
            for version in (0, 1, 2):
                if version:                        # the refit after the train step
                    await asyncio.to_thread(push_weights, [engine], weights, version)   # new label
                pool.set_version(version)
                groups, metrics = await take_batch(pool, spec)
                steps.append((version, groups, metrics, pool.in_flight))
                while pool.tasks:                  # the train step: whatever was started generates
                    await asyncio.sleep(0.05)
            return steps
        finally:
            await asyncio.to_thread(push_weights, [engine], weights, 0)
            await pool.close()

    steps = asyncio.run(main())
    for version, groups, metrics, _ in steps:
        assert metrics["filter/refill_groups"] >= 1       # the refill asked for fewer than the depth
        assert [versions_of(g) for g in groups] == [{version}] * len(groups), version
    assert [in_flight for *_, in_flight in steps] == [0, 0, 0]   # none started beyond the hand-out


@pytest.mark.parametrize("max_staleness", [0, 1, 4])
def test_staleness_bound_is_exact(max_staleness):
    """A group whose oldest token is exactly `max_staleness` versions old is handed out; one version more
    and it is re-queued and sampled again (a bound one step too strict fails the first half, one step too
    loose the second). The agent samples at the pool's version, as an engine refitted with it does."""
    pool: RolloutPool | None = None

    async def rollout_fn(item: dict, group_id: str, index: int) -> Rollout:
        v = pool.version
        seg = Segment([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], [NO_VERSION, v, v], f"{group_id}-{index}",
                      group_id, prompt_len=1)
        return Rollout(f"{group_id}-{index}", group_id, [seg], 1.0)

    async def waiting() -> None:
        while not pool.done:
            await asyncio.sleep(0)

    async def main() -> tuple[set[int], set[int]]:
        nonlocal pool
        pool = RolloutPool(({"i": i} for i in range(10)), FnGroups(rollout_fn, 2),
                           groups_in_flight=1, max_staleness=max_staleness)
        pool.set_version(0)
        await waiting()                                  # a group sampled at version 0 waits
        pool.set_version(max_staleness)                  # exactly max_staleness versions later
        [at_bound] = await pool.next_batch(1, need_current=False)
        assert pool.counts["stale_requeued"] == 0
        await waiting()                                  # the next one, sampled at max_staleness
        pool.set_version(2 * max_staleness + 1)          # one version beyond the bound
        assert pool.counts["stale_requeued"] == 1 and not pool.done
        [beyond] = await pool.next_batch(1, need_current=False)
        await pool.close()
        return versions_of(at_bound), versions_of(beyond)

    # a bound too strict at max_staleness 0 re-queues every group forever: fail, do not hang
    at_bound, beyond = asyncio.run(asyncio.wait_for(main(), timeout=20))
    assert at_bound == {0}
    assert beyond == {2 * max_staleness + 1}             # sampled again by the current policy


@pytest.mark.parametrize("oldest_first", [False, True])
def test_handout_order_freshest_or_oldest(oldest_first):
    """Groups sampled at versions 0, 1, 2 wait at version 2 (max_staleness 2, so none is stale): the default
    hands out the version-2 group first, `rollout.handout=oldest` the version-0 one, then 1, then 2 (a
    reversed or ignored order fails; so does a tie-break by latest start)."""
    pool: RolloutPool | None = None

    async def rollout_fn(item: dict, group_id: str, index: int) -> Rollout:
        v = item["v"]
        seg = Segment([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], [NO_VERSION, v, v], f"{group_id}-{index}",
                      group_id, prompt_len=1)
        return Rollout(f"{group_id}-{index}", group_id, [seg], 1.0)

    async def main() -> list[set[int]]:
        nonlocal pool
        rows = [{"v": 1}, {"v": 0}, {"v": 2}, {"v": 0}] + [{"v": 2}] * 8
        pool = RolloutPool(iter(rows), FnGroups(rollout_fn, 2), groups_in_flight=4, max_staleness=2,
                           oldest_first=oldest_first)
        pool.set_version(2)
        while len(pool.done) < 4:
            await asyncio.sleep(0)
        first = [await pool.next_batch(1, need_current=False) for _ in range(3)]
        await pool.close()
        return [(versions_of(g[0]), g[0][0].group_id) for g in first]

    order = asyncio.run(asyncio.wait_for(main(), timeout=20))
    if oldest_first:   # g1 and g3 both at version 0: the earlier started first
        assert order == [({0}, "g1"), ({0}, "g3"), ({1}, "g0")]
    else:              # (the refill started after the first hand-out has not finished yet)
        assert order == [({2}, "g2"), ({1}, "g0"), ({0}, "g1")]
