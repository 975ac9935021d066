"""The documentation's relative links resolve: every file a link names exists, and every `#anchor` into
a markdown page names one of that page's headings (as GitHub renders them); files copied into a page are
the files; the model sizes the pages quote are the models' (built on the meta device, no weights)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", REPO / "CONTRIBUTING.md", REPO / "bench" / "README.md",
                REPO / "bench" / "RESULTS.md", REPO / "tests" / "README.md", REPO / "recipes" / "README.md",
                *(REPO / "docs").glob("*.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def prose(text: str) -> str:
    """The page without code blocks and inline code, where brackets are code, not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", FENCE.sub("", page.read_text(encoding="utf-8")), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):    # http(s), mailto: not checked (no network in tests)
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading '#{anchor}' in {os.path.relpath(resolved, page.parent)}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    assert broken_links(page) == []


def test_the_checker_sees_a_broken_file_and_a_broken_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Title — `code` here\n\n## Two\n", encoding="utf-8")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#title--code-here) [ok](a.md#two) [bad](missing.md) [bad](a.md#three)\n"
                    "`[not a link](missing.md)`\n```\n[not a link](missing.md)\n```\n", encoding="utf-8")
    assert broken_links(page) == ["missing.md: no such file", "a.md#three: no heading '#three' in a.md"]


CODE = ["molt/**/*.py", "bench/*.py", "tests/**/*.py", "conf/**/*.yaml", "experiments/*.yaml",
        "examples/**/*.py"]
CITED = re.compile(r"\b((?:docs|bench|tests|recipes)/[\w-]+\.md)\b")


def test_documents_cited_by_the_code_exist():
    cited = {c for pattern in CODE for source in REPO.glob(pattern)
             for c in CITED.findall(source.read_text(encoding="utf-8"))}
    assert cited and sorted(c for c in cited if not (REPO / c).exists()) == []


EMBEDDED = re.compile(r"^<!-- file: (\S+) -->\n```\w*\n(.*?)^```", re.M | re.S)


def test_embedded_files_are_the_files():
    """A block after `<!-- file: PATH -->` is PATH's whole text: a worked example that is the real file."""
    blocks = [(page, path, text) for page in PAGES
              for path, text in EMBEDDED.findall(page.read_text(encoding="utf-8"))]
    assert any(path == "examples/algo/opo.py" for _, path, _ in blocks)
    stale = [f"{page.relative_to(REPO)}: {path}" for page, path, text in blocks
             if text != (REPO / path).read_text(encoding="utf-8")]
    assert stale == [], "copy the file into the page again"


def parameters(**opts: int) -> int:
    """Parameters of the molt.inputs.tiny model with these options (tied embeddings counted once)."""
    import torch
    from transformers import AutoModelForCausalLM

    from molt.inputs.tiny import DEFAULTS, build_model_config

    full = {**DEFAULTS, **opts}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_model_config(full, full["vocab_size"]))
    return sum(p.numel() for p in model.parameters())


def test_quoted_model_sizes_are_the_models():
    import importlib.util

    from molt.driver.compose import compose

    loaded = importlib.util.spec_from_file_location("bench_common", REPO / "bench" / "common.py")
    common = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(common)
    tiny = f"{parameters() / 1e6:.2f}M"
    # every sub-million size a page or an experiment's header quotes is the default tiny model's (RESULTS.md
    # is written by the benchmarks, which round to one decimal)
    written = [p for p in PAGES if p.name != "RESULTS.md"]
    quoted = {(str(p.relative_to(REPO)), size) for p in [*written, *REPO.glob("experiments/*.yaml")]
              for size in re.findall(r"\b0\.\d+M\b", p.read_text(encoding="utf-8"))}
    assert quoted and {q for q in quoted if q[1] != tiny} == set()
    bench = (REPO / "bench" / "README.md").read_text(encoding="utf-8")
    for name in ("30m", "100m"):
        assert f"| {parameters(**common.SIZES[name]) / 1e6:.1f}M |" in bench, name
    teacher = parameters(**compose(["+experiment=distill_tiny"]).model.reference_tiny) / 1e6
    assert f"a {teacher:.1f}M-parameter teacher" in (REPO / "docs" / "trainer.md").read_text(encoding="utf-8")


