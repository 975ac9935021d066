"""Run `python -m molt` as a user would (a fresh process per run) and read back its metrics.jsonl.

Each run gets its own directory; the launcher's per-step metrics are the only source of timings, so
a benchmark measures exactly what a run reports. Startup (Ray, engine, trainer) is reported apart
from the steps as `setup_s` = process wall time minus the sum of step times.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import LR, OUT, REPO, SIZES
from memory import RssWatch

# Everything a benchmark run does not need is off: W&B, plots, progress bar, rollout dumps, evals.
QUIET = ["logging.wandb.mode=disabled", "logging.plots=false", "logging.progress=false",
         "logging.dump_rollouts=false", "train.eval_every=0"]


def overrides(size: str, max_tokens: int, steps: int, prompts: int, samples: int,
              lr: float | None = None, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Hydra overrides for one Molt run of the repeat task with GRPO (TRL's estimator) at `size`."""
    out = ["algo=grpo", f"rollout.max_tokens={max_tokens}", f"train.steps={steps}",
           f"train.prompts_per_step={prompts}", f"rollout.samples_per_prompt={samples}",
           f"train.micro_batch_size={prompts * samples}", f"train.lr={lr if lr is not None else LR[size]}",
           f"model.max_model_len={max(256, 2 * max_tokens + 64)}",
           # async: the engine samples the next batch while the trainer steps on this one, no deeper
           # (deeper only produces groups that go stale and are sampled again); sync ignores it
           f"rollout.groups_in_flight={prompts}"]
    for key, value in SIZES[size].items():
        # keys the tiny default does not list (intermediate_size) must be added, not overridden
        known = key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size")
        out.append(f"{'' if known else '+'}model.tiny.{key}={value}")
    return out + QUIET + list(extra)


