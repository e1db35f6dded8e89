"""Record, replay and cache tool calls, at the one seam every call crosses: the ToolBox's call to a
server (after the call was routed and its arguments checked against the tool's schema, before the server
is reached).

- Recording (`tracking.record_tools`, on by default): each call that reaches a tool becomes a row -- where
  in the run it was made (ToolCall.origin), the server, the tool, the arguments, the whole result, its
  status, error kind and latency. The driver takes the rows right after each step's rollout and evaluation
  and logs them as that step's `tool_calls/step_NNNNN.parquet` table.
- Replay (`replay.run`, `factory run SPEC --replay RUN`, `factory rescore RUN --replay RUN`): a recorded
  run's rows answer this run's calls. A call is matched by its origin and must name the same tool with the
  same arguments: a rollout's call by its episode's place and its turn, a tool reward node's by its
  trajectory's place and the node (`reward_origin`), so a rescore of some steps, or of a step's evaluation
  before its training batch, gets the answers recorded for those very trajectories. A recording made before
  reward calls had origins holds them with none: a reward call then takes the next unused origin-less row of
  the same tool and arguments, as every reward call did then (a call without an origin, from a trajectory
  read back from a table of that time, too). A call the recording does not hold is a miss: `replay.on_miss:
  live` calls the tool, `fail` answers an infrastructure error (`replay_miss`) and the driver stops the run
  as soon as the step's rollout (or evaluation) ends, before the step is trained on, naming the first miss.
  Under `fail` no call reaches a server, so none is started: the tools are offered as the recorded run's
  servers listed them (its `tools.json`), and a run whose server is down or gone can still be replayed.
- Cache (`tools.<server>.cache: true`): the answers of a deterministic tool, kept across runs in a sqlite
  file, keyed by (server, tool, the tool's schema hash, the arguments). Infrastructure failures are never
  kept.
"""
from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from factory.types import ToolCall, ToolResult
from factory.util import UserError

COLUMNS = ("origin", "server", "tool", "arguments", "text", "status", "error_kind", "latency_s", "source")


class ReplayMiss(UserError):
    """A replayed run made tool calls its recording does not hold (replay.on_miss: fail)."""


def canonical(arguments: Any) -> str:
    """The arguments as one string: JSON with sorted keys and no spaces (a key that does not depend on the
    order the model wrote them in)."""
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def schema_hash(input_schema: dict[str, Any]) -> str:
    return hashlib.sha256(canonical(input_schema).encode()).hexdigest()[:16]


@dataclass
class Recorder:
    """The calls since the last `take`, as table rows. A run's driver takes them after every rollout and
    evaluation; where nobody would (`factory rescore`, the agent server run the tools stage in-process) the
    stage records nothing (factory.runtime.local)."""

    rows: list[dict[str, Any]] = field(default_factory=list)

    def add(self, call: ToolCall, server: str, tool: str, result: ToolResult, latency_s: float, source: str) -> None:
        self.rows.append({"origin": call.origin, "server": server, "tool": tool, "arguments": canonical(call.arguments),
                          "text": result.text, "status": result.status, "error_kind": result.error_kind,
                          "latency_s": latency_s, "source": source})

    def take(self) -> list[dict[str, Any]]:
        rows, self.rows = self.rows, []
        return rows


REWARD = "reward/"  # the prefix of a tool reward node's origin


def reward_origin(episode: str, node: str, turn: int | None = None) -> str:
    """The origin of reward node `node`'s tool call on the trajectory made at `episode` (Trajectory.origin), at
    `turn` for a per-turn node: `reward/<split>/<step>/<attempt>/<prompt>/<sample>/<node>[/<turn>]`. A tool node
    makes one call per trajectory (per turn when per-turn), and a trajectory is scored once in a run, so it is
    unique there; it names the node, not its tool and arguments, so two nodes asking the same question keep
    their own answers. "" where the episode's place is not known: the call then replays in order."""
    if not episode:
        return ""
    return f"{REWARD}{episode}/{node}" + ("" if turn is None else f"/{turn}")


class Replay:
    """A recording's rows, answering calls (see the module doc). `misses` lists what it could not answer.
    `listing`: server -> the tools the recorded run offered ({name, description, inputSchema}); None: not
    known (a run that saved none), and the servers must be started to list them."""

    def __init__(self, rows: list[dict[str, Any]], on_miss: str,
                 listing: dict[str, list[dict[str, Any]]] | None = None):
        self.on_miss = on_miss
        self.listing = listing
        self.by_origin = {r["origin"]: r for r in rows if r["origin"]}
        self.in_order: dict[tuple[str, str, str], deque[dict[str, Any]]] = defaultdict(deque)
        for r in rows:
            if not r["origin"]:
                self.in_order[(r["server"], r["tool"], r["arguments"])].append(r)
        self.misses: list[str] = []

    def needs_no_server(self) -> bool:
        """Whether every call is answered from the recording or fails as a miss, and the tools to offer are
        known without asking the servers: then none is started."""
        return self.on_miss == "fail" and self.listing is not None

    def answer(self, call: ToolCall, server: str, tool: str) -> ToolResult | None:
        """The recorded result of `call`, or None (a miss, noted in `misses`)."""
        args = canonical(call.arguments)
        if call.origin:
            row = self.by_origin.get(call.origin)
            if row is not None and (row["server"], row["tool"], row["arguments"]) != (server, tool, args):
                row = None
            elif row is None and call.origin.startswith(REWARD):
                # A recording made before reward calls had origins holds them with none, in the order they
                # were made: they answer in order, as every reward call was answered then, so that a run of
                # that time stays rescorable. A newer recording holds no such rows: a miss.
                row = self._next(server, tool, args)
        else:
            row = self._next(server, tool, args)
        if row is None:
            self.misses.append(f"{tool}({args[:200]}) at {call.origin or 'a reward node'}")
            return None
        return ToolResult(tool=tool, text=row["text"], status=row["status"], error_kind=row["error_kind"])

    def _next(self, server: str, tool: str, args: str) -> dict[str, Any] | None:
        """The next unused origin-less row of this tool and arguments (None: none left)."""
        queue = self.in_order.get((server, tool, args))
        return queue.popleft() if queue else None


