"""The streaming pool: keeps prompt groups in flight so engines never run dry while the trainer steps.

A group is `samples_per_prompt` rollouts of one prompt item. At most `groups_in_flight` groups exist
between "started" and "handed out" (running or finished and waiting), which bounds both memory and
staleness. `next_batch(k)` returns `k` complete groups as soon as they are ready; each hand-out frees a
slot that the next prompt item fills at once.

Staleness: a group whose oldest sampled token came from a policy older than
`version - max_staleness` is not handed out; its prompt item is re-queued (sampled again from the
current policy) and counted in `stats()["stale_requeued"]`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from molt.trajectory import Rollout

RolloutFn = Callable[[dict, str, int], Awaitable[Rollout]]


def oldest_version(group: list[Rollout]) -> int | None:
    """The smallest policy version of any sampled token in the group (None: nothing sampled)."""
    versions = [v for r in group for s in r.segments
                for v, m in zip(s.versions, s.loss_mask, strict=True) if m]
    return min(versions) if versions else None


class RolloutPool:
    def __init__(self, items: Iterator[dict], rollout_fn: RolloutFn, samples_per_prompt: int,
                 groups_in_flight: int, max_staleness: int, engines: list[Any] = (),
                 refill_during_batch: bool = True) -> None:
        self.items = iter(items)
        # False = sync mode: groups start only when a batch is asked for, so while the trainer steps
        # nothing generates and every batch is sampled by the current policy.
        self.refill_during_batch = refill_during_batch
        self.group_items: dict[str, dict] = {}  # prompt item of every group not yet handed out
        self.rollout_fn = rollout_fn
        self.n = samples_per_prompt
        self.depth = groups_in_flight
        self.max_staleness = max_staleness
        self.engines = list(engines)
        self.version = 0
        self.requeued: deque[dict] = deque()
        self.ready: asyncio.Queue[tuple[dict, list[Rollout]]] = asyncio.Queue()
        self.tasks: set[asyncio.Task] = set()
        self.waiting = 0                    # finished groups not yet handed out
        self.started = 0
        self.counts = {"stale_requeued": 0, "groups_done": 0, "failed_rollouts": 0}
        self.exhausted = False

    def set_version(self, version: int) -> None:
        """The policy version the engines now run (call after each refit)."""
        self.version = version

    @property
    def in_flight(self) -> int:
        """Groups started and not yet handed out (running or waiting)."""
        return len(self.tasks) + self.waiting

    def _next_item(self) -> dict | None:
        if self.requeued:
            return self.requeued.popleft()
        try:
            return next(self.items)
        except StopIteration:
            self.exhausted = True
            return None

    def _fill(self) -> None:
        while self.in_flight < self.depth:
            item = self._next_item()
            if item is None:
                return
            group_id = f"g{self.started}"
            self.group_items[group_id] = item
            task = asyncio.create_task(self._group(item, group_id))
            self.started += 1
            self.tasks.add(task)

    async def _one(self, item: dict, group_id: str, index: int) -> Rollout:
        try:
            return await self.rollout_fn(item, group_id, index)
        except Exception as err:  # an agent bug fails its rollout, not the run; the loop's policy decides
            return Rollout(rollout_id=f"{group_id}-{index}", group_id=group_id, segments=[], reward=0.0,
                           error=f"{type(err).__name__}: {err}")

    async def _group(self, item: dict, group_id: str) -> None:
        group = await asyncio.gather(*[self._one(item, group_id, i) for i in range(self.n)])
        self.tasks.discard(asyncio.current_task())
        self.waiting += 1
        self.counts["groups_done"] += 1
        self.counts["failed_rollouts"] += sum(not r.ok for r in group)
        self.ready.put_nowait((item, list(group)))

    async def next_batch(self, k: int) -> list[list[Rollout]]:
        """`k` complete groups within the staleness bound; fewer only when the items run out."""
        if k > self.depth:
            raise ValueError(f"a batch of {k} groups needs rollout.groups_in_flight >= {k} (is {self.depth})")
        batch: list[list[Rollout]] = []
        self._fill()
        while len(batch) < k:
            if self.ready.empty() and not self.tasks:
                break                       # items exhausted and nothing left running
            item, group = await self.ready.get()
            self.waiting -= 1
            self.group_items.pop(group[0].group_id, None)
            oldest = oldest_version(group)
            if oldest is not None and oldest < self.version - self.max_staleness:
                self.counts["stale_requeued"] += 1
                self.requeued.append(item)
            else:
                batch.append(group)
            if self.refill_during_batch or len(batch) + self.in_flight < k:
                self._fill()
        return batch

    def pending_items(self) -> list[dict]:
        """Prompt items started but not handed out (saved with a checkpoint, re-run first on resume)."""
        return list(self.requeued) + list(self.group_items.values())

    async def stats(self) -> dict[str, float]:
        """Pool counters and the engines' idle fraction since the previous call."""
        engine_stats = await asyncio.gather(*[e.stats.remote() for e in self.engines])
        busy = sum(s["busy_s"] for s in engine_stats)
        idle = sum(s["idle_s"] for s in engine_stats)
        return {**self.counts, "in_flight": self.in_flight, "version": self.version,
                "engine_idle_frac": idle / (busy + idle) if busy + idle > 0 else 0.0,
                "engine_busy_s": busy / max(len(engine_stats), 1),
                "generated_tokens": sum(s["generated_tokens"] for s in engine_stats)}

    async def close(self) -> None:
        """Cancel the running groups (the router aborts their requests on the engines)."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()
