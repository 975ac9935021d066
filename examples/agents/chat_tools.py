"""Function calling through the stock OpenAI SDK, over several turns.

The agent offers an `add` tool, runs every call the model makes, sends the results back as tool
messages and stops at the first reply without a call (or at agent.max_turns). Reward 1 when the final
reply contains the label. `options.tool_choice` is sent on the first turn (e.g. a named function, which
the server honours by constrained decoding: how a small or untrained policy is made to call a tool, in
evaluation only — a training rollout with a forced call fails); `options.stream` switches to streamed
responses.
"""

import json

import openai

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result

ADD = {"type": "function", "function": {
    "name": "add", "description": "a+b",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


def add(a: int, b: int) -> str:
    return str(int(a) + int(b))


class ToolsAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, http_client=ctx.http_client)
        messages, calls_made, text = list(ctx.messages), 0, ""
        choice = self.options.get("tool_choice", "auto")
        stream = bool(self.options.get("stream", False))
        for _ in range(ctx.max_turns):
            reply = await client.chat.completions.create(model=ctx.model_name, messages=messages, tools=[ADD],
                                                         tool_choice=choice, stream=stream,
                                                         seed=self.options.get("seed"))
            if stream:
                message = await _collect(reply)
            else:
                message = reply.choices[0].message.model_dump(exclude_none=True)
            messages.append(message)
            text = message.get("content") or ""
            if not message.get("tool_calls"):
                break
            for call in message["tool_calls"]:
                try:
                    output = add(**json.loads(call["function"]["arguments"]))
                except (TypeError, ValueError) as err:
                    output = f"error: {err}"
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
                calls_made += 1
            choice = "auto"
        return Result(reward=float(str(ctx.label) in text), info={"tool_calls": float(calls_made)})


async def _collect(stream) -> dict:
    """Merge streamed deltas into one assistant message, as the SDK's non-streamed response has it."""
    content, calls = "", {}
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": "", "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
                call["id"] += d.id or ""
                call["function"]["name"] += d.function.name or ""
                call["function"]["arguments"] += d.function.arguments or ""
    message = {"role": "assistant", "content": content}
    return {**message, "tool_calls": [calls[i] for i in sorted(calls)]} if calls else message


AgentRunner = ChatAgentRunner(ToolsAgent)
