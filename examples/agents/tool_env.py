"""Multi-turn tool use (Env): the model may call a calculator or run Python, then answers.

The tools the prompt shows come from the row's `tools` (rows of `python -m molt.tasks.tool_use` carry
`molt.tasks.tool_use.TOOLS`) and agent.tools. Each turn, agent.tool_parser reads the calls the model
wrote; a turn with calls gets one tool message per call back (`Env.call_tools`: an unknown tool or bad
arguments is answered "error: ..."), and the first turn without a call is the answer, which ends the
episode. Its reward: a reasoning-gym row (`entry`, from molt.tasks.tool_use) is scored by the task's
own scorer on the text inside <answer>...</answer> (else the whole reply; an answer the scorer cannot read
scores 0, counted in info/unscorable); any other row by whether the answer's last number equals the label.

Both tools run in `molt.agents.sandbox` (no network, no view of the run or the home directory, limits,
killed after a timeout: options.tool_timeout_s, default 2 s); the calculator evaluates only arithmetic (an
AST whitelist). What goes wrong inside a tool (an exception, a limit, the timeout, a blocked escape) is
the model's doing and comes back to it as `error: ...` in the tool message; the rollout goes on and is
trained. A sandbox that cannot start (`SandboxUnavailable`) is not the model's doing: it fails the rollout.
With `agent.options.tool_unavailable: true` every call is answered "error: tool unavailable": the control
run of docs/tool_use.md, which shows that the tool does the work.
"""

import re

from molt.agents import Env, Result, State, StepEnvRunner
from molt.agents.sandbox import run_python

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
MAX_OUTPUT_CHARS = 2000   # of a tool's stdout shown to the model
UNAVAILABLE = "error: tool unavailable"

CALCULATOR = r"""
import ast, operator as op, sys
OPS = {ast.Add: op.add, ast.Sub: op.sub, ast.Mult: op.mul, ast.Div: op.truediv, ast.Mod: op.mod,
       ast.Pow: op.pow, ast.USub: op.neg, ast.UAdd: op.pos, ast.FloorDiv: op.floordiv}
def ev(n):
    if isinstance(n, ast.Constant) and type(n.value) in (int, float):
        return n.value
    if isinstance(n, ast.BinOp) and type(n.op) in OPS:
        return OPS[type(n.op)](ev(n.left), ev(n.right))
    if isinstance(n, ast.UnaryOp) and type(n.op) in OPS:
        return OPS[type(n.op)](ev(n.operand))
    raise ValueError("only numbers and + - * / // % ** are allowed")
print(ev(ast.parse(sys.stdin.read(), mode="eval").body))
"""


def run_tool(code: str, stdin: str = "", timeout_s: float = 2.0) -> str:
    """Run `code` in the sandbox: its stdout, or the error (last line of the traceback, or the timeout)."""
    done = run_python(code, stdin, timeout_s=timeout_s)
    if done.timed_out:
        return f"error: timed out after {timeout_s}s"
    if done.returncode:
        return "error: " + (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    return done.stdout.strip()[:MAX_OUTPUT_CHARS]


def calculator(expression: str, timeout_s: float = 2.0) -> str:
    return run_tool(CALCULATOR, str(expression), timeout_s)


def python(code: str, timeout_s: float = 2.0) -> str:
    return run_tool(str(code), "", timeout_s)


def answer_text(value: str) -> str:
    """The final reply this Env rewards for `value` (what SFT traces write): reasoning-gym's answer tags."""
    return f"<answer>{value}</answer>"


def score(answer: str, item: dict, label: object) -> tuple[float, dict[str, float]]:
    """The reward of the final reply `answer` to the row `item` (also tool_chat.py's, the ChatAgent path)
    and its info: `exact`, and for a reasoning-gym row `unscorable` (its scorer could not read the answer,
    which then scores 0: molt.tasks.reasoning_gym.score_answer)."""
    entry = item.get("entry")
    if isinstance(entry, dict) and "source_dataset" in entry.get("metadata", {}):
        from molt.tasks.reasoning_gym import score_answer

        reward, unscorable = score_answer(answer, entry)
        return reward, {"exact": float(reward == 1.0), "unscorable": float(unscorable)}
    numbers = NUMBER.findall(answer)
    reward = float(bool(numbers) and float(numbers[-1]) == float(label))
    return reward, {"exact": reward}


class ToolEnv(Env):
    def __init__(self, options: dict | None = None) -> None:
        super().__init__(options)
        timeout = float(self.options.get("tool_timeout_s", 2.0))
        # the model's call binds only the schema's parameters; the time limit stays the run's
        self.tools = {"calculator": lambda expression: calculator(expression, timeout),
                      "python": lambda code: python(code, timeout)}
        if self.options.get("tool_unavailable"):
            self.tools = {"calculator": lambda expression: UNAVAILABLE, "python": lambda code: UNAVAILABLE}

    async def step(self, state: State) -> Result:
        if state.tool_calls:
            return Result(reward=0.0, observation=await self.call_tools(state), terminated=False)
        reward, info = score(state.action, state.item, state.label)
        return Result(reward=reward, info=info)


AgentRunner = StepEnvRunner(ToolEnv)
