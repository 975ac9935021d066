"""MCP tools (the `mcp` SDK over stdio) with the server process in the tool sandbox.

The reference MCP agent (examples/agents/mcp_agent.py) offers the example server's tools to the policy,
runs the (forced: evaluation's constrained decoding) call on the server, and the trainer scores the
sampled tokens as the engine did; the server is launched per rollout or shared (training it:
tests/test_agents_train.py). A probing MCP server shows the process is contained: no network (not even
the host's loopback), no view of the host's files, no writes outside its private /tmp.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import textwrap

import pytest
from agentlib import Runners, check_trainer_scores
from test_agents import Recorder, assert_exact, chat_ids, encode, run_all

from molt.agents.mcp import MCPTools, sandboxed_server

ITEM = {"messages": [{"role": "user", "content": "What is 2 times 3?"}], "label": "6"}
FORCED = {"type": "function", "function": {"name": "multiply"}}


@pytest.fixture()
def runners(tok):
    started = Runners(tok)
    yield started
    started.close()


@pytest.mark.parametrize("shared", [False, True])
def test_mcp_agent_calls_the_servers_tools(tok, engine, runners, trainer, shared):
    sampler = Recorder(engine)
    runner = runners("mcp_agent.py", {"max_turns": 2, "max_total_tokens": 900,
                                      "options": {"tool_choice": FORCED, "shared": shared}}, max_tokens=96)
    rollouts = run_all(runner, [ITEM] * 3, sampler, group=f"mcp{shared}")
    tools = asyncio.run(_list_tools())
    assert [t["function"]["name"] for t in tools] == ["multiply"]
    for r in rollouts:
        [calls] = assert_exact(r, [c for c in sampler.calls if c["key"] == r.rollout_id])
        assert len(calls) == 2 and r.info == {"tool_calls": 1.0}
        first, second = calls
        assert first["prompt_ids"] == chat_ids(tok, ITEM["messages"], tools)
        sampled = first["out"]["token_ids"]
        args = json.loads(tok.decode(sampled[:-1], skip_special_tokens=False)[11:-12])["arguments"]
        # The product came from the MCP server and went back to the model as the template's tool turn.
        glue = encode(tok, f"<|im_start|>tool\n{args['a'] * args['b']}<|im_end|><|im_start|>assistant")
        assert second["prompt_ids"] == first["prompt_ids"] + sampled + glue
        assert r.reward == float("6" in str(args["a"] * args["b"]) or "6" in tok.decode(
            second["out"]["token_ids"], skip_special_tokens=True))
    check_trainer_scores(trainer, rollouts, tok, sampler.calls)


def test_a_shared_server_is_started_once_per_event_loop():
    """sandboxed_server gives every launch its own uid, so each rollout's launch parameters differ: the
    shared server must still be one."""
    from test_agents import EXAMPLES

    from molt.agents import mcp

    async def main() -> list:
        script = EXAMPLES.parent / "mcp" / "calc_server.py"
        launches = [sandboxed_server(script) for _ in range(3)]
        assert os.geteuid() != 0 or launches[0].args != launches[1].args   # as root: a uid per launch
        return [await MCPTools.shared(params) for params in launches]

    before = len(mcp._SHARED)
    first, second, third = asyncio.run(main())
    assert first is second is third and len(mcp._SHARED) == before + 1


async def _list_tools() -> list[dict]:
    from test_agents import EXAMPLES

    async with MCPTools(sandboxed_server(EXAMPLES.parent / "mcp" / "calc_server.py")) as tools:
        assert await tools.call("multiply", {"a": 2, "b": 3}) == "6"
        assert (await tools.call("nope", {})).startswith("error: unknown tool")
        return tools.tools


PROBE = '''
import json, os, socket
from mcp.server.mcpserver import MCPServer

server = MCPServer("probe")


@server.tool()
def probe(port: int, secret: str) -> str:
    out = {}
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        out["network"] = "connected"
    except OSError as err:
        out["network"] = type(err).__name__
    out["secret"] = os.path.exists(secret)
    try:
        open(os.path.join(os.path.dirname(secret), "written"), "w").write("x")
        out["write"] = "ok"
    except OSError as err:
        out["write"] = type(err).__name__
    open("/tmp/scratch", "w").write("x")
    out["scratch"] = os.path.exists("/tmp/scratch")
    return json.dumps(out)


server.run()
'''


def test_the_mcp_server_runs_contained(tmp_path):
    script = tmp_path / "probe_server.py"
    script.write_text(textwrap.dedent(PROBE))
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    async def main() -> dict:
        async with MCPTools(sandboxed_server(script)) as tools:
            return json.loads(await tools.call("probe", {"port": listener.getsockname()[1],
                                                          "secret": str(secret)}))
    try:
        seen = asyncio.run(main())
    finally:
        listener.close()
    assert seen == {"network": "ConnectionRefusedError", "secret": False, "write": seen["write"],
                    "scratch": True}
    assert seen["write"] != "ok" and not (tmp_path / "written").exists()
