"""Loopback server faults through the real OpenAI and Anthropic SDKs and raw sockets, against the shared
engine: loopback-only binding, unknown model, parameters the server does not implement and over-long
prompts raise the SDK's own readable exception; another session's key or a guessed session id gets
nothing; slow (slowloris), malformed and oversized requests are answered or dropped while other sessions
go on; a client that disconnects aborts its engine request; hundreds of concurrent sessions with client
timeouts, cancellations and abandoned streams all end token-exact, leaving no session, dispatcher entry or
engine request behind.

(Malformed JSON and body size limits through each wire: tests/test_agents_chat.py.)
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from pathlib import Path

import anthropic
import httpx
import openai
from faultlib import small_spec
from test_agents import Recorder, assert_exact

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result
from molt.agents import http as connections
from molt.agents.server import LoopbackServer
from molt.agents.trace import Trace
from molt.rollout.dispatch import Dispatcher

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
                "openai/penalty": oa.chat.completions.create(model=ctx.model_name, messages=msgs,
                                                             frequency_penalty=0.5),
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

    spec = small_spec({"max_turns": 4, "max_total_tokens": 256})
    runner = ChatAgentRunner(Prober)
    runner.setup(tok, spec)
    try:
        url_host = runner.server.url.split("//")[1].split(":")[0]
        assert url_host == "127.0.0.1" and listening_hosts(int(runner.server.url.rsplit(":", 1)[1])) == {
            "127.0.0.1"}
        rollout = asyncio.run(runner.run({"prompt": "hi", "label": "x"}, "r0", "g", Dispatcher([engine])))
    finally:
        runner.close()
    assert rollout.ok and rollout.num_sampled > 0 and seen["untouched"] is True
    expected = {
        "openai/model": (openai.NotFoundError, "model 'gpt-4o' not found: this server serves"),
        "anthropic/model": (anthropic.NotFoundError, "model 'claude-x' not found"),
        "openai/logit_bias": (openai.BadRequestError, r"unsupported parameter\(s\) \['logit_bias'\]"),
        "openai/stop": (openai.BadRequestError, r"unsupported parameter\(s\) \['stop'\]"),
        "openai/penalty": (openai.BadRequestError, r"unsupported parameter\(s\) \['frequency_penalty'\]"),
        "anthropic/stop": (anthropic.BadRequestError, r"unsupported parameter\(s\) \['stop_sequences'\]"),
        "openai/long": (openai.BadRequestError, "no room left under agent.max_total_tokens=256"),
        "anthropic/long": (anthropic.BadRequestError, "no room left under agent.max_total_tokens=256"),
    }
    for name, (kind, message) in expected.items():
        assert isinstance(seen.get(name), kind), (name, seen.get(name))
        assert re.search(message, str(seen[name])), (name, str(seen[name]))


SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 4}
HI = [{"role": "user", "content": "hi"}]


def started(tok, **sampling) -> LoopbackServer:
    server = LoopbackServer(tok, "molt-tiny", {**SAMPLING, **sampling})
    server.start()
    return server


async def ask(server: LoopbackServer, session, messages: list[dict] = HI, **kw):
    """One chat completion of `session` through the OpenAI SDK."""
    async with openai.AsyncOpenAI(base_url=f"{server.url}/s/{session.id}/v1", api_key=session.key,
                                  max_retries=0, timeout=60) as client:
        return await client.chat.completions.create(model="molt-tiny", messages=messages, **kw)


def state(session) -> tuple:
    t = session.trace
    return list(t.ids), list(t.mask), len(t.segments), session.turns, len(session.candidates)


def test_a_session_cannot_touch_another_with_its_key_or_a_guessed_id(tok, engine):
    server = started(tok)

    async def main() -> tuple:
        dispatcher = Dispatcher([engine])
        a = server.open(Trace("a", "g"), dispatcher, 4, 256)
        b = server.open(Trace("b", "g"), dispatcher, 4, 256)
        await ask(server, a)
        reply = (await ask(server, b)).choices[0]
        before = state(b)
        turn = HI + [reply.message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
        body = {"model": "molt-tiny", "messages": turn, "max_tokens": 4}
        bearer = lambda key: {"authorization": f"Bearer {key}"}  # noqa: E731
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            seen = {
                "openai_other_key": (await http.post(f"/s/{b.id}/v1/chat/completions", json=body,
                                                     headers=bearer(a.key))).status_code,
                "anthropic_other_key": (await http.post(f"/s/{b.id}/v1/messages", json=body,
                                                        headers={"x-api-key": a.key})).status_code,
                "read": {(await http.get(path, headers=bearer(b.key))).status_code
                         for path in (f"/s/{b.id}/v1/chat/completions", f"/s/{b.id}", f"/s/{b.id}/v1")},
            }
            guesses = [(secrets.token_hex(8), key) for _ in range(100) for key in (a.key, b.key)]
            replies = await asyncio.gather(*[http.post(f"/s/{sid}/v1/chat/completions", json=body,
                                                       headers=bearer(key)) for sid, key in guesses])
            seen["guessed"] = {r.status_code for r in replies}
        untouched = state(b) == before
        # b itself carries on from exactly where it was
        await ask(server, b, turn)
        return seen, untouched, before, state(b)

    try:
        seen, untouched, before, after = asyncio.run(main())
    finally:
        server.stop()
    assert seen == {"openai_other_key": 401, "anthropic_other_key": 401, "read": {404, 405}, "guessed": {404}}
    assert untouched and after[0][:len(before[0])] == before[0] and after[3] == 2


RESET = b"<connection reset>"


async def raw_exchange(port: int, payload: bytes, drip: bytes = b"",
                       stop: asyncio.Event | None = None) -> bytes:
    """Send `payload`, then one byte of `drip` every 0.2 s until the server hangs up (or `stop` is set);
    returns everything the server sent before closing. Bounded: 60 s at most."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)

    async def dribble() -> None:
        for byte in drip:
            await asyncio.sleep(0.2)
            if stop is not None and stop.is_set():
                writer.close()   # the client gives up
                return
            writer.write(bytes([byte]))
            await writer.drain()

    dribbling = asyncio.create_task(dribble())
    try:
        return await asyncio.wait_for(reader.read(), 60)
    except ConnectionResetError:
        # The server closed with bytes of ours unread (it refused before reading them all): the kernel
        # sends a reset, which may discard its reply before we read it.
        return RESET
    finally:
        dribbling.cancel()
        writer.close()


