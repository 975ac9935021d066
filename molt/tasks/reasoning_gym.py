"""Any reasoning-gym task as a Molt agent: the library generates the prompts and scores the answers, offline.

Needs the optional extra: `pip install molt[tasks]`. Rows come from

    python -m molt.tasks.reasoning_gym TASK OUT.jsonl [--size N] [--seed S] [--config JSON] [--sft]
                                            [--unique] [--exclude FILE ...]

one per task entry: {"messages": [{"role": "user", "content": question}], "label": answer, "entry": the
entry}. `--config` passes the task's own options (e.g. '{"max_digits": 1}'); `--sft` adds the reference
answer as the assistant turn, a conversation for `python -m molt.sft`; `--unique` keeps one row per
question; `--exclude` drops the questions of other such files (a held-out eval set). With `agent.module:
molt.tasks.reasoning_gym` the reward is the task's own `score_answer` on the model's answer: the text
inside <answer>...</answer> when the response has one (reasoning-gym's convention), else the whole
response, stripped. `info/exact` is the fraction of answers scored exactly 1. A scorer that raises on an
answer it cannot read (prime_factorization's `int()` on text) scores it 0, as the wrong answer it is, and
`info/unscorable` counts such answers: a failed rollout is kept for the agent's own code breaking.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from molt.agents import Env, Result, State, StepEnvRunner


def answer_of(response: str) -> str:
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(response) if "<answer>" in response else None
    return (tagged if tagged is not None else response).strip()


def score_answer(response: str, entry: dict[str, Any]) -> tuple[float, bool]:
    """The task's own score of the model's `response` for `entry`, and whether the scorer could not read
    it. Scorers parse the answer themselves and some raise on text they cannot parse (a ValueError from
    `int()`, an IndexError, ...): such an answer is wrong, 0, and the rollout goes on to train on it."""
    import reasoning_gym

    scorer = reasoning_gym.get_score_answer_fn(entry["metadata"]["source_dataset"])
    try:
        return float(scorer(answer_of(response), entry)), False
    except Exception:   # the task's code on the model's text: whatever it raises means unreadable
        return 0.0, True


class ReasoningGymEnv(Env):
    async def step(self, state: State) -> Result:
        entry = state.item.get("entry")
        if not isinstance(entry, dict) or "source_dataset" not in entry.get("metadata", {}):
            raise ValueError("the row has no reasoning-gym 'entry' with metadata.source_dataset; write rows "
                             "with python -m molt.tasks.reasoning_gym")
        score, unscorable = score_answer(state.action, entry)
        return Result(reward=score, info={"exact": float(score == 1.0), "unscorable": float(unscorable)})


AgentRunner = StepEnvRunner(ReasoningGymEnv)


def task_rows(task: str, size: int, seed: int, config: dict[str, Any], sft: bool = False,
              unique: bool = False, exclude: set[str] = frozenset()) -> list[dict[str, Any]]:
    """The rows of `size` entries of `task` generated with `seed` (see the module doc), less the
    questions in `exclude` and, with `unique`, repeated questions."""
    import reasoning_gym

    rows, seen = [], set(exclude)
    for entry in reasoning_gym.create_dataset(task, size=size, seed=seed, **config):
        if entry["question"] in seen:
            continue
        if unique:
            seen.add(entry["question"])
        entry = json.loads(json.dumps(entry))   # as it will be read back (tuples become lists)
        messages = [{"role": "user", "content": entry["question"]}]
        if sft:
            messages.append({"role": "assistant", "content": entry["answer"]})
        rows.append({"messages": messages, "label": entry["answer"], "entry": entry})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m molt.tasks.reasoning_gym",
                                     description="Write a reasoning-gym task as a Molt JSONL dataset.")
    parser.add_argument("task", help="reasoning-gym task name, e.g. basic_arithmetic")
    parser.add_argument("out", type=Path, help="output .jsonl")
    parser.add_argument("--size", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", type=json.loads, default={}, help="task options as a JSON object")
    parser.add_argument("--sft", action="store_true", help="add the reference answer as the assistant turn")
    parser.add_argument("--unique", action="store_true", help="one row per question")
    parser.add_argument("--exclude", type=Path, nargs="*", default=[], help="drop these files' questions")
    args = parser.parse_args(argv)
    held_out = {json.loads(line)["entry"]["question"] for path in args.exclude
                for line in path.read_text().splitlines() if line.strip()}
    rows = task_rows(args.task, args.size, args.seed, args.config, args.sft, args.unique, held_out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} rows of {args.task} to {args.out}")


if __name__ == "__main__":
    main()
