"""Agent faults against the real engine and a real trainer: each fault fails only its rollout, the batch
is handled per agent.on_failure, training goes on with the rest, and too many failures stop the run.

The faulty agent (examples/agents/faulty.py) really raises, really hangs past agent.timeout_s, and
really returns NaN / text / nothing; rollouts go through the loop's own pool, `rollout_metrics`,
`drop_failed` and `learn`.
"""

from __future__ import annotations

import asyncio

import pytest
from faultlib import FAULTY, small_spec
from poollib import FnGroups

from molt.agents import load_agent_runner
from molt.driver.loop import learn
from molt.driver.select import drop_failed, rollout_metrics
from molt.rollout.dispatch import Dispatcher
from molt.rollout.pool import RolloutPool
from molt.trainer.ranks import Trainers

ERRORS = {"raise": "RuntimeError: the agent crashed", "hang": "agent timed out after 8.0s",
          "nan": "reward must be a finite number, got nan",
          "text": "reward must be a finite number, got 'high'",
          "none": "FaultyEnv.step returned NoneType, not Result"}
# One group per row: the fault of each of its 4 samples (None: a well-behaved rollout).
GROUPS = [["raise", None, None, None], ["hang", None, None, None], ["nan", "text", "none", None],
          [None, None, None, None]]


def agent(**extra) -> dict:
    return {"module": FAULTY, "timeout_s": 8.0, **extra}   # the others take < 1 s: room for a slow machine


async def run_batch(spec, tok, engine) -> list:
    """One batch of GROUPS through the loop's pool; sample i of a group gets that group's i-th fault."""
    runner = load_agent_runner(spec.agent)
    runner.setup(tok, spec)
    dispatcher = Dispatcher([engine])

    async def rollout_fn(item: dict, group_id: str, index: int):
        row = {"prompt": item["prompt"], "label": item["label"], "fault": item["faults"][index]}
        return await runner.run(row, f"{group_id}-{index}", group_id, dispatcher)

    items = [{"prompt": "a", "label": "a", "faults": faults} for faults in GROUPS]
    pool = RolloutPool(iter(items), FnGroups(rollout_fn, 4), len(items), 1, [engine],
                       refill_during_batch=False)
    groups = await pool.next_batch(len(items))
    await pool.close()
    return [r for g in groups for r in g]


@pytest.fixture(scope="module")
def batch(tok, engine):
    return asyncio.run(run_batch(small_spec(agent()), tok, engine))


def test_each_fault_fails_only_its_rollout(batch):
    by_id = {r.rollout_id: r for r in batch}
    for g, faults in enumerate(GROUPS):
        for i, fault in enumerate(faults):
            r = by_id[f"g{g}-{i}"]
            if fault is None:
                assert r.ok and r.segments and sum(r.segments[0].loss_mask) > 0
            else:
                assert not r.ok and ERRORS[fault] in r.error and r.segments == [] and r.label == "a"
    metrics = rollout_metrics(small_spec(agent()), batch)
    assert metrics["rollout/failed"] == 5 and metrics["rollout/count"] == 16


def test_on_failure_drops_the_group_or_only_the_rollout(batch):
    dropped = drop_failed(small_spec(agent(on_failure="drop_group")), batch)
    assert sorted(r.rollout_id for r in dropped) == [f"g3-{i}" for i in range(4)]
    kept = drop_failed(small_spec(agent(on_failure="keep_group")), batch)
    assert sorted(r.rollout_id for r in kept) == sorted(
        f"g{g}-{i}" for g, faults in enumerate(GROUPS) for i, fault in enumerate(faults) if fault is None)


@pytest.mark.parametrize("on_failure", ["drop_group", "keep_group"])
def test_training_goes_on_with_the_rest(batch, trainer, tok, on_failure):
    spec = small_spec(agent(on_failure=on_failure))
    kept = drop_failed(spec, batch)
    metrics = asyncio.run(learn(spec, batch, Trainers(trainer, pad_id=tok.pad_token_id), 0))
    assert "train/skipped" not in metrics and metrics["rollout/failed"] == 5
    # Exactly the sampled tokens of the kept rollouts were trained, none of a failed one.
    assert metrics["tokens/trained"] == sum(sum(s.loss_mask) for r in kept for s in r.segments)


def test_too_many_failures_stop_the_run_with_a_clear_message(batch, trainer, tok):
    spec = small_spec(agent(max_failure_rate=0.25))
    message = (r"5/16 rollouts failed, above agent.max_failure_rate=0.25; "
               r"first errors: \['FaultyEnv.step returned NoneType, not Result', "
               r"'RuntimeError: the agent crashed'")
    with pytest.raises(RuntimeError, match=message):
        rollout_metrics(spec, batch)
    with pytest.raises(RuntimeError, match=message):   # learn stops before any trainer call
        asyncio.run(learn(spec, batch, Trainers(trainer, pad_id=tok.pad_token_id), 0))
