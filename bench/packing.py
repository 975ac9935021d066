"""Sequence packing: seconds per trainer step on ragged rows, padded row micro-batches against packed
token-budget micro-batches, on the same batch in the same run.

One FSDP2 rank (a Ray actor, as in a run) per path; each path takes `--steps` optimizer steps over the
same batch (rows of uniformly random length), the first untimed. Padded: `train.micro_batch_size` rows
per micro-batch, each trimmed to its longest row. Packed: `train.micro_batch_tokens` = that many rows
times the mean length, so both paths run about as many micro-batches.

    python bench/packing.py [--size tiny] [--rows 32] [--min-len 32] [--max-len 512] [--steps 4]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

from common import SIZES, header, table, write_section

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def ragged_batch(rows: int, low: int, high: int, seed: int = 0):
    from molt.trainer import make_batch
    from molt.trajectory import Segment

    rng, segments = random.Random(seed), []
    for i in range(rows):
        length, prompt = rng.randint(low, high), rng.randint(4, 16)
        mask = [0] * prompt + [1] * (length - prompt)
        segments.append(Segment([rng.randrange(320) for _ in range(length)], mask, [-1.0 * m for m in mask],
                                [0 if m else -1 for m in mask], str(i), "g"))
    return make_batch(segments, advantages=[[rng.gauss(0, 1)] * len(s.token_ids) for s in segments])


def step_seconds(spec, batch, steps: int) -> list[float]:
    from molt.trainer import TrainerRanks

    group = TrainerRanks(spec)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        group.update(batch)
        times.append(time.perf_counter() - t0)
    group.shutdown()
    return times[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny", choices=list(SIZES))
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    import ray

    from molt.inputs.tiny import tiny_model_path
    from molt.spec import RunSpec

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}})
    batch = ragged_batch(args.rows, args.min_len, args.max_len)
    lengths = batch["attention_mask"].sum(-1)
    budget = int(args.micro_batch_size * float(lengths.float().mean()))
    base = {"model": {"path": str(tiny_model_path(**SIZES[args.size])), "max_model_len": 2048},
            "rollout": {"samples_per_prompt": args.rows, "max_tokens": args.max_len},
            "train": {"prompts_per_step": 1, "micro_batch_size": args.micro_batch_size}}
    padded = RunSpec.model_validate(base)
    packed = RunSpec.model_validate({**base, "train": {**base["train"], "micro_batch_tokens": budget}})
    results = {name: step_seconds(spec, batch, args.steps) for name, spec in
               (("padded", padded), ("packed", packed))}
    ray.shutdown()
    pad, pack = statistics.median(results["padded"]), statistics.median(results["packed"])
    rows = [[name, f"{statistics.median(t):.2f}", " ".join(f"{x:.2f}" for x in t)]
            for name, t in results.items()]
    command = "python bench/packing.py " + " ".join(sys.argv[1:])
    body = "\n".join([
        "## Sequence packing", "", header(), f"- command: `{command.strip()}`",
        f"- work: one trainer rank, model {args.size}, {args.rows} rows of {args.min_len}-{args.max_len} "
        f"tokens (uniform; {int(lengths.sum())} real), one optimizer step per timed step, "
        f"{args.steps - 1} timed steps per path after 1 untimed",
        f"- padded: train.micro_batch_size={args.micro_batch_size}; "
        f"packed: train.micro_batch_tokens={budget}",
        "", table(["path", "step s (median)", "step s (each)"], rows), "",
        f"**packed / padded: {pad / pack:.2f}x faster** per step on these ragged rows."])
    write_section("packing", body)
    print(body)


if __name__ == "__main__":
    main()
