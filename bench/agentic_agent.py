"""The chat agent `bench/agentic.py --workers N` runs in agent workers: `options.turns` calls through the
stock OpenAI SDK on the lent `http_client`, each call's seconds returned in `Result.info` (`turn_s_<k>`),
since the agent runs in another process than the bench."""

import time

import openai

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result


class TimedTurns(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0,
                                    http_client=ctx.http_client)
        messages, info = list(ctx.messages), {}
        for k in range(int(self.options["turns"])):
            t0 = time.perf_counter()
            reply = await client.chat.completions.create(model=ctx.model_name, messages=messages)
            info[f"turn_s_{k}"] = time.perf_counter() - t0
            messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                         {"role": "user", "content": "again"}]
        return Result(reward=0.0, info=info)


AgentRunner = ChatAgentRunner(TimedTurns)
