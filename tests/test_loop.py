"""End to end: `python -m molt` on the tiny experiment with every component real.

One CLI run (sync, Env agent) is killed with SIGKILL one step after a checkpoint and resumed in a new
process, which redoes that step bit for bit and which SIGTERM then stops (it checkpoints and exits 0);
one in-process run uses async mode with a ChatAgent driving the OpenAI SDK. Both sample at temperature
0.7 with top-p 0.9, so the trainer must reproduce the engine's processed logprobs, not the raw model's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from molt.driver.checkpoints import find_checkpoint
from molt.driver.compose import compose
from molt.driver.metrics import load_rollouts
from molt.driver.plot import read_metrics as metrics_by_step
from molt.driver.select import agent_metrics
from molt.inputs.data import PromptDataset, PromptIterator

REPO = Path(__file__).resolve().parents[1]
# One thread per process: a redone step is bit for bit only on the threads of the first run, and null's
# follow the cores the suite's other work leaves (molt/plan/cores.py).
SMALL = ["train.prompts_per_step=4", "rollout.samples_per_prompt=4", "train.micro_batch_size=8",
         "rollout.temperature=0.7", "rollout.top_p=0.9", "parallel.cpu_threads=1",
         "logging.plots=false", "logging.progress=false", "logging.wandb.mode=disabled",
         "rollout.engine.kv_cache_gib=0.25"]


# The resumed run's layout: parallel.colocate, on CPU the layout that runs anyway (cores shared), through the
# colocated path: the engine's sleep and wake around every step, refits over the shared transport (/dev/shm)
COLOCATED = ["parallel.colocate=true", "parallel.engine_sleep_level=2"]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def check_trained_tokens(run_dir: Path, model_path: str) -> None:
    """Invariant 1 against the dump: loss-masked tokens carry the engine's version and logprob, and at
    step 1 (initial weights) those logprobs equal a plain transformers forward of the sampled ids under
    the sampling the segment records (temperature 0.7, top-p 0.9)."""
    import torch
    from transformers import AutoModelForCausalLM

    from molt.trainer.model import token_logprobs

    rollouts = load_rollouts(run_dir / "rollouts" / "step_000001.jsonl")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    gaps = []
    for r in rollouts:
        for s in r.segments:
            assert [span[1:] for span in s.sampling] == [[0.7, 0.9, -1]]
            ids = torch.tensor([s.token_ids])
            with torch.no_grad():
                logp, _ = token_logprobs(model(ids).logits, ids, torch.ones_like(ids), 0.7, 0.9)
            for t, m in enumerate(s.loss_mask):
                if m:
                    assert s.versions[t] == 0 and s.logprobs[t] <= 0
                    gaps.append(abs(float(logp[0, t]) - s.logprobs[t]))
                else:
                    assert s.versions[t] == -1
    assert gaps and max(gaps) <= 1e-5


def test_cli_run_killed_after_checkpoint_resumes_exactly_and_stops_on_sigterm(tmp_path, tiny_model_path,
                                                                              ray_session):
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    cli = [sys.executable, "-m", "molt", *SMALL, *COLOCATED, "train.steps=200", "train.eval_every=0"]
    proc = subprocess.Popen([*cli, "train.save_every=2", f"hydra.run.dir={run_a}"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    saved_step = kill_one_step_after_a_checkpoint(proc, run_a)
    checkpoint = run_a / "checkpoints" / f"step_{saved_step:06d}"
    saved = json.loads((checkpoint / "meta.json").read_text())
    assert saved["step"] == saved_step >= 2

    # The resumed run starts now, and its start-up (mostly imports on one core) overlaps the checks of
    # the killed run below; SIGTERM stops it after its first step: it finishes the step in flight,
    # checkpoints and exits 0. It attaches to this test's Ray (`ray.address`, as on a cluster): the
    # killed run started its own, and a second local start would only repeat that path.
    address = ray_session.get_runtime_context().gcs_address
    proc = subprocess.Popen([*cli, "train.save_every=0", f"run.resume={run_a}", f"hydra.run.dir={run_b}",
                             f"ray.address={address}"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)

    try:
        # The killed run: every step logged reward, refit and a trainer/engine gap; the first step's
        # trained tokens are exactly the engine's.
        rows = read_metrics(run_a)
        assert [r["step"] for r in rows[: saved["step"]]] == list(range(1, saved["step"] + 1))
        for r in rows:
            assert 0.0 <= r["reward/mean"] <= 1.0 and r["time/refit"] > 0 and r["policy/version"] == r["step"]
            assert r["time/engine_sleep"] > 0 and r["time/engine_wake"] > 0   # COLOCATED, around the step
        assert rows[0]["mismatch/max_abs"] <= 1e-5
        check_trained_tokens(run_a, tiny_model_path)

        # Replaying the dumped first batch on the initial weights reproduces the logged step exactly.
        from molt.driver.replay import replay

        replayed = replay(run_a, 1)
        for key in ("train/loss", "train/grad_norm", "mismatch/mean_abs", "tokens/trained"):
            assert replayed[key] == pytest.approx(rows[0][key], rel=1e-4, abs=1e-6), key
    except BaseException:   # a failed check must not leave the resumed run training
        proc.kill()
        raise

    out = stop_after_first_step(proc, run_b / "metrics.jsonl")
    assert f"resumed from {checkpoint}" in out
    resumed = read_metrics(run_b)
    check_sigterm_checkpoint(run_b, out, [r["step"] for r in resumed], first=saved["step"] + 1)
    check_same_steps(run_a, run_b, saved["step"] + 1)
    # Weights: the engines were refit from the loaded trainer weights, and they agree with the trainer.
    assert resumed[0]["policy/version"] == saved["version"] + 1 and resumed[0]["mismatch/max_abs"] <= 1e-5
    # Data position: the first resumed batch holds exactly the prompts the saved iterator yields next.
    spec = compose([*SMALL, *COLOCATED])
    iterator = PromptIterator(PromptDataset(spec.data.train_path, spec.data), seed=spec.run.seed)
    iterator.load_state_dict(saved["data"])
    consumed = saved["data"]["index"] + 256 * saved["data"]["epoch"]
    assert consumed == saved["step"] * spec.train.prompts_per_step
    expected = Counter(item["label"] for item in iterator.take(spec.train.prompts_per_step))
    batch = load_rollouts(run_b / "rollouts" / f"step_{saved['step'] + 1:06d}.jsonl")
    got = Counter(r.label for r in batch if r.rollout_id.endswith("-0"))
    assert got == expected


def stop_after_first_step(proc: subprocess.Popen, metrics: Path) -> str:
    """SIGTERM once `metrics` holds a step; returns the output of the process, which must exit 0."""
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline and not (metrics.exists() and metrics.read_text()):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-3000:]
    return out


def check_sigterm_checkpoint(run: Path, out: str, steps: list[int], first: int) -> None:
    """SIGTERM: the steps from `first` on ran in order, the last one was checkpointed whole (policy, meta,
    spec, no temporary files) with its data position, in a run directory only its owner can enter, and
    `run.resume` finds it."""
    assert f"stopped by signal at step {steps[-1]}" in out and steps == list(range(first, steps[-1] + 1))
    root = run / "checkpoints"
    assert (root / "latest").read_text() == f"step_{steps[-1]:06d}"
    meta = json.loads((root / f"step_{steps[-1]:06d}" / "meta.json").read_text())
    assert meta["step"] == meta["version"] == steps[-1]
    assert meta["data"]["index"] + 256 * meta["data"]["epoch"] == 4 * steps[-1]   # 256 rows per epoch
    assert sorted(p.name for p in (root / f"step_{steps[-1]:06d}").iterdir()) == ["meta.json", "policy",
                                                                                   "spec.yaml"]
    assert not list(root.rglob("*.tmp"))
    assert run.stat().st_mode & 0o777 == 0o700   # tools in the sandbox (another uid) cannot enter it
    assert find_checkpoint(compose([*SMALL, f"run.resume={run}"])) == root / f"step_{steps[-1]:06d}"


def kill_one_step_after_a_checkpoint(proc: subprocess.Popen, run: Path) -> int:
    """SIGKILL the run once it has logged the step after its latest checkpoint; returns that checkpoint's
    step. The driver is stopped (SIGSTOP) while the two are read, so neither moves in between."""
    latest, deadline = run / "checkpoints" / "latest", time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        if latest.exists() and (run / "metrics.jsonl").exists():
            proc.send_signal(signal.SIGSTOP)
            saved = int(latest.read_text().strip().removeprefix("step_"))
            if saved + 1 in metrics_by_step(run / "metrics.jsonl"):   # skips a line being written
                proc.send_signal(signal.SIGKILL)
                proc.communicate()
                return saved
            proc.send_signal(signal.SIGCONT)
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"no step logged after a checkpoint: {proc.communicate()[0][-3000:]}")


def check_same_steps(run_a: Path, run_b: Path, first: int) -> None:
    """Resumed from the checkpoint before step `first`, in new processes, the run redoes every step both
    runs logged (at least `first`) bit for bit: the same tokens with the same logprobs (the dump), the
    same loss, gradient norm and reward. Step `first` shows the weights, the data position and the
    request seeds were restored; the optimizer's state shows from the next step (and in test_trainer's
    test_resume_is_exact)."""
    a, b = metrics_by_step(run_a / "metrics.jsonl"), metrics_by_step(run_b / "metrics.jsonl")
    steps = sorted(a.keys() & b.keys())
    assert steps[0] == first, steps
    for step in steps:
        for key in ("reward/mean", "train/loss", "train/grad_norm", "mismatch/max_abs", "tokens/sampled",
                    "policy/version"):
            assert a[step][key] == b[step][key], (step, key)
        name = f"rollouts/step_{step:06d}.jsonl"
        assert load_rollouts(run_a / name) == load_rollouts(run_b / name), step


def test_async_chat_agent_run(tmp_path, ray_session, monkeypatch):
    """An async run of a ChatAgent, handing out the oldest groups first (rollout.handout=oldest: the pool the
    loop builds is asked for that order; the order itself: test_pool.py)."""
    from molt.driver.loop import train
    from molt.rollout.pool import RolloutPool

    pools, build = [], RolloutPool.__init__

    def init(self, *args, **kwargs) -> None:   # the real pool, noted
        pools.append(self)
        build(self, *args, **kwargs)
    monkeypatch.setattr(RolloutPool, "__init__", init)
    spec = compose([*SMALL, "agent=chat_minimal", "rollout.mode=async", "rollout.groups_in_flight=12",
                    "rollout.max_staleness=1", "train.steps=3", "train.save_every=0", "train.eval_every=3",
                    "agent.max_turns=2", "model.max_model_len=512", "rollout.handout=oldest"])
    spec.run.dir = str(tmp_path)
    last = train(spec)
    assert len(pools) == 1 and pools[0].oldest_first
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]   # step 0: the starting model's eval, alone
    assert set(rows[0]) == {"step", "time"} | {
        f"eval/repeat_eval/{k}" for k in ("mean@1", "pass@1", "failed", *agent_metrics([]))}
    rows = rows[1:]
    assert all(r["time/refit"] > 0 and "reward/mean" in r for r in rows)
    # throughput per device and stage (molt/driver/throughput.py): one engine, one rank; async generation
    # is the exposed wait plus the logprob and training passes (NeMo-RL's definition)
    for r in rows:
        seconds = r["time/wait_batch"] + r["time/logprobs"] + r["time/train"]
        assert r["throughput/generation_tokens_per_s_per_gpu"] * seconds == pytest.approx(r["tokens/total"])
    # Invariant 3 every step: on the batch's tokens of the current policy, or, in a batch of older groups
    # only (the engines finished all 12 before the refit), on the probe sampled right after the refit;
    # older tokens are reported as policy lag, within max_staleness. A probe drawn before the refit
    # fails the first assertion (max_abs 0.25-0.41).
    assert all(r["mismatch/max_abs"] <= 1e-5 for r in rows), [r["mismatch/max_abs"] for r in rows]
    assert all(r.get("mismatch/probe") or r["mismatch/stale_frac"] < 1 for r in rows)
    assert any(r.get("mismatch/probe") for r in rows)
    assert all(r["policy/lag_max"] <= spec.rollout.max_staleness for r in rows)
    assert rows[-1]["pool/stale_requeued"] >= 1   # groups left behind two versions ago were re-sampled
    assert "eval/repeat_eval/mean@1" in last and "eval/repeat_eval/pass@1" in last
    # Trained tokens were sampled by a policy at most max_staleness versions old.
    for r in rows[1:]:
        batch = load_rollouts(tmp_path / "rollouts" / f"step_{r['step']:06d}.jsonl")
        versions = {v for ro in batch for s in ro.segments
                    for v, m in zip(s.versions, s.loss_mask, strict=True) if m}
        assert versions and min(versions) >= r["step"] - 1 - spec.rollout.max_staleness


def test_a_loss_token_without_an_engine_version_is_refused():
    """Invariant 1 in the loop itself: no trainer is reached when a trained token lacks its engine stamp."""
    import asyncio

    from molt.driver.loop import learn
    from molt.trainer.ranks import Trainers
    from molt.trajectory import NO_VERSION, Rollout, Segment

    def rollout(i: int, version: int) -> Rollout:
        seg = Segment(token_ids=[1, 5, 6], loss_mask=[0, 1, 1], logprobs=[0.0, -1.0, -2.0],
                      versions=[NO_VERSION, 0, version], rollout_id=f"r{i}", group_id="g", prompt_len=1)
        return Rollout(rollout_id=f"r{i}", group_id="g", segments=[seg], reward=float(i))

    with pytest.raises(RuntimeError, match=r"rollout r1 segment 0 token 2 .*refusing to train"):
        asyncio.run(learn(compose(SMALL), [rollout(0, 0), rollout(1, NO_VERSION)], Trainers(), 0))


@pytest.fixture(autouse=True)
def _no_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
