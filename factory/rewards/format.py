"""Format rewards: did the model use its tools well? Read from the structured turns (the calls the rollout
parsed with the spec's chat format, and each tool result's status), never by re-parsing the transcript."""
from __future__ import annotations

from collections.abc import Sequence

from factory.types import Turn


def called_tool(prompt: str, completion: str, *, turns: Sequence[Turn], **_: object) -> float:
    """1.0 when the model attempted at least one tool call (well-formed or not)."""
    return float(any(t.calls for t in turns))


def tool_call_ok(prompt: str, completion: str, *, turns: Sequence[Turn], **_: object) -> float:
    """1.0 when the model made at least one call and every call parsed: JSON with a `name` and object
    `arguments` (no `parse_error`); 0.0 otherwise."""
    calls = [c for t in turns for c in t.calls]
    return float(bool(calls) and all(c.parse_error is None for c in calls))


def tools_succeeded(prompt: str, completion: str, *, turns: Sequence[Turn], **_: object) -> float | None:
    """The share of the model's tool calls whose result came back `ok` (not an unknown tool, bad
    arguments, the tool's own error or an infrastructure failure); None when it made no call that ran."""
    results = [r for t in turns for r in t.results]
    return sum(r.status == "ok" for r in results) / len(results) if results else None
