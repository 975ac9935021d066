"""A model comes out and goes back in, each step through its command, on real components and a task from
reasoning-gym: `python -m molt.sft` (5 steps, eval loss from step 0, a checkpoint and HF export every
step, the best checkpoint kept past rotation) → `molt.export` of the same checkpoint (bitwise the loop's
export and the DCP shards) → the RL loop from that export with the reasoning-gym Env (eval at step 0 on
two named sets, engine/trainer gap on the exported weights) → `molt.eval` on the RL run's checkpoint
(exported on the fly), equal to the loop's own eval of that step."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from molt.driver.compose import compose
from molt.spec.user_modules import REPO_ROOT

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
QUIET = ["logging.progress=false", "logging.plots=false", "logging.wandb.mode=disabled"]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def sft_run(run: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    return subprocess.run(
        [sys.executable, "-m", "molt.sft", "+experiment=rg_sft", "train.steps=5", "train.save_every=1",
         "train.eval_every=1", "train.prompts_per_step=8", "train.micro_batch_size=8",
         # the largest eval loss after step 0 is step 1's: the best checkpoint is then the oldest one
         "train.best_metric=eval/rg_arith_sft_eval/loss", "train.best_mode=max", *QUIET,
         f"hydra.run.dir={run}"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)


def check_export(checkpoint: Path, tmp_path: Path) -> None:
    """`molt.export` writes exactly the loop's export, and that holds exactly the checkpoint's weights."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from molt.driver.export import main as export_main

    in_loop = tensors(checkpoint / "hf")
    shutil.rmtree(checkpoint / "hf")
    export_main([str(checkpoint.parent.parent), "5"])
    exported = tensors(checkpoint / "hf")
    assert exported.keys() == in_loop.keys() and all(torch.equal(exported[k], in_loop[k]) for k in in_loop)
    dcp_to_torch_save(checkpoint / "policy", tmp_path / "dcp.pt")
    saved = torch.load(tmp_path / "dcp.pt", weights_only=False)["model"]
    assert all(torch.equal(exported[k], saved[k]) for k in exported)   # the tied head is not exported
    assert set(saved) - set(exported) <= {"lm_head.weight"}


def test_sft_export_rl_eval_chain(tmp_path, ray_session, capsys) -> None:
    sft = tmp_path / "sft"
    done = sft_run(sft)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = read_metrics(sft)
    assert [r["step"] for r in rows] == list(range(6))
    losses = [r["eval/rg_arith_sft_eval/loss"] for r in rows]
    assert losses[-1] < losses[0] - 1.0 and all(r["train/tokens"] > 0 for r in rows[1:])
    root = sft / "checkpoints"
    best = json.loads((root / "best.json").read_text())
    assert best["step"] == 1 and best["value"] == pytest.approx(max(losses[1:]))
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000001", "step_000004", "step_000005"]
    assert all((root / f"step_00000{s}" / "hf" / "config.json").is_file() for s in (1, 4, 5))
    assert f"exported as a Hugging Face model to {root / 'step_000005' / 'hf'}" in done.stdout + done.stderr
    check_export(root / "step_000005", tmp_path)

    # RL from the export: vLLM and the trainer both load it and agree on it
    from molt.driver.eval import main as eval_main
    from molt.driver.loop import train

    small = tmp_path / "small_eval.jsonl"
    rg_eval = REPO_ROOT / "examples" / "data" / "rg_arith_eval.jsonl"
    small.write_text("".join(rg_eval.read_text().splitlines(keepends=True)[:8]))
    rl = ["+experiment=rg_rl", f"model.path={root / 'step_000005' / 'hf'}", f"data.eval=[{rg_eval},{small}]",
          "train.prompts_per_step=4", "rollout.samples_per_prompt=4", "train.micro_batch_size=16",
          "rollout.engine.kv_cache_gib=0.25", *QUIET]
    spec = compose([*rl, "train.steps=2", "train.save_every=1", "train.eval_every=2",
                    "train.export_hf=false"])
    spec.run.dir = str(tmp_path / "rl")
    train(spec)
    rows = read_metrics(tmp_path / "rl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    names = {f"eval/{s}/{m}" for s in ("rg_arith_eval", "small_eval") for m in ("mean@1", "pass@1")}
    assert set(rows[0]) - {"step", "time"} == names and names <= set(rows[2])
    assert rows[1]["mismatch/max_abs"] < 1e-4 and 0 <= rows[1]["reward/mean"] <= 1 and "info/exact" in rows[1]
    best = json.loads((tmp_path / "rl" / "checkpoints" / "best.json").read_text())
    assert best["step"] == 2 and best["value"] == rows[2]["eval/rg_arith_eval/pass@1"]

    # eval-only on a checkpoint folder (exported to its hf/ first): the loop's own eval of that step
    checkpoint = tmp_path / "rl" / "checkpoints" / "step_000002"
    capsys.readouterr()
    eval_main([*rl, f"model.path={checkpoint}"])
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated == {k: rows[2][k] for k in names} and (checkpoint / "hf" / "config.json").is_file()
