"""`python -m molt [+experiment=NAME] [key=value ...]` — compose, validate, launch."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from molt.config import check_overrides, spec_yaml, to_spec
from molt.launch import dry_run
from molt.spec import SpecError


@hydra.main(version_base=None, config_path="pkg://molt.conf", config_name="config")
def _run(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        spec = to_spec(cfg)
    except SpecError as err:
        sys.exit(f"molt: {err}")
    hc = HydraConfig.get()
    spec.run.dir = str(Path(hc.runtime.output_dir).resolve())
    if hc.mode == RunMode.MULTIRUN and spec.logging.wandb.group is None:
        spec.logging.wandb.group = Path(hc.sweep.dir).name  # one W&B group per sweep
    run_dir = Path(spec.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if run_dir not in (Path.cwd(), *Path.cwd().parents):  # never lock the user's working folder
        run_dir.chmod(0o700)  # sandboxed tools run as another uid: keep them out of the run's files
    (run_dir / "spec.yaml").write_text(spec_yaml(spec))

    from molt.launch import launch

    launch(spec)


def main() -> None:
    overrides = [a for a in sys.argv[1:] if not a.startswith("-") and "=" in a]
    flags = [a for a in sys.argv[1:] if a not in overrides]
    try:
        check_overrides(overrides)
        # A dry run writes nothing: it is answered here, not by Hydra's app (which creates the run dir).
        if set(flags) <= {"-m", "--multirun"} and dry_run(overrides, multirun=bool(flags)):
            return
    except (SpecError, OSError, ImportError, TypeError, ValueError) as err:
        sys.exit(f"molt: {err}")
    _run()


if __name__ == "__main__":
    main()
