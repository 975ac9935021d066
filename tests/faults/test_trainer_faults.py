"""Trainer ranks killed. In the middle of writing a checkpoint: the save fails (nothing hangs),
`checkpoints/latest` still names the previous checkpoint, and that checkpoint loads into a fresh trainer with
exactly the weights it was saved with. During a run: the run rebuilds the trainer from that checkpoint and
goes on."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import psutil
import pytest
import ray
import torch
from faultlib import small_spec, train_once
from poollib import FnGroups
from trainerlib import full_weights, one_rank

from molt.driver.checkpoints import find_checkpoint, save_checkpoint
from molt.inputs.data import PromptDataset, PromptIterator
from molt.rollout.pool import RolloutPool
from molt.trainer.batch import make_batch
from molt.trainer.ranks import TrainerRanks, gather
from molt.trajectory import Segment


def test_rank_killed_during_a_checkpoint_write_leaves_the_previous_one(ray_session, tmp_path):
    spec = small_spec(run={"dir": str(tmp_path), "resume": "auto"})
    data = PromptIterator(PromptDataset(spec.data.train_path, spec.data), seed=0)
    pool = RolloutPool(iter([]), FnGroups(None, 1), 1, 0)
    policy = TrainerRanks(spec, "policy")
    train_once(policy)
    saved = full_weights(policy)
    def extra(step: int) -> dict:
        return {"step": step, "version": step, "data": data.state_dict(), "pending": pool.pending_items()}

    first = save_checkpoint(spec, 1, {"policy": policy}, extra(1))
    train_once(policy)
    assert any(not torch.equal(saved[k], v) for k, v in full_weights(policy).items())

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

    with one_rank(spec) as fresh:
        extra = fresh.load(str(first / "policy"))
        restored = full_weights(fresh)
    assert extra["step"] == 1 and extra["version"] == 1
    assert restored.keys() == saved.keys() and all(torch.equal(saved[k], restored[k]) for k in saved)


def test_a_dead_rank_is_reported_as_its_death_not_as_the_survivors_error(ray_session, tmp_path):
    """Rank 1 dies; rank 0's next collective fails too ("connection reset"). Once both answers are in,
    `ray.get` raises rank 0's error first (list order), which the loop would not restart from; `gather`
    raises the death (RayActorError). In a run the race goes either way (the reset can beat Ray's death
    notice); waiting for both answers makes the losing order certain here."""
    policy = TrainerRanks(small_spec(parallel={"dp_size": 2}), "policy")
    try:
        train_once(policy)
        os.kill(ray.get(policy.workers[1].__ray_call__.remote(lambda self: os.getpid())), signal.SIGKILL)
        refs = [w.save.remote(str(tmp_path / "save"), {}) for w in policy.workers]
        ray.wait(refs, num_returns=len(refs))
        with pytest.raises(ray.exceptions.RayTaskError):   # the survivor's symptom comes first
            ray.get(refs)
        with pytest.raises(ray.exceptions.RayActorError):
            gather(refs)
    finally:
        policy.shutdown()


def trainer_pids() -> list[int]:
    """Pids of this test process's trainer rank actors (Ray sets their process title). psutil finds
    children by parent pid and tolerates processes and threads that exit while it looks."""
    pids = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.cmdline()[:1] and child.cmdline()[0].startswith("ray::TrainerWorker"):
                pids.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return pids


def test_a_killed_trainer_rank_resumes_from_the_last_checkpoint(ray_session, tmp_path, capfd):
    """2 ranks; one is SIGKILLed after step 3 (the last checkpoint is step 2): the run rebuilds the trainer
    from step 2 in new actors and finishes all 6 steps, each counted once, at the data position of 6 steps."""
    from molt.driver.loop import train

    spec = small_spec(run={"dir": str(tmp_path)}, parallel={"dp_size": 2},
                      train={"steps": 6, "save_every": 2, "prompts_per_step": 2, "max_trainer_restarts": 1},
                      rollout={"engine": {"kv_cache_gib": 0.1}},
                      logging={"plots": False, "progress": False, "wandb": {"mode": "disabled"}})
    killed: list[int] = []
    others = set(trainer_pids())   # ranks of another test in this process (the session's `trainer`)

    def kill_a_rank_after_step_3() -> None:
        metrics = tmp_path / "metrics.jsonl"
        while not (metrics.exists() and '"step": 3' in metrics.read_text()):
            time.sleep(0.05)
        pids = [p for p in trainer_pids() if p not in others]
        os.kill(pids[-1], signal.SIGKILL)
        killed.append(pids[-1])

    killer = threading.Thread(target=kill_a_rank_after_step_3, daemon=True)
    killer.start()
    last = train(spec)
    assert killed and last["trainer/restarts"] == 1.0
    assert "a trainer rank died" in capfd.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert steps[-3:] == [4, 5, 6] and sorted(set(steps)) == [1, 2, 3, 4, 5, 6]   # steps after 2 redone
    assert [r["trainer/restarts"] for r in records if r["step"] <= 2][:2] == [0.0, 0.0]
    meta = json.loads((tmp_path / "checkpoints" / "step_000006" / "meta.json").read_text())
    assert meta["step"] == meta["version"] == 6 and meta["pending"] == []
    assert meta["data"]["index"] + 256 * meta["data"]["epoch"] == 2 * 6   # 2 prompts a step, none twice
    # The rebuilt trainer was stopped too. `ray.kill` returns before the process exits, which takes
    # longer while another test loads the cores: a leaked rank lives on, a stopped one is gone soon.
    deadline = time.time() + 30
    while set(trainer_pids()) - others and time.time() < deadline:
        time.sleep(0.2)
    assert not set(trainer_pids()) - others


def test_ranks_that_cannot_be_placed_stop_with_a_message(ray_session, monkeypatch):
    """A cluster large enough for the plan but busy: the trainer's placement group waits for resources
    that other work holds. It used to wait forever without a word; it stops after PLACEMENT_TIMEOUT_S with
    what it waited for, and gives its reservation back."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from molt.trainer import ranks

    busy = placement_group([{"CPU": ray.available_resources()["CPU"]}])   # other work takes every free CPU
    ray.get(busy.ready(), timeout=60)
    monkeypatch.setattr(ranks, "PLACEMENT_TIMEOUT_S", 2.0)
    try:
        with pytest.raises(RuntimeError, match=r"policy's 1 trainer rank\(s\).*not placed within 2 s.*"
                                               r"other work holds those resources"):
            TrainerRanks(small_spec(), "policy")
    finally:
        remove_placement_group(busy)
    pending = [pg for pg in ray.util.placement_group_table().values() if pg["state"] == "PENDING"]
    assert not pending, pending
