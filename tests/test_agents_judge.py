"""LLM-as-judge rewards (molt.agents.judge) on the tiny model: the judge runs on an engine actor of its own
started from the spec (agent.judge), and a reward is its probability of "yes" against "no", checked here
against a plain transformers forward of the judge's weights; one training step runs on judged rollouts.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from agentlib import Runners, train_one_step
from test_agents import Recorder, assert_exact, encode, run_all

from molt.agents.render import render
from molt.spec import RunSpec, SpecError, validate_spec

ITEM = {"prompt": "What is 2+3?", "label": "5"}


def reference_p_yes(model, tok, messages: list[dict], temperature: float) -> float:
    """p(yes) / (p(yes) + p(no)) at `temperature`, from one forward of the judge's weights per word."""
    prompt = encode(tok, render(tok, messages))
    logps = []
    for word in ("yes", "no"):
        ids = prompt + encode(tok, word)
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        logps.append(sum(float(logp[t - 1, ids[t]]) for t in range(len(prompt), len(ids))))
    return 1.0 / (1.0 + math.exp(-(logps[0] - logps[1]) / temperature))


def test_judged_rewards_match_the_judges_weights_and_train(tok, engine, trainer, tiny_model_path):
    from transformers import AutoModelForCausalLM

    sampler, runners = Recorder(engine, training=True), Runners(tok)
    try:
        runner = runners("judge_env.py", {"judge": {"path": tiny_model_path, "temperature": 0.5}}, kind="env",
                         max_tokens=16)
        assert engine not in runner.judge.engines   # its own engine, which no refit ever reaches
        rollouts = run_all(runner, [ITEM] * 4, sampler, group="judge")
    finally:
        runners.close()
    assert runner.judge is None   # close() stopped the judge's engine
    grader = sys.modules[runner.env_cls.__module__].GRADER
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    for r in rollouts:
        [[call]] = assert_exact(r, [c for c in sampler.calls if c["key"] == r.rollout_id])
        answer = tok.decode(call["out"]["token_ids"], skip_special_tokens=True)
        verdict = [{"role": "system", "content": grader},
                   {"role": "user", "content": f"Question: {ITEM['prompt']}\nReference answer: 5\n"
                                               f"Answer: {answer}\nIs the answer correct?"}]
        assert 0.0 < r.reward < 1.0
        assert r.reward == pytest.approx(reference_p_yes(model, tok, verdict, 0.5), abs=1e-3)
    # The judge's requests never went through the policy's sampler.
    assert all("prompt_logprobs" not in c["sampling"] for c in sampler.calls)
    train_one_step(trainer, rollouts, sampler, tok)


def test_a_judge_on_cuda_is_refused_until_placement_plans_it():
    with pytest.raises(SpecError, match="agent.judge on parallel.device=cuda"):
        validate_spec({"parallel": {"device": "cuda"}, "model": {"dtype": "bfloat16"},
                       "agent": {"judge": {"path": "policy"}}})
    assert RunSpec.model_validate({"agent": {"judge": {"path": "policy"}}}).agent.judge.temperature == 1.0