def cache_path() -> Path:
    from factory.assets import cache_dir

    return cache_dir() / "tool-cache.sqlite"


class ToolCache:
    """Answers of deterministic tools across runs (a sqlite file; one connection per process, guarded by a
    lock: the tools stage calls it from worker threads of its event loop, tests from several threads)."""

    def __init__(self, path: Path | None = None):
        self.path = path or cache_path()
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=5)
            # readers (every run sharing the cache) do not wait on a writer; a writer waits 5 s for another
            # at most, then the call goes to the live tool (ToolBox._cached_or_live)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS answers (key TEXT PRIMARY KEY, text TEXT, status TEXT, "
                             "error_kind TEXT, stored REAL)")
        return self._db

    @staticmethod
    def key(server: str, tool: str, input_schema: dict[str, Any], arguments: Any) -> str:
        """`server`: the server's identity (`server_identity`), not its name in the spec: two projects' `search`
        servers, or one server before and after a fix to its code, must not share answers."""
        return hashlib.sha256(canonical([server, tool, schema_hash(input_schema), arguments]).encode()).hexdigest()

    def get(self, key: str) -> ToolResult | None:
        with self._lock:
            row = self._conn().execute("SELECT text, status, error_kind FROM answers WHERE key = ?", (key,)).fetchone()
        return None if row is None else ToolResult(tool="", text=row[0], status=row[1], error_kind=row[2])

    def put(self, key: str, result: ToolResult) -> None:
        if result.status == "infra_error":  # ours, not the tool's answer
            return
        with self._lock:
            db = self._conn()
            db.execute("INSERT OR REPLACE INTO answers VALUES (?, ?, ?, ?, ?)",
                       (key, result.text, result.status, result.error_kind, time.time()))
            db.commit()

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


def server_identity(spec: Any, base_dir: Path | None) -> str:
    """What makes a tool server's answers its own, for the cross-run cache: how it is started (a stdio
    server's command, arguments, folder and environment; an HTTP server's URL; a python tool's function) and
    the content of its code where a file names it -- a script among the command and arguments, a `-m`
    module, the python tool's module: a fix to the server's code is a new key. Hashed (the environment may
    hold secrets)."""
    from factory.schema import HttpServer, PythonTool

    if isinstance(spec, HttpServer):
        parts: list[Any] = ["http", spec.url]
        files: list[Path | None] = []
    elif isinstance(spec, PythonTool):
        parts, files = ["python", spec.function], [_module_file(spec.function.partition(":")[0], Path.cwd())]
    else:
        from factory.tools.connection import stdio_parameters

        parts = ["stdio", spec.command, spec.args, spec.cwd, spec.env]
        launch = stdio_parameters(spec, base_dir)  # the files as the started process finds them: its folder is
        folder = Path(launch.cwd) if launch.cwd else Path.cwd()  # `cwd` (from the spec's folder), else this one
        files = [Path(launch.command)] if os.sep in spec.command else []  # a script started as the command
        files += [folder / a for a in spec.args if (folder / a).is_file()]
        files += [_module_file(spec.args[i + 1], folder) for i, a in enumerate(spec.args[:-1]) if a == "-m"]
    parts += [_file_mark(f) for f in files]
    return hashlib.sha256(canonical(parts).encode()).hexdigest()


_HASHED_BYTES = 4 << 20  # a file above this (a data file or an index among the arguments) counts by size and time


def _file_mark(path: Path | None) -> str | None:
    """A file's content hash; a large one's size and modification time (a multi-GB index among a server's
    arguments is not read to hash it)."""
    try:
        if path is None:
            return None
        stat = path.stat()
        if stat.st_size > _HASHED_BYTES:
            return f"{stat.st_size}:{stat.st_mtime_ns}"
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _module_file(module: str, folder: Path) -> Path | None:
    """The file of module `module` as `python -m` would run it from `folder` (the server's cwd, first on its
    path), else as this process finds it without running it; None when there is none."""
    import importlib.util

    base = folder.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__main__.py", base / "__init__.py"):
        if candidate.is_file():
            return candidate
    try:  # (finding a submodule imports its parents, which may raise anything: then it is not known)
        found = importlib.util.find_spec(module)
    except Exception:  # noqa: BLE001
        return None
    if found is None or not found.origin:
        return None
    origin = Path(found.origin)
    if found.submodule_search_locations is not None:  # a package: `python -m` runs its __main__.py
        origin = origin.parent / "__main__.py"
    return origin if origin.is_file() else None
