"""Where the agent's groups run: in the driver's process (`LocalAgents`, agent.workers=0), or in N Ray actors
(`AgentWorkers`, `agent.workers: N`). Both have one face, which the pool (`molt.rollout.pool.GroupRunner`)
and evaluation use: `run_group`, `take_lost`, `set_version`, `metrics`, `close`.

Each worker imports agent.module and sets its runner up as the driver does (a ChatAgent's loopback server
on a port of its own, an Env's sandbox processes, its tool calls), then runs the groups the driver hands
it on its own event loop. It calls the engines itself, through a `Dispatcher` of its own, so a multi-turn
rollout keeps returning to the engine that holds its prefix. The driver sends a group (its item and id)
and receives the group's finished rollouts as one object: nothing crosses per turn. Requests are seeded as
in the driver (`TrainingSampler`, from the run seed, the policy version and the rollout id), so where a
group runs does not change what it samples.

A worker that dies (killed, OOM) loses only the groups it was running: each is run again whole on another
worker (the dead one is restarted in its slot, at most `agent.max_worker_restarts` times over the run), and
the pool receives it once. An engine a worker sees die is reported to the driver's fleet, which restarts it
and hands the restarted engine to every worker (`follow`). Evaluation's groups run on the workers too
(molt.driver.eval), with rollout.eval's sampling.
"""

from __future__ import annotations

import asyncio
import gc
import os
from typing import Any

import ray
from ray.exceptions import RayActorError

from molt.driver.judge_engines import start_judge
from molt.rollout.dispatch import Dispatcher
from molt.spec import RunSpec
from molt.spec.user_modules import user_file
from molt.trajectory import Rollout

START_TIMEOUT_S = 600.0   # a worker's set-up: imports, the tokenizer, a chat server (seconds on a loaded CPU)


class LocalAgents:
    """Groups run here, on the driver's event loop, by the agent's runner (set up by the run): training
    rollouts through a `TrainingSampler` seeded with the current policy version, an evaluation's through
    the dispatcher with its sampling, as on a worker."""

    def __init__(self, spec: RunSpec, runner: Any, dispatcher: Dispatcher) -> None:
        from molt.rollout.sampling import TrainingSampler

        self.spec, self.runner, self.dispatcher, self.version = spec, runner, dispatcher, 0
        self.sampler = TrainingSampler(dispatcher, spec.run.seed, lambda: self.version)

    async def run_group(self, item: dict, group_id: str, n: int | None = None,
                        sampling: dict | None = None) -> list[Rollout]:
        sampler = self.sampler if sampling is None else self.dispatcher
        return list(await asyncio.gather(*[
            self.runner.run(item, f"{group_id}-{i}", group_id, sampler, sampling)
            for i in range(n or self.spec.rollout.samples_per_prompt)]))

    def take_lost(self, keys: list[str]) -> bool:
        return self.dispatcher.take_lost(keys)

    def set_version(self, version: int) -> None:
        self.version = version

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        self.runner.close()


