"""One RL run's parts and their lifetime, owned in one place, and the step skeleton both loops share.

    Run.start(spec, inputs)   the engines (a `Fleet`), the trainer roles, the run logger, the agent's groups
                              (in this process, or on agent workers: one choice, here), then `begin`
    run.begin(checkpoint)     load a checkpoint (or none) into the trainers, refit the engines when they may
                              hold other weights, and start the pool at the data position
    run.save(best)            a checkpoint of the trainers and the run's position (molt/driver/checkpoints.py
                              lays the folder out; `load` reads it back)
    run.restart_trainers(err) new trainer actors from the last checkpoint, after a rank died
    run.stop()                stop everything started, also after a failure half-way through `start`

torchtune's recipe interface is the model (load_checkpoint / train / save_checkpoint / cleanup, all state in
one object). `train_steps` is the skeleton around a loop's step: the step-0 evaluation, evaluations every
train.eval_every, logging, the best checkpoint, periodic checkpoints, and SIGINT / SIGTERM (finish the step,
save, stop); the RL loop (molt/driver/loop.py) and SFT (molt/driver/sft_loop.py) both run in it.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable
from itertools import chain
from pathlib import Path
from typing import Any, Protocol

import ray
from ray.exceptions import RayActorError

from molt.driver.agent_workers import AgentWorkers, LocalAgents, start_agent_workers
from molt.driver.checkpoints import (
    carry_best,
    find_checkpoint,
    install_stop_handler,
    latest_of,
    load_checkpoint,
    new_best,
    save_checkpoint,
)
from molt.driver.compose import Inputs
from molt.driver.eval import evaluate
from molt.driver.fleet import Fleet
from molt.driver.judge_engines import judge_engines, start_judge
from molt.driver.metrics import RunLogger
from molt.inputs.data import PromptIterator
from molt.rollout.engine import start_engine
from molt.rollout.pool import RolloutPool
from molt.spec import RunSpec
from molt.trainer.ranks import Trainers


class Steps(Protocol):
    """What `train_steps` needs of a run (an RL `Run`, an SFT run)."""
    spec: RunSpec
    logger: RunLogger
    step: int                    # steps done
    saved: int                   # the step of the last checkpoint written (or loaded)
    eval_sets: dict[str, Any]    # empty: no evaluations

    async def evaluate(self) -> dict[str, float]: ...
    async def save(self, best: float | None = None) -> None: ...
    async def recover(self, err: RayActorError) -> bool: ...


async def train_steps(run: Steps, step: Callable[[Any], Awaitable[dict[str, float]]]) -> dict[str, float]:
    """Run `step(run)` until train.steps or a signal, evaluating, logging and checkpointing around it;
    returns the last step's metrics. A trainer rank's death (RayActorError) goes to `run.recover`, which
    continues from a checkpoint (True) or lets it stop the run."""
    spec, stop, metrics = run.spec, install_stop_handler(), {}
    if run.eval_sets and run.step == 0:   # the starting model's scores, logged as step 0
        run.logger.log(0, await run.evaluate())
    while run.step < spec.train.steps and not stop.is_set():
        try:
            metrics = await step(run)
            if run.eval_sets and (run.step % spec.train.eval_every == 0 or run.step == spec.train.steps):
                metrics |= await run.evaluate()
            run.logger.log(run.step, metrics)
            best = new_best(spec, run.step, metrics)
            if best is not None or (spec.train.save_every and run.step % spec.train.save_every == 0):
                await run.save(best)
        except RayActorError as err:   # a trainer rank died (engine deaths are the fleet's)
            if not await run.recover(err):
                raise
    if run.step != run.saved:
        await run.save()
    if stop.is_set():
        print(f"molt: stopped by signal at step {run.step}; checkpoint written, resume with "
              f"run.resume={spec.run.dir} (or run.resume=auto)")
    return metrics


class Run:
    """An RL run: its engines, trainers, agent groups, logger, pool and position, from start to stop."""

    def __init__(self, spec: RunSpec, inputs: Inputs, fleet: Fleet, trainers: Trainers,
                 logger: RunLogger) -> None:
        self.spec, self.inputs, self.fleet, self.trainers, self.logger = spec, inputs, fleet, trainers, logger
        self.runner = inputs.runner
        self.eval_sets = inputs.eval_sets if spec.train.eval_every else {}
        # Where the agent's groups run: one choice for the run (AgentWorkers replaces this in `start`).
        self.groups: LocalAgents | AgentWorkers = LocalAgents(spec, inputs.runner, fleet.dispatcher)
        self.pool: RolloutPool | None = None
        self.data: PromptIterator | None = None
        self.step = self.version = self.saved = self.trainer_restarts = 0
        self.kl_coef = spec.algo.kl.coef   # the KL weight in use (moved by the adaptive controller)
        self.probe: asyncio.Task | None = None   # async mode: the post-refit probe (molt.driver.probe)
        self.context_warned = False   # responses cut by the context are warned about once

    @classmethod
    async def start(cls, spec: RunSpec, inputs: Inputs) -> Run:
        """Everything a run needs, started; then `begin` at run.resume's checkpoint. The engines, the
        longest start (vLLM import, weights, KV cache), load while the rest starts; a failure stops all."""
        checkpoint = inputs.checkpoint
        if checkpoint:
            carry_best(spec, checkpoint)
        engines = [start_engine(spec, inputs.policy_path, i) for i in range(spec.rollout.engine.num_engines)]
        run = trainers = logger = judge = None
        try:
            judge = start_judge(spec)
            if spec.agent.workers:
                # The workers run every rollout on runners of their own: the driver's only holds the judge
                # whose engines they share (its close() stops them). Set up, a chat agent's would keep an
                # idle chat server ticking in the driver (≈2 ms of CPU a second, ≈0.15 s of a 75 s step).
                inputs.runner.judge = judge
            else:
                inputs.runner.setup(inputs.tokenizer, spec, judge)   # its close() stops the judge's engines
            ready = [e.ready.remote() for e in engines]
            if spec.parallel.colocate:   # vLLM sizes its KV cache from the GPU memory free when it starts
                ray.get(ready, timeout=spec.rollout.engine.start_timeout_s)
            trainers = Trainers.start(spec, inputs.tokenizer.pad_token_id)
            logger = RunLogger(spec)
            ray.get(ready, timeout=spec.rollout.engine.start_timeout_s)
            run = cls(spec, inputs, Fleet(spec, inputs.policy_path, engines), trainers, logger)
            workers = await start_agent_workers(spec, inputs.policy_path, run.fleet.dispatcher,
                                                judge_engines(inputs.runner.judge))
            run.groups = workers or run.groups
            await run.begin(checkpoint, refit_engines=checkpoint is not None)
        except BaseException:
            if run is not None:
                await run.stop()
            else:
                if judge is not None:   # also when the runner's set-up failed before it took the judge
                    judge.shutdown()
                inputs.runner.close()   # a chat server
                if logger:
                    logger.close()
                if trainers:
                    trainers.stop()
                for engine in engines:
                    ray.kill(engine)
            raise
        if checkpoint:
            print(f"molt: resumed from {checkpoint} at step {run.step} (policy version {run.version})")
        # Start-up leaves ~1M long-lived objects (torch, vLLM, Ray, the tokenizer). Frozen, the collector
        # never scans them again: the steps' rollouts trigger full collections, which scanned them all
        # (≈0.5 s of the driver's CPU every second or third step at 1,024 rollouts, bench/RESULTS.md).
        gc.collect()
        gc.freeze()
        return run

    async def begin(self, checkpoint: Path | None, refit_engines: bool) -> None:
        """Load `checkpoint` (if any) into the trainers, connect them to the engines (and refit these when
        they may hold other weights: a resume, a rebuilt trainer) and start a pool at the data position."""
        spec = self.spec
        self.data = PromptIterator(self.inputs.train, seed=spec.run.seed, shuffle=spec.data.shuffle)
        self.step = self.version = 0
        self.kl_coef, pending, groups = spec.algo.kl.coef, [], 0
        if checkpoint:
            meta = await asyncio.to_thread(load_checkpoint, checkpoint, self.trainers.roles())
            self.step, self.version, pending = meta["step"], meta["version"], meta["pending"]
            self.kl_coef, groups = meta.get("kl_coef", self.kl_coef), meta.get("groups_started", 0)
            self.data.load_state_dict(meta["data"])
        self.saved = self.step
        await self.fleet.connect(self.trainers.policy)
        if refit_engines:
            await self.fleet.refit(self.version)
        sync = spec.rollout.mode == "sync"
        # async, CPU, cpu_threads null: idle engines lend their cores to the trainer (placement.cpu_threads)
        lend = not sync and spec.parallel.device == "cpu" and not spec.parallel.cpu_threads
        self.pool = RolloutPool(chain(pending, self.data), self.groups,
                                spec.train.prompts_per_step if sync else spec.rollout.groups_in_flight,
                                spec.rollout.max_staleness, self.fleet.dispatcher.engines,
                                refill_during_batch=not sync, on_generating=self._lend if lend else None,
                                first_group=groups, oldest_first=spec.rollout.handout == "oldest")
        self.pool.set_version(self.version)

    def _lend(self, busy: bool) -> None:
        for role in self.trainers.roles().values():
            role.set_engines_idle(not busy)

    async def evaluate(self) -> dict[str, float]:
        return await evaluate(self.spec, self.groups, self.eval_sets, self.step)

    async def save(self, best: float | None = None) -> None:
        meta = {"step": self.step, "version": self.version, "data": self.data.state_dict(),
                "pending": self.pool.pending_items(), "groups_started": self.pool.started,
                "kl_coef": self.kl_coef}
        async with self.fleet.trainer:
            save_checkpoint(self.spec, self.step, self.trainers.roles(), meta, best)
        self.saved = self.step

    async def recover(self, err: RayActorError) -> bool:
        await self.restart_trainers(err)
        self.logger.redo_steps()
        return True

    async def restart_trainers(self, err: BaseException) -> None:
        """New trainer actors from the last checkpoint of this run (or the one resumed from, or the initial
        weights), the engines refitted to them and a new pool at the checkpoint's data position: steps after
        the checkpoint are redone (the metrics log keeps a redone step's last record); bounded by
        train.max_trainer_restarts."""
        spec, restarts = self.spec, self.trainer_restarts + 1
        if restarts > spec.train.max_trainer_restarts:
            raise RuntimeError(f"a trainer rank died {restarts} times, above train.max_trainer_restarts="
                               f"{spec.train.max_trainer_restarts}; last: {str(err).splitlines()[0]}"
                               ) from err
        await self._stop_pool()
        self.trainers.stop()
        self.trainers = Trainers.start(spec, self.trainers.pad_id)
        checkpoint = latest_of(Path(spec.run.dir)) or find_checkpoint(spec)
        await self.begin(checkpoint, refit_engines=True)
        self.trainer_restarts = restarts
        print(f"molt: a trainer rank died ({str(err).splitlines()[0]}); restart {restarts} of "
              f"{spec.train.max_trainer_restarts}: continuing from {checkpoint or 'the initial weights'} at "
              f"step {self.step}", flush=True)

    async def _stop_pool(self) -> None:
        if self.probe:
            self.probe.cancel()
            self.probe = None
        if self.pool is not None:
            await self.pool.close()

    async def stop(self) -> None:
        """Stop everything the run started (also a run that failed before its pool or workers existed)."""
        await self._stop_pool()
        self.groups.close()   # agent workers; the in-process runner (its chat server, the judge's engines)
        if isinstance(self.groups, AgentWorkers):
            self.runner.close()
        self.logger.close()
        self.trainers.stop()
        await self.fleet.close()
