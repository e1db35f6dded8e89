"""The name a typo most likely meant: one ranking for every "did you mean" Factory prints (a spec's keys,
its values, the registries' names). The bottom layer, so that the modules beside each other above it
(`presets`, `util`) share it."""
from __future__ import annotations

import difflib
import re
from collections.abc import Iterable


def nearest(key: str, valid: Iterable[str]) -> str | None:
    """The valid name a typo most likely meant: a close spelling (difflib), else the one name that
    starts the typo or that the typo starts (`lr_rate` -> `lr`, `calculator` -> `calc`), which difflib
    alone finds too different."""
    valid = list(valid)
    words = set(_words(key))  # every word of it in one name (`get_time` -> `get_current_time`, which difflib
    if len(words) > 1:        # ranks below `convert_time`: fewer letters in common, more of them in place)
        holding = [v for v in valid if words <= set(_words(v))]
        if len(holding) == 1:
            return holding[0]
    ratio = {v: difflib.SequenceMatcher(None, v, key).ratio() for v in valid}  # as difflib.get_close_matches
    close = [v for v in valid if ratio[v] >= 0.6]
    if close:
        # Swapped letters are the commonest slip, and difflib scores a swap below a dropped or changed letter
        # (`rewarsd`: `reward` 0.92, `rewards` 0.86) and breaks its ties by reverse alphabetical order (`gpro`:
        # `gspo` and `grpo` 0.75): a name of the typo's very letters first, then difflib's score, then the
        # fewest edits, a swap counting one; then the order given.
        return max(close, key=lambda v: (sorted(v) == sorted(key), ratio[v], -edits(key, v)))
    head = [v for v in valid if min(len(v), len(key)) >= 2 and (key.startswith(v) or v.startswith(key))]
    return head[0] if len(head) == 1 else None


def edits(a: str, b: str) -> int:
    """The fewest single-letter insertions, deletions, changes and swaps of two neighbours that make `a`
    into `b` (Damerau-Levenshtein, each letter edited once: the optimal string alignment distance)."""
    before, row = None, list(range(len(b) + 1))  # the distances of a[:i-1] and a[:i] to each prefix of b
    for i in range(1, len(a) + 1):
        current = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            current[j] = min(row[j] + 1, current[j - 1] + 1, row[j - 1] + (a[i - 1] != b[j - 1]))
            if before is not None and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                current[j] = min(current[j], before[j - 2] + 1)
        before, row = row, current
    return row[len(b)]


def _words(name: str) -> list[str]:
    return [w for w in re.split(r"[_\-.]+", name.lower()) if w]
