"""The ChatAgent path over real HTTP with the stock OpenAI and Anthropic SDKs, against the shared engine.

Trajectories are checked against the engine's own sampled ids (recorded at the sampler) and against the
chat template's rendering computed here, so a server that re-tokenized earlier turns, dropped a token
or trained on a prompt token would fail.
"""

from __future__ import annotations

import asyncio
import json
import re

import anthropic
import httpx
import openai
import pytest
import torch
from test_agents import EXAMPLES, Recorder, assert_exact, chat_ids, encode, make_spec, run_all, turn_glue

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result, load_agent_runner
from molt.agents.http import MAX_BODY_BYTES
from molt.agents.tools import forced_call_regex
from molt.agents.trace import Trace
from molt.algo.estimators import compute_advantages
from molt.spec import AlgoSpec

TOOLS_ITEM = {"messages": [{"role": "system", "content": "Use the tools."},
                           {"role": "user", "content": "What is 2+3?"}], "label": "5"}


@pytest.fixture()
def sampler(engine):
    return Recorder(engine)


@pytest.fixture()
def runners(tok):
    """Start chat runners (each with its own loopback server) and close them all after the test."""
    started = []

    def start(module, agent: dict | None = None, **rollout):
        module_name = module if isinstance(module, str) else "x.py"
        spec = make_spec({"module": module_name, **(agent or {})}, **rollout)
        runner = load_agent_runner(spec.agent) if isinstance(module, str) else ChatAgentRunner(module)
        runner.setup(tok, spec)
        started.append(runner)
        return runner

    yield start
    for runner in started:
        runner.close()


def trajectories(rollout) -> list[tuple]:
    return [(s.token_ids, s.loss_mask, s.versions, s.segment_index) for s in rollout.segments]


def test_chat_minimal_carries_sampled_ids_instead_of_retokenizing(tok, sampler, runners):
    runner = runners(str(EXAMPLES / "chat_minimal.py"), {"max_turns": 2, "options": {"turns": 2}})
    rollouts = run_all(runner, [{"prompt": "c", "label": "c"}] * 4, sampler)
    retokenized_differs = 0
    for r in rollouts:
        [calls] = assert_exact(r, [c for c in sampler.calls if c["key"] == r.rollout_id])
        first, second = calls
        sampled = first["out"]["token_ids"]
        assert first["prompt_ids"] == chat_ids(tok, [{"role": "user", "content": "c"}])
        assert second["prompt_ids"] == first["prompt_ids"] + sampled + turn_glue(tok, sampled, "user", "c")
        assert r.segments[0].token_ids == second["prompt_ids"] + second["out"]["token_ids"]
        content = sampled[:-1] if sampled[-1] == tok.eos_token_id else sampled
        retokenized_differs += encode(tok, tok.decode(content, skip_special_tokens=False)) != content
    # The sampled text re-tokenizes to other ids, so carrying the ids forward is what made this exact.
    assert retokenized_differs >= 1


def test_both_wires_streaming_or_not_give_identical_trajectories(tok, engine, runners):
    sampler = Recorder(engine, temperature=0.0)   # greedy: every wire must give the same tokens
    plain = {"max_turns": 2, "options": {"turns": 2}}
    results = []
    for module in ("chat_minimal.py", "chat_anthropic.py"):
        for stream in (False, True):
            agent = {**plain, "options": {**plain["options"], "stream": stream}}
            runner = runners(str(EXAMPLES / module), agent)
            [r] = run_all(runner, [{"prompt": "c", "label": "c"}], sampler, group=f"{module}{stream}")
            assert_exact(r, [c for c in sampler.calls if c["key"] == r.rollout_id])
            results.append(r)
    assert all(trajectories(r) == trajectories(results[0]) for r in results)
    assert all(r.reward == results[0].reward for r in results)
    for r in results:
        assert r.segments[0].logprobs == pytest.approx(results[0].segments[0].logprobs, abs=1e-4)


