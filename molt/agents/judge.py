"""LLM-as-judge rewards: a second model, frozen, served by vLLM engine actors of its own.

`agent.judge.path` names the judge (a Hugging Face folder, or "policy": the policy's starting weights).
The agent runner starts its engines at setup and stops them at close; they are never trained and never
refitted, because the training loop refits only the policy's engines and never sees these. An agent asks
through the same `Dispatcher` the policy's rollouts use: `await self.judge.p_yes(messages)` (an `Env`) or
`await ctx.judge.p_yes(messages)` (a `ChatAgent`).

The verdict is read from the judge's logprobs, not from text it writes: the messages are rendered with the
judge's chat template and a generation prompt, the engine scores "yes" and "no" as continuations of that
prompt (prompt logprobs, exact for words of several tokens too), and the reward is the judge's probability
of "yes" against "no", sigmoid((log p(yes) - log p(no)) / agent.judge.temperature). Nothing is parsed, so a
judge that would have written garbage still gives a number in (0, 1), it is continuous (groups of equal
0/1 verdicts would carry no advantage), and it costs two prefill passes and no decoding.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from typing import Any

from molt.agents.render import encode, render
from molt.rollout.dispatch import Dispatcher
from molt.spec import LoRASpec, RunSpec

YES, NO = "yes", "no"


class Judge:
    def __init__(self, engines: list, tokenizer: Any, temperature: float) -> None:
        self.engines, self.dispatcher = engines, Dispatcher(engines)
        self.tokenizer, self.temperature = tokenizer, temperature
        self.words = (encode(tokenizer, YES), encode(tokenizer, NO))

    @classmethod
    def start(cls, spec: RunSpec) -> Judge:
        """Start the engines of `spec.agent.judge` (vLLM, the judge's own `engine` settings)."""
        from transformers import AutoTokenizer

        from molt.models import model_path
        from molt.rollout.engine import start_engines

        judge = spec.agent.judge
        path = model_path(spec) if judge.path == "policy" else judge.path
        # The judge scores while the policy's engines generate: one thread each unless parallel.cpu_threads
        # says otherwise, rather than a second claim on every core.
        threads = spec.parallel.cpu_threads or 1
        # The judge is never refitted: it serves its model as is, without the policy's LoRA adapters, and
        # nothing trains on its tokens, so it captures no MoE routes for replay (a dense judge has none).
        model = spec.model.model_copy(update={"lora": LoRASpec(), "router_replay": False})
        own = spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"engine": judge.engine}),
                                      "parallel": spec.parallel.model_copy(update={"cpu_threads": threads}),
                                      "model": model})
        # the judge's engines run with the policy's model.trust_remote_code, and so does its tokenizer
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=spec.model.trust_remote_code)
        return cls(start_engines(own, path), tokenizer, judge.temperature)

    async def p_yes(self, messages: list[dict]) -> float:
        """The judge's probability of answering yes (rather than no) after `messages`."""
        prompt = encode(self.tokenizer, render(self.tokenizer, messages))
        yes, no = await asyncio.gather(*[self._logprob(prompt, word) for word in self.words])
        return 1.0 / (1.0 + math.exp(-(yes - no) / self.temperature))

    async def _logprob(self, prompt: list[int], word: list[int]) -> float:
        key = f"judge-{uuid.uuid4().hex}"
        try:
            out = await self.dispatcher.generate(prompt + word, {"max_tokens": 1, "prompt_logprobs": 0}, key)
        finally:
            self.dispatcher.release(key)
        return float(sum(out["prompt_logprobs"][-len(word):]))   # the word's tokens close the prompt

    def shutdown(self) -> None:
        import ray

        for engine in self.engines:
            ray.get(engine.shutdown.remote())
            ray.kill(engine)
