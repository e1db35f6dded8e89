"""Answer-checking rewards for open questions (search, trivia): SQuAD's exact match and token F1.

The answer is the text of the model's last <answer></answer> tag in its own turns (never a tool's text); both it and
the ground truth are normalised the way SQuAD and Search-R1 score them (lower case, punctuation and the
articles a/an/the dropped, whitespace collapsed), so "The Bronze." matches "Bronze"; a ground truth that this
leaves empty ("A", "The") keeps its articles (and then its punctuation), so that "" does not match it.
"""
from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

from factory.rewards.math import extract_answer
from factory.types import Turn

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", _without_punctuation(text)).split())


def _without_punctuation(text: str) -> str:
    return _folded(str(text).translate(_PUNCTUATION))


def _folded(text: str) -> str:
    return " ".join(str(text).lower().split())


def _comparable(prediction: str, truth: str) -> tuple[str, str]:
    """Both texts normalised SQuAD's way, or, where that leaves nothing of the truth ("A", a multiple-choice
    letter; "The"; "?"), with its articles and then its punctuation kept: else an empty answer matched it and
    the right one did not."""
    for normalise in (normalize_answer, _without_punctuation, _folded):
        gold = normalise(truth)
        if gold:
            break
    return normalise(prediction), gold


def _answers(answer: str | list[str]) -> list[str]:
    # Data sets such as NQ list several accepted answers; the best match counts.
    return [str(a) for a in answer] if isinstance(answer, (list, tuple)) else [str(answer)]


def exact_match(prompt: str, completion: str, answer: str | list[str], turns: Sequence[Turn] | None = None,
                **_: object) -> float:
    """1.0 when the normalised <answer> text equals a normalised ground truth, else 0.0 (no tag: 0.0)."""
    got = extract_answer(completion, turns)
    if got is None:
        return 0.0
    pairs = (_comparable(got, a) for a in _answers(answer))
    return float(any(said == truth for said, truth in pairs))


def token_f1(prediction: str, truth: str) -> float:
    """SQuAD's token F1 of two normalised strings (a truth that normalises to nothing: see `_comparable`)."""
    pred, gold = (text.split() for text in _comparable(prediction, truth))
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def f1(prompt: str, completion: str, answer: str | list[str], turns: Sequence[Turn] | None = None,
       **_: object) -> float:
    """Token F1 of the <answer> text against the best ground truth (no tag: 0.0): partial credit for
    'Mercury planet' against 'Mercury'."""
    got = extract_answer(completion, turns)
    if got is None:
        return 0.0
    return max((token_f1(got, a) for a in _answers(answer)), default=0.0)  # no accepted answer: nothing matches


def answered(prompt: str, completion: str, turns: Sequence[Turn] | None = None, **_: object) -> float:
    """1.0 when the model wrote an <answer> tag in its own turns. Meant as a gate (judge only what has an
    answer to judge), not as a bonus: a bonus for the tag alone is learned as a shortcut."""
    return float(extract_answer(completion, turns) is not None)


def near_miss(prompt: str, completion: str, answer: str | list[str], turns: Sequence[Turn] | None = None,
              **_: object) -> float:
    """1.0 when the <answer> is not an exact match but shares words with a ground truth ('Srinivasa
    Ramanujan Iyengar' for 'Srinivasa Ramanujan'): the answers an equivalence judge is for. As a gate it
    keeps a judge's calls, and its mistakes, to those (an exact match needs no judge; an answer with no
    word in common is wrong for one)."""
    return float(f1(prompt, completion, answer, turns) > 0 and exact_match(prompt, completion, answer, turns) == 0)
