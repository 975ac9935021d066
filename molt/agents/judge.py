"""LLM-as-judge rewards: a second model, frozen, served by vLLM engine actors of its own.

`agent.judge.path` names the judge (a Hugging Face folder, or "policy": the policy's starting weights).
Its engines are the driver's to start and stop (molt/driver/judge_engines.py); the judge here scores
through the `Sampler` (molt.trajectory) it is handed, their dispatcher. They are never trained and never
refitted, because the training loop refits only the policy's engines and never sees these. An agent asks
`await self.judge.p_yes(messages)` (an `Env`) or `await ctx.judge.p_yes(messages)` (a `ChatAgent`).

The verdict is read from the judge's logprobs, not from text it writes: the messages are rendered with the
judge's chat template and a generation prompt, the engine scores "yes" and "no" as continuations of that
prompt (prompt logprobs, exact for words of several tokens too), and the reward is the judge's probability
of "yes" against "no", sigmoid((log p(yes) - log p(no)) / agent.judge.temperature). Nothing is parsed, so a
judge that would have written garbage still gives a number in (0, 1), it is continuous (groups of equal
0/1 verdicts would carry no advantage), and it costs two prefill passes and no decoding.

The judge's engines have GPUs of their own on CUDA (plan/placement.py plans them as the policy's). A judge
served elsewhere is `agent.judge.url`, an OpenAI-compatible server (vLLM's): the same words are scored as
the echoed prompt logprobs of a completion request of token ids, rendered with `agent.judge.path`'s
tokenizer. Either way a verdict request gets `agent.judge.timeout_s`, is retried `agent.judge.retries`
times, and at most `agent.judge.max_concurrency` are in flight; a verdict that never comes fails its
rollout (an AgentError), not the run.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Callable
from typing import Any

from molt.agents.render import encode, render
from molt.spec import JudgeSpec, RunSpec
from molt.trajectory import AgentError, EngineDiedError, Sampler

YES, NO = "yes", "no"


class Judge:
    def __init__(self, tokenizer: Any, settings: JudgeSpec, sampler: Sampler | None = None,
                 client: Any = None, model: str | None = None,
                 on_close: Callable[[], None] | None = None) -> None:
        """Scores through `sampler` (the dispatcher of the judge's engines), or through `client` (an
        `openai.AsyncOpenAI` of agent.judge.url) asking for `model`. `on_close`: what `shutdown` stops (the
        engines whoever started them handed over with the sampler; none when they are shared)."""
        self.sampler, self.on_close = sampler, on_close
        self.client, self.model, self.settings = client, model, settings
        self.tokenizer, self.temperature = tokenizer, settings.temperature
        self.words = (encode(tokenizer, YES), encode(tokenizer, NO))
        # agent.judge.max_concurrency, made in the event loop that asks
        self.slots: asyncio.Semaphore | None = None

    @classmethod
    def start(cls, spec: RunSpec, sampler: Sampler | None = None,
              on_close: Callable[[], None] | None = None) -> Judge:
        """The judge of `spec.agent.judge`: connected to agent.judge.url, or scoring through `sampler` (the
        judge's engines, which the driver starts: molt.driver.judge_engines.start_judge)."""
        from transformers import AutoTokenizer

        from molt.plan.models import model_path

        judge = spec.agent.judge
        if sampler is None and not judge.url:
            raise RuntimeError(f"agent.judge.path={judge.path} scores on judge engines of the run, which the "
                               "driver starts: set the runner up with runner.setup(tokenizer, spec, "
                               "molt.driver.judge_engines.start_judge(spec)), or serve the judge at "
                               "agent.judge.url")
        path = model_path(spec) if judge.path == "policy" else judge.path
        # the judge's engines run with the policy's model.trust_remote_code, and so does its tokenizer
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=spec.model.trust_remote_code)
        if sampler is not None:
            return cls(tokenizer, judge, sampler=sampler, on_close=on_close)
        import openai

        # retries are the judge's own loop (the same for engines and servers), not the SDK's
        client = openai.AsyncOpenAI(base_url=judge.url, api_key="EMPTY", max_retries=0,
                                    timeout=judge.timeout_s)
        served = openai.OpenAI(base_url=judge.url, api_key="EMPTY", timeout=judge.timeout_s).models.list()
        return cls(tokenizer, judge, client=client, model=served.data[0].id)

    async def p_yes(self, messages: list[dict]) -> float:
        """The judge's probability of answering yes (rather than no) after `messages`."""
        prompt = encode(self.tokenizer, render(self.tokenizer, messages))
        yes, no = await asyncio.gather(*[self._logprob(prompt, word) for word in self.words])
        return 1.0 / (1.0 + math.exp(-(yes - no) / self.temperature))

    async def _logprob(self, prompt: list[int], word: list[int]) -> float:
        """log p(word | prompt), with agent.judge's timeout, retries and concurrency bound."""
        import openai

        if self.slots is None:
            self.slots = asyncio.Semaphore(self.settings.max_concurrency)
        tries, why = self.settings.retries + 1, ""
        for _ in range(tries):
            try:
                async with self.slots:
                    return await asyncio.wait_for(self._score(prompt, word), self.settings.timeout_s)
            except (TimeoutError, EngineDiedError, openai.APIError) as err:
                why = f"{type(err).__name__}: {err}" if str(err) else \
                    f"{type(err).__name__} after agent.judge.timeout_s={self.settings.timeout_s}"
        raise AgentError(f"the judge gave no verdict in {tries} tries ({why})")

    async def _score(self, prompt: list[int], word: list[int]) -> float:
        ids = prompt + word
        if self.client is not None:   # the echoed prompt's logprobs (the first token has none)
            out = await self.client.completions.create(model=self.model, prompt=ids, max_tokens=1, echo=True,
                                                       logprobs=0)
            return float(sum(out.choices[0].logprobs.token_logprobs[len(prompt):len(ids)]))
        key = f"judge-{uuid.uuid4().hex}"
        try:
            out = await self.sampler.generate(ids, {"max_tokens": 1, "prompt_logprobs": 0}, key)
        finally:
            self.sampler.release(key)
        return float(sum(out["prompt_logprobs"][-len(word):]))   # the word's tokens close the prompt

    def shutdown(self) -> None:
        """Stop what was handed over with the sampler (`on_close`), once."""
        on_close, self.on_close = self.on_close, None
        if on_close is not None:
            on_close()
