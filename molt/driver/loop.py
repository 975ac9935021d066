"""The training loop, top to bottom.

    take a batch of finished groups from the pool → drop failed rollouts → filters → trainer logprobs
    (+ reference, critic) → advantages → train → refit the engines → log, checkpoint, evaluate

Sync and async are one switch (`rollout.mode`): in sync mode the pool generates exactly one batch and
then waits for the refit; in async mode it keeps `rollout.groups_in_flight` groups generating while the
trainer steps, and `rollout.max_staleness` bounds how old a trained token may be. Trainer calls block
on Ray, so they run in a worker thread and the pool's rollouts keep going on the event loop.
"""

from __future__ import annotations

import asyncio
import gc
import time
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError

from molt.agents import load_agent_runner
from molt.algo import adaptive_kl_coef, compute_advantages, with_kl_coef
from molt.driver.agent_workers import AgentWorkers, start_agent_workers
from molt.driver.checkpoints import (
    carry_best,
    find_checkpoint,
    install_stop_handler,
    latest_of,
    new_best,
    save_checkpoint,
)
from molt.driver.eval import evaluate
from molt.driver.fleet import Fleet
from molt.driver.judge_engines import judge_engines, set_up, start_judge
from molt.driver.metrics import RunLogger, add_token_record
from molt.driver.probe import probe_gap, probe_prompt, sample_probe
from molt.driver.select import (
    filter_decisions,
    filter_rollouts,
    group_ids,
    rollout_metrics,
    shaped_rewards,
    take_batch,
    turn_credit,
)
from molt.driver.throughput import throughput
from molt.inputs.data import PromptDataset, PromptIterator, load_eval_sets
from molt.inputs.vision import processor
from molt.plan.models import model_path
from molt.rollout.engine import start_engine
from molt.rollout.pool import RolloutPool
from molt.rollout.sampling import TrainingSampler
from molt.spec import RunSpec
from molt.trainer.batch import add_images, check_token_first, make_batch
from molt.trainer.ranks import TrainerRanks, Trainers
from molt.trajectory import NO_VERSION, Rollout, Segment, pad_routes


def train(spec: RunSpec) -> dict[str, float]:
    """Run the whole training described by `spec`; returns the last step's metrics."""
    try:
        return asyncio.run(_train(spec))
    finally:
        gc.unfreeze()   # start_run froze start-up's objects for this run: collectable again after it


