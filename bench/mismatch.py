"""Mismatch: engine vs trainer logprob gap per model size, with the engine in fp32 and in bf16.

Both sides hold the same weights at every step (the trainer recomputes the logprobs of exactly the
tokens the engine sampled), so |Δ| is pure numerics: kernels, reduction order and the engine's dtype.
The trainer trains in fp32 here; the bf16 rows run only the engine in bf16
(`rollout.engine.extra_args.dtype=bfloat16`, which vLLM's CPU backend supports), the usual RL setup.
(`model.dtype=bfloat16` puts the trainer under CPU autocast too: bench/peer.py --dtype bfloat16.)

    python bench/mismatch.py --quick
    python bench/mismatch.py --sizes tiny,30m,100m --lengths 16 [--reuse]
"""

from __future__ import annotations

import argparse
import statistics

from common import BENCH, param_count, table
from molt_run import add_flags, apply_quick, finish, intro, metric, model_path, sweep

# The fp32 variant has the same overrides as the refit/scaling runs, so `--reuse` shares them.
DTYPES = {"float32": ["rollout.mode=sync"],
          "bfloat16": ["rollout.mode=sync", "+rollout.engine.extra_args.dtype=bfloat16"]}
MEAN = ("mismatch/mean_abs", "mismatch/abs_mean")
MAX = ("mismatch/max_abs", "mismatch/abs_max")
KL = ("mismatch/kl_k3", "train/mismatch/kl_k3")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, sizes="tiny,30m,100m", lengths="16")
    p.add_argument("--dtypes", default="float32,bfloat16", help="engine dtypes (float32, bfloat16)")
    args = p.parse_args()
    apply_quick(args)
    dtypes = args.dtypes.split(",")
    records = [r for r in sweep(args, {d: DTYPES[d] for d in dtypes}) if "summary" in r]
    rows, points = [], {}
    for size in args.sizes.split(","):
        params = param_count(model_path(size))
        for dtype in dtypes:
            runs = [r for r in records if r["size"] == size and r["variant"] == dtype]
            if not runs:
                rows.append([size, dtype, "failed", "", ""])
                continue
            steps = [x for r in runs for x in r["rows"]]
            mean = statistics.median(metric(x, *MEAN) for x in steps)
            peak = max(metric(x, *MAX) for x in steps)
            kl = statistics.median(metric(x, *KL) for x in steps)
            points[(size, dtype)] = (params, mean, peak)
            rows.append([f"{size} ({params / 1e6:.1f}M)", dtype, f"{mean:.2e}", f"{peak:.2e}", f"{kl:.2e}"])
    head = ["model", "engine dtype", "mean abs Δlogp (median over steps)", "max abs Δlogp (over all steps)",
            "KL k3 (median)"]
    body = intro("Mismatch: engine vs trainer logprobs (trainer fp32)", args) + "\n".join(
        [table(head, rows), "", "![mismatch](mismatch.png)"])
    if not args.no_results and points:
        draw(points, dtypes)
    finish(args, "mismatch", body)


def draw(points: dict[tuple[str, str], tuple[int, float, float]], dtypes: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for dtype in dtypes:
        xs = sorted(v for (_, d), v in points.items() if d == dtype)
        if xs:
            ax.plot([x[0] for x in xs], [x[1] for x in xs], marker="o", label=f"{dtype} mean abs Δ")
            ax.plot([x[0] for x in xs], [x[2] for x in xs], marker="^", ls="--", label=f"{dtype} max abs Δ")
    ax.set(xscale="log", yscale="log", xlabel="parameters", ylabel="|logp engine − logp trainer|")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(BENCH / "mismatch.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
