"""The decision tasks of decision_env.py through the `ChatAgent` path: the stock OpenAI SDK drives the turns.

Each turn sends the conversation with the row's tools (`tools=`, `tool_choice="auto"`) to the loopback
server, which renders them through the chat template and parses the calls with agent.tool_parser; the
reply goes to the same `DecisionEnv.step` the Env path calls (the same tools on the row's hidden tables,
the same reward and info), whose tool messages are the next request's tail. Out of turns, the last calls
are not run (no request would carry their output), as in tool_chat.py. Each step's reward goes to the
reply it judged (`ctx.reward_turn`: the chain's right first call earns its 0.5 at its own turn, for
algo.turn_credit=turn); the rollout's reward is their sum.
"""

from pathlib import Path

import openai

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result, State
from molt.spec.user_modules import import_user_module

# The sibling decision_env.py, loaded by its path (see tool_chat.py).
decision_env = import_user_module(str(Path(__file__).with_name("decision_env.py")), "molt_example")


class DecisionChatAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        env = decision_env.DecisionEnv(self.options)
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, http_client=ctx.http_client)
        messages, info = list(ctx.messages), {}
        for turn in range(ctx.max_turns):
            reply = await client.chat.completions.create(model=ctx.model_name, messages=messages,
                                                         tools=ctx.tools, tool_choice="auto")
            message = reply.choices[0].message.model_dump(exclude_none=True)
            messages.append(message)
            calls = message.get("tool_calls") or []
            if calls and turn == ctx.max_turns - 1:   # out of turns: no server call would read the output
                break
            state = State(observation="", action=message.get("content") or "", action_ids=[],
                          finish_reason=reply.choices[0].finish_reason, label=ctx.label, turn=turn,
                          messages=list(messages), sampling_params=ctx.sampling_params, item=ctx.item,
                          tools=ctx.tools, tool_calls=calls)
            result = await env.step(state)
            ctx.reward_turn(result.reward)
            info = result.info
            if result.terminated or result.observation is None:
                break
            messages += result.observation
        return Result(reward=0.0, info=info)   # every reply's reward is in ctx.turn_rewards


AgentRunner = ChatAgentRunner(DecisionChatAgent)
