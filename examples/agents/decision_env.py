"""Three tool tasks where RL has to learn a decision, not a copy (docs/tool_use.md#decisions).

    python examples/agents/decision_env.py runs/data [--tasks choice,chain,recovery] [--train N] ...

writes runs/data/decision_TASK_{train,eval,eval_off}.jsonl per task and decision_sft{,_eval}.jsonl, the
SFT traces of all tasks. Every row holds the question, the tools it offers (`tools`), the task's name and
`world`: the seed of the row's own hidden tables, which the tools read and the model never sees, so no
answer can be memorised. Numbers are 10-99.

- choice: `price(item)` and `stock(item)`, two look-ups; "What does item 37 cost?" needs `price`, "How many
  of item 37 are left?" `stock`. Decision: which tool (info/right_tool).
- chain: `find(box)` gives the item in a box, `price(item)` its price; "What does the item in box 37
  cost?" needs find, then price on find's output. A correct first call earns options.first_call_reward
  (default 0.5) at that turn, for algo.turn_credit=turn to credit. Decision: make the second call
  (info/chained: a price call on find's real output).
- recovery: `price(item)` answers "error: busy, try again" on 60% of the calls (options.busy_rate, drawn
  per row and call number, so every sample of a prompt meets the same failures). Decision: call again
  after a failure (info/retried, over the rollouts that met one).

The reward is 1 for the right number in the final reply (`<answer>N</answer>`, tool_env.answer_text; the
first reply without a call ends the episode), info/correct the same, for every task. SFT traces teach the
format and leave the decision to chance (`trace_turns`): a choice trace calls a tool drawn uniformly, a
chain trace makes the second call in a third of the traces, a recovery trace whose first call meets a
failure (half of them) calls again in a third of those; each answers the real output of its last call,
right or wrong (a recovery trace that gives up: a number drawn at random). `eval_off` is the first 50 rows
of `eval` with `tool_unavailable: true`: the tool-off control (every call answered "error: tool
unavailable", as options.tool_unavailable does for all rows).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from molt.agents import Env, Result, State, StepEnvRunner
from molt.spec.user_modules import import_user_module

# The sibling tool_env.py, loaded by its path (see tool_chat.py): the answer format its score reads.
tool_env = import_user_module(str(Path(__file__).with_name("tool_env.py")), "molt_example")
answer_text, UNAVAILABLE = tool_env.answer_text, tool_env.UNAVAILABLE

BUSY = "error: busy, try again"


def schema(name: str, description: str, arg: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {arg: {"type": "integer"}}, "required": [arg]}}}


PRICE, STOCK, FIND = (schema("price", "Price of an item.", "item"), schema("stock", "Items left.", "item"),
                      schema("find", "Item in a box.", "box"))
TOOLS = {"choice": [PRICE, STOCK], "chain": [FIND, PRICE], "recovery": [PRICE]}


def value(world: int, table: str, key: int) -> int:
    """Entry `key` of the row's hidden table `table` (a number 10-99; a string seed hashes the same in
    every process)."""
    return random.Random(f"{world}/{table}/{key}").randint(10, 99)


def busy(world: int, call: int, rate: float) -> bool:
    """Whether the row's `call`-th call (0, 1, ...) to the recovery tool meets a busy server."""
    return random.Random(f"{world}/busy/{call}").random() < rate


def question(task: str, n: int, asks: str) -> str:
    if task == "chain":
        return f"What does the item in box {n} cost?"
    return f"What does item {n} cost?" if asks == "price" else f"How many of item {n} are left?"


def task_row(task: str, rng: random.Random) -> dict[str, Any]:
    """A fresh question of `task`: its world, its number and, for choice, the table it asks about."""
    world, n = rng.randrange(10**9), rng.randint(10, 99)
    asks = rng.choice(["price", "stock"]) if task == "choice" else "price"
    if task == "chain":
        label = value(world, "price", value(world, "find", n))
    else:
        label = value(world, asks, n)
    return {"messages": [{"role": "user", "content": question(task, n, asks)}], "label": str(label),
            "tools": TOOLS[task], "task": task, "world": world, "n": n, "asks": asks}


class DecisionEnv(Env):
    """One rollout of a decision task: the row's tools (bound to its world), its reward and decisions."""

    def __init__(self, options: dict | None = None) -> None:
        super().__init__(options)
        self.calls: list[tuple[str, dict, str]] = []   # (tool, arguments, output) of each call so far
        self.busy_calls = 0

    def bind(self, item: dict) -> None:
        world, rate = item["world"], float(self.options.get("busy_rate", 0.6))

        def look_up(table: str, key: Any) -> str:
            try:
                return str(value(world, table, int(key)))
            except (TypeError, ValueError):
                return f"error: {key!r} is not a number"

        def price(item: int) -> str:
            if item_task == "recovery":
                self.busy_calls += 1
                if busy(world, self.busy_calls - 1, rate):
                    return BUSY
            return look_up("price", item)

        item_task = item["task"]
        self.tools = {"price": price, "stock": lambda item: look_up("stock", item),
                      "find": lambda box: look_up("find", box)}
        if self.options.get("tool_unavailable") or item.get("tool_unavailable"):
            self.tools = {name: (lambda **_: UNAVAILABLE) for name in self.tools}

    async def step(self, state: State) -> Result:
        item = state.item
        if state.tool_calls:
            self.bind(item)
            first = not self.calls
            messages = await self.call_tools(state)
            for call, message in zip(state.tool_calls, messages, strict=True):
                try:
                    args = json.loads(call["function"].get("arguments") or "{}")
                except ValueError:
                    args = {}
                self.calls.append((call["function"]["name"], args if isinstance(args, dict) else {},
                                   message["content"]))
            reward = 0.0
            if item["task"] == "chain" and first and self.first_call_right(item):
                reward = float(self.options.get("first_call_reward", 0.5))
            return Result(reward=reward, observation=messages, terminated=False, info=self.decisions(item))
        numbers = tool_env.NUMBER.findall(state.action)
        correct = float(bool(numbers) and numbers[-1] == str(item["label"]))
        return Result(reward=correct, info={**self.decisions(item), "correct": correct})

    def first_call_right(self, item: dict) -> bool:
        name, args, _ = self.calls[0]
        return name == "find" and args.get("box") == item["n"]

    def decisions(self, item: dict) -> dict[str, float]:
        """The task's decision metric so far (info/*; a rollout that ends without an answer has correct 0)."""
        task, calls, out = item["task"], self.calls, {"correct": 0.0}
        if task == "choice":
            out["right_tool"] = float(bool(calls) and calls[0][0] == item["asks"])
        elif task == "chain":
            out["first_call"] = float(bool(calls) and self.first_call_right(item))
            found = {output for name, _, output in calls if name == "find"}
            out["chained"] = float(any(name == "price" and str(args.get("item")) in found
                                       for name, args, _ in calls))
        elif task == "recovery":
            failed = [i for i, (_, _, output) in enumerate(calls) if output == BUSY]
            if failed:
                out["retried"] = float(len(calls) > failed[0] + 1)
        return out


