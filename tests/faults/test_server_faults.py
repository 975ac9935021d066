"""Loopback server faults through the real OpenAI and Anthropic SDKs, against the shared engine:
loopback-only binding, unknown model, parameters the server does not implement and over-long prompts
each raise the SDK's own readable exception and leave the trajectory untouched.

(Keys, cross-session access, malformed JSON and body size limits: tests/test_agents_chat.py.)
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import anthropic
import openai
from faultlib import small_spec

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result
from molt.rollout.router import Router

LONG = "word " * 600   # far more than agent.max_total_tokens=256 once tokenized


def listening_hosts(port: int) -> set[str]:
    """Local addresses of the sockets listening on `port`, read from the kernel's own table."""
    hosts = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            host, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:   # 0A = LISTEN
                hosts.add(".".join(str(int(host[i:i + 2], 16)) for i in (6, 4, 2, 0)) if len(host) == 8
                          else host)
    return hosts


def test_bad_requests_raise_readable_sdk_errors(tok, engine):
    seen: dict[str, object] = {}

    class Prober(ChatAgent):
        async def run(self, ctx: ChatContext) -> Result:
            oa = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
            an = anthropic.AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key, max_retries=0)
            msgs = ctx.messages
            calls = {
                "openai/model": oa.chat.completions.create(model="gpt-4o", messages=msgs),
                "anthropic/model": an.messages.create(model="claude-x", messages=msgs, max_tokens=4),
                "openai/logit_bias": oa.chat.completions.create(model=ctx.model_name, messages=msgs,
                                                                logit_bias={"5": 10}),
                "openai/stop": oa.chat.completions.create(model=ctx.model_name, messages=msgs, stop=["x"]),
                "openai/json": oa.chat.completions.create(model=ctx.model_name, messages=msgs,
                                                          response_format={"type": "json_object"}),
                "anthropic/stop": an.messages.create(model=ctx.model_name, messages=msgs, max_tokens=4,
                                                     stop_sequences=["x"]),
                "openai/long": oa.chat.completions.create(
                    model=ctx.model_name, messages=[{"role": "user", "content": LONG}]),
                "anthropic/long": an.messages.create(
                    model=ctx.model_name, messages=[{"role": "user", "content": LONG}], max_tokens=4),
            }
            session = next(iter(runner.server.sessions.values()))
            for name, call in calls.items():
                try:
                    await call
                except (openai.APIStatusError, anthropic.APIStatusError) as err:
                    seen[name] = err
                if not name.endswith("/long"):   # refused before the request touched the session
                    seen.setdefault("untouched", True)
                    seen["untouched"] &= session.trace.ids == [] and session.turns == 0
            # Defaults sent explicitly are fine, and the agent carries on normally afterwards.
            await oa.chat.completions.create(model=ctx.model_name, messages=msgs, presence_penalty=0,
                                             response_format={"type": "text"})
            return Result(reward=1.0)

    spec = small_spec({"kind": "chat", "max_turns": 4, "max_total_tokens": 256})
    runner = ChatAgentRunner(Prober)
    runner.setup(tok, spec)
    try:
        url_host = runner.server.url.split("//")[1].split(":")[0]
        assert url_host == "127.0.0.1" and listening_hosts(int(runner.server.url.rsplit(":", 1)[1])) == {
            "127.0.0.1"}
        rollout = asyncio.run(runner.run({"prompt": "hi", "label": "x"}, "r0", "g", Router([engine])))
    finally:
        runner.close()
    assert rollout.ok and rollout.num_sampled > 0 and seen["untouched"] is True
    expected = {
        "openai/model": (openai.NotFoundError, "model 'gpt-4o' not found: this server serves"),
        "anthropic/model": (anthropic.NotFoundError, "model 'claude-x' not found"),
        "openai/logit_bias": (openai.BadRequestError, r"unsupported parameter\(s\) \['logit_bias'\]"),
        "openai/stop": (openai.BadRequestError, r"unsupported parameter\(s\) \['stop'\]"),
        "openai/json": (openai.BadRequestError, r"unsupported parameter\(s\) \['response_format'\]"),
        "anthropic/stop": (anthropic.BadRequestError, r"unsupported parameter\(s\) \['stop_sequences'\]"),
        "openai/long": (openai.BadRequestError, "no room left under agent.max_total_tokens=256"),
        "anthropic/long": (anthropic.BadRequestError, "no room left under agent.max_total_tokens=256"),
    }
    for name, (kind, message) in expected.items():
        assert isinstance(seen.get(name), kind), (name, seen.get(name))
        assert re.search(message, str(seen[name])), (name, str(seen[name]))