def test_slow_malformed_and_oversized_requests_do_not_block_other_sessions(tok, engine, monkeypatch):
    server = started(tok, ignore_eos=True)   # every reply is a full 4 tokens: an early EOS is no failure
    port = int(server.url.rsplit(":", 1)[1])

    async def main() -> dict:
        dispatcher = Dispatcher([engine])
        a = server.open(Trace("a", "g"), dispatcher, 4, 256)
        head = (f"POST /s/{a.id}/v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {a.key}\r\n"
                "Content-Type: application/json\r\n")
        body_head = (head + "Content-Length: 1000\r\n\r\n").encode() + b'{"model": '
        out = {}
        # 1) While a head and a body trickle in (with a deadline far away), other sessions are served.
        monkeypatch.setattr(connections, "READ_TIMEOUT_S", 600.0)
        stop = asyncio.Event()
        slow = [asyncio.create_task(raw_exchange(port, head.encode(), b"X-Slow: " + b"a" * 500, stop)),
                asyncio.create_task(raw_exchange(port, body_head, b" " * 500, stop))]
        await asyncio.sleep(1.0)   # both are connected and dripping
        others = [server.open(Trace(f"o{i}", "g"), dispatcher, 1, 256) for i in range(3)]
        replies = await asyncio.gather(*[ask(server, o) for o in others])
        out["served_while_slow"] = [r.choices[0].finish_reason for r in replies]
        out["slow_still_open"] = not any(t.done() for t in slow)
        stop.set()
        await asyncio.gather(*slow)
        # 2) Malformed and oversized heads get 400 at once; nothing reaches the application.
        out["garbage"] = await raw_exchange(port, b"\x16\x03\x01\x00\xa5 not http at all\r\n\r\n")
        big = b"GET / HTTP/1.1\r\nX-Big: " + b"a" * (64 << 10) + b"\r\n\r\n"
        out["oversized"] = await raw_exchange(port, big)
        # 3) With the deadline near, a trickled head is dropped unanswered, a trickled body gets 408.
        monkeypatch.setattr(connections, "READ_TIMEOUT_S", 1.5)
        out["slow_head"], out["slow_body"] = await asyncio.gather(
            raw_exchange(port, head.encode(), b"X-Slow: " + b"a" * 200),
            raw_exchange(port, body_head, b" " * 200))
        out["a_untouched"] = state(a) == ([], [], 0, 0, 0)
        await ask(server, a)   # and a still works
        return out

    try:
        out = asyncio.run(main())
    finally:
        server.stop()
    assert out["served_while_slow"] == ["length"] * 3 and out["slow_still_open"]
    assert out["garbage"].startswith(b"HTTP/1.1 400")
    # 64 KiB against a 16 KiB limit: the 400 comes while the client still sends, so a reset may race it
    assert out["oversized"].startswith(b"HTTP/1.1 400") or out["oversized"] == RESET
    assert out["slow_head"] == b""
    assert out["slow_body"].startswith(b"HTTP/1.1 408") and b"not received within 1.5s" in out["slow_body"]
    assert out["a_untouched"]


