"""RunLogger: metrics.jsonl, progress bar, W&B offline run, rollout dump / replay round trip."""

from __future__ import annotations

import json
import time
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
import torch

from molt.driver.metrics import RunLogger, load_rollouts, wandb_mode
from molt.spec import RunSpec
from molt.trajectory import NO_VERSION, Rollout, Segment


def make_spec(run_dir: Path, **logging: object) -> RunSpec:
    return RunSpec.model_validate({
        "run": {"name": "t", "dir": str(run_dir), "seed": 1},
        "train": {"steps": 3},
        "logging": {"wandb": {"mode": "disabled", "name": "algo=grpo", "group": "sweep-1", "job_type": "grpo",
                          "tags": ["a", "b"]},
                    "plots": False, **logging},
    })


def test_metrics_jsonl_and_progress_bar(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = time.time()
    with closing(RunLogger(make_spec(tmp_path))) as logger:
        logger.log(1, {"reward/mean": 0.25, "time/step": 1.5, "tokens/per_s": 100})   # the loop logs
        logger.log(2, {"reward/mean": np.float32(0.5), "train/loss": torch.tensor(-0.125)})  # from step 1
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(before <= r["time"] <= time.time() for r in records)
    assert {k: v for k, v in records[0].items() if k != "time"} == \
        {"step": 1, "reward/mean": 0.25, "time/step": 1.5, "tokens/per_s": 100.0}
    assert {k: v for k, v in records[1].items() if k != "time"} == \
        {"step": 2, "reward/mean": 0.5, "train/loss": -0.125}
    bar = capsys.readouterr().err
    assert "2/3" in bar and "3/3" not in bar   # two steps logged of three: the bar must not run ahead
    assert "reward=0.500" in bar and "step_s=1.5" in bar and "tok/s=100" in bar

    # a logger opened again on the same run directory appends (it never truncates the file)
    with closing(RunLogger(make_spec(tmp_path, progress=False))) as logger:
        logger.log(3, {"reward/mean": 1.0})
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert "reward" not in capsys.readouterr().err


@pytest.mark.parametrize("threads", [None, 2])
def test_a_step_far_slower_on_an_overloaded_host_names_cpu_threads_once(tmp_path: Path, capsys, monkeypatch,
                                                                        threads: int | None) -> None:
    """A step 4x the earlier steps' median (the first, warming up, left out) while the 1-minute load exceeds
    the cores is said once, naming parallel.cpu_threads; a slow step on a host within its cores, a slow
    first step, or a second slow step say nothing. (The load is the one thing faked: a host's 1-minute
    average takes minutes to move.)"""
    import os

    cores = len(os.sched_getaffinity(0))
    load = [float(cores)]
    monkeypatch.setattr(os, "getloadavg", lambda: (load[0], 0.0, 0.0))
    spec = make_spec(tmp_path, progress=False)
    spec.parallel.cpu_threads = threads
    with closing(RunLogger(spec)) as logger:
        for step, seconds in enumerate([9.0, 1.0, 1.2, 0.8, 5.0], start=1):   # load == cores: not over
            logger.log(step, {"time/step": seconds})
        assert capsys.readouterr().out == ""
        load[0] = cores + 3.5
        for step, seconds in enumerate([3.9, 6.0, 9.0], start=6):   # 3.9 < 4 x the median 1.1
            logger.log(step, {"time/step": seconds})
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith(f"molt: step 7 took 6.0 s, 5x the earlier steps, while the "
                                               f"host's load ({cores + 3.5:.1f}) exceeds its {cores} cores")
    assert f"parallel.cpu_threads={threads or 'null'}" in out[0]


def test_run_dir_required() -> None:
    with pytest.raises(ValueError, match="run.dir"):
        RunLogger(RunSpec())


def test_wandb_mode_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert wandb_mode("auto") == "offline"
    assert wandb_mode("online") == "online"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode("online") == "disabled"


def test_wandb_offline_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = RunLogger(make_spec(tmp_path, progress=False))
    run = logger._wandb
    assert (run.name, run.group, run.job_type, list(run.tags), run.project) == \
        ("algo=grpo", "sweep-1", "grpo", ["a", "b"], "molt")
    assert run.config["run"]["dir"] == str(tmp_path) and run.config["train"]["steps"] == 3
    logger.log(0, {"reward/mean": 0.5})
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("*.wandb")), "the offline run has no .wandb log file"


