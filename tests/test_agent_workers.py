"""Agent workers (`agent.workers`): groups run in Ray actors sample what the driver's loop samples, the eval
sets' rollouts run there too (a run's evaluation and `python -m molt.eval`) and score what the driver's
evaluation scores, workers are placed by the plan and their cores checked (molt.eval's too). The killed
worker of a real run: faults/test_agent_faults.py.
"""

from __future__ import annotations

import asyncio

import pytest
import ray
from test_agents import EXAMPLES, make_spec

from molt.agents import load_agent_runner
from molt.driver.agent_workers import AgentWorkers
from molt.driver.compose import Inputs
from molt.driver.eval import ROLES, evaluate_on
from molt.driver.judge_engines import judge_engines, start_judge
from molt.driver.select import agent_metrics
from molt.rollout.dispatch import Dispatcher
from molt.rollout.sampling import TrainingSampler
from molt.spec import RunSpec

ROWS = [{"prompt": "Repeat this letter 3 times: a", "label": "a"},
        {"prompt": "Repeat this letter 3 times: q", "label": "q"}]


VERSION = 3   # the policy version the groups are sampled at: it keys every request's seed


def in_process(tok, spec: RunSpec, engine, judge=None) -> list[list]:
    """The groups as the loop runs them without workers: the runner in this loop, all groups at once."""
    runner = load_agent_runner(spec.agent)
    runner.setup(tok, spec, judge)
    sampler = TrainingSampler(Dispatcher([engine]), spec.run.seed, lambda: VERSION)
    n = spec.rollout.samples_per_prompt

    async def group(k: int, row: dict) -> list:
        return await asyncio.gather(*[runner.run(row, f"g{k}-{i}", f"g{k}", sampler) for i in range(n)])

    async def groups() -> list[list]:
        return await asyncio.gather(*[group(k, row) for k, row in enumerate(ROWS)])
    try:
        return asyncio.run(groups())
    finally:
        runner.close()   # a judge on the caller's engines leaves them running


def count_requests(worker) -> None:
    """From now on the worker counts the requests its training sampler sends (`requests`)."""
    def install(self) -> None:
        generate, self.requests = self.sampler.generate, 0

        async def counted(*args, **kwargs):
            self.requests += 1
            return await generate(*args, **kwargs)
        self.sampler.generate = counted
    ray.get(worker.__ray_call__.remote(install))


def on_workers(spec: RunSpec, path: str, engine, judge=None) -> tuple[list[list], list[int], list[int]]:
    """The groups run on the workers at policy version VERSION, all at once (so each worker gets one);
    also the workers' pids and the requests each one's training sampler sent."""
    workers = AgentWorkers(spec, path, Dispatcher([engine]), judge_engines(judge))
    try:
        pids = workers.ready()
        if judge is not None:   # the worker's judge scores on the driver's judge engines, not its own
            ids = ray.get(workers.workers[0].__ray_call__.remote(
                lambda self: [e._actor_id for e in self.runner.judge.sampler.engines]))
            assert ids == [e._actor_id for e in judge_engines(judge)]
        workers.set_version(VERSION)
        for worker in workers.workers:
            count_requests(worker)

        async def groups() -> list[list]:
            return await asyncio.gather(*[workers.run_group(row, f"g{k}") for k, row in enumerate(ROWS)])
        out = asyncio.run(groups())
        requests = [ray.get(w.__ray_call__.remote(lambda self: self.requests)) for w in workers.workers]
        return out, pids, requests
    finally:
        workers.close()


@pytest.mark.parametrize("agent", [{"module": str(EXAMPLES / "repeat.py")},
                                   {"module": str(EXAMPLES / "chat_minimal.py"),
                                    "options": {"turns": 2}, "max_turns": 2}], ids=["env", "chat"])
def test_workers_sample_the_tokens_the_driver_loop_samples(ray_session, tok, tiny_model_path, engine, agent):
    """Both paths seed each request from the run seed, the policy version (3, which the pool forwards to the
    workers) and the rollout id: the same ids, logprobs, rewards, with the two groups run at once on the
    same engine, on the workers one each, in two worker processes of their own (so a worker seeded
    otherwise, or left at version 0, samples other tokens)."""
    import os

    spec = make_spec({**agent, "workers": 2}, samples_per_prompt=2)
    mine = in_process(tok, spec, engine)
    theirs, pids, requests = on_workers(spec, tiny_model_path, engine)
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert all(requests), requests   # both workers sampled
    assert_same(mine, theirs)


