"""Benchmarks that drive Molt's Python API in-process still run against it (the timing runs are in bench/;
nothing here is timed). The ones that run `python -m molt` follow the CLI, which its own tests cover."""

from __future__ import annotations

import asyncio
import importlib.util

from molt.data import REPO_ROOT


def test_the_agentic_bench_runs_every_path(tok) -> None:
    """bench/agentic.py subclasses the Env runner and runs a ChatAgent over the loopback server (with its
    own SDK client and with ctx.http_client): 2 rollouts of 2 turns on each path complete and record a
    latency per turn (its run of 2026-12-02 found it broken by a runner signature change a stop earlier)."""
    from molt.config import compose

    loaded = importlib.util.spec_from_file_location("agentic", REPO_ROOT / "bench" / "agentic.py")
    bench = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(bench)
    latencies: dict[str, list[float]] = {path: [] for path in bench.PATHS}
    spec = compose(["agent.max_turns=2", "rollout.max_tokens=4"])
    engine = bench.StandInEngine(tok.encode("bbb", add_special_tokens=False) + [tok.eos_token_id], 0.0)

    async def both() -> None:
        for runner in bench.runners(2, latencies).values():
            runner.setup(tok, spec)
            try:
                await bench.run_path(runner, engine, 2)   # raises if a rollout failed
            finally:
                runner.close()

    asyncio.run(both())
    assert bench.PATHS == ("env", "chat", "chat_lent")
    assert [len(latencies[path]) for path in bench.PATHS] == [4, 4, 4]
