"""The dispatcher on two real engines: new rollouts go to the least-loaded engine, a rollout sticks to it."""

from __future__ import annotations

import asyncio

import pytest
import ray

from molt.rollout.dispatch import Dispatcher

LONG = {"temperature": 1.0, "max_tokens": 120, "ignore_eos": True, "seed": 5}
SHORT = {"temperature": 1.0, "max_tokens": 6, "seed": 5}


@pytest.fixture(scope="module")
def engines(engine, second_engine):
    return [engine, second_engine]


def test_new_keys_balance_and_keys_stick(engines):
    async def main():
        dispatcher = Dispatcher(engines)
        # four concurrent new rollouts: each goes to the engine with fewer requests in flight
        first = [asyncio.create_task(dispatcher.generate([1, 9, i], LONG, f"r{i}")) for i in range(4)]
        await asyncio.sleep(0)
        placed = [dispatcher.sticky[f"r{i}"] for i in range(4)]
        assert placed == [0, 1, 0, 1]
        # r1's next turn follows r1 to engine 1, although the loads tie (2, 2) and a new key would get 0
        follow = await dispatcher.generate([1, 9, 1, 4], SHORT, "r1")
        assert follow["engine"] == placed[1] == 1
        assert dispatcher.pick("new") == 0
        outs = await asyncio.gather(*first)
        assert [o["engine"] for o in outs] == placed
        assert dispatcher.load == [0, 0]
        # once released, the key is placed afresh on the least-loaded engine
        dispatcher.release("r1")
        busy = asyncio.create_task(dispatcher.generate([1, 9], LONG, "other"))   # engine 0 (idle tie → 0)
        await asyncio.sleep(0)
        assert dispatcher.sticky["other"] == 0
        again = await dispatcher.generate([1, 9, 1], SHORT, "r1")
        assert again["engine"] == 1
        await busy
        return outs

    outs = asyncio.run(main())
    assert all(len(o["token_ids"]) == 120 for o in outs)


def test_router_returns_engine_output_unchanged(engines):
    direct = ray.get(engines[1].generate.remote([1, 2, 3], SHORT))

    async def main():
        dispatcher = Dispatcher([engines[1], engines[0]])   # the first key goes to index 0: engines[1]
        return await dispatcher.generate([1, 2, 3], SHORT, "k")

    out = asyncio.run(main())
    assert out["engine"] == 0
    assert {k: out[k] for k in direct} == direct
