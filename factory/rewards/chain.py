"""Per-turn rewards for multi-step arithmetic: every model turn checked on its own (`per: turn` nodes).

The reference chain of a question is the value of each of its operations in the order they are computed
(precedence first): `7 + 12 - 5 + 33` -> 19, 14, 47; `12 + 34 * 5` -> 170, 182 (12 + 34, the classic
precedence mistake, is no step of it). A turn that calls the calculator is right when every call came back
with a value of that chain and at least one of them is new (a turn that repeats an earlier turn's result
earns nothing, so a model cannot farm the reward by calling the same thing again); the turn that answers is
right when its <answer> is the final value. A model may take the steps one by one or several at once: any
value of the chain is progress.
"""
from __future__ import annotations

import ast
import operator
from collections.abc import Sequence

from factory.rewards.math import numeric_match
from factory.types import Turn

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _value(node: ast.AST, steps: list[int]) -> int:
    """The node's value; each operation's value is appended to `steps` once both operands are known."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        steps.append(_OPS[type(node.op)](_value(node.left, steps), _value(node.right, steps)))
        return steps[-1]
    raise ValueError(f"not an integer + - * expression: {ast.dump(node)[:60]}")


def reference_chain(expression: str) -> list[int]:
    """The value of each operation of an integer + - * expression, in the order it is computed (the parse
    tree's operations in post-order, so with the usual precedence): `2 + 3 * 4` -> [12, 14]."""
    steps: list[int] = []
    _value(ast.parse(expression, mode="eval").body, steps)
    return steps


def _number(text: str) -> float | None:
    try:
        return float(text.strip())
    except ValueError:
        return None


def chain_step(prompt: str, completion: str, turn: Turn, index: int, expression: str, answer: str,
               turns: Sequence[Turn] = (), **_: object) -> float:
    """1.0 when this turn is a right step of the reference chain (see the module), else 0.0. `completion`
    is this turn's text; `turns` every turn of the episode (the earlier ones say what was already reached).
    A turn whose calls were not run (the episode's last turn, or one that left no room for their answers) or
    failed is not a step. `expression` and `answer` are data columns without a default: a dataset that lacks
    one is refused before step 1, instead of every turn scoring 0."""
    if not turn.calls:
        return numeric_match(prompt, completion, answer, turns=[turn])
    if len(turn.results) != len(turn.calls) or any(r.status != "ok" for r in turn.results):
        return 0.0
    chain = set(reference_chain(expression))
    values = [_number(r.text) for r in turn.results]
    reached = {_number(r.text) for t in turns[:index] for r in t.results if r.status == "ok"}
    return float(all(v in chain for v in values) and any(v not in reached for v in values))
