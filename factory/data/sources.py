"""Data sources: read rows (parquet, jsonl or a python generator), render the task prompt with jinja2,
and pack batches of chat prompts as pyarrow tables.

A batch table has a `messages` column (list of {role, content}) and every column of the source rows, so
reward functions receive the ground truth and any extra fields as keyword arguments.
"""
from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import jinja2
import pyarrow as pa

from factory.schema import DataSource, DataSpec
from factory.util import UserError, import_object, importable, resolve_file, template_env


# --------------------------------------------------------------------------------------------- loading
# Eval rows come from another seed stream (seed + this) so generated eval questions differ from training ones;
# a small generator's question space still repeats across seeds, so held_out also drops the training rows that
# an eval row's prompt matches.
EVAL_SEED_OFFSET = 1_000_003

class DataError(UserError, ValueError):
    """Data rows that cannot be used (bad JSON, missing columns, wrong types), found while the data is
    prepared, before any training step. The message names the file (or generator) and every bad row."""


def read_source(source: DataSource, *, seed: int, base_dir: Path | None = None, limit: int | None = None
                ) -> tuple[list[dict[str, Any]], list[str]]:
    """All rows of one source as plain dicts, and where each came from (`file:line` for jsonl, `file row
    N` for parquet, `generator row N`), for error messages. `limit`: at most that many, the first ones (a
    generator is asked for that many, and no more are taken: an endless one is fine)."""
    if source.generator is not None:
        fn = import_object(source.generator)
        n = source.size if limit is None else min(source.size, limit)
        with importable(os.getcwd()):  # as in the data stage: a generator may import its helpers when called
            rows = list(itertools.islice(fn(n=n, seed=seed, **source.args), n))
        return rows, [f"{source.generator} row {i + 1}" for i in range(len(rows))]
    path = resolve_file(source.path, base_dir)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        if limit is None:
            rows = pq.read_table(path).to_pylist()
        else:
            rows = next(pq.ParquetFile(path).iter_batches(batch_size=limit), None)
            rows = rows.to_pylist() if rows is not None else []
        return rows, [f"{source.path} row {i + 1}" for i in range(len(rows))]
    if path.suffix == ".json" and _starts_with(path, "["):  # one JSON array of rows (not JSON Lines)
        text = path.read_text(encoding="utf-8-sig", errors="surrogateescape")
        if (bad := not_utf8(text)) is not None:
            raise DataError(f"{source.path}:{bad[0]}: {bad[1]}")
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{source.path}:{e.lineno}: invalid JSON: {e}") from None
        rows = rows if limit is None else rows[:limit]
        return rows, [f"{source.path} row {i + 1}" for i in range(len(rows))]
    if path.suffix in (".jsonl", ".json"):
        rows, origins, problems = [], [], []
        # utf-8-sig: a byte-order mark (Windows tools write one) is not part of the first row's JSON;
        # surrogateescape: a byte that is not UTF-8 is said at its line (`not_utf8`)
        with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:
            for number, line in enumerate(f, 1):
                if limit is not None and len(rows) + len(problems) >= limit:
                    break
                if (bad := not_utf8(line)) is not None:
                    problems.append(f"{source.path}:{number}: {bad[1]}")
                    continue
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                    origins.append(f"{source.path}:{number}")
                except json.JSONDecodeError as e:
                    problems.append(f"{source.path}:{number}: invalid JSON: {e}")
        if problems:
            raise DataError(_listed(problems))
        return rows, origins
    raise DataError(f"{source.path}: data files must be .parquet, .jsonl or .json")


# What a byte that is not UTF-8 becomes when read with errors="surrogateescape"; text that is UTF-8 never holds one
# (JSON's `\udce9` escape is six ASCII characters until json.loads reads it)
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")


def not_utf8(text: str) -> tuple[int, str] | None:
    """Where `text`, a data file's (or one of its lines) read with errors="surrogateescape", holds a byte that is not
    UTF-8: (its line, counted from 1; `not UTF-8 (byte 0xe9 at column 18)`), or None. The decoder's own error named
    a position in its read buffer ("position 3496", of a byte on line 2001)."""
    if (match := _ESCAPED_BYTE.search(text)) is None:
        return None
    at = match.start()
    column = at - text.rfind("\n", 0, at)  # (from 1: rfind is -1 on the first line)
    return text.count("\n", 0, at) + 1, f"not UTF-8 (byte 0x{ord(match.group()) - 0xDC00:02x} at column {column})"


