"""Async vs sync: the same experiment in both rollout modes, interleaved; step time and idle fractions.

Sync alternates generate and train (one of engine and trainer is always waiting); async keeps prompt
groups in flight while the trainer steps (max_staleness bounds how old a trained token may be).

    python bench/async_sync.py --quick
    python bench/async_sync.py --sizes tiny,30m --lengths 128 --repeats 3 [--reuse]
"""

from __future__ import annotations

import argparse
import statistics

from common import BENCH, fmt_spread, table
from molt_run import add_flags, apply_quick, cells, finish, intro, metric, sweep

MODES = ("sync", "async")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, sizes="tiny,30m", lengths="128", repeats=3)
    args = p.parse_args()
    apply_quick(args)
    records = [r for r in sweep(args, {m: [f"rollout.mode={m}"] for m in MODES}) if "summary" in r]
    rows, bars = [], []
    med = statistics.median
    for size, length in cells(args):
        by = {m: {r["repeat"]: r for r in records if (r["size"], r["length"], r["variant"]) ==
                  (size, length, m)} for m in MODES}
        paired = sorted(set(by["sync"]) & set(by["async"]))
        if not paired:
            rows.append([size, length, "no complete pair", "", "", "", "", ""])
            continue
        ratio = [by["async"][i]["summary"]["step_s"] / by["sync"][i]["summary"]["step_s"] for i in paired]
        stats = {}
        for m in MODES:
            runs = [by[m][i] for i in paired]
            stats[m] = {
                "step": med(r["summary"]["step_s"] for r in runs),
                "tok": med(r["summary"]["trained_tok_s"] for r in runs),
                "engine": med(metric(r["medians"], "engine/idle_frac") for r in runs),
                "trainer": med(metric(r["medians"], "trainer/idle_frac") for r in runs),
            }
        rows.append([size, length, f"{stats['sync']['step']:.3g} / {stats['async']['step']:.3g}",
                     fmt_spread(ratio), f"{stats['sync']['tok']:.4g} / {stats['async']['tok']:.4g}",
                     f"{stats['sync']['engine']:.2f} / {stats['async']['engine']:.2f}",
                     f"{stats['sync']['trainer']:.2f} / {stats['async']['trainer']:.2f}", len(paired)])
        bars.append((f"{size}\n{length} tok", stats))
    head = ["model", "max tokens", "step s sync / async", "step time async/sync",
            "trained tok/s sync / async", "engine idle sync / async", "trainer idle sync / async", "repeats"]
    body = intro("Async vs sync", args) + "\n".join([table(head, rows), "", "![async](async_sync.png)"])
    if not args.no_results and bars:
        draw(bars)
    finish(args, "async_sync", body)


def draw(bars: list[tuple[str, dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    width = 0.38
    for ax, key, title in zip(axes, ("step", "engine", "trainer"),
                              ("s / step", "engine idle fraction", "trainer idle fraction"), strict=True):
        for j, m in enumerate(MODES):
            ax.bar([i + (j - 0.5) * width for i in range(len(bars))], [c[m][key] for _, c in bars], width,
                   label=m)
        ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.legend()
    fig.tight_layout()
    fig.savefig(BENCH / "async_sync.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