@ray.remote
class AgentWorker:
    """One worker: the agent's runner, a dispatcher over the run's engines and a training sampler."""

    def __init__(self, spec: RunSpec, policy_path: str, engines: list, live: list[int],
                 judge_engines: list, index: int) -> None:
        from transformers import AutoTokenizer

        from molt.agents import load_agent_runner
        from molt.rollout.sampling import TrainingSampler

        self.index, self.version = index, 0
        self.runner = load_agent_runner(spec.agent)
        tokenizer = AutoTokenizer.from_pretrained(policy_path, trust_remote_code=spec.model.trust_remote_code)
        # the driver's judge engines (never a second set, never stopped here), or agent.judge.url
        self.runner.setup(tokenizer, spec, start_judge(spec, judge_engines))
        self.dispatcher = Dispatcher(list(engines), on_death=self._engine_died)
        self.dispatcher.live = set(live)
        self.sampler = TrainingSampler(self.dispatcher, spec.run.seed, lambda: self.version)
        self.deaths: dict[int, tuple[str, str]] = {}   # engine -> (actor id, why), not yet reported
        # Out of the collector's scans, as in the driver (molt.driver.run.Run.start): the set-up's
        # long-lived objects made each full collection a pause of every session here.
        gc.collect()
        gc.freeze()

    def ready(self) -> int:
        return os.getpid()

    def _engine_died(self, i: int) -> None:
        # No restart here: the driver's fleet owns engines. Rollouts wait until `follow` brings one back.
        self.deaths[i] = (self.dispatcher.engines[i]._actor_id.hex(), self.dispatcher.dead[i])

    def set_version(self, version: int) -> None:
        self.version = version

    def follow(self, engines: list, live: list[int], fatal: str | None) -> None:
        """The driver's engines now: restarted ones take work again (also one whose death only the driver
        saw: its slot holds another actor); `fatal`: none is left."""
        mine = self.dispatcher
        for i in live:
            if i not in mine.live or mine.engines[i]._actor_id != engines[i]._actor_id:
                # rollouts still pinned to the old actor restart whole, as the driver's would
                mine.mark_dead(i, "restarted by the driver's fleet")
                mine.set_live(i, engines[i])
        if fatal:
            self.dispatcher.give_up(fatal)

    async def run_group(self, item: dict, group_id: str, n: int,
                        sampling: dict | None = None) -> dict[str, Any]:
        """The `n` rollouts of `item`; `lost`: an engine died under one (the pool restarts the group).
        `sampling`: an evaluation's defaults (rollout.eval's), sampled through the dispatcher itself, as the
        driver's evaluation without workers does (a training rollout's request seeds are not its)."""
        keys = [f"{group_id}-{i}" for i in range(n)]
        sampler = self.sampler if sampling is None else self.dispatcher
        rollouts = await asyncio.gather(*[self.runner.run(item, key, group_id, sampler, sampling)
                                          for key in keys])
        deaths, self.deaths = self.deaths, {}
        return {"rollouts": list(rollouts), "lost": self.dispatcher.take_lost(keys), "deaths": deaths}

    def close(self) -> None:
        self.runner.close()


async def start_agent_workers(spec: RunSpec, policy_path: str, dispatcher: Dispatcher,
                              judge_engines: list | None = None) -> AgentWorkers | None:
    """`agent.workers` workers, set up (None for 0: the rollouts run in the driver's loop); `judge_engines`:
    the driver's (molt.driver.judge_engines), which the workers' judges score on."""
    if not spec.agent.workers:
        return None
    workers = AgentWorkers(spec, policy_path, dispatcher, judge_engines)
    try:
        await asyncio.to_thread(workers.ready)
    except BaseException:
        workers.close()   # those that did set up (one that failed is dead already)
        raise
    return workers


