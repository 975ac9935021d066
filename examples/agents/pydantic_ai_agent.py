"""A pydantic-ai agent with a structured output, unmodified, over agent.max_turns conversation turns.

The agent's output type is `Answer`; pydantic-ai asks for it as a tool call (its default "tool output"
mode, sent with `tool_choice="required"`), which the loopback server honours by constrained decoding,
so even a random-init policy returns a valid `Answer`. Constrained decoding is for evaluation: every
training rollout of this agent fails (molt.rollout.sampling.check_trainable), so use it with
python -m molt.eval. Each further turn (agent.max_turns > 1) continues the conversation with
pydantic-ai's own message history. Reward 1 when the last answer equals the label.
Needs `pip install molt[agents]`.
"""

from pydantic import BaseModel
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result


class Answer(BaseModel):
    value: int


class PydanticAIAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        provider = OpenAIProvider(base_url=ctx.base_url, api_key=ctx.api_key, http_client=ctx.http_client)
        agent = Agent(OpenAIChatModel(ctx.model_name, provider=provider), output_type=Answer, retries=0)
        result = await agent.run(ctx.messages[-1]["content"])
        for _ in range(ctx.max_turns - 1):
            result = await agent.run("Again?", message_history=result.all_messages())
        return Result(reward=float(str(result.output.value) == str(ctx.label)))


AgentRunner = ChatAgentRunner(PydanticAIAgent)
