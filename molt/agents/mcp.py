"""Tools of an MCP server (Model Context Protocol, stdio transport) for an `Env` or a `ChatAgent`.

The server process runs inside the tool sandbox (`molt.agents.sandbox.server_command`: no network, a
private /tmp, a read-only system, limits), launched either per rollout (`async with MCPTools(params)`)
or once and shared by every rollout of the process (`await MCPTools.shared(params)`). Its tools come
back in OpenAI function format, ready for `tools=` of a chat request or a chat template, and a call
returns the tool's text; a tool that fails returns `error: ...` for the model to read.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from mcp import Client, StdioServerParameters

from molt.agents.sandbox import launch_independent, server_command

_SHARED: dict[tuple, asyncio.Future] = {}


def sandboxed_server(script: str | os.PathLike, **limits: int) -> StdioServerParameters:
    """Launch parameters of the Python MCP server `script` (stdio) inside the tool sandbox."""
    command, *args = server_command(script, **limits)
    return StdioServerParameters(command=command, args=args)


class MCPTools:
    """One connection to an MCP server: `tools` (OpenAI function format) and `call(name, arguments)`."""

    def __init__(self, params: StdioServerParameters) -> None:
        self.params = params
        self.client: Client | None = None
        self.tools: list[dict[str, Any]] = []

    async def __aenter__(self) -> MCPTools:
        self.client = await Client(self.params).__aenter__()
        listed = await self.client.list_tools()
        self.tools = [{"type": "function", "function": {
            "name": t.name, "description": t.description or "", "parameters": t.input_schema}}
            for t in listed.tools]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        client, self.client = self.client, None
        if client is None:
            return
        try:
            await client.__aexit__(*exc)
        except BaseExceptionGroup as group:
            # The SDK's task group wraps an exception raised inside `async with`; the caller gets its own.
            if not (exc[1] is not None and len(group.exceptions) == 1 and group.exceptions[0] is exc[1]):
                raise

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        """The tool's text output; an unknown tool or a tool error comes back as `error: ...`."""
        if name not in {t["function"]["name"] for t in self.tools}:
            return f"error: unknown tool {name!r}"
        result = await self.client.call_tool(name, arguments)
        text = "\n".join(getattr(part, "text", "") for part in result.content)
        return f"error: {text}" if result.is_error else text

    @classmethod
    async def shared(cls, params: StdioServerParameters) -> MCPTools:
        """One server for every rollout of this event loop, started on first use.

        The connection lives in a task of its own (the SDK's transport must be entered and left by one
        task); it ends with the event loop, and bwrap's --die-with-parent ends the server with Molt.
        """
        # sandboxed_server gives each launch its own uid: the same server with another uid is the same key
        key = (id(asyncio.get_running_loop()), params.command, launch_independent(params.args))
        if key not in _SHARED:
            ready = asyncio.get_running_loop().create_future()
            _SHARED[key] = ready
            asyncio.get_running_loop().create_task(_hold(cls(params), ready))
        return await asyncio.shield(_SHARED[key])


async def _hold(tools: MCPTools, ready: asyncio.Future) -> None:
    try:
        async with tools:
            ready.set_result(tools)
            await asyncio.Event().wait()   # until the loop cancels this task at its end
    except Exception as err:
        if not ready.done():
            ready.set_exception(err)
        raise
