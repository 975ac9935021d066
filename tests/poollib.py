"""A `GroupRunner` (molt.rollout.pool) over a per-rollout function, for the tests that drive the pool with
rollouts of their own: the run's groups are `molt.driver.agent_workers.LocalAgents` or `AgentWorkers`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from molt.trajectory import Rollout


class FnGroups:
    """`n` calls of `fn(item, group_id, index)` per group; `lost(rollout_ids)` answers `take_lost`."""

    def __init__(self, fn: Callable[[dict, str, int], Awaitable[Rollout]], n: int,
                 lost: Callable[[list[str]], bool] | None = None) -> None:
        self.fn, self.n, self.lost, self.version = fn, n, lost, 0

    async def run_group(self, item: dict, group_id: str) -> list[Rollout]:
        return list(await asyncio.gather(*[self.fn(item, group_id, i) for i in range(self.n)]))

    def take_lost(self, rollout_ids: list[str]) -> bool:
        return bool(self.lost and self.lost(rollout_ids))

    def set_version(self, version: int) -> None:
        self.version = version
