"""The Env path keeps each turn's rendering for the next turn's glue instead of rendering it again
(molt.agents.env, two renders a turn): after every step the prompt the engine reads must be what three
fresh renders give — the template's rendering before the reply, with it, and with the observation, glued
as molt.agents.render.glue glues them — on every template the tests ship (the tiny model's ChatML,
Qwen3's), over turns of unequal lengths, user turns, a tool chain of two calls and a turn cut at its token
budget. The kept rendering itself is checked too, as the chat session's is (test_chat_templates.py): a
stale one that is still a prefix of the new renderings gives the same glue on these templates, but not the
same check for a rewritten prefix. ChatML never rewrites a prefix, Qwen3 does at most turns here, so both
branches run. A turn's token budget is what the context leaves of rollout.max_tokens: a response cut by it
is counted (rollout/context_truncated).
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

import pytest
from test_agents import Recorder, encode, make_spec
from test_chat_templates import qwen_tok  # noqa: F401 (the fixture)

from molt.agents import Env, Result, State, StepEnvRunner
from molt.agents.render import glue, render

TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
CALL = r'<tool_call>\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}</tool_call>'
FIRST = {"structured_outputs": {"regex": "a{3}"}}


class UnevenEnv(Env):
    """reply → long user turn → reasoning and one call → its tool message → two calls → two tool messages →
    a reply cut at 5 tokens → a short user turn → a last reply. Records each step's conversation and what
    follows it."""

    tools: ClassVar = {"add": lambda a, b: str(a + b)}
    seen: ClassVar[list[tuple[list[dict], list[dict]]]] = []
    NEXT = [("a longer question, with several words in it", "<think>[a-z]{1,6}</think>" + CALL),
            ("tools", f"({CALL}){{2}}"), ("tools", "[a-z]{40}"), ("y", "b{7}")]

    async def step(self, state: State) -> Result:
        if state.turn == len(self.NEXT):
            self.seen.append((state.messages, []))
            return Result(reward=1.0)
        observation, regex = self.NEXT[state.turn]
        new = await self.call_tools(state) if observation == "tools" else \
            [{"role": "user", "content": observation}]
        assert len(new) == (2 if state.turn == 2 else 1), (state.finish_reason, state.action)
        self.seen.append((state.messages, new))
        params = {"structured_outputs": {"regex": regex}, **({"max_tokens": 5} if state.turn == 2 else {})}
        return Result(reward=0.0, observation=new, terminated=False, sampling_params=params)


class KeptRunner(StepEnvRunner):
    """The runner, recording the rendering each step's glue starts from and the conversation it stands for."""

    def _observe(self, trace, text: str, messages: list[dict], *rest) -> str:
        self.kept.append((text, messages[:-1]))   # the conversation before the reply
        return super()._observe(trace, text, messages, *rest)


