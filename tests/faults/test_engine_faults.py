"""Engine faults, against real vLLM engines: over-long prompts (rejected or truncated per
rollout.prompt_too_long, the engine keeps serving) and a killed engine actor (the loop's router names
it and the run stops; nothing hangs).

The shared engine runs with `reject`; a second engine, started here with `truncate` and a shorter
context, is killed by the last test.
"""

from __future__ import annotations

import asyncio

import pytest
import ray
from faultlib import small_spec

from molt.agents import load_agent_runner
from molt.rollout.engine import start_engines
from molt.rollout.pool import RolloutPool
from molt.rollout.router import EngineDiedError, Router

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 8, "seed": 0}
REPEAT = {"module": "examples/agents/repeat.py", "max_total_tokens": 4096}


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
    with pytest.raises(ValueError, match="prompt of 600 tokens does not fit model.max_model_len=512"):
        ray.get(engine.generate.remote(long_prompt(600), SAMPLING))
    out = ray.get(engine.generate.remote(long_prompt(20), SAMPLING))
    assert len(out["token_ids"]) == 8 and out["prompt_ids"] == long_prompt(20)

    # Through an agent: the over-long rollout fails, its neighbour in the same batch does not.
    spec = small_spec(REPEAT)
    runner = load_agent_runner(spec.agent)
    runner.setup(tok, spec)
    router = Router([engine])
    long, short = asyncio.run(_both(runner, router, [{"prompt": "x" * 2000, "label": "x"},
                                                     {"prompt": "a", "label": "a"}]))
    assert not long.ok and "does not fit model.max_model_len=512" in long.error
    assert short.ok and short.num_sampled > 0


async def _both(runner, router, items):
    return await asyncio.gather(*[runner.run(item, f"r{i}", "g", router) for i, item in enumerate(items)])


def test_truncate_keeps_the_most_recent_context(spare, tok):
    prompt = long_prompt(300)
    out = ray.get(spare.generate.remote(prompt, SAMPLING))
    # 127 prompt tokens (the last ones) leave room for exactly one generated token.
    assert out["prompt_ids"] == prompt[-127:]
    assert len(out["token_ids"]) == 1 and out["finish_reason"] == "length"

    spec = small_spec(REPEAT, model={"max_model_len": 128}, rollout={"prompt_too_long": "truncate"})
    runner = load_agent_runner(spec.agent)
    runner.setup(tok, spec)
    [r] = asyncio.run(_both(runner, Router([spare]), [{"prompt": "x" * 400, "label": "x"}]))
    # The trained segment is what the engine actually read: its truncated prompt, then the sample.
    [segment] = r.segments
    assert r.ok and len(segment.token_ids) == 128 and segment.prompt_len == 127
    assert segment.loss_mask == [0] * 127 + [1]


def test_a_killed_engine_stops_the_run_with_a_clear_error(spare, tok):
    spec = small_spec(REPEAT)
    runner = load_agent_runner(spec.agent)
    runner.setup(tok, spec)
    router = Router([spare])

    async def rollout_fn(item: dict, group_id: str, index: int):
        return await runner.run(item, f"{group_id}-{index}", group_id, router)

    async def kill_mid_batch():
        # Long generations (ignore_eos) so the kill lands while requests are in flight.
        runner.sampling.update(max_tokens=100, ignore_eos=True)
        items = iter([{"prompt": "a", "label": "a"}] * 4)
        pool = RolloutPool(items, rollout_fn, 4, 4, 1, [spare], refill_during_batch=False)
        batch = asyncio.create_task(pool.next_batch(4))
        while router.load[0] == 0:
            await asyncio.sleep(0.01)
        ray.kill(spare)
        # The guard only turns a hang into a failure; a dead actor fails its calls within seconds.
        groups = await asyncio.wait_for(batch, timeout=60)
        await pool.close()
        return [r for g in groups for r in g]

    rollouts = asyncio.run(kill_mid_batch())
    assert len(rollouts) == 16
    assert all(not r.ok and "EngineDiedError: engine 0 died" in r.error for r in rollouts)
    # What the loop does right after each batch (molt.loop._train): one clear error, not a failed batch.
    with pytest.raises(EngineDiedError, match=r"1 of 1 rollout engine\(s\) died \(engine 0: .*Actor.*\); "
                                              "stopping the run"):
        router.check()