def test_a_late_client_keeps_its_connection_until_the_idle_timeout(tok, monkeypatch):
    """A client whose event loop runs hundreds of sessions may send its first request after connecting, or
    its next after a reply, many seconds late: the head deadline starts at a head's first byte, so only
    IDLE_TIMEOUT_S closes such a connection (before, the turn failed with a connection error)."""
    monkeypatch.setattr(connections, "READ_TIMEOUT_S", 0.4)
    monkeypatch.setattr(connections, "IDLE_TIMEOUT_S", 2.5)
    server = started(tok)
    request = b"POST /s/nobody/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"

    async def main() -> list:
        reader, writer = await asyncio.open_connection("127.0.0.1", int(server.url.rsplit(":", 1)[1]))
        seen = []
        for _ in range(2):   # connected, then kept alive after a reply: 3x READ_TIMEOUT_S before sending
            await asyncio.sleep(1.2)
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(int(re.search(rb"content-length: (\d+)", head, re.I)[1]))
            seen.append(head.split(b"\r\n")[0])
        await asyncio.sleep(3.0)   # past IDLE_TIMEOUT_S: closed by the server
        seen.append(await reader.read())
        return seen

    try:
        assert asyncio.run(main()) == [b"HTTP/1.1 404 Not Found"] * 2 + [b""]
    finally:
        server.stop()


