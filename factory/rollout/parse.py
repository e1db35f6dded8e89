"""Tool calls parsed from model text in the Hermes / Qwen format.

    <tool_call>
    {"name": "add", "arguments": {"a": 1, "b": 2}}
    </tool_call>

Parsing never raises: a call the model wrote badly becomes a ToolCall with `arguments=None` and a
`parse_error` that the agent loop answers to the model as an error observation (the model learns from
it, and a reward can count it).
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator

from factory.types import ToolCall
from factory.util import TOOL_CALL_CLOSE as CLOSE
from factory.util import TOOL_CALL_OPEN as OPEN
from factory.util import tool_call_end, without_reasoning

# A block holds no other opening marker: `<tool_call>` written in prose before a real call must not swallow it.
_BLOCK = re.compile(re.escape(OPEN) + r"((?:(?!" + re.escape(OPEN) + r").)*?)" + re.escape(CLOSE), re.DOTALL)
# An opening marker that a call's JSON follows: before a closed block, one the model never closed.
_UNCLOSED = re.compile(re.escape(OPEN) + r"(?=\s*\{)")
# Best effort for the name of a call whose JSON is broken, so its error is attributed to the right tool.
_NAME = re.compile(r'"name"\s*:\s*"([^"\\]*)"')
# The error of a call never closed; the agent loop drops a trailing one from a turn a token limit cut (the limit cut
# it, not the model).
NEVER_CLOSED = f"unclosed {OPEN}: no {CLOSE} after it"


def parse_tool_calls(text: str, *, opened_before: bool = True) -> list[ToolCall]:
    """All calls in `text` outside its reasoning (`without_reasoning`), in order. A call never closed is one
    malformed call: each opening marker followed by `{` and no closing one, its text running to the next
    marker (a mention of the marker in prose, with no `{` after it, is not a call), or, after the last closed
    block where no marker has a `{` after it, the first marker there (a turn cut off right after it).
    `opened_before=False`: the text begins with any `<think>` its prompt opened (the agent loop writes
    ChatFormat.reasoning_opened into each turn's text), so a `</think>` with none before it is the model's own
    (in an argument) and drops no call before it; True (a completion as a reward reads it): all before a
    leading `</think>` is reasoning."""
    text = without_reasoning(text, opened_before=opened_before)
    calls: list[ToolCall] = []
    last_end = 0
    for start, end, raw in _blocks(text):
        calls += _unclosed(text[last_end:start])
        calls.append(parse_one(raw))
        last_end = end
    # Whatever follows the last closed block: an opening marker there was never closed (the model ran
    # out of tokens or forgot the marker). Each one a call's JSON follows is a call, as between blocks (two
    # such calls were one, its text holding both); else the first marker, with whatever it was cut to.
    tail = text[last_end:]
    if OPEN in tail:
        calls += _unclosed(tail) or [_malformed(tail[tail.index(OPEN) + len(OPEN):], NEVER_CLOSED)]
    return calls


def _blocks(text: str) -> Iterator[tuple[int, int, str]]:
    """Each closed block, in order: (start, end, the text between its markers). A block's JSON object is read
    first, so a marker inside one of its strings (an argument that quotes `</tool_call>`) does not end it; a
    block whose JSON object does not read ends at the first closing marker (holding no opening one, as
    `_BLOCK` says)."""
    pos = 0
    while (start := text.find(OPEN, pos)) >= 0:
        body = start + len(OPEN)
        end = tool_call_end(text, start)
        if end is None:
            m = _BLOCK.match(text, start)
            if m is None:  # never closed: left to _unclosed or the tail
                pos = body
                continue
            end = m.end()
        yield start, end, text[body:end - len(CLOSE)]
        pos = end


def _unclosed(gap: str) -> list[ToolCall]:
    """The calls opened in the text between two closed blocks and never closed (a block holds no opening
    marker, so the later block's match starts after them); each one's text runs to the next marker."""
    calls = []
    for m in _UNCLOSED.finditer(gap):
        end = gap.find(OPEN, m.end())
        calls.append(_malformed(gap[m.end():end if end >= 0 else None], NEVER_CLOSED))
    return calls


def parse_one(raw: str) -> ToolCall:
    """One call from the text between the markers: a JSON object with `name` and `arguments`."""
    try:
        obj = json.loads(raw)
    except RecursionError:  # a model can nest `[[[[...` deeper than the decoder's recursion limit
        return _malformed(raw, "invalid JSON: nested too deeply")
    except ValueError as e:  # a JSONDecodeError, or an integer of more digits than int() converts (a plain one)
        return _malformed(raw, f"invalid JSON: {e}")
    if not isinstance(obj, dict):
        return _malformed(raw, f"expected a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return _malformed(raw, 'missing "name" (a string)')
    # a tool without parameters may be called without "arguments"; Llama 3's JSON calls name them "parameters"
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        # Some models (and OpenAI's wire format) give the arguments as a JSON-encoded string.
        try:
            args = json.loads(args) if args.strip() else {}
        except RecursionError:
            return ToolCall(name=name, arguments=None, raw=raw, parse_error='"arguments" string is nested too deeply')
        except ValueError as e:  # (as above)
            return ToolCall(name=name, arguments=None, raw=raw, parse_error=f'"arguments" string is not JSON: {e}')
    if not isinstance(args, dict):
        return ToolCall(name=name, arguments=None, raw=raw,
                        parse_error=f'"arguments" must be a JSON object, got {type(args).__name__}')
    return ToolCall(name=name, arguments=args, raw=raw)


def _malformed(raw: str, error: str) -> ToolCall:
    m = _NAME.search(raw)
    return ToolCall(name=m.group(1) if m else "?", arguments=None, raw=raw, parse_error=error)
