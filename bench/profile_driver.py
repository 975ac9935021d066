"""Profile Molt's driver process (the loop, rollout pool, agents, batching) with cProfile.

The engine and trainer are separate processes whose time shows up in the loop's `time/*` metrics; the
driver is where framework overhead lives, so this profiles exactly that and prints the top functions,
then the driver process's own CPU seconds (user + system, psutil, sampled each time a step's metrics row
is written) per step after the first, and those seconds split by the driver's threads (by their OS
names: `main` is the loop's; Ray's own threads are named, Python's other threads all read `python`);
cProfile inflates Python calls, so `--no-cprofile` runs the same driver without it for that figure alone.

    python bench/profile_driver.py --quick
    python bench/profile_driver.py --size 30m --length 128 --steps 4 [-- extra.override=value ...]
"""

from __future__ import annotations

import argparse
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from common import OUT, REPO
from molt_run import overrides

if TYPE_CHECKING:
    import psutil


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny")
    p.add_argument("--length", type=int, default=16)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--top", type=int, default=30, help="functions to print")
    p.add_argument("--quick", action="store_true", help="tiny, 16 tokens, 3 steps")
    p.add_argument("--no-cprofile", action="store_true", help="only the driver's CPU s per step, unprofiled")
    p.add_argument("extra", nargs="*", help="more Hydra overrides (e.g. rollout.mode=async)")
    args = p.parse_args()
    if args.quick:
        args.size, args.length, args.steps = "tiny", 16, 3
    run_dir = OUT / "profile" / f"{args.size}-{args.length}{'-unprofiled' if args.no_cprofile else ''}"
    run_dir.mkdir(parents=True, exist_ok=True)
    stats = run_dir / "driver.prof"
    profiler = [] if args.no_cprofile else ["-m", "cProfile", "-o", str(stats)]
    cmd = [sys.executable, *profiler, "-m", "molt",
           *overrides(args.size, args.length, args.steps, args.prompts_per_step, args.samples_per_prompt,
                      extra=args.extra), f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)   # a rerun appends to the same folder
    cpu, threads = step_cpu(subprocess.Popen(cmd, cwd=REPO, env=env), run_dir / "metrics.jsonl")
    for key in () if args.no_cprofile else ("cumulative", "tottime"):
        print(f"\n==== top {args.top} by {key} (driver process; stats in {stats}) ====")
        pstats.Stats(str(stats)).sort_stats(key).print_stats(args.top)
    per_step = [round(b - a, 3) for a, b in zip(cpu, cpu[1:], strict=False)]
    print(f"driver CPU s per step after the first ({'unprofiled' if args.no_cprofile else 'under cProfile'}):"
          f" {per_step}")
    for step, (a, b) in enumerate(zip(threads, threads[1:], strict=False), start=2):
        spent = {name: b[name] - a.get(name, 0.0) for name in b}
        top = sorted(spent.items(), key=lambda kv: -kv[1])
        print(f"  step {step} by thread: " + ", ".join(f"{name} {s:.2f}" for name, s in top if s >= 0.01))


def step_cpu(proc: subprocess.Popen, metrics: Path) -> tuple[list[float], list[dict[str, float]]]:
    """The driver's CPU seconds each time a step's row lands in `metrics`, until it exits (check=True), and
    at each of those marks its threads' CPU seconds summed by thread name."""
    import psutil

    driver, marks, threads, rows = psutil.Process(proc.pid), [], [], 0
    while proc.poll() is None:
        seen = metrics.read_text().count("\n") if metrics.exists() else 0
        if seen > rows:
            try:
                marks.append(sum(driver.cpu_times()[:2]))
                threads.append(thread_cpu(driver))
            except psutil.NoSuchProcess:
                break
            rows = seen
        time.sleep(0.2)
    if proc.wait():
        raise subprocess.CalledProcessError(proc.returncode, proc.args)
    return marks, threads


def thread_cpu(process: psutil.Process) -> dict[str, float]:
    """User + system seconds of `process`'s live threads, summed by OS thread name (`main`: its first)."""
    out: dict[str, float] = {}
    for t in process.threads():
        try:
            comm = Path(f"/proc/{process.pid}/task/{t.id}/comm")
            name = "main" if t.id == process.pid else comm.read_text().strip()
        except OSError:   # the thread ended meanwhile
            continue
        out[name] = out.get(name, 0.0) + t.user_time + t.system_time
    return out


if __name__ == "__main__":
    main()
