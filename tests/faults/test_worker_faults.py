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
from faultlib import small_spec

from molt.metrics import load_rollouts

# One second per rollout: the kill lands while the worker's groups are in flight.
SLOW_ENV = '''
import asyncio

from molt.agents import Env, Result, StepEnvRunner


class SlowRepeat(Env):
    async def step(self, state):
        await asyncio.sleep(1.0)
        return Result(reward=float(str(state.label) in state.action))


AgentRunner = StepEnvRunner(SlowRepeat)
'''


def worker_pids() -> list[int]:
    """Pids of this test process's agent worker actors (Ray sets their process title)."""
    pids = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.cmdline()[:1] and child.cmdline()[0].startswith("ray::AgentWorker"):
                pids.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return pids


def test_a_killed_agent_worker_loses_only_its_groups(ray_session, tmp_path, capfd):
    from molt.loop import train

    module = tmp_path / "slow_env.py"
    module.write_text(SLOW_ENV)
    steps, prompts = 3, 4
    spec = small_spec({"module": str(module), "workers": 2, "max_worker_restarts": 1},
                      run={"dir": str(tmp_path / "run")}, train={"steps": steps, "prompts_per_step": prompts},
                      rollout={"engine": {"kv_cache_gib": 0.1}},
                      logging={"plots": False, "progress": False, "wandb": {"mode": "disabled"}})
    others, killed = set(worker_pids()), []

    def kill_a_worker_during_step_2() -> None:
        metrics = tmp_path / "run" / "metrics.jsonl"
        while not (metrics.exists() and '"step": 1' in metrics.read_text()):
            time.sleep(0.05)
        time.sleep(0.3)   # step 2's groups are sleeping in their Env
        pid = sorted(set(worker_pids()) - others)[0]
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    threading.Thread(target=kill_a_worker_during_step_2, daemon=True).start()
    last = train(spec)
    assert killed and last["agent/worker_restarts"] == 1.0 and last["agent/groups_rerun"] >= 1
    assert "agent worker" in capfd.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["rollout/count"] == prompts * 4 and r["rollout/failed"] == 0 for r in records)
    groups = [r.group_id for step in range(1, steps + 1)
              for r in load_rollouts(tmp_path / "run" / "rollouts" / f"step_{step:06d}.jsonl")]
    assert len(set(groups)) == steps * prompts and all(groups.count(g) == 4 for g in set(groups))
    meta = json.loads((tmp_path / "run" / "checkpoints" / f"step_{steps:06d}" / "meta.json").read_text())
    assert meta["data"]["index"] == steps * prompts and meta["pending"] == []
    deadline = time.time() + 30   # the replacement worker was stopped with the run
    while set(worker_pids()) - others and time.time() < deadline:
        time.sleep(0.2)
    assert not set(worker_pids()) - others
