"""`bench/agentic.py --workers N`: the chat path's turns run in N agent workers (`agent.workers`).

The same multi-turn chat rollouts as `agentic.py`'s lent-client path (bench/agentic_agent.py, stock OpenAI
SDK over the loopback server), but as a training run places them: the driver hands groups of 8 to
`AgentWorkers`, each worker runs them on its own event loop and loopback server, and calls the engine
itself, a Ray actor standing in for vLLM that answers every request after a fixed delay. Reported per
worker count: turns per second (all sessions' turns over the run's wall time), the SDK call's latency per
turn (median, p99) and what it adds to the stand-in's delay, and CPU seconds per turn of the driver, of
the workers (together) and of the stand-in engine actor (psutil, over the measured run only).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
SAMPLES = 8   # rollouts per group: the driver hands out sessions / SAMPLES groups


def stand_in_engine(reply: list[int], delay: float):
    """A Ray actor with `EngineActor.generate`'s signature answering after `delay` seconds."""
    import ray

    @ray.remote
    class StandInEngineActor:
        async def generate(self, prompt_ids: list[int], sampling: dict, request_id: str | None = None,
                           images: list | None = None) -> dict:
            await asyncio.sleep(delay)
            n = len(reply)
            return {"token_ids": list(reply), "logprobs": [-1.0] * n, "versions": [0] * n,
                    "finish_reason": "stop", "prompt_ids": list(prompt_ids),
                    "sampling": [sampling.get("temperature", 1.0), sampling.get("top_p", 1.0),
                                 sampling.get("top_k", -1)]}

        def pid(self) -> int:
            return os.getpid()

    return StandInEngineActor.options(max_concurrency=100_000).remote()


def cpu_seconds(pids: list[int]) -> float:
    import psutil

    return sum(sum(psutil.Process(p).cpu_times()[:2]) for p in pids)


def measure(workers: int, sessions: int, turns: int, delay: float, reply: list[int], path: str,
            repeats: int, tools: bool = False) -> dict[str, list[float]]:
    """Per repeat: turns/s, latency median and p99 (s), CPU s per turn of driver, workers, engine."""
    import ray

    from molt.driver.agent_workers import AgentWorkers
    from molt.driver.compose import compose
    from molt.rollout.dispatch import Dispatcher

    spec = compose([f"agent.max_turns={turns}", "agent.max_total_tokens=4096", "model.max_model_len=4096",
                    f"rollout.max_tokens={len(reply)}", f"rollout.samples_per_prompt={SAMPLES}",
                    f"agent.module={BENCH / 'agentic_agent.py'}",
                    f"+agent.options.turns={turns}", f"+agent.options.tools={tools}",
                    f"agent.workers={workers}", "agent.timeout_s=3600"])
    engine = stand_in_engine(reply, delay)
    pool = AgentWorkers(spec, path, Dispatcher([engine]))
    out: dict[str, list[float]] = {k: [] for k in ("turns_per_s", "median", "p99", "driver", "workers",
                                                    "engine")}
    try:
        worker_pids, engine_pid = pool.ready(), ray.get(engine.pid.remote())

        async def run(n: int, tag: str) -> list:
            groups = await asyncio.gather(*[pool.run_group({"prompt": "a", "label": "a"}, f"{tag}g{g}")
                                            for g in range(max(1, n // SAMPLES))])
            rollouts = [r for g in groups for r in g]
            failed = [r.error for r in rollouts if r.error]
            if failed:
                raise RuntimeError(f"{len(failed)} rollouts failed, e.g. {failed[0]}")
            return rollouts

        asyncio.run(run(min(16, sessions), "warm"))   # imports, first connections
        for r in range(repeats):
            before = [cpu_seconds([os.getpid()]), cpu_seconds(worker_pids), cpu_seconds([engine_pid])]
            start = time.perf_counter()
            rollouts = asyncio.run(run(sessions, f"r{r}"))
            wall = time.perf_counter() - start
            after = [cpu_seconds([os.getpid()]), cpu_seconds(worker_pids), cpu_seconds([engine_pid])]
            latencies = sorted(v for ro in rollouts for k, v in ro.info.items() if k.startswith("turn_s_"))
            n = len(latencies)
            out["turns_per_s"].append(n / wall)
            out["median"].append(statistics.median(latencies))
            out["p99"].append(latencies[min(n - 1, int(0.99 * n))])
            for key, b, a in zip(("driver", "workers", "engine"), before, after, strict=True):
                out[key].append((a - b) / n)
            print(f"[agentic --workers {workers}] r{r}: {n / wall:.0f} turns/s, median "
                  f"{out['median'][-1] * 1e3:.1f} ms, p99 {out['p99'][-1] * 1e3:.1f} ms over {n} turns; CPU "
                  f"ms/turn driver {out['driver'][-1] * 1e3:.2f}, workers {out['workers'][-1] * 1e3:.2f}, "
                  f"engine {out['engine'][-1] * 1e3:.2f}", flush=True)
    finally:
        pool.close()
        ray.kill(engine)
    return out


def run_axis(counts: list[int], sessions: int, turns: int, delays_ms: list[float], reply: list[int],
             path: str, repeats: int, tools: bool = False) -> tuple[list[str], list[list[str]]]:
    """The table (head, rows) of every stand-in delay x worker count, measured one after another.

    `load` is what the workers' CPU would need per delay: sessions per worker x CPU per turn / delay. A
    session's turn is its CPU then the engine's delay, so above 1 the workers' cores are the bottleneck
    and a turn's added latency is its wait in their queue (Little's law), not the server's work."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")   # a private local cluster, as molt.plan.placement's
    ray.init(num_cpus=max(16, 2 * max(counts)), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                                       "RAY_AUTH_MODE": os.environ["RAY_AUTH_MODE"]}})
    ms = lambda x: f"{statistics.median(x) * 1e3:.2f} ({min(x) * 1e3:.2f}–{max(x) * 1e3:.2f})"  # noqa: E731
    rows = []
    try:
        for delay_ms in delays_ms:
            for workers in counts:
                m = measure(workers, sessions, turns, delay_ms / 1000, reply, path, repeats, tools)
                added = [v - delay_ms / 1000 for v in m["median"]]
                added99 = [v - delay_ms / 1000 for v in m["p99"]]
                load = sessions / workers * statistics.median(m["workers"]) / (delay_ms / 1000)
                rows.append([f"{delay_ms:g}", str(workers), f"{load:.2f}",
                             f"{statistics.median(m['turns_per_s']):.0f}", ms(m["median"]), ms(added),
                             ms(added99), ms(m["driver"]), ms(m["workers"]), ms(m["engine"])])
    finally:
        ray.shutdown()
    head = ["delay ms", "workers", "load", "turns/s", "latency median", "added median", "added p99",
            "CPU/turn: driver", "workers (all)", "stand-in engine"]
    return head, rows