AgentRunner = StepEnvRunner(DecisionEnv)


# ---- the data: questions, and SFT traces that leave the decision to chance ----

RIGHT_SHARE = 1 / 3   # of chain traces that make the second call, of recovery traces that retry a failure


def trace_turns(row: dict[str, Any], rng: random.Random) -> tuple[list[tuple[str, dict, str]], str]:
    """The calls of an SFT trace of `row`, each with the tool's real output (DecisionEnv's tools on the row's
    world), and its answer; the decision drawn at random: a uniform tool (choice), the second call
    (chain) or a retry after a failure (recovery) in RIGHT_SHARE of the traces. The answer is the last
    output; a recovery trace that gives up after a failure answers a number drawn at random."""
    env = DecisionEnv({"busy_rate": 0.0})
    env.bind(row)
    task, n = row["task"], row["n"]
    run = lambda name, **args: (name, args, env.tools[name](**args))  # noqa: E731
    if task == "choice":
        calls = [run(rng.choice(["price", "stock"]), item=n)]
    elif task == "chain":
        calls = [run("find", box=n)]
        if rng.random() < RIGHT_SHARE:
            calls.append(run("price", item=int(calls[0][2])))
    else:
        calls = [run("price", item=n)]
        if rng.random() < 0.5:   # the first call meets a busy server
            calls[0] = ("price", {"item": n}, BUSY)
            if rng.random() >= RIGHT_SHARE:
                return calls, answer_text(str(rng.randint(10, 99)))
            calls.append(run("price", item=n))
    return calls, answer_text(calls[-1][2])


def sft_trace(row: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """`row` as an SFT conversation: one call a turn (examples/agents/tool_traces.py's writer)."""
    tool_traces = import_user_module(str(Path(__file__).with_name("tool_traces.py")), "molt_example")
    tool_conversation = tool_traces.tool_conversation

    calls, answer = trace_turns(row, rng)
    return tool_conversation(row, [([(name, args)], [output]) for name, args, output in calls], answer)


def write(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} rows to {path}")


def write_data(out: Path, tasks: list[str], sizes: dict[str, int], bare: float, seed: int = 0) -> None:
    """Per task, its RL prompts, held-out eval and tool-off control; one SFT set of all tasks' traces.
    Every row is a new world: an eval row's question text may recur in training (90 numbers), its answer
    cannot be known there. A `bare` share of the SFT traces lack the `tools` column (a context a third as
    long, where copying numbers is learnt sooner: docs/tool_use.md)."""
    rng = random.Random(f"decisions/{seed}")
    sft, sft_eval = [], []
    for task in tasks:
        rows = lambda count, task=task: [task_row(task, rng) for _ in range(count)]  # noqa: E731
        held_out = rows(sizes["eval"])
        write(out / f"decision_{task}_eval.jsonl", held_out)
        write(out / f"decision_{task}_eval_off.jsonl",
              [{**r, "tool_unavailable": True} for r in held_out[:sizes["eval_off"]]])
        write(out / f"decision_{task}_train.jsonl", rows(sizes["train"]))
        sft += [sft_trace(r, rng) for r in rows(sizes["sft"])]
        sft_eval += [sft_trace(r, rng) for r in rows(sizes["sft_eval"])]
    for row in sft:
        if rng.random() < bare:
            del row["tools"]
    rng.shuffle(sft)
    write(out / "decision_sft.jsonl", sft)
    write(out / "decision_sft_eval.jsonl", sft_eval)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python examples/agents/decision_env.py",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="output folder, e.g. examples/data")
    parser.add_argument("--tasks", default="choice,chain,recovery")
    parser.add_argument("--train", type=int, default=1000, help="RL prompts per task")
    parser.add_argument("--eval", type=int, default=100, help="held-out questions per task")
    parser.add_argument("--eval-off", type=int, default=50, help="of them, in the tool-off control")
    parser.add_argument("--sft", type=int, default=1000, help="SFT traces per task")
    parser.add_argument("--sft-eval", type=int, default=20, help="SFT eval traces per task")
    parser.add_argument("--bare", type=float, default=2 / 3, help="share of SFT traces without the tools")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = {"train": args.train, "eval": args.eval, "eval_off": args.eval_off, "sft": args.sft,
             "sft_eval": args.sft_eval}
    write_data(args.out, args.tasks.split(","), sizes, args.bare)


if __name__ == "__main__":
    main()
