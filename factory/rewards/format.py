"""Format rewards: did the model use its tools well? Read from the structured turns (the calls the rollout
parsed with the spec's chat format, and each tool result's status), never by re-parsing the transcript."""
from __future__ import annotations

from collections.abc import Sequence

from factory.types import Turn


def called_tool(prompt: str, completion: str, *, turns: Sequence[Turn], **_: object) -> float:
    """1.0 when the model attempted at least one tool call (well-formed or not)."""
    return float(any(t.calls for t in turns))


def tool_call_ok(prompt: str, completion: str, *, turns: Sequence[Turn], tools: Sequence[str] | None = None,
                 **_: object) -> float:
    """1.0 when the model made at least one call and every call is well formed: its JSON parsed (a `name`
    and object `arguments`, no `parse_error`) and it names a tool the servers offer; 0.0 otherwise. The
    tool's answer says which names exist (an `unknown_tool` result); a call the rollout did not run (one
    in the last turn, or in a turn that left no room for its answer) is checked against `tools`, the tool
    names, when the spec passes them as an arg."""
    calls = [c for t in turns for c in t.calls]
    unknown = any(r.error_kind == "unknown_tool" for t in turns for r in t.results)
    misnamed = tools is not None and any(c.name not in tools for c in calls)
    # A call named after the answer is not a tool call: crediting it taught a search model to skip searching.
    return float(bool(calls) and all(c.parse_error is None for c in calls) and not unknown and not misnamed)


def tools_succeeded(prompt: str, completion: str, *, turns: Sequence[Turn], **_: object) -> float | None:
    """The share of the model's tool calls whose result came back `ok` (not an unknown tool, bad
    arguments, the tool's own error or an infrastructure failure); None when it made no call that ran."""
    results = [r for t in turns for r in t.results]
    return sum(r.status == "ok" for r in results) / len(results) if results else None
