"""`python -m molt.diff A B`: what changes between two resolved run specs, for review.

Each side names a run spec, optionally followed by overrides in the same (quoted) argument:
    tiny                                an experiment, by name
    experiments/tiny.yaml               an experiment file
    experiments/tiny.yaml@main          that file at a git revision (with conf/ at that revision)
    runs/tiny/2026-11-29_10-00-00       a run directory, or its spec.yaml
    "tiny algo=rloo train.lr=1e-4"      an experiment plus overrides

Prints the config-group choices first, then every differing key grouped by section (free-form dicts
such as model.tiny on one line). `--format markdown` gives a table to paste into a pull request;
`--unified` a unified diff of the two spec.yaml files. Exit status as diff(1): 0 same, 1 different,
2 trouble (a one-line error).
"""

from __future__ import annotations

import argparse
import difflib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml

from molt.spec import RunSpec, SpecError, Strict, validate_spec
from molt.spec.config import GROUPS, choices_of, compose_config, spec_yaml, validate_config

SIDE = "_molt_diff_side"   # the name an experiment file gets while it is composed
ABSENT = "<absent>"


@dataclass
class Side:
    label: str
    spec: RunSpec
    choices: dict[str, str] = field(default_factory=dict)


def _compose(label: str, overrides: list[str], text: str | None = None, name: str = "",
             config_dir: Path | None = None) -> Side:
    """Compose overrides (plus an experiment file's text, shown as experiment `name`) into a Side."""
    if text is None:
        cfg = compose_config(overrides, config_dir)
        return Side(label, validate_config(cfg), choices_of(cfg))
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "experiment").mkdir()
        (Path(tmp) / "experiment" / f"{SIDE}.yaml").write_text(text, encoding="utf-8")
        cfg = compose_config([f"+experiment={SIDE}", *overrides], config_dir, Path(tmp))
        return Side(label, validate_config(cfg), choices_of(cfg) | {"experiment": name})


def _run_spec(label: str, text: str, run_dir: Path | None, overrides: list[str]) -> Side:
    """A resolved spec.yaml; its group choices come from Hydra's record beside it, when there is one."""
    if overrides:
        raise SpecError("overrides apply to experiments, not to a run's spec.yaml")
    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise SpecError("neither a run spec (a YAML mapping) nor an experiment ('# @package _global_')")
    spec = validate_spec(data)
    record = run_dir / ".hydra" / "hydra.yaml" if run_dir else None
    choices = {}
    if record and record.is_file():
        chosen = yaml.safe_load(record.read_text(encoding="utf-8"))["hydra"]["runtime"]["choices"]
        choices = {g: str(c) for g, c in chosen.items() if "/" not in g and c is not None}
    return Side(label, spec, choices)


def _git(*args: str) -> bytes:
    done = subprocess.run(["git", *args], capture_output=True)
    if done.returncode:
        raise SpecError(done.stderr.decode(errors="replace").strip().splitlines()[0])
    return done.stdout


def _conf_at(rev: str, into: Path) -> Path | None:
    """conf/ (and experiments/) of a Molt checkout at `rev`, unpacked into `into`; None if it has none."""
    top = _git("rev-parse", "--show-toplevel").decode().strip()
    present = [p for p in ("conf", "experiments")
               if not subprocess.run(["git", "-C", top, "cat-file", "-e", f"{rev}:{p}"],
                                     capture_output=True).returncode]
    if "conf" not in present:
        return None
    archive = _git("-C", top, "archive", rev, *present)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "conf"


def _at_revision(label: str, path: str, rev: str, overrides: list[str]) -> Side:
    """PATH@REV: the file as committed at REV, composed with conf/ at REV when the repository has one."""
    text = _git("show", f"{rev}:./{os.path.relpath(path)}").decode()
    if "@package _global_" not in text:
        return _run_spec(label, text, None, overrides)
    with tempfile.TemporaryDirectory() as tmp:
        return _compose(label, overrides, text, f"{Path(path).stem}@{rev}", _conf_at(rev, Path(tmp)))


def load_side(arg: str) -> Side:
    """Resolve one side of the diff (see the module docstring for the forms it takes)."""
    from hydra.errors import HydraException

    try:
        return _load(arg)
    except SpecError as err:
        raise SpecError(f"{arg}: {err}") from None
    except HydraException as err:   # e.g. an override Hydra cannot parse: its first line says why
        raise SpecError(f"{arg}: {str(err).strip().splitlines()[0]}") from None