def step_records(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    """metrics.jsonl rows → the records `common.summarize` takes (generate = the engine's busy seconds)."""
    return [{"time": r["time/step"], "sampled": r.get("tokens/sampled", 0.0),
             "trained": r.get("tokens/trained", 0.0), "reward": r.get("reward/mean", float("nan")),
             "generate": r.get("time/generate", float("nan"))}
            for r in rows]


def run_molt(args: list[str], run_dir: Path, timeout: float = 1800, module: str = "molt") -> dict[str, Any]:
    """Run Molt (`python -m molt`, or another command `module`: molt.sft) with these overrides in `run_dir`;
    returns {rows, steps, wall_s, setup_s, rc, log}.

    A failed or timed-out run comes back with rc != 0 and the tail of its log, not an exception, so a
    sweep keeps going and reports what failed.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", module, *args, f"hydra.run.dir={run_dir}"]
    start, epoch, load = time.perf_counter(), time.time(), os.getloadavg()[0]  # 1-minute load at the start
    with (run_dir / "molt.log").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        watch = RssWatch(proc.pid).start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = 124
        watch.stop()
    wall = time.perf_counter() - start
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] \
        if metrics.exists() else []
    timed = [r for r in rows if "time/step" in r]
    steps = step_records(timed)
    tail = (run_dir / "molt.log").read_text()[-3000:] if rc else ""
    out = {"cmd": " ".join(cmd), "dir": str(run_dir), "rc": rc, "rows": rows, "steps": steps, "wall_s": wall,
           "load": load,
           "setup_s": wall - sum(s["time"] for s in steps), "log": tail}
    if timed:   # from the process start to the start of the first step; memory from step 2's end on
        out["startup_s"] = timed[0]["time"] - timed[0]["time/step"] - epoch
        out["memory"] = watch.summary(timed[min(1, len(timed) - 1)]["time"], timed[-1]["time"])
    return out


def run_cached(args: list[str], reuse: bool, timeout: float = 1800, module: str = "molt") -> dict[str, Any]:
    """`run_molt` in bench/out/runs/<hash of the overrides>; with `reuse`, a finished run there is read back.

    Lets the benchmarks that look at the same runs from different sides (scaling, refit, mismatch,
    breakdown) share them when asked to (`--reuse`), instead of paying Molt's start-up again.
    """
    key = hashlib.sha1(json.dumps(sorted(args) + ([module] if module != "molt" else [])).encode()
                       ).hexdigest()[:12]
    run_dir = OUT / "runs" / key
    saved = run_dir / "result.json"
    if reuse and saved.exists():
        result = json.loads(saved.read_text())
        if result["rc"] == 0:
            return result
    if run_dir.exists():
        shutil.rmtree(run_dir)
    result = run_molt(args, run_dir, timeout, module)
    saved.write_text(json.dumps(result))
    return result


def medians(rows: list[dict[str, float]], warmup: int, prefix: str = "") -> dict[str, float]:
    """Median over the timed steps (after `warmup`) of every metric whose name starts with `prefix`."""
    timed = rows[warmup:] if len(rows) > warmup else rows[-1:]
    keys = sorted({k for r in timed for k in r if k.startswith(prefix) and k not in ("step", "time")})
    return {k: statistics.median(r[k] for r in timed if k in r) for k in keys}


def metric(values: dict[str, float], *names: str) -> float:
    """The first of `names` present (metric names that moved between versions), else NaN."""
    return next((values[n] for n in names if n in values), float("nan"))


# Default steps per run: the same in every benchmark, so `--reuse` can share runs between them.
STEPS = "tiny=8,30m=3,100m=3"


def add_flags(p: argparse.ArgumentParser, sizes: str, lengths: str, steps: str = STEPS,
              repeats: int = 1) -> None:
    """The flags every Molt-only benchmark shares."""
    p.add_argument("--sizes", default=sizes, help=f"comma list of bench/common.py SIZES (default {sizes})")
    p.add_argument("--lengths", default=lengths, help=f"comma list of max tokens (default {lengths})")
    p.add_argument("--steps", default=steps, help="optimizer steps per run: N, or per size: tiny=8,30m=4")
    p.add_argument("--warmup", type=int, default=1, help="first steps of each run left out of the timings")
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--skip", default="", help="size:length cells to leave out, e.g. 100m:128")
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--reuse", action="store_true",
                   help="reuse finished runs with identical overrides (scaling/refit/mismatch/breakdown)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny, 16 tokens, 3 steps, 1 repeat; "
                   "prints the section instead of writing RESULTS.md")
    p.add_argument("--no-results", action="store_true",
                   help="print the section; write neither bench/RESULTS.md nor the PNG")


def apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        args.sizes, args.lengths, args.steps, args.warmup, args.repeats = "tiny", "16", "3", 1, 1
        args.no_results = True


def cells(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(size, max tokens) pairs of --sizes x --lengths, minus --skip."""
    skip = set(filter(None, args.skip.split(",")))
    return [(size, int(n)) for size in args.sizes.split(",") for n in args.lengths.split(",")
            if f"{size}:{n}" not in skip]


def sweep(args: argparse.Namespace, variants: dict[str, list[str]]) -> list[dict[str, Any]]:
    """Run Molt for every repeat x size x length x variant (extra overrides); one record per run."""
    from common import parse_steps, summarize

    steps = parse_steps(args.steps, args.sizes.split(","))
    records = []
    for r in range(args.repeats):
        for size, length in cells(args):
            for name, extra in variants.items():
                run_args = overrides(size, length, steps[size], args.prompts_per_step,
                                     args.samples_per_prompt, extra=[f"run.name=bench-r{r}", *extra])
                result = run_cached(run_args, args.reuse, args.timeout)
                rec = {"size": size, "length": length, "variant": name, "repeat": r, "rc": result["rc"],
                       "setup_s": result["setup_s"], "cmd": result["cmd"],
                       **{k: result[k] for k in ("startup_s", "memory") if k in result}}
                if result["rc"] == 0 and result["steps"]:
                    rec["summary"] = summarize(result["steps"], args.warmup)
                    timed = [x for x in result["rows"] if "time/step" in x]
                    rec["medians"] = medians(timed, args.warmup)
                    rec["rows"] = timed[args.warmup:] or timed
                status = "ok" if "summary" in rec else f"FAILED rc={result['rc']}\n{result['log']}"
                print(f"[bench] {size} {length} tok {name} r{r}: {status}", flush=True)
                records.append(rec)
    return records


def finish(args: argparse.Namespace, name: str, body: str) -> None:
    """Write the section (a real run) or only print it (--quick, --no-results)."""
    from common import write_section

    if not args.no_results:
        write_section(name, body)
    print(body)


def model_path(size: str) -> str:
    """The molt.inputs.tiny folder of `size` (built on first use): the same folder Molt's own run loads."""
    from molt.inputs.tiny import tiny_model_path

    return str(tiny_model_path(**SIZES[size]))


def intro(title: str, args: argparse.Namespace) -> str:
    """Section title, machine/versions/date, the work per step and the exact command."""
    from common import header

    command = "python " + " ".join(["bench/" + Path(sys.argv[0]).name, *sys.argv[1:]])
    return "\n".join([f"## {title}", "", header(),
                      f"- work: repeat-the-letter task, GRPO, {args.prompts_per_step} prompts x "
                      f"{args.samples_per_prompt} samples per step, steps {args.steps} (first {args.warmup} "
                      f"untimed), {args.repeats} repeat(s)", f"- command: `{command}`", ""])