def make_rollouts() -> list[Rollout]:
    lp = torch.log_softmax(torch.randn(6, generator=torch.Generator().manual_seed(0)), 0).tolist()
    seg0 = Segment(token_ids=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1], logprobs=[0.0, 0.0, lp[0], lp[1]],
                   versions=[NO_VERSION, NO_VERSION, 3, 4], rollout_id="r0", group_id="g0", prompt_len=2,
                   finish_reason="length")
    seg1 = Segment(token_ids=[5, 6, 7], loss_mask=[0, 1, 1], logprobs=[0.0, lp[2], lp[3]],
                   versions=[NO_VERSION, 4, 4], rollout_id="r0", group_id="g0", segment_index=1, prompt_len=1,
                   routed_experts=[[[0, 1]], [[2, 3]], [[1, 3]]])
    seg2 = Segment(token_ids=[9, 8], loss_mask=[0, 1], logprobs=[0.0, 0.1 + 0.2], versions=[NO_VERSION, 0],
                   rollout_id="r1", group_id="g0", prompt_len=1, finish_reason="abort")
    return [Rollout("r0", "g0", [seg0, seg1], reward=0.75, score=1.0, label={"answer": "a"},
                    info={"turns": 2.0}),
            Rollout("r1", "g0", [seg2], reward=0.0, error="Timeout: agent took > 60 s")]


def test_rollout_dump_round_trip(tmp_path: Path) -> None:
    rollouts = make_rollouts()
    with closing(RunLogger(make_spec(tmp_path, progress=False))) as logger:
        path = logger.dump_rollouts(7, rollouts[:1])
        assert logger.dump_rollouts(7, rollouts[1:]) == path   # appends to the step's file
    assert path == tmp_path / "rollouts" / "step_000007.jsonl"
    loaded = load_rollouts(path)
    assert loaded == rollouts
    assert [type(s) for r in loaded for s in r.segments] == [Segment] * 3
    record = json.loads(path.read_text().splitlines()[0])
    assert record["segments"][1]["segment_index"] == 1 and record["error"] is None

    # re-running step 7 replaces its file
    with closing(RunLogger(make_spec(tmp_path, progress=False))) as resumed:
        resumed.dump_rollouts(7, rollouts[1:])
    assert load_rollouts(path) == rollouts[1:]

    # in one process too: step 8, the first after a checkpoint at 7, failed after its dump; the trainer
    # restart redoes it (molt/driver/loop.py: restart_trainers, then redo_steps), and only the redo's batch
    # stays
    with closing(RunLogger(make_spec(tmp_path, progress=False))) as logger:
        failed = logger.dump_rollouts(8, rollouts[:1])
        logger.redo_steps()
        assert logger.dump_rollouts(8, rollouts[1:]) == failed
    assert load_rollouts(failed) == rollouts[1:]


def test_dump_disabled_and_plots_on_close(tmp_path: Path) -> None:
    logger = RunLogger(make_spec(tmp_path, progress=False, dump_rollouts=False, plots=True))
    assert logger.dump_rollouts(0, make_rollouts()) is None
    for step in range(3):
        logger.log(step, {"reward/mean": step / 2})
    assert logger.close() == [tmp_path / "plots" / "reward.png"]
    assert not (tmp_path / "rollouts").exists()
    assert (tmp_path / "plots" / "reward.png").stat().st_size > 0


def test_throughput_per_gpu_and_stage_is_nemo_rls_arithmetic() -> None:
    """tokens/s/GPU = the batch's tokens / (the stage's seconds x its devices), worked out by hand for
    qwen30b_tools' layout (8 policy ranks on node 0, 8 one-GPU engines on node 1): sync generation is the
    wait for the batch; async adds the logprob and training passes (NeMo-RL's exposed generation); no
    logprob line for a step that ran no logprob pass; the colocated GPU counts once for every stage."""
    from molt.driver.compose import compose
    from molt.driver.throughput import stage_devices, throughput

    step = {"tokens/total": 16000.0, "time/wait_batch": 10.0, "time/logprobs": 2.0, "time/train": 4.0,
            "time/step": 20.0}
    spec = compose(["+experiment=qwen30b_tools", "rollout.mode=sync"])
    assert stage_devices(spec) == {"trainer": 8, "engines": 8, "all": 16}
    assert throughput(spec, step) == {"throughput/generation_tokens_per_s_per_gpu": 200.0,
                                      "throughput/logprobs_tokens_per_s_per_gpu": 1000.0,
                                      "throughput/training_tokens_per_s_per_gpu": 500.0,
                                      "throughput/e2e_tokens_per_s_per_gpu": 50.0}
    spec = compose(["+experiment=qwen30b_tools"])   # async
    assert throughput(spec, step)["throughput/generation_tokens_per_s_per_gpu"] == 16000 / (16 * 8)
    assert "throughput/logprobs_tokens_per_s_per_gpu" not in throughput(spec, {**step, "time/logprobs": 0.0})
    spec = compose(["parallel=gpu1", "model.reference=policy", "algo.kl.coef=0.1"])
    assert stage_devices(spec) == {"trainer": 1, "engines": 1, "all": 1}
    assert throughput(spec, step)["throughput/training_tokens_per_s_per_gpu"] == 4000.0