async def _train(spec: RunSpec) -> dict[str, float]:
    policy_path = model_path(spec)
    runner = load_agent_runner(spec.agent)           # bad input fails before any actor starts
    PromptDataset(spec.data.train_path, spec.data)
    eval_sets = load_eval_sets(spec.data) if spec.train.eval_every else {}
    checkpoint = find_checkpoint(spec)               # a bad run.resume too
    if checkpoint:
        carry_best(spec, checkpoint)
    fleet, trainers, logger = start_run(spec, policy_path, runner)
    # only what the trainer can score, seeded so that a rerun samples the same tokens
    sampler = TrainingSampler(fleet.dispatcher, spec.run.seed, lambda: at.pool.version)

    async def rollout_fn(item: dict, group_id: str, sample_index: int) -> Rollout:
        return await runner.run(item, f"{group_id}-{sample_index}", group_id, sampler)

    def save(best: float | None = None) -> None:
        extra = {"step": at.step, "version": at.version, "data": at.data.state_dict(),
                 "pending": at.pool.pending_items(), "groups_started": at.pool.started, "kl_coef": at.kl_coef}
        save_checkpoint(spec, at.step, {"policy": trainers.policy, "critic": trainers.critic}, extra, best)
        at.saved = at.step

    workers, at = None, None
    try:   # from here a failure (a worker's agent set-up, a bad checkpoint) stops what start_run started
        workers = await start_agent_workers(spec, policy_path, fleet.dispatcher, judge_engines(runner.judge))
        at = await begin(spec, trainers, fleet, rollout_fn, checkpoint, refit_engines=checkpoint is not None,
                         workers=workers)
        if checkpoint:
            print(f"molt: resumed from {checkpoint} at step {at.step} (policy version {at.version})")
        stop, metrics = install_stop_handler(), {}
        if eval_sets and at.step == 0:   # the starting model's scores, logged as step 0
            logger.log(0, await evaluate(spec, runner, fleet.dispatcher, eval_sets, 0, workers))
        while at.step < spec.train.steps and not stop.is_set():
            try:
                metrics = await rl_step(spec, at, trainers, fleet, logger)
                metrics.update(workers.metrics() if workers else {})
                if eval_sets and (at.step % spec.train.eval_every == 0 or at.step == spec.train.steps):
                    metrics |= await evaluate(spec, runner, fleet.dispatcher, eval_sets, at.step, workers)
                logger.log(at.step, metrics)
                best = new_best(spec, at.step, metrics)
                if best is not None or (spec.train.save_every and at.step % spec.train.save_every == 0):
                    async with fleet.trainer:
                        save(best)
            except RayActorError as err:   # a trainer rank died (engine deaths are the fleet's)
                trainers, at = await restart_trainers(spec, err, at, trainers, fleet, rollout_fn, workers)
                logger.redo_steps()
        if at.step != at.saved:
            save()
        if stop.is_set():
            print(f"molt: stopped by signal at step {at.step}; checkpoint written, resume with "
                  f"run.resume={spec.run.dir} (or run.resume=auto)")
    finally:
        await stop_run(at, workers, runner, logger, trainers, fleet)
        if spec.logging.dump_rollouts and any((Path(spec.run.dir) / "rollouts").glob("step_*.jsonl")):
            from molt.driver.inspect import inspect_command

            print(f"molt: read the rollouts token by token: {inspect_command(spec.run.dir)}", flush=True)
    return metrics


async def stop_run(at: Position | None, workers: AgentWorkers | None, runner: Any, logger: RunLogger,
                   trainers: Trainers, fleet: Fleet) -> None:
    """Stop everything a run started, also one that failed before its pool (`at`) or workers existed."""
    if at is not None:
        if at.probe:
            at.probe.cancel()
        await at.pool.close()
    if workers:
        workers.close()
    runner.close()
    logger.close()
    trainers.stop()
    await fleet.close()


@dataclass
class Position:
    """Where the run is: steps done, the policy version, the data position and the pool sampling ahead."""
    step: int
    version: int
    data: PromptIterator
    pool: RolloutPool
    saved: int              # the step of the last checkpoint written (or loaded)
    kl_coef: float          # the KL weight in use (algo.kl.coef, moved by the adaptive controller)
    trainer_restarts: int = 0
    probe: asyncio.Task | None = None   # async mode: the post-refit probe (molt.driver.probe)


def start_run(spec: RunSpec, policy_path: str, runner: Any) -> tuple[Fleet, Trainers, RunLogger]:
    """The engines (a `Fleet`), trainer roles (with the pad token of the tokenizer `runner` is set up on) and
    run logger. The engines, the longest start (vLLM import, weights, KV cache), load while the rest starts;
    a failure stops all."""
    engines = [start_engine(spec, policy_path, i) for i in range(spec.rollout.engine.num_engines)]
    trainers, logger, judge = Trainers(), None, None
    try:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(policy_path, trust_remote_code=spec.model.trust_remote_code)
        judge = start_judge(spec)
        if spec.agent.workers:
            # The workers run every rollout on runners of their own: the driver's only holds the judge
            # whose engines they share (its close() stops them). Set up, a chat agent's would keep an idle
            # chat server ticking in the driver (≈2 ms of CPU a second, ≈0.15 s of a 75 s step).
            runner.judge = judge
        else:
            set_up(runner, tokenizer, spec, judge)   # the runner's close() stops the judge's engines
        ready = [engine.ready.remote() for engine in engines]
        if spec.parallel.colocate:   # vLLM sizes its KV cache from the GPU memory free when it starts
            ray.get(ready, timeout=spec.rollout.engine.start_timeout_s)
        trainers = Trainers.start(spec, tokenizer.pad_token_id)
        logger = RunLogger(spec)
        ray.get(ready, timeout=spec.rollout.engine.start_timeout_s)
    except BaseException:
        if judge is not None:   # also when the runner's set-up failed before it took the judge
            judge.shutdown()
        runner.close()   # a chat server
        if logger:
            logger.close()
        trainers.stop()
        for engine in engines:
            ray.kill(engine)
        raise
    # Start-up leaves ~1M long-lived objects (torch, vLLM, Ray, the tokenizer). Frozen, the collector
    # never scans them again: the steps' rollouts trigger full collections, which scanned them all
    # (≈0.5 s of the driver's CPU every second or third step at 1,024 rollouts, bench/RESULTS.md).
    gc.collect()
    gc.freeze()
    return Fleet(spec, policy_path, engines), trainers, logger


