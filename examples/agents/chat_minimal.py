"""The smallest chat agent: one or more turns through the stock OpenAI SDK.

The reward is the fraction of the reply's characters equal to the label (the repeat task, spoken
through a chat API). With `options.turns > 1` the agent asks again with the whole history, which the
server extends token-exactly.
"""

import openai

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result


class MinimalAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, http_client=ctx.http_client)
        messages = list(ctx.messages)
        for _ in range(int(self.options.get("turns", 1))):
            reply = await client.chat.completions.create(model=ctx.model_name, messages=messages,
                                                         stream=bool(self.options.get("stream", False)),
                                                         seed=self.options.get("seed"))
            text = await _text(reply)
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": ctx.prompt or ""}]
        return Result(reward=text.count(str(ctx.label)) / max(len(text), 1))


async def _text(reply) -> str:
    if isinstance(reply, openai.AsyncStream):
        return "".join([c.choices[0].delta.content or "" async for c in reply if c.choices])
    return reply.choices[0].message.content or ""


AgentRunner = ChatAgentRunner(MinimalAgent)
