"""Engine faults, against real vLLM engines: over-long prompts (rejected or truncated per
rollout.prompt_too_long, the engine keeps serving), and engines that die and come back: the actor
process killed (what an out-of-memory kill does; vLLM's engine core runs in it), or vLLM's engine failing
inside a live actor.

The shared engine runs with `reject`; a second engine, started here with `truncate` and a shorter
context, and a third one form the fleet of the last test, which kills them.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import ray
from faultlib import small_spec, train_once
from poollib import FnGroups

from molt.agents import load_agent_runner
from molt.driver.fleet import Fleet
from molt.rollout.dispatch import Dispatcher
from molt.rollout.engine import start_engine, start_engines
from molt.rollout.pool import RolloutPool
from molt.trajectory import EngineDiedError

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 8, "seed": 0}
# A rollout waits while its engine restarts (tens of seconds, more on a loaded machine): the default
# 60 s agent timeout would fail it for the restart's sake, not for anything this file checks.
REPEAT = {"module": "examples/agents/repeat.py", "max_total_tokens": 4096, "timeout_s": 300.0}


@pytest.fixture(scope="module")
def spare(ray_session, tiny_model_path):
    """A second engine: prompt_too_long=truncate and a 128-token context."""
    spec = small_spec(model={"max_model_len": 128},
                      rollout={"prompt_too_long": "truncate", "engine": {"kv_cache_gib": 0.1}})
    [actor] = start_engines(spec, tiny_model_path)
    yield actor
    ray.kill(actor)   # the last test killed it already; killing twice is harmless


def long_prompt(n: int) -> list[int]:
    return [(7 * i) % 250 + 3 for i in range(n)]


def test_reject_raises_for_that_request_and_the_engine_keeps_serving(engine, tok):
    with pytest.raises(ValueError, match="prompt of 1100 tokens does not fit model.max_model_len=1024"):
        ray.get(engine.generate.remote(long_prompt(1100), SAMPLING))
    out = ray.get(engine.generate.remote(long_prompt(20), SAMPLING))
    assert len(out["token_ids"]) == 8 and out["prompt_ids"] == long_prompt(20)

    # Through an agent: the over-long rollout fails, its neighbour in the same batch does not.
    spec = small_spec(REPEAT)
    runner = load_agent_runner(spec.agent)
    runner.setup(tok, spec)
    dispatcher = Dispatcher([engine])
    long, short = asyncio.run(_both(runner, dispatcher, [{"prompt": "x" * 2000, "label": "x"},
                                                     {"prompt": "a", "label": "a"}]))
    assert not long.ok and "does not fit model.max_model_len=1024" in long.error
    assert short.ok and short.num_sampled > 0


async def _both(runner, dispatcher, items):
    return await asyncio.gather(*[runner.run(item, f"r{i}", "g", dispatcher) for i, item in enumerate(items)])


def test_truncate_keeps_the_most_recent_context(spare, tok):
    prompt = long_prompt(300)
    out = ray.get(spare.generate.remote(prompt, SAMPLING))
    # 127 prompt tokens (the last ones) leave room for exactly one generated token.
    assert out["prompt_ids"] == prompt[-127:]
    assert len(out["token_ids"]) == 1 and out["finish_reason"] == "length"

    spec = small_spec(REPEAT, model={"max_model_len": 128}, rollout={"prompt_too_long": "truncate"})
    runner = load_agent_runner(spec.agent)
    runner.setup(tok, spec)
    [r] = asyncio.run(_both(runner, Dispatcher([spare]), [{"prompt": "x" * 400, "label": "x"}]))
    # The trained segment is what the engine actually read: its truncated prompt, then the sample.
    [segment] = r.segments
    assert r.ok and len(segment.token_ids) == 128 and segment.prompt_len == 127
    assert segment.loss_mask == [0] * 127 + [1]


GREEDY = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
PROBE = [5, 40, 41, 42]


def actor_pid(engine) -> int:
    return ray.get(engine.__ray_call__.remote(lambda self: os.getpid()))


async def until(condition, what: str, timeout: float = 300.0) -> None:
    """Poll `condition`; the bound only turns a hang into a failure (restarts take tens of seconds)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def test_engines_come_back_refitted_and_groups_restart_whole(ray_session, spare, trainer, tok):
    """The session's `trainer` is the policy: it trains and refits these two engines (tests that need its
    initial weights load `trainer.initial`)."""
    spec = small_spec(REPEAT, model={"max_model_len": 128},
                      rollout={"prompt_too_long": "truncate",
                               "engine": {"kv_cache_gib": 0.1, "num_engines": 2, "max_restarts": 1}})
    path = ray.get(spare.__ray_call__.remote(lambda self: self.llm.model_config.model))
    second = start_engine(spec, path, 1)
    policy = trainer
    ray.get(second.ready.remote())
    runner = load_agent_runner(spec.agent)
    runner.setup(tok, spec)
    runner.sampling.update(max_tokens=60, ignore_eos=True)   # long enough that kills land mid-request

    async def scenario() -> None:
        fleet = Fleet(spec, path, engines=[spare, second])
        dispatcher = fleet.dispatcher

        async def rollout_fn(item: dict, group_id: str, index: int):
            return await runner.run(item, f"{group_id}-{index}", group_id, dispatcher)

        def pool() -> RolloutPool:
            items = iter([{"prompt": c, "label": c} for c in "abcdefgh"])
            return RolloutPool(items, FnGroups(rollout_fn, 4, lost=dispatcher.take_lost), 4, 1,
                               dispatcher.engines, refill_during_batch=False)

        async def batch_while(kill) -> RolloutPool:
            """A batch of 4 groups; `kill()` runs once both engines have requests in flight."""
            p = pool()
            task = asyncio.create_task(p.next_batch(4))
            await until(lambda: min(dispatcher.load) > 0, "requests on both engines")
            kill()
            groups = await asyncio.wait_for(task, 300)
            # every group complete and clean: the dead engine's groups were restarted whole
            assert len(groups) == 4 and all(len(g) == 4 and all(r.ok for r in g) for g in groups)
            assert len({r.group_id for g in groups for r in g}) == 4
            assert p.counts["engine_requeued"] >= 1
            await p.close()
            return p

        async def same_weights_everywhere(version: int) -> None:
            outs = [await e.generate.remote(PROBE, GREEDY) for e in dispatcher.engines]
            assert [o["versions"] for o in outs] == [[version] * 6] * 2
            assert outs[0]["token_ids"] == outs[1]["token_ids"]
            gaps = [abs(a - b) for a, b in zip(outs[0]["logprobs"], outs[1]["logprobs"], strict=True)]
            assert max(gaps) < 1e-5

        await fleet.connect(policy)
        await asyncio.to_thread(train_once, policy)   # the trainer's weights now differ from the model's
        await fleet.refit(1)
        before = await dispatcher.engines[0].generate.remote(PROBE, GREEDY)

        # 1+2. both kinds of death in the same batch: engine 0's process is killed (SIGKILL, as by the OOM
        # killer), and engine 1's vLLM engine fails under its live actor (which then exits itself); both
        # come back, at once, with version 1's weights
        pid = actor_pid(dispatcher.engines[0])

        def fail_next_step(actor) -> None:
            """Runs in the engine actor: vLLM's next engine step raises, as an internal vLLM error would
            (a fault this test cannot cause otherwise)."""
            def step():
                raise RuntimeError("vLLM's engine step failed (injected by the test)")
            actor.llm.step = step

        def kill_both() -> None:
            os.kill(pid, signal.SIGKILL)
            # not waited for: the actor may exit before it answers
            dispatcher.engines[1].__ray_call__.remote(fail_next_step)
        await batch_while(kill_both)
        await until(lambda: dispatcher.live == {0, 1} and fleet.metrics()["engine/restarts"] == 2.0,
                    "both engines to come back")
        assert fleet.metrics() == {"engine/deaths": 2.0, "engine/restarts": 2.0, "engine/live": 2.0}
        await same_weights_everywhere(1)
        assert (await dispatcher.engines[0].generate.remote(PROBE, GREEDY))["logprobs"] == pytest.approx(
            before["logprobs"], abs=1e-5)
        await asyncio.to_thread(train_once, policy)
        await fleet.refit(2)   # through a refit group re-formed with both new engines
        await same_weights_everywhere(2)

        # 3. restarts used up (max_restarts=1): the run goes on with engine 1 alone ...
        await batch_while(lambda: ray.kill(dispatcher.engines[0]))
        await until(lambda: 0 not in fleet.restarting, "engine 0's restart budget to be checked")
        assert dispatcher.live == {1} and fleet.metrics()["engine/restarts"] == 2.0
        dispatcher.check()
        await fleet.refit(3)   # the group is re-formed without the dead engine: no hang
        # ... and stops with one message when the last engine dies
        ray.kill(dispatcher.engines[1])
        p = pool()
        groups = await asyncio.wait_for(p.next_batch(4), 120)
        assert all(not r.ok for g in groups for r in g)
        with pytest.raises(EngineDiedError, match=r"all 2 rollout engine\(s\) died and their restarts "
                                                  r"\(rollout.engine.max_restarts=1\) are used up"):
            dispatcher.check()
        await p.close()
        await fleet.close()

    asyncio.run(scenario())
