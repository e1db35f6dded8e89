"""Spec errors: one record per problem, pointing at the file, line and dotted path that caused it.

Every problem found while loading or compiling a spec becomes a `SpecError`; they are collected and
raised together as `SpecErrors`, so a user fixes a spec in one round instead of one error per run.
The text is short and fixed (`FILE:LINE: dotted.path: message`) so that editors can jump to it and tests
can assert it exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

EXIT_SPEC_ERROR = 2  # the user's spec is wrong
EXIT_INTERNAL_ERROR = 1  # Factory is wrong


@dataclass(frozen=True)
class SpecError:
    """One problem. `file` is the spec file as the user named it, or `<override N>` for the N-th
    command-line override; `line` is 1-based (None when the problem has no line, e.g. an override)."""

    file: str
    line: int | None
    path: str  # dotted path into the spec: `train.lr`, `rewards.total.sum.fmt`; "" for the whole file
    message: str
    snippet: str = ""  # extra lines shown under the message (the offending YAML line and a caret)
    level: Literal["error", "warning"] = "error"
    column: int = 0  # 1-based column of the key, for ordering errors that share a line (not shown)

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line is not None else self.file
        what = f"warning: {self.message}" if self.level == "warning" else self.message
        text = f"{where}: {self.path}: {what}" if self.path else f"{where}: {what}"
        return f"{text}\n{self.snippet}" if self.snippet else text


class SpecErrors(Exception):
    """All the problems of one spec. `factory` prints `report()` and exits with code 2."""

    def __init__(self, errors: list[SpecError], file: str):
        self.errors = sort_errors(errors)
        self.file = file
        super().__init__(self.report())

    def report(self) -> str:
        n = len(self.errors)
        lines = [str(e) for e in self.errors]
        lines.append(f"{n} error{'s' if n != 1 else ''} in {self.file}")
        return "\n".join(lines)


def sort_errors(errors: list[SpecError]) -> list[SpecError]:
    """File errors in reading order (line, column; a spec's bases, `extends`, file by file), then
    command-line overrides in the order given; duplicates dropped (two checks may reach the same
    conclusion about one key)."""

    def key(e: SpecError) -> tuple[int, str, int, int]:
        if e.file.startswith("<override "):
            return (1, "", int(e.file[len("<override "):-1]), 0)
        return (0, e.file, e.line if e.line is not None else 0, e.column)

    unique = list(dict.fromkeys(errors))
    return sorted(unique, key=key)
