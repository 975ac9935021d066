"""Which checkpoint `run.resume=auto` continues. (SIGTERM to a real `python -m molt` run, which finishes
the step in flight, checkpoints and exits 0: tests/test_loop.py, on the run it resumes exactly.)"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import yaml

from molt.driver.checkpoints import find_checkpoint
from molt.driver.compose import compose
from molt.spec import RunSpec
from molt.spec.config import spec_yaml

SMALL = ["train.prompts_per_step=4", "rollout.samples_per_prompt=4", "train.micro_batch_size=8",
         "logging.plots=false", "logging.progress=false", "logging.wandb.mode=disabled",
         "rollout.engine.kv_cache_gib=0.25", "train.eval_every=0"]


def test_resume_auto_continues_the_newest_run_of_the_same_experiment(tmp_path, capsys):
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
    # the run passed over is named with the key that makes it another experiment
    assert capsys.readouterr().out.splitlines() == [
        f"molt: run.resume=auto: not continuing {runs / '2026-01-03_00-00-00'}: train.lr differs (0.001 "
        f"there, {now.train.lr!r} here)"]

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
    capsys.readouterr()
    assert find_checkpoint(again) is None
    assert capsys.readouterr().out == (f"molt: run.resume=auto: starting {again.run.dir} fresh: no run "
                                       "beside it has a checkpoint\n")


def run_with_spec(where: Path, spec: dict, step: int) -> Path:
    """A run folder with a checkpoint at `step`, written by a run whose dumped spec was `spec`."""
    where.mkdir(parents=True)
    (where / "spec.yaml").write_text(yaml.safe_dump(spec))
    (where / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
    (where / "checkpoints" / "latest").write_text(f"step_{step:06d}")
    return where


def test_resume_auto_continues_a_run_whose_spec_predates_a_key(tmp_path, capsys):
    """An upgrade added keys (and removed one) since the run was written: a key its spec.yaml lacks, which
    this spec holds at its default, and a key this version no longer has do not make it another
    experiment. The same key away from its default does, and the skip names it; so does a new key of a
    section this version added, set away from its default. Nothing to continue: one line says why."""
    runs = tmp_path / "runs" / "tiny"
    now = compose([*SMALL, "run.resume=auto"])
    now.run.dir = str(runs / "2026-01-09_00-00-00")
    dumped = now.model_dump(mode="json")
    old = copy.deepcopy(dumped)
    del old["train"]["best_mode"]                 # added since: this spec holds its default
    del old["rollout"]["engine"]["enforce_eager"]  # nested, added since
    del old["agent"]["judge"]                     # a whole section added since
    old["train"]["retired_knob"] = 7              # removed since: nothing here reads it
    assert now.train.best_mode == RunSpec().train.best_mode
    older = run_with_spec(runs / "2026-01-01_00-00-00", old, 30)
    assert find_checkpoint(now) == older / "checkpoints" / "step_000030"
    assert capsys.readouterr().out == ""

    changed = compose([*SMALL, "run.resume=auto", "train.best_mode=min"])
    changed.run.dir = now.run.dir
    assert find_checkpoint(changed) is None
    out = capsys.readouterr().out.splitlines()
    assert out == [f"molt: run.resume=auto: not continuing {older}: train.best_mode differs ('max' there, "
                   "'min' here)",
                   f"molt: run.resume=auto: starting {now.run.dir} fresh: the 1 run(s) beside it with a "
                   "checkpoint differ (above)"]
    compiled = compose([*SMALL, "run.resume=auto", "rollout.engine.enforce_eager=false"])
    compiled.run.dir = now.run.dir
    assert find_checkpoint(compiled) is None
    assert "rollout.engine.enforce_eager differs (True there, False here)" in capsys.readouterr().out
