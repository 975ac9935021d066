"""The token-first contract under a real model family's chat template, and the tool parser as a config key.

Qwen3's template (tests/data/qwen3_chat_template.jinja, its published behaviour) renders the latest
assistant turn with a `<think>` block, keeps the reasoning of turns after the last user query (a tool
chain) and drops it from turns before it: a naive loop that re-renders the conversation each turn would
rewrite tokens the model already sampled. The tiny tokenizer gets that template, with `<think>` and
`<tool_call>` as plain added tokens (as Qwen3's tokenizer has them). Over a scripted multi-turn episode
the trajectory must seal a segment exactly where the rendered prefix changes — computed here from the
template alone — and nowhere else, with every sampled token carried verbatim.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest
from test_agents import EXAMPLES, Recorder, assert_exact, make_spec, run_all

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Env, Result, State, StepEnvRunner
from molt.agents.tools import make_parser, parse_reply

QWEN3 = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
THINK = r"<think>[a-z]{1,6}</think>[a-z]{1,6}"
THINK_CALL = (r'<think>[a-z]{1,6}</think>'
              r'<tool_call>\{"name": "add", "arguments": \{"a": [0-9]\}\}</tool_call>')


@pytest.fixture(scope="module")
def qwen_tok(tok):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    data = json.loads(tok.backend_tokenizer.to_str())
    for added in data["added_tokens"]:
        added["special"] = added["content"] not in ("<think>", "</think>", "<tool_call>", "</tool_call>")
    qwen = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)),
                                   bos_token=tok.bos_token, eos_token=tok.eos_token, pad_token=tok.pad_token)
    qwen.chat_template = QWEN3
    return qwen


def rendered(tok, messages: list[dict], prompt: bool, **variables) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt, **variables)


def ids(tok, messages: list[dict], **variables) -> list[int]:
    return tok.encode(rendered(tok, messages, True, **variables), add_special_tokens=False)


def expected_seals(tok, requests: list[list[dict]], replies: list[dict], **variables) -> list[bool]:
    """For each request after the first: does the template (with these variables) render the earlier
    conversation (with the reply the model gave) differently once the new messages follow?"""
    return [not rendered(tok, requests[k], True, **variables).startswith(
        rendered(tok, requests[k - 1] + [replies[k - 1]], False, **variables))
        for k in range(1, len(requests))]


def check_segments(tok, rollout, calls: list[dict], requests: list[list[dict]], seals: list[bool],
                   **variables) -> None:
    """Segments = requests grouped at the seals; each segment opens with its request's rendering."""
    per_segment = assert_exact(rollout, calls)
    assert [len(c) for c in per_segment] == [len(g) for g in _groups(len(requests), seals)]
    for segment, group in zip(per_segment, _groups(len(requests), seals), strict=True):
        assert segment[0]["prompt_ids"] == ids(tok, requests[group[0]], **variables)


def _groups(n: int, seals: list[bool]) -> list[list[int]]:
    groups = [[0]]
    for k in range(1, n):
        groups.append([k]) if seals[k - 1] else groups[-1].append(k)
    return groups


class ScriptedEnv(Env):
    """user → (free reply) → user → think reply → tool result → think + call → user → think reply."""

    SCRIPT = [({"role": "user", "content": "next"}, THINK), ({"role": "tool", "content": "42"}, THINK_CALL),
              ({"role": "user", "content": "last"}, THINK)]

    async def step(self, state: State) -> Result:
        if state.turn == len(self.SCRIPT):
            return Result(reward=1.0)
        observation, regex = self.SCRIPT[state.turn]
        return Result(reward=0.0, observation=observation, terminated=False,
                      sampling_params={"structured_outputs": {"regex": regex}})


def test_env_seals_exactly_where_qwen3_rewrites_the_prefix(qwen_tok, engine):
    # Seeded: which turns the template rewrites depends on the sampled text, so the scenario is pinned.
    sampler, runner = Recorder(engine, seed=0), StepEnvRunner(ScriptedEnv)
    runner.setup(qwen_tok, make_spec({"module": "x.py", "max_turns": 4, "max_total_tokens": 400},
                                     max_tokens=16))
    rollouts = run_all(runner, [{"prompt": "hi", "label": ""}] * 2, sampler, group="qwen")
    for r in rollouts:
        calls = [c for c in sampler.calls if c["key"] == r.rollout_id]
        texts = [qwen_tok.decode(c["out"]["token_ids"], skip_special_tokens=True) for c in calls]
        replies = [{"role": "assistant", "content": text} for text in texts]
        requests = [[{"role": "user", "content": "hi"}]]
        for reply, (observation, _) in zip(replies, ScriptedEnv.SCRIPT, strict=False):
            requests.append(requests[-1] + [reply, observation])
        seals = expected_seals(qwen_tok, requests, replies)
        # The free first reply and the two think replies before a new user query lose their <think> block;
        # the think reply followed by a tool result keeps it (a tool chain), so its turn continues.
        assert seals == [True, False, True], texts
        check_segments(qwen_tok, r, calls, requests, seals)
        assert replies[1]["content"].startswith("<think>") and r.reward == 1.0


