"""Scaling: Molt's step time vs model size and vs response length (sync mode, one command).

    python bench/scaling.py --quick
    python bench/scaling.py --sizes tiny,30m,100m --lengths 16,128 [--skip 100m:128] [--reuse]
"""

from __future__ import annotations

import argparse
import statistics

from common import BENCH, fmt_spread, param_count, table
from molt_run import add_flags, apply_quick, cells, finish, intro, metric, model_path, sweep

STAGES = ("time/generate", "time/wait_batch", "time/logprobs", "time/train", "time/refit")  # loop stages


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, sizes="tiny,30m,100m", lengths="16,128")
    args = p.parse_args()
    apply_quick(args)
    records = [r for r in sweep(args, {"sync": ["rollout.mode=sync"]}) if "summary" in r]
    params = {s: param_count(model_path(s)) for s in args.sizes.split(",")}
    rows, points = [], {}
    for size, length in cells(args):
        runs = [r for r in records if r["size"] == size and r["length"] == length]
        if not runs:
            rows.append([size, length, "failed"])
            continue
        med = statistics.median
        step = [r["summary"]["step_s"] for r in runs]
        points[(size, length)] = med(step)
        rows.append([f"{size} ({params[size] / 1e6:.1f}M)", length, fmt_spread(step, 3),
                     f"{med(r['summary']['sampled_tok_s'] for r in runs):.4g}",
                     f"{med(r['summary']['trained_tok_s'] for r in runs):.4g}",
                     *(f"{med(metric(r['medians'], k) for r in runs):.3g}" for k in STAGES)])
    head = ["model", "max tokens", "step s median (min–max)", "sampled tok/s", "trained tok/s",
            *(f"{k.removeprefix('time/')} s" for k in STAGES)]
    body = intro("Scaling: step time vs model size and response length (sync)", args) + "\n".join(
        [table(head, rows), "", "![scaling](scaling.png)"])
    if not args.no_results and points:
        draw(points, params)
    finish(args, "scaling", body)


def draw(points: dict[tuple[str, int], float], params: dict[str, int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for length in sorted({k[1] for k in points}):
        xs = [(params[s], v) for (s, n), v in points.items() if n == length]
        a.plot(*zip(*sorted(xs), strict=True), marker="o", label=f"{length} tokens")
    for size in params:
        xs = [(n, v) for (s, n), v in points.items() if s == size]
        if xs:
            b.plot(*zip(*sorted(xs), strict=True), marker="o", label=f"{size}")
    a.set(xscale="log", yscale="log", xlabel="parameters", ylabel="s / step", title="step time vs size")
    b.set(yscale="log", xlabel="max response tokens", ylabel="s / step", title="step time vs length")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(BENCH / "scaling.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
