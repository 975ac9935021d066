"""Generator benchmark: generation tokens/s and refit seconds on a real vLLM engine, two model sizes.

    python bench/bench_generator.py [--sizes tiny,30m] [--requests 64] [--tokens 128] [--refits 3]

Prints a table and writes it as the `generator` section of bench/RESULTS.md (with machine, versions and
date). Numbers on a shared CPU are noisy: compare rows from the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import SIZES, header, param_count, table, write_section  # noqa: E402


async def generate_many(engine, n: int, tokens: int) -> tuple[int, float]:
    sampling = {"temperature": 1.0, "max_tokens": tokens, "ignore_eos": True}
    start = time.perf_counter()
    outs = await asyncio.gather(*[engine.generate.remote([1, 10 + i % 50, 11], {**sampling, "seed": i})
                                  for i in range(n)])
    return sum(len(o["token_ids"]) for o in outs), time.perf_counter() - start


async def refit_once(policy, dispatcher, version: int) -> tuple[float, float]:
    """The loop's refit (trainer gathers and broadcasts, the engine receives and reloads), timed from
    both ends: (seconds inside the engine, seconds of the whole call)."""
    t0 = time.perf_counter()
    engine_s, _ = await asyncio.gather(dispatcher.update_weights(version),
                                       asyncio.to_thread(policy.send_weights))
    return engine_s, time.perf_counter() - t0


def bench_one(size: str, args: argparse.Namespace) -> list:
    import ray

    from molt.driver.fleet import Fleet
    from molt.inputs.tiny import tiny_model_path
    from molt.rollout.dispatch import Dispatcher
    from molt.rollout.engine import start_engines
    from molt.spec import RunSpec
    from molt.trainer.ranks import TrainerRanks

    path = str(tiny_model_path(**SIZES[size]))
    spec = RunSpec.model_validate({"model": {"path": path, "max_model_len": args.tokens + 64},
                                   "rollout": {"max_tokens": args.tokens, "engine": {"kv_cache_gib": 0.5}},
                                   "train": {"micro_batch_size": 8}})
    t0 = time.perf_counter()
    [engine] = start_engines(spec, path)
    startup = time.perf_counter() - t0
    asyncio.run(generate_many(engine, 4, 8))                         # warm-up
    tokens, seconds = asyncio.run(generate_many(engine, args.requests, args.tokens))
    policy, dispatcher = TrainerRanks(spec), Dispatcher([engine])
    asyncio.run(Fleet(spec, path, engines=[engine]).connect(policy))
    times = [asyncio.run(refit_once(policy, dispatcher, v)) for v in range(1, args.refits + 1)]
    policy.shutdown()
    ray.get(engine.shutdown.remote())
    ray.kill(engine)
    engine_s, call_s = zip(*times, strict=True)
    row = [size, f"{param_count(path) / 1e6:.2f}", f"{startup:.1f}", f"{tokens / seconds:.0f}",
           f"{statistics.median(engine_s):.3f}", f"{statistics.median(call_s):.3f}"]
    print(row, flush=True)
    return row


def main() -> None:
    import ray

    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="tiny,30m")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--refits", type=int, default=3)
    args = parser.parse_args()
    load = os.getloadavg()[0]           # the machine may be shared: record how busy it was
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False)
    rows = [bench_one(size, args) for size in args.sizes.split(",")]
    ray.shutdown()
    head = ["model", "params (M)", "engine start (s)", "generation tok/s", "refit (s, in engine)",
            "refit (s, whole call)"]
    body = (f"## Generator\n\n{header()}\n\nOne engine (enforce_eager), {args.requests} concurrent "
            f"requests × {args.tokens} tokens; refit = a 1-rank trainer gathers and broadcasts the "
            f"full weights (gloo), the engine receives them into its reload path, median of "
            f"{args.refits}. Load average at start: {load:.1f}.\n\n"
            f"{table(head, rows)}")
    print(table(head, rows))
    write_section("generator", body)


if __name__ == "__main__":
    main()
