"""A chat agent whose tools are an MCP server's, with the server process inside the tool sandbox.

The agent lists the tools of `options.server` (a Python MCP server on stdio; default
examples/mcp/calc_server.py), offers them to the policy through the stock OpenAI SDK, runs every call
the model makes on the MCP server and sends the results back as tool messages, until a reply without a
call or agent.max_turns. `options.shared` (default false) starts one server for all rollouts instead of
one per rollout; `options.tool_choice` is sent on the first turn (e.g. a named function: a forced call,
constrained decoding, for evaluation only; a training rollout with it fails).
Reward 1 when a tool result or the final reply contains the label.
"""

import contextlib
import json
from pathlib import Path

import openai

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result
from molt.agents.mcp import MCPTools, sandboxed_server

DEFAULT_SERVER = Path(__file__).resolve().parents[1] / "mcp" / "calc_server.py"


class MCPAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        params = sandboxed_server(self.options.get("server", DEFAULT_SERVER))
        async with contextlib.AsyncExitStack() as stack:
            if self.options.get("shared"):
                tools = await MCPTools.shared(params)
            else:
                tools = await stack.enter_async_context(MCPTools(params))
            return await self.converse(ctx, tools)

    async def converse(self, ctx: ChatContext, tools: MCPTools) -> Result:
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0,
                                    http_client=ctx.http_client)
        messages, seen, calls = list(ctx.messages), [], 0
        choice = self.options.get("tool_choice", "auto")
        for _ in range(ctx.max_turns):
            reply = await client.chat.completions.create(model=ctx.model_name, messages=messages,
                                                         tools=tools.tools, tool_choice=choice)
            message = reply.choices[0].message.model_dump(exclude_none=True)
            messages.append(message)
            seen.append(message.get("content") or "")
            for call in message.get("tool_calls") or []:
                try:
                    arguments = json.loads(call["function"]["arguments"])
                    output = await tools.call(call["function"]["name"], arguments)
                except ValueError as err:   # arguments that are not JSON
                    output = f"error: {err}"
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
                seen.append(output)
                calls += 1
            if not message.get("tool_calls"):
                break
            choice = "auto"
        return Result(reward=float(any(str(ctx.label) in s for s in seen)), info={"tool_calls": float(calls)})


AgentRunner = ChatAgentRunner(MCPAgent)