def test_chat_session_seals_where_qwen3_drops_the_think_block(qwen_tok, engine):
    seen = []

    class Thinker(ChatAgent):
        async def run(self, ctx: ChatContext) -> Result:
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
            messages = list(ctx.messages)
            for question in ("again", None):
                reply = await client.chat.completions.create(
                    model=ctx.model_name, messages=messages,
                    extra_body={"structured_outputs": {"regex": THINK}})
                seen.append((list(messages), reply.choices[0].message.model_dump(exclude_none=True)))
                if question:
                    messages += [seen[-1][1], {"role": "user", "content": question}]
            return Result(reward=0.0)

    sampler, runner = Recorder(engine), ChatAgentRunner(Thinker)
    runner.setup(qwen_tok, make_spec({"module": "x.py", "max_turns": 2}, max_tokens=16))
    try:
        [r] = run_all(runner, [{"prompt": "hi", "label": ""}], sampler, group="qchat")
    finally:
        runner.close()
    requests, replies = [m for m, _ in seen], [reply for _, reply in seen]
    assert replies[0]["content"].startswith("<think>")   # as vLLM's server gives it: the text as sampled
    seals = expected_seals(qwen_tok, requests, replies)
    assert seals == [True]
    check_segments(qwen_tok, r, [c for c in sampler.calls if c["key"] == r.rollout_id], requests, seals)


class Again(Env):
    """Two turns: the reply, then "again"."""

    async def step(self, state: State) -> Result:
        if state.turn == 0:
            return Result(reward=0.0, observation="again", terminated=False)
        return Result(reward=1.0)


def test_model_chat_template_kwargs_render_every_turn(qwen_tok, engine):
    """model.chat_template_kwargs are the template's variables in every render: with Qwen3's
    enable_thinking=false each generation prompt ends in an empty think block, on the Env path and in a
    chat session (whose agent may send the same variables), and a request asking for others is refused
    rather than rendered otherwise than the rest of its session."""
    off, seen, refused = {"enable_thinking": False}, [], []
    hi = [{"role": "user", "content": "hi"}]
    assert rendered(qwen_tok, hi, True, **off).endswith("<think>\n\n</think>\n\n")

    class Asker(ChatAgent):
        async def run(self, ctx: ChatContext) -> Result:
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
            messages = list(ctx.messages)
            for question in ("again", None):
                reply = await client.chat.completions.create(model=ctx.model_name, messages=messages,
                                                             extra_body={"chat_template_kwargs": off})
                seen.append((list(messages), reply.choices[0].message.model_dump(exclude_none=True)))
                if question:
                    messages += [seen[-1][1], {"role": "user", "content": question}]
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(model=ctx.model_name, messages=messages, extra_body={
                    "chat_template_kwargs": {"enable_thinking": True}})
            refused.append(err.value.message)
            return Result(reward=0.0)

    for kind, runner in (("env", StepEnvRunner(Again)), ("chat", ChatAgentRunner(Asker))):
        spec = make_spec({"module": "x.py", "max_turns": 3}, max_tokens=8)
        spec.model.chat_template_kwargs = off
        sampler = Recorder(engine, seed=0)
        runner.setup(qwen_tok, spec)
        try:
            [r] = run_all(runner, [{"prompt": "hi", "label": ""}], sampler, group=f"vars-{kind}")
        finally:
            runner.close()
        calls = [c for c in sampler.calls if c["key"] == r.rollout_id]
        if kind == "env":   # the Env's messages: each reply as text, then the observation
            texts = [qwen_tok.decode(c["out"]["token_ids"], skip_special_tokens=True) for c in calls]
            replies = [{"role": "assistant", "content": text} for text in texts]
            requests = [hi, hi + [replies[0], {"role": "user", "content": "again"}]]
        else:
            requests, replies = [m for m, _ in seen], [reply for _, reply in seen]
        seals = expected_seals(qwen_tok, requests, replies, **off)
        check_segments(qwen_tok, r, calls, requests, seals, **off)
    assert "differs from the run's model.chat_template_kwargs={'enable_thinking': False}" in refused[0]


def test_env_prompt_shows_every_tool_through_qwen3s_template(qwen_tok, engine):
    """The first prompt of the tool Env, with the flagship's tools (the row's) and one from agent.tools,
    decoded from the ids the engine read: Qwen3's tools block names each tool and each parameter."""
    from molt.agents import load_agent_runner
    from molt.spec import RunSpec
    from molt.tasks.tool_use import CALCULATOR, PYTHON

    add = {"type": "function", "function": {"name": "add", "description": "a+b", "parameters": {
        "type": "object", "properties": {"first": {"type": "integer"}, "second": {"type": "integer"}}}}}
    spec = RunSpec.model_validate({"model": {"max_model_len": 1024}, "rollout": {"max_tokens": 4}, "agent": {
        "module": str(EXAMPLES / "tool_env.py"), "tools": [add], "max_total_tokens": 1024}})
    runner, sampler = load_agent_runner(spec.agent), Recorder(engine)
    runner.setup(qwen_tok, spec)
    row = {"prompt": "What is 1234*5678?", "label": "7006652", "tools": [CALCULATOR, PYTHON]}
    [r] = run_all(runner, [row], sampler, group="qwen-tools")
    assert r.ok, r.error
    prompt = qwen_tok.decode(sampler.calls[0]["prompt_ids"])
    assert "<tools>" in prompt and prompt.endswith("What is 1234*5678?<|im_end|>\n<|im_start|>assistant\n")
    for tool in (add, CALCULATOR, PYTHON):
        fn = tool["function"]
        assert f'"name": "{fn["name"]}"' in prompt, fn["name"]
        for parameter in fn["parameters"]["properties"]:
            assert f'"{parameter}": {{"type": ' in prompt, parameter


