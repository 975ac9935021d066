"""A trainer rank SIGKILLed in the middle of writing a checkpoint: the save fails (the run stops, nothing
hangs), `checkpoints/latest` still names the previous checkpoint, and that checkpoint loads into a fresh
trainer with exactly the weights it was saved with."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from faultlib import small_spec
from safetensors.torch import load_file

from molt.checkpoints import find_checkpoint, save_checkpoint
from molt.data import PromptDataset, PromptIterator
from molt.rollout.pool import RolloutPool
from molt.trainer.batch import make_batch
from molt.trainer.group import TrainerGroup
from molt.trajectory import Segment


def weights(group: TrainerGroup) -> dict[str, torch.Tensor]:
    """Full weights in checkpoint names, read back from an exported folder."""
    with tempfile.TemporaryDirectory() as tmp:
        group.export_hf(f"{tmp}/export")
        files = sorted(Path(tmp, "export").glob("*.safetensors"))
        return {k: v for f in files for k, v in load_file(f).items()}


def train_once(group: TrainerGroup) -> None:
    """One real optimizer step on a small fixed batch, so the weights move away from the checkpoint."""
    ids = list(range(3, 40))
    segment = Segment(ids, [0] * 5 + [1] * 32, [0.0] * 5 + [-2.0] * 32, [-1] * 5 + [0] * 32, "r", "g",
                      prompt_len=5)
    batch = make_batch([segment], 0)
    batch.update(old_logp=group.logprobs(batch), advantages=torch.ones_like(batch["loss_mask"]))
    group.train_step(batch)


def test_rank_killed_during_a_checkpoint_write_leaves_the_previous_one(ray_session, tmp_path):
    spec = small_spec(run={"dir": str(tmp_path), "resume": "auto"})
    data = PromptIterator(PromptDataset(spec.data.train_path, spec.data), seed=0)
    pool = RolloutPool(iter([]), None, 1, 1, 0)
    policy = TrainerGroup(spec, "policy")
    train_once(policy)
    saved = weights(policy)
    def extra(step: int) -> dict:
        return {"step": step, "version": step, "data": data.state_dict(), "pending": pool.pending_items()}

    first = save_checkpoint(spec, 1, {"policy": policy}, extra(1))
    train_once(policy)
    assert any(not torch.equal(saved[k], v) for k, v in weights(policy).items())

    [rank] = policy.workers
    pid = ray.get(rank.__ray_call__.remote(lambda self: os.getpid()))
    failure: list[BaseException] = []

    def save_second() -> None:
        try:
            save_checkpoint(spec, 2, {"policy": policy}, extra(2))
        except BaseException as err:   # noqa: BLE001 - recorded for the assertion below
            failure.append(err)

    writing = tmp_path / "checkpoints" / "step_000002" / ".policy.tmp"
    thread = threading.Thread(target=save_second)
    thread.start()
    while not writing.exists() and thread.is_alive():
        time.sleep(0.001)
    os.kill(pid, signal.SIGKILL)          # the rank dies mid-write
    thread.join(timeout=120)
    assert not thread.is_alive() and failure and isinstance(failure[0], ray.exceptions.RayActorError), failure

    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text() == "step_000001" and find_checkpoint(spec) == first
    assert sorted(p.name for p in (root / "step_000002").iterdir()) == [".policy.tmp"]   # the torn write
    with pytest.raises(ray.exceptions.RayActorError):   # further trainer calls fail at once, no hang
        policy.logprobs(make_batch([Segment([3, 4], [0, 1], [0.0, -1.0], [-1, 0], "r", "g")], 0))
    policy.shutdown()                    # tolerates the dead rank

    fresh = TrainerGroup(spec, "policy")
    try:
        extra = fresh.load(str(first / "policy"))
        assert extra["step"] == 1 and extra["version"] == 1
        restored = weights(fresh)
        assert restored.keys() == saved.keys() and all(torch.equal(saved[k], restored[k]) for k in saved)
    finally:
        fresh.shutdown()
