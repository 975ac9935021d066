"""Helpers of the trainer tests: one rank in the test process, and a trainer's full weights."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from molt.spec import RunSpec


@contextmanager
def one_rank(spec: RunSpec, role: str = "policy", path: str | None = None) -> Iterator[Any]:
    """The one `TrainerWorker` of a world-size-1 trainer, set up in this process: the code a TrainerRanks
    rank runs (`forward` is its logprobs or values), without a Ray actor's start (≈10 CPU-s of imports).
    The rank sets torch.distributed's variables, torch's threads and seed; they are restored on exit."""
    from molt.plan.models import model_path
    from molt.trainer.worker import TrainerWorker

    assert spec.parallel.world_size == 1, "one_rank is world size 1; use TrainerRanks for more"
    environ, threads, rng = dict(os.environ), torch.get_num_threads(), torch.get_rng_state()
    worker = TrainerWorker(spec, role, 0, path or model_path(spec, role))
    try:
        worker.setup(*worker.address())
        yield worker
    finally:
        worker.shutdown()
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)


def full_weights(trainer: Any) -> dict[str, torch.Tensor]:
    """A trainer's (TrainerRanks or one rank's) full weights in checkpoint names, read back from an
    exported folder."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer.export_hf(f"{tmp}/export")
        files = sorted(Path(tmp, "export").glob("*.safetensors"))
        return {k: v for f in files for k, v in load_file(f).items()}


def forked_ranks(spec: RunSpec, work: Callable[[Any], Any], role: str = "policy",
                 timeout_s: float = 240.0) -> list[Any]:
    """`work(worker)` on each of the `parallel.world_size` `TrainerWorker`s of `spec`, one per process forked
    from this one; their results in rank order. A fork inherits the worker's modules already imported here,
    so a rank starts at once (a spawned process or a Ray actor imports for ≈10 CPU-s); the ranks form a real
    gloo group. Forked processes must not start OpenMP thread pools: `parallel.cpu_threads` must be 1."""
    import gc
    import multiprocessing
    import pickle
    import traceback

    from molt.plan.models import model_path
    from molt.trainer.worker import TrainerWorker

    assert spec.parallel.cpu_threads == 1, "forked ranks need parallel.cpu_threads=1"
    size, path = spec.parallel.world_size, model_path(spec, role)
    context = multiprocessing.get_context("fork")
    results, address = context.Queue(), context.Queue()

    def rank_main(rank: int) -> None:
        try:
            worker = TrainerWorker(spec, role, rank, path)
            if rank == 0:
                host_port = worker.address()
                for _ in range(size - 1):
                    address.put(host_port)
            worker.setup(*(host_port if rank == 0 else address.get(timeout=timeout_s)))
            out = work(worker)
            worker.shutdown()
            results.put((rank, pickle.dumps(out), None))
        except BaseException:   # the parent raises it
            results.put((rank, None, traceback.format_exc()))

    processes = [context.Process(target=rank_main, args=(r,), daemon=True) for r in range(size)]
    # A rank must never free what it inherits. This process's uncollected garbage may hold an earlier
    # rank's process group (`one_rank`'s, in a reference cycle until the next full collection), whose
    # destructor waits until the group's threads stop waiting on it; a fork copies no thread, so a child's
    # first full collection would hang there. Objects frozen at the fork stay out of the children's
    # collections (the gc module's recipe for fork without exec).
    gc.freeze()
    try:
        for p in processes:
            p.start()
    finally:
        gc.unfreeze()
    got: list[tuple[int, bytes | None, str | None]] = []
    try:
        while len(got) < size and not any(error for *_, error in got):   # a failed rank stops the rest
            got.append(results.get(timeout=timeout_s))
    finally:
        for p in processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = [f"rank {rank}:\n{error}" for rank, _, error in sorted(got) if error]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [pickle.loads(out) for _, out, _ in sorted(got)]
