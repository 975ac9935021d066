"""The run's checkpoints folder, shared by the RL loop and SFT.

    checkpoints/step_000050/   policy/ (+ critic/): torch DCP; meta.json: the loop's position;
                               spec.yaml: the spec that wrote it; hf/: a Hugging Face folder
                               when train.export_hf is on
    checkpoints/latest         name of the newest complete checkpoint (switched atomically)
    checkpoints/best.json      the checkpoint with the best train.best_metric so far, and its value
                               (a path when carried over from the run this one resumed from)

A checkpoint is written whole before `latest` names it. The last `train.keep_checkpoints` are kept, and
the best one too: a step whose eval improves `train.best_metric` is saved even between `train.save_every`
steps, so the best model always exists on disk.
SIGINT / SIGTERM end either loop the same way: the current step finishes, a checkpoint is written
(`install_stop_handler`).

A run directory is `runs/<run.name>/<start time>/` (a sweep job: `runs/sweeps/<name>_<time>/<job>/`).
`run.resume=auto` continues the newest run of the same experiment that has a checkpoint; with none the run
starts fresh, so one command both starts a run and continues it after the driver died. Two specs are the same
experiment when no key differs but NOT_IDENTITY's: a key one spec lacks counts at its default (a spec dumped
before an upgrade added a key, or after one removed it), a key this version no longer has is not compared.
Every run of the same name it passes over is printed with the first key that differs, and a fresh start says
why it is one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from pydantic import BaseModel

from molt.spec import RunSpec
from molt.spec.config import spec_yaml

log = logging.getLogger("molt")
# What may differ between a run and the run `run.resume=auto` continues (None: the whole section).
NOT_IDENTITY = {"run": ("dir", "resume", "dry_run"), "train": ("steps", "keep_checkpoints"), "logging": None,
                "ray": None}


def checkpoints_dir(spec: RunSpec) -> Path:
    return Path(spec.run.dir) / "checkpoints"


def latest_of(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run directory, if any."""
    latest = run_dir / "checkpoints" / "latest"
    return run_dir / "checkpoints" / latest.read_text().strip() if latest.is_file() else None


def _identity(spec: dict[str, Any]) -> dict[str, Any]:
    """A spec without what may differ between a run and the run it continues (NOT_IDENTITY)."""
    out = {}
    for section, value in spec.items():
        drop = NOT_IDENTITY.get(section, ())
        if drop is not None and isinstance(value, dict):
            out[section] = {k: v for k, v in value.items() if k not in drop}
        elif drop is not None:
            out[section] = value
    return out


def first_difference(saved: dict[str, Any], mine: dict[str, Any], schema: type[BaseModel] = RunSpec,
                     defaults: dict[str, Any] | None = None, where: str = "") -> tuple[str, Any, Any] | None:
    """The first key (dotted, in the schema's order) whose value differs between two dumped specs, with
    both values; None when they are the same experiment. A key one of them lacks is taken at its default
    (one dumped before an upgrade added the key), and a key the schema no longer has is skipped: nothing in
    this version reads it, so it cannot make the runs differ."""
    if defaults is None:
        defaults = RunSpec().model_dump(mode="json")
    for key in [*mine, *(k for k in saved if k not in mine)]:
        field = schema.model_fields.get(key)
        if field is None:
            continue
        section = field.annotation if isinstance(field.annotation, type) and \
            issubclass(field.annotation, BaseModel) else None
        if section is not None:   # a section: compared key by key, so its new keys take their defaults
            found = first_difference(saved.get(key) or {}, mine.get(key) or {}, section, defaults[key],
                                     f"{where}{key}.")
            if found:
                return found
        elif saved.get(key, defaults[key]) != mine.get(key, defaults[key]):
            return f"{where}{key}", saved.get(key, defaults[key]), mine.get(key, defaults[key])
    return None


def same_experiment_runs(spec: RunSpec) -> tuple[list[Path], int]:
    """Run directories of this experiment that have a checkpoint, the newest checkpoint last: this run's
    directory, the ones beside it and (a sweep job) the same job of earlier sweeps, whose spec.yaml equals
    this spec but for NOT_IDENTITY (`first_difference`); and how many others with a checkpoint were passed
    over, each printed with the first key that differs."""
    run_dir = Path(spec.run.dir)
    me = _identity(spec.model_dump(mode="json"))
    found, skipped = [], 0
    nearby = {run_dir, *run_dir.parent.glob("*"), *run_dir.parent.parent.glob(f"*/{run_dir.name}")}
    for candidate in sorted(nearby):
        latest = candidate / "checkpoints" / "latest"
        if not latest.is_file():
            continue
        if candidate != run_dir:
            saved = candidate / "spec.yaml"
            differs = first_difference(_identity(OmegaConf.to_container(OmegaConf.load(saved))), me) \
                if saved.is_file() else ("spec.yaml", "missing", "")
            if differs:
                key, there, here = differs
                skipped += 1
                print(f"molt: run.resume=auto: not continuing {candidate}: {key} differs ({there!r} there, "
                      f"{here!r} here)", flush=True)
                continue
        found.append((latest.stat().st_mtime_ns, str(candidate), candidate))
    return [c for *_, c in sorted(found)], skipped


