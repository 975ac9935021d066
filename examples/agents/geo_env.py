"""Geometry diagrams (examples/data/make_geo.py): reward 1 when the answer's last number is the missing
angle exactly, else 0."""

import re

from molt.agents import Env, Result, State, StepEnvRunner

NUMBER = re.compile(r"\d+")


class GeoEnv(Env):
    async def step(self, state: State) -> Result:
        found = NUMBER.findall(state.action)
        correct = bool(found) and int(found[-1]) == int(state.label)
        return Result(reward=float(correct), info={"answered": float(bool(found))})


AgentRunner = StepEnvRunner(GeoEnv)
