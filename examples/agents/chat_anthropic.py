"""A chat agent through the stock Anthropic SDK (`/v1/messages`), with optional tool use.

Without tools it is the minimal agent (reward: the fraction of the reply's characters equal to the
label). With `options.tools` it offers the `add` tool, answers every `tool_use` block with a
`tool_result` and stops at the first reply without one (reward 1 when it contains the label);
`options.tool_choice` is sent on the first turn (a forced call, `{"type": "tool"}` / `{"type": "any"}`, is
constrained decoding: evaluation only, a training rollout with it fails), `options.stream` streams.
"""

import anthropic

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result

ADD = {"name": "add", "description": "a+b",
       "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                        "required": ["a", "b"]}}


class AnthropicAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = anthropic.AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key,
                                          http_client=ctx.http_client)
        system = "\n".join(m["content"] for m in ctx.messages if m["role"] == "system")
        messages = [m for m in ctx.messages if m["role"] != "system"]
        tools = [ADD] if self.options.get("tools") else []
        extra = {"system": system} if system else {}
        choice, calls_made = self.options.get("tool_choice"), 0
        for _ in range(int(self.options.get("turns", ctx.max_turns))):
            if tools:
                extra.update(tools=tools, tool_choice=choice or {"type": "auto"})
            kwargs = dict(model=ctx.model_name, messages=messages,
                          max_tokens=ctx.sampling_params["max_tokens"], **extra)
            if self.options.get("stream"):
                async with client.messages.stream(**kwargs) as stream:
                    reply = await stream.get_final_message()
            else:
                reply = await client.messages.create(**kwargs)
            text = "".join(b.text for b in reply.content if b.type == "text")
            uses = [b for b in reply.content if b.type == "tool_use"]
            blocks = [b.model_dump(exclude_none=True) for b in reply.content]
            messages.append({"role": "assistant", "content": blocks if uses else text})
            if tools and not uses:
                break
            if uses:
                results = [{"type": "tool_result", "tool_use_id": b.id,
                            "content": str(b.input["a"] + b.input["b"])} for b in uses]
                messages.append({"role": "user", "content": results})
                calls_made += len(uses)
                choice = None
            else:
                messages.append({"role": "user", "content": ctx.prompt or ""})
        if tools:
            return Result(reward=float(str(ctx.label) in text), info={"tool_calls": float(calls_made)})
        return Result(reward=text.count(str(ctx.label)) / max(len(text), 1))


AgentRunner = ChatAgentRunner(AnthropicAgent)
