"""Checkpoints: rotation (the newest train.keep_checkpoints stay on disk, and the best one too), the best
record across a resume, and what a resumed optimizer takes from the new spec."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from molt.driver.checkpoints import carry_best, find_checkpoint, new_best, save_checkpoint
from molt.driver.export import checkpoint_dir
from molt.spec import RunSpec
from molt.trainer import rank_state


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


def run_spec(run_dir: Path, resume: Path | None = None, metric: str = "eval/repeat_eval/pass@1") -> RunSpec:
    """A run in `run_dir` that keeps its best checkpoint by `metric` (repeat_eval: the default eval set)."""
    return RunSpec.model_validate({"run": {"dir": str(run_dir), "resume": str(resume) if resume else None},
                                   "train": {"best_metric": metric}})


def checkpoint_at(spec: RunSpec, step: int, best: float | None = None) -> None:
    """save_checkpoint without trainer groups (they would write their state into the folder)."""
    (Path(spec.run.dir) / "checkpoints" / f"step_{step:06d}").mkdir(parents=True, exist_ok=True)
    save_checkpoint(spec, step, {"policy": None}, {"step": step}, best)


def test_a_resumed_run_compares_its_evals_with_the_best_before_the_resume(tmp_path):
    """A resumed run writes into a run folder of its own: without the record of the run it resumed from,
    its first eval would always be a "new best" (and its checkpoint kept as the best)."""
    metric = "eval/repeat_eval/pass@1"
    first = run_spec(tmp_path / "a")
    checkpoint_at(first, 4, best=0.5)
    checkpoint_at(first, 6)                                     # the latest, not the best
    second = run_spec(tmp_path / "b", resume=tmp_path / "a")
    carry_best(second, find_checkpoint(second))                 # what the loops do at a resume
    assert new_best(second, 7, {"train/loss": 1.0}) is None    # no eval this step
    assert new_best(second, 8, {metric: 0.4}) is None           # below the 0.5 of step 4
    assert new_best(second, 9, {metric: 0.6}) == 0.6
    # the record names run a's checkpoint, which `molt.export <run b> best` finds; b's rotation keeps its own
    checkpoint_at(second, 10)
    assert checkpoint_dir(str(tmp_path / "b"), "best") == (tmp_path / "a/checkpoints/step_000004").resolve()
    # a run resumed from b (which found no better model) still knows a's best
    third = run_spec(tmp_path / "c", resume=tmp_path / "b")
    carry_best(third, find_checkpoint(third))
    assert new_best(third, 11, {metric: 0.45}) is None
    assert new_best(third, 11, {metric: 0.55}) == 0.55
    # a record of another metric is not comparable: the resumed run starts its own
    other = run_spec(tmp_path / "d", resume=tmp_path / "a", metric="eval/repeat_eval/mean@1")
    carry_best(other, find_checkpoint(other))
    assert new_best(other, 7, {"eval/repeat_eval/mean@1": 0.1}) == 0.1
    assert not (tmp_path / "d/checkpoints/best.json").exists()


def test_a_resume_across_objectives_is_refused_before_anything_starts(tmp_path):
    """An SFT checkpoint holds no policy version and a conversation position: an RL run resumed from it
    failed after its engines and trainers had started (and SFT took an RL run's prompt position)."""
    sft = RunSpec.model_validate({"run": {"dir": str(tmp_path / "sft")}, "train": {"objective": "sft"}})
    checkpoint_at(sft, 3)
    rl = RunSpec.model_validate({"run": {"dir": str(tmp_path / "rl"), "resume": str(tmp_path / "sft")}})
    with pytest.raises(ValueError, match="train.objective=sft run, this run's is rl; .*molt.export"):
        find_checkpoint(rl)
    again = RunSpec.model_validate({"run": {"dir": str(tmp_path / "sft2"), "resume": str(tmp_path / "sft")},
                                    "train": {"objective": "sft"}})
    assert find_checkpoint(again) == tmp_path / "sft/checkpoints/step_000003"


def test_resume_keeps_the_optimizer_state_and_takes_the_new_specs_values(tmp_path):
    """run.resume with another train.lr / betas / weight_decay: AdamW's moments and step counts and the
    schedule's position come from the checkpoint; the values the optimizer was built with (the new spec)
    stay, and the schedule's rate at the resumed step is the new base rate's. Plain torch objects as
    molt/trainer/worker.py builds them, through the trainer's own save / load, in a gloo world of 1."""
    def build(lr: float, betas: tuple[float, float], weight_decay: float):
        model = nn.Linear(4, 3)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay)
        return model, optimizer, LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))   # 4 warm-up steps

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model, optimizer, scheduler = build(1e-3, (0.9, 0.999), 0.0)
        for _ in range(2):
            model(torch.randn(5, 4)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        saved = {k: v.clone() for k, v in optimizer.state[model.weight].items()}
        rank_state.save(str(tmp_path / "ckpt"), model, optimizer, scheduler, {"step": 2})
        model2, optimizer2, scheduler2 = build(1e-5, (0.8, 0.95), 0.1)
        assert rank_state.load(str(tmp_path / "ckpt"), model2, optimizer2, scheduler2)["step"] == 2
    finally:
        dist.destroy_process_group()
    group = optimizer2.param_groups[0]
    assert (group["lr"], tuple(group["betas"]), group["weight_decay"]) == (1e-5 * 0.75, (0.8, 0.95), 0.1)
    assert group["initial_lr"] == 1e-5 and scheduler2.base_lrs == [1e-5]
    assert scheduler2.get_last_lr() == [1e-5 * 0.75] and scheduler2.last_epoch == 2
    state = optimizer2.state[model2.weight]
    assert float(state["step"]) == 2 and all(torch.equal(state[k], saved[k]) for k in saved)
    assert torch.equal(model2.weight, model.weight)
    # the next step: AdamW with the new values on the restored moments, written out by hand
    grad = torch.full_like(model2.weight, 0.5)
    model2.weight.grad, model2.bias.grad = grad, torch.zeros_like(model2.bias)
    weight = model2.weight.detach().clone()
    optimizer2.step()
    lr, (b1, b2), eps = 1e-5 * 0.75, (0.8, 0.95), 1e-8
    m, v = b1 * saved["exp_avg"] + (1 - b1) * grad, b2 * saved["exp_avg_sq"] + (1 - b2) * grad**2
    expected = weight * (1 - lr * 0.1) - lr * (m / (1 - b1**3)) / ((v / (1 - b2**3)).sqrt() + eps)
    assert torch.allclose(model2.weight, expected, rtol=0, atol=1e-9)
