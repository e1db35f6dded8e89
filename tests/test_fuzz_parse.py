"""Hostile model output: 10,000 random and malformed texts through the tool-call parser and the ToolBox.

The well-formed part of the corpus is real: every ground-truth call of the Berkeley Function Calling
Leaderboard (the `bfcl-eval` wheel on PyPI ships its data) written the way a Hermes/Qwen model writes
calls, one `<tool_call>` block per call (parallel calls in one turn). Those must parse back exactly; their
mutations (cut anywhere, characters dropped, doubled, swapped for markers) and random text must never
raise, and every call the parser returns must be a well-formed ToolCall that the ToolBox answers with
a ToolResult (an unknown tool, bad JSON or bad arguments are the model's errors, never exceptions).
"""
from __future__ import annotations

import ast
import asyncio
import importlib.util
import json
import random
from pathlib import Path
from typing import Any

import pytest

from factory.rollout.parse import CLOSE, OPEN, parse_tool_calls
from factory.schema import PythonTool
from factory.tools import ToolBox
from factory.types import ToolCall

TOTAL = 10_000
BFCL_FILES = ["simple_python", "multiple", "parallel", "parallel_multiple", "live_simple", "live_multiple",
              "live_parallel", "live_parallel_multiple", "multi_turn_base"]


def _bfcl_dir() -> Path:
    found = importlib.util.find_spec("bfcl_eval")
    if found is None or not found.submodule_search_locations:
        pytest.fail("bfcl-eval is not installed: run bin/setup (it installs the wheel with --no-deps)")
    return Path(found.submodule_search_locations[0]) / "data" / "possible_answer"


def _first_option(value: Any) -> Any:
    """BFCL lists the acceptable values of each argument; nested objects list them per key too."""
    if isinstance(value, dict):
        return {k: _first_option(v[0]) for k, v in value.items() if isinstance(v, list) and v and v[0] != ""}
    return value


def _python_call(text: str) -> tuple[str, dict[str, Any]] | None:
    """`cd(folder='document')` (BFCL's multi-turn answers) -> (name, arguments); None for positional calls."""
    node = ast.parse(text, mode="eval").body
    if not isinstance(node, ast.Call) or node.args:
        return None
    return ast.unparse(node.func), {k.arg: ast.literal_eval(k.value) for k in node.keywords}


def bfcl_turns() -> list[list[tuple[str, dict[str, Any]]]]:
    """Every BFCL ground-truth turn as the list of (name, arguments) calls a model should make."""
    turns = []
    for name in BFCL_FILES:
        for line in (_bfcl_dir() / f"BFCL_v4_{name}.json").read_text().splitlines():
            truth = json.loads(line)["ground_truth"]
            if name.startswith("multi_turn"):
                for turn in truth:
                    calls = [c for c in map(_python_call, turn) if c is not None]
                    if calls:
                        turns.append(calls)
            else:
                turns.append([(fn, {k: _first_option(v[0]) for k, v in args.items() if v and v[0] != ""})
                              for call in truth for fn, args in call.items()])
    return turns


def hermes(calls: list[tuple[str, dict[str, Any]]], rng: random.Random) -> str:
    """The calls as a Hermes/Qwen model writes them, with the layouts models actually produce."""
    preamble = rng.choice(["", "I'll look that up.\n", "<think>\nThe user wants this.\n</think>\n\n"])
    blocks = []
    for name, args in calls:
        if rng.random() < 0.2:  # some models encode the arguments as a JSON string (OpenAI wire format)
            obj = {"name": name, "arguments": json.dumps(args)}
        else:
            obj = {"name": name, "arguments": args}
        body = json.dumps(obj, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, None, 2]))
        blocks.append(f"{OPEN}\n{body}\n{CLOSE}")
    return preamble + rng.choice(["\n", ""]).join(blocks) + rng.choice(["", "<|im_end|>"])


