"""Helpers of the trainer tests: one rank in the test process, and a trainer's full weights."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
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
