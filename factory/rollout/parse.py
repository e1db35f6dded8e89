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

from factory.types import ToolCall
from factory.util import TOOL_CALL_CLOSE as CLOSE
from factory.util import TOOL_CALL_OPEN as OPEN
from factory.util import call_json_end, without_reasoning

# A block holds no other opening marker: `<tool_call>` written in prose before a real call must not swallow it.
_BLOCK = re.compile(re.escape(OPEN) + r"((?:(?!" + re.escape(OPEN) + r").)*?)" + re.escape(CLOSE), re.DOTALL)
# The closing marker after a call's JSON object, by the same rule (what lies between is the model's error).
_CLOSING = re.compile(r"(?:(?!" + re.escape(OPEN) + r").)*?" + re.escape(CLOSE), re.DOTALL)
# An opening marker that a call's JSON follows, where the JSON does not read: a call the model never closed.
_UNCLOSED = re.compile(re.escape(OPEN) + r"(?=\s*\{)")
# Best effort for the name of a call whose JSON is broken, so its error is attributed to the right tool.
_NAME = re.compile(r'"name"\s*:\s*"([^"\\]*)"')
# The error of a call never closed; the agent loop drops a trailing one from a turn a token limit cut (the limit cut
# it, not the model).
NEVER_CLOSED = f"unclosed {OPEN}: no {CLOSE} after it"


def parse_tool_calls(text: str, *, opened_before: bool = True, cut: bool = False) -> list[ToolCall]:
    """All calls in `text` outside its reasoning (`without_reasoning`), in order. A call ends at the first closing
    marker after its JSON object where that reads (a marker inside the object's strings is the call's), else at
    the first after its opening marker; no other opening marker comes before it. A call never closed is one
    malformed call: each opening marker followed by `{` and no closing one, its text running to the next marker
    after its object, or, where the token limit `cut` the text, to the end of the text where it ends inside one of
    the object's strings (a turn cut inside an argument: the markers after are quoted in it; in a finished turn the
    string is the model's unclosed quote, and the call runs to the first closing marker); a mention of the marker
    in prose, with no `{` after it, is not a call. After the last closed call, where no marker has a `{` after it,
    the first marker there is one too (a turn cut off right after it).
    `opened_before=False`: the text begins with any `<think>` its prompt opened (the agent loop writes
    ChatFormat.reasoning_opened into each turn's text), so a `</think>` with none before it is the model's own
    (in an argument) and drops no call before it; True (a completion as a reward reads it): all before a
    leading `</think>` is reasoning. `cut`: the token limit cut the text (the agent loop's unfinished turn); False
    for a finished turn and for a completion as a reward reads it."""
    text = without_reasoning(text, opened_before=opened_before, cut=cut)
    calls: list[ToolCall] = []
    pos = tail = 0  # tail: where the text after the last closed call begins
    while (start := text.find(OPEN, pos)) >= 0:
        body = pos = start + len(OPEN)
        if (end := call_json_end(text, start, cut=cut)) is not None:
            if closing := _CLOSING.match(text, end):
                calls.append(parse_one(text[body:closing.end() - len(CLOSE)]))
                pos = tail = closing.end()
            else:  # the turn stopped after the object, or inside one of its strings, before the closing marker
                calls.append(_never_closed(text, body, end))
                pos = end
        elif block := _BLOCK.match(text, start):
            calls.append(parse_one(block.group(1)))
            pos = tail = block.end()
        elif _UNCLOSED.match(text, start):
            calls.append(_never_closed(text, body, body))
    # No call opened after the last closed one (only an unclosed call has NEVER_CLOSED) but a marker there: the
    # model ran out of tokens right after it (or forgot the call's JSON).
    if (not calls or calls[-1].parse_error != NEVER_CLOSED) and (first := text.find(OPEN, tail)) >= 0:
        calls.append(_malformed(text[first + len(OPEN):], NEVER_CLOSED))
    return calls


def _never_closed(text: str, body: int, after: int) -> ToolCall:
    """The call whose text begins at `body` and was never closed: its text runs to the next marker from `after`
    (the end of its object, where that reads)."""
    end = text.find(OPEN, after)
    return _malformed(text[body:end if end >= 0 else len(text)], NEVER_CLOSED)


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