def test_a_client_disconnect_aborts_its_engine_request(tok, engine):
    """vLLM's own record of the request says it was aborted, early: 480 tokens would take seconds, the
    disconnect comes as soon as the engine has started it."""

    def watch(actor) -> int:   # runs in the engine actor: keep the scheduler's records of running requests
        try:
            actor.molt_test_watched = list(actor.llm.engine_core.engine_core.scheduler.requests.values())
        except RuntimeError:   # the engine thread changed the dict meanwhile: look again
            return 0
        return len(actor.molt_test_watched)

    def finished(actor) -> list | None:   # how they ended, once the engine holds no request
        if actor.llm.engine_core.engine_core.scheduler.requests:
            return None
        return [(r.status.name, r.num_output_tokens) for r in actor.__dict__.pop("molt_test_watched")]

    async def abort_while_running(request: asyncio.Task) -> list:
        while not await engine.__ray_call__.remote(watch):
            assert not request.done(), request
            await asyncio.sleep(0.01)
        request.cancel()
        deadline = time.time() + 60
        while (reasons := await engine.__ray_call__.remote(finished)) is None and time.time() < deadline:
            await asyncio.sleep(0.05)
        return reasons

    server = started(tok, max_tokens=480, ignore_eos=True)

    async def main() -> tuple:
        dispatcher = Dispatcher([engine])
        # The dispatcher: cancelling a generate call aborts the engine's request (Env path, agent timeouts).
        via_router = await abort_while_running(asyncio.create_task(
            dispatcher.generate([1, 2, 3], {**SAMPLING, "max_tokens": 480, "ignore_eos": True}, "k")))
        # The chat server: a client that goes away mid-turn.
        a = server.open(Trace("a", "g"), dispatcher, 1, 512)
        async with httpx.AsyncClient(timeout=60) as http:
            post = http.post(f"{server.url}/s/{a.id}/v1/chat/completions", json={"messages": HI},
                             headers={"authorization": f"Bearer {a.key}"})
            via_server = await abort_while_running(asyncio.create_task(post))
        untouched = state(a) == ([], [], 0, 0, 0)
        # The aborted turn did not count: the session's single turn is still there.
        reply = await ask(server, a, max_tokens=4)
        return via_router, via_server, untouched, reply.choices[0].finish_reason, await engine.stats.remote()

    try:
        via_router, via_server, untouched, finish, stats = asyncio.run(main())
    finally:
        server.stop()
    for ended in (via_router, via_server):
        [(status, tokens)] = ended
        assert status == "FINISHED_ABORTED" and tokens < 480, ended
    assert untouched and finish == "length" and stats["in_flight"] == 0


def test_hundreds_of_concurrent_sessions_with_timeouts_and_cancellations(tok, engine):
    modes = ["plain", "stream", "abandon_stream", "cancel", "client_timeout"]
    http: list[httpx.AsyncClient] = []
    gave_up = []   # requests a client abandoned mid-flight

    class Busy(ChatAgent):
        async def run(self, ctx: ChatContext) -> Result:
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0,
                                        http_client=http[0])
            create = lambda **kw: client.chat.completions.create(  # noqa: E731
                model=ctx.model_name, messages=ctx.messages, **kw)
            mode = ctx.item["mode"]
            if mode == "cancel":   # gives up on its request mid-flight, then asks again
                try:
                    return Result(reward=len((await asyncio.wait_for(create(), 0.05)).choices))
                except TimeoutError:
                    gave_up.append(mode)
            if mode == "client_timeout":   # the SDK's own timeout, then asks again
                try:
                    return Result(reward=len((await create(timeout=0.01)).choices))
                except openai.APITimeoutError:
                    gave_up.append(mode)
            if mode in ("stream", "abandon_stream"):
                stream = await create(stream=True)
                async for _ in stream:
                    if mode == "abandon_stream":
                        break
                await stream.close()
                return Result(reward=0.5)
            return Result(reward=len((await create()).choices))

    spec = small_spec({"max_turns": 2, "max_total_tokens": 256, "timeout_s": 300.0},
                      rollout={"max_tokens": 4})
    runner = ChatAgentRunner(Busy)
    runner.setup(tok, spec)
    sampler = Recorder(engine)
    n = 250

    async def main() -> list:
        http.append(httpx.AsyncClient(limits=httpx.Limits(max_connections=None), timeout=120))
        try:
            items = [{"prompt": "x", "label": "x", "mode": modes[i % len(modes)]} for i in range(n)]
            runs = [runner.run(item, f"r{i}", "g", sampler) for i, item in enumerate(items)]
            return await asyncio.gather(*runs)
        finally:
            await http[0].aclose()

    try:
        rollouts = asyncio.run(main())
        sessions_left = dict(runner.server.sessions)
    finally:
        runner.close()
    for r in rollouts:
        assert_exact(r, [c for c in sampler.calls if c["key"] == r.rollout_id])   # ok, and token-exact
    assert gave_up and sessions_left == {} and sampler.inner.sticky == {}
    deadline = time.time() + 60
    while ray_in_flight(engine) and time.time() < deadline:
        time.sleep(0.1)
    assert ray_in_flight(engine) == 0   # every abandoned request was aborted or finished


def ray_in_flight(engine) -> int:
    import ray

    return ray.get(engine.stats.remote())["in_flight"]
