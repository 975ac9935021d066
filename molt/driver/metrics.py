"""Run observability: metrics.jsonl, W&B, a console progress bar, and rollout dumps.

The loop calls `RunLogger.log(step, metrics)` once per step and `dump_rollouts(step, rollouts)` with
the batch it trained on. Everything lands in the run directory, so a run is inspectable (and its
batches replayable with `load_rollouts`) without W&B. Metric names are documented in docs/loop.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from molt.spec import RunSpec
from molt.trajectory import Rollout, Segment

TRAINER_KEY = "trainer"   # a dumped rollout's trainer side (`learn`'s record), beside its Rollout fields

# Shown on the progress bar, in this order: (metric name, short label, format).
BAR_FIELDS = (("reward/mean", "reward", ".3f"), ("train/nll", "nll", ".3f"), ("time/step", "step_s", ".3g"),
              ("tokens/per_s", "tok/s", ".0f"))
# A step this many times the median of the earlier ones, while the host's load exceeds its cores, is named
# once in the log with parallel.cpu_threads: other work on the host slows threads that wait on each other.
SLOW_STEP = 4.0


def wandb_mode(configured: str) -> str:
    """WANDB_MODE in the environment wins; `auto` is online with an API key, else offline.

    Offline runs land in <run dir>/wandb/offline-run-*; Molt never syncs them (`wandb sync` hangs
    without network), the user does when they want to.
    """
    env = os.environ.get("WANDB_MODE")
    if env:
        return env
    if configured == "auto":
        return "online" if os.environ.get("WANDB_API_KEY") else "offline"
    return configured


def load_rollouts(path: str | Path) -> list[Rollout]:
    """Read a rollout dump (one JSON object per line) back into Rollouts, field for field (the trainer's
    side, which the inspector reads, is left out)."""
    rollouts = []
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                record.pop(TRAINER_KEY, None)
                record["segments"] = [Segment(**s) for s in record["segments"]]
                rollouts.append(Rollout(**record))
    return rollouts


def add_token_record(record: dict[str, dict], segments: list[Segment], tokens: dict[str, Any]) -> None:
    """Put the policy's per-token record (`TrainerRanks.token_record`: [S, T] per field, rows in `segments`
    order) into `record` (`learn`'s), under each segment's rollout: {"segments": [{"segment_index", and
    per field one value per token of the segment}]}."""
    for row, segment in enumerate(segments):
        n = len(segment.token_ids)
        fields = {k: v[row, :n].tolist() for k, v in tokens.items()}
        for key in ("input_ids", "loss_mask", "decisions"):
            fields[key] = [int(x) for x in fields[key]]
        record.setdefault(segment.rollout_id, {}).setdefault("segments", []).append(
            {"segment_index": segment.segment_index, **fields})


def _listed(value: Any) -> Any:
    if isinstance(value, np.ndarray):  # routed experts
        return value.tolist()
    raise TypeError(f"cannot dump {type(value).__name__}")


class RunLogger:
    """Per-step logging for one run; `close()` (or the context manager) finishes W&B and writes plots."""

    def __init__(self, spec: RunSpec) -> None:
        if not spec.run.dir:
            raise ValueError("RunLogger needs run.dir (the launcher sets it from Hydra's output directory)")
        self.spec = spec
        self.dir = Path(spec.run.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        # Append, never truncate: a run directory opened again keeps its steps. A resumed run has a run
        # directory of its own (a new start time), so its file starts at the step after its checkpoint.
        self._metrics = (self.dir / "metrics.jsonl").open("a", encoding="utf-8")
        self._wandb = self._init_wandb()
        self._dumping: int | None = None   # the step whose rollout file this process has started last
        self._step_times: list[float] = []   # time/step of the steps so far (`_note_busy_host`)
        self._busy_said = False
        self._bar = None
        if spec.logging.progress:
            from tqdm import tqdm

            self._bar = tqdm(total=spec.train.steps, desc=spec.run.name, unit="step", dynamic_ncols=True)

    def _init_wandb(self) -> Any:
        mode = wandb_mode(self.spec.logging.wandb.mode)
        if mode == "disabled":
            return None
        import wandb

        cfg = self.spec.logging.wandb
        # A new W&B run at each start, a resumed run too (no id / resume): offline W&B cannot resume a run,
        # and syncing two offline runs of one id keeps only the last (wandb/wandb#4624, #5865). The link is
        # the same name and, in the config, run.resume (docs/observability.md).
        # quiet: W&B's start lines (mode, local folder) stay; its end-of-run history dump does not
        return wandb.init(project=cfg.project, entity=cfg.entity, group=cfg.group, job_type=cfg.job_type,
                          tags=cfg.tags or None, mode=mode, dir=str(self.dir),
                          name=cfg.name or self.spec.run.name,
                          config=self.spec.model_dump(mode="json"), reinit="create_new",
                          settings=wandb.Settings(quiet=True))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        values = {k: float(v) for k, v in metrics.items()}
        self._metrics.write(json.dumps({"step": step, "time": time.time(), **values}) + "\n")
        self._metrics.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=step)
        if self._bar is not None:
            self._bar.update(step - self._bar.n)  # `step` counts finished steps; a resumed run starts mid-bar
            shown = {label: format(values[k], fmt) for k, label, fmt in BAR_FIELDS if k in values}
            self._bar.set_postfix(shown)
        if "time/step" in values:
            self._note_busy_host(step, values["time/step"])

    def _note_busy_host(self, step: int, seconds: float) -> None:
        """Say once when a step takes SLOW_STEP times the earlier steps' median (the first one, which
        warms up, left out) while the host's 1-minute load exceeds the cores this process may use."""
        earlier, self._step_times = self._step_times[1:], self._step_times + [seconds]
        if self._busy_said or len(earlier) < 3 or seconds < SLOW_STEP * float(np.median(earlier)):
            return
        load, cores = os.getloadavg()[0], len(os.sched_getaffinity(0))
        if load <= cores:
            return
        self._busy_said = True
        threads = self.spec.parallel.cpu_threads
        hint = {None: "parallel.cpu_threads=null already computes on the cores other work leaves idle",
                1: "parallel.cpu_threads=1 already keeps each process to one thread"}.get(
            threads, f"parallel.cpu_threads={threads}: null computes on the cores other work leaves idle")
        print(f"molt: step {step} took {seconds:.1f} s, {seconds / np.median(earlier):.0f}x the earlier "
              f"steps, while the host's load ({load:.1f}) exceeds its {cores} cores: other work is taking "
              f"them ({hint})", flush=True)

    def dump_rollouts(self, step: int, rollouts: list[Rollout],
                      trainer: dict[str, dict] | None = None) -> Path | None:
        """Append this step's rollouts to rollouts/step_XXXXXX.jsonl (unless logging.dump_rollouts is off),
        each with its `trainer` side under the key "trainer" (`learn`'s record: the inspector's view).

        The first dump of a step in this process truncates the file: a resumed run re-runs the steps
        after its checkpoint, and their files must hold the new batch, not the killed run's too (within
        one process, after `redo_steps`). Files of steps `logging.dump_keep_steps` or more before this
        one are deleted (0 keeps all).
        """
        if not self.spec.logging.dump_rollouts:
            return None
        path = self.dir / "rollouts" / f"step_{step:06d}.jsonl"
        path.parent.mkdir(exist_ok=True)
        with path.open("a" if step == self._dumping else "w", encoding="utf-8") as f:
            self._dumping = step
            for rollout in rollouts:  # every field, so load_rollouts rebuilds each rollout exactly
                line = dataclasses.asdict(rollout)
                if trainer and rollout.rollout_id in trainer:
                    line[TRAINER_KEY] = trainer[rollout.rollout_id]
                f.write(json.dumps(line, default=_listed) + "\n")
        keep = self.spec.logging.dump_keep_steps
        if keep:
            for old in path.parent.glob("step_*.jsonl"):
                if old.stem[5:].isdigit() and int(old.stem[5:]) <= step - keep:
                    old.unlink(missing_ok=True)
        return path

    def redo_steps(self) -> None:
        """The loop goes back to a checkpoint (a trainer restart) and redoes the steps after it: the next
        dump of each step replaces its file. Otherwise, when the failed step was the first after the
        checkpoint, its redo's batch would be appended to the failed attempt's dump (twice the rows)."""
        self._dumping = None

    def close(self) -> list[Path]:
        """Finish W&B and the bar; write the PNG plots when logging.plots is on. Returns the plot paths."""
        self._metrics.close()
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if not self.spec.logging.plots:
            return []
        from molt.driver.plot import plot_run

        return plot_run(self.dir)
