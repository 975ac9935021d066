"""`python -m molt.diff A B`: what two run specs change, key by key (or as a unified diff).

A and B are each an experiment name followed by optional overrides, in one quoted argument:
    python -m molt.diff tiny qwen30b_tools
    python -m molt.diff tiny "tiny algo=rloo train.lr=1e-4" --unified
"""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import Any

from molt.config import compose, spec_yaml
from molt.spec import RunSpec, SpecError


def overrides_of(arg: str) -> list[str]:
    words = arg.split()
    return [w if "=" in w else f"+experiment={w}" for w in words]


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def key_diff(a: RunSpec, b: RunSpec) -> list[tuple[str, Any, Any]]:
    """(key, value in a, value in b) for every leaf that differs; missing leaves are '<absent>'."""
    fa, fb = flatten(a.model_dump(mode="json")), flatten(b.model_dump(mode="json"))
    absent = "<absent>"
    return [(k, fa.get(k, absent), fb.get(k, absent)) for k in sorted(fa.keys() | fb.keys())
            if fa.get(k, absent) != fb.get(k, absent)]


def unified_diff(a: RunSpec, b: RunSpec, name_a: str, name_b: str) -> str:
    return "".join(difflib.unified_diff(spec_yaml(a).splitlines(True), spec_yaml(b).splitlines(True),
                                        fromfile=name_a, tofile=name_b))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m molt.diff", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--unified", action="store_true", help="print a unified diff of the resolved specs")
    args = parser.parse_args(argv)
    try:
        a, b = compose(overrides_of(args.a)), compose(overrides_of(args.b))
    except SpecError as err:
        print(f"molt.diff: {err}", file=sys.stderr)
        return 2
    if args.unified:
        print(unified_diff(a, b, args.a, args.b), end="")
        return 0
    rows = key_diff(a, b)
    width = max((len(k) for k, _, _ in rows), default=0)
    for key, va, vb in rows:
        print(f"{key:<{width}}  {va!r} -> {vb!r}")
    print(f"{len(rows)} key(s) differ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
