"""Which checkpoint `run.resume=auto` continues. (SIGTERM to a real `python -m molt` run, which finishes
the step in flight, checkpoints and exits 0: tests/test_loop.py, on the run it resumes exactly.)"""

from __future__ import annotations

import os
from pathlib import Path

from molt.driver.checkpoints import find_checkpoint
from molt.driver.compose import compose
from molt.spec.config import spec_yaml

SMALL = ["train.prompts_per_step=4", "rollout.samples_per_prompt=4", "train.micro_batch_size=8",
         "logging.plots=false", "logging.progress=false", "logging.wandb.mode=disabled",
         "rollout.engine.kv_cache_gib=0.25", "train.eval_every=0"]


def test_resume_auto_continues_the_newest_run_of_the_same_experiment(tmp_path):
    """After a driver crash the same command with run.resume=auto continues: the newest checkpoint among
    the runs of this experiment (a changed train.steps is still the same experiment; another lr is not)."""
    def run_dir(where: Path, overrides: list[str], step: int | None, written_at: int) -> Path:
        spec = compose([*SMALL, *overrides])
        spec.run.dir = str(where)
        where.mkdir(parents=True)
        (where / "spec.yaml").write_text(spec_yaml(spec))
        if step is not None:
            (where / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
            (where / "checkpoints" / f"step_{step:06d}" / "meta.json").write_text("{}")
            (where / "checkpoints" / "latest").write_text(f"step_{step:06d}")
            os.utime(where / "checkpoints" / "latest", (written_at, written_at))
        return where

    runs = tmp_path / "runs" / "tiny"
    older = run_dir(runs / "2026-01-01_00-00-00", [], 40, 100)
    newer = run_dir(runs / "2026-01-02_00-00-00", ["train.steps=9"], 20, 200)
    run_dir(runs / "2026-01-03_00-00-00", ["train.lr=1e-3"], 60, 300)       # another experiment
    run_dir(runs / "2026-01-04_00-00-00", [], None, 400)                    # crashed before a checkpoint
    now = compose([*SMALL, "run.resume=auto"])
    now.run.dir = str(runs / "2026-01-05_00-00-00")
    assert find_checkpoint(now) == newer / "checkpoints" / "step_000020"

    now.run.resume = str(older)                                            # explicit paths still work
    assert find_checkpoint(now) == older / "checkpoints" / "step_000040"
    now.run.resume = str(older / "checkpoints" / "step_000040")
    assert find_checkpoint(now) == older / "checkpoints" / "step_000040"

    # a sweep job continues the same job of an earlier sweep; with nothing to continue, a fresh start
    sweeps = tmp_path / "runs" / "sweeps"
    job = run_dir(sweeps / "tiny_2026-01-01" / "0_algo=rloo", ["algo=rloo"], 8, 100)
    run_dir(sweeps / "tiny_2026-01-01" / "1_algo=grpo", [], 9, 200)
    again = compose([*SMALL, "algo=rloo", "run.resume=auto"])
    again.run.dir = str(sweeps / "tiny_2026-01-02" / "0_algo=rloo")
    assert find_checkpoint(again) == job / "checkpoints" / "step_000008"
    again.run.dir = str(tmp_path / "elsewhere" / "x" / "run")
    assert find_checkpoint(again) is None
