"""A calculator whose answers change from call to call (a counter and the clock in every answer): live
calls never repeat a run, so a replayed run that matches its recording was answered from it.

Two faces of one tool: `answer`, a python tool (in-process tests), and, run as
`python tests/tool_servers/drifting.py`, an MCP stdio server offering the calculator's tool exactly as
factory.examples.calculator lists it (the tiny model was warmed up on that listing).
"""
from __future__ import annotations

import itertools
import time
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

from factory.examples.calculator import evaluate, format_number

_calls = itertools.count(1)


def _stamp() -> str:
    return f" [call {next(_calls)} at {time.time():.6f}]"


def answer(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The arithmetic expression to evaluate.
    """
    try:
        value = format_number(evaluate(expression))
    except ValueError as e:
        value = f"error ({e})"
    return value + _stamp()


def calls_so_far() -> int:
    """How many calls were answered in this process."""
    global _calls
    n = next(_calls)
    _calls = itertools.count(n)
    return n - 1


server = MCPServer("factory-calculator", log_level="WARNING")


@server.tool(
    description="Evaluate an arithmetic expression with + - * / // % ** and parentheses, e.g. (3 + 4) * 2.",
    structured_output=False,
)
def calculate(expression: Annotated[str, Field(description="The arithmetic expression to evaluate.")]) -> str:
    try:
        return format_number(evaluate(expression)) + _stamp()
    except ValueError as exc:
        raise ToolError(str(exc) + _stamp()) from None


if __name__ == "__main__":
    server.run()
