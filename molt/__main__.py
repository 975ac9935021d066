"""`python -m molt [+experiment=NAME] [key=value ...]` — compose, validate, launch.

    python -m molt --help [KEY_PREFIX]     every key with its type, default and meaning
    python -m molt ... --cfg job           the validated spec each job would run with; starts nothing
    python -m molt ... run.dry_run=true    each job's plan, then every problem found; starts nothing
    python -m molt -m algo=grpo,rloo       a sweep: one job per choice, summarized at the end

A refusal is one line, `molt: ...`, and exit code 2, before anything starts (no Ray, no run folder) when
the dry run would have refused too; an error after the start is one line as well, its traceback written to
the run folder's error.txt (HYDRA_FULL_ERROR=1 prints it instead).
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import NoReturn

import hydra
from omegaconf import DictConfig

from molt.spec.config import check_overrides, spec_yaml

# Flags handled here; any other Hydra flag (--cfg hydra, --info, --config-name, ...) goes to Hydra as is.
OWN_FLAGS = {"-m", "--multirun", "--resolve", "--cfg", "-c", "job"}
REFUSED = 2   # the exit code of every error
# The inputs `main` built for each job before Hydra's app ran (by job number; None: a single run).
PREPARED: dict[int | None, object] = {}


def fail(err: BaseException, run_dir: Path | None = None) -> NoReturn:
    """Exit with `err` as one `molt:` line. A refusal of the user's input is its message; anything else
    also names its type and leaves its traceback in the run folder (HYDRA_FULL_ERROR=1: raised as is)."""
    from molt.driver.compose import REFUSALS
    from molt.driver.jobs import one_line

    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise err
    if isinstance(err, REFUSALS):
        line = one_line(err)
    else:
        where = "HYDRA_FULL_ERROR=1 prints the traceback"
        if run_dir is not None and run_dir.is_dir():
            (run_dir / "error.txt").write_text("".join(traceback.format_exception(err)))
            where = f"traceback in {run_dir / 'error.txt'}; {where}"
        first = (str(err).strip().splitlines() or [""])[0]
        line = f"{type(err).__name__}: {first} ({where})"
    print(f"molt: {line}", file=sys.stderr, flush=True)
    sys.exit(REFUSED)


@hydra.main(version_base=None, config_path="pkg://molt.conf", config_name="config")
def _run(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    try:
        from molt.driver.compose import prepare, to_spec
        from molt.driver.jobs import fill_launch_fields
        from molt.driver.launch import launch

        multirun = hc.mode == RunMode.MULTIRUN
        spec = fill_launch_fields(to_spec(cfg), hc, run_dir, multirun)
        inputs = PREPARED.pop(hc.job.num if multirun else None, None) or prepare(spec).or_raise()
        run_dir = Path(spec.run.dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        if run_dir not in (Path.cwd(), *Path.cwd().parents):  # never lock the user's working folder
            run_dir.chmod(0o700)  # sandboxed tools run as another uid: keep them out of the run's files
        (run_dir / "spec.yaml").write_text(spec_yaml(spec))
        launch(spec, inputs)
    except Exception as err:   # noqa: BLE001 -- every error reaches the user as one line
        fail(err, run_dir)


def _wants_spec(argv: list[str]) -> bool:
    """`--cfg job` / `-c job` (with or without --resolve): print validated specs instead of Hydra's."""
    return any(a in ("--cfg", "-c") and argv[i + 1:i + 2] == ["job"] for i, a in enumerate(argv)) or \
        "--cfg=job" in argv


def main() -> None:
    argv = sys.argv[1:]
    if "--help" in argv or "-h" in argv:
        from molt.spec.help import main as help_main

        sys.exit(help_main(argv))
    overrides = [a for a in argv if not a.startswith("-") and "=" in a]
    flags = [a for a in argv if a not in overrides]
    if any(f not in OWN_FLAGS and f != "--cfg=job" for f in flags):
        try:
            check_overrides(overrides)
        except Exception as err:   # noqa: BLE001
            fail(err)
        _run()
        return
    from molt.driver.jobs import dry_runs, naming_overrides, plan, prepare_jobs, show

    multirun = "-m" in flags or "--multirun" in flags
    try:
        jobs = plan(overrides, multirun)
        # A print or a dry run writes nothing: it is answered here, not by Hydra's app (which creates
        # the run directory). A dry run also builds the inputs (data, agent, tokenizer) as a run would.
        if _wants_spec(flags):
            print(show(jobs), end="")
            return
        if all(job.spec.run.dry_run for job in jobs):
            text, problems = dry_runs(jobs)
            print(text, end="", flush=True)
        else:   # every job's inputs, built and checked before Hydra's app creates a run folder
            prepared, problems = prepare_jobs(jobs, multirun)
            PREPARED.update(prepared)
    except Exception as err:   # noqa: BLE001 -- every error reaches the user as one line
        fail(err)
    for problem in problems:
        print(f"molt: {problem}", file=sys.stderr)
    if problems:
        sys.exit(REFUSED)
    if all(job.spec.run.dry_run for job in jobs):
        return
    if multirun:
        sys.argv += naming_overrides(overrides)
    _run()


if __name__ == "__main__":
    main()