@pytest.mark.parametrize("template", ["chatml", "qwen3"])
def test_the_env_path_prompt_after_every_step_is_three_fresh_renders(tok, qwen_tok, engine, template):  # noqa: F811
    tok = qwen_tok if template == "qwen3" else tok
    UnevenEnv.seen = []
    sampler, runner = Recorder(engine, seed=0), KeptRunner(UnevenEnv)
    runner.kept = []
    runner.setup(tok, make_spec({"module": "x.py", "max_turns": 5, "max_total_tokens": 1000},
                                max_tokens=160))
    first = [{"role": "user", "content": "hi"}]
    rollout = asyncio.run(runner.run({"messages": first, "label": "", "tools": TOOLS}, "r0", "g0", sampler,
                                     {**runner.sampling, **FIRST}))
    calls = sampler.calls
    requests = [first] + [messages + new for messages, new in UnevenEnv.seen[:-1]]
    assert rollout.ok, rollout.error
    assert len(calls) == len(requests) == 5 and rollout.reward == 1.0
    assert [c["out"]["finish_reason"] for c in calls] == ["stop", "stop", "stop", "length", "stop"]
    assert calls[0]["prompt_ids"] == encode(tok, render(tok, first, TOOLS))
    # the kept rendering is the template's rendering of the whole conversation, every step
    assert [text for text, _ in runner.kept] == [render(tok, m, TOOLS) for _, m in runner.kept]
    assert [m for _, m in runner.kept] == requests[:-1]
    seals = []
    for k in range(1, len(calls)):
        before, (answered, _) = calls[k - 1], UnevenEnv.seen[k - 1]
        sampled, full = before["out"]["token_ids"], render(tok, requests[k], TOOLS)
        tail = glue(tok, render(tok, requests[k - 1], TOOLS), render(tok, answered, TOOLS, False), full,
                    sampled[-1] == tok.eos_token_id)
        seals.append(tail is None)
        expected = encode(tok, full) if tail is None else \
            before["prompt_ids"] + sampled + encode(tok, tail)
        assert calls[k]["prompt_ids"] == expected, (template, k)
    # each segment: its calls laid end to end, the sampled tokens (only they) with loss mask 1
    starts = [0] + [k for k in range(1, len(calls)) if seals[k - 1]]
    for segment, start, end in zip(rollout.segments, starts, starts[1:] + [len(calls)], strict=True):
        last, mask = calls[end - 1], [0] * len(segment.token_ids)
        for call in calls[start:end]:
            n = len(call["prompt_ids"])
            mask[n:n + len(call["out"]["token_ids"])] = [1] * len(call["out"]["token_ids"])
        assert segment.token_ids == last["prompt_ids"] + last["out"]["token_ids"]
        assert segment.loss_mask == mask
    # ChatML never rewrites a prefix; Qwen3 re-renders a reply once anything follows it (it loses the empty
    # think block of the last turn), except one with reasoning of its own in a tool chain
    assert seals == ([False] * 4 if template == "chatml" else [True, False, True, True]), seals


def test_a_response_cut_by_the_context_is_counted(tok, engine):
    """A turn that stops on length before its own max_tokens (8) was cut by the context: by what is left of
    agent.max_total_tokens (the agent layer shrinks the request) or of the engine's model.max_model_len
    (1024; vLLM's request is shrunk). Each counts on its rollout and in rollout/context_truncated; a turn
    that ran its whole max_tokens, or stopped on its own, does not."""
    from test_agents import EXAMPLES, chat_ids, run_all

    from molt.agents import load_agent_runner
    from molt.driver.select import context_warning, rollout_metrics
    from molt.spec import RunSpec

    sampler = Recorder(engine)

    module = str(EXAMPLES / "repeat.py")
    short = len(chat_ids(tok, [{"role": "user", "content": "c"}]))
    words = next(n for n in range(300, 1100) if len(chat_ids(tok, [{"role": "user", "content": "c " * n}]))
                 >= 1024 - 3)   # leaves 3 tokens or fewer of the engine's context
    cases = {"agent.max_total_tokens": ({"max_total_tokens": short + 3}, "c"),
             "model.max_model_len": ({"max_total_tokens": 4096}, "c " * words),
             "no cut": ({}, "c")}
    counted = {}
    for name, (agent, prompt) in cases.items():
        spec = RunSpec.model_validate({"model": {"max_model_len": 4096}, "rollout": {"max_tokens": 8},
                                       "agent": {"module": module, **agent}})
        runner = load_agent_runner(spec.agent)
        runner.setup(tok, spec)
        sampler.calls.clear()
        rollouts = run_all(runner, [{"prompt": prompt, "label": "c"}] * 6, sampler, group=name)
        outs = {c["key"]: c["out"] for c in sampler.calls}
        for r in rollouts:
            out = outs[r.rollout_id]
            assert r.context_truncated == (out["finish_reason"] == "length" and len(out["token_ids"]) < 8)
        counted[name] = rollout_metrics(spec, rollouts)["rollout/context_truncated"]
        assert counted[name] == sum(r.context_truncated for r in rollouts)
        if counted[name]:
            assert "responses are cut short by the context" in context_warning(spec, rollouts)
    assert counted["agent.max_total_tokens"] >= 1 and counted["model.max_model_len"] >= 1, counted
    assert counted["no cut"] == 0


