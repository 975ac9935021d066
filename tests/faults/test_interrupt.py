"""SIGTERM to a real `python -m molt` run: the step in flight finishes, a checkpoint is written, the
process exits 0, and `run.resume` finds that checkpoint. (Resuming from such a checkpoint is exact:
tests/test_loop.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from faultlib import REPO

from molt.checkpoints import find_checkpoint
from molt.config import compose

SMALL = ["train.prompts_per_step=4", "rollout.samples_per_prompt=4", "train.micro_batch_size=8",
         "logging.plots=false", "logging.progress=false", "logging.wandb.mode=disabled",
         "rollout.engine.kv_cache_gib=0.25", "train.eval_every=0"]


def test_sigterm_checkpoints_and_exits_cleanly(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    proc = subprocess.Popen([sys.executable, "-m", "molt", *SMALL, "train.steps=500", "train.save_every=0",
                             f"hydra.run.dir={run}"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline and not (metrics.exists() and metrics.read_text()):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-3000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert f"stopped by signal at step {steps[-1]}" in out and steps == list(range(1, steps[-1] + 1))

    root = run / "checkpoints"
    assert (root / "latest").read_text() == f"step_{steps[-1]:06d}"
    meta = json.loads((root / f"step_{steps[-1]:06d}" / "meta.json").read_text())
    assert meta["step"] == meta["version"] == steps[-1]
    assert meta["data"]["index"] + 256 * meta["data"]["epoch"] == 4 * steps[-1]   # 256 rows per epoch
    saved = sorted(p.name for p in (root / f"step_{steps[-1]:06d}").iterdir())
    assert saved == ["meta.json", "policy", "spec.yaml"]
    assert not list(root.rglob("*.tmp"))
    assert run.stat().st_mode & 0o777 == 0o700   # tools in the sandbox (another uid) cannot enter it

    spec = compose([*SMALL, f"run.resume={run}"])
    assert find_checkpoint(spec) == root / f"step_{steps[-1]:06d}"