async def begin(spec: RunSpec, trainers: Trainers, fleet: Fleet, rollout_fn: Any, checkpoint: Path | None,
                refit_engines: bool, workers: AgentWorkers | None = None) -> Position:
    """Load `checkpoint` (if any) into the trainers, connect them to the engines (and refit these when
    they may hold other weights: a resume, a rebuilt trainer) and start a pool at the data position; with
    `workers` the pool's groups run there instead of through `rollout_fn`."""
    data = PromptIterator(PromptDataset(spec.data.train_path, spec.data), seed=spec.run.seed,
                          shuffle=spec.data.shuffle)
    step, version, pending, kl_coef, groups = 0, 0, [], spec.algo.kl.coef, 0
    if checkpoint:
        extra = await asyncio.to_thread(trainers.load, checkpoint)
        step, version, pending = extra["step"], extra["version"], extra["pending"]
        kl_coef, groups = extra.get("kl_coef", kl_coef), extra.get("groups_started", 0)
        data.load_state_dict(extra["data"])
    await fleet.connect(trainers.policy)
    if refit_engines:
        await fleet.refit(version)
    sync = spec.rollout.mode == "sync"

    def engines_generating(busy: bool) -> None:   # async, CPU, cpu_threads null: idle engines lend
        for group in trainers.groups():            # their cores to the trainer (placement.cpu_threads)
            group.set_engines_idle(not busy)
    lend = not sync and spec.parallel.device == "cpu" and not spec.parallel.cpu_threads
    pool = RolloutPool(chain(pending, data), rollout_fn, spec.rollout.samples_per_prompt,
                       spec.train.prompts_per_step if sync else spec.rollout.groups_in_flight,
                       spec.rollout.max_staleness, fleet.dispatcher.engines, refill_during_batch=not sync,
                       lost=workers.take_lost if workers else fleet.dispatcher.take_lost,
                       on_generating=engines_generating if lend else None, first_group=groups,
                       oldest_first=spec.rollout.handout == "oldest",
                       group_fn=workers.run_group if workers else None,
                       on_version=workers.set_version if workers else None)
    pool.set_version(version)
    return Position(step, version, data, pool, saved=step, kl_coef=kl_coef)


async def restart_trainers(spec: RunSpec, err: BaseException, at: Position, trainers: Trainers, fleet: Fleet,
                           rollout_fn: Any, workers: AgentWorkers | None = None) -> tuple[Trainers, Position]:
    """New trainer actors from the last checkpoint of this run (or the one resumed from, or the initial
    weights), the engines refitted to them and a new pool at the checkpoint's data position: steps after
    the checkpoint are redone (the metrics log keeps a redone step's last record); bounded by
    train.max_trainer_restarts."""
    restarts = at.trainer_restarts + 1
    if restarts > spec.train.max_trainer_restarts:
        raise RuntimeError(f"a trainer rank died {restarts} times, above train.max_trainer_restarts="
                           f"{spec.train.max_trainer_restarts}; last: {str(err).splitlines()[0]}") from err
    if at.probe:
        at.probe.cancel()
    await at.pool.close()
    trainers.stop()
    trainers = Trainers.start(spec, trainers.pad_id)
    checkpoint = latest_of(Path(spec.run.dir)) or find_checkpoint(spec)
    at = await begin(spec, trainers, fleet, rollout_fn, checkpoint, refit_engines=True, workers=workers)
    at.trainer_restarts = restarts
    print(f"molt: a trainer rank died ({str(err).splitlines()[0]}); restart {restarts} of "
          f"{spec.train.max_trainer_restarts}: continuing from {checkpoint or 'the initial weights'} at step "
          f"{at.step}", flush=True)
    return trainers, at


