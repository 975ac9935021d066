"""What `logging.dump_trainer` costs a step: the trainer's per-token record and the bigger dump.

One trainer rank (`TrainerWorker` at world size 1, the code a Ray rank runs) on a batch of R rows x N tokens
(N/8 prompt, the rest sampled), at the tiny model's 320-token vocabulary and at Qwen3's 151,936 (the tiny
model's config with that vocabulary, as bench/logprob_memory.py builds it). Per repeat, in alternation: one
`update` without the record, one with it plus `token_record()`: the difference is what the trainer pays
(the entropy it computes for the record, the copies). Then the step's dump as the loop writes it, without
and with the trainer's side (`add_token_record`, JSON lines): seconds and bytes.

    python bench/dump_trainer.py [--rows 8] [--tokens 512] [--repeats 5] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import header, table, write_section  # noqa: E402
from logprob_memory import VOCAB, build  # noqa: E402


def measure(path: str, vocab: int, rows: int, tokens: int, repeats: int) -> list:
    import torch

    from molt.driver.metrics import TRAINER_KEY, add_token_record
    from molt.spec import RunSpec
    from molt.trainer import make_batch
    from molt.trainer.worker import TrainerWorker
    from molt.trajectory import Rollout, Segment

    spec = RunSpec.model_validate({"model": {"path": path}, "train": {"prompts_per_step": 1,
                                                                      "micro_batch_size": rows}})
    worker = TrainerWorker(spec, "policy", 0, path)
    worker.setup(*worker.address())
    gen = torch.Generator().manual_seed(0)
    prompt = tokens // 8
    mask = [0] * prompt + [1] * (tokens - prompt)
    segments = [Segment(torch.randint(0, vocab, (tokens,), generator=gen).tolist(), mask,
                        [-3.0 * m for m in mask], [0 if m else -1 for m in mask], f"r{i}", "g",
                        prompt_len=prompt) for i in range(rows)]
    batch = make_batch(segments, advantages=[[1.0] * tokens] * rows)
    worker.update(batch, record=True)
    worker.token_record()
    off, on = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        worker.update(batch)
        off.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        worker.update(batch, record=True)
        record_tensors = worker.token_record()
        on.append(time.perf_counter() - t0)
    worker.shutdown()
    rollouts = [Rollout(s.rollout_id, "g", [s], 1.0) for s in segments]
    record = {r.rollout_id: {"decision": "kept", "version": 0} for r in rollouts}
    add_token_record(record, segments, record_tensors)
    dumps = []
    for with_trainer in (False, True):
        t0 = time.perf_counter()
        side = {r.rollout_id: {TRAINER_KEY: record[r.rollout_id]} if with_trainer else {} for r in rollouts}
        lines = [json.dumps(dataclasses.asdict(r) | side[r.rollout_id]) for r in rollouts]
        dumps.append((time.perf_counter() - t0, sum(map(len, lines)) / 2**20))
    mid_off, mid_on = statistics.median(off), statistics.median(on)
    return [f"{vocab:,}", f"{rows} x {tokens}", f"{mid_off:.3f}", f"{mid_on:.3f}",
            f"{mid_on - mid_off:+.3f} ({100 * (mid_on - mid_off) / mid_off:+.1f}%)",
            f"{dumps[0][0]:.3f} / {dumps[1][0]:.3f}", f"{dumps[0][1]:.2f} / {dumps[1][1]:.2f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 rows x 128 tokens, 2 repeats, print only")
    args = parser.parse_args()
    rows, tokens, repeats = (2, 128, 2) if args.quick else (args.rows, args.tokens, args.repeats)
    from molt.inputs.tiny import tiny_model_path

    out = [measure(str(tiny_model_path()), 320, rows, tokens, repeats)]
    with tempfile.TemporaryDirectory() as tmp:
        build(tmp)
        out.append(measure(tmp, VOCAB, rows, tokens, repeats))
    head = ["vocabulary", "rows x tokens", "update s", "update + record s", "the record's cost",
            "dump s without / with", "dump MiB without / with"]
    body = table(head, out)
    print(body)
    if not args.quick:
        command = "python " + " ".join(["bench/dump_trainer.py", *sys.argv[1:]])
        write_section("dump_trainer", "## What logging.dump_trainer costs a step\n\n" + header(
            f"- work: one trainer rank (world size 1, fp32, one thread), tiny Qwen3 (hidden 128, 2 layers), "
            f"median of {repeats} alternating repeats\n- command: `{command}`") + "\n\n" + body)


if __name__ == "__main__":
    main()
