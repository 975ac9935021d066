"""Run spec → placement plan → the loop. The only place that turns config into running actors."""

from __future__ import annotations

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


def launch(spec: RunSpec) -> None:
    print(describe_plan(spec))
    if spec.run.dry_run:
        return
    raise SystemExit("molt: the training loop has not landed yet; the spec above is valid (run.dry_run=true "
                     "prints this plan without this message)")
