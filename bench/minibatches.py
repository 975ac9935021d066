"""Time per generated batch with one optimizer step (today's default) vs several (train.minibatches,
train.epochs), same runs otherwise, in one command.

Read from the loop's own metrics: `time/step` (the whole step), `time/train` (the updates, and with
more than one the extra no-grad forward for the old logprobs) and, for the several-update runs, the
last update's ratio and approx KL (`train/ratio_mean_last`, `train/approx_kl_last`): they show the
updates after the first being off-policy, which is what makes PPO's clip act.

    python bench/minibatches.py --quick
    python bench/minibatches.py --sizes tiny,30m --lengths 16
"""

from __future__ import annotations

import argparse

from common import fmt_spread, table
from molt_run import add_flags, apply_quick, cells, finish, intro, metric, sweep

VARIANTS = {
    "1 update (default)": [],
    "minibatches=4": ["train.minibatches=4"],
    "minibatches=2, epochs=2": ["train.minibatches=2", "train.epochs=2"],
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, sizes="tiny,30m", lengths="16")
    args = p.parse_args()
    apply_quick(args)
    records = [r for r in sweep(args, {k: ["rollout.mode=sync", *v] for k, v in VARIANTS.items()})
               if "summary" in r]
    rows = []
    for size, length in cells(args):
        for name in VARIANTS:
            runs = [r for r in records if (r["size"], r["length"], r["variant"]) == (size, length, name)]
            if not runs:
                rows.append([size, length, name, "failed", "", "", ""])
                continue
            step = [r["summary"]["step_s"] for r in runs]
            train = [metric(r["medians"], "time/train") for r in runs]
            last = runs[0]["medians"]
            rows.append([size, length, name, fmt_spread(step, 3), fmt_spread(train, 3),
                         f"{metric(last, 'train/ratio_mean_last'):.4f}",
                         f"{metric(last, 'train/approx_kl_last'):.2g}"])
    head = ["model", "max tokens", "updates per batch", "step s median (min–max)", "train s",
            "last update ratio", "last update approx KL"]
    note = ("\n\n`train s` holds every update of the batch plus, with several, the no-grad forward for the "
            "old logprobs. One run per cell: on a shared machine (see the load average above) differences "
            "of tens of percent are noise; rerun with `--repeats 3` on a quiet one for a speed claim.")
    body = intro("Several updates per generated batch", args) + table(head, rows) + note
    finish(args, "minibatches", body)


if __name__ == "__main__":
    main()
