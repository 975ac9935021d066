"""Run spec → placement plan → the loop. The only place that turns config into running actors."""

from __future__ import annotations

import os

from molt.spec import RunSpec


def describe_plan(spec: RunSpec) -> str:
    """What the launcher places where, in words (printed by `run.dry_run=true`)."""
    p, e = spec.parallel, spec.rollout.engine
    unit = "GPU" if p.device == "cuda" else "CPU process"
    where = f"attach to Ray at {spec.ray.address}" if spec.ray.address else "start Ray locally"
    lines = [
        f"run '{spec.run.name}' -> {spec.run.dir}",
        f"ray: {where}",
        f"engines: {e.num_engines} x vLLM (tp={e.tp_size}, dp={e.dp_size}, expert_parallel="
        f"{e.enable_expert_parallel}) = {e.num_engines * e.tp_size * e.dp_size} {unit}(s)",
        f"policy trainer: {p.world_size} rank(s) [dp={p.dp_size} tp={p.tp_size} cp={p.cp_size} "
        f"ep={p.ep_size}] FSDP2 on {p.device}, offload_optimizer={p.offload_optimizer}",
    ]
    if spec.model.critic:
        lines.append(f"critic: {p.world_size} rank(s), same layout")
    if spec.model.reference:
        lines.append(f"reference: {p.world_size} rank(s), frozen ({spec.model.reference})")
    lines += [
        f"agent: {spec.agent.kind} from {spec.agent.module}",
        f"loop: {spec.rollout.mode}, {spec.train.steps} steps x {spec.train.prompts_per_step} prompts x "
        f"{spec.rollout.samples_per_prompt} samples, estimator={spec.algo.estimator}",
    ]
    return "\n".join(lines)


def init_ray(spec: RunSpec) -> None:
    """Attach to `ray.address`, or start Ray on this machine.

    Locally on CPU, Ray is told there are more logical CPUs than cores: engines, trainer ranks and the
    driver time-share the cores anyway (one thread each), and a 2-core laptop must still place them.
    """
    import ray

    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false"}
    if spec.ray.address:
        ray.init(address=spec.ray.address, runtime_env={"env_vars": env})
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local cluster; nothing else joins it
    env["RAY_AUTH_MODE"] = os.environ["RAY_AUTH_MODE"]
    cpus = spec.ray.num_cpus or (max(16, os.cpu_count() or 1) if spec.parallel.device == "cpu" else None)
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})


def launch(spec: RunSpec) -> dict[str, float]:
    """Validate-time checks done; place everything and run the loop. Returns the last step's metrics."""
    print(describe_plan(spec))
    if spec.run.dry_run:
        return {}
    import ray

    from molt.loop import train

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    init_ray(spec)
    try:
        return train(spec)
    finally:
        ray.shutdown()