def _load(arg: str) -> Side:
    words = arg.split()
    if not words:
        raise SpecError("empty: name an experiment, a YAML file, a run directory or FILE@REV")
    if "=" in words[0] and not Path(words[0]).exists():
        return _compose(arg, words)          # overrides of the default experiment
    source, overrides = words[0], words[1:]
    path = Path(source)
    base, at, rev = source.rpartition("@")
    if at and base and rev and not path.exists():
        return _at_revision(arg, base, rev, overrides)
    if path.is_dir():
        if not (path / "spec.yaml").is_file():
            raise SpecError("a directory without spec.yaml (not a run directory)")
        path = path / "spec.yaml"
    if path.is_file():
        text = path.read_text(encoding="utf-8")
        if "@package _global_" in text:
            return _compose(arg, overrides, text, path.stem)
        return _run_spec(arg, text, path.parent, overrides)
    names = sorted(p.name.removesuffix(".yaml") for p in files("molt.conf").joinpath("experiment").iterdir()
                   if p.name.endswith(".yaml"))
    if source in names:
        return _compose(arg, [f"+experiment={source}", *overrides])
    what = "no such file or directory" if "/" in source or path.suffix in (".yaml", ".yml") else \
        f"unknown experiment '{source}'"
    raise SpecError(f"{what}; available: {', '.join(names)} (or a YAML file, a run directory, FILE@REV)")


def leaves(model: type[Strict], data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value, descending into spec sections only: free-form dicts stay one value."""
    out: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, Strict):
            out.update(leaves(info.annotation, data[name], f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = data[name]
    return out


def key_diff(a: RunSpec, b: RunSpec) -> list[tuple[str, Any, Any]]:
    """(key, value in a, value in b) for every key that differs, in schema order."""
    fa = leaves(RunSpec, a.model_dump(mode="json"))
    fb = leaves(RunSpec, b.model_dump(mode="json"))
    return [(k, fa.get(k, ABSENT), fb.get(k, ABSENT)) for k in fa | fb
            if fa.get(k, ABSENT) != fb.get(k, ABSENT)]


def show(value: Any) -> str:
    """A value as one line of YAML flow style: null, true, 1.0e-06, {hidden_size: 128, ...}."""
    if isinstance(value, str) and value == ABSENT:
        return value
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6, sort_keys=False)
    return text.removesuffix("\n...\n").strip()


def _sections(a: Side, b: Side) -> list[tuple[str, list[tuple[str, Any, Any]]]]:
    """("groups", differing group choices) first, then (section, its differing keys) in schema order."""
    sections: dict[str, list[tuple[str, Any, Any]]] = {}
    chosen = [(g, a.choices.get(g, "(none)"), b.choices.get(g, "(none)")) for g in GROUPS]
    choices = [(g, ca, cb) for g, ca, cb in chosen if ca != cb]
    if choices:
        sections["groups"] = choices
    for key, va, vb in key_diff(a.spec, b.spec):
        sections.setdefault(key.split(".")[0], []).append((key, va, vb))
    return list(sections.items())


def as_text(a: Side, b: Side) -> str:
    """One row per difference; a section's name heads its first row, its keys are relative to it."""
    sections = _sections(a, b)
    rows = [(title if i == 0 else "", key.removeprefix(f"{title}."), va, vb)
            for title, group in sections for i, (key, va, vb) in enumerate(group)]
    w_title = max((len(t) for t, _, _, _ in rows), default=0)
    w_key = max((len(k) for _, k, _, _ in rows), default=0)
    lines = [f"{a.label} -> {b.label}: {summary(a, b)}"]
    lines += [f"{t:<{w_title}}  {k:<{w_key}}  {show(va)} -> {show(vb)}" for t, k, va, vb in rows]
    return "\n".join(lines) + "\n"


def as_markdown(a: Side, b: Side) -> str:
    def cell(value: Any) -> str:
        return "`" + show(value).replace("|", "\\|") + "`"

    lines = [f"**`{a.label}` → `{b.label}`**: {summary(a, b)}", ""]
    sections = _sections(a, b)
    if sections:
        lines += [f"| key | `{a.label}` | `{b.label}` |", "|---|---|---|"]
    for title, rows in sections:
        lines.append(f"| **{title}** | | |")
        lines += [f"| `{k}` | {cell(va)} | {cell(vb)} |" for k, va, vb in rows]
    return "\n".join(lines) + "\n"


def summary(a: Side, b: Side) -> str:
    n = len(key_diff(a.spec, b.spec))
    return "the resolved specs are identical" if n == 0 else f"{n} key(s) differ"


def unified_diff(a: RunSpec, b: RunSpec, name_a: str, name_b: str) -> str:
    return "".join(difflib.unified_diff(spec_yaml(a).splitlines(True), spec_yaml(b).splitlines(True),
                                        fromfile=name_a, tofile=name_b))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m molt.diff", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--format", choices=("text", "markdown"), default="text",
                        help="markdown: a table for a pull-request comment")
    parser.add_argument("--unified", action="store_true", help="a unified diff of the two spec.yaml files")
    args = parser.parse_args(argv)
    try:
        a, b = load_side(args.a), load_side(args.b)
    except SpecError as err:
        print(f"molt.diff: {err}", file=sys.stderr)
        return 2
    if args.unified:
        print(unified_diff(a.spec, b.spec, a.label, b.label), end="")
    else:
        print((as_markdown if args.format == "markdown" else as_text)(a, b), end="")
    return 1 if key_diff(a.spec, b.spec) else 0
