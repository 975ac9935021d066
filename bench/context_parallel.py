"""Context parallel on this CPU: the longest rollout a trainer rank trains under a memory cap, and the step
time and peak memory per rank at given lengths, cp=1 against cp=2 (`parallel.cp_size`).

Each layout is a real `TrainerRanks` group (Ray actors, gloo) of the tiny model in fp32 (or another size of
bench/common.py) training on one rollout: 8 prompt tokens and `length - 8` sampled ones, in one micro-batch.
Peak memory per rank: the growth of the rank's resident memory during one `update` (Linux's VmHWM, reset
through /proc/self/clear_refs just before; glibc's mmap threshold fixed low so that freed tensors leave at
once), the largest over the group's ranks; beside it the memory plan's activations + logits for the same
spec (molt/plan/memory.py, which divides them by cp_size). Step time: the median seconds of `update` over
`--repeats` steps after an untimed one. Layouts: cp=1 with 1 and with 2 threads (its best on 2 cores), cp=2
with 1 thread per rank.

The longest rollout under `--cap-mib`: lengths double from 4096 while a step's peak stays under the cap,
then bisect to a multiple of 2048.

`--learning` instead runs the default experiment as a user would (`python -m molt parallel=cpu2`, 400
steps) with cp_size 1 and 2 and compares the reward curves and the engine/trainer gap (section
`context_parallel_learning`).

    python bench/context_parallel.py --lengths 8192,16384,32768 --cap-mib 256 --write
    python bench/context_parallel.py --learning [--steps 400] --write
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from common import BENCH, OUT, SIZES, header, table, write_section

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
PROMPT, MIB = 8, 2**20
LAYOUTS = {"cp=1, 1 thread": (1, 1), "cp=1, 2 threads": (1, 2), "cp=2, 1 thread per rank": (2, 1)}


def rollout(length: int) -> dict:
    """One row: PROMPT prompt tokens and `length - PROMPT` sampled ones with a behaviour logprob each."""
    import torch

    from molt.trainer import make_batch
    from molt.trajectory import Segment

    g = torch.Generator().manual_seed(length)
    mask = [0] * PROMPT + [1] * (length - PROMPT)
    segment = Segment(torch.randint(3, 300, (length,), generator=g).tolist(), mask, [-5.0 * m for m in mask],
                      [0 if m else -1 for m in mask], "r0", "g0", prompt_len=PROMPT, finish_reason="length")
    return make_batch([segment], advantages=[[0.0] * PROMPT + [1.0] * (length - PROMPT)])


def spec_for(path: str, cp: int, threads: int, length: int):
    from molt.spec import RunSpec

    return RunSpec.model_validate({
        "model": {"path": path, "max_model_len": length + 1},
        "parallel": {"cp_size": cp, "cpu_threads": threads},
        "agent": {"max_total_tokens": length},
        "rollout": {"samples_per_prompt": 2, "max_tokens": 8},
        "train": {"prompts_per_step": 1, "micro_batch_size": 1}})


def _reset_peak(worker) -> int:   # runs inside a rank (`__ray_call__`)
    Path("/proc/self/clear_refs").write_text("5")   # VmHWM := VmRSS
    return _status_kib("VmRSS")


def _peak(worker) -> int:
    return _status_kib("VmHWM")


def _status_kib(field: str) -> int:
    line = next(x for x in open("/proc/self/status") if x.startswith(field + ":"))
    return int(line.split()[1])


def step(group, length: int) -> tuple[float, float]:
    """One `update` of a `length`-token rollout: its seconds and the largest rank's memory growth (MiB)."""
    import ray

    batch = rollout(length)
    before = ray.get([w.__ray_call__.remote(_reset_peak) for w in group.workers])
    start = time.perf_counter()
    group.update(batch)
    seconds = time.perf_counter() - start
    after = ray.get([w.__ray_call__.remote(_peak) for w in group.workers])
    return seconds, max(a - b for a, b in zip(after, before, strict=True)) / 1024


