"""Run spec → placement plan → the loop. The only place that turns config into running actors."""

from __future__ import annotations

import logging
import os

from molt.driver.compose import Inputs, prepare, warnings
from molt.spec import RunSpec, spec_warnings

log = logging.getLogger("molt")


def describe_plan(spec: RunSpec, nodes: list[dict] | None = None, agent_kind: str | None = None) -> str:
    """What the launcher places where, in words (printed by `run.dry_run=true` and at every start);
    `nodes` (the bound Ray nodes) adds each plan node's address, `agent_kind` (the runner's) the agent's."""
    from molt.plan import memory
    from molt.plan.placement import describe

    p, e = spec.parallel, spec.rollout.engine
    unit = "GPU" if p.device == "cuda" else "CPU process"
    where = f"attach to Ray at {spec.ray.address}" if spec.ray.address else "start Ray locally"
    names = [f"{n['NodeManagerAddress']} {n['NodeID'][:8]}" for n in nodes] if nodes else None
    # AutoModel's parallelizer returns a single rank's model as it is: FSDP2 shards only from two ranks on
    sharding = "FSDP2" if p.world_size > 1 else "unsharded (one rank: no FSDP2)"
    lines = [
        f"run '{spec.run.name}' -> {spec.run.dir or '(dry run: no run directory)'}",
        f"ray: {where}",
        f"engines: {e.num_engines} x vLLM (tp={e.tp_size}, expert_parallel={e.enable_expert_parallel}) = "
        f"{e.num_engines * e.tp_size} {unit}(s)",
        f"policy trainer: {p.world_size} rank(s) [dp={p.dp_size} cp={p.cp_size} tp={p.tp_size} "
        f"ep={p.ep_size}] {sharding} on {p.device}, offload={p.offload}",
    ]
    if spec.model.critic:
        lines.append(f"critic: {p.world_size} rank(s), same layout")
    if spec.model.reference:
        lines.append(f"reference: {p.world_size} rank(s), frozen ({spec.model.reference})")
    lines += [f"placement: {line}" for line in describe(spec, names)]
    lines.append(f"data: train {spec.data.train_path}; eval {', '.join(map(str, spec.data.eval)) or 'none'}")
    lines += [f"memory: {line}" for line in memory.describe(spec)]
    if spec.train.objective == "sft":
        lines[2] = "engines: none (train.objective=sft samples nothing)"
        return "\n".join([*lines, f"sft: {spec.train.steps} steps x {spec.train.prompts_per_step} "
                                   "conversations"])
    lines += [
        f"agent: {agent_kind + ' from ' if agent_kind else ''}{spec.agent.module}",
        f"loop: {spec.rollout.mode}, {spec.train.steps} steps x {spec.train.prompts_per_step} prompts x "
        f"{spec.rollout.samples_per_prompt} samples, estimator={spec.algo.estimator}",
    ]
    return "\n".join(lines)


def dry_run(spec: RunSpec) -> tuple[str, list[Exception]]:
    """`run.dry_run=true`: log the warnings, build the inputs as a run would (`prepare`) and return the plan
    with what the inputs showed (the agent's kind, the context each set leaves), and every problem found;
    writes nothing (`python -m molt` answers a dry run without Hydra's app, which creates the run folder)."""
    for warning in spec_warnings(spec) + warnings(spec):
        log.warning(warning)
    inputs = prepare(spec)
    kind = inputs.runner.kind if inputs.runner is not None else None
    return "\n".join([describe_plan(spec, agent_kind=kind), *inputs.notes]), inputs.problems


def launch(spec: RunSpec, inputs: Inputs) -> dict[str, float]:
    """Place everything and run the loop from `inputs` (checked: `prepare` found no problem). Returns the
    last step's metrics."""
    for warning in spec_warnings(spec) + warnings(spec):
        log.warning(warning)  # console and the run directory's log file
    if spec.run.dry_run:
        print(describe_plan(spec, agent_kind=inputs.runner.kind if inputs.runner else None))
        return {}
    import ray

    from molt.driver.loop import train as train_rl
    from molt.driver.sft_loop import train as train_sft
    from molt.plan.placement import bind, init_ray

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    init_ray(spec)
    try:
        kind = inputs.runner.kind if inputs.runner else None
        print(describe_plan(spec, bind(spec), kind))   # the cluster holds the plan: actors may start
        return (train_sft if spec.train.objective == "sft" else train_rl)(spec, inputs)
    finally:
        ray.shutdown()
