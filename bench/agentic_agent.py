"""The chat agent `bench/agentic.py --workers N` runs in agent workers: `options.turns` calls through the
stock OpenAI SDK on the lent `http_client`, each call's seconds returned in `Result.info` (`turn_s_<k>`),
since the agent runs in another process than the bench. With `options.tools` it offers an `add` tool and
answers each tool call the reply makes with the tool's result (the stand-in engine then replies with a
call every turn), as a tool agent's turns go: a call parsed by the server, a tool message rendered."""

import json
import time

import openai

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "a + b",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'   # what the engine says


class TimedTurns(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0,
                                    http_client=ctx.http_client)
        tools = {"tools": TOOLS} if self.options.get("tools") else {}
        messages, info = list(ctx.messages), {}
        for k in range(int(self.options["turns"])):
            t0 = time.perf_counter()
            reply = await client.chat.completions.create(model=ctx.model_name, messages=messages, **tools)
            info[f"turn_s_{k}"] = time.perf_counter() - t0
            message = reply.choices[0].message
            calls = [{"id": c.id, "type": "function",
                      "function": {"name": c.function.name, "arguments": c.function.arguments}}
                     for c in message.tool_calls or []]
            messages.append({"role": "assistant", "content": message.content or "",
                             **({"tool_calls": calls} if calls else {})})
            for call in calls:
                args = json.loads(call["function"]["arguments"])
                messages.append({"role": "tool", "tool_call_id": call["id"],
                                 "content": str(args["a"] + args["b"])})
            if not calls:
                messages.append({"role": "user", "content": "again"})
        return Result(reward=0.0, info=info)


AgentRunner = ChatAgentRunner(TimedTurns)
