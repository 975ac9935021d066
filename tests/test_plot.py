"""plot_run and `python -m molt.plot` on synthetic metrics.jsonl files."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib.image import imread

from molt.driver.plot import main, plot_run, read_metrics, warmup_clip

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_metrics(run_dir: Path, steps: int = 30) -> None:
    lines = []
    for s in range(steps):
        row = {"step": s, "time": 1000.0 + s, "reward/mean": 0.1 + 0.8 * s / steps + 0.05 * math.sin(s),
               "reward/std": 0.2, "mismatch/mean_abs": 1e-5, "mismatch/max_abs": 3e-4,
               "time/generate": 0.5, "time/logprobs": 0.1, "time/train": 0.2, "time/refit": 0.01,
               "time/step": 0.9}
        if s % 10 == 9:
            row |= {"eval/x/mean@4": s / steps, "eval/x/pass@4": min(1.0, 2 * s / steps)}
        lines.append(json.dumps(row))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_plot_run_writes_all_figures(tmp_path: Path) -> None:
    write_metrics(tmp_path)
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == ["reward.png", "eval.png", "mismatch.png", "timings.png"]
    for p in paths:
        assert p.parent == tmp_path / "plots" and p.read_bytes()[:8] == PNG_MAGIC
        image = imread(p)
        assert image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0  # not a blank canvas


def test_missing_metrics_are_skipped(tmp_path: Path) -> None:
    # a reward-only run: no eval, mismatch or timing figures; a line cut off by a killed run is ignored
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "reward/mean": 0.1}\n'
                                            '{"step": 1, "reward/mean": 0.3}\n'
                                            '{"step": 2, "rew')
    assert [p.name for p in plot_run(tmp_path)] == ["reward.png"]
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "time/generate": 1.0}\n')
    assert [p.name for p in plot_run(tmp_path)] == ["timings.png"]
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "train/loss": 1.0}\n')   # e.g. an SFT run
    assert [p.name for p in plot_run(tmp_path)] == ["loss.png"]
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "train/lr": 1.0}\n')
    assert plot_run(tmp_path) == []
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        plot_run(tmp_path / "nowhere")


def test_resumed_steps_keep_the_last_record(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "a": 1}\n{"step": 0, "a": 0}\n{"step": 1, "a": 2}\n')
    assert read_metrics(tmp_path / "metrics.jsonl") == {0: {"a": 0}, 1: {"a": 2}}


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_metrics(tmp_path, steps=10)
    done = subprocess.run([sys.executable, "-m", "molt.plot", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    printed = [Path(line) for line in done.stdout.splitlines()]
    names = ("reward.png", "eval.png", "mismatch.png", "timings.png")
    assert printed == [tmp_path / "plots" / n for n in names]
    assert all(p.stat().st_size > 0 for p in printed)

    with pytest.raises(SystemExit, match="no metrics.jsonl"):
        main([str(tmp_path / "missing")])
    with pytest.raises(SystemExit, match="2"):
        main([])
    assert "usage: python -m molt.plot" in capsys.readouterr().err


def test_a_slow_first_step_does_not_flatten_the_timings(tmp_path: Path) -> None:
    # measured on the default run: 17.7 s for step 1 (engine and trainer warm-up), ~0.3 s afterwards
    assert warmup_clip([17.7, 0.3, 0.45, 0.35]) == pytest.approx(1.2 * 0.45)
    assert warmup_clip([0.5, 0.3, 0.45]) is None and warmup_clip([17.7]) is None
    loaded = [4.8, 5.9, 3.0, 3.4, 2.1, 1.5, 0.9, 0.5] + [0.4, 1.2] * 196   # busy machine: 8 slow steps
    assert warmup_clip(loaded) == pytest.approx(1.2 * 1.2)
    write_metrics(tmp_path, steps=20)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first = json.loads(lines[0]) | {"time/step": 17.7, "time/generate": 16.0}
    (tmp_path / "metrics.jsonl").write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    assert (tmp_path / "plots" / "timings.png") in plot_run(tmp_path)
