"""Nothing the driver keeps per rollout or per step grows with the length of the run: the dispatcher forgets a
rollout's engine when the rollout ends (however it ends), rollout dumps rotate, and the logger holds no
per-step state or file. (Chat sessions: tests/faults/test_server_faults.py checks the server keeps none
after hundreds of sessions that finished, failed, timed out or were cancelled.)"""

from __future__ import annotations

import asyncio
import os
import tracemalloc
from contextlib import closing
from pathlib import Path

from faultlib import FAULTY, small_spec
from poollib import FnGroups

from molt.agents import load_agent_runner
from molt.driver.agent_workers import LocalAgents
from molt.driver.eval import evaluate
from molt.driver.metrics import RunLogger, load_rollouts
from molt.inputs.data import PromptDataset
from molt.rollout.dispatch import Dispatcher
from molt.rollout.pool import RolloutPool
from molt.trajectory import Rollout, Segment

FAULTS = ["raise", "hang", "nan", None]


def test_the_router_forgets_every_rollout_when_it_ends(tok, engine, tmp_path):
    # A short agent timeout so the hanging rollouts end; whether a slow one fails too does not matter here.
    spec = small_spec({"module": FAULTY, "timeout_s": 3.0})
    runner = load_agent_runner(spec.agent)
    runner.setup(tok, spec)
    dispatcher = Dispatcher([engine])

    async def rollout_fn(item: dict, group_id: str, index: int) -> Rollout:   # as molt.driver.loop's
        row = {"prompt": item["prompt"], "label": "a", "fault": FAULTS[index]}
        return await runner.run(row, f"{group_id}-{index}", group_id, dispatcher)

    async def main() -> list:
        items = [{"prompt": "a"}] * 6
        pool = RolloutPool(iter(items), FnGroups(rollout_fn, 4), 3, 1, [engine], refill_during_batch=False)
        groups = await pool.next_batch(3) + await pool.next_batch(3)
        await pool.close()
        return [r for g in groups for r in g]

    rollouts = asyncio.run(main())
    assert len(rollouts) == 24 and sum(r.ok for r in rollouts) >= 1 and sum(not r.ok for r in rollouts) >= 12
    assert dispatcher.sticky == {}
    data = tmp_path / "eval.jsonl"
    data.write_text('{"prompt": "a", "label": "a"}\n{"prompt": "b", "label": "b"}\n')
    sets = {"set": PromptDataset(str(data), spec.data)}
    asyncio.run(evaluate(spec, LocalAgents(spec, runner, dispatcher), sets, 1))
    assert dispatcher.sticky == {}


def dumps_of(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "rollouts").iterdir())


def rollout(i: int) -> Rollout:
    segment = Segment(token_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0, -0.5, -0.25],
                      versions=[-1, 0, 0], rollout_id=f"r{i}", group_id="g", segment_index=0, prompt_len=1)
    return Rollout(f"r{i}", "g", [segment], reward=1.0)


def logger_spec(run_dir: Path, keep: int):
    return small_spec(run={"dir": str(run_dir)}, logging={"dump_keep_steps": keep, "progress": False,
                                                          "plots": False, "wandb": {"mode": "disabled"}})


def test_rollout_dumps_keep_the_last_n_steps(tmp_path):
    with closing(RunLogger(logger_spec(tmp_path / "a", 3))) as logger:
        for step in range(1, 6):   # N + 2 steps
            logger.dump_rollouts(step, [rollout(step)])
        logger.dump_rollouts(5, [rollout(6)])   # a second dump of a step still appends
    assert dumps_of(tmp_path / "a") == ["step_000003.jsonl", "step_000004.jsonl", "step_000005.jsonl"]
    last = load_rollouts(tmp_path / "a" / "rollouts" / "step_000005.jsonl")
    assert [r.rollout_id for r in last] == ["r5", "r6"]

    with closing(RunLogger(logger_spec(tmp_path / "b", 0))) as logger:   # 0 keeps all
        for step in range(1, 6):
            logger.dump_rollouts(step, [rollout(step)])
    assert len(dumps_of(tmp_path / "b")) == 5


def test_the_logger_holds_no_per_step_memory_or_files(tmp_path):
    def fds() -> list[str]:
        # The files this process holds open in the run folder: Ray's and pytest's own descriptors
        # come and go on other threads, so a count over the whole process is not the logger's.
        held = [os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")]
        return sorted(p for p in held if p.startswith(str(tmp_path.resolve())))

    with closing(RunLogger(logger_spec(tmp_path, 2))) as logger:
        for step in range(200):   # warm up: every buffer reaches its steady size
            logger.log(step, {"reward/mean": 0.5})
            logger.dump_rollouts(step, [rollout(step)])
        open_before = fds()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        for step in range(200, 2200):
            logger.log(step, {"reward/mean": 0.5})
            logger.dump_rollouts(step, [rollout(step)])
        grown = tracemalloc.take_snapshot().compare_to(before, "filename")
        tracemalloc.stop()
        assert fds() == open_before
    mine = os.path.join("molt", "metrics.py")
    held = sum(d.size_diff for d in grown if d.traceback[0].filename.endswith(mine))
    assert held < 4096, [str(d) for d in grown[:5]]   # 2,000 more steps: no per-step state kept
    assert len(dumps_of(tmp_path)) == 2
