"""Foundation: experiments compose and validate; bad config fails clearly; diff; multirun."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from molt.config import compose
from molt.diff import key_diff, unified_diff
from molt.diff import main as diff_main
from molt.spec import SpecError

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted(p.stem for p in (REPO / "experiments").glob("*.yaml"))


def test_experiment_group_is_reachable():
    assert (REPO / "conf" / "experiment").resolve() == (REPO / "experiments").resolve()
    assert {"tiny", "qwen3_4b_math", "qwen30b_tools", "dsv3_ep256"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_and_validates(name):
    spec = compose([f"+experiment={name}"])
    assert spec.run.name == name
    p = spec.parallel
    assert p.dp_size * p.tp_size * p.cp_size == p.world_size


def test_default_is_tiny():
    assert compose([]) == compose(["+experiment=tiny"])


def test_qwen30b_tools_matches_its_description():
    spec = compose(["+experiment=qwen30b_tools"])
    assert spec.parallel.ep_size == 8 and spec.parallel.nodes == 2
    assert spec.rollout.mode == "async" and spec.rollout.partial_rollout
    assert (spec.algo.correction.level, spec.algo.correction.mode) == ("geo", "mask")
    assert (spec.algo.correction.low, spec.algo.correction.high) == (0.99, 1.01)
    assert spec.model.router_replay and spec.model.max_model_len == 32768


@pytest.mark.parametrize("override", ["parallel.ep_sise=8", "+parallel.ep_sise=8"])
def test_typo_names_the_nearest_key(override):
    with pytest.raises(SpecError, match=r"parallel\.ep_size"):
        compose([override])


def test_typo_inside_a_config_file_is_caught(tmp_path):
    from molt.spec import validate_spec

    data = compose([]).model_dump(mode="json")
    data["rollout"]["engine"]["kv_cache_gb"] = 2
    data["train"]["lrr"] = 1.0
    with pytest.raises(SpecError) as err:
        validate_spec(data)
    message = str(err.value)
    assert "2 error(s)" in message  # every problem at once
    assert "rollout.engine.kv_cache_gib" in message and "train.lr" in message


def test_bad_type_is_reported_with_key_and_value():
    with pytest.raises(SpecError, match=r"train\.lr: .*valid number.*'abc'"):
        compose(["train.lr=abc"])


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["parallel.world_size=4"], "must equal world_size=4"),
        (["parallel.tp_size=3", "parallel.world_size=3"], "power of two"),
        (["parallel.ep_size=4"], "ep_size=4 must divide"),
        (["train.prompts_per_step=3", "parallel=cpu2", "rollout.samples_per_prompt=1"], "divisible"),
        (["algo=gae"], "needs a critic"),
        (["algo.correction.low=1.5", "algo.correction.high=1.0"], "must be below"),
    ],
)
def test_cross_field_rules(overrides, fragment):
    with pytest.raises(SpecError, match=fragment):
        compose(overrides)


def test_missing_experiment_fails():
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match="experiment/nope"):
        compose(["+experiment=nope"])


def test_yaml_off_is_the_string_off():
    assert compose(["algo.correction.level=off"]).algo.correction.level == "off"


def test_diff_tiny_vs_qwen30b_tools(capsys):
    a, b = compose(["+experiment=tiny"]), compose(["+experiment=qwen30b_tools"])
    keys = {k for k, _, _ in key_diff(a, b)}
    assert "parallel.ep_size" in keys and "model.path" in keys and "run.seed" not in keys
    assert "+  ep_size: 8" in unified_diff(a, b, "tiny", "qwen30b_tools")
    assert diff_main(["tiny", "qwen30b_tools"]) == 0
    out = capsys.readouterr().out
    assert "parallel.ep_size" in out and "1 -> 8" in out


def test_diff_of_override_lists(capsys):
    assert diff_main(["tiny", "tiny algo=rloo train.lr=1e-4"]) == 0
    out = capsys.readouterr().out
    assert "algo.estimator" in out and "train.lr" in out and "3 key(s) differ" in out  # + job_type


def _molt(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "molt", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_cli_typo_fails_before_anything_starts():
    proc = _molt("parallel.ep_sise=8")
    assert proc.returncode != 0 and "parallel.ep_size" in proc.stderr


def test_cli_print_config():
    proc = _molt("+experiment=qwen30b_tools", "--cfg", "job", "--resolve")
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["parallel"]["ep_size"] == 8


def test_multirun_writes_one_resolved_spec_per_job(tmp_path):
    proc = _molt("-m", "algo=grpo,rloo,reinforce_pp", "run.dry_run=true", f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    specs = sorted(tmp_path.glob("*/spec.yaml"))
    assert len(specs) == 3
    loaded = [yaml.safe_load(p.read_text()) for p in specs]
    assert sorted(s["algo"]["estimator"] for s in loaded) == ["grpo", "reinforce_pp", "rloo"]
    for path, spec in zip(specs, loaded, strict=True):
        assert spec["run"]["dir"] == str(path.parent)           # resolved, not ${...}
        assert spec["logging"]["wandb"]["group"] == tmp_path.name  # one W&B group per sweep
        assert spec["logging"]["wandb"]["job_type"] == spec["algo"]["estimator"]
