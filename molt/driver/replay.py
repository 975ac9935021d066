"""`python -m molt.replay RUN_DIR STEP [--checkpoint PATH]`: train on a dumped batch without regenerating.

Loads `<RUN_DIR>/spec.yaml` and `<RUN_DIR>/rollouts/step_<STEP>.jsonl`, starts the trainer (from the
initial weights, or a checkpoint with its adaptive KL weight), and runs the loop's own `learn` step on
exactly those tokens (the critic alone within train.critic_warmup_steps, as the loop did): the way to
reproduce a loss spike or check the trainer/engine gap of one batch in isolation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import yaml

from molt.spec import RunSpec


def replay(run_dir: Path, step: int, checkpoint: Path | None = None) -> dict[str, float]:
    import ray
    from transformers import AutoTokenizer

    from molt.algo import with_kl_coef
    from molt.driver.checkpoints import load_checkpoint
    from molt.driver.loop import learn
    from molt.driver.metrics import load_rollouts
    from molt.plan.models import model_path
    from molt.plan.placement import init_ray
    from molt.trainer.ranks import Trainers

    spec = RunSpec.model_validate(yaml.safe_load((run_dir / "spec.yaml").read_text()))
    dump = run_dir / "rollouts" / f"step_{step:06d}.jsonl"
    if not dump.exists():
        kept = sorted(int(p.stem[5:]) for p in dump.parent.glob("step_*.jsonl") if p.stem[5:].isdigit())
        raise FileNotFoundError(f"{dump}: no rollout dump of step {step} (dumps kept: "
                                f"{f'steps {kept[0]}..{kept[-1]}' if kept else 'none'}; only the last "
                                f"logging.dump_keep_steps={spec.logging.dump_keep_steps} steps are kept)")
    rollouts = load_rollouts(dump)
    trust = spec.model.trust_remote_code
    pad_id = AutoTokenizer.from_pretrained(model_path(spec), trust_remote_code=trust).pad_token_id
    if not ray.is_initialized():
        init_ray(spec)
    trainers = Trainers.start(spec, pad_id)
    try:
        extra = load_checkpoint(checkpoint, trainers.roles()) if checkpoint is not None else {}
        # as the loop ran this step: the adaptive KL weight the checkpoint holds (the spec's without
        # one), and the critic alone while the step was within train.critic_warmup_steps
        warmup = step - 1 < spec.train.critic_warmup_steps
        return asyncio.run(learn(spec, rollouts, trainers, extra.get("version", 0),
                                 algo=with_kl_coef(spec.algo, extra.get("kl_coef")), train_policy=not warmup))
    finally:
        trainers.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m molt.replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("step", type=int)
    parser.add_argument("--checkpoint", type=Path, help="a checkpoint folder (default: initial weights)")
    args = parser.parse_args(argv)
    metrics = replay(args.run_dir, args.step, args.checkpoint)
    print(json.dumps(metrics, indent=1, sort_keys=True))
    return 0
