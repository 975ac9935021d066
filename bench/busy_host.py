"""`parallel.cpu_threads` on an idle and on a busy host: the tool example's SFT and RL steps.

    python bench/busy_host.py [--busy 0,2] [--threads null,1] [--steps 12] [--write]

Each cell is a fresh `python -m molt.sft +experiment=tool_sft` (SFT) and `python -m molt +experiment=tool_rl`
(RL, from the tiny model: the step's work, not its learning, is timed) run, with `--busy` processes that
spin a core each (`python -c 'while 1: pass'`) started beside it and stopped after it: the load of other
work on a shared workstation or CI runner. The step time is the median `time/step` after the warm-up steps;
the ratio column is each setting's over `cpu_threads=1` at the same load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from common import OUT, header, table, write_section
from molt_run import QUIET, run_molt

STAGES = {   # stage -> (command, the example's overrides for a short timed run)
    "sft": ("molt.sft", ["+experiment=tool_sft", "train.save_every=0", "train.eval_every=0",
                         "train.export_hf=false"]),
    "rl": ("molt", ["+experiment=tool_rl", "model.path=null", "train.save_every=0", "train.eval_every=0",
                    "train.export_hf=false", "train.best_metric=null"]),
}


def spin(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(count)]


def cell(stage: str, busy: int, threads: str, steps: int, warmup: int) -> dict[str, float]:
    module, args = STAGES[stage]
    run_dir = OUT / "busy_host" / f"{stage}_busy{busy}_threads{threads}"
    spinners = spin(busy)
    try:
        result = run_molt([*args, *QUIET, f"train.steps={steps}", f"parallel.cpu_threads={threads}"], run_dir,
                          module=module)
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()
    if result["rc"]:
        raise RuntimeError(f"{result['cmd']} failed ({result['rc']}):\n{result['log']}")
    times = [s["time"] for s in result["steps"]][warmup:]
    return {"step_s": statistics.median(times), "max_s": max(times), "load": result["load"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default="sft,rl")
    parser.add_argument("--busy", default="0,2", help="comma list: processes spinning beside the run")
    parser.add_argument("--threads", default="null,1", help="comma list of parallel.cpu_threads settings")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="write the table into bench/RESULTS.md")
    args = parser.parse_args()
    head = header()   # the machine and the load when the run starts, not when it ends
    command = (f"python bench/busy_host.py --stages {args.stages} --busy {args.busy} --threads "
               f"{args.threads} --steps {args.steps} --write")
    cells = [(stage, int(busy), threads) for stage in args.stages.split(",") for busy in args.busy.split(",")
             for threads in reversed(args.threads.split(","))]   # cpu_threads=1 first: the ratios' base
    rows, base = [], {}
    for n, (stage, busy, threads) in enumerate(cells, 1):
        r = cell(stage, busy, threads, args.steps, args.warmup)
        base.setdefault((stage, busy), r["step_s"])
        rows.append([stage, str(busy), threads, f"{r['step_s']:.3f}", f"{r['max_s']:.3f}",
                     f"{r['step_s'] / base[stage, busy]:.2f}", f"{r['load']:.1f}"])
        print(" | ".join(rows[-1]), flush=True)
        text = table(["stage", "busy processes beside it", "parallel.cpu_threads", "median step s",
                      "slowest step s", "vs cpu_threads=1", "1-min load at start"], rows)
        if args.write:   # after every cell: on a busy host the run is long, and a stopped one keeps its rows
            done = "" if n == len(cells) else f" ({n} of {len(cells)} cells: the run stopped before the rest)"
            write_section("busy_host", f"## Busy host: parallel.cpu_threads null vs 1\n\n`{command}` "
                          f"({os.cpu_count()} cores){done}\n\n{head}\n\n{text}\n")
    print(text)


if __name__ == "__main__":
    main()
