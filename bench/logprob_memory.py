"""Memory of the logprob pass at a Qwen-sized vocabulary: peak RSS of one trainer rank's step vs tokens.

A random-init tiny Qwen3 (hidden 128, 2 layers, tied embeddings) with Qwen3's 151,936-token vocabulary;
one micro-batch of one row of N tokens (16 prompt tokens, the rest sampled) per step. Each setting runs
in a fresh process as one trainer rank (`TrainerWorker` at world size 1, the code a Ray rank runs):
one warm-up step on 64 tokens, then the measured `update` (forward, backward, AdamW). Reported: the
process's peak RSS during that step minus its RSS before it, and the step's seconds.

`train.logprob_chunk_tokens` = N is one chunk holding every position's logits: the memory of the whole-
logits computation that chunking replaces (only at small N: it needs several GB). `auto` is the default.

    python bench/logprob_memory.py [--tokens 2048,4096,8192,16384] [--whole 1024,2048]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

from common import header, table, write_section

VOCAB = 151_936   # Qwen3's


def build(path: str) -> None:
    """The tiny model's config with a Qwen3-sized vocabulary and room for 16K positions, random init."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from molt.inputs.tiny import tiny_model_path

    config = AutoConfig.from_pretrained(tiny_model_path())
    config.vocab_size, config.max_position_embeddings = VOCAB, 32_768
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)


def child(path: str, tokens: int, chunk: int | None) -> None:
    import psutil
    import torch

    from molt.spec import RunSpec
    from molt.trainer import make_batch
    from molt.trainer.worker import TrainerWorker
    from molt.trajectory import Segment

    spec = RunSpec.model_validate({"model": {"path": path}, "train": {
        "prompts_per_step": 1, "micro_batch_size": 1, "logprob_chunk_tokens": chunk}})
    worker = TrainerWorker(spec, "policy", 0, path)
    worker.setup(*worker.address())

    def batch(n: int):
        gen = torch.Generator().manual_seed(n)
        ids = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
        mask = [0] * 16 + [1] * (n - 16)
        segment = Segment(ids, mask, [-12.0 * m for m in mask], [0 if m else -1 for m in mask], "r", "g")
        return make_batch([segment], advantages=[[1.0] * n])

    worker.update(batch(64))
    b = batch(tokens)
    before = psutil.Process().memory_info().rss / 2**20
    start = time.perf_counter()
    worker.update(b)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10   # KiB on Linux
    worker.shutdown()
    print(json.dumps({"extra_mib": peak - before, "seconds": seconds}))


def measure(path: str, tokens: int, chunk: int | None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    out = subprocess.run([sys.executable, __file__, "--child", path, str(tokens), str(chunk)],
                         capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"{tokens} tokens, chunk {chunk}: {out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"[bench] {tokens} tokens, chunk {chunk or 'auto'}: {result}", flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="2048,4096,8192,16384", help="micro-batch sizes, default chunking")
    p.add_argument("--whole", default="1024,2048", help="micro-batch sizes also run as one chunk")
    p.add_argument("--no-results", action="store_true", help="print the section, do not write it")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        path, tokens, chunk = args.child
        return child(path, int(tokens), None if chunk == "None" else int(chunk))
    from molt.trainer.model import AUTO_CHUNK_BYTES

    auto = max(64, AUTO_CHUNK_BYTES // (4 * VOCAB))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        build(tmp)
        runs = [(n, n) for n in map(int, args.whole.split(","))] + \
            [(n, None) for n in map(int, args.tokens.split(","))]
        for tokens, chunk in runs:
            r = measure(tmp, tokens, chunk)
            rows.append([tokens, f"{chunk} (one chunk: whole logits)" if chunk else f"auto ({auto})",
                         f"{tokens * VOCAB * 4 / 2**20:.0f}", f"{r['extra_mib']:.0f}", f"{r['seconds']:.1f}"])
    command = "python " + " ".join(["bench/logprob_memory.py", *sys.argv[1:]])
    head = ["tokens", "train.logprob_chunk_tokens", "fp32 logits of the whole batch (MiB)",
            "peak RSS of the step - RSS before (MiB)", "step s"]
    body = "\n".join([
        "## Logprob pass memory at a 152K vocabulary", "", header(),
        f"- work: one trainer rank (world size 1, fp32), tiny Qwen3 (hidden 128, 2 layers, tied) with a "
        f"{VOCAB}-token vocabulary, one row of N tokens (N - 16 sampled), one update after a warm-up",
        f"- command: `{command}`", "", table(head, rows)])
    if not args.no_results:
        write_section("logprob_memory", body)
    print(body)


if __name__ == "__main__":
    main()
