"""Tasks a model gains from tools on: reasoning-gym questions with the tool schemas in every row.

    python -m molt.tasks.tool_use OUT_DIR [--mix flagship|tiny] [--train N] [--eval M] [--seed S]

writes OUT_DIR/tool_MIX_train.jsonl and OUT_DIR/tool_MIX_eval.jsonl (the eval questions are held out
of the training rows; metrics eval/tool_MIX_eval/...). A row is a row of molt.tasks.reasoning_gym
({"messages", "label", "entry"}) plus `tools`, the schemas of the mix's tools, which the Env path renders
through the chat template. The agent that runs them is examples/agents/tool_env.py (the calculator and
Python tools in the sandbox; the answer scored by the task's own scorer). Needs `pip install molt[tasks]`.

Mixes (`MIXES`): `flagship`, sizes where mental arithmetic fails even a large model: products of three
4-6 digit numbers, countdown (reach a 3-digit target from 4-6 numbers), prime factorization of 7-9 digit
numbers, with the calculator and Python; `tiny`, products of two 3-4 digit numbers with the calculator
only, small enough for the tiny CPU model to learn to copy operands into a call and its result out.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from molt.tasks.reasoning_gym import task_rows

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (+ - * / // % ** and brackets).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}
PYTHON = {"type": "function", "function": {
    "name": "python", "description": "Run Python code; returns what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}

SYSTEM = ("Use the tools when they help. When you know the answer, reply with it inside <answer></answer> "
          "and nothing else.")

# name -> system prompt (None: none), tools, [(reasoning-gym task, its options, share of the rows)]
MIXES: dict[str, dict[str, Any]] = {
    "flagship": {"system": SYSTEM, "tools": [CALCULATOR, PYTHON], "tasks": [
        ("products", {"min_terms": 3, "max_terms": 3, "min_digits": 4, "max_digits": 6}, 1 / 3),
        ("countdown", {}, 1 / 3),
        ("prime_factorization", {"min_value": 1_000_000, "max_value": 999_999_999}, 1 / 3)]},
    "tiny": {"system": None, "tools": [CALCULATOR], "tasks": [
        ("products", {"min_terms": 2, "max_terms": 2, "min_digits": 3, "max_digits": 4}, 1.0)]},
}


def mix_rows(mix: str, size: int, seed: int, exclude: set[str] = frozenset()) -> list[dict[str, Any]]:
    """About `size` distinct questions of `mix` (each task's share, at least one), less `exclude`,
    shuffled."""
    spec, rows = MIXES[mix], []
    for i, (task, config, share) in enumerate(spec["tasks"]):
        rows += task_rows(task, max(1, round(size * share)), seed * 1000 + i, config, unique=True,
                          exclude=exclude)
    system = [{"role": "system", "content": spec["system"]}] if spec["system"] else []
    for row in rows:
        row["messages"] = system + row["messages"]
        row["tools"] = spec["tools"]
    random.Random(seed).shuffle(rows)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m molt.tasks.tool_use",
                                     description="Write a tool-use task mix as Molt JSONL datasets.")
    parser.add_argument("out", type=Path, help="output folder")
    parser.add_argument("--mix", choices=sorted(MIXES), default="flagship")
    parser.add_argument("--train", type=int, default=20000, help="training rows")
    parser.add_argument("--eval", type=int, default=500, help="held-out eval rows")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    held_out = mix_rows(args.mix, args.eval, 2 * args.seed + 1)
    train = mix_rows(args.mix, args.train, 2 * args.seed, {r["entry"]["question"] for r in held_out})
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in ((f"tool_{args.mix}_train", train), (f"tool_{args.mix}_eval", held_out)):
        (args.out / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(f"wrote {len(rows)} rows of the {args.mix} mix to {args.out / name}.jsonl")


if __name__ == "__main__":
    main()