def planned_mib(path: str, cp: int, length: int) -> float:
    from molt.plan.arch import arch_of
    from molt.plan.memory import trainer_estimate

    spec = spec_for(path, cp, 1, length)
    parts = trainer_estimate(spec, "policy", arch_of(spec)).parts
    return (parts["activations"] + parts["logits"]) / MIB


def longest_under(group, cap_mib: float, limit: int) -> tuple[int, list[tuple[int, float]]]:
    """The longest rollout (a multiple of 2048, at most `limit`) whose step stays under `cap_mib`, and every
    (length, peak MiB) probed."""
    probed: list[tuple[int, float]] = []

    def fits(length: int) -> bool:
        probed.append((length, step(group, length)[1]))
        print(f"  {length} tokens: {probed[-1][1]:.0f} MiB", flush=True)
        return probed[-1][1] <= cap_mib
    good, bad = 0, 4096
    while bad <= limit and fits(bad):
        good, bad = bad, 2 * bad
    bad = min(bad, limit + 2048)
    while bad - good > 2048:
        mid = (good + bad) // 2 // 2048 * 2048
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good, probed


def plot(rows: dict, lengths: list[int], cap: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, sec) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, by_length in rows.items():
        mem.plot(lengths, [by_length[n]["peak_mib"] for n in lengths], "o-", label=name)
        sec.plot(lengths, [by_length[n]["step_s"] for n in lengths], "o-", label=name)
    mem.axhline(cap["cap_mib"], color="grey", ls="--", lw=1, label=f"cap {cap['cap_mib']:g} MiB")
    mem.set(xlabel="rollout tokens", ylabel="peak memory growth per rank (MiB)", xscale="log", yscale="log")
    sec.set(xlabel="rollout tokens", ylabel="update seconds", xscale="log", yscale="log")
    for ax in (mem, sec):
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xticks(lengths, [f"{n // 1024}K" for n in lengths])
        ax.grid(alpha=0.3)
    mem.legend(fontsize=8)
    fig.suptitle(f"context parallel, tiny model, one rollout per step; longest under the cap: cp=1 "
                 f"{cap[1] // 1024}K, cp=2 {cap[2] // 1024}K tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(BENCH / "context_parallel.png", dpi=110)


def learning(steps: int, write: bool) -> None:
    """The default experiment on dp=2 ranks, cp_size 1 and 2: reward and gap per step, side by side."""
    from learning import rolling
    from molt_run import QUIET, run_molt

    head, runs = header(), {}
    for cp in (1, 2):
        args = ["parallel=cpu2", f"parallel.cp_size={cp}", f"train.steps={steps}", *QUIET]
        out = OUT / f"context_parallel_learning_cp{cp}"
        shutil.rmtree(out, ignore_errors=True)   # a run appends to the metrics.jsonl it finds
        runs[cp] = run_molt(args, out, timeout=3600)
        runs[cp]["command"] = "python -m molt " + " ".join(args[:3])
        print(f"cp={cp}: rc={runs[cp]['rc']}", flush=True)
    rows = []
    for r in runs.values():
        reward = [x["reward/mean"] for x in r["rows"] if "reward/mean" in x]
        gap = [x["mismatch/max_abs"] for x in r["rows"] if "mismatch/max_abs" in x]
        fifth = max(1, len(reward) // 5)
        reached = next((i + 1 for i, v in enumerate(rolling(reward)) if v >= 0.8), None)
        rows.append([f"`{r['command']}`", r["rc"], len(reward), f"{statistics.fmean(reward[:fifth]):.3f}",
                     f"{statistics.fmean(reward[-fifth:]):.3f}", reached or "never", f"{max(gap):.1e}",
                     f"{statistics.median(gap):.1e}", f"{r['wall_s'] / 60:.1f}"])
        r["reward"] = reward
    body = "\n".join([
        "## Context parallel: the default experiment learns at cp_size=2 as at 1", "", head,
        f"- command: `python bench/context_parallel.py --learning --steps {steps} --write`",
        "- work: the default experiment (tiny model, repeat task, GRPO, sync) on 2 data-parallel ranks, "
        "without and with 2 cp ranks each (2 and 4 trainer ranks), one engine, 2 cores",
        "", table(["command", "rc", "steps", "reward, first 20%", "last 20%", "step the 20-step mean reaches "
                   "0.8", "gap max_abs, max over steps", "median", "wall min"], rows), "",
        "![context parallel learning](context_parallel_learning.png)"])
    print(body)
    if write:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.6))
        for cp, r in runs.items():
            ax.plot(range(1, len(r["reward"]) + 1), rolling(r["reward"]), label=f"cp_size={cp}")
        ax.set(xlabel="step", ylabel="reward (20-step mean)", title="parallel=cpu2, default experiment")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(BENCH / "context_parallel_learning.png", dpi=110)
        write_section("context_parallel_learning", body)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny", choices=list(SIZES))
    p.add_argument("--lengths", default="8192,16384,32768")
    p.add_argument("--cap-mib", type=float, default=512.0)
    p.add_argument("--limit", type=int, default=131072, help="longest rollout the cap search tries")
    p.add_argument("--repeats", type=int, default=2, help="timed steps per length (after an untimed one)")
    p.add_argument("--write", action="store_true", help="write the section and the plot into bench/")
    p.add_argument("--learning", action="store_true", help="the learning runs instead (their own section)")
    p.add_argument("--steps", type=int, default=400, help="--learning: steps per run")
    args = p.parse_args()
    if args.learning:
        learning(args.steps, args.write)
        return
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:   # before the first allocation: re-run with it
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    import ray

    from molt.inputs.tiny import tiny_model_path
    from molt.trainer import TrainerRanks

    head = header()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled",
                                       "MALLOC_MMAP_THRESHOLD_": "65536"}})
    path, lengths = str(tiny_model_path(**SIZES[args.size])), [int(n) for n in args.lengths.split(",")]
    rows: dict[str, dict[int, dict[str, float]]] = {}
    cap: dict = {"cap_mib": args.cap_mib}
    for name, (cp, threads) in LAYOUTS.items():
        group = TrainerRanks(spec_for(path, cp, threads, max(lengths)))
        rows[name] = {}
        for length in lengths:
            step(group, length)   # untimed: the first step at a length allocates what later ones reuse
            runs = [step(group, length) for _ in range(args.repeats)]
            rows[name][length] = {"step_s": statistics.median(r[0] for r in runs), "peak_mib": max(
                r[1] for r in runs), "plan_mib": planned_mib(path, cp, length)}
            print(name, length, rows[name][length], flush=True)
        if threads == 1:
            cap[cp], cap[f"probed{cp}"] = longest_under(group, args.cap_mib, args.limit)
            print(name, "longest under the cap:", cap[cp], flush=True)
        group.shutdown()
    ray.shutdown()
    lines = [[name, f"{n // 1024}K", f"{r['step_s']:.2f}", f"{r['peak_mib']:.0f}", f"{r['plan_mib']:.0f}"]
             for name, by_length in rows.items() for n, r in by_length.items()]
    probes = "; ".join(f"cp={cp}: " + ", ".join(f"{n // 1024}K {m:.0f}" for n, m in cap[f"probed{cp}"])
                       for cp in (1, 2))
    command = "python bench/context_parallel.py " + " ".join(sys.argv[1:])
    body = "\n".join([
        "## Context parallel: memory per rank and step time against rollout length", "", head,
        f"- command: `{command.strip()}`",
        f"- work: model {args.size}, fp32, one rollout of N tokens ({PROMPT} prompt) per `update`, one "
        "micro-batch; each layout a TrainerRanks group (Ray actors, gloo); step time: median of "
        f"{args.repeats} after an untimed step; peak: growth of the largest rank's resident memory during "
        "`update`; plan: the memory plan's activations + logits for the same spec",
        "", table(["layout", "tokens", "update s", "peak MiB per rank", "plan MiB per rank"], lines), "",
        f"**Longest rollout trained with every rank under {args.cap_mib:g} MiB: cp=1 {cap[1]} tokens, cp=2 "
        f"{cap[2]} tokens** (probed, tokens and MiB of the largest rank: {probes}).", "",
        "![context parallel](context_parallel.png)"])
    print(body)
    if args.write:
        plot(rows, lengths, cap)
        write_section("context_parallel", body)


if __name__ == "__main__":
    main()
