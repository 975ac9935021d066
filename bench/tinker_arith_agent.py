"""The tinker-cookbook's `arithmetic` task (recipes/math_rl, ArithmeticEnv) as a Molt Env, so that
`python -m molt` runs the task the cookbook's recipe runs through `python -m molt.tinker serve`
(bench/tinker_vs_loop.py). The prompt rows carry the cookbook's few-shot conversation; the reward is the
cookbook's: 1 if the reply's last integer is X + Y, minus 0.1 unless the reply ended on the stop token.
"""

import re

from molt.agents import Env, Result, State, StepEnvRunner

INTEGER = re.compile(r"-?\d+")
# the cookbook's ArithmeticEnv.standard_fewshot_prefix: prompt rows start with it (bench/tinker_vs_loop.py)
FEW_SHOT = [{"role": "user", "content": "What is 4 + 5?"}, {"role": "assistant", "content": "9"}]


class ArithmeticEnv(Env):
    async def step(self, state: State) -> Result:
        found = INTEGER.findall(state.action.replace(",", ""))
        correct = float(bool(found) and int(found[-1]) == int(state.label))
        well_formed = float(state.finish_reason == "stop")
        return Result(reward=0.1 * (well_formed - 1) + correct)


AgentRunner = StepEnvRunner(ArithmeticEnv)