async def rl_step(spec: RunSpec, at: Position, trainers: Trainers, fleet: Fleet,
                  logger: RunLogger) -> dict[str, float]:
    """One step: a batch from the pool → learn → refit; advances `at` and returns the step's metrics."""
    t_step = time.perf_counter()
    # Async mode: a probe of the current policy measures invariant 3 if the batch cannot, so the pool
    # need not wait for a group of it (one group's generation per step).
    groups, batch_metrics = await take_batch(at.pool, spec, need_current=at.probe is None)
    probe = await at.probe if at.probe else None
    fleet.dispatcher.check()   # no engine left (restarts used up): stop with a clear error
    t_batch = time.perf_counter()
    rollouts = [r for g in groups for r in g]
    live = [fleet.dispatcher.engines[i] for i in sorted(fleet.dispatcher.live)]
    warmup = at.step < spec.train.critic_warmup_steps   # the critic alone: the policy stays as it is
    record = None   # the trainer's side of the dump: why each rollout is trained or not, what the loss saw
    if spec.logging.dump_rollouts:
        record = {rollout_id: {"decision": why, "version": at.version}
                  for rollout_id, why in filter_decisions(spec, rollouts).items()}
    try:
        await fleet.sleep_if_colocated()   # the engine sleeps while the trainer steps on its GPU
        async with fleet.trainer:
            metrics = await learn(spec_with_kl_coef(spec, at.kl_coef), rollouts, trainers, at.version,
                                  engines=live, train_policy=not warmup, probe=probe, record=record)
    finally:   # after learn, so the dump carries the routes it captured; also when it fails
        logger.dump_rollouts(at.step + 1, rollouts, record)
        await fleet.wake_if_colocated()
    metrics.update(batch_metrics)
    if spec.algo.kl.coef:
        metrics["kl/coef"] = at.kl_coef
    at.kl_coef = next_kl_coef(spec, at.kl_coef, metrics)
    metrics["time/refit"] = 0.0
    if not warmup:
        at.version += 1
        metrics["time/refit"] = await fleet.refit(at.version)
        metrics["refit/bytes"] = float(fleet.refit_bytes)
        at.pool.set_version(at.version)
        prompt = probe_prompt(rollouts) if spec.rollout.mode == "async" else None
        at.probe = asyncio.create_task(sample_probe(spec, fleet.dispatcher, prompt, at.version)) \
            if prompt else None
    at.step += 1

    pool_stats = await at.pool.stats()
    step_time = time.perf_counter() - t_step
    metrics.update({
        "time/wait_batch": t_batch - t_step,
        "time/generate": pool_stats["engine_busy_s"],  # mean seconds an engine had work
        "time/step": step_time,
        "engine/idle_frac": pool_stats["engine_idle_frac"],
        "trainer/idle_frac": (t_batch - t_step) / step_time,
        "pool/in_flight": pool_stats["in_flight"],
        "pool/stale_requeued": pool_stats["stale_requeued"],
        "pool/engine_requeued": pool_stats["engine_requeued"],
        "trainer/restarts": float(at.trainer_restarts),
        "policy/version": at.version,
        **fleet.metrics(),
    })
    metrics["tokens/per_s"] = metrics["tokens/sampled"] / metrics["time/step"]
    metrics.update(throughput(spec, metrics))   # per device and stage, as NeMo-RL reports it
    return metrics


