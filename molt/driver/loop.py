"""The training loop, top to bottom.

    take a batch of finished groups from the pool → drop failed rollouts → filters → trainer logprobs
    (+ reference, critic) → advantages → train → refit the engines → log, checkpoint, evaluate

The run's parts (engines, trainers, agent groups, pool, position) are a `Run` (molt/driver/run.py), which
also holds the skeleton around each step (evaluations, logging, checkpoints, signals): this file is the step.

Sync and async are one switch (`rollout.mode`): in sync mode the pool generates exactly one batch and
then waits for the refit; in async mode it keeps `rollout.groups_in_flight` groups generating while the
trainer steps, and `rollout.max_staleness` bounds how old a trained token may be. Trainer calls block
on Ray, so they run in a worker thread and the pool's rollouts keep going on the event loop.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from pathlib import Path

import torch

from molt.algo import adaptive_kl_coef, compute_advantages, with_kl_coef
from molt.driver.compose import Inputs, prepare
from molt.driver.metrics import add_token_record
from molt.driver.probe import probe_gap, probe_prompt, sample_probe
from molt.driver.run import Run, train_steps
from molt.driver.select import (
    context_warning,
    filter_decisions,
    filter_rollouts,
    group_ids,
    rollout_metrics,
    shaped_rewards,
    take_batch,
    turn_credit,
)
from molt.driver.throughput import throughput
from molt.inputs.vision import processor
from molt.plan.models import model_path
from molt.spec import AlgoSpec, RunSpec
from molt.trainer.batch import add_images, check_token_first, make_batch
from molt.trainer.ranks import TrainerRanks, Trainers
from molt.trajectory import NO_VERSION, Rollout, Segment, pad_routes

log = logging.getLogger("molt")

def train(spec: RunSpec, inputs: Inputs | None = None) -> dict[str, float]:
    """Run the whole training described by `spec` from its `inputs` (molt.driver.compose.prepare; built here
    when not given, refusing the first problem before anything starts); returns the last step's metrics."""
    inputs = (inputs or prepare(spec)).or_raise()

    async def main() -> dict[str, float]:
        run = await Run.start(spec, inputs)
        try:
            return await train_steps(run, rl_step)
        finally:
            await run.stop()
            if spec.logging.dump_rollouts and any((Path(spec.run.dir) / "rollouts").glob("step_*.jsonl")):
                from molt.driver.inspect import inspect_command

                print(f"molt: read the rollouts token by token: {inspect_command(spec.run.dir)}", flush=True)

    try:
        return asyncio.run(main())
    finally:
        gc.unfreeze()   # Run.start froze start-up's objects for this run: collectable again after it