def assert_same(mine: list[list], theirs: list[list]) -> None:
    for a_group, b_group in zip(mine, theirs, strict=True):
        for a, b in zip(a_group, b_group, strict=True):
            assert a.ok and b.ok and (a.rollout_id, a.reward) == (b.rollout_id, b.reward)
            assert [s.token_ids for s in a.segments] == [s.token_ids for s in b.segments]
            assert [s.logprobs for s in a.segments] == [s.logprobs for s in b.segments]
            assert [s.loss_mask for s in a.segments] == [s.loss_mask for s in b.segments]


PID_ENV = """
import os

from molt.agents import Env, Result, State, StepEnvRunner


class PidEnv(Env):
    # a reward of the sampled ids alone; each step notes the process the agent's code ran in
    async def step(self, state: State) -> Result:
        with open(self.options["pids"], "a") as out:
            out.write(f"{os.getpid()}\\n")
        return Result(reward=sum(state.action_ids) % 5 / 4)


AgentRunner = StepEnvRunner(PidEnv)
"""


def test_evaluation_runs_on_the_workers_and_scores_what_the_driver_scores(ray_session, tiny_model_path,
                                                                          tok, engine, tmp_path):
    """`python -m molt.eval` (`evaluate_on`, the run's `evaluate` on the agent workers it starts): with
    agent.workers the eval sets' rollouts run in the worker, the agent's code never in this process, and,
    greedy, score what the agent in this process does."""
    import os

    (tmp_path / "pid_env.py").write_text(PID_ENV)
    pids = tmp_path / "pids"
    sets = {"a": ROWS, "b": [{"prompt": "Repeat this letter 3 times: z", "label": "z"}]}
    metrics, ran = {}, {}
    for workers in (0, 1):
        spec = make_spec({"module": str(tmp_path / "pid_env.py"), "options": {"pids": str(pids)},
                          "workers": workers}, eval={"n": 2, "temperature": 0.0})
        inputs = Inputs(policy_path=tiny_model_path, tokenizer=tok, runner=load_agent_runner(spec.agent),
                        eval_sets=sets)
        metrics[workers] = evaluate_on(spec, inputs, [engine])
        ran[workers] = [int(line) for line in pids.read_text().split()]
        pids.unlink()
    assert ran[0] == [os.getpid()] * 6 and len(ran[1]) == 6 and len(set(ran[1])) == 1
    assert ran[1][0] != os.getpid()
    assert metrics[1] == metrics[0] and set(metrics[0]) == {
        f"eval/{name}/{k}" for name in sets
        for k in ("mean@2", "pass@1", "pass@2", "failed", *agent_metrics([]))}


def test_molt_eval_refuses_workers_the_cluster_cannot_hold(ray_session, tiny_model_path):
    """molt.eval checks the nodes' cores against the plan's engines and workers (no trainer) before any
    actor starts: the session's Ray has 16 CPUs, 16 workers and an engine need 16.01."""
    from molt.driver.eval import main

    with pytest.raises(RuntimeError, match=r"node 0 \(.*\): the plan puts 16.01 CPU there, the node has 16"):
        main([f"model.path={tiny_model_path}", "agent.workers=16",
              f"data.eval=[{EXAMPLES.parent / 'data' / 'math_eval.jsonl'}]"])


def test_a_worker_judges_with_the_drivers_judge_engines(ray_session, tok, tiny_model_path, engine):
    """agent.judge: the worker scores through the judge engines the driver started (here the session's
    engine stands in for them), not a second set; the judged rewards equal the driver loop's, and closing
    the worker leaves those engines to the driver."""
    spec = make_spec({"module": str(EXAMPLES / "judge_env.py"), "workers": 1,
                      "judge": {"path": tiny_model_path, "temperature": 0.5}}, max_tokens=16,
                     samples_per_prompt=2)
    judge = start_judge(spec, [engine])
    mine = in_process(tok, spec, engine, judge)
    theirs, _, _ = on_workers(spec, tiny_model_path, engine, judge)
    assert_same(mine, theirs)
    assert all(0.0 < r.reward < 1.0 for g in theirs for r in g)
    assert ray.get(engine.stats.remote())["version"] == 0   # still serving