def test_tool_calls_on_both_wires_streaming_or_not(tok, engine, runners):
    sampler = Recorder(engine, temperature=0.0)
    forced_openai = {"type": "function", "function": {"name": "add"}}
    agents = [("chat_tools.py", {"tool_choice": forced_openai}),
              ("chat_anthropic.py", {"tools": True, "tool_choice": {"type": "tool", "name": "add"}})]
    results = []
    for module, options in agents:
        for stream in (False, True):
            agent = {"max_turns": 2, "max_total_tokens": 900, "options": {**options, "stream": stream}}
            runner = runners(str(EXAMPLES / module), agent, max_tokens=64)
            [r] = run_all(runner, [TOOLS_ITEM], sampler, group=f"{module}{stream}")
            [calls] = assert_exact(r, [c for c in sampler.calls if c["key"] == r.rollout_id])
            assert len(calls) == 2 and r.info == {"tool_calls": 1.0}
            # agent/* metrics: two turns, the one call the server parsed, no tool error; an answer when
            # the last reply (no longer forced) finished on its own without a call
            last = tok.decode(calls[1]["out"]["token_ids"], skip_special_tokens=False)
            answered = calls[1]["out"]["finish_reason"] == "stop" and "<tool_call>" not in last
            assert (r.turns, r.tool_calls, r.tool_errors, r.answered) == (2, 1, 0, answered)
            results.append(r)
    first, second = calls
    tools = [{"type": "function", "function": {"name": "add", "description": "a+b", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"]}}}]
    assert first["prompt_ids"] == chat_ids(tok, TOOLS_ITEM["messages"], tools)
    # The engine sampled a Hermes call (constrained to the tool's schema); the server parsed it with
    # vLLM's parser, the agent ran it, and the tool's answer came back as the template's tool turn.
    sampled = first["out"]["token_ids"]
    text = tok.decode(sampled[:-1] if sampled[-1] == tok.eos_token_id else sampled, skip_special_tokens=False)
    assert re.fullmatch(forced_call_regex(tools[0]), text)
    args = json.loads(text[len("<tool_call>"):-len("</tool_call>")])["arguments"]
    glue = turn_glue(tok, sampled, "tool", str(args["a"] + args["b"]))
    assert second["prompt_ids"] == first["prompt_ids"] + sampled + glue
    assert all(trajectories(r) == trajectories(results[0]) for r in results)


def test_n_choices_the_trajectory_follows_the_choice_the_agent_continues(tok, sampler, runners):
    class PickSecond(ChatAgent):
        async def run(self, ctx: ChatContext) -> Result:
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
            reply = await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages, n=2,
                                                         seed=3)
            assert len(reply.choices) == 2
            messages = ctx.messages + [reply.choices[1].message.model_dump(exclude_none=True),
                                       {"role": "user", "content": "again"}]
            await client.chat.completions.create(model=ctx.model_name, messages=messages)
            return Result(reward=0.5)

    runner = runners(PickSecond, {"max_turns": 2})
    [r] = run_all(runner, [{"prompt": "d", "label": "d"}], sampler)
    calls = [c for c in sampler.calls if c["key"] == r.rollout_id]
    assert len(calls) == 3 and calls[0]["out"]["token_ids"] != calls[1]["out"]["token_ids"]
    [mine] = assert_exact(r, calls)
    assert [c["sampling"].get("seed") for c in mine] == [4, None]   # choice 1, then the next turn
    assert r.reward == 0.5


def test_a_reply_edited_before_it_is_sent_back_restarts_the_segment(tok, sampler, runners):
    """An agent that changes the last character of the reply it got before sending it back: that is not the
    sampled reply, so the first segment ends with the reply as sampled and a second one starts from the
    edited conversation, rendered whole (an echo taken as unchanged would train the edited text's tokens
    as sampled ones, or glue the next turn after ids the agent never sent)."""
    sent: list[list[dict]] = []   # the conversations the agents sent back

    class EditLast(ChatAgent):
        async def run(self, ctx: ChatContext) -> Result:
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key,
                                        http_client=ctx.http_client)
            reply = await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
            text = reply.choices[0].message.content or ""
            edited = text[:-1] + ("b" if text.endswith("a") else "a")
            messages = ctx.messages + [{"role": "assistant", "content": edited},
                                       {"role": "user", "content": "again"}]
            sent.append(messages)
            await client.chat.completions.create(model=ctx.model_name, messages=messages)
            return Result(reward=1.0)

    runner = runners(EditLast, {"max_turns": 2})
    for r in run_all(runner, [{"prompt": "f", "label": "f"}] * 2, sampler):
        first, second = assert_exact(r, [c for c in sampler.calls if c["key"] == r.rollout_id])
        assert len(first) == 1 and len(second) == 1
        assert second[0]["prompt_ids"] in [chat_ids(tok, messages) for messages in sent]


def test_a_compacting_agent_makes_segments_that_share_one_reward(tok, sampler, runners):
    runner = runners(str(EXAMPLES / "chat_compact.py"), {"max_turns": 3, "options": {"keep_turns": 2}})
    minimal = runners(str(EXAMPLES / "chat_minimal.py"))
    item = {"prompt": "e", "label": "e"}
    [compact] = run_all(runner, [item], sampler, group="g")
    others = run_all(minimal, [item] * 3, sampler, group="g")
    per_segment = assert_exact(compact, [c for c in sampler.calls if c["key"] == compact.rollout_id])
    assert [len(calls) for calls in per_segment] == [2, 1]
    summary = [{"role": "system", "content": "summary: 2 replies so far"}, {"role": "user", "content": "e"}]
    assert per_segment[1][0]["prompt_ids"] == chat_ids(tok, summary)
    assert {s.rollout_id for s in compact.segments} == {compact.rollout_id}

    # Group baselines are taken over rollouts: the two segments are one sample of the group. Rewards are
    # set to distinct values so the baseline is not degenerate; the segment structure is the real one.
    rollouts = [compact] + others
    rewards = torch.tensor([0.9, 0.1, 0.3, 0.5])
    segments = [(i, s) for i, r in enumerate(rollouts) for s in r.segments]
    width = max(len(s.token_ids) for _, s in segments)
    mask = torch.tensor([s.loss_mask + [0] * (width - len(s.loss_mask)) for _, s in segments])
    seg_rollout = torch.tensor([i for i, _ in segments])
    adv = compute_advantages(rewards, torch.zeros(4, dtype=torch.long), seg_rollout, mask,
                             AlgoSpec(estimator="grpo")).advantages
    expected = (0.9 - rewards.mean()) / (rewards.std() + 1e-6)
    for row in (0, 1):   # both segments of the compacting rollout
        assert torch.allclose(adv[row][mask[row] > 0], expected.expand(int(mask[row].sum())), atol=1e-5)


def test_bad_requests_get_4xx_and_leave_the_trajectory_unchanged(tok, sampler, runners):
    seen: dict[str, tuple] = {}

    class Prober(ChatAgent):
        async def run(self, ctx: ChatContext) -> Result:
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
            reply = await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
            session = next(iter(runner.server.sessions.values()))
            state = lambda: (list(session.trace.ids), len(session.trace.segments), len(session.candidates))  # noqa: E731
            before = state()
            auth = {"authorization": f"Bearer {ctx.api_key}"}
            other = runner.server.open(Trace("other", "g"), sampler, 1, 100)   # a live neighbour session
            async with httpx.AsyncClient() as http:
                for wire, path in (("openai", "/v1/chat/completions"), ("anthropic", "/v1/messages")):
                    url = ctx.session_url + path
                    body = json.dumps({"model": "m", "messages": ctx.messages, "max_tokens": 4})
                    cases = {
                        "wrong_key": http.post(url, content=body, headers={"x-api-key": "sk-other"}),
                        "other_key": http.post(url, content=body,
                                               headers={"authorization": f"Bearer {other.key}"}),
                        "unknown": http.post(url.replace(ctx.session_url, ctx.session_url[:-4] + "dead"),
                                             content=body, headers=auth),
                        "malformed": http.post(url, content=b"{not json", headers=auth),
                        "no_messages": http.post(url, content=b'{"model": "m"}', headers=auth),
                        "oversized": http.post(url, content=b" " * (MAX_BODY_BYTES + 1), headers=auth),
                    }
                    for name, request in cases.items():
                        response = await request
                        seen[f"{wire}/{name}"] = (response.status_code, response.json())
                        assert state() == before, name
            with pytest.raises(openai.AuthenticationError, match="invalid API key"):
                await openai.AsyncOpenAI(base_url=ctx.base_url, api_key="sk-nope", max_retries=0) \
                    .chat.completions.create(model=ctx.model_name, messages=ctx.messages)
            with pytest.raises(anthropic.NotFoundError, match="unknown session"):
                await anthropic.AsyncAnthropic(base_url=ctx.session_url + "x", api_key=ctx.api_key,
                                               max_retries=0).messages.create(
                    model=ctx.model_name, messages=ctx.messages, max_tokens=4)
            assert state() == before and other.trace.ids == []
            runner.server.close(other)
            # The agent then continues normally: its next turn extends the same trajectory.
            messages = ctx.messages + [reply.choices[0].message.model_dump(exclude_none=True),
                                       {"role": "user", "content": "again"}]
            await client.chat.completions.create(model=ctx.model_name, messages=messages)
            seen["key"] = (ctx.base_url, ctx.api_key)
            return Result(reward=1.0)

    runner = runners(Prober, {"max_turns": 2})
    [r] = run_all(runner, [{"prompt": "f", "label": "f"}], sampler)
    [calls] = assert_exact(r, [c for c in sampler.calls if c["key"] == r.rollout_id])
    assert len(calls) == 2
    expected = {"wrong_key": 401, "other_key": 401, "unknown": 404, "malformed": 400, "no_messages": 400,
                "oversized": 413}
    for name, status in expected.items():
        code, openai_body = seen[f"openai/{name}"]
        assert code == status and openai_body["error"]["message"] and openai_body["error"]["code"] == status
        code, anthropic_body = seen[f"anthropic/{name}"]
        assert code == status and anthropic_body["type"] == "error" and anthropic_body["error"]["message"]

    async def after_close():
        base_url, key = seen["key"]
        with pytest.raises(openai.NotFoundError, match="unknown session"):
            await openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}])
    asyncio.run(after_close())


