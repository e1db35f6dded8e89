"""A tiny MCP tool server: the `count_letter` tool, spoken to over stdio.

Factory starts it from spec.yaml (`tools.letters`) and lists its tools for the model. Try it by hand:
`factory check spec.yaml --connect` starts it and prints the tools it offers. To serve it over HTTP
instead, run `python tools/letters.py --http` and point the spec at `url: http://127.0.0.1:8000/mcp`.
"""
from __future__ import annotations

import sys

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

# WARNING: at INFO the server logs a line per call to stderr, which costs time under many concurrent calls.
server = MCPServer("letters", log_level="WARNING")


# The description and the docstring are what the model reads in its tool list: keep them short and exact.
@server.tool(description="Count how many times a letter occurs in a word.", structured_output=False)
def count_letter(word: str, letter: str) -> str:
    """The count as text; an error result (shown to the model) when `letter` is not one character."""
    if len(letter) != 1:
        raise ToolError(f"letter must be one character, got {letter!r}")
    return str(word.lower().count(letter.lower()))


if __name__ == "__main__":
    if "--http" in sys.argv:
        server.run("streamable-http", host="127.0.0.1", port=8000)
    else:
        server.run("stdio")
