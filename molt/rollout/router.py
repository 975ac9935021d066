"""Route generation requests to engines: a rollout sticks to one engine, new rollouts go to the idlest.

A multi-turn rollout resends its whole history every turn; on the engine that served the previous
turn that history is a prefix-cache hit, anywhere else it is recomputed. So the first request of a
key (a rollout id) picks the engine with the fewest requests in flight, and later ones follow it.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import ray
from ray.exceptions import RayActorError


class EngineDiedError(RuntimeError):
    """An engine actor is gone; Molt does not restart engines, so the run stops (see `Router.check`)."""


class Router:
    def __init__(self, engines: list[Any]) -> None:
        if not engines:
            raise ValueError("Router needs at least one engine")
        self.engines = engines
        self.load = [0] * len(engines)      # requests in flight per engine, from this router
        self.sticky: dict[str, int] = {}
        self.dead: dict[int, str] = {}      # engine index -> why its actor died
        self.refit_workers: list[int] = []  # refit group ranks per engine (see `refit_size`)

    def pick(self, key: str) -> int:
        if key not in self.sticky:
            self.sticky[key] = min(range(len(self.engines)), key=lambda i: self.load[i])
        return self.sticky[key]

    async def generate(self, prompt_ids: list[int], sampling: dict, key: str,
                       images: list[str] | None = None) -> dict:
        """`EngineActor.generate` on the engine of `key`; the result also names that engine."""
        i = self.pick(key)
        self.load[i] += 1
        ref = self.engines[i].generate.remote(prompt_ids, sampling, images=images)
        try:
            out = await ref
        except asyncio.CancelledError:
            # Ray leaves a remote call running when its awaiter is cancelled; `ray.cancel` cancels the
            # actor's coroutine, and vLLM aborts a request whose generator is cancelled (its KV is freed).
            ray.cancel(ref)
            raise
        except RayActorError as err:
            # Ray fails every call to a dead actor at once, so a killed engine surfaces here within
            # seconds; the rollout fails and the loop's `check` turns it into one clear error.
            self.dead.setdefault(i, f"{type(err).__name__}: {str(err).splitlines()[0]}")
            raise EngineDiedError(f"engine {i} died") from err
        finally:
            self.load[i] -= 1
        return {**out, "engine": i}

    def check(self) -> None:
        """Raise `EngineDiedError` naming every engine a request found dead."""
        if self.dead:
            lines = "; ".join(f"engine {i}: {why}" for i, why in sorted(self.dead.items()))
            raise EngineDiedError(f"{len(self.dead)} of {len(self.engines)} rollout engine(s) died "
                                  f"({lines}); stopping the run (engines are not restarted): resume from "
                                  "the last checkpoint with run.resume")

    def release(self, key: str) -> None:
        """Forget `key`: its rollout ended (`Runner.run` calls this, so the map holds only live rollouts)."""
        self.sticky.pop(key, None)

    async def refit_size(self) -> int:
        """Ranks of the refit group: trainer rank 0 plus every worker of every engine."""
        self.refit_workers = await asyncio.gather(*[e.refit_workers.remote() for e in self.engines])
        return 1 + sum(self.refit_workers)

    async def join_refit(self, host: str, port: int) -> None:
        """Every engine worker joins the refit group at host:port, engine by engine after rank 0 (after
        `refit_size`, concurrently with the trainer's `join_refit`, which hosts it)."""
        size = 1 + sum(self.refit_workers)
        offsets = itertools.accumulate([1, *self.refit_workers[:-1]])
        await asyncio.gather(*[e.join_refit.remote(host, port, offset, size)
                               for e, offset in zip(self.engines, offsets, strict=True)])

    async def update_weights(self, version: int) -> float:
        """Every engine receives the weights the trainer broadcasts meanwhile (`TrainerGroup.send_weights`)
        and switches to `version`; returns the slowest engine's seconds."""
        seconds = await asyncio.gather(*[e.update_weights.remote(version) for e in self.engines])
        return max(seconds)
