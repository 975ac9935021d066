"""The tool-using agents as a run trains them: each configured agent (conf/agent/<name>.yaml, composed as
`python -m molt agent=<name>` composes it) samples a group through the loop's TrainingSampler on the shared
engine, every trajectory is checked against the engine's calls, and one step of the loop's `learn` runs on
it. The token-level plumbing of forced tool calls is checked in the per-framework files (evaluation's
constrained decoding); pydantic-ai always forces its structured output, so its training rollouts fail
with the reason instead of training on logprobs the trainer cannot reproduce.
"""

from __future__ import annotations

import pytest
from agentlib import train_one_step
from test_agents import Recorder, assert_exact, run_all

from molt.agents import load_agent_runner
from molt.config import compose

ITEM = {"messages": [{"role": "user", "content": "What is 3 squared?"}], "label": "9"}
# Each configured agent, and the extra its framework needs (None: the core install).
AGENTS = {"openai_agents": "agents", "langgraph": "langgraph", "verifiers": "verifiers", "mcp": "mcp",
          "code": None}


def configured_runner(name: str, tok):
    spec = compose([f"agent={name}", "model.max_model_len=1024", "rollout.max_tokens=16"])   # the engine's
    runner = load_agent_runner(spec.agent)
    runner.setup(tok, spec)
    return runner


@pytest.mark.parametrize("name", AGENTS)
def test_configured_agents_train_through_the_training_sampler(name, tok, engine, trainer):
    if AGENTS[name]:
        pytest.importorskip(AGENTS[name], reason=f"needs the {AGENTS[name]} package (see docs/agents.md)")
    sampler, runner = Recorder(engine, training=True), configured_runner(name, tok)
    try:
        rollouts = run_all(runner, [ITEM] * 2, sampler, group=f"train-{name}")
    finally:
        runner.close()
    for r in rollouts:
        assert_exact(r, [c for c in sampler.calls if c["key"] == r.rollout_id])
    assert all("structured_outputs" not in c["sampling"] for c in sampler.calls)
    train_one_step(trainer, rollouts, sampler, tok)


def test_an_agent_that_needs_constrained_decoding_is_refused_in_training(tok, engine):
    pytest.importorskip("pydantic_ai", reason="needs the agents extra: pip install molt[agents]")
    runner = configured_runner("pydantic_ai", tok)
    try:
        rollouts = run_all(runner, [ITEM] * 2, Recorder(engine, training=True), group="train-pai")
    finally:
        runner.close()
    for r in rollouts:
        assert not r.ok and "constrained decoding" in r.error, r.error