async def learn(spec: RunSpec, rollouts: list[Rollout], trainers: Trainers, version: int, *,
                engines: list | None = None, train_policy: bool = True,
                probe: Segment | None = None, record: dict[str, dict] | None = None) -> dict[str, float]:
    """One training step on finished rollouts (also how a dumped batch is replayed).

    The KL weight is `spec.algo.kl.coef`: the loop passes the adaptive controller's value in it
    (`spec_with_kl_coef`). With `model.router_replay`, segments without routed experts get them from `engines`
    (`fill_routes`). `train_policy=False` trains only the critic (train.critic_warmup_steps). `probe`
    (async mode) is scored for invariant 3 when no trained token was sampled by `version`. `record` (the
    dump's, by rollout id) gets what the policy's loss saw of each token (logging.dump_trainer)."""
    policy, reference, critic, pad_id = trainers.policy, trainers.reference, trainers.critic, trainers.pad_id
    metrics = rollout_metrics(spec, rollouts)
    kept, filter_metrics = filter_rollouts(spec, rollouts)
    metrics.update(filter_metrics)
    rewards, reward_metrics = shaped_rewards(spec, kept)
    metrics.update(reward_metrics)
    groups = group_ids(kept)
    segments = [s for r in kept for s in r.segments if sum(s.loss_mask)]
    if not segments:
        metrics["train/skipped"] = 1.0
        return metrics

    # --- MoE router replay: segments carry the engine's routes; re-score only those that do not ---
    if spec.model.router_replay:
        t0 = time.perf_counter()
        await fill_routes(engines, segments, version)
        metrics["time/route_capture"] = time.perf_counter() - t0
    # --- end router replay ---

    t0 = time.perf_counter()
    batch = token_batch(spec, segments, pad_id, version, metrics)
    if probe is not None and train_policy and not batch["current_mask"].any() and \
            probe.versions[probe.prompt_len] == version:
        metrics.update(await probe_gap(policy, probe, pad_id))   # before the update moves the weights
    # Without a reference nothing before the update needs the policy's logprobs: update takes
    # them from its own forward (one update per batch, so old == current), saving a forward pass, or
    # computes them itself before its first update (train.minibatches / train.epochs > 1).
    old_logp = await asyncio.to_thread(policy.logprobs, batch) if reference else None
    ref_logp = await asyncio.to_thread(reference.logprobs, batch) if reference else None
    values = await asyncio.to_thread(critic.values, batch) if critic else None
    metrics["time/logprobs"] = time.perf_counter() - t0

    rollout_of = {r.rollout_id: i for i, r in enumerate(kept)}
    rewards, per_turn = turn_credit(spec, kept, rewards, segments, batch["loss_mask"].shape)
    adv = compute_advantages(
        rewards, groups, torch.tensor([rollout_of[s.rollout_id] for s in segments], dtype=torch.long),
        batch["loss_mask"], spec.algo, values=values, logp=old_logp, ref_logp=ref_logp,
        **per_turn)
    metrics.update({f"adv/{k}": float(v) for k, v in adv.metrics.items()})
    batch["advantages"] = adv.advantages
    if reference is not None:
        batch.update(old_logp=old_logp, ref_logp=ref_logp)

    t0 = time.perf_counter()
    trained = policy if train_policy else None
    metrics.update(await update(batch, trained, critic, values, adv.returns, spec.algo.kl.coef,
                                record if spec.logging.dump_trainer else None, segments))
    metrics["time/train"] = time.perf_counter() - t0
    metrics["tokens/trained"] = float(batch["loss_mask"].sum())
    return metrics


