"""Profile Molt's driver process (the loop, rollout pool, agents, batching) with cProfile.

The engine and trainer are separate processes whose time shows up in the loop's `time/*` metrics; the
driver is where framework overhead lives, so this profiles exactly that and prints the top functions.

    python bench/profile_driver.py --quick
    python bench/profile_driver.py --size 30m --length 128 --steps 4 [-- extra.override=value ...]
"""

from __future__ import annotations

import argparse
import os
import pstats
import subprocess
import sys

from common import OUT, REPO
from molt_run import overrides


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny")
    p.add_argument("--length", type=int, default=16)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--top", type=int, default=30, help="functions to print")
    p.add_argument("--quick", action="store_true", help="tiny, 16 tokens, 3 steps")
    p.add_argument("extra", nargs="*", help="more Hydra overrides (e.g. rollout.mode=async)")
    args = p.parse_args()
    if args.quick:
        args.size, args.length, args.steps = "tiny", 16, 3
    run_dir = OUT / "profile" / f"{args.size}-{args.length}"
    run_dir.mkdir(parents=True, exist_ok=True)
    stats = run_dir / "driver.prof"
    cmd = [sys.executable, "-m", "cProfile", "-o", str(stats), "-m", "molt",
           *overrides(args.size, args.length, args.steps, args.prompts_per_step, args.samples_per_prompt,
                      extra=args.extra), f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    subprocess.run(cmd, cwd=REPO, env=env, check=True)
    for key in ("cumulative", "tottime"):
        print(f"\n==== top {args.top} by {key} (driver process; stats in {stats}) ====")
        pstats.Stats(str(stats)).sort_stats(key).print_stats(args.top)


if __name__ == "__main__":
    main()
