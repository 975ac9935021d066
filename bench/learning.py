"""Does the loop learn? Each estimator that needs no teacher, on the default task: reward curves compared.

Each estimator is one `python -m molt algo=NAME` run of the default experiment (gae adds the critic),
everything else as the default run has it, so the curves differ only by the estimator. The target is a
mean reward of at least 0.8 (of 1.0) within 400 steps; the table says which runs reach it and when.

    python bench/learning.py --quick                 # 10 steps each: a smoke test, prints the section
    python bench/learning.py [--steps 400] [--estimators grpo,rloo] [--seeds 0,1] [--reuse]
    python bench/learning.py --staleness 1,4 [--steps 200] [--groups-in-flight 32] [--jobs 2]

`--staleness` is the staleness axis instead: grpo in async mode at each `rollout.max_staleness`, with the
default correction (none) and with decoupled PPO (`algo=decoupled_ppo`), section `staleness`. The pool
hands out the oldest groups first (`rollout.handout=oldest`) with prompts_per_step x (1 + K) groups in
flight, so the trained tokens really are up to K versions old (freshest first, the lag stays ≈ 1).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from common import BENCH, header, table
from molt_run import QUIET, run_cached

ESTIMATORS = ("reinforce_pp", "reinforce_baseline", "grpo", "dr_grpo", "rloo", "gae")
TARGET = 0.8
WINDOW = 20   # steps in the rolling mean that decides when a run reached the target


def rolling(values: list[float], window: int = WINDOW) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def run(estimator: str, steps: int, seed: int, reuse: bool, timeout: float) -> dict:
    args = [f"algo={estimator}", f"train.steps={steps}", f"run.seed={seed}", f"run.name=learning-{estimator}",
            *QUIET, *(["model.critic=true"] if estimator == "gae" else [])]
    result = run_cached(args, reuse, timeout)
    rewards = [r["reward/mean"] for r in result["rows"] if "reward/mean" in r]
    status = "ok" if result["rc"] == 0 else f"FAILED rc={result['rc']}\n{result['log']}"
    print(f"[bench] {estimator} seed {seed}: {status}", flush=True)
    return {"estimator": estimator, "seed": seed, "rc": result["rc"], "rewards": rewards,
            "wall_s": result["wall_s"], "load": result["load"], "cmd": result["cmd"]}


def run_stale(algo: str, staleness: int, steps: int, depth: int | None, seed: int, reuse: bool,
              timeout: float) -> dict:
    """One async run of the default task at `rollout.max_staleness=staleness`, oldest groups first, with
    `depth` groups in flight (None: the default batch of 8 groups x (1 + staleness), so that the oldest
    waiting groups are `staleness` versions old when handed out)."""
    depth = depth or 8 * (1 + staleness)
    args = [f"algo={algo}", "rollout.mode=async", f"rollout.max_staleness={staleness}",
            "rollout.handout=oldest", f"rollout.groups_in_flight={depth}", f"train.steps={steps}",
            f"run.seed={seed}", f"run.name=staleness-{algo}-{staleness}", *QUIET]
    result = run_cached(args, reuse, timeout)
    rows = [r for r in result["rows"] if "reward/mean" in r]
    print(f"[bench] {algo} staleness {staleness}: rc={result['rc']}", flush=True)
    if result["rc"]:
        print(result["log"], flush=True)
    return {"estimator": f"{algo}, staleness {staleness}", "seed": seed, "rc": result["rc"],
            "rewards": [r["reward/mean"] for r in rows], "wall_s": result["wall_s"], "load": result["load"],
            "lag_mean": statistics.fmean(r.get("policy/lag_mean", 0.0) for r in rows) if rows else 0.0,
            "lag_max": max((r.get("policy/lag_max", 0.0) for r in rows), default=0.0),
            "requeued": max((r.get("pool/stale_requeued", 0.0) for r in rows), default=0.0)}


def staleness_axis(args: argparse.Namespace) -> None:
    from concurrent.futures import ThreadPoolExecutor

    cells = [(algo, int(k), int(seed)) for seed in args.seeds.split(",") for k in args.staleness.split(",")
             for algo in ("grpo", "decoupled_ppo")]
    with ThreadPoolExecutor(args.jobs) as pool:   # each run is its own process tree
        records = list(pool.map(lambda c: run_stale(c[0], c[1], args.steps, args.groups_in_flight, c[2],
                                                    args.reuse, args.timeout), cells))
    command = "python " + " ".join(["bench/learning.py", *sys.argv[1:]])
    head = ["run", "seed", "reward first 20%", "reward last 20%", f"best {WINDOW}-step mean",
            f"first step with {WINDOW}-step mean >= {TARGET}", "wall (1-min load at start)",
            "policy/lag_mean (mean over steps)", "policy/lag_max", "groups re-queued (stale)"]
    rows = [summary_row(r) + [f"{r['lag_mean']:.2f}", f"{r['lag_max']:.0f}", f"{r['requeued']:.0f}"]
            for r in records]
    body = "\n".join([
        "## Staleness: async grpo at several rollout.max_staleness, without and with decoupled PPO", "",
        header(), f"- work: the default experiment with `rollout.mode=async rollout.max_staleness=K "
        f"rollout.handout=oldest rollout.groups_in_flight={args.groups_in_flight or '8 x (1 + K)'}`, "
        "`algo=grpo` (no correction) or "
        f"`algo=decoupled_ppo`, {args.steps} steps, evaluation and logging off", f"- command: `{command}`",
        "", table(head, rows), "", "![staleness curves](staleness.png)"])
    if not args.quick:
        draw(records, BENCH / "staleness.png")
        from common import write_section

        write_section("staleness", body)
    print(body)


def summary_row(rec: dict) -> list:
    rewards = rec["rewards"]
    if rec["rc"] or not rewards:
        return [rec["estimator"], rec["seed"], "failed", "", "", "", ""]
    fifth = max(1, len(rewards) // 5)
    reached = next((i + 1 for i, r in enumerate(rolling(rewards)) if r >= TARGET), None)
    return [rec["estimator"], rec["seed"], f"{statistics.fmean(rewards[:fifth]):.3f}",
            f"{statistics.fmean(rewards[-fifth:]):.3f}", f"{max(rolling(rewards)):.3f}",
            reached if reached else "not reached", f"{rec['wall_s']:.0f} s (load {rec['load']:.1f})"]


def draw(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for rec in records:
        if rec["rewards"]:
            ax.plot(range(1, len(rec["rewards"]) + 1), rolling(rec["rewards"]), lw=1.4,
                    label=f"{rec['estimator']} (seed {rec['seed']})")
    ax.axhline(TARGET, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel(f"train reward, rolling mean of {WINDOW} steps")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--estimators", default=",".join(ESTIMATORS), help="comma list (default: all six)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seeds", default="0", help="comma list of run.seed values")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--reuse", action="store_true", help="read back finished runs with identical overrides")
    p.add_argument("--quick", action="store_true", help="10 steps each; prints the section, writes nothing")
    p.add_argument("--staleness", default=None, help="comma list of rollout.max_staleness: the staleness "
                   "axis (async grpo, with and without decoupled PPO) instead of the estimators")
    p.add_argument("--groups-in-flight", type=int, default=None,
                   help="staleness axis: rollout.groups_in_flight (default 8 x (1 + K))")
    p.add_argument("--jobs", type=int, default=1, help="staleness axis: runs at once (each is a whole run)")
    args = p.parse_args()
    if args.quick:
        args.steps = 10
    if args.staleness:
        return staleness_axis(args)
    records = [run(e, args.steps, int(s), args.reuse, args.timeout)
               for s in args.seeds.split(",") for e in args.estimators.split(",")]
    command = "python " + " ".join(["bench/learning.py", *sys.argv[1:]])
    head = ["estimator", "seed", "reward first 20%", "reward last 20%", f"best {WINDOW}-step mean",
            f"first step with {WINDOW}-step mean >= {TARGET}", "wall (1-min load at start)"]
    body = "\n".join([
        "## Learning: every estimator on the default task", "", header(),
        f"- work: the default experiment (`python -m molt`) with `algo=NAME` (gae: `model.critic=true`), "
        f"{args.steps} steps, evaluation and logging off", f"- command: `{command}`", "",
        table(head, [summary_row(r) for r in records]), "", "![learning curves](learning.png)"])
    if not args.quick:
        draw(records, BENCH / "learning.png")
        from common import write_section

        write_section("learning", body)
    print(body)


if __name__ == "__main__":
    main()
