"""The task's reward: is the count in the model's <answer> tag right?

A reward is a plain function `(prompt, completion, **row) -> float | None`. The row's ground truth
arrives as `answer` (the `answer` column of data/*.jsonl); every other column of the row arrives under
its own name (`word`, `letter`). Declaring `turns` gets the model's turns, parsed: each turn's text,
its tool calls and their results. Returning None means "no value"; the node's `on_missing` decides
what that does to training (default: it counts as 0).
"""
from __future__ import annotations

import re

from factory.rewards.math import extract_answer

# Models trained on typeset math write the minus sign U+2212 (or its small and full-width forms): read as "-".
_MINUS = str.maketrans("\u2212\ufe63\uff0d", "---")


def correct(prompt: str, completion: str, answer: int, turns=None, **row) -> float:
    """1.0 when the last <answer> the model wrote holds the right count, else 0.0."""
    got = extract_answer(completion, turns)  # reads the model's own text, never a tool's
    number = re.search(r"-?\d+", (got or "").translate(_MINUS))
    return float(number is not None and int(number.group()) == int(answer))
