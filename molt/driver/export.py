"""A saved checkpoint as a Hugging Face folder, without a running loop:

    python -m molt.export RUN_DIR [STEP | latest | best]      (default: latest)
    python -m molt.export RUN_DIR/checkpoints/step_000050

The checkpoint's policy is loaded from its DCP shards (written at any world size and layout) into one
trainer rank inside this process (world size 1, the run's device and model classes, from the spec.yaml
the checkpoint carries), then written by the trainer's own exporter to <checkpoint>/hf, exactly what
`train.export_hf=true` writes during a run. The folder loads in vLLM and transformers and is a valid
`model.path`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml

from molt.spec import RunSpec, validate_spec


def checkpoint_dir(target: str, which: str = "latest") -> Path:
    """A checkpoint folder from a run folder and a step number / "latest" / "best", or a checkpoint folder."""
    from molt.driver.checkpoints import read_best

    path = Path(target).expanduser()
    if (path / "meta.json").is_file() and (path / "policy").is_dir():
        return path
    root = path / "checkpoints"
    if which == "latest" and (root / "latest").is_file():
        return root / (root / "latest").read_text().strip()
    if which == "best" and read_best(root):
        return root / read_best(root)["checkpoint"]
    if which.isdigit() and (root / f"step_{int(which):06d}").is_dir():
        return root / f"step_{int(which):06d}"
    have = sorted(p.name for p in root.glob("step_*")) if root.is_dir() else []
    raise FileNotFoundError(f"no checkpoint '{which}' in {path} (checkpoints there: "
                            f"{', '.join(have) or 'none'})")


def run_spec_of(checkpoint: Path) -> RunSpec:
    """The spec that wrote `checkpoint` (its spec.yaml)."""
    path = checkpoint / "spec.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{checkpoint}: no spec.yaml (a checkpoint of an older Molt: copy the run's "
                                "spec.yaml there)")
    return validate_spec(yaml.safe_load(path.read_text()))


def export_checkpoint(checkpoint: Path) -> Path:
    """Write <checkpoint>/hf from the checkpoint's policy weights; returns the folder."""
    from molt.plan.models import model_path
    from molt.trainer.worker import TrainerWorker

    spec = run_spec_of(checkpoint).model_copy(deep=True)
    par = spec.parallel   # one rank holds the whole model; DCP reshards whatever layout was saved
    par.dp_size = par.tp_size = par.ep_size = par.nodes = 1
    par.offload, par.trainer_nodes = "none", None
    environ = dict(os.environ)   # the rank sets torch.distributed's variables; the caller keeps its own
    worker = TrainerWorker(spec, "policy", 0, model_path(spec))
    try:
        worker.setup(*worker.address())
        worker.load(str(checkpoint / "policy"), weights_only=True)
        worker.export_hf(str(checkpoint / "hf"))
    finally:
        worker.shutdown()
        os.environ.clear()
        os.environ.update(environ)
    return checkpoint / "hf"


def as_hf_folder(path: str) -> str:
    """`path` itself unless it is a Molt checkpoint folder; then its hf/ export (written first if absent)."""
    local = Path(path).expanduser()
    if not ((local / "meta.json").is_file() and (local / "policy").is_dir()):
        return path
    if not (local / "hf" / "config.json").is_file():
        export_checkpoint(local)
    return str(local / "hf")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m molt.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run's folder, or one checkpoint folder (RUN/checkpoints/step_N)")
    parser.add_argument("step", nargs="?", help="STEP, latest or best (default: latest)")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(checkpoint_dir(*[a for a in (args.run_dir, args.step) if a is not None]))
    except (OSError, ValueError) as err:
        sys.exit(f"molt.export: {err}")
    print(f"molt.export: wrote a Hugging Face model to {out}")
