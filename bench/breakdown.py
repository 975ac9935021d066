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


def matmul_peak(threads: int, n: int = 1024, repeats: int = 5) -> float:
    """This CPU's fp32 matmul FLOP/s at `threads` torch threads: the best of `repeats` n x n products."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b   # warm-up (allocation, kernel selection)
    best = min(_seconds(lambda: a @ b) for _ in range(repeats))
    torch.set_num_threads(before)
    return 2 * n**3 / best


def _seconds(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def train_flops(size: str, rows: int, seq: int) -> float:
    """FLOPs of one forward + backward (3x forward) over `rows` sequences of `seq` tokens: 2 x parameters
    per token (tied embeddings counted once, as the output head), plus causal attention's QK^T and AV
    (2 x seq^2 x heads x head_dim per layer and sequence)."""
    import json
    from pathlib import Path

    from common import param_count

    path = model_path(size)
    config = json.loads((Path(path) / "config.json").read_text())
    attention = 2 * seq**2 * config["num_attention_heads"] * config["head_dim"] * config["num_hidden_layers"]
    return 3 * rows * (2 * param_count(path) * seq + attention)


PROMPT = 8   # prompt tokens of each row of `policy_batch`


def policy_batch(rows: int, samples: int, length: int) -> dict:
    """A fixed batch of the loop's shape for timing a train step alone: `rows` random rows of PROMPT
    prompt tokens and `length` sampled ones, groups of `samples`, one random advantage per row."""
    import torch

    from molt.trainer import make_batch
    from molt.trajectory import Segment

    g = torch.Generator().manual_seed(0)
    segments = [Segment(torch.randint(3, 300, (PROMPT + length,), generator=g).tolist(),
                        [0] * PROMPT + [1] * length, [0.0] * PROMPT + [-5.0] * length,
                        [-1] * PROMPT + [0] * length, f"r{i}", f"g{i // samples}", prompt_len=PROMPT,
                        finish_reason="length") for i in range(rows)]
    adv = torch.randn(rows, generator=g)
    return make_batch(segments, advantages=[[0.0] * PROMPT + [float(a)] * length for a in adv])


def limits(size: str, length: int, args: argparse.Namespace, mode: str, repeats: int = 3) -> dict[str, float]:
    """Measured in this command with nothing else of Molt running, each with the threads `mode` gives it
    (`parallel.cpu_threads`): the engine alone (seconds and tok/s for the step's requests), the trainer
    alone (seconds of `update` on a batch of the step's shape, its FLOP/s) and this CPU's fp32 matmul peak
    at the trainer's threads."""
    import ray
    from bench_generator import generate_many

    from molt.driver.compose import compose
    from molt.plan.placement import cpu_threads, init_ray
    from molt.rollout.engine import start_engines
    from molt.trainer import TrainerRanks

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    n = args.prompts_per_step * args.samples_per_prompt
    spec = compose(overrides(size, length, 1, args.prompts_per_step, args.samples_per_prompt,
                             extra=[f"rollout.mode={mode}"]))
    init_ray(spec)
    try:
        [engine] = start_engines(spec, model_path(size))
        asyncio.run(generate_many(engine, 4, 8))  # warm-up
        runs = [asyncio.run(generate_many(engine, n, length)) for _ in range(repeats)]
        engine_s = statistics.median(seconds for _, seconds in runs)
        engine_tok_s = statistics.median(tokens / seconds for tokens, seconds in runs)
        ray.get(engine.shutdown.remote())
        ray.kill(engine)

        policy = TrainerRanks(spec, "policy")
        batch = policy_batch(n, args.samples_per_prompt, length)
        # the loop's step: one update, old logprobs from the update's own forward (no reference model)
        train_s = [_seconds(lambda: policy.update(batch)) for _ in range(repeats + 1)][1:]
        policy.shutdown()
    finally:
        ray.shutdown()
    threads = cpu_threads(spec, "policy", 0)
    train = statistics.median(train_s)
    return {"engine_s": engine_s, "engine_tok_s": engine_tok_s, "train_s": train,
            "trainer_tok_s": n * length / train, "threads": threads,
            "train_flop_s": train_flops(size, n, PROMPT + length) / train,
            "peak_flop_s": matmul_peak(threads)}


def ratio(loop: float, alone: float) -> str:
    return f"{loop:.4g} / {alone:.4g} = {loop / alone:.2f}"


def limit_row(size: str, length: int, mode: str, runs: list[dict], lim: dict[str, float]) -> list[str]:
    """The issue's targets for one cell: overhead against the parts alone, refit share, generation and
    trainer speed against their limits, start-up."""
    med = {k: statistics.median(metric(r["medians"], k) for r in runs)
           for k in ("time/step", "time/refit", "time/generate", "tokens/sampled")}
    parts = lim["engine_s"] + lim["train_s"] if mode == "sync" else max(lim["engine_s"], lim["train_s"])
    formula = "gen + train" if mode == "sync" else "max(gen, train)"
    startup = [r["startup_s"] for r in runs if "startup_s" in r]
    return [size, length, mode,
            f"{med['time/step']:.3g} / ({formula} = {parts:.3g}) = {med['time/step'] / parts:.2f}",
            f"{med['time/refit'] / med['time/step']:.3f}",
            ratio(med["tokens/sampled"] / med["time/generate"], lim["engine_tok_s"])
            + f" (s: {ratio(med['time/generate'], lim['engine_s'])})",
            f"{lim['train_flop_s'] / 1e9:.3g} / {lim['peak_flop_s'] / 1e9:.3g} = "
            f"{lim['train_flop_s'] / lim['peak_flop_s']:.2f} ({lim['threads']} thr)",
            f"{statistics.median(startup):.1f}" if startup else "—"]


def memory_rows(size: str, mode: str, runs: list[dict]) -> list[list[str]]:
    """Peak RSS per process role (largest run) and its growth from the end of step 2 to the last step."""
    roles = sorted({role for r in runs for role in r.get("memory", {})})
    rows = []
    for role in roles:
        mine = [r["memory"][role] for r in runs if role in r.get("memory", {})]
        rows.append([size, mode, role, f"{max(m['peak_mib'] for m in mine):.0f}",
                     " / ".join(f"{m['growth_mib']:+.0f}" for m in mine)])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, sizes="tiny,30m", lengths="128")
    p.add_argument("--modes", default="sync", help="rollout.mode(s) of the loop runs")
    args = p.parse_args()
    apply_quick(args)
    modes = args.modes.split(",")
    records = [r for r in sweep(args, {m: [f"rollout.mode={m}"] for m in modes}) if "summary" in r]
    rows, targets, memory, bars = [], [], [], []
    for size, length in cells(args):
        for mode in modes:
            lim = limits(size, length, args, mode)
            runs = [r for r in records if (r["size"], r["length"], r["variant"]) == (size, length, mode)]
            if not runs:
                rows.append([size, length, mode, "failed"] + [""] * 5)
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
                         f"{lim['engine_s']:.3g} / {lim['train_s']:.3g}"])
            targets.append(limit_row(size, length, mode, runs, lim))
            memory += memory_rows(size, mode, runs)
    head = ["model", "max tokens", "mode", "step s", "engine busy s",
            "wait_batch / logprobs / train / refit / other (s)",
            "sampled tok/s: loop / engine alone", "trained tok/s: loop / trainer alone",
            "alone: generate / update (s)"]
    target_head = ["model", "max tokens", "mode", "overhead: step / parts alone (target ≤ 1.1 sync, ≤ 1.15 "
                   "async)", "refit / step (≤ 0.05)",
                   "generation tok/s: loop while generating / engine alone (s: engine busy per step / "
                   "alone)",
                   "trainer GFLOP/s / fp32 matmul peak (≥ 0.5)", "start-up to first step (s)"]
    body = intro("Where the time goes", args) + "\n".join([
        table(head, rows), "", "![stages](breakdown.png)", "",
        "Against the targets (engine alone, trainer alone and the matmul peak measured in this command; "
        "trainer FLOPs = 3 x (2 x parameters x tokens + causal attention); start-up = process start to the "
        "first step's start). The engine alone runs every request to max tokens; the loop's samples stop "
        "at EOS, yet a round lasts until its longest sample, so its tok/s counts fewer tokens for the same "
        "engine steps: the seconds compare one round of generation in the loop with one alone:", "",
        table(target_head, targets), "",
        "Peak RSS per process role (MiB, the largest process of that role) and its change from the end of "
        "step 2 to the end of the last step, per run:", "",
        table(["model", "mode", "process", "peak RSS MiB", "growth MiB (per run)"], memory)])
    if not args.no_results and bars:
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
