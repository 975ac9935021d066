"""The curves of docs/tool_use.md from a tool_rl run's metrics.jsonl.

    python bench/tool_use_plot.py RUN_DIR [RUN_DIR2 ...] [--labels Env ChatAgent] [--out docs/tool_use.png]

Four panels over RL steps: training reward (rolling mean over --window steps), held-out greedy accuracy
(eval/tool_products_eval/pass@1; step 0 is the SFT model), tool calls per rollout and turns per rollout
(the Env's info/tool_calls and info/turns, or agent/tool_calls and agent/turns where logged).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from matplotlib.figure import Figure

from molt.driver.plot import read_metrics, rolling_mean

PANELS = [("training reward", ["reward/mean"], True),
          ("held-out greedy accuracy", ["eval/tool_products_eval/pass@1"], False),
          ("tool calls per rollout", ["agent/tool_calls", "info/tool_calls"], True),
          ("turns per rollout", ["agent/turns", "info/turns"], True)]


def series(rows: dict, keys: list[str]) -> tuple[list[int], list[float]]:
    for key in keys:
        steps = [s for s, r in rows.items() if key in r]
        if steps:
            return steps, [rows[s][key] for s in steps]
    return [], []


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (each with metrics.jsonl)")
    parser.add_argument("--labels", nargs="*", default=None, help="one legend label per run")
    parser.add_argument("--out", type=Path, default=Path("docs/tool_use.png"))
    parser.add_argument("--window", type=int, default=3, help="rolling mean of the per-step panels")
    args = parser.parse_args(argv)
    labels = args.labels or [run.name for run in args.runs]
    fig = Figure(figsize=(10, 7), layout="constrained")
    axes = fig.subplots(2, 2).flatten()
    for run, label in zip(args.runs, labels, strict=True):
        rows = read_metrics(run / "metrics.jsonl")
        for ax, (title, keys, rolled) in zip(axes, PANELS, strict=True):
            steps, values = series(rows, keys)
            ax.plot(steps, rolling_mean(values, args.window) if rolled else values, marker="o", label=label)
            ax.set_title(title + (f" (rolling mean of {args.window})" if rolled and args.window > 1 else ""))
            ax.set_xlabel("RL step")
    axes[1].set_ylim(0, 1)
    for ax in axes:
        ax.grid(alpha=0.3)
        if len(args.runs) > 1:
            ax.legend()
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
