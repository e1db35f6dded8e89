"""Data sources: read rows (parquet, jsonl or a python generator), render the task prompt with jinja2,
and pack batches of chat prompts as pyarrow tables.

A batch table has a `messages` column (list of {role, content}) and every column of the source rows, so
reward functions receive the ground truth and any extra fields as keyword arguments.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa

from factory.schema import DataSource, DataSpec
from factory.util import import_path, resolve_file, template_env


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