# Pasted command output: a fenced block of `$ python -m molt...` lines, each followed by what it prints.
PASTED = re.compile(r"^```\n(\$ python -m molt.*?)^```", re.M | re.S)
RUN_TIME = re.compile(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d")


class _Started(Exception):
    """The command would start a run: its output is a run's, which no test reproduces."""


def pasted_commands(page: Path) -> list[tuple[str, list[str]]]:
    """(command, the lines the page shows it printing) for every pasted `python -m molt...` command."""
    out: list[tuple[str, list[str]]] = []
    for block in PASTED.findall(page.read_text(encoding="utf-8")):
        for line in block.splitlines():
            if line.startswith("$ "):
                out.append((line[2:], []))
            else:
                out[-1][1].append(line)
    return out


def printed(command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    """What `command` prints (stdout, then stderr), run in this process; raises _Started for a real run."""
    import shlex

    import molt.__main__ as cli
    from molt.spec.diff import main as diff_main

    def started() -> None:
        raise _Started

    words = shlex.split(command)
    monkeypatch.setattr(cli, "_run", started)
    tail = ""
    if words[2] == "molt.diff":
        diff_main(words[3:])
    else:
        monkeypatch.setattr("sys.argv", ["molt", *words[3:]])
        try:
            cli.main()
        except SystemExit as done:   # sys.exit("molt: ...") prints its message on the way out
            tail = f"{done.code}\n" if isinstance(done.code, str) else ""
    captured = capsys.readouterr()
    return RUN_TIME.sub("<time>", (captured.out + captured.err + tail).replace(str(REPO), "~/molt"))


def shown_in(shown: list[str], actual: list[str]) -> bool:
    """The page's lines are the output, where a `...` line stands for lines left out."""
    if "..." not in shown:
        return shown == actual
    at = 0
    for chunk in "\n".join(shown).split("\n...\n"):
        lines = [line for line in chunk.split("\n") if line != "..."]
        found = next((i for i in range(at, len(actual) - len(lines) + 1)
                      if actual[i:i + len(lines)] == lines), None)
        if found is None:
            return False
        at = found + len(lines)
    return True


def test_pasted_outputs_are_what_the_commands_print(monkeypatch, capsys):
    """docs/workflows.md's `--help`, `--cfg job`, dry-run, sweep-preview and `molt.diff` outputs; a command
    that starts a run, or names a git revision (FILE@REV), is not rerun."""
    page = REPO / "docs" / "workflows.md"
    checked, stale = 0, []
    for command, shown in pasted_commands(page):
        if not shown or "@" in command:
            continue
        try:
            actual = printed(command, monkeypatch, capsys)
        except _Started:
            capsys.readouterr()
            continue
        checked += 1
        if not shown_in([RUN_TIME.sub("<time>", line) for line in shown], actual.splitlines()):
            stale.append((command, shown, actual.splitlines()))
    assert checked >= 8
    if stale and os.environ.get("MOLT_UPDATE_DOCS"):
        page.write_text(updated(page.read_text(encoding="utf-8"), stale), encoding="utf-8")
        return
    assert stale == [], ("update docs/workflows.md with what these print (or rerun this test with "
                         "MOLT_UPDATE_DOCS=1 to paste it):\n" +
                         "\n".join(f"$ {c}\n" + "\n".join(a) for c, _, a in stale))


def updated(text: str, stale: list[tuple[str, list[str], list[str]]]) -> str:
    """`text` with each stale command's shown lines replaced by its output; a shown block that left lines
    out (`...`) keeps as many lines before and after the cut as it showed."""
    for command, shown, actual in stale:
        if "..." in shown:
            cuts = [i for i, line in enumerate(shown) if line == "..."]
            head, tail = cuts[0], len(shown) - 1 - cuts[-1]
            actual = actual[:head] + ["..."] + (actual[len(actual) - tail:] if tail else [])
        old = "\n".join([f"$ {command}", *shown]) + "\n"
        text = text.replace(old, "\n".join([f"$ {command}", *actual]) + "\n", 1)
    return text


def test_an_elided_block_must_still_match():
    assert shown_in(["a", "...", "c", "d"], ["a", "b", "c", "d", "e"])
    assert not shown_in(["a", "...", "d", "c"], ["a", "b", "c", "d"])
    assert not shown_in(["a", "b"], ["a", "b", "c"])


CITED_TEST = re.compile(r"`(?:tests/)?((?:faults/)?test_\w+\.py)(?:::(\w+))?`|`(test_\w+)`")


def test_tests_the_pages_cite_exist():
    """Every test file, `file::test` and bare `test_name` a page cites is there (a renamed test leaves
    a dangling citation otherwise)."""
    files = {p.name: p for p in (REPO / "tests").rglob("test_*.py")}
    defined = {p.name: set(re.findall(r"^\s*(?:async )?def (\w+)", p.read_text(encoding="utf-8"), re.M))
               for p in files.values()}
    everywhere = set().union(*defined.values())
    missing, cited = [], 0
    for page in PAGES:
        for path, name, bare in CITED_TEST.findall(page.read_text(encoding="utf-8")):
            cited += 1
            where = str(page.relative_to(REPO))
            if path and Path(path).name not in files:
                missing.append(f"{where}: {path}")
            elif path and name and name not in defined[Path(path).name]:
                missing.append(f"{where}: {path}::{name}")
            elif bare and bare not in everywhere:
                missing.append(f"{where}: {bare}")
    assert cited > 100 and missing == []


def test_every_test_file_is_on_the_map():
    """tests/README.md's table is where a reader finds a test file: a new one gets its row."""
    listed = (REPO / "tests" / "README.md").read_text(encoding="utf-8")
    assert sorted(p.name for p in (REPO / "tests").glob("test_*.py") if f"`{p.name}`" not in listed) == []


CODE_PATH = re.compile(r"`((?:molt|examples|conf|experiments|bench|tools|recipes|tests)/[\w./-]+"
                       r"\.(?:py|yaml|sh|jsonl|sbatch|md))")
DOTTED = re.compile(r"`(molt(?:\.\w+)+)")


def resolves(dotted: str) -> bool:
    """`molt.a.b.c`: the longest importable module prefix, then attributes."""
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_code_the_pages_name_exists():
    """Every file path and `molt.x.y` name a page cites in code font is there (NAME, GROUP, OPTION:
    placeholders)."""
    missing = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        missing += [f"{page.relative_to(REPO)}: {path}" for path in CODE_PATH.findall(text)
                    if not (REPO / path).exists() and not re.search(r"NAME|GROUP|OPTION", path)]
        missing += [f"{page.relative_to(REPO)}: {name}" for name in sorted(set(DOTTED.findall(text)))
                    if not resolves(name)]
    assert missing == []


# Code font that names code: a call (`name(...)`, `obj.method(`), a dotted name (`module.attr`,
# `Trainers.save`) outside the `molt.` names above, or a snake_case name (`replay_routes`). Each must be a
# name the code defines, uses or spells in a string (a config value, a metric), a module of the repository,
# or a spec key (`rollout.eval.pass_reward`); an attribute of one of Molt's classes must be that class's.
# These are not the code's:
EXTERNAL = {"vllm", "torch", "aten", "httpx2", "anyio",   # other packages' names, as they spell them
            "AsyncLLM", "EngineCoreClient", "WeightTransferEngineFactory", "CompletionOutput",   # vLLM's
            "qwen3_coder", "llama4_pythonic", "deepseek_v32", "kimi_k2",   # vLLM's tool parsers
            "top_logprobs", "best_of", "file_search", "code_interpreter",  # OpenAI request fields, tools
            "ttl_seconds",                                                 # a Tinker SDK request field
            "context_parallel"}                                            # torch's
NOT_CODE = {"thinking.budget_tokens", "output_config.effort",   # Anthropic request fields
            "response.created", "response.completed",           # Responses API stream events
            "sigmoid", "whiten_batch", "mean_group", "mean_t",  # formula notation (algo.md, agents.md)
            "a_k", "s_k"}
FREE_FORM = {"options", "extra_args", "tiny", "reference_tiny", "chat_template_kwargs", "arch", "fields"}
CODE_SPAN = re.compile(r"`([^`\n]+)`")
CALL = re.compile(r"(?<![\w.])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\(")
DOTTED_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
SNAKE = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)+")
FILE_NAME = re.compile(r"\.(?:py|ya?ml|jsonl?|md|txt|log|png|sh|sbatch|jinja|parquet|pq|toml|whl|so|"
                       r"safetensors)$")


def code_names() -> tuple[set[str], dict[str, set[str]]]:
    """Every name the code defines, uses (ast: names, attributes, definitions, arguments, imports) or spells
    in a string, every module's file name; and the members of each of Molt's classes (methods, fields,
    attributes set on self, those of its Molt bases), None for a class with another base (its members are
    not all here)."""
    import ast

    names, members, bases = set(), {}, {}
    names |= {p.stem for p in [*REPO.glob("conf/*/*.yaml"), *REPO.glob("experiments/*.yaml")]}   # options
    names |= set(re.findall(r"<!-- bench:(\w+)", (REPO / "bench" / "RESULTS.md").read_text(encoding="utf-8")))
    for source in [p for pattern in ("molt/**/*.py", "examples/**/*.py", "bench/*.py", "tests/**/*.py",
                                     "tools/*.py") for p in REPO.glob(pattern) if p.name != "test_docs.py"]:
        names.add(source.stem)
        tree = ast.parse(source.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names.add(getattr(node, "id", None) or getattr(node, "attr", None) or getattr(node, "arg", None)
                      or getattr(node, "name", None) or "")
            if isinstance(node, ast.alias):
                names.update(node.name.split("."))
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.update(re.findall(r"\w+", node.value))
            if isinstance(node, ast.ClassDef) and source.relative_to(REPO).parts[0] == "molt":
                own = members.setdefault(node.name, set())
                bases[node.name] = [ast.unparse(b) for b in node.bases]
                for inner in ast.walk(node):
                    own.add(getattr(inner, "name", None) or "")
                    target = getattr(inner, "target", None) or getattr(inner, "attr", None)
                    own.add(getattr(target, "id", None) or getattr(target, "attr", None) or
                            (target if isinstance(target, str) else ""))
                    for t in getattr(inner, "targets", []):
                        own.add(getattr(t, "id", None) or getattr(t, "attr", None) or "")

    def all_members(cls: str) -> set[str] | None:
        own = set(members[cls])
        for base in bases[cls]:
            if base in members:
                inherited = all_members(base)
                if inherited is None:
                    return None
                own |= inherited
            elif base not in ("Protocol", "object", "NamedTuple", "Exception", "ValueError", "RuntimeError"):
                return None
        return own
    return names, {cls: all_members(cls) for cls in members}


def spec_key(dotted: str) -> bool:
    """Whether `dotted` is a run-spec key (anything below a free-form dict counts)."""
    from molt.spec import RunSpec

    model = RunSpec
    for part in dotted.split("."):
        fields = getattr(model, "model_fields", None)
        if fields is None:
            return True
        if part not in fields:
            return False
        model = fields[part].annotation
    return True


def unknown_code_names(text: str, names: set[str], classes: dict[str, set[str] | None]) -> list[str]:
    """The calls, dotted and snake_case names in `text`'s code font that name nothing in the code."""
    unknown = []
    for span in CODE_SPAN.findall(text):
        whole = span.strip()
        alone = DOTTED_NAME.fullmatch(whole) or SNAKE.fullmatch(whole)
        named = CALL.findall(span) + ([whole] if alone else [])
        for name in dict.fromkeys(named):
            parts = name.split(".")
            if name in NOT_CODE or parts[0] in EXTERNAL | FREE_FORM or name.startswith("molt.") or \
                    FILE_NAME.search(name) or (len(parts) > 1 and spec_key(name)):
                continue
            known = classes.get(parts[0])
            if any(part not in names for part in parts) or (known is not None and len(parts) > 1 and
                                                            parts[1] not in known):
                unknown.append(name)
    return unknown


def test_code_names_the_pages_use_exist():
    """A function, method or attribute a page names in code font is one the code has: a renamed or removed
    name leaves a false sentence otherwise (generator.md named `replay_routes`, which no code defined)."""
    names, classes = code_names()
    # bench/RESULTS.md records what ran at each measurement's commit, in the names of that day
    unknown = [f"{page.relative_to(REPO)}: {name}" for page in PAGES if page.name != "RESULTS.md"
               for name in unknown_code_names(page.read_text(encoding="utf-8"), names, classes)]
    assert unknown == []


def test_the_name_check_catches_a_false_name():
    names, classes = code_names()
    page = ("the trainer's `replay_routes` forces the routers; `set_routes(model, routes)` does; "
            "`Trainers.roles()` and `Trainers.groups()`; `rollout.eval.pass_reward`, `spec.yaml`, "
            "`runner.setup(tokenizer, spec, judge)`, `replay_routes(batch)`, `take_batch`")
    assert unknown_code_names(page, names, classes) == ["replay_routes", "Trainers.groups", "replay_routes"]
