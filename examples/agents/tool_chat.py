"""The tool task of tool_env.py through the `ChatAgent` path: the stock OpenAI SDK drives the turns.

The same tools (the row's `tools`, passed as the SDK's `tools=` with `tool_choice="auto"`; the loopback
server renders them through the chat template and parses the calls with agent.tool_parser), the same
calculator and python run in the sandbox (`ToolEnv.call_tools`: the same "error: ..." answers), the same
stop rule (the first reply without a call is the answer) and the same reward (`tool_env.score`). With the
same chat template, a rollout here is token for token the rollout tool_env.py samples from the same
random draws: docs/tool_use.md compares their learning curves.
"""

from pathlib import Path

import openai

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result, State
from molt.spec.user_modules import import_user_module

# The sibling tool_env.py, loaded by its path: putting examples/agents/ on sys.path would let its
# math_verify.py hide the installed math_verify package from every later import in the process.
tool_env = import_user_module(str(Path(__file__).with_name("tool_env.py")), "molt_example")
ToolEnv, score = tool_env.ToolEnv, tool_env.score


class ToolChatAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        env = ToolEnv(self.options)
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, http_client=ctx.http_client)
        messages, answer = list(ctx.messages), ""
        for turn in range(ctx.max_turns):
            reply = await client.chat.completions.create(model=ctx.model_name, messages=messages,
                                                         tools=ctx.tools, tool_choice="auto")
            message = reply.choices[0].message.model_dump(exclude_none=True)
            messages.append(message)
            if not message.get("tool_calls"):
                answer = message.get("content") or ""
                break
            if turn == ctx.max_turns - 1:   # out of turns: no server call would read the tools' output
                break
            # call_tools reads only the offered tools and the calls of the state
            state = State(observation="", action="", action_ids=[], finish_reason="stop", label=ctx.label,
                          turn=turn, messages=messages, sampling_params={}, item=ctx.item, tools=ctx.tools,
                          tool_calls=message["tool_calls"])
            messages += await env.call_tools(state)
        reward, info = score(answer, ctx.item, ctx.label)
        return Result(reward=reward, info=info)


AgentRunner = ChatAgentRunner(ToolChatAgent)
