"""Single-turn math graded by math-verify (Hugging Face's answer verifier): reward 1 when the response's final
answer (\\boxed{...} first, else the last LaTeX or plain expression) equals the label mathematically
(1/2 = 0.5 = \\frac{1}{2}, 2\\sqrt3 = 2\\sqrt{3}), not as a string. The label may be a bare answer, LaTeX or a
worked solution ending in \\boxed{...} (MATH's `solution`). Also `gsm8k_row`, a data transform for GSM8K.

math-verify bounds its parse with signal.alarm, which only the main thread may use (an agent's event loop
may run in another), so the grade runs in a worker thread under our own timeout instead; only the tail of a
long response is read (the final answer is at its end), which bounds the parse too.
"""

import asyncio

from math_verify import parse, verify

from molt.agents import Env, Result, State, StepEnvRunner

TIMEOUT_S = 10.0
TAIL_CHARS = 2000


def gold_of(label: object) -> list:
    """The label's parsed answer: as written (\\boxed, $...$), else the whole label read as LaTeX."""
    text = str(label)
    return parse(text, parsing_timeout=None) if "\\boxed" in text or "$" in text else \
        parse(f"${text}$", parsing_timeout=None)


def grade(response: str, label: object) -> tuple[bool, bool]:
    """(correct, answered) of one response against its label."""
    answer = parse(response[-TAIL_CHARS:], parsing_timeout=None)
    gold = gold_of(label)
    return bool(answer and gold and verify(gold, answer, timeout_seconds=None)), bool(answer)


class MathVerifyEnv(Env):
    async def step(self, state: State) -> Result:
        try:
            correct, answered = await asyncio.wait_for(asyncio.to_thread(grade, state.action, state.label),
                                                       TIMEOUT_S)
        except TimeoutError:
            return Result(reward=0.0, info={"answered": 1.0, "grade_timeout": 1.0})
        return Result(reward=float(correct), info={"answered": float(answered), "grade_timeout": 0.0})


def gsm8k_row(row: dict) -> dict:
    """A GSM8K row (question; answer = worked solution, then `#### <number>`) as a prompt and its number."""
    return {"prompt": row["question"], "label": row["answer"].rsplit("####", 1)[-1].strip().replace(",", "")}


AgentRunner = StepEnvRunner(MathVerifyEnv)