class AgentWorkers:
    """The driver's side: starts the workers on their plan nodes, hands out groups, replaces dead workers."""

    def __init__(self, spec: RunSpec, policy_path: str, dispatcher: Dispatcher,
                 judge_engines: list | None = None) -> None:
        if spec.agent.module.endswith(".py"):   # a worker's current directory may not be the driver's
            agent = spec.agent.model_copy(update={"module": str(user_file(spec.agent.module))})
            spec = spec.model_copy(update={"agent": agent})
        self.spec, self.policy_path, self.dispatcher = spec, policy_path, dispatcher
        self.judge_engines = list(judge_engines or [])
        self.workers = [self._start(i) for i in range(spec.agent.workers)]
        self.load = [0] * len(self.workers)   # groups in flight per worker
        self.restarts = 0
        self.reruns = 0                        # groups run again because their worker died
        self.version = 0
        self.lost: set[str] = set()            # rollout ids whose engine died under them
        dispatcher.followers.append(self._engines_changed)

    def _start(self, i: int) -> Any:
        from molt.plan.placement import cluster_nodes, node_selector, plan

        slot = next(s for s in plan(self.spec) if s.role == "agent" and s.index == i)
        node = cluster_nodes(self.spec)[slot.node]["NodeID"]
        d, options = self.dispatcher, {"num_cpus": 1, "max_concurrency": 10_000}
        return AgentWorker.options(**options, label_selector=node_selector(node)).remote(
            self.spec, self.policy_path, d.engines, sorted(d.live), self.judge_engines, i)

    def ready(self) -> list[int]:
        """The workers' pids, once all have set up; a worker that failed to (its agent module, its chat
        server) raises here, before the run starts, and one that takes over START_TIMEOUT_S too."""
        try:
            return ray.get([w.ready.remote() for w in self.workers], timeout=START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"agent workers did not set up within {START_TIMEOUT_S:g} s (agent.module "
                               f"{self.spec.agent.module}: imports, tokenizer, chat server)") from None

    def set_version(self, version: int) -> None:
        """The policy version the engines hold (the pool calls this after each refit)."""
        self.version = version
        for worker in self.workers:
            worker.set_version.remote(version)

    def _engines_changed(self) -> None:
        d = self.dispatcher
        for worker in self.workers:
            worker.follow.remote(d.engines, sorted(d.live), d.fatal)

    def _pick(self, avoid: int | None) -> int:
        others = [i for i in range(len(self.workers)) if i != avoid] or [avoid]
        return min(others, key=lambda i: self.load[i])

    async def run_group(self, item: dict, group_id: str, n: int | None = None,
                        sampling: dict | None = None) -> list[Rollout]:
        """The group's rollouts (rollout.samples_per_prompt, or `n` of an evaluation with its `sampling`),
        from the least loaded worker; rerun whole on another if that one dies."""
        avoid = None
        while True:
            i = self._pick(avoid)
            worker = self.workers[i]
            self.load[i] += 1
            ref = worker.run_group.remote(item, group_id, n or self.spec.rollout.samples_per_prompt, sampling)
            try:
                out = await ref
            except asyncio.CancelledError:
                ray.cancel(ref)   # the worker cancels the group's rollouts, and they their engine requests
                raise
            except RayActorError as err:
                self._replace(i, worker, err)
                self.reruns += 1
                avoid = i
                continue
            finally:
                self.load[i] -= 1
            self._report_engine_deaths(out["deaths"])
            if out["lost"] and sampling is None:   # an evaluation's rollout on a dead engine scores 0
                self.lost.update(r.rollout_id for r in out["rollouts"])
            return out["rollouts"]

    def _replace(self, i: int, worker: Any, err: BaseException) -> None:
        """Worker `i` died under a group: start another in its slot (once, whichever group saw it first)."""
        if self.workers[i] is not worker:
            return
        self.restarts += 1
        limit = self.spec.agent.max_worker_restarts
        why = str(err).splitlines()[0]
        if self.restarts > limit:
            raise RuntimeError(f"agent workers died {self.restarts} times, above agent.max_worker_restarts="
                               f"{limit}; last: worker {i}: {why}") from err
        print(f"molt: agent worker {i} died ({why}); its groups rerun on the others; restart "
              f"{self.restarts} of {limit}", flush=True)
        self.workers[i] = self._start(i)   # calls wait in Ray's queue until it has set up
        self.workers[i].set_version.remote(self.version)

    def _report_engine_deaths(self, deaths: dict[int, tuple[str, str]]) -> None:
        """A worker saw engine `i` die: the driver's dispatcher marks it dead (the fleet restarts it), unless
        it knows already or slot `i` holds a newer engine."""
        for i, (actor, why) in deaths.items():
            if i in self.dispatcher.live and self.dispatcher.engines[i]._actor_id.hex() == actor:
                self.dispatcher.mark_dead(i, why)

    def take_lost(self, keys: list[str]) -> bool:
        """Whether an engine died under any of `keys` (`Dispatcher.take_lost`, for groups run here)."""
        hit = self.lost.intersection(keys)
        self.lost -= hit
        return bool(hit)

    def metrics(self) -> dict[str, float]:
        return {"agent/worker_restarts": float(self.restarts), "agent/groups_rerun": float(self.reruns)}

    def close(self) -> None:
        self.dispatcher.followers.remove(self._engines_changed)
        for worker in self.workers:
            try:
                ray.get(worker.close.remote(), timeout=30)
            except (RayActorError, ray.exceptions.GetTimeoutError):
                pass   # dead already: nothing of it to stop
            ray.kill(worker)