def _starts_with(path: Path, char: str) -> bool:
    """Whether a text file's first character that is not white space (or a byte-order mark) is `char`."""
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        while chunk := f.read(4096):
            if chunk.strip():
                return chunk.lstrip()[0] == char
    return False


def prompt_key(renderer: PromptRenderer, row: Any) -> str | None:
    """What identifies a row's prompt: the chat messages the model reads for it (None for a row that cannot
    render them: check_rows says why where that row is used)."""
    if not isinstance(row, dict):
        return None
    try:
        return json.dumps(renderer.messages(row), sort_keys=True)
    except (ValueError, TypeError, jinja2.TemplateError):
        return None


def held_out(rows: list[dict[str, Any]], eval_rows: list[Any], renderer: PromptRenderer) -> list[dict[str, Any]]:
    """The training rows whose prompt no eval row has: the eval split is held out of training."""
    held = {prompt_key(renderer, r) for r in eval_rows} - {None}
    return [row for row in rows if prompt_key(renderer, row) not in held]


def load_rows(source: DataSource, *, seed: int, base_dir: Path | None = None) -> list[dict[str, Any]]:
    """All rows of one source as plain dicts."""
    return read_source(source, seed=seed, base_dir=base_dir)[0]


_SHOWN_PROBLEMS = 10


def _listed(problems: list[str]) -> str:
    more = len(problems) - _SHOWN_PROBLEMS
    return "\n".join(problems[:_SHOWN_PROBLEMS] + ([f"... and {more} more"] if more > 0 else []))


def check_rows(rows: list[Any], origins: list[str], renderer: PromptRenderer,
               required: Mapping[str, str] | None = None, judges: Mapping[str, jinja2.Template] | None = None,
               valued: Collection[str] = ()) -> None:
    """Every row renders to valid chat messages and has the columns the reward functions need; raises
    DataError listing the bad rows. `required`: column -> who needs it (`rewards.correct`); `judges`: the
    reward graph's templates (node -> one compiled by row_template_env), which must not print a null;
    `valued`: the required columns a reward function takes as a parameter, which must not be null."""
    rows_with: dict[str, list[str]] = {}  # problem -> the rows that have it (one line for a column missing everywhere)
    for row, where in zip(rows, origins):
        problem = row_problem(row, renderer, required or {}, judges or {}, valued)
        if problem:
            rows_with.setdefault(problem, []).append(where)
    if rows_with:
        raise DataError(_listed([f"{where[0]}{f' and {len(where) - 1} more rows' if len(where) > 1 else ''}: "
                                 f"{problem}" for problem, where in rows_with.items()]))


_ABSENT = object()


def column(row: dict[str, Any], name: str) -> Any:
    """The row's column `name`, or, where no column has that name, a dotted path into nested columns
    (`reward_model.ground_truth`, where verl's parquet keeps the answer); `_ABSENT` when neither is there."""
    if name in row:
        return row[name]
    value: Any = row
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return _ABSENT
        value = value[part]
    return value


def row_problem(row: Any, renderer: PromptRenderer, required: Mapping[str, str],
                judges: Mapping[str, jinja2.Template] | None = None, valued: Collection[str] = ()) -> str | None:
    """Why one row cannot be used, or None. `judges`, `valued`: see check_rows."""
    if not isinstance(row, dict):
        return f"expected an object of columns, got {type(row).__name__}"
    if unencodable := [c for c, value in row.items() if not _utf8(c) or not _utf8(value)]:
        # repr escapes the surrogate: the message naming the column must itself print
        return f"text that is not valid Unicode (a lone surrogate) in column {unencodable[0]!r}"
    missing = [f"'{c}' (needed by {who})" for c, who in required.items() if column(row, c) is _ABSENT]
    if missing:
        return f"missing column {', '.join(missing)}"
    # a null where a reward function needs a value: it was called with None (exact_match then scored the
    # answer "None" right). (A template may guard a null column with {% if %}: its render says.)
    null = [f"'{c}' (needed by {who})" for c, who in required.items() if c in valued and column(row, c) is None]
    if null:
        return f"null value in column {', '.join(null)}: give it a value, or leave the row out"
    try:
        renderer.messages(row)
    except (ValueError, TypeError, jinja2.TemplateError) as e:
        return str(e)
    for name, template in (judges or {}).items():
        # rendered with the row and an empty trajectory: only a null the row puts in it is this row's problem
        # (a template that needs a real trajectory fails here for that reason alone, and is left to the run)
        try:
            template.render({**renderer.row_fields(row), "prompt": "", "completion": "", "turns": []})
        except NullValueError as e:
            return f"rewards.{name}'s template {e}"
        except Exception:  # noqa: BLE001 (see above)
            pass
    return None


