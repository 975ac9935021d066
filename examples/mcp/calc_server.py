"""A small MCP server (stdio) with a calculator tool, written with the `mcp` SDK's MCPServer.

Molt launches it inside the tool sandbox (examples/agents/mcp_agent.py); run it by hand with
`python examples/mcp/calc_server.py` and speak MCP on its stdin/stdout.
"""

from mcp.server.mcpserver import MCPServer

server = MCPServer("calculator")


@server.tool()
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


if __name__ == "__main__":
    server.run()
