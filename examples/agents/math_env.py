"""Single-turn math: reward 1 when the last number of the answer equals the label."""

import re

from molt.agents import Env, Result, State, StepEnvRunner

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> float | None:
    found = NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


class MathEnv(Env):
    async def step(self, state: State) -> Result:
        answer = last_number(state.action)
        correct = answer is not None and answer == float(state.label)
        return Result(reward=float(correct), info={"answered": float(answer is not None)})


AgentRunner = StepEnvRunner(MathEnv)
