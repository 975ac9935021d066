"""Multi-turn tool use (Env): the model may call a calculator, then answers.

A turn that contains a Hermes tool call `<tool_call>{"name": "calculator", "arguments":
{"expression": "..."}}</tool_call>` gets the calculator's output back as a tool message. A turn with
`ANSWER: <number>` ends the episode, rewarded 1 when the number equals the label. Anything else gets a
short hint and another turn, until agent.max_turns. The calculator runs in `molt.agents.sandbox` (a
separate Python process with time, memory and file limits, unprivileged when run as root), evaluates
only arithmetic (an AST whitelist) and is killed after a timeout.
"""

import asyncio
import json
import re

from molt.agents import Env, Result, State, StepEnvRunner
from molt.agents.sandbox import run_python

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
ANSWER = re.compile(r"ANSWER:\s*(-?\d+(?:\.\d+)?)")

SANDBOX = r"""
import ast, operator as op, sys
OPS = {ast.Add: op.add, ast.Sub: op.sub, ast.Mult: op.mul, ast.Div: op.truediv, ast.Mod: op.mod,
       ast.Pow: op.pow, ast.USub: op.neg, ast.UAdd: op.pos}
def ev(n):
    if isinstance(n, ast.Constant) and type(n.value) in (int, float):
        return n.value
    if isinstance(n, ast.BinOp) and type(n.op) in OPS:
        return OPS[type(n.op)](ev(n.left), ev(n.right))
    if isinstance(n, ast.UnaryOp) and type(n.op) in OPS:
        return OPS[type(n.op)](ev(n.operand))
    raise ValueError("only numbers and + - * / % ** are allowed")
print(ev(ast.parse(sys.stdin.read(), mode="eval").body))
"""


def calculator(expression: str, timeout_s: float = 2.0) -> str:
    """Evaluate `expression` in a sandboxed subprocess; errors and timeouts come back as text."""
    done = run_python(SANDBOX, expression, timeout_s=timeout_s)
    if done.timed_out:
        return f"error: timed out after {timeout_s}s"
    if done.returncode:
        return "error: " + (done.stderr.strip().splitlines() or ["failed"])[-1]
    return done.stdout.strip()


class ToolEnv(Env):
    async def step(self, state: State) -> Result:
        answer = ANSWER.search(state.action)
        if answer:
            return Result(reward=float(float(answer.group(1)) == float(state.label)))
        call = CALL.search(state.action)
        if call:
            try:
                expression = str(json.loads(call.group(1))["arguments"]["expression"])
            except (ValueError, KeyError, TypeError) as err:
                output = f"error: malformed tool call ({err})"
            else:
                timeout = float(self.options.get("tool_timeout_s", 2.0))
                # a thread, so the subprocess does not block the other rollouts' event loop
                output = await asyncio.to_thread(calculator, expression, timeout)
            return Result(reward=0.0, observation={"role": "tool", "content": output}, terminated=False,
                          info={"tool_calls": 1.0})
        hint = "Call the calculator or reply with ANSWER: <number>."
        return Result(reward=0.0, observation=hint, terminated=False)


AgentRunner = StepEnvRunner(ToolEnv)
