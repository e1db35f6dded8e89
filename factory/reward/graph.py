"""The reward graph: which nodes read which, in what order, and how combinators combine."""
from __future__ import annotations

import graphlib
import math
from typing import Any

from factory.schema import MaxNode, MinNode, ProductNode, Spec, SumNode


def node_inputs(node: Any) -> list[str]:
    """The other nodes a node reads."""
    if isinstance(node, SumNode):
        return list(node.sum)
    if isinstance(node, (MinNode, MaxNode, ProductNode)):
        return list(getattr(node, type(node).__name__[:-4].lower()))
    return []


def topological_order(nodes: dict[str, Any]) -> list[str]:
    """Nodes so that inputs come first (the compiler has already rejected cycles)."""
    return list(graphlib.TopologicalSorter({n: node_inputs(v) for n, v in nodes.items()}).static_order())


def training_node(spec: Spec) -> str:
    if spec.reward:
        return spec.reward
    return next(iter(spec.rewards)) if len(spec.rewards) == 1 else "total"


def prompt_text(messages: list[dict[str, Any]]) -> str:
    """What reward functions get as `prompt`: the last user message (the task as posed)."""
    users = [m["content"] for m in messages if m.get("role") == "user"]
    return users[-1] if users else ""


def combine(node: Any, values: dict[str, float | None]) -> float | None:
    if isinstance(node, SumNode):
        return sum(w * (values[k] or 0.0) for k, w in node.sum.items())
    inputs = [values[k] for k in node_inputs(node)]
    if isinstance(node, ProductNode):
        return math.prod(v or 0.0 for v in inputs)
    present = [v for v in inputs if v is not None]
    if not present:
        return None
    return min(present) if isinstance(node, MinNode) else max(present)