def find_checkpoint(spec: RunSpec) -> Path | None:
    """run.resume: a checkpoint folder, a run folder (its latest checkpoint), or "auto": the newest
    checkpoint of this experiment (`same_experiment_runs`), None when there is none (a fresh start, printed
    with its reason)."""
    if not spec.run.resume:
        return None
    if spec.run.resume == "auto":
        runs, skipped = same_experiment_runs(spec)
        if runs:
            return _same_objective(spec, latest_of(runs[-1]))
        why = f"the {skipped} run(s) beside it with a checkpoint differ (above)" if skipped else \
            "no run beside it has a checkpoint"
        print(f"molt: run.resume=auto: starting {spec.run.dir} fresh: {why}", flush=True)
        return None
    target = Path(spec.run.resume)
    if latest_of(target):
        return _same_objective(spec, latest_of(target))
    if (target / "meta.json").exists():
        return _same_objective(spec, target)
    raise FileNotFoundError(f"run.resume={spec.run.resume}: no checkpoint there (expected a run folder with "
                            "checkpoints/latest or a checkpoint folder with meta.json)")


def _same_objective(spec: RunSpec, checkpoint: Path) -> Path:
    """`checkpoint`, when it continues this run's train.objective: an RL checkpoint holds a policy version
    and a prompt position, an SFT one a conversation position, and neither means anything to the other
    (an RL run resumed from SFT failed after its engines started; SFT took the RL run's data position)."""
    written = checkpoint / "spec.yaml"
    objective = OmegaConf.select(OmegaConf.load(written), "train.objective", default="rl") \
        if written.exists() else spec.train.objective
    if objective != spec.train.objective:
        raise ValueError(f"run.resume: {checkpoint} is a checkpoint of a train.objective={objective} run, "
                         f"this run's is {spec.train.objective}; to start from its weights, export it "
                         f"(python -m molt.export {checkpoint}) and set model.path to the export")
    return checkpoint


def read_best(root: Path) -> dict[str, Any] | None:
    """best.json of a checkpoints folder: {"checkpoint", "step", "metric", "value"}, or None."""
    path = root / "best.json"
    return json.loads(path.read_text()) if path.exists() else None


def carry_best(spec: RunSpec, checkpoint: Path) -> None:
    """A resumed run writes into a run directory of its own: copy in the best.json of the checkpoints folder
    it resumes from (when it records the same train.best_metric), naming that checkpoint by its path, so the
    resumed run's evals are compared with the best before the resume (`new_best`), `molt.export <run> best`
    finds it, and a run resumed from this one carries it on in turn."""
    carried = read_best(checkpoint.parent)
    if spec.train.best_metric is None or carried is None or carried["metric"] != spec.train.best_metric:
        return
    root = checkpoints_dir(spec)
    root.mkdir(parents=True, exist_ok=True)
    best = {**carried, "checkpoint": str((checkpoint.parent / carried["checkpoint"]).resolve())}
    (root / "best.json.tmp").write_text(json.dumps(best))
    os.replace(root / "best.json.tmp", root / "best.json")


def new_best(spec: RunSpec, step: int, metrics: dict[str, float]) -> float | None:
    """The value of train.best_metric at this step when it beats best.json's (or there is none yet); None
    when it does not, when this step did not evaluate, or at step 0 (there is no trained checkpoint)."""
    metric = spec.train.best_metric
    if metric is None or step == 0 or not any(k.startswith("eval/") for k in metrics):
        return None
    if metric not in metrics:
        names = ", ".join(sorted(k for k in metrics if k.startswith("eval/")))
        raise KeyError(f"train.best_metric={metric!r} is not an eval metric of this run; it has: {names}")
    value, best = metrics[metric], read_best(checkpoints_dir(spec))
    if best is None:
        return value
    better = value > best["value"] if spec.train.best_mode == "max" else value < best["value"]
    return value if better else None


# The roles whose weights a checkpoint holds (a reference is frozen: it is rebuilt from its model path).
TRAINED_ROLES = ("policy", "critic")


def save_checkpoint(spec: RunSpec, step: int, roles: dict[str, Any], extra: dict[str, Any],
                    best: float | None = None) -> Path:
    """checkpoints/step_N with the state of each trained role of `roles` (`extra`, the run's position, is
    saved with the policy's and as meta.json), the HF export when train.export_hf, then best.json (when
    `best` is a new best value) and `latest`."""
    root = checkpoints_dir(spec)
    path = root / f"step_{step:06d}"
    for name in TRAINED_ROLES:
        if roles.get(name) is not None:
            roles[name].save(str(path / name), extra if name == "policy" else {})
    (path / "meta.json").write_text(json.dumps(extra))
    (path / "spec.yaml").write_text(spec_yaml(spec))   # molt.export rebuilds the trainer from it
    if spec.train.export_hf:
        roles["policy"].export_hf(str(path / "hf"))
        log.info("molt: step %d exported as a Hugging Face model to %s", step, path / "hf")
    pointers = {"latest": path.name}
    if best is not None:
        pointers["best.json"] = json.dumps({"checkpoint": path.name, "step": step,
                                            "metric": spec.train.best_metric, "value": best})
        log.info("molt: new best %s = %.4g at step %d (%s)", spec.train.best_metric, best, step, path)
    for name, text in pointers.items():   # each switched atomically
        tmp = root / f"{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, root / name)
    kept = (read_best(root) or {}).get("checkpoint")
    for old in sorted(root.glob("step_*"))[:-spec.train.keep_checkpoints]:
        if old.name != kept:
            shutil.rmtree(old, ignore_errors=True)
    return path


def load_checkpoint(checkpoint: Path, roles: dict[str, Any]) -> dict[str, Any]:
    """Load a checkpoint folder into each trained role of `roles`; returns the run's position saved with
    the policy (`save_checkpoint`'s `extra`)."""
    extra = roles["policy"].load(str(checkpoint / "policy"))
    for name in TRAINED_ROLES[1:]:
        if roles.get(name) is not None:
            roles[name].load(str(checkpoint / name))
    return extra


def install_stop_handler() -> asyncio.Event:
    """SIGINT / SIGTERM finish the current step, write a checkpoint and exit cleanly (both loops: RL and
    SFT, in the running event loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop
