"""`python -m molt.diff`: every input form, the text and markdown output, exit codes, one-line errors.

Run directories (a real sweep's jobs) are diffed in tests/test_sweep.py.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from molt.driver.compose import compose
from molt.spec.diff import key_diff, load_side, main, unified_diff

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = REPO / "experiments"


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_name_and_its_file_are_the_same_spec(capsys):
    code, out, _ = run(capsys, "tiny", str(EXPERIMENTS / "tiny.yaml"))
    assert code == 0 and "identical" in out
    assert load_side(str(EXPERIMENTS / "qwen30b_tools.yaml")).spec == compose(["+experiment=qwen30b_tools"])


def test_text_output_puts_group_choices_first_and_keeps_free_dicts_on_one_line(capsys):
    code, out, _ = run(capsys, str(EXPERIMENTS / "tiny.yaml"), "qwen30b_tools")
    assert code == 1
    lines = out.splitlines()
    n = len(key_diff(compose([]), compose(["+experiment=qwen30b_tools"])))
    assert lines[0] == f"{EXPERIMENTS / 'tiny.yaml'} -> qwen30b_tools: {n} key(s) differ"
    assert lines[1].split() == ["groups", "experiment", "tiny", "->", "qwen30b_tools"]
    assert ["algo", "grpo", "->", "grpo_seq_mask_tis"] in [line.split() for line in lines[2:6]]
    sections = [line.split()[0] for line in lines[1:] if not line.startswith(" ")]
    assert sections == ["groups", "run", "model", "parallel", "rollout", "train", "algo", "agent", "data"]
    assert len(lines) == n + 5 + 1 <= 50   # one screen: a header, 5 group choices, the keys
    code, out, _ = run(capsys, "tiny", "tiny model=tiny_moe")
    [tiny] = [line for line in out.splitlines() if line.split()[0] in ("model", "tiny")
              and "hidden_size" in line]   # model.tiny, a free-form dict, on one line
    assert tiny.split("{")[1].startswith("hidden_size: 128,") and tiny.endswith("moe_intermediate_size: 64}")


def test_markdown_table_for_a_pull_request(capsys):
    code, out, _ = run(capsys, "tiny", "tiny algo=rloo train.lr=1e-4", "--format", "markdown")
    assert code == 1
    assert out.splitlines()[0] == "**`tiny` → `tiny algo=rloo train.lr=1e-4`**: 2 key(s) differ"
    assert "\n".join(["| key | `tiny` | `tiny algo=rloo train.lr=1e-4` |", "|---|---|---|",
                      "| **groups** | | |", "| `algo` | `grpo` | `rloo` |",
                      "| **train** | | |", "| `train.lr` | `0.0005` | `0.0001` |"]) in out
    assert "| `algo.estimator` | `grpo` | `rloo` |" in out


def test_unified_and_exit_codes(capsys):
    a, b = compose([]), compose(["+experiment=qwen30b_tools"])
    assert "+  dp_size: 8" in unified_diff(a, b, "tiny", "qwen30b_tools")
    code, out, _ = run(capsys, "tiny", "qwen30b_tools", "--unified")
    assert code == 1 and out.startswith("--- tiny\n+++ qwen30b_tools\n") and "+  dp_size: 8" in out
    code, out, _ = run(capsys, "tiny", "tiny", "--unified")
    assert (code, out) == (0, "")


@pytest.mark.parametrize("side, fragment", [
    ("nope", "nope: unknown experiment 'nope'; available: "
             + ", ".join(sorted(p.stem for p in EXPERIMENTS.glob("*.yaml")))),
    ("experiments/nope.yaml", "experiments/nope.yaml: no such file or directory; available: "
                              + ", ".join(sorted(p.stem for p in EXPERIMENTS.glob("*.yaml")))),
    (str(REPO / "docs"), "a directory without spec.yaml (not a run directory)"),
    ("tiny algo=nope", "tiny algo=nope: unknown algo 'nope'; available: cispo, dapo, decoupled_ppo,"),
    ("tiny train.lrr=1", "unknown key 'train.lrr' (did you mean 'train.lr'?)"),
    ("tiny algo=[", "tiny algo=[: "),
    ("experiments/tiny.yaml@no-such-rev", "fatal: invalid object name 'no-such-rev'"),
])
def test_bad_sides_are_one_line_errors(capsys, side, fragment):
    code, out, err = run(capsys, side, "tiny")
    assert code == 2 and out == ""
    assert err.startswith("molt.diff: ") and fragment in err and err.count("\n") == 1, err


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo), *args], check=True,
                   capture_output=True)


def test_file_at_a_git_revision_is_composed_with_conf_at_that_revision(tmp_path, monkeypatch, capsys):
    """A throwaway repository: commit 1 has the shipped conf/ and experiments/; commit 2 changes a
    group option (conf/algo/reinforce_pp.yaml) and an experiment. Each revision composes with its own
    conf/; the working-tree file composes with the installed conf/."""
    shutil.copytree(REPO / "conf", tmp_path / "conf", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(EXPERIMENTS, tmp_path / "experiments")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "base")
    algo = tmp_path / "conf" / "algo" / "reinforce_pp.yaml"
    algo.write_text(algo.read_text() + "gamma: 0.5\n")
    (tmp_path / "experiments" / "tiny.yaml").write_text("# @package _global_\nrun: {name: tiny}\n"
                                                        "train: {lr: 1.0e-4}\n")
    _git(tmp_path, "commit", "-qam", "change")
    monkeypatch.chdir(tmp_path)

    code, out, _ = run(capsys, "experiments/tiny.yaml@HEAD~1", "experiments/tiny.yaml@HEAD")
    assert code == 1
    assert [line.split() for line in out.splitlines()[1:]] == [
        ["groups", "experiment", "tiny@HEAD~1", "->", "tiny@HEAD"],
        ["train", "lr", "0.0005", "->", "0.0001"],
        ["algo", "gamma", "1.0", "->", "0.5"]]
    # the working-tree file with the installed conf/ (gamma 1.0): only the experiment's change shows
    assert [(k, b) for k, _, b in key_diff(load_side("experiments/tiny.yaml@HEAD~1").spec,
                                           load_side("experiments/tiny.yaml").spec)] == [("train.lr", 1e-4)]
    code, _, err = run(capsys, "experiments/gone.yaml@HEAD", "tiny")
    assert code == 2 and "'experiments/gone.yaml' does not exist in 'HEAD'" in err
