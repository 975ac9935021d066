"""Size rules of the codebase: no file in molt/ over 400 lines, no function over 60.

    python tools/check_size.py [ROOT]    # prints every violation; exit status 1 if there is one

A function's length is its lines from `def` (decorators excluded) to its last line, docstring included.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def violations(root: Path) -> list[str]:
    """Every file over MAX_FILE_LINES and function over MAX_FUNCTION_LINES under `root`, as
    'path:line: what' lines."""
    out = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            out.append(f"{path}:1: {lines} lines (at most {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    out.append(f"{path}:{node.lineno}: {node.name} has {length} lines "
                               f"(at most {MAX_FUNCTION_LINES})")
    return out


def main() -> int:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "molt"
    found = violations(root)
    print("\n".join(found) or f"{root}: every file <= {MAX_FILE_LINES} lines, every function <= "
                                f"{MAX_FUNCTION_LINES}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
