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
# model cannot score by rambling numbers. Tags are found as markers and paired by `_closed` in one pass: a
# regex spanning a tag (`<answer>\s*(.*?)\s*</answer>`) backtracked for minutes over a tag never closed,
# holding the GIL, which a thread's `timeout_s` cannot stop.
_ANSWER = re.compile(r"<(/?)answer>", re.IGNORECASE)
_TOOL_RESPONSE = re.compile(r"<(/?)tool_response>")
_NUM = r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"  # ".5" is 0.5, not 5
# The first number: `\frac{a}{b}` (`-\frac`, `\dfrac`, `\tfrac` too; LaTeX's `\frac12`, a single digit without
# braces, as well), `a/b` or `a`, and whether an operator follows it on its line (`2^{10}`, `2 \times 10^3`,
# `3 * 4`, `2**10`: an expression, not its first number). A `*` is multiplication only with its operand after
# it: markdown's bold and italic close with one before any text, as in `**42** (the total)` (`42 * the units` is
# no product either), and a line break ends the expression (`42\n* note` is a list item).
_NUM_ARG = rf"\{{\s*(?P<num>{_NUM})\s*\}}|(?P<num_digit>\d)"
_DEN_ARG = rf"\{{\s*(?P<den>{_NUM})\s*\}}|(?P<den_digit>\d)"
_FIRST_NUMBER = re.compile(
    rf"(?P<sign>-?)\\[dt]?frac\s*(?:{_NUM_ARG})\s*(?:{_DEN_ARG})"
    rf"|(?P<a>{_NUM})(?:\s*/\s*(?P<b>{_NUM}))?"
)
# An operand: a number, a parenthesis, or a LaTeX command (`\frac{1}{2}`, `\sqrt{2}`, `\pi`) but `\text`, which
# typesets words (`42 - \text{the total}` is prose, as `42 - the total`).
_OPERAND = r"(?:-?\.?\d|\(|\\(?!text\b)[a-zA-Z]+)"
# `+`, `-` and a `/` after a fraction (`1/2/3`) are operators only with an operand after them on the line, as a `*`:
# `42 - that is my answer` and `3-` are the number (a dash in prose), `3 -4` and `3-4` an expression.
_OPERATOR_AFTER = re.compile(
    rf"[^\S\r\n]*(?:\^|\\times|\\cdot|\u00d7)|[^\S\r\n]+\*{{1,2}}[^\S\r\n]*{_OPERAND}|\*{{1,2}}{_OPERAND}"
    rf"|[^\S\r\n]*[-+/][^\S\r\n]*{_OPERAND}")
# With spaces on its right alone (`3* 4`), a `*` is how an emphasis closes (`**42** (x)`, `**The total: 42** 7
# boxes`): multiplication only where no emphasis is open before the number on its line.
_STAR_THEN_SPACE = re.compile(rf"\*{{1,2}}[^\S\r\n]+{_OPERAND}")
_STAR_RUN = re.compile(r"\*+")
# TeX takes a single digit as `\frac`'s argument: `\frac123` is `\frac{1}{2}3`, a half then a 3, and so is
# `\frac{1}{2} 3` (math mode ignores spaces): a number right after a fraction makes it an expression.
_DIGIT_AFTER = re.compile(r"[^\S\r\n]*\.?\d")
_SEPARATOR = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")  # 1,234 and 1,234,567; not 3,4 nor 1,2345
# Models trained on typeset math write the minus sign U+2212 (or its small and full-width forms): read as "-",
# not dropped, or "−7" would score as 7.
_MINUS = str.maketrans("\u2212\ufe63\uff0d", "---")
# Numbers are compared as decimals, exactly as written: a float turns a ground truth past 1.8e308 (200!)
# into inf, and `|x - inf| <= rel_tol * inf` held for every x. Exponents as wide as decimal allows.
_EXACT = Context(prec=60, Emax=MAX_EMAX, Emin=MIN_EMIN)


def extract_answer(completion: str, turns: Sequence[Turn] | None = None) -> str | None:
    """The text of the last <answer> tag in the model's own text (tool responses never count). Given the
    turns, a tag is closed within its turn: one left open by a turn that went on with a call is no answer."""
    found = [text[inner:close] for text in _model_texts(completion, turns)
             for _, inner, close, _ in _closed(_ANSWER, text)]
    return found[-1].strip() if found else None


def _closed(marker: re.Pattern[str], text: str) -> list[tuple[int, int, int, int]]:
    """Each block from an opening marker to the first closing one after it, as `<x>(.*?)</x>` finds them in
    turn: (start, its text's start, its text's end, end). An opener inside a block is its text; one never
    closed opens nothing. `marker` matches either, its group 1 "/" for a closer."""
    blocks, opened = [], None
    for m in marker.finditer(text):
        if not m.group(1):
            opened = m if opened is None else opened
        elif opened is not None:
            blocks.append((opened.start(), opened.end(), m.start(), m.end()))
            opened = None
    return blocks