def test_tool_parser_is_a_config_key(tok):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}}}}}]
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=tools)
    pythonic = tok.encode("[add(a=1)]", add_special_tokens=False)
    _, calls, _ = parse_reply(make_parser(tok, "pythonic"), tok, pythonic, request)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("add", {"a": 1})]
    assert parse_reply(make_parser(tok, "hermes"), tok, pythonic, request)[1] == []
    two = tok.encode("[add(a=1), add(a=2)]", add_special_tokens=False)
    assert len(parse_reply(make_parser(tok, "pythonic"), tok, two, request)[1]) == 2
    single = request.model_copy(update={"parallel_tool_calls": False})
    kept = parse_reply(make_parser(tok, "pythonic"), tok, two, single)[1]
    assert [json.loads(c["function"]["arguments"]) for c in kept] == [{"a": 1}]

    runner = ChatAgentRunner(ChatAgent)
    with pytest.raises(ValueError, match=r"tool_parser='nope' is not a vLLM tool parser; known: .*hermes"):
        runner.setup(tok, make_spec({"module": "x.py", "tool_parser": "nope"}))
    with pytest.raises(ValueError, match=r"agent.tool_parser='llama3_json' does not fit this tokenizer"):
        runner.setup(tok, make_spec({"module": "x.py", "tool_parser": "llama3_json"}))
    runner.setup(tok, make_spec({"module": "x.py", "tool_parser": "pythonic"}))
    try:
        assert type(runner.server.parser) is type(make_parser(tok, "pythonic"))
        forced = asyncio.run(_forced_call(runner))   # forced calls are decoded as Hermes markup
        assert forced.status_code == 400 and "does not read" in str(forced)
    finally:
        runner.close()


async def _forced_call(runner) -> openai.APIStatusError:
    from molt.agents.trace import Trace

    session = runner.server.open(Trace("r", "g"), None, 1, 100)
    client = openai.AsyncOpenAI(base_url=f"{runner.server.url}/s/{session.id}/v1", api_key=session.key,
                                max_retries=0)
    with pytest.raises(openai.APIStatusError) as err:
        await client.chat.completions.create(
            model=runner.server.model_name, messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
            tool_choice={"type": "function", "function": {"name": "add"}})
    return err.value


def test_every_forced_call_the_grammar_allows_is_valid_json():
    # Exhaustive over short spellings: a forced call whose arguments a JSON parser rejects (`{"x": 01}`)
    # is dropped by the tool parser, so the agent silently loses the turn.
    import itertools
    import re

    from molt.agents.tools import forced_call_regex

    tool = {"type": "function", "function": {"name": "f", "parameters": {"properties": {
        "i": {"type": "integer"}, "n": {"type": "number"}}}}}
    pattern = re.compile(forced_call_regex(tool))
    spellings = ["".join(c) for k in range(1, 5) for c in itertools.product("-0.19", repeat=k)]
    allowed = 0
    for i, n in itertools.product(spellings, spellings):
        text = f'<tool_call>{{"name": "f", "arguments": {{"i": {i}, "n": {n}}}}}</tool_call>'
        if pattern.fullmatch(text):
            allowed += 1
            args = json.loads(text[11:-12])["arguments"]
            assert isinstance(args["i"], int), text
    assert allowed > 100
    assert not pattern.fullmatch('<tool_call>{"name": "f", "arguments": {"i": 01, "n": 0}}</tool_call>')


def test_the_session_keeps_each_prompts_rendering_for_the_next_turns_glue(tok):
    """A continued turn's glue starts from the previous request's rendering, which the session keeps
    instead of rendering it again (molt.agents.session): after every turn it must be the template's
    rendering of that request, or the check that the reply left the prompt's text as it was compares
    against a stale one."""
    from molt.agents.render import render
    from molt.agents.session import ChatSession
    from molt.agents.trace import Trace

    session = ChatSession(Trace("r0", "g0"), tok, None, None, 8, 4096, {}, {})
    messages = [{"role": "user", "content": "a"}]
    for turn in range(3):
        session.prompt_ids(messages, None)
        assert session.history_text == render(tok, messages, None, True)
        text = "b" * (turn + 1)
        sampled = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        n = len(sampled)
        out = {"token_ids": sampled, "logprobs": [-1.0] * n, "versions": [0] * n, "finish_reason": "stop"}
        session.offer(out, {"role": "assistant", "content": text})
        messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": "c"}]
    assert session.trace.segments == [] and session.trace.turn == 2   # every turn continued the last one