def _utf8(value: Any) -> bool:
    """Whether every text in `value` encodes as UTF-8. JSON allows a lone surrogate (`\\ud800`) and json.loads
    keeps it in a str that nothing downstream (a batch, the tokenizer, a log) can encode."""
    try:
        json.dumps(value, ensure_ascii=False, default=str).encode()
    except UnicodeEncodeError:
        return False
    return True


def messages_from_text(text: str, what: str = "") -> list[dict[str, str]]:
    """The chat messages a rendered template means: a JSON list of messages when the text starts with `[`
    (worked examples as real chat turns), else the text as one user message. The one rule for
    `data.prompt` and judge prompts. ValueError (naming `what`) when the JSON is broken or not such a list."""
    if not text.strip():  # an empty template, or one whose every `{% if %}` failed: the model reads nothing
        raise ValueError(f"{what} rendered no text: the user's message would be empty".lstrip())
    if not text.lstrip().startswith("["):
        return [{"role": "user", "content": text}]
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} rendered invalid JSON: {_json_mistake(e)}".lstrip()) from None
    check_messages(messages)
    return messages


def _json_mistake(e: json.JSONDecodeError) -> str:
    """The decoder's complaint with the text of the rendered line (a line of the template's output, not of the
    template) at the mistake: the template's text where it can tell, so that one mistake of the template is one
    problem for all its rows. Without the decoder's `(char N)` nor column, which move with the lengths of the row's
    values before the mistake. At a bracket, a brace, a comma or a colon the mistake is the template's own text,
    quoted from there on (`,]`: a trailing comma). Anywhere else it is most likely in a row's value (printed bare,
    `{{ question }}` without `| tojson`, or a quote inside quotes), where the decoder stops at the value's start
    (`What`) or after a part of it that parses (`12` of `12+34?`): the template's text up to that value (its key,
    from the comma or bracket before it) is quoted instead."""
    lines = e.doc.splitlines()
    line = lines[e.lineno - 1] if e.lineno <= len(lines) else ""
    before, at = line[:e.colno - 1].lstrip(), line[e.colno - 1:]
    where = f"{e.msg} at line {e.lineno} of the rendered text"
    if at and at[0] in "[]{},:" or not before:
        return f"{where}, at {at[:40] + ('...' if len(at) > 40 else '')!r}"
    before = _template_text_before(before)
    return f"{where}, in the value after {('...' if len(before) > 40 else '') + before[-40:]!r}"


def _template_text_before(text: str) -> str:
    """The end of `text` (a rendered line up to a value the decoder stopped in) that is the template's own text:
    from the last bracket, brace or comma outside a JSON string to where the value starts (the last of them or
    a colon outside one), a key and its colon at most. A string before it may be a row's value printed through
    `tojson` (or hold a comma of it), different in every row; all of `text` where it has no such character."""
    start = end = -1
    inside = escaped = False
    for i, c in enumerate(text):
        if escaped:  # the character after a backslash in a string: an escaped quote does not end it
            escaped = False
        elif inside and c == "\\":
            escaped = True
        elif c == '"':
            inside = not inside
        elif inside:
            continue
        elif c in "[{,":
            start = end = i
        elif c == ":":
            end = i
    return text[max(start, 0):end + 1] if end >= 0 else text


