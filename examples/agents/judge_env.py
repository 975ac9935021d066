"""An LLM-as-judge reward (Env): a second model grades each answer of the policy.

The reward is the judge's probability that the answer is correct — its probability of "yes" against "no"
after a grading prompt (molt.agents.judge): continuous, and never parsed from the judge's text. The judge
is agent.judge (e.g. `agent.judge.path=/models/judge`, or `policy` for a frozen copy of the starting
policy, as in conf/agent/judge.yaml); it has its own engine and is never trained.
"""

from molt.agents import Env, Result, State, StepEnvRunner

GRADER = "You grade answers to questions. Reply with yes or no."


class JudgedEnv(Env):
    async def step(self, state: State) -> Result:
        if self.judge is None:
            raise RuntimeError("judge_env needs an LLM judge: set agent.judge.path (a model, or policy)")
        question = state.messages[-2]["content"]
        verdict = [{"role": "system", "content": GRADER},
                   {"role": "user", "content": f"Question: {question}\nReference answer: {state.label}\n"
                                               f"Answer: {state.action}\nIs the answer correct?"}]
        return Result(reward=await self.judge.p_yes(verdict))


AgentRunner = StepEnvRunner(JudgedEnv)
