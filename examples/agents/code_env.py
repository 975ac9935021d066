"""A code-execution agent (Env): the model writes Python, the sandbox runs it, the output comes back.

Each turn, the first fenced block (```python ... ```) of the model's reply runs in `molt.agents.sandbox`
(no network, private /tmp, limits, killed after `options.timeout_s`, default 2 s); its stdout — or the
error's last line, or the timeout — comes back as the next user turn (```output ... ```), tokens with
loss mask 0. A reply with `ANSWER: <number>` ends the episode: reward 1 when the number equals the label.
Anything else gets a hint and another turn, until agent.max_turns.

`options.constrain: true` constrains the turn after a hint to a code block that prints arithmetic and
the turn after an output to an answer (a regex, decoded by the engine): how a random-init policy is made
to produce runnable code and an answer. Constrained decoding is for evaluation (python -m molt.eval): in
training, the first constrained turn fails its rollout (molt.rollout.sampling.check_trainable).
"""

import asyncio
import re

from molt.agents import Env, Result, State, StepEnvRunner
from molt.agents.sandbox import run_python

CODE = re.compile(r"```python\n(.*?)```", re.DOTALL)
ANSWER = re.compile(r"ANSWER:\s*(-?\d+(?:\.\d+)?)")
HINT = "Write Python in a ```python block to compute it, or reply with ANSWER: <number>."
MAX_OUTPUT_CHARS = 1000   # of the program's output shown to the model

# Integer literals without leading zeros: Python rejects `088`, and the program must run.
CONSTRAINED_CODE = r"```python\nprint\((0|[1-9][0-9]{0,2})( [+*-] (0|[1-9][0-9]{0,2})){0,2}\)\n```"
CONSTRAINED_ANSWER = r"ANSWER: -?[0-9]{1,6}"


def execute(code: str, timeout_s: float) -> str:
    """What the model sees of running `code`: stdout, or `error: <last line of stderr>`, or the timeout."""
    done = run_python(code, timeout_s=timeout_s)
    if done.timed_out:
        return f"error: timed out after {timeout_s:g}s"
    if done.returncode:
        return "error: " + (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    return done.stdout.strip()[:MAX_OUTPUT_CHARS]


class CodeEnv(Env):
    def __init__(self, options: dict | None = None) -> None:
        super().__init__(options)
        self.runs = 0

    async def step(self, state: State) -> Result:
        answer = ANSWER.search(state.action)
        if answer:
            return Result(reward=float(float(answer.group(1)) == float(state.label)),
                          info={"code_runs": float(self.runs)})
        block = CODE.search(state.action)
        if block is None:
            return self.next_turn(HINT, CONSTRAINED_CODE)
        # a thread, so the sandboxed process does not block the other rollouts' event loop
        output = await asyncio.to_thread(execute, block.group(1), float(self.options.get("timeout_s", 2.0)))
        self.runs += 1
        return self.next_turn(f"```output\n{output}\n```", CONSTRAINED_ANSWER)

    def next_turn(self, text: str, regex: str) -> Result:
        constrain = {"structured_outputs": {"regex": regex}} if self.options.get("constrain") else None
        return Result(reward=0.0, observation=text, terminated=False, sampling_params=constrain,
                      info={"code_runs": float(self.runs)})


AgentRunner = StepEnvRunner(CodeEnv)