def _model_texts(completion: str, turns: Sequence[Turn] | None) -> list[str]:
    # An answer copied by a tool (or injected by a hostile one) must not count as the model's, nor one
    # drafted in its reasoning (a turn cut while thinking would score its draft).
    if turns is not None:  # each turn's text starts with any `<think>` its prompt opened (the agent loop's)
        return [without_reasoning(t.text, opened_before=False) for t in turns]
    kept, pos = [], 0
    for start, _, _, end in _closed(_TOOL_RESPONSE, completion):
        kept.append(completion[pos:start])
        pos = end
    return [without_reasoning("".join(kept) + completion[pos:])]


def exact_match(prompt: str, completion: str, answer: str, turns: Sequence[Turn] | None = None,
                **_: object) -> float:
    """1.0 when the <answer> text equals the ground truth (whitespace- and case-insensitive: runs of whitespace
    count as one space), else 0.0."""
    got = extract_answer(completion, turns)
    return float(got is not None and _folded(got) == _folded(str(answer)))


def _folded(text: str) -> str:
    return " ".join(text.split()).lower()


def numeric_match(prompt: str, completion: str, answer: str | float, rel_tol: float = 1e-9, abs_tol: float = 0.0,
                  turns: Sequence[Turn] | None = None, **_: object) -> float:
    """1.0 when the first number in the <answer> tag equals the numeric ground truth within rel_tol, a relative
    tolerance, or within abs_tol, an absolute one (as math.isclose).

    rel_tol is a share of the larger of the two numbers in magnitude, 1e-9 by default (math.isclose's): a whole
    number below a billion must be exact (1e-6 let the quickstart's answers of up to ~5e8 be off by hundreds);
    abs_tol is 0 by default, so only 0 matches a ground truth of 0: set it where answers near 0 should count
    (abs_tol: 1e-9, say).
    The number read is the first of the tag: `1/2`, `\\frac{1}{2}` and `\\frac12` are read as fractions (0.5),
    and one that an operator follows on its line (`2^{10}`, `2 \\times 10^3`, `2 \\cdot 5`, `3 * 4`, `3 × 4`,
    `3 + 4`, `3 -4`, `1/2/3`, `1 + \\frac{1}{2}`; a `*`, `+`, `-` or `/` only with a number, "(" or a LaTeX command
    after it: `42 - the total` is 42), or a fraction a digit follows (`\\frac123` is TeX's `\\frac{1}{2}3`), scores
    0.0: that is an expression, not its first number (markdown's bold `**42**` is 42, `**42** (x)` too).
    Thousands separators (a comma before each group of 3 digits) are dropped from both sides, so "1,234" matches
    a ground truth of "1,234" or 1234; any other comma ends the number ("3,4" is 3).
    A ground truth of any size counts; one that is no finite number ("inf", "nan") matches nothing. One that
    is no decimal number at all ("1/2", "$18", GSM8K's "... #### 72") raises ValueError, whatever the model
    wrote: the data needs converting, which 0.0 on every sample would hide.
    """
    target = _ground_truth(answer)
    got = extract_answer(completion, turns)
    if got is None or not target.is_finite():
        return 0.0
    try:  # ArithmeticError: a number past decimal's range, or a fraction of 0
        value = _first_number(got)
        if value is None:
            return 0.0
        gap = _EXACT.abs(_EXACT.subtract(value, target))
        larger = max(_EXACT.abs(value), _EXACT.abs(target))
        return float(gap <= max(_EXACT.multiply(Decimal(str(rel_tol)), larger), Decimal(str(abs_tol))))
    except ArithmeticError:
        return 0.0


def _first_number(text: str) -> Decimal | None:
    """The first number of `text` (None if none, or if it starts an expression: see _FIRST_NUMBER)."""
    text = _SEPARATOR.sub("", text.translate(_MINUS))
    found = _FIRST_NUMBER.search(text)
    if found is None or _OPERATOR_AFTER.match(text, found.end()) or (
            _STAR_THEN_SPACE.match(text, found.end()) and not _emphasis_open(text, found.start())):
        return None
    if found["num"] is not None or found["num_digit"] is not None:
        if _DIGIT_AFTER.match(text, found.end()):
            return None
        num, den = found["num"] or found["num_digit"], found["den"] or found["den_digit"]
        value = _EXACT.divide(Decimal(num), Decimal(den))
        return _EXACT.minus(value) if found["sign"] else value
    if found["b"] is not None:
        return _EXACT.divide(Decimal(found["a"]), Decimal(found["b"]))
    return Decimal(found["a"])


def _emphasis_open(text: str, start: int) -> bool:
    """Whether a markdown emphasis is open at `start`: an odd number of `*` runs before it on its line, counting
    only those that touch text (one with spaces on both sides is a bullet or a multiplication, as `* 3* 4`)."""
    line = text[max(text.rfind("\n", 0, start), text.rfind("\r", 0, start)) + 1:start + 1]  # start's char ends it
    touching = [run for run in _STAR_RUN.finditer(line)
                if (run.start() > 0 and not line[run.start() - 1].isspace()) or not line[run.end()].isspace()]
    return len(touching) % 2 == 1


def _ground_truth(answer: object) -> Decimal:
    # An int as itself: str() refuses one of more than 4300 digits.
    text = answer if type(answer) is int else _SEPARATOR.sub("", str(answer).translate(_MINUS))
    try:
        return Decimal(text)
    except ArithmeticError:  # decimal.InvalidOperation: not a decimal number
        raise ValueError(f"ground truth {answer!r} is not a number") from None