# A second user turn after the first reply: the 10-token prompt, a reply of 8 and this turn's 11 tokens of
# glue (<|im_end|><|im_start|>user\nc<|im_end|><|im_start|>assistant, measured on the tiny model's ChatML)
# make 29, so agent.max_total_tokens=32 leaves the second reply 3 of its 8 tokens (7 or fewer whenever the
# first reply ran 3 tokens or more, as a random-init model's nearly always does).
TWO_TURNS = """
from molt.agents import Env, Result, StepEnvRunner

class TwoTurns(Env):
    async def step(self, state):
        if state.turn == 0:
            return Result(reward=0.0, observation="c", terminated=False)
        return Result(reward=len(state.action_ids) / 8)   # what the context cut takes away

AgentRunner = StepEnvRunner(TwoTurns)
"""


def test_a_run_whose_context_cuts_responses_counts_them_and_says_so_once(tok, engine, trainer, tmp_path,
                                                                         caplog):
    """Three steps of the loop (pool → learn → refit, logged as a run logs them) on the shared engine and
    trainer, every second turn cut by agent.max_total_tokens: each step's metrics.jsonl row counts the cut
    responses (rollout/context_truncated, checked against the dumped tokens), and the warning that names
    them is logged once, at the first step, not at every step."""
    import json
    import logging
    from pathlib import Path

    from molt.driver.compose import compose, prepare
    from molt.driver.fleet import Fleet
    from molt.driver.loop import rl_step
    from molt.driver.metrics import RunLogger, load_rollouts
    from molt.driver.run import Run, train_steps
    from molt.trainer.ranks import Trainers

    module = tmp_path / "two_turns.py"
    module.write_text(TWO_TURNS)
    spec = compose([f"agent.module={module}", "agent.max_turns=2", "agent.max_total_tokens=32",
                    "rollout.max_tokens=8", "train.steps=3", "train.prompts_per_step=2",
                    "rollout.samples_per_prompt=4", "train.micro_batch_size=8", "train.save_every=0",
                    "train.eval_every=0",
                    "model.max_model_len=1024", "parallel.cpu_threads=1", "rollout.engine.kv_cache_gib=0.25",
                    "rollout.engine.enforce_eager=true", "logging.plots=false", "logging.progress=false",
                    "logging.wandb.mode=disabled", f"run.dir={tmp_path / 'run'}"])
    inputs = prepare(spec).or_raise()   # the dry run's context check passes: the first turn fits
    inputs.runner.setup(inputs.tokenizer, spec)

    async def scenario() -> None:
        fleet = Fleet(spec, inputs.policy_path, engines=[engine])
        run = Run(spec, inputs, fleet, Trainers(trainer, pad_id=tok.pad_token_id), RunLogger(spec))
        try:
            await run.begin(None, refit_engines=False)
            await train_steps(run, rl_step)
        finally:   # the shared trainer and engine back on the initial weights, as version 0
            await run.pool.close()
            run.logger.close()
            await asyncio.to_thread(trainer.load, trainer.initial)
            await fleet.refit(0)

    trainer.load(trainer.initial)
    with caplog.at_level(logging.WARNING, logger="molt"):
        asyncio.run(scenario())
    run_dir = Path(spec.run.dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        cut = 0
        for rollout in load_rollouts(run_dir / "rollouts" / f"step_{r['step']:06d}.jsonl"):
            [segment] = rollout.segments   # ChatML: one segment, the second turn's tokens last
            last = sum(segment.loss_mask[segment.turns[-1][1]:])
            cut += segment.finish_reason == "length" and len(segment.turns) == 2 and last < 8
        assert r["rollout/context_truncated"] == cut >= 1, (r["step"], r["rollout/context_truncated"], cut)
    warnings = [m for m in caplog.messages if "responses are cut short by the context" in m]
    assert len(warnings) == 1, warnings
    assert "agent.max_total_tokens=32" in warnings[0] and "rollout.max_tokens=8" in warnings[0]
