"""Answer-checking rewards for math-style tasks.

A reward is a plain function `(prompt, completion, **row) -> float | None`; `answer` comes from the data
row's ground-truth column (`data.answer_key`), which these functions require: data without it is refused
before the first step (factory.reward.graph.required_columns), never scored 0 on every sample. The answer
is read from the model's own turns: the reward stage passes them as `turns`; called without them (from a
user's function, say), tool responses are cut out of the completion text instead.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from decimal import MAX_EMAX, MIN_EMIN, Context, Decimal

from factory.types import Turn
from factory.util import without_reasoning

# The final answer is what the model puts in <answer>...</answer>; without the tag, nothing is graded, so a
# model cannot score by rambling numbers.
_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL | re.IGNORECASE)
_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")  # ".5" is 0.5, not 5
# Numbers are compared as decimals, exactly as written: a float turns a ground truth past 1.8e308 (200!)
# into inf, and `|x - inf| <= rel_tol * inf` held for every x. Exponents as wide as decimal allows.
_EXACT = Context(prec=60, Emax=MAX_EMAX, Emin=MIN_EMIN)


def extract_answer(completion: str, turns: Sequence[Turn] | None = None) -> str | None:
    """The text of the last <answer> tag in the model's own text (tool responses never count)."""
    found = _ANSWER.findall(_model_text(completion, turns))
    return found[-1].strip() if found else None


def _model_text(completion: str, turns: Sequence[Turn] | None) -> str:
    # An answer copied by a tool (or injected by a hostile one) must not count as the model's, nor one
    # drafted in its reasoning (a turn cut while thinking would score its draft).
    if turns is not None:  # each turn's text starts with any `<think>` its prompt opened (the agent loop's)
        return "\n".join(without_reasoning(t.text, opened_before=False) for t in turns)
    return without_reasoning(re.sub(r"<tool_response>.*?</tool_response>", "", completion, flags=re.DOTALL))


def exact_match(prompt: str, completion: str, answer: str, turns: Sequence[Turn] | None = None,
                **_: object) -> float:
    """1.0 when the <answer> text equals the ground truth (whitespace- and case-insensitive), else 0.0."""
    got = extract_answer(completion, turns)
    return float(got is not None and got.strip().lower() == str(answer).strip().lower())


def numeric_match(prompt: str, completion: str, answer: str | float, rel_tol: float = 1e-6,
                  turns: Sequence[Turn] | None = None, **_: object) -> float:
    """1.0 when the first number in the <answer> tag equals the numeric ground truth within rel_tol.

    Thousands separators are dropped from both sides, so "1,234" matches a ground truth of "1,234" or 1234.
    A ground truth of any size counts; one that is no finite number ("inf", "nan") matches nothing.
    """
    got = extract_answer(completion, turns)
    if got is None:
        return 0.0
    found = _NUMBER.search(got.replace(",", ""))
    if found is None:
        return 0.0
    try:  # ValueError: an int too long for str(); ArithmeticError: not a number, or past decimal's range
        value, target = Decimal(found.group()), Decimal(str(answer).replace(",", ""))
        if not target.is_finite():
            return 0.0
        gap = _EXACT.abs(_EXACT.subtract(value, target))
        return float(gap <= _EXACT.multiply(Decimal(str(rel_tol)), max(Decimal(1), abs(target))))
    except (ValueError, ArithmeticError):
        return 0.0