NOISE = [OPEN, CLOSE, "{", "}", "[", "]", '"', ":", ",", "\\", "\\u", "\\ud800", "\x00", "null", "NaN", "1e999",
         '"name"', '"arguments"', "\n", "<|im_end|>", "é", "🙂", "\u202e"]


def mutate(text: str, rng: random.Random) -> str:
    """One malformation of a model output."""
    kind = rng.randrange(8)
    i = rng.randrange(len(text) + 1)
    if kind == 0:  # cut off by the token budget
        return text[:i]
    if kind == 1:  # a character lost
        return text[:i] + text[i + 1:]
    if kind == 2:  # noise inserted
        return text[:i] + rng.choice(NOISE) + text[i:]
    if kind == 3:  # a stretch repeated
        j = rng.randrange(i, len(text) + 1)
        return text[:j] + text[i:j] + text[j:]
    if kind == 4:  # markers swapped or doubled
        return text.replace(CLOSE, OPEN, 1) if rng.random() < 0.5 else text.replace(OPEN, OPEN + OPEN, 1)
    if kind == 5:  # quotes the way some models write them
        return text.replace('"', "'")
    if kind == 6:  # deep nesting (json's recursion limit), a huge payload, or more digits than int() converts
        value = rng.choice([f'{"[" * depth}1{"]" * depth}' for depth in (50, 5_000, 200_000)] + ["1" * 5_000])
        return f'{OPEN}{{"name": "f", "arguments": {{"x": {value}}}}}{CLOSE}'
    return text[:i] + "".join(rng.choice(NOISE) for _ in range(rng.randrange(1, 6))) + text[i:]


def random_text(rng: random.Random) -> str:
    alphabet = "abc{}[]\":,\\ \n0123456789<>/_éλ🙂\x00"
    parts = [rng.choice(NOISE) if rng.random() < 0.3 else "".join(rng.choices(alphabet, k=rng.randrange(20)))
             for _ in range(rng.randrange(1, 12))]
    return "".join(parts)


def _well_formed(call: ToolCall) -> bool:
    if not isinstance(call.name, str) or not isinstance(call.raw, str):
        return False
    if call.arguments is None:
        return isinstance(call.parse_error, str) and bool(call.parse_error)
    return isinstance(call.arguments, dict) and call.parse_error is None


def echo(text: str) -> str:
    """Echoes its input.

    Args:
        text: anything
    """
    return text


def test_ten_thousand_model_outputs_never_break_the_parser_or_the_toolbox():
    rng = random.Random(13)
    turns = bfcl_turns()
    assert len(turns) > 2_000  # the wheel's data is all there
    corpus: list[str] = []
    for calls in turns:  # every real answer parses back exactly
        text = hermes(calls, rng)
        parsed = parse_tool_calls(text)
        assert [(c.name, c.arguments, c.parse_error) for c in parsed] == [(n, a, None) for n, a in calls], text
        corpus.append(text)
    real = list(corpus)
    while len(corpus) < TOTAL:
        corpus.append(mutate(rng.choice(real), rng) if rng.random() < 0.8 else random_text(rng))

    parsed_calls: list[ToolCall] = []
    for text in corpus:
        calls = parse_tool_calls(text)  # must not raise
        assert all(_well_formed(c) for c in calls), text
        assert len(calls) <= text.count(OPEN)
        parsed_calls += calls

    async def answer_all() -> list[Any]:
        box = ToolBox.from_spec({"echo": PythonTool(function=f"{__name__}:echo")})
        async with box:
            results = []
            for i in range(0, len(parsed_calls), 500):
                results += await box.call_many(parsed_calls[i:i + 500])
            return results

    results = asyncio.run(answer_all())
    assert len(results) == len(parsed_calls)
    assert {r.status for r in results} <= {"ok", "model_error"}  # no call made by the model is our failure
    kinds = {r.error_kind for r in results}
    assert {"unknown_tool", "parse_error"} <= kinds
