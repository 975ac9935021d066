"""The streaming pool: keeps prompt groups in flight so engines never run dry while the trainer steps.

A group is `samples_per_prompt` rollouts of one prompt item. At most `groups_in_flight` groups exist
between "started" and "handed out" (running or finished and waiting), which bounds both memory and
staleness. Every hand-out frees a slot that the next prompt item fills at once, so in async mode the
engines sample the next groups while the trainer steps on this batch.

`next_batch(k)` hands out `k` complete groups, freshest first (by oldest, then newest token version, then
start order; `rollout.handout=oldest`: oldest first), and at least one of them holds tokens of the current
policy: that is where the trainer measures its gap to the engine (invariant 3) every step, unless the
loop holds a post-refit probe for that (`need_current=False`, molt.driver.probe). Staleness: a waiting
group whose oldest sampled token is older than `version - max_staleness` is never handed out; at the
next `set_version` or `next_batch` its prompt item is re-queued (sampled again from the current policy)
and counted in `stats()["stale_requeued"]`. A group that `lost(rollout_ids)` says an engine died under is
restarted whole, first in line (never handed out half re-sampled), and counted in
`stats()["engine_requeued"]`.

Where a group's rollouts run is the `GroupRunner`'s business (molt.driver.agent_workers: in this process,
or on agent workers): the pool asks it for whole groups, whether an engine died under one, and tells it
each new policy version.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from ray.exceptions import RayActorError

from molt.trajectory import Rollout


class GroupRunner(Protocol):
    async def run_group(self, item: dict, group_id: str) -> list[Rollout]:
        """The group's rollouts (rollout.samples_per_prompt of `item`); an agent's failure is a failed
        rollout, and what this raises is a bug the pool hands to `next_batch`."""

    def take_lost(self, rollout_ids: list[str]) -> bool:
        """Whether an engine died under any of these rollouts (the pool restarts their group whole)."""

    def set_version(self, version: int) -> None:
        """The policy version the engines hold now (training requests are seeded with it)."""


@dataclass
class Finished:
    order: int                      # start order, for a stable hand-out order
    item: dict
    group: list[Rollout]
    oldest: int | None              # oldest sampled token's version
    newest: int | None


class RolloutPool:
    def __init__(self, items: Iterator[dict], groups: GroupRunner, groups_in_flight: int, max_staleness: int,
                 engines: list[Any] = (), refill_during_batch: bool = True,
                 on_generating: Callable[[bool], None] | None = None, first_group: int = 0,
                 oldest_first: bool = False) -> None:
        self.items = iter(items)
        # False = sync mode: groups start only when a batch is asked for, and only those it still lacks,
        # so while the trainer steps nothing generates and every batch is sampled by the current policy.
        self.refill_during_batch = refill_during_batch
        self.group_items: dict[str, dict] = {}  # prompt item of every group not yet handed out
        self.groups = groups
        self.depth = groups_in_flight
        self.max_staleness = max_staleness
        self.oldest_first = oldest_first    # rollout.handout=oldest: first in, first out within the bound
        self.engines = engines              # the live list: a restarted engine replaces its slot
        self.version = 0
        self.requeued: deque[dict] = deque()
        self.done: list[Finished] = []      # finished groups not yet handed out
        self.finished = asyncio.Event()     # set whenever a group finishes
        self.tasks: set[asyncio.Task] = set()
        # Group ids (g<n>) key the request seeds: a resumed run continues the saved count, so it redoes
        # a step with the seeds the interrupted run used, and no id repeats within a run.
        self.started = first_group
        self.counts = {"stale_requeued": 0, "engine_requeued": 0, "groups_done": 0, "failed_rollouts": 0}
        self.exhausted = False
        self.crash: Exception | None = None   # what a rollout raised that was not the agent's fault
        self.on_generating = on_generating    # told when groups start running (True) or none runs (False)
        self.generating = False

    def set_version(self, version: int) -> None:
        """The policy version the engines now run (call after each refit): groups it makes too stale are
        re-queued at once and their slots refilled, so the engines sample with the new policy right away."""
        self.version = version
        self.groups.set_version(version)
        self._requeue_stale()
        if self.refill_during_batch:
            self._fill()

    @property
    def in_flight(self) -> int:
        """Groups started and not yet handed out (running or waiting)."""
        return len(self.tasks) + len(self.done)

    def _next_item(self) -> dict | None:
        if self.requeued:
            return self.requeued.popleft()
        try:
            return next(self.items)
        except StopIteration:
            self.exhausted = True
            return None

    def _fill(self, target: int | None = None) -> None:
        """Start groups until `target` (default: the pool's depth) are in flight."""
        while self.in_flight < (self.depth if target is None else target):
            item = self._next_item()
            if item is None:
                return
            group_id = f"g{self.started}"
            self.group_items[group_id] = item
            task = asyncio.create_task(self._group(item, group_id, self.started))
            self.started += 1
            self.tasks.add(task)
        self._report_generating()

    def _report_generating(self) -> None:
        if bool(self.tasks) != self.generating:
            self.generating = bool(self.tasks)
            if self.on_generating:
                self.on_generating(self.generating)

    def _requeue_stale(self) -> None:
        bound = self.version - self.max_staleness
        for entry in [e for e in self.done if e.oldest is not None and e.oldest < bound]:
            self.done.remove(entry)
            self.group_items.pop(entry.group[0].group_id, None)
            self.requeued.append(entry.item)
            self.counts["stale_requeued"] += 1

    async def _group(self, item: dict, group_id: str, order: int) -> None:
        # The runner turns the agent's failures into failed rollouts itself; what it raises is a bug,
        # handed to `next_batch`, which raises it in the loop (a background task's error is otherwise lost).
        try:
            group = list(await self.groups.run_group(item, group_id))
        except Exception as err:
            self.crash = err
            self.finished.set()
            return
        finally:
            self.tasks.discard(asyncio.current_task())
            self._report_generating()
        if self.groups.take_lost([r.rollout_id for r in group]):
            self.group_items.pop(group_id, None)
            self.requeued.appendleft(item)
            self.counts["engine_requeued"] += 1
            if self.refill_during_batch:
                self._fill()
            self.finished.set()    # wakes `next_batch`, which refills in sync mode too
            return
        self.counts["groups_done"] += 1
        self.counts["failed_rollouts"] += sum(not r.ok for r in group)
        versions = [v for r in group for s in r.segments
                    for v, m in zip(s.versions, s.loss_mask, strict=True) if m]
        self.done.append(Finished(order, item, group, min(versions, default=None),
                                  max(versions, default=None)))
        self.finished.set()

    def _pick(self, need_current: bool) -> Finished | None:
        """The freshest (`oldest_first`: the oldest) waiting group (with current-policy tokens if
        `need_current`), out of the pool."""
        candidates = [e for e in self.done if not need_current or e.newest == self.version]
        if not candidates:
            return None

        def freshness(e: Finished) -> tuple[int, int, int]:
            if e.oldest is None:      # nothing sampled (all its rollouts failed): nothing can be stale
                return (self.version, self.version, -e.order)
            return (e.oldest, e.newest, -e.order)

        if self.oldest_first:    # first in, first out: oldest tokens, then earliest started
            best = min(candidates, key=lambda e: (*freshness(e)[:2], e.order))
        else:
            best = max(candidates, key=freshness)
        self.done.remove(best)
        self.group_items.pop(best.group[0].group_id, None)
        return best

    async def next_batch(self, k: int, need_current: bool = True) -> list[list[Rollout]]:
        """`k` complete groups within the staleness bound, freshest first, at least one holding tokens of
        the current policy (when any can still come) unless `need_current` is False (the loop holds a probe
        of the current policy, molt.driver.probe); fewer only when the items run out. Returned in start
        order, so a sync run's batch does not depend on which group finished first."""
        if k > self.depth:
            raise ValueError(f"a batch of {k} groups needs rollout.groups_in_flight >= {k} (is {self.depth})")
        batch: list[Finished] = []
        while len(batch) < k:
            if self.crash is not None:
                raise self.crash
            self._requeue_stale()
            if self.refill_during_batch:
                self._fill()
            else:
                # Sync: only the groups this batch still lacks (a dynamic-sampling refill asks for fewer
                # than `depth`, an engine death re-queues one). A group started beyond them would generate
                # through the train step and be handed out after the refit, one policy version old.
                self._fill(k - len(batch))
            last = need_current and len(batch) == k - 1 and not any(e.newest == self.version for e in batch)
            pick = self._pick(need_current=last and bool(self.tasks))
            if pick is not None:
                batch.append(pick)
                if self.refill_during_batch:
                    self._fill()            # its slot starts the next group at once
                continue
            if not self.tasks:
                break                       # items exhausted and nothing left running
            self.finished.clear()
            await self.finished.wait()
        return [e.group for e in sorted(batch, key=lambda e: e.order)]

    def pending_items(self) -> list[dict]:
        """Prompt items started but not handed out (saved with a checkpoint, re-run first on resume)."""
        return list(self.requeued) + list(self.group_items.values())

    async def stats(self) -> dict[str, float]:
        """Pool counters and the engines' idle fraction since the previous call."""
        answers = await asyncio.gather(*[e.stats.remote() for e in self.engines], return_exceptions=True)
        engine_stats = [a for a in answers if not isinstance(a, RayActorError)]   # dead: being restarted
        for a in answers:
            if isinstance(a, BaseException) and not isinstance(a, RayActorError):
                raise a
        busy = sum(s["busy_s"] for s in engine_stats)
        idle = sum(s["idle_s"] for s in engine_stats)
        return {**self.counts, "in_flight": self.in_flight, "version": self.version,
                "engine_idle_frac": idle / (busy + idle) if busy + idle > 0 else 0.0,
                "engine_busy_s": busy / max(len(engine_stats), 1),
                "generated_tokens": sum(s["generated_tokens"] for s in engine_stats)}

    async def close(self) -> None:
        """Cancel the running groups (the dispatcher aborts their requests on the engines)."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()
        self._report_generating()
