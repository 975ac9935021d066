"""Multi-turn tool use (Env): the model may call a calculator or run Python, then answers.

A turn that contains a Hermes tool call `<tool_call>{"name": "calculator", "arguments":
{"expression": "..."}}</tool_call>` (or `"name": "python", "arguments": {"code": "..."}`) gets the
tool's output back as a tool message. A turn with `ANSWER: <number>` ends the episode, rewarded 1 when
the number equals the label. Anything else gets a short hint and another turn, until agent.max_turns.
The tools' schemas (`TOOLS`) are what a row's `tools` column carries for the chat template to render.
Each step's info holds the rollout's totals so far (`tool_calls`, `tool_errors`, `turns`, `answered`);
the last step's are logged as info/NAME. With `agent.options.tool_unavailable: true` every call is
answered "error: tool unavailable" (the control run that shows the tool does the work).

Both tools run in `molt.agents.sandbox` (no network, no view of the run or the home directory, limits,
killed after a timeout); the calculator evaluates only arithmetic (an AST whitelist). What goes wrong
inside a tool (an exception, a limit, the timeout, a blocked escape) is the model's doing and comes
back to it as `error: ...` in the tool message; the rollout goes on and is trained. A sandbox that
cannot start (`SandboxUnavailable`) is not the model's doing: it fails the rollout.
"""

import asyncio
import json
import re

from molt.agents import Env, Result, State, StepEnvRunner
from molt.agents.sandbox import run_python

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
ANSWER = re.compile(r"ANSWER:\s*(-?\d+(?:\.\d+)?)")

MAX_OUTPUT_CHARS = 2000   # of a tool's stdout shown to the model
UNAVAILABLE = "error: tool unavailable"

TOOLS = [
    {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic",
                                      "parameters": {"type": "object",
                                                     "properties": {"expression": {"type": "string"}},
                                                     "required": ["expression"]}}},
    {"type": "function", "function": {"name": "python", "description": "Run Python, return its stdout",
                                      "parameters": {"type": "object",
                                                     "properties": {"code": {"type": "string"}},
                                                     "required": ["code"]}}},
]

CALCULATOR = r"""
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


def run_tool(code: str, stdin: str = "", timeout_s: float = 2.0) -> str:
    """Run `code` in the sandbox: its stdout, or the error (last line of the traceback, or the timeout)."""
    done = run_python(code, stdin, timeout_s=timeout_s)
    if done.timed_out:
        return f"error: timed out after {timeout_s}s"
    if done.returncode:
        return "error: " + (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    return done.stdout.strip()[:MAX_OUTPUT_CHARS]


def calculator(expression: str, timeout_s: float = 2.0) -> str:
    return run_tool(CALCULATOR, expression, timeout_s)


def answer_text(value: str) -> str:
    """The final turn this Env rewards for `value` (what SFT traces write)."""
    return f"ANSWER: {value}"


class ToolEnv(Env):
    def __init__(self, options: dict | None = None) -> None:
        super().__init__(options)
        self.counts = {"tool_calls": 0.0, "tool_errors": 0.0}

    async def step(self, state: State) -> Result:
        # `<tool_call>` is a special token in many tokenizers, which `state.action` drops: read the ids.
        text = self.tokenizer.decode(state.action_ids, skip_special_tokens=False) \
            if self.tokenizer is not None and state.action_ids else state.action
        info = lambda answered: {**self.counts, "turns": float(state.turn + 1), "answered": answered}  # noqa: E731
        answer = ANSWER.search(text)
        if answer:
            return Result(reward=float(float(answer.group(1)) == float(state.label)), info=info(1.0))
        call = CALL.search(text)
        if call:
            output = await self.call(call.group(1))
            self.counts["tool_calls"] += 1
            self.counts["tool_errors"] += float(output.startswith("error:"))
            return Result(reward=0.0, observation={"role": "tool", "content": output}, terminated=False,
                          info=info(0.0))
        hint = "Call the calculator or reply with ANSWER: <number>."
        return Result(reward=0.0, observation=hint, terminated=False, info=info(0.0))

    async def call(self, request_text: str) -> str:
        """The tool message for one call: its output, or `error: ...`."""
        timeout = float(self.options.get("tool_timeout_s", 2.0))
        try:
            request = json.loads(request_text)
            name, args = request["name"], request["arguments"]
            if name == "calculator":
                code, stdin = CALCULATOR, str(args["expression"])
            elif name == "python":
                code, stdin = str(args["code"]), ""
            else:
                raise KeyError(f"unknown tool {name!r}; the tools are calculator and python")
        except (ValueError, KeyError, TypeError) as err:
            return f"error: malformed tool call ({err})"
        if self.options.get("tool_unavailable"):
            return UNAVAILABLE
        # a thread, so the subprocess does not block the other rollouts' event loop
        return await asyncio.to_thread(run_tool, code, stdin, timeout)


AgentRunner = StepEnvRunner(ToolEnv)
