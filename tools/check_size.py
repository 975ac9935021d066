"""The size prompt: a file past ~400 lines or a function past ~60 is read again for a second idea.

    python tools/check_size.py [ROOT ...]    # default: molt/ and tests/; exit status 1 if one is unreviewed

Size is a smell, not a rule: splitting one idea in two to get under a number makes code harder to read.
So a file or function over the limits either gets split along a second idea it holds, or is listed in
REVIEWED below with the reason it is one idea. Entries that are no longer over the limits are reported
too, so the list stays true. A function's length runs from `def` (decorators excluded) to its last line.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
REPO = Path(__file__).resolve().parents[1]

# path relative to the repository (a file) or "path::function": why it is one idea at its length.
REVIEWED: dict[str, str] = {
    "molt/trainer/worker.py": "one rank's collective calls (forward, update, molt.tinker's accumulate and "
                              "apply_gradients, refit, checkpoints); its second idea, the metric sums, "
                              "lives in step_metrics.py, the per-token record in token_record.py, the "
                              "layouts a forward uses in batch.py, packing.py and context_parallel.py",
    "molt/rollout/engine.py": "one engine actor (vLLM's engine on its own thread: generation, refit, sleep "
                              "and wake, adapters) and the two calls that place it; its sampling, routes and "
                              "arguments already live beside it (sampling.py, routes.py, engine_args.py)",
    "molt/trainer/model.py": "building a trainer rank's model and scoring tokens from its output (the "
                             "token_logprobs family, chunked or not): the second idea, to move to a "
                             "logprobs.py of its own",
    "tests/test_config.py": "the spec from composition to refusal, one short test per setting; its CLI "
                            "tests (dry run, multirun, print) are a second idea left for a tests/test_cli.py",
    "tests/test_docs.py": "every sentence kind the pages hold checked against the code, one checker each "
                          "(links, cited files and tests, sizes, embedded files, pasted outputs, code names)",
    "tests/test_trainer.py": "the trainer rank's numbers; its critic tests share a module fixture that a "
                             "second file would build again",
    "tests/test_agents_chat.py": "one subject, the loopback chat server over the OpenAI SDK, on one "
                                 "module-scoped server",
    "tests/test_agents_chat.py::test_bad_requests_get_4xx_and_leave_the_trajectory_unchanged":
        "a table of bad requests, one line each, and the one check they share",
    "tests/faults/test_server_faults.py::test_bad_requests_raise_readable_sdk_errors":
        "a table of bad requests, one line each, and the one check they share",
    "tests/faults/test_engine_faults.py::test_engines_come_back_refitted_and_groups_restart_whole":
        "one scenario told in order (kill, restart, refit, restart groups); its steps share every local",
    "tests/faults/test_engine_faults.py::scenario":
        "the same scenario's driver, read top to bottom beside the test that asserts on it",
    "tests/test_lora.py::test_loop_refits_the_adapter_and_the_engine_serves_the_merged_model":
        "one end-to-end check whose steps share the run's state",
}


def oversized(root: Path) -> list[tuple[str, str]]:
    """(key, what) for every file over MAX_FILE_LINES and function over MAX_FUNCTION_LINES under root."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.resolve().relative_to(REPO).as_posix() if path.resolve().is_relative_to(REPO) \
            else path.as_posix()
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            found.append((rel, f"{rel}:1: {lines} lines (over {MAX_FILE_LINES})"))
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append((f"{rel}::{node.name}", f"{rel}:{node.lineno}: {node.name} has {length} "
                                                         f"lines (over {MAX_FUNCTION_LINES})"))
    return found


def unreviewed(roots: list[Path]) -> tuple[list[str], list[str]]:
    """(oversized places not in REVIEWED, REVIEWED keys under these roots that are no longer oversized)."""
    found = [item for root in roots for item in oversized(root)]
    keys = {key for key, _ in found}
    rels = [r.resolve().relative_to(REPO).as_posix() for r in roots if r.resolve().is_relative_to(REPO)]
    stale = [key for key in REVIEWED if key not in keys
             and any(key == r or key.startswith(r.rstrip("/") + "/") for r in rels)]
    return [what for key, what in found if key not in REVIEWED], stale


def main() -> int:
    roots = [Path(a) for a in sys.argv[1:]] or [REPO / "molt", REPO / "tests"]
    new, stale = unreviewed(roots)
    for what in new:
        print(f"{what}: look for a second idea to split along, or list it in REVIEWED with the reason")
    for key in stale:
        print(f"{key}: listed in REVIEWED but no longer over the limits; remove the entry")
    if not new and not stale:
        print("every file and function over the limits is reviewed")
    return 1 if new or stale else 0


if __name__ == "__main__":
    sys.exit(main())
