"""`python -m molt [+experiment=NAME] [key=value ...]` — compose, validate, launch.

    python -m molt --help [KEY_PREFIX]     every key with its type, default and meaning
    python -m molt ... --cfg job           the validated spec each job would run with; starts nothing
    python -m molt ... run.dry_run=true    each job's placement plan; starts nothing
    python -m molt -m algo=grpo,rloo       a sweep: one job per choice, summarized at the end
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from molt.spec import SpecError
from molt.spec.config import check_overrides, spec_yaml

# Flags handled here; any other Hydra flag (--cfg hydra, --info, --config-name, ...) goes to Hydra as is.
OWN_FLAGS = {"-m", "--multirun", "--resolve", "--cfg", "-c", "job"}


@hydra.main(version_base=None, config_path="pkg://molt.conf", config_name="config")
def _run(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from molt.driver.compose import to_spec
    from molt.driver.jobs import fill_launch_fields

    hc = HydraConfig.get()
    try:
        spec = fill_launch_fields(to_spec(cfg), hc, hc.runtime.output_dir, hc.mode == RunMode.MULTIRUN)
    except SpecError as err:
        sys.exit(f"molt: {err}")
    run_dir = Path(spec.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if run_dir not in (Path.cwd(), *Path.cwd().parents):  # never lock the user's working folder
        run_dir.chmod(0o700)  # sandboxed tools run as another uid: keep them out of the run's files
    (run_dir / "spec.yaml").write_text(spec_yaml(spec))

    from molt.driver.launch import launch

    launch(spec)


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
        except SpecError as err:
            sys.exit(f"molt: {err}")
        _run()
        return
    from molt.driver.jobs import naming_overrides, plan, show

    multirun = "-m" in flags or "--multirun" in flags
    try:
        jobs = plan(overrides, multirun)
        # A print or a dry run writes nothing: it is answered here, not by Hydra's app (which creates
        # the run directory). A dry run also loads the data files and imports the agent module.
        if _wants_spec(flags) or all(job.spec.run.dry_run for job in jobs):
            print(show(jobs, "spec" if _wants_spec(flags) else "plan"), end="")
            return
    except (SpecError, OSError, ImportError, TypeError, ValueError) as err:
        sys.exit(f"molt: {err}")
    if multirun:
        sys.argv += naming_overrides(overrides)
    _run()


if __name__ == "__main__":
    main()
