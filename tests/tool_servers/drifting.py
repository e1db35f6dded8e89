"""A calculator whose answers change from call to call (a counter and the clock in every answer): live
calls never repeat a run, so a replayed run that matches its recording was answered from it."""
from __future__ import annotations

import itertools
import time

from factory.examples.calculator import evaluate, format_number

_calls = itertools.count(1)


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The arithmetic expression to evaluate.
    """
    try:
        value = format_number(evaluate(expression))
    except Exception as e:  # noqa: BLE001 -- the model's expression: its error is the answer
        value = f"error ({type(e).__name__})"
    return f"{value} [call {next(_calls)} at {time.time():.6f}]"


def calls_so_far() -> int:
    """How many calls were answered in this process (the counter's next value, less one)."""
    global _calls
    n = next(_calls)
    _calls = itertools.count(n)
    return n - 1
