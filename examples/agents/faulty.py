"""An Env that misbehaves on purpose, for the fault-tolerance tests and for trying `agent.on_failure`.

The dataset row's `fault` field picks the behaviour: `raise` (an exception), `hang` (never returns),
`nan` (a NaN reward), `text` (a non-numeric reward), `none` (no `Result`); anything else is a well-behaved
repeat task (reward 1 when the reply contains the label).
"""

import asyncio

from molt.agents import Env, Result, State, StepEnvRunner


class FaultyEnv(Env):
    async def step(self, state: State) -> Result:
        fault = state.item.get("fault")
        if fault == "raise":
            raise RuntimeError("the agent crashed")
        if fault == "hang":
            await asyncio.Event().wait()
        if fault == "nan":
            return Result(reward=float("nan"))
        if fault == "text":
            return Result(reward="high")
        if fault == "none":
            return None
        return Result(reward=float(str(state.label) in state.action))


AgentRunner = StepEnvRunner(FaultyEnv)
