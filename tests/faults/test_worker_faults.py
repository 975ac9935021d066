"""A killed agent worker (`agent.workers`): SIGKILLed mid-run, as an OOM kill would, while it runs groups.
Its groups rerun whole on the other worker (a new one takes its slot), the run finishes, and every group
is trained exactly once: no group id twice, none short of its samples, the data position exact."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import psutil
import pytest
from faultlib import small_spec

from molt.driver.metrics import load_rollouts

# One second per rollout: the kill lands while the worker's groups are in flight. Each execution of the
# module (an import) appends its process id beside it: once per process, in the driver and in each worker.
SLOW_ENV = '''
import asyncio
import os

with open(__file__ + ".executions", "a") as f:
    f.write(f"{os.getpid()}\\n")

from molt.agents import Env, Result, StepEnvRunner


class SlowRepeat(Env):
    async def step(self, state):
        await asyncio.sleep(self.options.get("sleep", 1.0))
        done = state.turn + 1 >= self.options.get("turns", 1)
        return Result(reward=float(str(state.label) in state.action), terminated=done,
                      observation=None if done else "again")


AgentRunner = StepEnvRunner(SlowRepeat)
'''


def actor_pids(cls: str = "AgentWorker") -> list[int]:
    """Pids of this test process's actors of class `cls` (Ray sets their process title)."""
    pids = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.cmdline()[:1] and child.cmdline()[0].startswith(f"ray::{cls}"):
                pids.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return pids


def worker_pids() -> list[int]:
    return actor_pids("AgentWorker")


def kill_during_step_2(run_dir, pids) -> list[int]:
    """Starts a thread that SIGKILLs the first of `pids()` 0.3 s after step 1 is logged; returns the list
    it appends the killed pid to."""
    killed: list[int] = []

    def kill() -> None:
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and '"step": 1' in metrics.read_text()):
            time.sleep(0.05)
        time.sleep(0.3)   # step 2's groups are sleeping in their Env
        pid = pids()[0]
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    threading.Thread(target=kill, daemon=True).start()
    return killed


def check_every_group_trained_once(run_dir, steps: int, prompts: int) -> list[dict]:
    """Each step trained `prompts` whole groups of 4, none failed, no group id twice; the data position is
    exactly steps x prompts. Returns the metrics records."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all(r["rollout/count"] == prompts * 4 and r["rollout/failed"] == 0 for r in records)
    groups = [r.group_id for step in range(1, steps + 1)
              for r in load_rollouts(run_dir / "rollouts" / f"step_{step:06d}.jsonl")]
    assert len(set(groups)) == steps * prompts and all(groups.count(g) == 4 for g in set(groups))
    meta = json.loads((run_dir / "checkpoints" / f"step_{steps:06d}" / "meta.json").read_text())
    assert meta["data"]["index"] == steps * prompts and meta["pending"] == []
    return records


def run_spec(module, run_dir, agent: dict, **sections):
    return small_spec({"module": str(module), "workers": 2, **agent}, run={"dir": str(run_dir)},
                      train={"steps": 3, "prompts_per_step": 4}, rollout={"engine": {"kv_cache_gib": 0.1}},
                      logging={"plots": False, "progress": False, "wandb": {"mode": "disabled"}}, **sections)


def test_a_killed_agent_worker_loses_only_its_groups(ray_session, tmp_path, capfd):
    from molt.driver.loop import train

    module = tmp_path / "slow_env.py"
    module.write_text(SLOW_ENV)
    run_dir = tmp_path / "run"
    spec = run_spec(module, run_dir, {"max_worker_restarts": 1})
    others = set(worker_pids())
    killed = kill_during_step_2(run_dir, lambda: sorted(set(worker_pids()) - others))
    last = train(spec)
    assert killed and last["agent/worker_restarts"] == 1.0 and last["agent/groups_rerun"] >= 1
    assert "agent worker" in capfd.readouterr().out
    check_every_group_trained_once(run_dir, 3, 4)
    # the agent module executed once per process: the driver's (this one), two workers and the replacement
    pids = [int(p) for p in (tmp_path / "slow_env.py.executions").read_text().split()]
    assert len(pids) == len(set(pids)) == 4 and os.getpid() in pids and killed[0] in pids
    deadline = time.time() + 30   # the replacement worker was stopped with the run
    while set(worker_pids()) - others and time.time() < deadline:
        time.sleep(0.2)
    assert not set(worker_pids()) - others


@pytest.mark.slow
def test_an_engine_killed_under_agent_workers_is_restarted_and_its_groups_rerun(ray_session, tmp_path):
    """The engine's process SIGKILLed while the workers' 3-turn rollouts sleep between turns: a worker sees
    the death, the driver's fleet restarts the engine and hands it to the workers, the groups on it rerun
    whole (pool/engine_requeued), and the run finishes with every group trained once."""
    from molt.driver.loop import train

    module = tmp_path / "slow_env.py"
    module.write_text(SLOW_ENV)
    run_dir = tmp_path / "run"
    # a rollout waits while its engine restarts (tens of seconds on a loaded machine)
    spec = run_spec(module, run_dir, {"options": {"turns": 3, "sleep": 0.5}, "max_turns": 3,
                                      "max_total_tokens": 4096, "timeout_s": 300.0})
    others = set(actor_pids("EngineActor"))
    killed = kill_during_step_2(run_dir, lambda: sorted(set(actor_pids("EngineActor")) - others))
    last = train(spec)
    assert killed and last["engine/restarts"] == 1.0 and last["engine/live"] == 1.0
    records = check_every_group_trained_once(run_dir, 3, 4)
    assert max(r["pool/engine_requeued"] for r in records) >= 1


def test_a_worker_death_past_max_worker_restarts_stops_the_run(ray_session, tmp_path, engine,
                                                              tiny_model_path):
    """agent.max_worker_restarts=0: the first worker death fails the group's call with a message naming
    the key (the pool hands it to the loop, which stops)."""
    import asyncio

    from molt.driver.agent_workers import AgentWorkers
    from molt.rollout.dispatch import Dispatcher

    module = tmp_path / "slow_env.py"
    module.write_text(SLOW_ENV)
    spec = small_spec({"module": str(module), "workers": 1, "max_worker_restarts": 0})
    workers = AgentWorkers(spec, tiny_model_path, Dispatcher([engine]))
    try:
        [pid] = workers.ready()

        async def kill_mid_group() -> None:
            group = asyncio.ensure_future(workers.run_group({"prompt": "a", "label": "a"}, "g0"))
            await asyncio.sleep(0.5)   # its rollouts sleep in their Env for 1 s
            os.kill(pid, signal.SIGKILL)
            await group

        with pytest.raises(RuntimeError, match=r"agent workers died 1 times, above "
                                               r"agent.max_worker_restarts=0; last: worker 0: "):
            asyncio.run(kill_mid_group())
    finally:
        workers.close()
