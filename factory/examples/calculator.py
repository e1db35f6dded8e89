"""The MCP calculator server the quickstart agent learns to use.

Run it as `python -m factory.examples.calculator` (stdio, the default) or with
`--http --port N` for streamable HTTP on 127.0.0.1. Expressions are evaluated by walking
Python's AST over a whitelist of nodes (numbers, + - * / // % **, unary +/-, parentheses), never
with eval: the model writes the expression, so it is untrusted input. Every number, written or computed,
is a finite real of at most MAX_MAGNITUDE: the tool never answers inf or nan.
"""
from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

from factory.examples import serve

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}

# Bounds that keep one call cheap: `9**9**9` would otherwise pin a core for minutes.
MAX_EXPRESSION_CHARS = 1000
MAX_EXPONENT = 1000
MAX_MAGNITUDE = 1e300
# Nesting levels, checked as the tree is walked: a recursion that ran out of stack raised RecursionError (the
# model read "Error executing tool calculate"), at a depth that moved with the caller's stack. Half the length
# bound admits every chain of binary operations that fits in it (`1+1+...`); only long unary chains are refused.
MAX_DEPTH = MAX_EXPRESSION_CHARS // 2


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ValueError names what is not allowed."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {exc.msg}") from None
    except RecursionError:  # building a deep tree where the caller's stack is deep already
        raise ValueError("expression nested too deeply") from None
    return _eval(tree.body, 0)


def _eval(node: ast.AST, depth: int) -> int | float:
    if depth > MAX_DEPTH:
        raise ValueError(f"expression nested deeper than {MAX_DEPTH} levels")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _real(node.value)  # a literal too: 1e309 is read as inf
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand, depth + 1))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent larger than {MAX_EXPONENT}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("result too large") from None
        return _real(value)
    raise ValueError(f"unsupported element: {ast.dump(node)[:60]}")


def _real(value: int | float | complex) -> int | float:
    # nan passes any `abs(x) > bound` test, so finiteness is checked on its own; an int is always finite
    # (and too large for math.isfinite past 1e308: the bound is checked first).
    if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE or (isinstance(value, float)
                                                                     and not math.isfinite(value)):
        raise ValueError("result too large or not a real number")
    return value


def format_number(value: float) -> str:
    """The number as the model should read it: integers without '.0', floats rounded to 10 digits."""
    if isinstance(value, float):
        if math.isfinite(value) and value == int(value) and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.10g}"
    return str(value)


# WARNING: INFO logs a line per request to stderr, which costs time under many concurrent calls.
server = MCPServer("factory-calculator", log_level="WARNING")


# The description and the argument's description are what the model reads in its tool list.
@server.tool(
    description="Evaluate an arithmetic expression with + - * / // % ** and parentheses, e.g. (3 + 4) * 2.",
    structured_output=False,
)
def calculate(expression: Annotated[str, Field(description="The arithmetic expression to evaluate.")]) -> str:
    """The expression's value as text; an isError result saying why when it cannot be evaluated."""
    try:
        return format_number(evaluate(expression))
    except ValueError as exc:
        # ToolError keeps its message in the isError result, so the model learns what went wrong.
        raise ToolError(str(exc)) from None


def main(argv: list[str] | None = None) -> None:
    serve(server, __doc__, argv)


if __name__ == "__main__":
    main()