def token_batch(spec: RunSpec, segments: list[Segment], pad_id: int, version: int,
                metrics: dict[str, float]) -> dict[str, torch.Tensor]:
    """The padded training batch of `segments`, checked against invariant 1; adds how stale it is to
    `metrics`. Tokens the current weights sampled are marked: invariant 3 is measured on them."""
    batch = make_batch(segments, pad_id, versions=[[float(v) for v in s.versions] for s in segments])
    if any(s.images for s in segments):
        add_images(batch, segments, processor(model_path(spec), spec.model.trust_remote_code))
    sampled = batch["loss_mask"] > 0
    check_token_first(batch, segments)
    current = sampled & (batch["versions"] == version)
    batch["current_mask"] = current.float()
    metrics["mismatch/stale_frac"] = 1 - float(current.sum()) / max(float(sampled.sum()), 1.0)
    metrics["tokens/total"] = float(batch["attention_mask"].sum())   # (molt/driver/throughput.py)
    lag = (version - batch["versions"])[sampled]   # policy versions between sampling and this update
    metrics["policy/lag_mean"], metrics["policy/lag_max"] = float(lag.mean()), float(lag.max())
    return batch


async def update(batch: dict[str, torch.Tensor], policy: TrainerRanks | None, critic: TrainerRanks | None,
                 values: torch.Tensor | None, returns: torch.Tensor | None,
                 kl_coef: float, record: dict[str, dict] | None = None,
                 segments: list[Segment] = ()) -> dict[str, float]:
    """The optimizer steps of the policy (None: critic warm-up) and the critic on `batch`; their metrics
    as the trainers name them (train/, critic/, the trainer/engine gap under mismatch/). `record` gets what
    the policy's loss saw of each token of `segments` (the batch's rows) under their rollout ids."""
    metrics: dict[str, float] = {}
    if policy is not None:
        metrics.update(await asyncio.to_thread(policy.update, batch, kl_coef, record is not None))
        if record is not None:
            add_token_record(record, segments, await asyncio.to_thread(policy.token_record))
    else:
        metrics["train/critic_warmup"] = 1.0
    if critic is not None:
        critic_batch = dict(batch, old_values=values, returns=returns)
        metrics.update(await asyncio.to_thread(critic.update, critic_batch))
    return metrics


def spec_with_kl_coef(spec: RunSpec, kl_coef: float | None) -> RunSpec:
    """`spec` as one step runs it: algo.kl.coef is the adaptive KL controller's weight (None: the spec's)."""
    return spec.model_copy(update={"algo": with_kl_coef(spec.algo, kl_coef)})


def next_kl_coef(spec: RunSpec, kl_coef: float, metrics: dict[str, float]) -> float:
    """The adaptive KL controller's next weight (algo.kl.target) from this step's mean token KL: the
    reward's when folded in, else the loss's; unchanged when the step measured none."""
    measured = metrics.get("adv/kl_in_reward", metrics.get("train/kl"))
    if measured is None:
        return kl_coef
    return adaptive_kl_coef(kl_coef, measured, int(metrics["rollout/count"]), spec.algo.kl)


async def fill_routes(engines: list | None, segments: list[Segment], version: int) -> None:
    """Fallback for segments that came without routed experts: re-score them on the engines (split evenly).

    Engines return each request's routes with its tokens, so this runs only where they could not. The
    engines hold `version` now, so only segments that version sampled entirely can be re-scored.
    """
    todo = [s for s in segments if s.routed_experts is None]
    if not todo:
        return
    stale = [s for s in todo if any(v not in (NO_VERSION, version) for v in s.versions)]
    if stale:
        raise RuntimeError(f"model.router_replay: rollout {stale[0].rollout_id} came without routed experts "
                           f"and was sampled by an older policy than the engines hold (version {version}); "
                           "re-scoring it would replay the wrong routes")
    if not engines:
        raise RuntimeError("model.router_replay: these segments carry no routed experts and no engine is "
                           "running to capture them (dumped before the routes were captured?)")
    shares = [todo[i::len(engines)] for i in range(len(engines))]
    routes = await asyncio.gather(*[e.capture_routes.remote([s.token_ids for s in share])
                                    for e, share in zip(engines, shares, strict=True) if share])
    for share, got in zip([s for s in shares if s], routes, strict=True):
        for segment, route in zip(share, got, strict=True):
            segment.routed_experts = pad_routes(route, len(segment.token_ids))
