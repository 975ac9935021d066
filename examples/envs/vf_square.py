"""A Prime Intellect `verifiers` environment, written the way verifiers environments are: a module whose
`load_environment()` returns a `vf.Environment`. Here a `vf.ToolEnv` with a `square` tool, scored by a
`vf.Rubric`: 1 when a tool result or a reply contains the answer. Its own dataset (squares of 0..19) is
what verifiers' tools evaluate; under Molt the rows come from Molt's data.

Molt trains it unmodified through examples/agents/verifiers_env.py (`agent=verifiers`).
"""

import verifiers as vf
from datasets import Dataset


def square(x: int) -> int:
    """The square of an integer."""
    return x * x


def answer_seen(completion, answer) -> float:
    """1.0 when any tool result or reply of the completion contains the answer."""
    texts = [m.get("content") if isinstance(m, dict) else getattr(m, "content", "") for m in completion]
    return float(bool(answer) and any(answer in str(t or "") for t in texts))


def load_environment(max_turns: int = 2) -> vf.Environment:
    tasks = [{"question": f"What is {x} squared?", "answer": str(x * x)} for x in range(20)]
    return vf.ToolEnv(dataset=Dataset.from_list(tasks), tools=[square], max_turns=max_turns,
                      rubric=vf.Rubric(funcs=[answer_seen]))
