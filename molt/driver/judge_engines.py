"""The LLM judge's engines (agent.judge): started by the driver, handed to the agent's judge as a sampler.

The judge (molt/agents/judge.py) only scores: it asks through whatever `Sampler` it is given. Starting its
vLLM engines is the same work as starting the policy's, so it lives here with the rest of the run's
start-up, and agents/ needs nothing of rollout/. The judge's engines are never refitted or restarted: the
fleet (molt/driver/fleet.py) owns only the policy's.
"""

from __future__ import annotations

import ray

from molt.agents.judge import Judge
from molt.plan.models import model_path
from molt.plan.placement import plan
from molt.rollout.dispatch import Dispatcher
from molt.rollout.engine import start_engines
from molt.spec import LoRASpec, RunSpec


def start_judge(spec: RunSpec, engines: list | None = None) -> Judge | None:
    """The judge a runner is set up with (`runner.setup(tokenizer, spec, judge)`): None without
    agent.judge.path; a client of agent.judge.url; else scoring on engines started here on the GPUs the
    plan gives them, which the judge's `shutdown` (the runner's `close`) stops. `engines`: judge engines
    another process started (an agent worker scores on the driver's), used as they are and never stopped."""
    settings = spec.agent.judge
    if not settings.path:
        return None
    if settings.url:
        return Judge.start(spec)
    if engines:
        return Judge.start(spec, Dispatcher(list(engines)))
    path = model_path(spec) if settings.path == "policy" else settings.path
    # The judge scores while the policy's engines generate: one thread each unless parallel.cpu_threads
    # says otherwise, rather than a second claim on every core.
    threads = spec.parallel.cpu_threads or 1
    # The judge is never refitted: it serves its model as is, without the policy's LoRA adapters, and
    # nothing trains on its tokens, so it captures no MoE routes for replay (a dense judge has none).
    model = spec.model.model_copy(update={"lora": LoRASpec(), "router_replay": False})
    rollout = spec.rollout.model_copy(update={"engine": settings.engine})
    started = start_engines(spec, path, [s for s in plan(spec) if s.role == "judge"], rollout, model, threads)
    try:
        return Judge.start(spec, Dispatcher(started), on_close=lambda: stop_engines(started))
    except BaseException:
        stop_engines(started)
        raise


def stop_engines(engines: list) -> None:
    for engine in engines:
        ray.get(engine.shutdown.remote())
        ray.kill(engine)


def judge_engines(judge: Judge | None) -> list:
    """The engine actors a judge from `start_judge` scores on, to share with agent workers ([] for none
    or a judge at agent.judge.url)."""
    return list(judge.sampler.engines) if judge is not None and judge.sampler is not None else []