def test_a_failing_chat_agent_gives_an_error_rollout(tok, sampler, runners):
    class Crashes(ChatAgent):
        async def run(self, ctx: ChatContext) -> Result:
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
            await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
            raise ValueError("tool broke")

    class NoReward(ChatAgent):
        async def run(self, ctx: ChatContext) -> Result:
            return Result(reward="high")

    for agent, message in ((Crashes, "ValueError: tool broke"), (NoReward, "reward must be a finite number")):
        runner = runners(agent)
        [r] = run_all(runner, [{"prompt": "g", "label": "g"}], sampler)
        assert not r.ok and message in r.error and r.segments == []
        assert runner.server.sessions == {}   # the failed rollout's session is closed
    runner = runners(Crashes)   # a row the runner cannot make messages of fails before the agent runs
    [r] = run_all(runner, [{"label": "g"}], sampler)
    assert not r.ok and "dataset row has neither 'prompt' nor 'messages'" in r.error
    assert runner.server.sessions == {}


def test_a_chat_agent_rewards_its_turns_for_turn_credit(tok, sampler, runners):
    """`ctx.reward_turn` adds to the reward of the latest reply (twice on one reply: the sum), a reply it
    never names gets 0, and Result.reward lands on the last reply; the rollout's reward is their sum. Turn
    credit then gives each turn's tokens its return from that turn on (d = 0.5): 0.5 + 0.5 * (0 + 0.5 * 1),
    0.5 * 1 and 1. A reward before the first reply fails the rollout."""
    from molt.driver.select import turn_credit
    from molt.spec import RunSpec
    from molt.trainer.batch import make_batch

    class Rewarded(ChatAgent):
        async def run(self, ctx: ChatContext) -> Result:
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key,
                                        http_client=ctx.http_client)
            messages = list(ctx.messages)
            for turn in range(3):
                reply = await client.chat.completions.create(model=ctx.model_name, messages=messages)
                messages += [reply.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": "more"}]
                if turn == 0:
                    ctx.reward_turn(0.25)
                    ctx.reward_turn(0.25)
            return Result(reward=1.0)

    class Early(ChatAgent):
        async def run(self, ctx: ChatContext) -> Result:
            ctx.reward_turn(1.0)
            return Result(reward=0.0)

    [r] = run_all(runners(Rewarded, {"max_turns": 3}), [{"prompt": "h", "label": "h"}], sampler)
    assert (r.turn_rewards, r.reward, r.turns) == ([0.5, 0.0, 1.0], 1.5, 3)
    algo = {"estimator": "rloo", "turn_credit": "turn", "turn_discount": 0.5}
    spec = RunSpec.model_validate({"algo": algo})
    mask = make_batch(r.segments)["loss_mask"]
    first, extra = turn_credit(spec, [r], torch.tensor([r.reward]), r.segments, mask.shape)
    [segment] = r.segments
    starts = [start for _, start in segment.turns] + [len(segment.token_ids)]
    assert [turn for turn, _ in segment.turns] == [0, 1, 2] and first.tolist() == [0.75]
    for turn, expected in enumerate((0.75, 0.5, 1.0)):
        span = slice(starts[turn], starts[turn + 1])
        sampled = mask[0, span] > 0
        assert sampled.any() and extra["turn_returns"][0, span][sampled].eq(expected).all()
    [failed] = run_all(runners(Early), [{"prompt": "h", "label": "h"}], sampler)
    assert not failed.ok and "reward_turn before the model's first reply" in failed.error


def test_chat_context_urls_and_options(tok, sampler, runners):
    got = {}

    class Echo(ChatAgent):
        async def run(self, ctx: ChatContext) -> Result:
            got.update(vars(ctx))
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
            await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
            return Result(reward=0.0, score=2.0, info={"turns": 1})

    [r] = run_all(runners(Echo, {"options": {"k": 1}}), [{"prompt": "h", "label": "h"}], sampler)
    assert got["base_url"].startswith("http://127.0.0.1:") and got["base_url"].endswith("/v1")
    assert got["session_url"] + "/v1" == got["base_url"] and got["api_key"].startswith("sk-")
    assert got["prompt"] == "h" and got["label"] == "h" and got["options"] == {"k": 1}
    assert got["messages"] == [{"role": "user", "content": "h"}]
    assert got["sampling_params"] == {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 8}
    assert r.score == 2.0 and r.info == {"turns": 1.0}


def test_the_lent_http_client_bypasses_proxies_survives_the_agent_and_closes_after(tok, sampler, runners,
                                                                                  monkeypatch):
    """ctx.http_client: both SDKs reach the server through it although the environment names a dead proxy
    (which an SDK's own client takes), an SDK closing it (`async with`) is allowed, its timeout is the
    rollout's, each rollout gets its own, and the runner closes it when the rollout ends."""
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ALL_PROXY", "http://127.0.0.1:9")   # nothing listens on the discard port
    lent = []

    class Lent(ChatAgent):
        async def run(self, ctx: ChatContext) -> Result:
            lent.append(ctx.http_client)
            assert ctx.http_client.timeout.read == 60.0   # agent.timeout_s
            with pytest.raises(openai.APIConnectionError):   # the SDK's own client goes through the proxy
                await openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) \
                    .chat.completions.create(model=ctx.model_name, messages=ctx.messages)
            an = anthropic.AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key,
                                          http_client=ctx.http_client, max_retries=0)
            await an.messages.create(model=ctx.model_name, messages=ctx.messages, max_tokens=4)
            async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0,
                                          http_client=ctx.http_client) as oa:
                await oa.chat.completions.create(model=ctx.model_name, messages=ctx.messages, max_tokens=4)
            assert ctx.http_client.is_closed
            return Result(reward=1.0)

    rollouts = run_all(runners(Lent, {"max_turns": 2}), [{"prompt": "p", "label": "p"}] * 2, sampler)
    assert all(r.ok for r in rollouts), [r.error for r in rollouts]
    assert len({id(c) for c in lent}) == 2 and all(c.is_closed for c in lent)

    class LeavesItOpen(ChatAgent):
        async def run(self, ctx: ChatContext) -> Result:
            lent.append(ctx.http_client)
            oa = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, http_client=ctx.http_client)
            await oa.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
            assert not ctx.http_client.is_closed
            return Result(reward=1.0)

    [r] = run_all(runners(LeavesItOpen), [{"prompt": "q", "label": "q"}], sampler)
    assert r.ok and lent[-1].is_closed


