"""Eval metrics: unbiased pass@k against brute-force enumeration, mean@n, and the k that are reported; the
eval sampling (rollout.eval) as the agent's defaults on the shared engine, for an Env and a ChatAgent."""

from __future__ import annotations

import asyncio
from itertools import combinations

import openai
import pytest
import torch
from test_agents import EXAMPLES, Recorder, chat_ids

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result, load_agent_runner
from molt.driver.agent_workers import LocalAgents
from molt.driver.eval import evaluate, pass_at_k, set_metrics
from molt.spec import RunSpec


def brute_pass_at_k(outcomes: list[bool], k: int) -> float:
    """The fraction of all k-subsets of the samples that hold a correct one (the quantity estimated)."""
    subsets = list(combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_is_the_exact_subset_average() -> None:
    for n in (1, 2, 5, 8):
        for c in range(n + 1):
            outcomes = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(outcomes, k), abs=1e-12)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)                   # pass@1 = c / n
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)                    # 1 - C(3,2)/C(4,2) = 1 - 3/6
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


def test_set_metrics_names_and_values() -> None:
    # 3 prompts x 4 samples; reward >= 1 is correct, partial credit counts for mean@4 only
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])
    m = set_metrics("gsm", rewards, 1.0)
    assert sorted(m) == ["eval/gsm/mean@4", "eval/gsm/pass@1", "eval/gsm/pass@2", "eval/gsm/pass@4"]
    assert m["eval/gsm/mean@4"] == pytest.approx(3.5 / 12)
    assert m["eval/gsm/pass@1"] == pytest.approx((1 / 4 + 2 / 4 + 0) / 3)
    assert m["eval/gsm/pass@2"] == pytest.approx((1 / 2 + 5 / 6 + 0) / 3)
    assert m["eval/gsm/pass@4"] == pytest.approx(2 / 3)
    assert set_metrics("gsm", rewards, 0.5)["eval/gsm/pass@4"] == pytest.approx(2 / 3)   # threshold moves
    assert set_metrics("gsm", rewards, 0.5)["eval/gsm/pass@1"] == pytest.approx((1 / 4 + 3 / 4 + 0) / 3)
    assert sorted(set_metrics("x", torch.zeros(2, 10), 1.0)) == [
        f"eval/x/{m}" for m in ("mean@10", "pass@1", "pass@10", "pass@2", "pass@4", "pass@8")]


def eval_spec(tok, prompt: str, **agent) -> RunSpec:
    # Training samples 8 tokens a turn, evaluation 16 (greedy): the budget (max_total_tokens) allows 12.
    budget = len(chat_ids(tok, [{"role": "user", "content": prompt}])) + 12
    return RunSpec.model_validate({
        "model": {"max_model_len": 256},
        "rollout": {"max_tokens": 8, "eval": {"max_tokens": 16, "temperature": 0.0, "n": 1}},
        "agent": {"max_total_tokens": budget, **agent}})


def test_eval_sampling_is_the_agents_default_capped_by_the_token_budget(tok, engine):
    """repeat.py's reward is the letter's tokens over state.sampling_params["max_tokens"]: with the eval
    sampling forced over every turn, the engine was asked for 16 tokens while the agent saw 8 (training's)
    and scored up to 16/8 = 2."""
    spec = eval_spec(tok, "a", module=str(EXAMPLES / "repeat.py"))
    runner = load_agent_runner(spec.agent)
    runner.setup(tok, spec)
    sampler = Recorder(engine)
    # The label is the token the greedy policy repeats most after this prompt, so the reward is high.
    groups = LocalAgents(spec, runner, sampler)
    asyncio.run(evaluate(spec, groups, {"probe": [{"prompt": "a", "label": "a"}]}, 0))
    ids = sampler.calls[0]["out"]["token_ids"]
    label = tok.decode([max(set(ids), key=ids.count)])
    sampler.calls.clear()
    metrics = asyncio.run(evaluate(spec, groups, {"set": [{"prompt": "a", "label": label}]}, 0))
    [call] = sampler.calls
    hits, mean = sum(tok.decode([t]) == label for t in call["out"]["token_ids"]), metrics["eval/set/mean@1"]
    assert 0 <= mean <= 1, (mean, hits, call["sampling"])
    assert call["sampling"] == {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 12}
    assert mean == pytest.approx(hits / 12)
    assert runner.sampling["max_tokens"] == 8   # the runner training samples through keeps its defaults


def test_eval_sampling_is_a_chat_agents_default_and_requests_still_override_it(tok, engine):
    seen = []

    class Asks(ChatAgent):
        async def run(self, ctx: ChatContext) -> Result:
            seen.append(ctx.sampling_params)
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
            await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages, max_tokens=100)
            await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages, temperature=0.5,
                                                 max_tokens=3)
            return Result(reward=0.0)

    spec = eval_spec(tok, "b", module="x.py", max_turns=2)
    runner = ChatAgentRunner(Asks)
    runner.setup(tok, spec)
    sampler = Recorder(engine)
    try:
        groups = LocalAgents(spec, runner, sampler)
        asyncio.run(evaluate(spec, groups, {"set": [{"prompt": "b", "label": "b"}]}, 0))
    finally:
        runner.close()
    assert seen == [{"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 16}]
    # 100 wanted, capped at rollout.eval.max_tokens (16), then at the budget (12); the second request's
    # own temperature and max_tokens win over the eval defaults.
    assert [c["sampling"] for c in sampler.calls] == [
        {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 12},
        {"temperature": 0.5, "top_p": 1.0, "top_k": -1, "max_tokens": 3}]


def test_eval_logs_what_the_agent_did_per_set(tok, engine):
    """eval/NAME/agent/* and eval/NAME/info/KEY, as training logs them, per set and over the set's rollouts
    that did not fail (a set's info mean covers only its rollouts that report the key); failures counted."""
    from molt.agents import Env, StepEnvRunner

    class Reports(Env):
        async def step(self, state):
            if state.item["info"] is None:
                raise RuntimeError("boom")
            return Result(reward=1.0, info=state.item["info"])

    spec = eval_spec(tok, "a", module="x.py")
    spec.rollout.eval.n = 2
    runner = StepEnvRunner(Reports)
    runner.setup(tok, spec)
    sets = {"a": [{"prompt": "a", "info": {"k": 1.0}}, {"prompt": "a", "info": {"k": 3.0}}],
            "b": [{"prompt": "a", "info": None}, {"prompt": "a", "info": {"j": 5.0}}]}
    metrics = asyncio.run(evaluate(spec, LocalAgents(spec, runner, Recorder(engine)), sets, 0))
    assert (metrics["eval/a/info/k"], metrics["eval/b/info/j"]) == (2.0, 5.0)
    assert "eval/a/info/j" not in metrics and "eval/b/info/k" not in metrics
    assert (metrics["eval/a/failed"], metrics["eval/b/failed"]) == (0.0, 2.0)
    assert metrics["eval/a/agent/turns"] == metrics["eval/b/agent/turns"] == 1.0
    assert metrics["eval/b/mean@2"] == 0.5   # the failed row scores 0
