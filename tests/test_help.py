"""Self-documenting keys: every spec field has a description; `--help` prints it; the reference is current."""

from __future__ import annotations

from pathlib import Path

import pytest

from molt.spec import RunSpec
from molt.spec.help import main, sections

REPO = Path(__file__).resolve().parents[1]


def test_every_spec_field_has_a_one_line_description():
    for name, _, model in [("", "", RunSpec), *sections()]:
        for field, info in model.model_fields.items():
            assert info.description and "\n" not in info.description, f"{name}.{field} has no description"


def test_help_prints_type_value_and_meaning(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m molt")
    # * marks the default
    assert "  algo        cispo, dapo, decoupled_ppo, dr_grpo, gae, " in out and "reinforce_pp," in out
    assert "  train.lr: float = 0.0005\n      AdamW learning rate of the policy\n" in out
    assert "  rollout.mode: sync|async = sync\n" in out
    assert "  model.tiny: dict[str, int] = {hidden_size: 128," in out   # a free-form dict: one value


def test_help_of_a_prefix_with_overrides(capsys):
    assert main(["--help", "algo.correction", "algo=icepop"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("algo.correction — ")
    assert "  algo.correction.level: off|token|seq|geo = token\n" in out   # icepop's value
    assert "train." not in out and "algo.loss" not in out
    assert main(["--help", "model.tiny.hidden_size"]) == 0   # inside a free-form dict: the dict
    assert "  model.tiny: dict[str, int]" in capsys.readouterr().out


def test_help_of_an_unknown_prefix_is_a_one_line_error(capsys):
    assert main(["--help", "trian"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("molt: unknown key 'trian' (did you mean 'train'?); valid keys here: run, model,")
    assert err.count("\n") == 1


def test_configuration_reference_is_current(capsys):
    """docs/configuration.md is `python -m molt --help --markdown`; regenerate it when this fails."""
    assert main(["--help", "--markdown"]) == 0
    generated = capsys.readouterr().out
    assert "| `train.lr` | `float` | `0.0005` | AdamW learning rate of the policy |" in generated
    assert "| algo | `grpo` (default) |" in generated
    current = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert current == generated, "docs/configuration.md is stale: python -m molt --help --markdown > " \
                                 "docs/configuration.md"


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_cli_help_goes_to_molt_not_hydra(flag, monkeypatch, capsys):
    import molt.__main__ as cli

    monkeypatch.setattr("sys.argv", ["molt", flag, "ray"])
    with pytest.raises(SystemExit) as done:
        cli.main()
    assert done.value.code == 0
    assert "ray.address: str | None = null" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["eval", "export", "plot", "replay", "sweep", "diff"])
def test_every_command_answers_help(command, monkeypatch, capsys):
    """`python -m molt.CMD --help` prints its usage and exits 0, never a Hydra parse error or a
    missing-file message about a folder named --help."""
    import runpy

    monkeypatch.setattr("sys.argv", [f"molt.{command}", "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module(f"molt.{command}", run_name="__main__")
    out = capsys.readouterr()
    assert done.value.code in (0, None), out.err
    assert f"python -m molt.{command}" in out.out, out.out