def test_stop_token_ids_and_ignore_eos_end_the_reply_where_asked(tok, engine, runners):
    """vLLM's two request fields that only say where a reply ends reach the engine on the training path:
    with ignore_eos the reply runs to max_tokens, with stop_token_ids it ends at the first stop token
    (included, finish reason "stop"); the trajectories stay token-exact, and the next turn closes a reply
    that did not end on eos with the template's end marker."""
    sampler, replies = Recorder(engine, training=True), {}

    class Stops(ChatAgent):
        async def run(self, ctx: ChatContext) -> Result:
            oa = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, http_client=ctx.http_client)
            reply = await oa.chat.completions.create(model=ctx.model_name, messages=ctx.messages, seed=3,
                                                     extra_body=ctx.options["extra"])
            replies[ctx.options["name"]] = reply
            again = [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "a"}]
            await oa.chat.completions.create(model=ctx.model_name, messages=ctx.messages + again)
            return Result(reward=1.0)

    def run(name: str, extra: dict) -> dict:
        runner = runners(Stops, {"max_turns": 2, "options": {"name": name, "extra": extra}})
        [r] = run_all(runner, [{"prompt": "s", "label": "s"}], sampler, group=name)
        [[call, then]] = assert_exact(r, [c for c in sampler.calls if c["key"] == r.rollout_id])
        ids = call["out"]["token_ids"]
        assert then["prompt_ids"] == call["prompt_ids"] + ids + turn_glue(tok, ids, "user", "a")
        assert "ignore_eos" not in then["sampling"] and "stop_token_ids" not in then["sampling"]
        return call

    free = run("free", {"ignore_eos": True})
    ids = free["out"]["token_ids"]
    assert free["sampling"]["ignore_eos"] is True
    assert len(ids) == 8 and free["out"]["finish_reason"] == "length"
    stop = ids[3]
    stopped = run("stopped", {"ignore_eos": True, "stop_token_ids": [stop]})
    assert stopped["sampling"]["stop_token_ids"] == [stop]
    assert stopped["out"]["token_ids"] == ids[:ids.index(stop) + 1]   # the same seed samples the same tokens
    assert stopped["out"]["finish_reason"] == "stop" and replies["stopped"].choices[0].finish_reason == "stop"


