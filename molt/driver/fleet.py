"""The run's engines over its life: they die, come back, and always serve the current policy.

An engine dies when its actor's process is killed (an OOM kill; vLLM's engine core runs in it) or when
vLLM's engine fails in it (the actor then exits itself, `EngineActor._serve`). The dispatcher stops
routing to it and the pool restarts the groups it was sampling (`Dispatcher.take_lost`). The fleet
restarts the engine on its plan node, at most `rollout.engine.max_restarts` times; a restarted engine
joins a re-formed refit group (`molt.refit`) and receives the current weights before the dispatcher gives
it work. With its restarts used up an engine stays down and the run goes on with the others; with none
left, and none coming back, the run stops with one message.

The refit group holds trainer rank 0 and the workers of the engines that are in it (`members`); it is
re-formed whenever the live engines differ from its members. Every wait on an engine is bounded: start-up
by `rollout.engine.start_timeout_s`, a liveness ping before each refit by `PING_TIMEOUT_S`, a refit
transfer by `molt.refit.TIMEOUT`; a failed refit is retried on the engines still alive.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray
from ray.exceptions import RayActorError

from molt.rollout.dispatch import Dispatcher
from molt.rollout.engine import start_engine, start_engines
from molt.trajectory import EngineDiedError

PING_TIMEOUT_S = 60.0   # an engine actor that does not answer a trivial call for this long is treated as dead
REFIT_GRACE_S = 30.0    # after a failed refit, how long the other engines get to finish theirs


class Fleet:
    def __init__(self, spec: Any, model_path: str, engines: list | None = None) -> None:
        """Starts the spec's engines, or takes `engines` already started from this spec."""
        self.spec, self.model_path = spec, model_path
        self.dispatcher = Dispatcher(engines or start_engines(spec, model_path), on_death=self._died)
        self.policy: Any = None
        self.trainer = asyncio.Lock()    # one user of the policy's rank 0 at a time: a step, a refit
        self.version = 0                 # the policy version the engines hold
        self.members: list[int] = []     # engines in the refit group now
        self.restarts = [0] * len(self.dispatcher.engines)
        self.restarting: dict[int, asyncio.Task] = {}
        self.deaths = 0
        self.refit_bytes = 0             # what the last refit sent (the LoRA adapter alone with model.lora)
        self.colocated_s = {"sleep": 0.0, "wake": 0.0}   # parallel.colocate: seconds since the last metrics

    async def connect(self, policy: Any) -> None:
        """Open the refit group between `policy` (a TrainerRanks; also a rebuilt one) and the live engines."""
        async with self.trainer:
            self.policy = policy
            await self._connect(sorted(self.dispatcher.live))

    async def _connect(self, members: list[int]) -> None:
        self.members = []
        size = await self.dispatcher.refit_size(members)
        host, port = await asyncio.to_thread(self.policy.host_refit, size)
        await asyncio.gather(asyncio.to_thread(self.policy.join_refit, size),
                             self.dispatcher.join_refit(host, port, members))
        self.members = [self.dispatcher.engines[i] for i in members]   # the actors: a restart changes them

    async def refit(self, version: int) -> float:
        """Trainer weights → every live engine, as `version`; returns the seconds. An engine that dies
        meanwhile is dropped (and restarted) and the refit retried on the others."""
        async with self.trainer:
            return await self._refit(version)

    async def _refit(self, version: int, admit: int | None = None) -> float:
        """Refit the live engines and `admit` (a restarted engine, not live yet; dropped if it dies)."""
        for _ in range(len(self.dispatcher.engines) + 1):   # every retry follows an engine's death
            await self._ping()
            members = sorted(self.dispatcher.live | ({admit} if admit is not None else set()))
            if not members:
                self.version = version   # a restarted engine gets it when it comes back
                return 0.0
            if [self.dispatcher.engines[i] for i in members] != self.members:
                await self._connect(members)
            t0 = time.perf_counter()
            died = await self._broadcast(version, members)
            if not died:
                self.version = version
                return time.perf_counter() - t0
            self.members = []   # the group lost a rank: form a new one
            admit = None if admit in died else admit
        raise EngineDiedError("engines kept dying during the weight refit; stopping the run")

    async def _broadcast(self, version: int, members: list[int]) -> list[int]:
        """One transfer to `members`; returns the engines that died in it (dropped). After a failure the
        other receivers get `REFIT_GRACE_S` to finish; one still waiting for a stream that will not come
        is dropped too (restarted), so nothing waits for the transfer's own long timeout."""
        engines = self.dispatcher.engines
        calls = {asyncio.ensure_future(engines[i].update_weights.remote(version)): i for i in members}
        sender = asyncio.ensure_future(asyncio.to_thread(self.policy.send_weights))
        done, pending = await asyncio.wait([*calls, sender], return_when=asyncio.FIRST_EXCEPTION)
        if pending:   # something failed
            done, pending = await asyncio.wait(pending, timeout=REFIT_GRACE_S)
        died = []
        for call, i in calls.items():
            err = call.exception() if call.done() else None
            if call in pending or isinstance(err, RayActorError):
                why = "stuck in a failed refit" if call in pending else str(err).splitlines()[0]
                self._drop(i, f"died during a refit: {why}")
                died.append(i)
            elif err is not None:
                raise err
        if not sender.done():
            if died:   # the trainer's broadcast waits for receivers that are gone: fail it now (NCCL)
                await asyncio.to_thread(self.policy.abort_refit)
            await asyncio.wait([sender])   # else the trainer's own bound: molt.refit.TIMEOUT
        if died:
            sender.exception()   # expected (an aborted or broken stream); the refit is retried
            return died
        if sender.exception():
            raise sender.exception()
        self.refit_bytes = sender.result()
        return died

    async def _ping(self) -> None:
        """Liveness of the live engines before a refit: a dead one would stall the broadcast."""
        live = sorted(self.dispatcher.live)
        engines = self.dispatcher.engines
        pings = [asyncio.wait_for(asyncio.wrap_future(engines[i].refit_workers.remote().future()),
                                  PING_TIMEOUT_S) for i in live]
        for i, answer in zip(live, await asyncio.gather(*pings, return_exceptions=True), strict=True):
            if isinstance(answer, (RayActorError, TimeoutError)):
                self._drop(i, f"{type(answer).__name__} on a liveness check")

    def _drop(self, i: int, why: str) -> None:
        self.dispatcher.mark_dead(i, why)   # (an engine being admitted is not live: only killed)
        ray.kill(self.dispatcher.engines[i], no_restart=True)

    def _died(self, i: int) -> None:
        """Dispatcher callback: engine `i` is dead. Restart it while its budget lasts."""
        self.deaths += 1
        why = self.dispatcher.dead.get(i, "")
        print(f"molt: engine {i} died ({why}); its rollouts are restarted", flush=True)
        if i not in self.restarting:
            self.restarting[i] = asyncio.get_running_loop().create_task(self._restart(i))

    async def _restart(self, i: int) -> None:
        limit = self.spec.rollout.engine.max_restarts
        try:
            while self.restarts[i] < limit:
                self.restarts[i] += 1
                if await self._start(i):
                    print(f"molt: engine {i} restarted ({self.restarts[i]} of {limit}) and refitted to "
                          f"policy version {self.version}", flush=True)
                    return
            print(f"molt: engine {i} stays down: rollout.engine.max_restarts={limit} used up", flush=True)
        finally:
            self.restarting.pop(i, None)
        if not self.dispatcher.live and not self.restarting:
            dispatcher = self.dispatcher
            dispatcher.give_up(f"all {len(dispatcher.engines)} rollout engine(s) died and their restarts "
                               f"(rollout.engine.max_restarts={limit}) are used up; last: engine {i}: "
                               f"{dispatcher.dead.get(i)}. Resume from the last checkpoint with "
                               "run.resume=auto")

    async def _start(self, i: int) -> bool:
        """One restart of engine `i`: start it, wait until ready, refit it (with the others); True if live."""
        try:
            ray.kill(self.dispatcher.engines[i], no_restart=True)
        except Exception:   # noqa: BLE001 - already gone
            pass
        engine = start_engine(self.spec, self.model_path, i)
        self.dispatcher.engines[i] = engine   # in its slot, but not live: no work until refitted
        try:
            await asyncio.wait_for(asyncio.wrap_future(engine.ready.remote().future()),
                                   self.spec.rollout.engine.start_timeout_s)
            async with self.trainer:
                await self._refit(self.version, admit=i)
            if engine not in self.members:
                raise EngineDiedError(f"engine {i} died while it was refitted")
        except Exception as err:   # noqa: BLE001 - any failed attempt is reported, counted and retried
            why = (str(err) or "-").splitlines()[0]
            print(f"molt: engine {i} restart failed: {type(err).__name__}: {why}", flush=True)
            ray.kill(engine, no_restart=True)
            return False
        self.dispatcher.set_live(i, engine)
        return True

    async def sleep_if_colocated(self) -> None:
        """parallel.colocate: every live engine frees the GPU for the trainer's step (vLLM's sleep at
        parallel.engine_sleep_level); `wake_if_colocated` takes it back before the refit. Otherwise the
        engines have GPUs of their own: nothing to do."""
        if self.spec.parallel.colocate:
            level, engines = self.spec.parallel.engine_sleep_level, self.dispatcher.engines
            start = time.perf_counter()
            await asyncio.gather(*[engines[i].sleep.remote(level) for i in self.dispatcher.live])
            self.colocated_s["sleep"] += time.perf_counter() - start

    async def wake_if_colocated(self) -> None:
        if self.spec.parallel.colocate:
            start = time.perf_counter()
            await asyncio.gather(*[self.dispatcher.engines[i].wake_up.remote() for i in self.dispatcher.live])
            self.colocated_s["wake"] += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """The step's engine metrics (read once per step: the colocated sleep and wake times restart at 0)."""
        colocated = {f"time/engine_{k}": seconds for k, seconds in self.colocated_s.items()} \
            if self.spec.parallel.colocate else {}
        self.colocated_s = {"sleep": 0.0, "wake": 0.0}
        return {"engine/deaths": float(self.deaths), "engine/restarts": float(sum(self.restarts)),
                "engine/live": float(len(self.dispatcher.live)), **colocated}

    async def close(self) -> None:
        """Stop restarts in progress and every engine (dead ones are only killed)."""
        for task in list(self.restarting.values()):
            task.cancel()
        await asyncio.gather(*self.restarting.values(), return_exceptions=True)
        for engine in self.dispatcher.engines:
            try:
                ray.get(engine.shutdown.remote(), timeout=PING_TIMEOUT_S)
            except (RayActorError, ray.exceptions.GetTimeoutError):
                pass   # already dead: the error that ended the run says so; don't hide it
            ray.kill(engine)
