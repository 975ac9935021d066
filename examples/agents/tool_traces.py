"""Data for learning to use a tool: SFT traces of tool use for any task, and reasoning-gym's products.

A trace of your own task: `tool_conversation(row, turns, answer)` appends to a row's question one assistant
message per turn with its calls (OpenAI `tool_calls`, arguments as a dict), one tool message per call with
the tool's real output, and the final answer; keep the row's `tools` (the schemas the template shows). For
example, with a look-up tool `price` that returned "52":

    {"messages": [{"role": "user", "content": "What does item 37 cost?"},
                  {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                   "function": {"name": "price", "arguments": {"item": 37}}}]},
                  {"role": "tool", "content": "52"},
                  {"role": "assistant", "content": "<answer>52</answer>"}],
     "tools": [{"type": "function", "function": {"name": "price", ...}}], ...the row's other columns}

`python -m molt.sft` renders it through the model's chat template (the calls in the template's own markup)
and trains every assistant turn; examples/agents/decision_env.py writes its traces this way.

The products data of docs/tool_use.md:

    python examples/agents/tool_traces.py examples/data/tool_products [--task products]
        [--config JSON] [--eval N] [--sft N] [--bare N] [--sft-eval N] [--train N]

writes PREFIX_eval.jsonl (held-out questions), PREFIX_sft.jsonl and PREFIX_sft_eval.jsonl (traces for
`python -m molt.sft`), PREFIX_train.jsonl (RL prompts); none of the last three holds an eval question.
Rows come from molt.tasks.reasoning_gym (the task's generator; `label` is its answer) with a `tools`
column: molt.tasks.tool_use' calculator schema (the flagship's), which the chat template renders into
the prompt in SFT and RL alike. A trace is the question, one calculator call on the task's own
expression, the tool message holding the calculator's REAL output from the sandbox (checked against the
task's answer), and the final turn tool_env.py rewards (`answer_text`). The template renders the call in
its own tool-call markup.
`--bare N` adds N more traces to PREFIX_sft.jsonl without the `tools` column: the same turns in a context
about a third as long. A random-init model first has to learn to copy digits, and it learns that sooner
where its attention is spread over fewer tokens; the text between the question and the call is the
same with or without the tools block, so the copying carries over to the prompts that have it.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from molt.spec.user_modules import import_user_module
from molt.tasks.reasoning_gym import task_rows
from molt.tasks.tool_use import CALCULATOR as CALCULATOR_TOOL

# The sibling tool_env.py, loaded by its path: putting examples/agents/ on sys.path would let its
# math_verify.py hide the installed math_verify package from every later import in the process.
_tool_env = import_user_module(str(Path(__file__).with_name("tool_env.py")), "molt_example")
answer_text, calculator = _tool_env.answer_text, _tool_env.calculator

CALCULATOR = [CALCULATOR_TOOL]
PRODUCTS = {"min_digits": 3, "max_digits": 3, "min_terms": 2, "max_terms": 2}


def tool_conversation(row: dict[str, Any], turns: list[tuple[list[tuple[str, dict]], list[str]]],
                      answer: str) -> dict[str, Any]:
    """`row` (its `messages` end with the question) with a conversation of tool use appended, as an SFT
    trace: for each turn, one assistant message making its calls [(tool name, arguments)] (OpenAI
    `tool_calls`; the chat template renders them in its own markup) and one tool message per call holding
    that call's output (the tool's real output: run the tool to get it); then the final assistant message
    `answer`. Rows of any task take this shape; `python -m molt.sft` trains on every assistant turn."""
    messages = list(row["messages"])
    for calls, outputs in turns:
        if len(calls) != len(outputs):
            raise ValueError(f"{len(calls)} calls but {len(outputs)} outputs in a turn")
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": args}} for name, args in calls]})
        messages += [{"role": "tool", "content": output} for output in outputs]
    return {**row, "messages": messages + [{"role": "assistant", "content": answer}]}


def trace(row: dict[str, Any], timeout_s: float = 30.0) -> dict[str, Any]:
    """`row` with the conversation of a correct tool use; the tool's output is the sandbox's."""
    expression = row["entry"]["metadata"]["expression"]
    output = calculator(expression, timeout_s=timeout_s)
    if output != row["label"]:
        raise RuntimeError(f"the sandboxed calculator gave {output!r} for {expression!r}, the task says "
                           f"{row['label']!r}")
    return tool_conversation(row, [([("calculator", {"expression": expression})], [output])],
                             answer_text(output))


def write(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} rows to {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python examples/agents/tool_traces.py",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("prefix", help="output prefix, e.g. examples/data/tool_products")
    parser.add_argument("--task", default="products", help="a reasoning-gym task with metadata.expression")
    parser.add_argument("--config", type=json.loads, default=PRODUCTS, help="task options (JSON)")
    parser.add_argument("--eval", type=int, default=100)
    parser.add_argument("--sft", type=int, default=100)
    parser.add_argument("--bare", type=int, default=500, help="extra SFT traces without the tools column")
    parser.add_argument("--sft-eval", type=int, default=50)
    parser.add_argument("--train", type=int, default=1000)
    args = parser.parse_args(argv)
    with_tools = lambda rows: [{**row, "tools": CALCULATOR} for row in rows]  # noqa: E731
    # reasoning-gym seeds entry i with seed + i: sets a million seeds apart share no entry
    held_out = with_tools(task_rows(args.task, args.eval, 1, args.config, unique=True))
    exclude = {row["entry"]["question"] for row in held_out}
    sft, sft_eval = (with_tools(task_rows(args.task, n, seed, args.config, exclude=exclude))
                     for n, seed in ((args.sft, 10**6), (args.sft_eval, 2 * 10**6)))
    bare = task_rows(args.task, args.bare, 4 * 10**6, args.config, exclude=exclude)
    with ThreadPoolExecutor(4) as pool:   # each call starts a sandbox; a few at a time
        sft, sft_eval = list(pool.map(trace, sft + bare)), list(pool.map(trace, sft_eval))
    prefix = Path(args.prefix)
    write(prefix.with_name(prefix.name + "_eval.jsonl"), held_out)
    write(prefix.with_name(prefix.name + "_sft.jsonl"), sft)
    write(prefix.with_name(prefix.name + "_sft_eval.jsonl"), sft_eval)
    write(prefix.with_name(prefix.name + "_train.jsonl"),
          with_tools(task_rows(args.task, args.train, 3 * 10**6, args.config, exclude=exclude)))


if __name__ == "__main__":
    main()
