"""`python -m molt.sweep SWEEP_DIR`: which job of a sweep won — one table and one plot.

Writes `summary.md` (per job: steps, final and best reward, last evaluation, tokens/s, wall time) and
`rewards.png` (every job's reward curve on one axis) into the sweep directory. A multirun of
`python -m molt -m ...` does this by itself when its last job ends (`SweepSummary`, a Hydra callback
in conf/config.yaml); run it by hand for a sweep that stopped early or is still running.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

NOTES = ("final: mean `reward/mean` over the last 10% of steps; best: highest rolling mean of "
         "`reward/mean` (window: 10% of the steps, as in each job's plots/reward.png); eval: at the last "
         "evaluation, the job's `train.best_metric`, or without one the first data.eval set's "
         "`eval/NAME/mean@N` (N = rollout.eval.n); tokens/s: sampled tokens / step time; wall: first "
         "step's start to last step's end (start-up excluded).")


def job_row(job: Path) -> dict[str, Any]:
    """One job's numbers from its metrics.jsonl (and train.best_metric from its spec.yaml); only `job`
    when it logged no step."""
    import yaml

    from molt.driver.plot import read_metrics, rolling_mean

    metrics = job / "metrics.jsonl"
    rows = read_metrics(metrics) if metrics.is_file() else {}
    reward = [r["reward/mean"] for r in rows.values() if "reward/mean" in r]
    if not rows or not reward:
        return {"job": job.name}
    window = max(1, len(reward) // 10)
    last_eval = next((r for r in reversed(rows.values()) if any(k.startswith("eval/") for k in r)), {})
    spec = yaml.safe_load((job / "spec.yaml").read_text()) if (job / "spec.yaml").is_file() else {}
    # molt.driver.eval.set_metrics logs each set's mean@N first, and `evaluate` the sets in data.eval order
    metric = spec.get("train", {}).get("best_metric") or next(
        (k for k in last_eval if k.startswith("eval/") and "/mean@" in k), None)
    step_time = sum(r.get("time/step", 0.0) for r in rows.values())
    first, last = rows[min(rows)], rows[max(rows)]
    return {"job": job.name, "steps": max(rows), "final": sum(reward[-window:]) / len(reward[-window:]),
            "best": max(rolling_mean(reward, window)), "eval": last_eval.get(metric),
            "tokens_per_s": sum(r.get("tokens/sampled", 0.0) for r in rows.values()) / step_time
            if step_time else None,
            "wall_s": last["time"] - first["time"] + first.get("time/step", 0.0)}


# table column -> (job_row key, format); "—" where a job has no such number
COLUMNS = {"steps": ("steps", "d"), "final reward": ("final", ".3f"), "best reward": ("best", ".3f"),
           "eval reward": ("eval", ".3f"), "tokens/s": ("tokens_per_s", ".0f"), "wall (s)": ("wall_s", ".0f")}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| job | " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * len(COLUMNS)]
    for r in rows:
        cells = ["no step logged" if "steps" not in r and i == 0 else
                 "—" if r.get(key) is None else format(r[key], fmt)
                 for i, (key, fmt) in enumerate(COLUMNS.values())]
        lines.append(f"| `{r['job']}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_rewards(jobs: list[Path], out: Path) -> Path:
    """Every job's rolling-mean reward on one axis (its raw per-step reward faint behind it)."""
    from matplotlib.figure import Figure

    from molt.driver.plot import read_metrics, rolling_mean

    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    for job in jobs:
        if not (job / "metrics.jsonl").is_file():
            continue
        rows = read_metrics(job / "metrics.jsonl")
        steps = [s for s, r in rows.items() if "reward/mean" in r]
        reward = [rows[s]["reward/mean"] for s in steps]
        if steps:
            [line] = ax.plot(steps, rolling_mean(reward, max(1, len(reward) // 10)), linewidth=2,
                             label=job.name)
            ax.plot(steps, reward, color=line.get_color(), alpha=0.2, linewidth=1)
    ax.set(xlabel="step", ylabel="reward/mean", title=f"{out.parent.name}: train reward (rolling mean)")
    ax.legend(fontsize="small")
    fig.savefig(out, dpi=100, bbox_inches="tight")
    return out


def summarize(sweep_dir: str | Path) -> str:
    """Write summary.md and rewards.png into the sweep directory and return the table ("" and nothing
    written while no job has logged a step)."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"no such sweep directory: {sweep_dir}")
    jobs = [p for p in sweep_dir.iterdir() if (p / "spec.yaml").is_file()]   # `<num>_<choices>`
    jobs.sort(key=lambda p: (p.name.partition("_")[0].zfill(9), p.name))     # by number: 2 before 10
    rows = [job_row(j) for j in jobs]
    if not any("steps" in r for r in rows):
        return ""
    png = plot_rewards(jobs, sweep_dir / "rewards.png")
    text = table(rows)
    (sweep_dir / "summary.md").write_text(f"# Sweep `{sweep_dir.name}`\n\n{text}\n{NOTES}\n\n"
                                          f"![rewards]({png.name})\n", encoding="utf-8")
    return text


class SweepSummary(Callback):
    """Hydra callback: summarize the sweep directory when a multirun ends."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        text = summarize(sweep_dir) if sweep_dir.is_dir() else ""
        if text:
            print(f"{text}molt: wrote {sweep_dir / 'summary.md'} and {sweep_dir / 'rewards.png'}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m molt.sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep_dir", help="a multirun's folder (one subfolder per job)")
    sweep_dir = parser.parse_args(argv).sweep_dir
    try:
        text = summarize(sweep_dir)
    except FileNotFoundError as err:
        sys.exit(f"molt.sweep: {err}")
    if not text:
        sys.exit(f"molt.sweep: no job in {sweep_dir} has logged a step yet")
    print(f"{text}molt: wrote {Path(sweep_dir) / 'summary.md'} and {Path(sweep_dir) / 'rewards.png'}")
