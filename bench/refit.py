"""Refit cost: seconds per weight refit (trainer → engine) and its share of the step, per model size.

Read from the loop's own `time/refit` (gather the full state dict, ship it, reload it in the engine,
reset the prefix cache) in real runs, so it is what a user pays per step.

    python bench/refit.py --quick
    python bench/refit.py --sizes tiny,30m,100m --lengths 16 [--reuse]
    python bench/refit.py --lora 8 --sizes tiny,30m     (LoRA adapter refit vs full refit, same command)
"""

from __future__ import annotations

import argparse
import statistics

from common import BENCH, fmt_spread, param_count, table
from molt_run import add_flags, apply_quick, cells, finish, intro, metric, model_path, sweep


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, sizes="tiny,30m,100m", lengths="16")
    p.add_argument("--lora", type=int, default=0, help="also run model.lora.rank=N and compare (section "
                   "refit_lora)")
    args = p.parse_args()
    apply_quick(args)
    if args.lora:
        return compare_lora(args)
    records = [r for r in sweep(args, {"sync": ["rollout.mode=sync"]}) if "summary" in r]
    rows, points = [], []
    params = {size: param_count(model_path(size)) for size in args.sizes.split(",")}
    for size, length in cells(args):
        runs = [r for r in records if r["size"] == size and r["length"] == length]
        if not runs:
            rows.append([size, length, "failed", "", "", ""])
            continue
        refit = [statistics.median(x["time/refit"] for x in r["rows"]) for r in runs]
        share = [statistics.median(x["time/refit"] / x["time/step"] for x in r["rows"]) for r in runs]
        gbps = [params[size] * 4 / s / 1e9 for s in refit]  # fp32 bytes moved per second
        points.append((f"{size}\n{length} tok", statistics.median(refit), statistics.median(share)))
        rows.append([f"{size} ({params[size] / 1e6:.1f}M)", length, fmt_spread(refit, 3),
                     fmt_spread(share, 3), f"{statistics.median(gbps):.2f}",
                     f"{statistics.median(metric(r['medians'], 'time/step') for r in runs):.3g}"])
    head = ["model", "max tokens", "refit s median (min–max)", "refit / step", "GB/s (fp32 weights)",
            "step s"]
    body = intro("Refit cost", args) + "\n".join([table(head, rows), "", "![refit](refit.png)"])
    if not args.no_results and points:
        draw(points)
    finish(args, "refit", body)


def compare_lora(args: argparse.Namespace) -> None:
    """Full-weight refit against a LoRA adapter refit, both runs of each size in one sweep."""
    variants = {"full": ["rollout.mode=sync"], f"lora r{args.lora}": ["rollout.mode=sync",
                                                                      f"model.lora.rank={args.lora}"]}
    records = sweep(args, variants)
    rows, ratios = [], []
    for size, length in cells(args):
        got = {}
        for name in variants:
            ok = [r for r in records if (r["size"], r["length"], r["variant"]) == (size, length, name)
                  and "rows" in r]
            if not ok:
                rows.append([size, name, "failed", "", "", "", ""])
                continue
            refit = [statistics.median(x["time/refit"] for x in r["rows"]) for r in ok]
            sent = statistics.median(x["refit/bytes"] for r in ok for x in r["rows"])
            got[name] = (sent, statistics.median(refit))
            rows.append([size, name, f"{sent / 2**20:.3g}", fmt_spread(refit, 3)] +
                        [f"{statistics.median(metric(r['medians'], key) for r in ok):.3g}"
                         for key in ("time/generate", "time/train", "time/step")])
        if len(got) == 2:
            (full_b, full_s), (lora_b, lora_s) = got.values()
            ratios.append(f"- {size}: the adapter refit moves {full_b / lora_b:.0f}x fewer bytes and takes "
                          f"{full_s / lora_s:.1f}x less time than the full refit")
    head = ["model", "refit", "MB per refit", "refit s median (min–max)", "generate s", "train s", "step s"]
    body = "\n".join([table(head, rows), "", *ratios])
    finish(args, "refit_lora", intro("Refit cost: LoRA adapter vs full weights", args) + "\n" + body)


def draw(points: list[tuple[str, float, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    labels = [p[0] for p in points]
    a.bar(labels, [p[1] for p in points], color="#4c72b0")
    a.set(ylabel="s per refit", title="refit seconds")
    b.bar(labels, [p[2] for p in points], color="#dd8452")
    b.set(ylabel="fraction of step", title="refit share of step time")
    fig.tight_layout()
    fig.savefig(BENCH / "refit.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