def check_messages(messages: Any) -> None:
    """Chat messages as templates and the rollout expect them: a non-empty list of {role, content}."""
    if not isinstance(messages, list) or not messages:
        got = _kind(messages) if messages else "an empty list"
        raise ValueError(f"expected a non-empty list of chat messages, got {got}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"message {i}: expected an object with role and content, got {_kind(m)}")
        if m.get("role") not in _ROLES:
            raise ValueError(f"message {i}: role must be one of {', '.join(_ROLES)}, got {m.get('role')!r}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"message {i}: content must be a string, got {_kind(m.get('content'))}")


_ROLES = ("system", "user", "assistant", "tool")


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__


class NullValueError(ValueError):
    """A `{{ ... }}` of a prompt template printed a null value."""


def _not_null(value: Any) -> Any:
    """Every value a prompt template prints: a null (a JSON null, a parquet null, a column made null to fill a
    schema) would be printed as the text `None` in the model's (or a judge's) prompt."""
    if value is None:
        raise NullValueError("printed a null value (a column that is null in this row) where the prompt would "
                             "read 'None'; write `{{ x or '' }}` or `{% if x %}` where a column may be null")
    return value


def row_template_env() -> jinja2.Environment:
    """The environment of templates rendered with a row (data.prompt, data.system_prompt, judge prompts,
    tool nodes' arguments): template_env's, refusing to print a null."""
    env = template_env()
    env.finalize = _not_null  # before any template is compiled: the compiler reads it
    return env


class PromptRenderer:
    """Turns a row into chat messages with the spec's jinja templates."""

    def __init__(self, spec: DataSpec, base_dir: Path | None = None):
        env = row_template_env()
        self._prompt = env.from_string(resolve_file(spec.prompt, base_dir).read_text()) if spec.prompt else None
        self._system = (env.from_string(resolve_file(spec.system_prompt, base_dir).read_text())
                        if spec.system_prompt else None)
        self._answer_key = spec.answer_key
        self._prompt_file = spec.prompt

    def system_unused(self, row: dict[str, Any]) -> bool:
        """Whether data.system_prompt is set but not used for this row: its messages (data.prompt's, or its
        own `prompt` column) already begin with a system message, which is kept."""
        return self._system is not None and self._messages(row)[0]["role"] == "system"

    def messages(self, row: dict[str, Any]) -> list[dict[str, str]]:
        """The row's chat messages; ValueError (or a jinja error naming a missing column) when the row
        cannot make them."""
        messages = self._messages(row)
        if self._system is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self._render(self._system, row, "data.system_prompt")})
        return messages

    def _messages(self, row: dict[str, Any]) -> list[dict[str, str]]:
        """The row's messages before data.system_prompt."""
        if self._prompt is not None:
            # a template may render a whole JSON message list, or just the user's text
            messages = messages_from_text(self._render(self._prompt, row, "data.prompt"),
                                          f"data.prompt ({self._prompt_file})")
        elif isinstance(row.get("prompt"), list):
            messages = [dict(m) if isinstance(m, dict) else m for m in row["prompt"]]
        elif isinstance(row.get("question", row.get("prompt")), str):
            messages = [{"role": "user", "content": row.get("question", row.get("prompt"))}]
        elif "question" in row or "prompt" in row:
            column = "question" if "question" in row else "prompt"
            raise ValueError(f"column '{column}' must be a string{' or a list of messages' * (column == 'prompt')}, "
                             f"got {_kind(row[column])}")
        else:
            raise ValueError("a row needs a `prompt` messages column, a `question` column or data.prompt")
        check_messages(messages)
        return messages

    @staticmethod
    def _render(template: jinja2.Template, row: dict[str, Any], name: str) -> str:
        try:
            return template.render(**row).strip()
        except jinja2.UndefinedError as e:  # StrictUndefined: the template reads a column the row lacks
            raise ValueError(f"{name} needs a column this row does not have: {e.message}") from None
        except NullValueError as e:
            raise ValueError(f"{name} {e}") from None

    def row_fields(self, row: dict[str, Any]) -> dict[str, Any]:
        """The row as reward functions see it: `answer` is the ground-truth column."""
        fields = {k: v for k, v in row.items() if k != "prompt"}
        if (answer := column(row, self._answer_key)) is not _ABSENT:
            fields["answer"] = answer
        return fields


def to_table(renderer: PromptRenderer, rows: list[dict[str, Any]]) -> pa.Table:
    """A batch table: each row's `messages` and its fields, both as JSON text. (A nested pyarrow column infers
    one struct type over the batch: every message would gain every key any message has, every tool call's
    arguments every other call's names, as null, and values of two types in one place would not convert.)"""
    return pa.table({
        "messages": [json.dumps(renderer.messages(r), default=str) for r in rows],
        "row": [json.dumps(renderer.row_fields(r), sort_keys=True, default=str) for r in rows],
    })


def from_table(table: pa.Table) -> list[tuple[list[dict[str, Any]], dict[str, Any]]]:
    """(messages, row) pairs from a batch table."""
    return [(json.loads(m), json.loads(r)) for m, r in zip(table.column("messages").to_pylist(),
                                                            table.column("row").to_pylist())]
