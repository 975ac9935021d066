"""Route generation requests to engines: a rollout sticks to one engine, new rollouts go to the idlest.

A multi-turn rollout resends its whole history every turn; on the engine that served the previous
turn that history is a prefix-cache hit, anywhere else it is recomputed. So the first request of a
key (a rollout id) picks the live engine with the fewest requests in flight, and later ones follow it.

Engines die (a killed or OOM-killed actor, vLLM's engine failing in it: the actor then exits). The dispatcher
stops sending work to a dead engine, remembers which rollouts were on it (`take_lost`: the pool restarts
their groups whole) and tells `on_death` (the fleet, which restarts it). A restarted engine takes work
again only once `set_live` says it holds the current weights.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayActorError

from molt.trajectory import EngineDiedError, Sample

__all__ = ["Dispatcher", "EngineDiedError"]   # EngineDiedError: molt/trajectory.py, importable here too


class Dispatcher:
    def __init__(self, engines: list[Any], on_death: Callable[[int], None] | None = None) -> None:
        if not engines:
            raise ValueError("Dispatcher needs at least one engine")
        self.engines = engines
        self.load = [0] * len(engines)      # requests in flight per engine, from this dispatcher
        self.sticky: dict[str, int] = {}
        self.dead: dict[int, str] = {}      # engine index -> why its actor died (until it is live again)
        self.live = set(range(len(engines)))
        self.lost: set[str] = set()         # keys whose engine died under them
        self.fatal: str | None = None       # set when no engine is left and none will come back
        self.changed = asyncio.Event()      # set whenever an engine dies or comes back
        self.on_death = on_death
        self.refit_workers: list[int] = []  # refit group ranks per engine (see `refit_size`)
        # told when an engine comes back or none is left (agent workers' dispatchers follow this one)
        self.followers: list[Callable[[], None]] = []

    def pick(self, key: str) -> int:
        if self.sticky.get(key) not in self.live:
            self.sticky[key] = min(sorted(self.live), key=lambda i: self.load[i])
        return self.sticky[key]

    async def _live_engine(self, key: str) -> int:
        """The engine of `key`; while none is live (all dead or restarting) wait for one to come back."""
        while not self.live:
            if self.fatal:
                raise EngineDiedError(self.fatal)
            self.changed.clear()
            await self.changed.wait()   # a restart ends either way: live, or `fatal` once none is left
        return self.pick(key)

    async def generate(self, prompt_ids: list[int], sampling: dict, key: str,
                       images: list[str] | None = None) -> Sample:
        """`EngineActor.generate` on the engine of `key`; the result also names that engine."""
        i = await self._live_engine(key)
        engine = self.engines[i]
        self.load[i] += 1
        ref = engine.generate.remote(prompt_ids, sampling, images=images)
        try:
            out = await ref
        except asyncio.CancelledError:
            # Ray leaves a remote call running when its awaiter is cancelled; `ray.cancel` cancels the
            # actor's coroutine, and vLLM aborts a request whose generator is cancelled (its KV is freed).
            ray.cancel(ref)
            raise
        except RayActorError as err:
            # Ray fails every call to a dead actor at once, so a killed engine surfaces here within seconds.
            if self.engines[i] is engine:
                self.mark_dead(i, f"{type(err).__name__}: {str(err).splitlines()[0]}")
            self.lost.add(key)
            raise EngineDiedError(f"engine {i} died") from err
        finally:
            self.load[i] -= 1
        return {**out, "engine": i}

    def mark_dead(self, i: int, why: str) -> None:
        """Engine `i` is gone: no more work for it; its rollouts are lost; `on_death` restarts it."""
        if i not in self.live:
            return
        self.live.discard(i)
        self.dead[i] = why
        self.lost.update(k for k, e in self.sticky.items() if e == i)
        self.changed.set()
        if self.on_death:
            self.on_death(i)
        elif not self.live:   # nobody restarts engines here (a dispatcher without a fleet)
            self.give_up(f"all {len(self.engines)} rollout engine(s) died (engine {i}: {why})")

    def set_live(self, i: int, engine: Any) -> None:
        """Engine slot `i` now holds `engine`, refitted to the current weights: it takes work again."""
        self.engines[i] = engine
        self.dead.pop(i, None)
        self.live.add(i)
        self.changed.set()
        for follower in self.followers:
            follower()

    def give_up(self, why: str) -> None:
        """No engine is left and none will come back: waiting rollouts fail with `why`."""
        self.fatal = why
        self.changed.set()
        for follower in self.followers:
            follower()

    def take_lost(self, keys: list[str]) -> bool:
        """Whether an engine died under any of `keys` (those keys are forgotten)."""
        hit = self.lost.intersection(keys)
        self.lost -= hit
        return bool(hit)

    def check(self) -> None:
        """Raise `EngineDiedError` when no engine is left (`give_up`)."""
        if self.fatal:
            raise EngineDiedError(self.fatal)

    def release(self, key: str) -> None:
        """Forget `key`: its rollout ended (`Runner.run` calls this, so the map holds only live rollouts)."""
        self.sticky.pop(key, None)

    async def refit_size(self, members: list[int] | None = None) -> int:
        """Ranks of the refit group: trainer rank 0 plus every worker of the `members` engines (all)."""
        members = range(len(self.engines)) if members is None else members
        self.refit_workers = await asyncio.gather(*[self.engines[i].refit_workers.remote() for i in members])
        return 1 + sum(self.refit_workers)

    async def join_refit(self, host: str, port: int, members: list[int] | None = None) -> None:
        """Every worker of the `members` engines (all) joins the refit group at host:port, engine by engine
        after rank 0 (after `refit_size` of the same members, concurrently with the trainer's `join_refit`,
        which hosts it)."""
        members = range(len(self.engines)) if members is None else members
        size = 1 + sum(self.refit_workers)
        offsets = itertools.accumulate([1, *self.refit_workers[:-1]])
        await asyncio.gather(*[self.engines[i].join_refit.remote(host, port, offset, size)
                               for i, offset in zip(members, offsets, strict=True)])

    async def update_weights(self, version: int, members: list[int] | None = None) -> float:
        """Every `members` engine (all) receives the weights the trainer broadcasts meanwhile
        (`TrainerRanks.send_weights`) and switches to `version`; returns the slowest engine's seconds."""
        members = range(len(self.engines)) if members is None else members
        seconds = await asyncio.gather(*[self.engines[i].update_weights.remote(version) for i in members])
        return max(seconds)
