"""Checkpoint rotation: the newest train.keep_checkpoints stay on disk, and the best one too."""

from __future__ import annotations

import json

from molt.checkpoints import save_checkpoint
from molt.spec import RunSpec


def test_rotation_keeps_the_newest_n_and_the_best(tmp_path):
    # No trainer groups (which write their state into the folder): meta.json, spec.yaml, the pointers and
    # the rotation are what is left, all of save_checkpoint's own work.
    spec = RunSpec.model_validate({"run": {"dir": str(tmp_path)}, "train": {"keep_checkpoints": 3}})
    root = tmp_path / "checkpoints"
    for step in range(1, 7):
        (root / f"step_{step:06d}").mkdir(parents=True)
        save_checkpoint(spec, step, {"policy": None, "critic": None}, {"step": step},
                        best=0.5 if step == 2 else None)
    assert sorted(p.name for p in root.glob("step_*")) == [f"step_00000{i}" for i in (2, 4, 5, 6)]
    assert json.loads((root / "best.json").read_text())["checkpoint"] == "step_000002"
    assert (root / "latest").read_text() == "step_000006"