async def rl_step(run: Run) -> dict[str, float]:
    """One step: a batch from the pool → learn → refit; advances the run and returns the step's metrics."""
    spec, fleet, t_step = run.spec, run.fleet, time.perf_counter()
    # Async mode: a probe of the current policy measures invariant 3 if the batch cannot, so the pool
    # need not wait for a group of it (one group's generation per step).
    groups, batch_metrics = await take_batch(run.pool, spec, need_current=run.probe is None)
    probe = await run.probe if run.probe else None
    fleet.dispatcher.check()   # no engine left (restarts used up): stop with a clear error
    rollouts, t_batch = [r for g in groups for r in g], time.perf_counter()
    live = [fleet.dispatcher.engines[i] for i in sorted(fleet.dispatcher.live)]
    warmup = run.step < spec.train.critic_warmup_steps   # the critic alone: the policy stays as it is
    record = None   # the trainer's side of the dump: why each rollout is trained or not, what the loss saw
    if spec.logging.dump_rollouts:
        record = {rollout_id: {"decision": why, "version": run.version}
                  for rollout_id, why in filter_decisions(spec, rollouts).items()}
    try:
        await fleet.sleep_if_colocated()   # the engine sleeps while the trainer steps on its GPU
        async with fleet.trainer:
            metrics = await learn(spec, rollouts, run.trainers, run.version,
                                  algo=with_kl_coef(spec.algo, run.kl_coef), engines=live,
                                  train_policy=not warmup, probe=probe, record=record)
    finally:   # after learn, so the dump carries the routes it captured; also when it fails
        run.logger.dump_rollouts(run.step + 1, rollouts, record)
        await fleet.wake_if_colocated()
    metrics.update(batch_metrics)
    if metrics["rollout/context_truncated"] and not run.context_warned:   # said once; the metric counts
        run.context_warned = True
        log.warning(context_warning(spec, rollouts))
    if spec.algo.kl.coef:
        metrics["kl/coef"] = run.kl_coef
    run.kl_coef = next_kl_coef(spec, run.kl_coef, metrics)
    metrics["time/refit"] = 0.0
    if not warmup:
        run.version += 1
        metrics["time/refit"] = await fleet.refit(run.version)
        metrics["refit/bytes"] = float(fleet.refit_bytes)
        run.pool.set_version(run.version)
        prompt = probe_prompt(rollouts) if spec.rollout.mode == "async" else None
        run.probe = asyncio.create_task(sample_probe(spec, fleet.dispatcher, prompt, run.version)) \
            if prompt else None
    run.step += 1
    pool_stats = await run.pool.stats()
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
        "trainer/restarts": float(run.trainer_restarts),
        "policy/version": run.version,
        **fleet.metrics(),
        **run.groups.metrics(),
        "tokens/per_s": metrics["tokens/sampled"] / step_time,
    })
    metrics.update(throughput(spec, metrics))   # per device and stage, as NeMo-RL reports it
    return metrics


async def learn(spec: RunSpec, rollouts: list[Rollout], trainers: Trainers, version: int, *,
                algo: AlgoSpec | None = None, engines: list | None = None, train_policy: bool = True,
                probe: Segment | None = None, record: dict[str, dict] | None = None) -> dict[str, float]:
    """One training step on finished rollouts (also how a dumped batch is replayed).

    `algo` is the step's (None: the spec's): the loop's carries the adaptive KL weight in algo.kl.coef. With
    `model.router_replay`, segments without routed experts get them from `engines` (`fill_routes`).
    `train_policy=False` trains only the critic (train.critic_warmup_steps). `probe` (async mode) is scored
    for invariant 3 when no trained token was sampled by `version`. `record` (the dump's, by rollout id)
    gets what the policy's loss saw of each token (logging.dump_trainer)."""
    policy, reference, critic, pad_id = trainers.policy, trainers.reference, trainers.critic, trainers.pad_id
    algo = algo or spec.algo
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
        batch["loss_mask"], algo, values=values, logp=old_logp, ref_logp=ref_logp, **per_turn)
    metrics.update({f"adv/{k}": float(v) for k, v in adv.metrics.items()})
    batch["advantages"] = adv.advantages
    if reference is not None:
        batch.update(old_logp=old_logp, ref_logp=ref_logp)

    t0 = time.perf_counter()
    trained = policy if train_policy else None
    metrics.update(await update(batch, trained, critic, values, adv.returns, algo,
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
                 values: torch.Tensor | None, returns: torch.Tensor | None, algo: AlgoSpec,
                 record: dict[str, dict] | None = None, segments: list[Segment] = ()) -> dict[str, float]:
    """The optimizer steps of the policy (None: critic warm-up) and the critic on `batch` with the step's
    `algo`; their metrics as the trainers name them (train/, critic/, the trainer/engine gap under
    mismatch/). `record` gets what the policy's loss saw of each token of `segments` (the batch's rows)
    under their rollout ids."""
    metrics: dict[str, float] = {}
    if policy is not None:
        metrics.update(await asyncio.to_thread(policy.update, batch, algo, record is not None))
        if record is not None:
            add_token_record(record, segments, await asyncio.to_thread(policy.token_record))
    else:
        metrics["train/critic_warmup"] = 1.0
    if critic is not None:
        critic_batch = dict(batch, old_values=values, returns=returns)
        metrics.update(await asyncio.to_thread(critic.update, critic_batch, algo))
    return metrics


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
