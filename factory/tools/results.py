"""Turning what a tool returned into the text the model reads (pure functions).

The model sees one string per call. MCP results carry a list of content blocks (text, images, audio,
resources) and sometimes structured content; python tools return any value. Both end up as text,
cut to the server's `max_result_chars` with the head and the tail kept, because the start of a
result usually says what it is and the end often holds the answer or the error.
"""
from __future__ import annotations

import json
from typing import Any

from mcp import types as mcp_types

from factory.types import ToolResult
from factory.util import escaped

TRUNCATION_MARKER = "\n...[{omitted} characters omitted]...\n"


def truncate_middle(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters: head and tail kept, a marker saying how much went.

    The marker counts toward the limit, so the model's context budget is exactly what the spec says.
    When the limit is too small to hold the marker, the head alone is kept.
    """
    if len(text) <= limit:
        return text
    omitted = len(text)  # the marker's length depends on the number it prints; iterate to a fixed point
    for _ in range(3):
        marker = TRUNCATION_MARKER.format(omitted=omitted)
        keep = limit - len(marker)
        if keep <= 0:
            return text[:limit]
        omitted = len(text) - keep
    marker = TRUNCATION_MARKER.format(omitted=omitted)
    keep = limit - len(marker)
    head = (keep + 1) // 2
    tail = keep - head
    return text[:head] + marker + (text[len(text) - tail :] if tail else "")


def content_text(result: mcp_types.CallToolResult) -> str:
    """One string for an MCP tool result: its text blocks joined; other blocks named by a placeholder.

    A result whose content is empty but that has structured content shows that content as JSON
    (servers may put the whole answer there).
    """
    parts = [_block_text(block) for block in result.content]
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False, default=str)
    return "\n".join(parts)


def _block_text(block: Any) -> str:
    kind = getattr(block, "type", "")
    if kind == "text":
        return block.text
    if kind in ("image", "audio"):
        return f"[{kind}: {block.mime_type}, {len(block.data)} base64 characters]"
    if kind == "resource":
        resource = block.resource
        text = getattr(resource, "text", None)
        return text if text is not None else f"[resource: {resource.uri}]"
    if kind == "resource_link":
        return f"[resource link: {block.uri}]"
    return f"[{kind or type(block).__name__} content]"


def value_text(value: Any) -> str:
    """One string for a python tool's return value: strings as they are, anything else as JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def answer(tool: str, text: str, status: str = "ok", error_kind: str | None = None) -> ToolResult:
    """A tool's answer. Every ToolResult the tools build is made here (or by `model_error` or `infra_error`,
    through here): each keeps a lone surrogate in its text or tool name as its `\\udcff` escape (`escaped`): a
    python tool's os.fsdecode of a file name that is not UTF-8 holds one, as does a tool name json.loads read from
    the model's `"\\ud83d"`. The tokenizer refuses one (the episode failed), as do the cache's sqlite and the run's
    tables, so the model, the recording, the cache and a replay all hold the same escaped text."""
    return ToolResult(tool=escaped(tool), text=escaped(text), status=status, error_kind=error_kind)


def model_error(tool: str, kind: str, text: str) -> ToolResult:
    """A failure the model caused; its text is what the model reads and learns from."""
    return answer(tool, text, "model_error", kind)


def infra_error(tool: str, kind: str, text: str) -> ToolResult:
    """A failure of ours; the model still sees the text, the spec decides if the trajectory trains."""
    return answer(tool, text, "infra_error", kind)
