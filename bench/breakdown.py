"""Where the time goes: the loop's per-stage times, and its throughput against the two limits.

For each size: (1) a real Molt run; its per-step `time/*` metrics, medians after warm-up; (2) the
engine alone: one engine generating the same number of requests x tokens with nothing else running
(bench_generator.generate_many); (3) the trainer alone: the policy trainer doing `logprobs` +
`update` on a fixed batch of the same shape. Loop throughput / limit says how much of each
component's speed the loop delivers; the rest is waiting and framework overhead.

    python bench/breakdown.py --quick
    python bench/breakdown.py --sizes tiny,30m --lengths 128 [--modes sync,async] [--reuse]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

from common import BENCH, table
from molt_run import add_flags, apply_quick, cells, finish, intro, metric, model_path, overrides, sweep

# The loop's stages in the order they happen; "other" is step time minus their sum. The engine's busy
# time (time/generate) is reported beside them: in async mode it overlaps the others.
STAGES = ("time/wait_batch", "time/logprobs", "time/train", "time/refit")


def limits(size: str, length: int, args: argparse.Namespace, repeats: int = 3) -> dict[str, float]:
    """Engine alone (sampled tok/s) and trainer alone (trained tok/s; logprobs and update seconds)."""
    import ray
    import torch
    from bench_generator import generate_many

    from molt.config import compose
    from molt.placement import init_ray
    from molt.rollout.engine import start_engines
    from molt.trainer import TrainerRanks, make_batch
    from molt.trajectory import Segment

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    n = args.prompts_per_step * args.samples_per_prompt
    spec = compose(overrides(size, length, 1, args.prompts_per_step, args.samples_per_prompt))
    init_ray(spec)
    try:
        [engine] = start_engines(spec, model_path(size))
        asyncio.run(generate_many(engine, 4, 8))  # warm-up
        runs = [asyncio.run(generate_many(engine, n, length)) for _ in range(repeats)]
        engine_tok_s = statistics.median(tokens / seconds for tokens, seconds in runs)
        ray.get(engine.shutdown.remote())
        ray.kill(engine)

        policy = TrainerRanks(spec, "policy")
        g = torch.Generator().manual_seed(0)
        prompt = 8
        segments = []
        for i in range(n):
            ids = torch.randint(3, 300, (prompt + length,), generator=g).tolist()
            segments.append(Segment(ids, [0] * prompt + [1] * length, [0.0] * prompt + [-5.0] * length,
                                    [-1] * prompt + [0] * length, f"r{i}", f"g{i // args.samples_per_prompt}",
                                    prompt_len=prompt, finish_reason="length"))
        adv = torch.randn(n, generator=g)
        batch = make_batch(segments, advantages=[[0.0] * prompt + [float(a)] * length for a in adv])
        logp_s, train_s = [], []
        for _ in range(repeats + 1):  # the first is warm-up
            t0 = time.perf_counter()
            old = policy.logprobs(batch)
            t1 = time.perf_counter()
            policy.update({**batch, "old_logp": old})
            logp_s.append(t1 - t0)
            train_s.append(time.perf_counter() - t1)
        policy.shutdown()
    finally:
        ray.shutdown()
    tokens = n * length
    return {"engine_tok_s": engine_tok_s, "logprobs_s": statistics.median(logp_s[1:]),
            "train_s": statistics.median(train_s[1:]),
            "trainer_tok_s": tokens / (statistics.median(logp_s[1:]) + statistics.median(train_s[1:]))}


def ratio(loop: float, alone: float) -> str:
    return f"{loop:.4g} / {alone:.4g} = {loop / alone:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, sizes="tiny,30m", lengths="128")
    p.add_argument("--modes", default="sync", help="rollout.mode(s) of the loop runs")
    args = p.parse_args()
    apply_quick(args)
    modes = args.modes.split(",")
    records = [r for r in sweep(args, {m: [f"rollout.mode={m}"] for m in modes}) if "summary" in r]
    rows, bars = [], []
    for size, length in cells(args):
        lim = limits(size, length, args)
        for mode in modes:
            runs = [r for r in records if (r["size"], r["length"], r["variant"]) == (size, length, mode)]
            if not runs:
                rows.append([size, length, mode, "failed"] + [""] * 6)
                continue
            med = {k: statistics.median(metric(r["medians"], k) for r in runs) for k in STAGES}
            step = statistics.median(r["summary"]["step_s"] for r in runs)
            sampled = statistics.median(r["summary"]["sampled_tok_s"] for r in runs)
            trained = statistics.median(r["summary"]["trained_tok_s"] for r in runs)
            other = step - sum(v for v in med.values() if v == v)
            bars.append((f"{size}\n{length} tok\n{mode}", {**med, "other": other}))
            busy = statistics.median(metric(r["medians"], "time/generate") for r in runs)
            rows.append([size, length, mode, f"{step:.3g}", f"{busy:.3g}",
                         " / ".join(f"{med[k]:.3g}" for k in STAGES) + f" / {other:.3g}",
                         ratio(sampled, lim["engine_tok_s"]), ratio(trained, lim["trainer_tok_s"]),
                         f"{lim['logprobs_s']:.3g} + {lim['train_s']:.3g}"])
    head = ["model", "max tokens", "mode", "step s", "engine busy s",
            "wait_batch / logprobs / train / refit / other (s)",
            "sampled tok/s: loop / engine alone", "trained tok/s: loop / trainer alone",
            "trainer alone: logprobs + update (s)"]
    body = intro("Where the time goes", args) + "\n".join([table(head, rows), "", "![stages](breakdown.png)"])
    if not args.quick and bars:
        draw(bars)
    finish(args, "breakdown", body)


def draw(bars: list[tuple[str, dict[str, Any]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5, 1.5 * len(bars)) + 2, 4))
    bottom = [0.0] * len(bars)
    for key in (*STAGES, "other"):
        values = [max(b[1].get(key, 0.0), 0.0) for b in bars]
        ax.bar(range(len(bars)), values, bottom=bottom, label=key.removeprefix("time/"))
        bottom = [x + y for x, y in zip(bottom, values, strict=True)]
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    ax.set(ylabel="s per step", title="per-stage step time (medians)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(BENCH / "breakdown.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
