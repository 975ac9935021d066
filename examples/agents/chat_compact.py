"""A chat agent that compacts its context: after `options.keep_turns` turns it drops the history and
continues from a one-line summary. The server sees a rewritten prefix and starts a new segment of the
same rollout; all segments share the one reward."""

import openai

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result


class CompactingAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, http_client=ctx.http_client)
        messages, texts = list(ctx.messages), []
        for turn in range(ctx.max_turns):
            if turn and turn % int(self.options.get("keep_turns", 2)) == 0:
                messages = [{"role": "system", "content": f"summary: {len(texts)} replies so far"},
                            {"role": "user", "content": ctx.prompt or ""}]
            reply = await client.chat.completions.create(model=ctx.model_name, messages=messages,
                                                         seed=self.options.get("seed"))
            texts.append(reply.choices[0].message.content or "")
            messages += [{"role": "assistant", "content": texts[-1]},
                         {"role": "user", "content": ctx.prompt or ""}]
        text = "".join(texts)
        return Result(reward=text.count(str(ctx.label)) / max(len(text), 1))


AgentRunner = ChatAgentRunner(CompactingAgent)
