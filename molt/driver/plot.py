"""PNG plots of a run from its metrics.jsonl: `python -m molt.plot RUN_DIR`.

Uses matplotlib's object API with the Agg canvas (never pyplot), so plotting works headless and
leaves the caller's matplotlib backend alone. A figure whose metrics are absent is skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from matplotlib.figure import Figure

Rows = dict[int, dict[str, float]]


def read_metrics(path: Path) -> Rows:
    """step → metrics. A resumed run re-logs steps: the last record of a step wins. A line cut off by
    a killed run is skipped rather than failing the plot."""
    rows: Rows = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record:
            rows[int(record.pop("step"))] = record
    return dict(sorted(rows.items()))


def _series(rows: Rows, key: str) -> tuple[list[int], list[float]]:
    steps = [s for s, r in rows.items() if key in r]
    return steps, [rows[s][key] for s in steps]


def rolling_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last `window` values at every position (fewer at the start)."""
    return [sum(values[max(0, i + 1 - window):i + 1]) / min(i + 1, window) for i in range(len(values))]


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=100, bbox_inches="tight")  # "tight" keeps legends placed outside the axes
    return path


def _reward(rows: Rows, out: Path) -> Path | None:
    steps, reward = _series(rows, "reward/mean")
    if not steps:
        return None
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    ax.plot(steps, reward, alpha=0.35, label="reward/mean")
    window = max(1, len(reward) // 10)
    ax.plot(steps, rolling_mean(reward, window), linewidth=2, label=f"rolling mean ({window} steps)")
    ax.set(xlabel="step", ylabel="reward", title="train reward")
    ax.legend()
    return _save(fig, out / "reward.png")


def _lines(rows: Rows, prefix: str, title: str, path: Path, marker: str | None = None, log: bool = False,
           depth: int | None = None) -> Path | None:
    """One line per metric under `prefix` (with `depth`: only names of that many parts, a/b/c = 3)."""
    keys = sorted({k for r in rows.values() for k in r
                   if k.startswith(prefix) and (depth is None or len(k.split("/")) == depth)})
    if not keys:
        return None
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    for key in keys:
        ax.plot(*_series(rows, key), marker=marker, markersize=3, label=key)
    if log and all(r[k] > 0 for r in rows.values() for k in keys if k in r):
        ax.set_yscale("log")  # mismatch spans orders of magnitude (mean ~1e-6, max ~1e-3 in fp32)
    ax.set(xlabel="step", title=title)
    ax.legend()
    return _save(fig, path)


def warmup_clip(step_times: list[float]) -> float | None:
    """A y-axis top for the timings plot when the warm-up steps (the first 2%, at least one: engine and
    trainer warm-up, e.g. 17.7 s against 0.3 s later) would flatten every other step; None otherwise."""
    warm = max(1, len(step_times) // 50)
    if len(step_times) <= warm:
        return None
    top = 1.2 * max(step_times[warm:])
    return top if max(step_times[:warm]) > 2 * top else None


def _timings(rows: Rows, out: Path) -> Path | None:
    """The step's consecutive stages (wait for the batch, logprobs, train, refit, ...) stacked; time/step
    (the whole step) and time/generate (engine busy time, which overlaps the stages) as lines. Slow
    warm-up steps are cut at the top of the axis, the slowest one's time written beside it."""
    lines = ("time/step", "time/generate")
    stages = sorted({k for r in rows.values() for k in r if k.startswith("time/") and k not in lines})
    total_steps, total = _series(rows, "time/step")
    if not stages and not any(_series(rows, k)[0] for k in lines):
        return None
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    if stages:
        steps = [s for s, r in rows.items() if any(k in r for k in stages)]
        ax.stackplot(steps, [[rows[s].get(k, 0.0) for s in steps] for k in stages], labels=stages, alpha=0.8)
    for key, style in zip(lines, ("-", "--"), strict=True):
        if _series(rows, key)[0]:
            ax.plot(*_series(rows, key), color="black", linestyle=style, linewidth=1, label=key)
    top = warmup_clip(total)
    if top is not None:
        slowest = max(range(len(total)), key=total.__getitem__)
        ax.set_ylim(0, top)
        ax.annotate(f"warm-up: step {total_steps[slowest]} took {total[slowest]:.1f} s (off scale)",
                    xy=(total_steps[slowest], top), xytext=(4, -12), textcoords="offset points",
                    fontsize="small")
    ax.set(xlabel="step", ylabel="seconds", title="stage timings")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    return _save(fig, out / "timings.png")


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write reward / eval / loss / mismatch / timing PNGs into <run_dir>/plots/; returns the files."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    rows = read_metrics(metrics)
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    written = [_reward(rows, out),
               # the scores (eval/NAME/pass@k ...), not what the agent did (eval/NAME/agent/turns ...)
               _lines(rows, "eval/", "eval", out / "eval.png", marker="o", depth=3),
               _lines(rows, "train/loss", "train loss", out / "loss.png"),
               _lines(rows, "mismatch/", "trainer vs engine logprob gap", out / "mismatch.png", log=True),
               _timings(rows, out)]
    return [p for p in written if p is not None]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m molt.plot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run's folder (holds metrics.jsonl); PNGs go to its plots/")
    args = parser.parse_args(argv)
    try:
        paths = plot_run(args.run_dir)
    except FileNotFoundError as err:
        sys.exit(f"molt.plot: {err}")
    for path in paths:
        print(path)