# Fields vLLM's schemas accept that the loopback server does not apply, with a value away from the default
# and the reason the 400 gives: each would be silently dropped otherwise.
DISTRIBUTION, RENDER, MISSING = "sampling distribution", "how the prompt is rendered", "not implemented"
RUN_VARIABLES = "differs from the run's model.chat_template_kwargs={}"   # the run's are accepted
REFUSED_OPENAI = {
    "min_p": (0.2, DISTRIBUTION), "repetition_penalty": (1.3, DISTRIBUTION), "min_tokens": (5, DISTRIBUTION),
    "allowed_token_ids": ([1, 2], DISTRIBUTION), "bad_words": (["x"], DISTRIBUTION),
    "use_beam_search": (True, DISTRIBUTION), "length_penalty": (0.5, DISTRIBUTION),
    "thinking_token_budget": (10, DISTRIBUTION), "stop": (["x"], MISSING),
    "chat_template_kwargs": ({"enable_thinking": False}, RUN_VARIABLES),
    "add_generation_prompt": (False, RENDER),
    "continue_final_message": (True, RENDER), "reasoning_effort": ("low", RENDER),
    "a_future_vllm_field": (1, MISSING)}   # unknown to the schema: refused too, not ignored
REFUSED_ANTHROPIC = {
    "thinking.budget_tokens": ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, DISTRIBUTION),
    "output_config.effort": ({"extra_body": {"output_config": {"effort": "low"}}}, RENDER),
    "thinking.type=disabled": ({"thinking": {"type": "disabled"}}, RENDER),
    "chat_template_kwargs": ({"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
                             RUN_VARIABLES)}


