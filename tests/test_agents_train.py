"""The tool-using agents as a run trains them: each configured agent (conf/agent/<name>.yaml, composed as
`python -m molt agent=<name>` composes it) samples a group through the loop's TrainingSampler on the shared
engine, every trajectory is checked against the engine's calls, and one step of the loop's `learn` runs on
it. The token-level plumbing of forced tool calls is checked in the per-framework files (evaluation's
constrained decoding); pydantic-ai always forces its structured output, so its training rollouts fail
with the reason instead of training on logprobs the trainer cannot reproduce. The flagship tool recipe's
CPU twin (experiments/tiny_tools.yaml) runs 2 steps through the loop.
"""

from __future__ import annotations

import pytest
from agentlib import train_one_step
from test_agents import Recorder, assert_exact, run_all

from molt.agents import load_agent_runner
from molt.driver.compose import compose

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


def test_the_flagship_tool_recipe_runs_on_the_tiny_model(tmp_path, ray_session, tiny_model_path):
    """experiments/tiny_tools.yaml, the CPU twin of qwen30b_tools (its agent, tools, multi-turn settings,
    estimator and gate), for 2 steps through the loop: agent/* metrics are logged every step and equal
    what the dumped rollouts show, counted here from their tokens; no tool output is ever trained on."""
    import itertools
    import json

    from transformers import AutoTokenizer

    from molt.agents.tools import make_parser, parse_reply, tool_request
    from molt.driver.loop import train
    from molt.driver.metrics import load_rollouts
    from molt.tasks.tool_use import CALCULATOR, PYTHON

    r_tools = [CALCULATOR, PYTHON]   # the rows' tools (molt.tasks.tool_use' flagship mix)

    spec = compose(["+experiment=tiny_tools", "train.steps=2", "train.prompts_per_step=2",
                    "rollout.samples_per_prompt=2", "train.eval_every=0", "train.best_metric=null",
                    "train.save_every=0",
                    "logging.plots=false", "logging.progress=false", "logging.wandb.mode=disabled",
                    "rollout.engine.kv_cache_gib=0.25"])
    spec.run.dir = str(tmp_path)
    train(spec)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    steps = [r for r in rows if "agent/turns" in r]
    assert [r["step"] for r in steps] == [1, 2]
    # reasoning-gym's prime_factorization scorer raises on the random model's answers: they score 0 and
    # are counted (info/unscorable), no rollout fails (a failure would drop its group from training)
    assert [r["rollout/failed"] for r in steps] == [0, 0]
    assert max(r.get("info/unscorable", 0) for r in steps) > 0
    tool_turn = tok.encode("<|im_start|>tool", add_special_tokens=False)
    parser = make_parser(tok, "hermes")
    for row in steps:
        dump = tmp_path / "rollouts" / f"step_{row['step']:06d}.jsonl"
        rollouts = [r for r in load_rollouts(dump) if r.ok]
        turns, calls, answered = [], [], []
        for r in rollouts:
            # each sampled turn is a run of mask-1 tokens; its calls are what the tool parser reads in it
            runs = [[t for t, _ in run] for s in r.segments for m, run in
                    itertools.groupby(zip(s.token_ids, s.loss_mask, strict=True), key=lambda x: x[1]) if m]
            found = [len(parse_reply(parser, tok, ids, tool_request(r_tools))[1]) for ids in runs]
            turns.append(len(runs))
            calls.append(sum(found))
            answered.append(r.segments[-1].finish_reason == "stop" and not found[-1])
            for s in r.segments:   # a tool message's tokens, from its role header on, are never trained
                for i in range(len(s.token_ids) - len(tool_turn) + 1):
                    if s.token_ids[i:i + len(tool_turn)] == tool_turn:
                        end = s.token_ids.index(tok.eos_token_id, i)
                        assert not any(s.loss_mask[i:end + 1]), (r.rollout_id, i)
        n = len(rollouts)
        assert row["agent/turns"] == sum(turns) / n and row["agent/tool_calls"] == sum(calls) / n
        assert row["agent/answer_rate"] == sum(answered) / n
        assert row["agent/tool_errors"] == sum(r.tool_errors for r in rollouts) / n
