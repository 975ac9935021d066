"""The jobs a command line describes — one run, or every job of a `-m` sweep — composed and validated.

`python -m molt` composes and validates every job before anything starts (a sweep whose third job is
invalid fails before the first one trains), and this is also what `--cfg job` prints and
`run.dry_run=true` plans: the spec each job's launcher will read, with the fields the launcher fills
(run.dir, the W&B name, group and job type), without creating a directory or starting anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from molt.driver.compose import Inputs, to_spec
from molt.spec import RunSpec, SpecError
from molt.spec.config import compose_config, spec_yaml


@dataclass
class Job:
    label: str          # the swept choices, e.g. "algo=icepop,train.lr=1e-06" ("" for a single run)
    spec: RunSpec


def naming_overrides(overrides: Sequence[str]) -> list[str]:
    """Hydra overrides that name sweep jobs after the swept choices only.

    `hydra.job.override_dirname` names each job's directory and W&B run; by default it lists every
    override, so the keys that are not swept are excluded: `-m +experiment=tiny algo=grpo,rloo` gives
    jobs `0_algo=grpo` and `1_algo=rloo`.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    swept = {o.key_or_group for o in parsed if o.is_sweep_override()}
    fixed = sorted({o.key_or_group for o in parsed if not o.key_or_group.startswith("hydra")} - swept)
    if not swept or not fixed:
        return []
    return ["hydra.job.config.override_dirname.exclude_keys=[" + ",".join(f"'{k}'" for k in fixed) + "]"]


def fill_launch_fields(spec: RunSpec, hydra: Any, run_dir: str | Path, multirun: bool) -> RunSpec:
    """What the launcher adds to a validated spec from Hydra's runtime: the run directory, and W&B's job
    type (the algo group's option), group (the sweep directory's name) and run name (the swept choices).
    Explicit settings win. `hydra` is Hydra's config node of the job (HydraConfig.get() in a run); a
    `run.dir` override is refused, since the run would silently write elsewhere."""
    if spec.run.dir is not None and Path(spec.run.dir).resolve() != Path(run_dir).resolve():
        raise SpecError(f"run.dir={spec.run.dir}: python -m molt writes each run to Hydra's output "
                        f"directory; set hydra.run.dir={spec.run.dir} instead (a sweep: hydra.sweep.dir)")
    spec.run.dir = str(Path(run_dir).resolve())
    wandb = spec.logging.wandb
    if wandb.job_type is None:
        wandb.job_type = hydra.runtime.choices.get("algo")
    if multirun:
        wandb.group = wandb.group or Path(hydra.sweep.dir).name
        wandb.name = wandb.name or hydra.job.override_dirname or None
    return spec


def _job(overrides: list[str], num: int | None, first: DictConfig | None = None) -> tuple[Job, DictConfig]:
    cfg: DictConfig = compose_config(overrides)
    if first is not None:   # as Hydra's sweeper does: resolver values (${now:...}) are the first job's
        OmegaConf.copy_cache(from_config=first, to_config=cfg)
    hydra = cfg.hydra
    if num is None:
        run_dir = hydra.run.dir
    else:
        with open_dict(hydra):
            hydra.job.num = num
        run_dir = Path(hydra.sweep.dir) / hydra.sweep.subdir
    spec = fill_launch_fields(to_spec(cfg), hydra, run_dir, num is not None)
    return Job(str(hydra.job.override_dirname) if num is not None else "", spec), cfg


def plan(overrides: Sequence[str], multirun: bool) -> list[Job]:
    """Every job of the command line, validated; SpecError names the first job that does not validate."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not multirun:
        return [_job(list(overrides), None)[0]]
    naming = naming_overrides(overrides)
    [batch] = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(list(overrides)), None)
    jobs, first = [], None
    for num, job_overrides in enumerate(batch):
        try:
            job, cfg = _job([*job_overrides, *naming], num, first)
            jobs.append(job)
            first = first or cfg
        except SpecError as err:
            raise SpecError(f"sweep job {num} ({' '.join(job_overrides)}): {err}") from None
    return jobs


def show(jobs: list[Job]) -> str:
    """Each job's validated spec as YAML (one document per job)."""
    parts = [(f"# sweep job {num}: {job.label}\n" if len(jobs) > 1 else "") + spec_yaml(job.spec)
             for num, job in enumerate(jobs)]
    return "---\n".join(parts)


def dry_runs(jobs: list[Job]) -> tuple[str, list[str]]:
    """Each job's dry run (warnings logged, inputs built, the plan; a dry run has no run directory) and
    every problem found, each one line (prefixed with its sweep job)."""
    from molt.driver.launch import dry_run

    parts, problems = [], []
    for num, job in enumerate(jobs):
        head = f"# sweep job {num}: {job.label}\n" if len(jobs) > 1 else ""
        unplaced = job.spec.run.model_copy(update={"dir": None})
        text, found = dry_run(job.spec.model_copy(update={"run": unplaced}))
        parts.append(head + text + "\n")
        problems += [f"{_job_prefix(jobs, num)}{one_line(err)}" for err in found]
    return "\n".join(parts), problems


def prepare_jobs(jobs: list[Job], multirun: bool) -> tuple[dict[int | None, Inputs], list[str]]:
    """Every job's inputs, built before the first job starts (by Hydra's job number; None for a single
    run), and every problem found, each one line: a sweep whose third job's data is missing starts none."""
    from molt.driver.compose import prepare

    prepared, problems = {}, []
    for num, job in enumerate(jobs):
        inputs = prepare(job.spec)
        problems += [f"{_job_prefix(jobs, num)}{one_line(err)}" for err in inputs.problems]
        prepared[num if multirun else None] = inputs
    return prepared, problems


def _job_prefix(jobs: list[Job], num: int) -> str:
    return f"sweep job {num} ({jobs[num].label}): " if len(jobs) > 1 else ""


def one_line(err: BaseException) -> str:
    """What the user reads of a refusal: its message (one line; a spec's several problems stay listed)."""
    return str(err) if isinstance(err, SpecError) else " ".join(str(err).split())
