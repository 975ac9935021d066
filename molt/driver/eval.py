"""Evaluation on the eval sets of `data.eval` with `rollout.eval` sampling, in the loop and on its own.

Each prompt gets `rollout.eval.n` samples through the run's agent, whose sampling defaults are
`rollout.eval`'s in place of training's (a turn may still override them; agent.max_total_tokens caps
each turn's max_tokens as in training). Per set NAME (a file's stem):
`eval/NAME/mean@n` is the mean reward over all samples, and `eval/NAME/pass@k` (k = 1, 2, 4, ... and n)
the unbiased estimate of the chance that k samples hold a correct one (a reward of at least
rollout.eval.pass_reward, 1 by default), from the c correct of n: 1 - C(n-c, k) / C(n, k) (Chen et al.,
2021). A failed rollout scores 0. What the agent did, as training logs it (molt.driver.select.agent_metrics):
`eval/NAME/agent/*` and `eval/NAME/info/KEY` over the set's rollouts that did not fail, and
`eval/NAME/failed`, how many failed. With agent.workers > 0 the
rollouts run on the agent workers (a prompt's n samples as one group), here as in a run.

    python -m molt.eval [+experiment=NAME] [key=value ...] model.path=PATH

evaluates a Hugging Face folder, or a checkpoint folder (RUN/checkpoints/step_N, exported to its hf/
first), on the composed spec's eval sets and prints the metrics as JSON.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from typing import Any

import torch

from molt.driver.select import agent_metrics
from molt.spec import RunSpec, pass_ks


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def set_metrics(name: str, rewards: torch.Tensor, pass_reward: float) -> dict[str, float]:
    """mean@n and pass@k (k = powers of two up to n, and n) of one set's rewards [prompts, n]; a sample
    with a reward >= `pass_reward` is correct."""
    n = rewards.shape[1]
    correct = (rewards >= pass_reward).sum(dim=1).tolist()
    out = {f"eval/{name}/mean@{n}": float(rewards.mean())}
    for k in pass_ks(n):   # the spec checks train.best_metric against these
        out[f"eval/{name}/pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / len(correct)
    return out


async def evaluate(spec: RunSpec, groups: Any, eval_sets: dict[str, Any], step: int) -> dict[str, float]:
    """Every set's metrics; all prompts of all sets are in flight at once, each prompt's n samples as one
    group of `groups` (molt.driver.agent_workers: in this process, or on the agent workers, so that the
    agent's code never runs in the driver when the run has workers)."""
    e = spec.rollout.eval
    # rollout.eval is the agent's default sampling here, where training's would be (what State /
    # ChatContext.sampling_params report and the chat server starts from), so per-turn overrides and the
    # agent.max_total_tokens cap still apply; training rollouts in flight on the same runner keep theirs.
    sampling = e.request()
    jobs = [(name, i, item) for name, items in eval_sets.items() for i, item in enumerate(items)]
    done = await asyncio.gather(*[groups.run_group(item, f"eval{step}-{name}-{i}", e.n, sampling)
                                  for name, i, item in jobs])
    results = [r for group in done for r in group]
    rewards = torch.tensor([r.reward if r.ok else 0.0 for r in results]).view(len(jobs), e.n)
    metrics, start = {}, 0
    for name, items in eval_sets.items():
        metrics.update(set_metrics(name, rewards[start:start + len(items)], e.pass_reward))
        ran = results[start * e.n:(start + len(items)) * e.n]
        metrics[f"eval/{name}/failed"] = float(sum(not r.ok for r in ran))
        metrics |= {f"eval/{name}/{k}": v for k, v in agent_metrics([r for r in ran if r.ok]).items()}
        start += len(items)
    return metrics


# What `python -m molt.eval` starts of a run's plan: no trainer, so only these roles' cores and GPUs count.
ROLES = ("engine", "judge", "agent")


def evaluate_model(spec: RunSpec) -> dict[str, float]:
    """Start engines on model.path (a checkpoint folder is exported first) and evaluate every set."""
    import ray

    from molt.driver.compose import prepare
    from molt.driver.export import as_hf_folder
    from molt.driver.judge_engines import stop_engines
    from molt.plan.placement import bind, init_ray
    from molt.rollout.engine import start_engines

    if spec.model.path is not None:
        spec.model.path = as_hf_folder(spec.model.path)
    inputs = prepare(spec, train=False).or_raise()   # the agent and eval sets, built once, before a start
    if not inputs.eval_sets:
        raise ValueError("data.eval is empty: nothing to evaluate")
    own_ray = not ray.is_initialized()   # a caller's Ray (a notebook, a test session) is left running
    if own_ray:
        init_ray(spec)
    try:
        bind(spec, ROLES)   # the nodes hold the engines and agent workers the plan puts there, as for a run
        engines = start_engines(spec, inputs.policy_path)
        try:
            return evaluate_on(spec, inputs, engines)
        finally:
            stop_engines(engines)
    finally:
        if own_ray:
            ray.shutdown()


def evaluate_on(spec: RunSpec, inputs: Any, engines: list) -> dict[str, float]:
    """Every eval set's metrics on `engines` (serving the model at `inputs.policy_path`), the agent
    (`inputs.runner`, not set up yet; closed here) set up as for a run: in this process, or on
    `agent.workers` workers."""
    from molt.driver.agent_workers import LocalAgents, start_agent_workers
    from molt.driver.judge_engines import judge_engines, start_judge
    from molt.rollout.dispatch import Dispatcher

    runner = inputs.runner

    async def run() -> dict[str, float]:
        dispatcher = Dispatcher(engines)
        workers = await start_agent_workers(spec, inputs.policy_path, dispatcher, judge_engines(judge))
        try:   # with workers the agent's code never runs here: this process sets no runner up
            return await evaluate(spec, workers or LocalAgents(spec, runner, dispatcher), inputs.eval_sets, 0)
        finally:
            if workers:
                workers.close()

    judge = start_judge(spec)   # its engines start in the caller's Ray; close() stops them
    try:
        if not spec.agent.workers:
            runner.setup(inputs.tokenizer, spec, judge)
        return asyncio.run(run())
    finally:
        if judge is not None:   # also when the runner's set-up failed before it took the judge
            judge.shutdown()
        runner.close()


def main(argv: list[str] | None = None) -> None:
    from molt.driver.compose import compose
    from molt.spec import SpecError

    overrides = sys.argv[1:] if argv is None else argv
    try:
        spec = compose(overrides)
        metrics = evaluate_model(spec)
    except (SpecError, OSError, ImportError, KeyError, ValueError) as err:
        sys.exit(f"molt.eval: {err}")
    print(json.dumps(metrics, indent=1))
