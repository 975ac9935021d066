"""The import graph of molt/, read from the source (ast), folder by folder.

    python tools/import_graph.py            # folder-level edges, each module's floor, circles
    python tools/import_graph.py --modules  # every module-level edge as well

A module's floor is 0 when it imports nothing of Molt and one more than the highest floor it imports
otherwise (imports inside functions count: they still make one file depend on another). The wings
(agents, rollout, trainer, algo) meet only through the contract and never import each other; the spec
imports none of them nor plan/ nor inputs/, so no two folders import each other: tests/test_codebase.py
checks both with `wing_crossings` and `circles`.
"""

from __future__ import annotations

import ast
import sys
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "molt"
WINGS = ("agents", "rollout", "trainer", "algo")
# What sits above the wings and may import them; nothing else imports it back (the top level is the
# commands and the contract). tinker/ is the service face over the same pieces (it imports the driver's).
ORCHESTRATION = ("driver", "tinker")
# Wing-to-wing imports still standing, each with its reason; tests/test_codebase.py fails on any other
# one and on an entry that no longer happens.
KNOWN_CROSSINGS = {
    "molt.trainer.step_metrics -> molt.algo": "the trainer/engine gap a rank sums and reduces is algo/'s "
                                              "statistic (gap_sums, gap_metrics: the correction's too)",
    "molt.trainer.worker -> molt.algo": "the trainer rank computes the losses algo/ defines (pure tensor "
                                        "functions chosen by name, the way the spec names them) and loads "
                                        "algo.plugins into its own registries",
    "molt.trainer.token_record -> molt.algo": "the rank's per-token record for the dump keeps the importance "
                                              "weight the loss applies: algo's importance_weights on the "
                                              "loss's own inputs",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The Molt modules `path` imports anywhere in its body (`from a import b` counts a.b if a module)."""
    found = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    own = module_name(path) if path.resolve().is_relative_to(REPO) else ""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name in modules and name != own}


def graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return {module_name(path): imports(path, modules) for path in paths}


# The top level holds the contract between the wings (and the package itself), and the commands.
CONTRACT = ("molt", "molt.trajectory", "molt.refit", "molt.quiet")


def folder(module: str) -> str:
    """The job a module belongs to: its folder under molt/; at the top level, `contract` or `commands`."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()):
        return parts[1]
    return "contract" if module in CONTRACT else "commands"


def wing_crossings(edges: dict[str, set[str]]) -> list[str]:
    """Imports from one wing into another wing: the wings meet only through the contract."""
    return sorted(f"{src} -> {dst}" for src, dsts in edges.items() for dst in dsts
                  if folder(src) in WINGS and folder(dst) in WINGS and folder(src) != folder(dst))


def into_orchestration(edges: dict[str, set[str]]) -> list[str]:
    """Imports into the driver from below it (the wings, the plan, the spec, the inputs)."""
    return sorted(f"{src} -> {dst}" for src, dsts in edges.items() for dst in dsts
                  if folder(dst) in ORCHESTRATION and folder(src) not in (*ORCHESTRATION, "commands"))


def floors(edges: dict[str, set[str]]) -> dict[str, int]:
    @cache
    def floor(module: str, seen: frozenset = frozenset()) -> int:
        deps = [d for d in edges[module] if d not in seen and not module.startswith(d + ".")]
        return 1 + max((floor(d, seen | {module}) for d in deps), default=-1)
    return {module: floor(module) for module in edges}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Folder-level circles (a folder that imports a folder that imports it back), the package excluded."""
    by_folder: dict[str, set[str]] = {}
    for src, dsts in edges.items():
        by_folder.setdefault(folder(src), set()).update(folder(d) for d in dsts if folder(d) != folder(src))
    return sorted([a, b] for a in by_folder for b in by_folder.get(a, ()) if a < b
                  and a in by_folder.get(b, ()))


def main(argv: list[str]) -> None:
    edges = graph()
    by_folder: dict[tuple[str, str], int] = {}
    for src, dsts in edges.items():
        for dst in dsts:
            if folder(src) != folder(dst):
                key = (folder(src), folder(dst))
                by_folder[key] = by_folder.get(key, 0) + 1
    print("folder -> folder (imports)")
    for (src, dst), count in sorted(by_folder.items()):
        print(f"  {src:10s} -> {dst:10s} {count}")
    levels = floors(edges)
    print(f"{len(edges)} modules, {max(levels.values()) + 1} floors; "
          f"{sum(folder(m) in ('contract', 'commands') for m in edges)} at the top level")
    for level in range(max(levels.values()) + 1):
        print(f"  floor {level}: " + " ".join(sorted(m.removeprefix('molt.') for m in edges
                                                     if levels[m] == level)))
    print("folder circles:", circles(edges) or "none")
    print("wing crossings:", wing_crossings(edges) or "none")
    print("imports into the driver from below:", into_orchestration(edges) or "none")
    if "--modules" in argv:
        for src, dsts in sorted(edges.items()):
            print(src, "->", " ".join(sorted(dsts)))


if __name__ == "__main__":
    main(sys.argv[1:])
