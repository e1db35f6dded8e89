"""Format rewards: did the model use its tools well? Read from the completion text, which holds the
model's turns with <tool_call> blocks and the tool responses in between."""
from __future__ import annotations

import json
import re

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_RESPONSE = re.compile(r"<tool_response>(.*?)</tool_response>", re.DOTALL)


def _calls(completion: str) -> list[str]:
    without_responses = _RESPONSE.sub("", completion)
    return _CALL.findall(without_responses)


def called_tool(prompt: str, completion: str, **_: object) -> float:
    """1.0 when the model attempted at least one tool call (well-formed or not)."""
    return float("<tool_call>" in _RESPONSE.sub("", completion))


def tool_call_ok(prompt: str, completion: str, **_: object) -> float:
    """1.0 when the model made at least one call and every call is JSON with a `name` and object
    `arguments`; 0.0 otherwise."""
    calls = _calls(completion)
    if not calls:
        return 0.0
    for raw in calls:
        try:
            call = json.loads(raw)
        except json.JSONDecodeError:
            return 0.0
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return 0.0
        if not isinstance(call.get("arguments", {}), (dict, str)):
            return 0.0
    return 1.0
