"""Throughput per device and stage, as NeMo-RL reports it: the step's tokens over the stage's seconds times
the devices the stage runs on,

    tokens/s/GPU = total tokens processed / (time for the stage x number of GPUs)

with the total tokens those of the trained batch (prompts, responses and observations: `tokens/total`), the
same for every stage. Stages: generation (sync: the wait for the batch; async: NeMo-RL's exposed
generation plus the logprob and training passes), logprobs (the reference / critic / pre-update policy
passes; logged only when the step ran one), training, and the whole step (e2e, over every device of the
run). A device is a GPU on cuda; on CPU each trainer rank and engine worker counts as one. With
`parallel.colocate` generation and training share the same devices.
"""

from __future__ import annotations

from molt.plan.placement import engine_groups, trainer_roles
from molt.spec import RunSpec


def stage_devices(spec: RunSpec) -> dict[str, int]:
    """Devices of each stage: `trainer` (every trainer role's ranks), `engines` (the policy's), `all`."""
    par = spec.parallel
    trainer = len(trainer_roles(spec)) * par.world_size
    groups = {role: count * per for role, count, per in engine_groups(spec)}
    if par.colocate:   # one GPU holds every role and the engine (a judge's engines keep their own)
        return {"trainer": par.world_size, "engines": par.world_size,
                "all": par.world_size + groups.get("judge", 0)}
    return {"trainer": trainer, "engines": groups.get("engine", 0), "all": trainer + sum(groups.values())}


def throughput(spec: RunSpec, metrics: dict[str, float]) -> dict[str, float]:
    """The `throughput/*_tokens_per_s_per_gpu` metrics of one step, from its `tokens/total` and `time/*`."""
    tokens, devices = metrics.get("tokens/total", 0.0), stage_devices(spec)
    train, logprobs = metrics.get("time/train", 0.0), metrics.get("time/logprobs", 0.0)
    generation = metrics["time/wait_batch"] + (logprobs + train if spec.rollout.mode == "async" else 0.0)
    stages = {"generation": (generation, devices["engines"]), "logprobs": (logprobs, devices["trainer"]),
              "training": (train, devices["trainer"]), "e2e": (metrics["time/step"], devices["all"])}
    return {f"throughput/{stage}_tokens_per_s_per_gpu": tokens / (seconds * n)
            for stage, (seconds, n) in stages.items() if tokens and seconds > 0 and n}