def test_workers_are_planned_on_the_generating_nodes_and_shown():
    from molt.driver.launch import describe_plan
    from molt.plan.placement import plan

    spec = RunSpec.model_validate({"agent": {"workers": 3}, "parallel": {
        "device": "cuda", "nodes": 3, "gpus_per_node": 8, "trainer_nodes": 1, "dp_size": 8},
        "rollout": {"engine": {"num_engines": 16}}})
    assert [s.node for s in plan(spec) if s.role == "agent"] == [1, 1, 2]
    assert all(s.gpus == 0 for s in plan(spec) if s.role == "agent")
    text = describe_plan(spec)
    assert "placement: node 1: engines 0-7, agent workers 0-1 | 8/8 GPUs\n" in text
    assert "placement: node 2: engines 8-15, agent worker 2 | 8/8 GPUs\n" in text
    assert "agent workers: 3 x 1 CPU core, no GPU" in text and "agent rank" not in text
    assert "agent worker" not in describe_plan(RunSpec())


def test_ray_workers_run_at_the_drivers_priority(ray_session):
    """Ray's default starts workers at nice 15: beside two busy processes an SFT step took 16 s instead of
    0.5 s (bench/RESULTS.md `busy_host`). The local Ray of a run (and of these tests) runs them at nice 0."""
    import os

    @ray.remote(num_cpus=0)
    def niceness() -> int:
        return os.nice(0)

    assert ray.get(niceness.remote()) == os.nice(0) == 0


def test_workers_that_do_not_fit_a_nodes_cores_are_refused(monkeypatch):
    import molt.plan.placement as placement

    node = {"NodeManagerAddress": "10.0.0.1", "NodeID": "ab" * 28, "Alive": True,
            "Resources": {"CPU": 4.0}}
    monkeypatch.setattr(placement, "cluster_nodes", lambda spec: [node])
    placement.bind(RunSpec.model_validate({"agent": {"workers": 2}}))   # 1 rank + 2 workers + an engine
    with pytest.raises(RuntimeError, match=r"node 0 \(10.0.0.1, abababab\): the plan puts 5.01 CPU there, "
                                           r"the node has 4"):
        placement.bind(RunSpec.model_validate({"agent": {"workers": 4}}))
    # molt.eval starts no trainer rank: 3 workers fit there, 4 do not
    placement.bind(RunSpec.model_validate({"agent": {"workers": 3}}), ROLES)
    with pytest.raises(RuntimeError, match=r"the plan puts 4.01 CPU there, the node has 4"):
        placement.bind(RunSpec.model_validate({"agent": {"workers": 4}}), ROLES)


@pytest.mark.slow
def test_a_run_on_agent_workers_learns_what_the_driver_loop_learns(ray_session, tmp_path):
    """The learning check: 3 steps of the default task with agent.workers=2 and without, same seed. Every
    step trains the same tokens (the rollout dumps) to the same rewards and the same loss: the workers
    change where rollouts run, not what is trained."""
    import json
    import sys

    from molt.driver.loop import train
    from molt.driver.metrics import load_rollouts

    sys.path.insert(0, str(EXAMPLES.parents[1] / "tests" / "faults"))
    from faultlib import small_spec

    runs = {}
    for workers in (0, 2):
        run_dir = tmp_path / f"w{workers}"
        train(small_spec({"workers": workers}, run={"dir": str(run_dir)}, parallel={"cpu_threads": 1},
                         train={"steps": 3, "prompts_per_step": 4}, rollout={"engine": {"kv_cache_gib": 0.1}},
                         logging={"plots": False, "progress": False, "wandb": {"mode": "disabled"}}))
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        dumps = [sorted((r.rollout_id, [s.token_ids for s in r.segments], r.reward)
                        for r in load_rollouts(run_dir / "rollouts" / f"step_{k:06d}.jsonl"))
                 for k in (1, 2, 3)]
        runs[workers] = records, dumps
    (mine, mine_dumps), (theirs, their_dumps) = runs[0], runs[2]
    assert mine_dumps == their_dumps
    for a, b in zip(mine, theirs, strict=True):
        assert a["reward/mean"] == b["reward/mean"]
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-6)
