"""The dry run's memory estimate (molt/plan/memory.py) against the measured peak of one trainer rank on CPU.

One `TrainerWorker` runs in this process (world size 1, gloo, fp32): `setup` (model and optimizer), then
two `update`s on a GRPO batch of `rows` rows of 8 prompt + `length` sampled tokens in one micro-batch. The
measured peak is what the estimate models: the parameters' and the AdamW state's bytes plus the growth of
the process's resident memory during the second update (Linux's VmHWM, reset just before it through
/proc/self/clear_refs; glibc's mmap threshold is fixed low, so a freed tensor's pages go back to the system
at once). The first update also pays what a process pays once and no GPU holds: the library code its
kernels page in and the buffers they keep (thread pools, oneDNN / BLAS workspaces), backed by 2 MiB pages
where transparent huge pages apply to malloc (THP `always`): the `first update's extra` column, by host. It
is compared with the estimate of the same spec (the rows' length as the row bound, so both see the same
micro-batch). Bytes, not seconds: the result does not depend on the machine's load.

    python bench/memory_plan.py --sizes tiny,30m --rows 64 --length 128
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from breakdown import PROMPT, policy_batch
from common import machine, write_section
from molt_run import overrides

from molt.plan.arch import arch_of
from molt.plan.memory import trainer_estimate

MIB = 2 ** 20


def _status_kib(field: str) -> int:
    line = next(x for x in open("/proc/self/status") if x.startswith(field + ":"))
    return int(line.split()[1])


def host() -> str:
    """The machine and its transparent huge pages mode: `always` backs malloc's regions with 2 MiB pages,
    which the first update's kept buffers round up to."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    mode = thp.read_text().split("[")[1].split("]")[0] if thp.exists() else "unknown"
    return f"{machine()}, transparent huge pages {mode}"


def measure(size: str, rows: int, length: int) -> dict[str, float]:
    from molt.driver.compose import compose
    from molt.plan.models import model_path
    from molt.trainer.worker import TrainerWorker

    row = PROMPT + length
    spec = compose(overrides(size, length, 1, rows // 8, 8, extra=[
        f"agent.max_total_tokens={row}", f"train.micro_batch_size={rows}", "parallel.cpu_threads=2"]))
    worker = TrainerWorker(spec, "policy", 0, model_path(spec))
    batch = policy_batch(rows, 8, length)
    worker.setup("127.0.0.1", 29555)
    params = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    peaks = []
    for _ in range(2):
        Path("/proc/self/clear_refs").write_text("5")   # VmHWM := VmRSS
        before = _status_kib("VmRSS")
        worker.update(batch)
        peaks.append((_status_kib("VmHWM") - before) * 1024)
    state = sum(t.numel() * t.element_size() for s in worker.optimizer.state.values() for t in s.values())
    torch.distributed.destroy_process_group()
    est = trainer_estimate(spec, "policy", arch_of(spec))
    return {"measured_mib": (params + state + peaks[1]) / MIB, "first_extra_mib": (peaks[0] - peaks[1]) / MIB,
            "estimate_mib": est.total / MIB, **{f"{k}_mib": v / MIB for k, v in est.parts.items()},
            "tokens": rows * row}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,30m")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--write", action="store_true", help="write the table into bench/RESULTS.md")
    args = parser.parse_args()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:   # before the first allocation: re-run with it
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    lines = ["| size | micro-batch tokens | measured peak (MiB) | estimate (MiB) | estimate / measured | "
             "params + grads + optimizer | activations | logits | first update's extra (MiB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for size in args.sizes.split(","):
        r = measure(size, args.rows, args.length)
        static = r["params_mib"] + r["grads_mib"] + r["optimizer_mib"]
        lines.append(f"| {size} | {r['tokens']} | {r['measured_mib']:.1f} | {r['estimate_mib']:.1f} | "
                     f"{r['estimate_mib'] / r['measured_mib']:.2f} | {static:.1f} | "
                     f"{r['activations_mib']:.1f} | {r['logits_mib']:.1f} | {r['first_extra_mib']:.1f} |")
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    print(table)
    if args.write:
        command = (f"python bench/memory_plan.py --sizes {args.sizes} --rows {args.rows} --length "
                   f"{args.length} --write")
        write_section("memory_plan", f"`{command}` (fp32, one CPU trainer rank: parameters + AdamW state + "
                                     f"the growth of resident memory during a second update; {host()})"
                                     f"\n\n{table}\n")


if __name__ == "__main__":
    main()
