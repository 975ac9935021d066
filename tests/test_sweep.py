"""A real two-job sweep (`python -m molt -m algo=grpo,rloo`, two steps each on the tiny model): job
names, W&B fields, the summary its end writes, `python -m molt.sweep`, and diffs of its run directories.
The most expensive test file of the workflows (about a minute on two cores): one sweep, shared, marked
slow; the summary's eval column is checked on job folders written by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from matplotlib.image import imread

from molt.driver.eval import set_metrics
from molt.driver.sweep import job_row, summarize
from molt.driver.sweep import main as sweep_main
from molt.spec import RunSpec
from molt.spec.config import spec_yaml
from molt.spec.diff import main as diff_main

slow = pytest.mark.slow   # a test of the real two-job sweep: two CLI runs (over a minute)

REPO = Path(__file__).resolve().parents[1]
LEAN = ["train.steps=2", "train.prompts_per_step=4", "rollout.samples_per_prompt=4",
        "train.micro_batch_size=8", "train.eval_every=0", "rollout.engine.kv_cache_gib=0.25",
        "logging.progress=false",
        "logging.plots=false", "logging.dump_rollouts=false", "logging.wandb.mode=disabled"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, tiny_model_path) -> tuple[Path, str]:
    sweep_dir = tmp_path_factory.mktemp("sweeps") / "tiny_sweep"
    done = subprocess.run([sys.executable, "-m", "molt", "-m", "algo=grpo,rloo", *LEAN,
                           f"hydra.sweep.dir={sweep_dir}"], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return sweep_dir, done.stdout


@slow
def test_jobs_are_named_after_the_swept_choices(sweep):
    sweep_dir, _ = sweep
    jobs = sorted(p.name for p in sweep_dir.iterdir() if p.is_dir())
    assert jobs == ["0_algo=grpo", "1_algo=rloo"]
    for job, algo in zip(jobs, ["grpo", "rloo"], strict=True):
        wandb = yaml.safe_load((sweep_dir / job / "spec.yaml").read_text())["logging"]["wandb"]
        assert (wandb["name"], wandb["group"], wandb["job_type"]) == (f"algo={algo}", "tiny_sweep", algo)


@slow
def test_the_sweep_end_writes_a_summary(sweep):
    sweep_dir, stdout = sweep
    summary = (sweep_dir / "summary.md").read_text()
    assert summary.startswith("# Sweep `tiny_sweep`\n\n| job | steps | final reward | best reward | "
                              "eval reward | tokens/s | wall (s) |")
    rows = [line for line in summary.splitlines() if line.startswith("| `")]
    assert [r.split(" | ")[:2] for r in rows] == [["| `0_algo=grpo`", "2"], ["| `1_algo=rloo`", "2"]]
    assert "![rewards](rewards.png)" in summary
    assert f"molt: wrote {sweep_dir / 'summary.md'} and {sweep_dir / 'rewards.png'}" in stdout
    image = imread(sweep_dir / "rewards.png")
    assert image.shape[0] > 100 and image.std() > 0
    for job in ("0_algo=grpo", "1_algo=rloo"):   # numbers from the job's own metrics.jsonl
        row = job_row(sweep_dir / job)
        assert 0 <= row["final"] <= 1 and row["best"] >= row["final"] - 1e-9
        assert row["tokens_per_s"] > 0 and row["wall_s"] > 0 and row["eval"] is None


@slow
def test_summary_by_hand(sweep, tmp_path, capsys):
    sweep_dir, _ = sweep
    (sweep_dir / "summary.md").unlink()
    sweep_main([str(sweep_dir)])
    assert "| `1_algo=rloo` | 2 |" in capsys.readouterr().out and (sweep_dir / "summary.md").is_file()
    with pytest.raises(SystemExit, match="no job in"):
        sweep_main([str(tmp_path)])
    with pytest.raises(FileNotFoundError):
        summarize(tmp_path / "nowhere")


@slow
def test_diff_of_run_directories_and_spec_files(sweep, capsys):
    sweep_dir, _ = sweep
    grpo, rloo = sweep_dir / "0_algo=grpo", sweep_dir / "1_algo=rloo"
    assert diff_main([str(grpo), str(rloo / "spec.yaml")]) == 1
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert lines[1] == ["groups", "algo", "grpo", "->", "rloo"]   # from Hydra's record in the run dir
    assert ["algo", "estimator", "grpo", "->", "rloo"] in lines
    assert diff_main([str(grpo), str(grpo / "spec.yaml")]) == 0
    assert diff_main([str(grpo), f"{grpo} train.lr=1"]) == 2
    assert "overrides apply to experiments" in capsys.readouterr().err


def test_the_eval_column_shows_the_best_metric_or_the_first_sets_mean(tmp_path):
    """Jobs written by hand as the loop writes them: a spec.yaml, and a metrics.jsonl whose evaluations
    (step 0 alone, then merged into step 2's record) carry molt.eval's own metric names."""
    def evaluation(math: list[float], code: list[float]) -> dict[str, float]:
        return {**set_metrics("math", torch.tensor([math], dtype=torch.float32), 1.0),
                **set_metrics("code", torch.tensor([code], dtype=torch.float32), 1.0)}

    records = [{"step": 0, "time": 10.0, **evaluation([0, 0, 0, 1], [0, 0, 1, 1])},
               {"step": 1, "time": 11.0, "reward/mean": 0.25, "time/step": 1.0, "tokens/sampled": 50.0},
               {"step": 2, "time": 12.0, "reward/mean": 0.75, "time/step": 1.0, "tokens/sampled": 50.0,
                **evaluation([0, 1, 1, 0.5], [1, 1, 1, 0.5])}]
    for job, best in (("0_plain", None), ("1_best", "eval/code/pass@1")):
        spec = RunSpec.model_validate({"data": {"eval": ["data/math.jsonl", "data/code.jsonl"]},
                                       "rollout": {"eval": {"n": 4}}, "train": {"best_metric": best}})
        (tmp_path / job).mkdir()
        (tmp_path / job / "spec.yaml").write_text(spec_yaml(spec))
        (tmp_path / job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert "eval/math/mean@4" in records[2] and "eval/code/pass@1" in records[2]
    assert job_row(tmp_path / "0_plain")["eval"] == 0.625   # math's mean@4 at step 2
    assert job_row(tmp_path / "1_best")["eval"] == 0.75     # code's pass@1 at step 2
    rows = [line for line in summarize(tmp_path).splitlines() if line.startswith("| `")]
    assert [r.split(" | ")[4] for r in rows] == ["0.625", "0.750"]