def test_parameters_the_server_does_not_apply_are_refused_not_dropped(tok, sampler, runners):
    errors: dict[str, Exception] = {}

    class Prober(ChatAgent):
        async def run(self, ctx: ChatContext) -> Result:
            oa = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
            an = anthropic.AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key, max_retries=0)
            session = next(iter(runner.server.sessions.values()))
            calls = {f"openai/{k}": oa.chat.completions.create(model=ctx.model_name, messages=ctx.messages,
                                                                extra_body={k: v})
                     for k, (v, _) in REFUSED_OPENAI.items()}
            calls["responses/min_p"] = oa.responses.create(model=ctx.model_name, input=ctx.messages,
                                                           extra_body={"min_p": 0.2})
            calls["responses/reasoning"] = oa.responses.create(model=ctx.model_name, input=ctx.messages,
                                                               reasoning={"effort": "low"})
            calls.update({f"anthropic/{k}": an.messages.create(model=ctx.model_name, messages=ctx.messages,
                                                               max_tokens=2000, **kw)
                          for k, (kw, _) in REFUSED_ANTHROPIC.items()})
            for name, call in calls.items():
                with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)) as err:
                    await call
                errors[name] = err.value
                assert session.trace.ids == [] and session.turns == 0, name   # refused before the session
            # The same fields at their defaults are accepted, and the engine samples with the run's sampling.
            defaults = {"min_p": 0, "repetition_penalty": 1, "min_tokens": 0, "allowed_token_ids": None,
                        "bad_words": [], "use_beam_search": False, "length_penalty": 1.0,
                        "stop_token_ids": [], "ignore_eos": False, "add_generation_prompt": True,
                        "continue_final_message": False, "chat_template_kwargs": {}}
            await oa.chat.completions.create(model=ctx.model_name, messages=ctx.messages, extra_body=defaults)
            await an.messages.create(model=ctx.model_name, messages=ctx.messages, max_tokens=8,
                                     thinking={"type": "adaptive"})   # pins nothing in vLLM either
            return Result(reward=1.0)

    runner = runners(Prober, {"max_turns": 2})
    [r] = run_all(runner, [{"prompt": "k", "label": "k"}], sampler)
    assert r.ok, r.error
    expected = {**{f"openai/{k}": (k, why) for k, (_, why) in REFUSED_OPENAI.items()},
                "responses/min_p": ("min_p", DISTRIBUTION), "responses/reasoning": ("reasoning", RENDER),
                **{f"anthropic/{k}": (k, why) for k, (_, why) in REFUSED_ANTHROPIC.items()}}
    for name, (field, why) in expected.items():
        message = str(errors[name])
        assert errors[name].status_code == 400 and field in message and why in message, (name, message)
        if name.endswith("/chat_template_kwargs"):   # refused earlier, by its own rule
            continue
        applies = message.split("this wire applies: ")[1]   # each wire names its own fields
        assert ("stop_token_ids" in applies) == name.startswith("openai/"), (name, applies)
    assert [c["sampling"] for c in sampler.calls] == [
        {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 8}] * 2
