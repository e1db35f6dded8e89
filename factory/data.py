"""Data-prep: read rows (parquet, jsonl or a python generator), render the task prompt with jinja2, and
serve batches of chat prompts as pyarrow tables.

A batch table has a `messages` column (list of {role, content}) and every column of the source rows, so
reward functions receive the ground truth and any extra fields as keyword arguments.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa

from factory.spec.schema import DataSource, DataSpec
from factory.util import import_path, resolve_file, template_env


# ------------------------------------------------------------------------------------ task generators
def arithmetic(n: int, seed: int = 0, operands: tuple[int, int] = (2, 3), digits: tuple[int, int] = (2, 3),
               ops: str = "+-*") -> Iterable[dict[str, Any]]:
    """Integer arithmetic questions such as `47 * 83 - 215`, with the exact answer.

    2-3 operands of 2-3 digits: a 135M model cannot do these in its head, so reward needs the calculator.
    """
    rng = random.Random(seed)
    for _ in range(n):
        k = rng.randint(*operands)
        sizes = [rng.randint(*digits) for _ in range(k)]
        terms = [str(rng.randint(10 ** (d - 1), 10 ** d - 1)) for d in sizes]
        expr = terms[0]
        for term in terms[1:]:
            expr += f" {rng.choice(ops)} {term}"
        # eval is safe here: the expression is built above from digits and + - * only.
        yield {"question": f"What is {expr}?", "expression": expr, "answer": str(eval(expr))}


# --------------------------------------------------------------------------------------------- loading
def load_rows(source: DataSource, *, seed: int, base_dir: Path | None = None) -> list[dict[str, Any]]:
    """All rows of one source as plain dicts."""
    if source.generator is not None:
        fn = import_path(source.generator)
        return list(fn(n=source.size, seed=seed, **source.args))
    path = resolve_file(source.path, base_dir)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    raise ValueError(f"{path}: data files must be .parquet or .jsonl")


class PromptRenderer:
    """Turns a row into chat messages with the spec's jinja templates."""

    def __init__(self, spec: DataSpec, base_dir: Path | None = None):
        env = template_env()
        self._prompt = env.from_string(resolve_file(spec.prompt, base_dir).read_text()) if spec.prompt else None
        self._system = (env.from_string(resolve_file(spec.system_prompt, base_dir).read_text())
                        if spec.system_prompt else None)
        self._answer_key = spec.answer_key

    def messages(self, row: dict[str, Any]) -> list[dict[str, str]]:
        if self._prompt is not None:
            text = self._prompt.render(**row).strip()
            # A template may render a whole JSON message list, or just the user's text.
            messages = json.loads(text) if text.startswith("[") else [{"role": "user", "content": text}]
        elif isinstance(row.get("prompt"), list):
            messages = [dict(m) for m in row["prompt"]]
        elif "question" in row or "prompt" in row:
            messages = [{"role": "user", "content": str(row.get("question", row.get("prompt")))}]
        else:
            raise ValueError("a row needs a `prompt` messages column, a `question` column or data.prompt")
        if self._system is not None and not (messages and messages[0]["role"] == "system"):
            messages.insert(0, {"role": "system", "content": self._system.render(**row).strip()})
        return messages

    def row_fields(self, row: dict[str, Any]) -> dict[str, Any]:
        """The row as reward functions see it: `answer` is the ground-truth column."""
        fields = {k: v for k, v in row.items() if k != "prompt"}
        if self._answer_key in row:
            fields["answer"] = row[self._answer_key]
        return fields


def to_table(renderer: PromptRenderer, rows: list[dict[str, Any]]) -> pa.Table:
    """A batch table: `messages` plus the row's fields (as a JSON column, so heterogeneous rows fit)."""
    return pa.table({
        "messages": [renderer.messages(r) for r in rows],
        "row": [json.dumps(renderer.row_fields(r), sort_keys=True, default=str) for r in rows],
    })


def from_table(table: pa.Table) -> list[tuple[list[dict[str, Any]], dict[str, Any]]]:
    """(messages, row) pairs from a batch table."""
    return [(m, json.loads(r)) for m, r in zip(table.column("messages").to_pylist(),
                                                table.column("row").to_pylist())]


class DataStage:
    """The data-prep stage: an endless, seeded, epoch-shuffled stream of training batches and a fixed eval
    batch. Holds everything in memory: RL prompt sets are small next to the model."""

    def __init__(self, spec: DataSpec, *, seed: int, base_dir: Path | None = None, eval_size: int | None = None):
        self._spec, self._seed, self._base_dir, self._eval_size = spec, seed, base_dir, eval_size
        self._rows: list[dict[str, Any]] = []
        self._order: list[int] = []
        self._epoch = 0
        self._cursor = 0

    def setup(self) -> dict[str, int]:
        self._renderer = PromptRenderer(self._spec, self._base_dir)
        self._rows = load_rows(self._spec.train, seed=self._seed, base_dir=self._base_dir)
        if not self._rows:
            raise ValueError("data.train produced no rows")
        # Eval rows come from another seed stream so generated eval questions differ from training ones.
        self._eval = (load_rows(self._spec.eval, seed=self._seed + 1_000_003, base_dir=self._base_dir)
                      if self._spec.eval else [])
        if self._eval_size is not None:
            self._eval = self._eval[: self._eval_size]
        self._reshuffle()
        return {"train_rows": len(self._rows), "eval_rows": len(self._eval)}

    def _reshuffle(self) -> None:
        self._order = list(range(len(self._rows)))
        if self._spec.shuffle:
            random.Random(self._seed * 7919 + self._epoch).shuffle(self._order)
        self._cursor = 0

    def next_batch(self, n: int) -> pa.Table:
        rows = []
        while len(rows) < n:
            if self._cursor >= len(self._order):
                self._epoch += 1
                self._reshuffle()
            rows.append(self._rows[self._order[self._cursor]])
            self._cursor += 1
        return to_table(self._renderer, rows)

    def eval_batch(self) -> pa.Table | None:
        return to_table(self._renderer, self._eval) if self._eval else None

    def state(self) -> dict[str, int]:
        """Position in the stream, saved with checkpoints so a resumed run sees the same data."""
        return {"epoch": self._epoch, "cursor": self._cursor}

    def restore(self, state: dict[str, int]) -> None:
        self._epoch = state["epoch"]
        self._reshuffle()
        self._cursor = state["cursor"]
