"""The loopback server's OpenAI Responses API (`/v1/responses`) with the stock OpenAI SDK, against the shared
engine: a tool-calling conversation over two turns, streamed or not, gives exactly the trajectory the same
conversation gives over `/v1/chat/completions` (greedy), and requests the server does not implement are
refused with the SDK's readable errors, leaving the trajectory untouched.
"""

from __future__ import annotations

import json

import openai
import pytest
from test_agents import EXAMPLES, Recorder, assert_exact, make_spec, run_all
from test_agents_chat import TOOLS_ITEM, trajectories

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result, load_agent_runner

ADD = {"type": "function", "name": "add", "description": "a+b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}
AGENT = {"max_turns": 2, "max_total_tokens": 900}


class ResponsesTools(ChatAgent):
    """chat_tools.py's conversation over the Responses API: a forced `add` call, its output, one more turn."""

    async def run(self, ctx: ChatContext) -> Result:
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        items, stream = list(ctx.messages), self.options["stream"]
        choice = {"type": "function", "name": "add"}
        for _ in range(2):
            reply = await client.responses.create(model=ctx.model_name, input=items, tools=[ADD],
                                                  tool_choice=choice, stream=stream)
            if stream:
                events = [event async for event in reply]
                assert events[0].type == "response.created" and events[-1].type.startswith("response.")
                reply = events[-1].response
            items += [item.model_dump(exclude_none=True) for item in reply.output]
            calls = [item for item in reply.output if item.type == "function_call"]
            for call in calls:
                args = json.loads(call.arguments)
                items.append({"type": "function_call_output", "call_id": call.call_id,
                              "output": str(args["a"] + args["b"])})
            choice = "auto"
        return Result(reward=1.0, info={"tool_calls": float(len(items) - len(ctx.messages) > 2)})


def test_responses_wire_is_token_exact_and_equals_chat_completions(tok, engine):
    sampler = Recorder(engine, temperature=0.0)   # greedy: every wire must give the same tokens
    results = []
    for stream in (False, True):
        runner = ChatAgentRunner(ResponsesTools)
        agent = {"module": "x.py", **AGENT, "options": {"stream": stream}}
        runner.setup(tok, make_spec(agent, max_tokens=64))
        try:
            [r] = run_all(runner, [TOOLS_ITEM], sampler, group=f"resp{stream}")
        finally:
            runner.close()
        [calls] = assert_exact(r, [c for c in sampler.calls if c["key"] == r.rollout_id])
        assert len(calls) == 2
        results.append(r)
    spec = make_spec_chat_tools()
    chat = load_agent_runner(spec.agent)
    chat.setup(tok, spec)
    try:
        [reference] = run_all(chat, [TOOLS_ITEM], sampler, group="chat")
    finally:
        chat.close()
    assert_exact(reference, [c for c in sampler.calls if c["key"] == reference.rollout_id])
    assert all(trajectories(r) == trajectories(reference) for r in results)


def make_spec_chat_tools():
    options = {"tool_choice": {"type": "function", "function": {"name": "add"}}}
    return make_spec({"module": str(EXAMPLES / "chat_tools.py"), **AGENT, "options": options},
                     max_tokens=64)


@pytest.mark.parametrize("extra, status, message", [
    ({"previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ({"model": "gpt-4o"}, 404, "model 'gpt-4o' not found"),
    ({"input": [{"type": "nonsense"}]}, 400, "invalid request"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [ADD]}, 400, "not found in 'tools'"),
    ({"tools": [{"type": "web_search"}]}, 400, "runs no hosted tools"),
])
def test_responses_refusals_are_readable_and_change_nothing(tok, engine, extra, status, message):
    seen = {}

    class Prober(ChatAgent):
        async def run(self, ctx: ChatContext) -> Result:
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
            session = next(iter(runner.server.sessions.values()))
            before = list(session.trace.ids)
            with pytest.raises(openai.APIStatusError) as err:
                await client.responses.create(**{"model": ctx.model_name, "input": ctx.messages, **extra})
            seen["error"] = err.value
            assert session.trace.ids == before and session.turns == 0, seen
            await client.responses.create(model=ctx.model_name, input=ctx.messages)
            return Result(reward=0.0)

    runner = ChatAgentRunner(Prober)
    runner.setup(tok, make_spec({"module": "x.py"}))
    try:
        [r] = run_all(runner, [{"prompt": "h", "label": "h"}], Recorder(engine))
    finally:
        runner.close()
    assert r.ok, r.error
    assert seen["error"].status_code == status and message in str(seen["error"]), str(seen["error"])
