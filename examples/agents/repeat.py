"""The default tiny task: repeat the prompt's letter.

The prompt is one letter; the reward is the fraction of the turn's token budget (rollout.max_tokens)
spent on that letter's token. A random-init tiny model learns it by RL alone within a few hundred steps
(the conditioning included), which makes it the smoke test of the whole loop.
"""

from molt.agents import Env, Result, State, StepEnvRunner


class RepeatEnv(Env):
    async def step(self, state: State) -> Result:
        letter = str(state.label)
        hits = sum(self.tokenizer.decode([t]) == letter for t in state.action_ids)
        # Divide by the budget, not by what was sampled: stopping early must not raise the reward.
        return Result(reward=hits / state.sampling_params["max_tokens"])


AgentRunner = StepEnvRunner(RepeatEnv)
