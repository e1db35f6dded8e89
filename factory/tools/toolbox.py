"""ToolBox: every tool of a spec behind one async `call`, for the rollout and the driver.

Naming rule. The spec's `tools:` maps a SERVER name to a server; a server exposes several tools. A
tool is offered to the model under its own name when no other server has a tool of that name, else
as `<server>__<tool>`; `<server>__<tool>` is always accepted in calls too. A python tool is one
tool whose name is its key in the spec.

Failures, kept apart. model_error (the model's fault, shown to it and trained on): unknown_tool,
parse_error (the call's JSON did not parse), bad_arguments (fails the tool's inputSchema, checked
here with jsonschema before anything is sent), tool_error (the tool's own isError, or a python tool
that raised). infra_error (ours; the spec decides if the trajectory trains): timeout, crash,
transport, circuit_open.

Event loop. A ToolBox belongs to the event loop that ran `start()` (the rollout actor's); call it
only from that loop. All its calls run concurrently, bounded only by each server's `concurrency`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import jsonschema
import jsonschema.exceptions
import jsonschema.validators

from factory.schema import TOOL_QUALIFIER, PythonTool, ToolSpec
from factory.tools.metrics import ToolMetrics
from factory.tools.recording import Recorder, Replay, ToolCache, server_identity
from factory.tools.resilience import Resilience
from factory.tools.results import infra_error, model_error, truncate_middle
from factory.tools.servers import McpServer, PythonFunction
from factory.types import ToolCall, ToolResult
from factory.util import being_cancelled

log = logging.getLogger(__name__)

Backend = McpServer | PythonFunction


@dataclass(frozen=True)
class ToolEntry:
    """One tool as offered to the model."""

    offered: str  # the name the model calls
    server: str  # key in the spec's `tools:`
    tool: str  # the name the server knows it by
    description: str
    input_schema: dict[str, Any]


class ToolBox:
    """The tools of one spec: MCP servers (stdio, streamable HTTP) and python functions.

    Lives in one asyncio event loop, the one that ran `start()`; share it between the rollout's
    trajectories (tasks of that loop), not between loops or threads. `close()` then `start()` again
    (even in another loop, as a stage that runs `asyncio.run` per step does) starts fresh servers;
    metrics carry over until reset.
    """

    def __init__(self, tools: Mapping[str, ToolSpec], *, base_dir: Path | None, resilience: Resilience,
                 record: bool = False) -> None:
        self._specs = dict(tools)
        # factory.tools.recording: the calls kept for the run's tables, a recording that answers calls, the
        # cross-run cache of the servers marked `cache: true` (opened on first use)
        self.recorder = Recorder() if record else None
        self.replay: Replay | None = None
        self._cache: ToolCache | None = None
        self._cache_warned = False
        self._identities: dict[str, str] = {}  # server -> its identity in the cache's keys (recording.server_identity)
        self._base_dir = base_dir
        self._resilience = resilience
        self._metrics = ToolMetrics()
        self._backends: dict[str, Backend] = {}
        self._entries: list[ToolEntry] = []
        self._routes: dict[str, ToolEntry] = {}
        self._validators: dict[str, Any] = {}
        self._running = False

    @classmethod
    def from_spec(
        cls, tools: Mapping[str, ToolSpec], *, base_dir: Path | None = None, resilience: Resilience | None = None,
        record: bool = False,
    ) -> ToolBox:
        """Build, without side effects: nothing is started, imported or connected until `start()`. `record`:
        keep every call that reaches a tool in `recorder` (factory.tools.recording)."""
        for name in tools:
            if TOOL_QUALIFIER in name:
                raise ValueError(f"tool server name {name!r} must not contain {TOOL_QUALIFIER!r} (it joins server and tool)")
        return cls(tools, base_dir=base_dir, resilience=resilience or Resilience(), record=record)

    def _make_backend(self, name: str, spec: ToolSpec) -> Backend:
        if isinstance(spec, PythonTool):
            return PythonFunction(name, spec, resilience=self._resilience)
        return McpServer(name, spec, base_dir=self._base_dir, resilience=self._resilience, metrics=self._metrics)

    # ------------------------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start every server in parallel, initialize sessions, list and check tools. No-op when running.

        Raises (after stopping whatever did start) if a server fails to start, lists no tool that
        `allowed_tools` names, or a python tool cannot be imported or described.
        """
        if self._running:
            return
        if self.replay is not None and self.replay.needs_no_server():
            self._offer(recorded_listings(self._specs, self.replay.listing or {}))
            self._running = True
            return
        # Fresh backends at each start: their locks and sessions belong to the loop that starts them.
        self._backends = {name: self._make_backend(name, spec) for name, spec in self._specs.items()}
        names = list(self._backends)
        results = await asyncio.gather(*(self._backends[n].start() for n in names), return_exceptions=True)
        failures = [(n, r) for n, r in zip(names, results) if isinstance(r, BaseException)]
        try:
            if failures:
                raise ToolStartError("; ".join(f"{n}: {e}" for n, e in failures)) from failures[0][1]
            self._offer(self._listings())
        except BaseException:
            await self._close_backends()
            raise
        self._running = True

    async def close(self) -> None:
        """Stop every server (no orphan processes). Safe to call twice."""
        self._running = False
        await self._close_backends()
        if self._cache is not None:
            self._cache.close()

    async def _close_backends(self) -> None:
        backends, self._backends = self._backends, {}
        await asyncio.gather(*(b.close() for b in backends.values()), return_exceptions=True)

    async def __aenter__(self) -> ToolBox:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # -------------------------------------------------------------------------------------- listing
    def _offer(self, listings: Mapping[str, list[Listed]]) -> None:
        self._entries = offered_tools(listings)
        self._routes = routes(self._entries)
        self._validators = {e.offered: compile_validator(e) for e in self._entries}

    def _listings(self) -> dict[str, list[Listed]]:
        """server -> [(tool, description, inputSchema)] of the allowed tools, checking allowed_tools."""
        out: dict[str, list[Listed]] = {}
        for name, backend in self._backends.items():
            if isinstance(backend, PythonFunction):
                fn = backend.schema["function"]
                tools = [(name, fn.get("description") or "", fn["parameters"])]
            else:
                tools = [(t.name, t.description or "", t.input_schema) for t in backend.tools]
            out[name] = allowed_only(name, tools, backend.spec.allowed_tools, "the server has")
        return out

    def schemas(self) -> list[dict[str, Any]]:
        """The offered tools in the OpenAI/HF function-tool format that chat templates take."""
        return [
            {
                "type": "function",
                "function": {"name": e.offered, "description": e.description, "parameters": e.input_schema},
            }
            for e in self._entries
        ]

    def tool_listing(self) -> dict[str, list[dict[str, Any]]]:
        """server -> [{name, offered_as, description, inputSchema}] of the offered tools (for check and the Plan)."""
        listing: dict[str, list[dict[str, Any]]] = {name: [] for name in self._specs}
        for e in self._entries:
            listing[e.server].append(
                {"name": e.tool, "offered_as": e.offered, "description": e.description, "inputSchema": e.input_schema}
            )
        return listing

    # ---------------------------------------------------------------------------------------- calls
    async def call(self, call: ToolCall, expired: bool = False) -> ToolResult:
        """Run one call from the model. Never raises for tool or server problems: every failure is a
        ToolResult with status model_error/infra_error and an error_kind; text is cut to the server's
        `max_result_chars`; latency_s is the whole time the caller waited (queueing and retries included).
        `expired`: the episode's deadline passed before the call was sent (factory.rollout.agent.send_expired):
        answered and recorded as a call the deadline cut, and neither run nor replayed.
        """
        started = time.perf_counter()
        entry = self._routes.get(call.name)
        result = await self._dispatch(call, entry, expired)
        if entry is not None:
            result.text = truncate_middle(result.text, self._specs[entry.server].max_result_chars)
            result.tool = entry.offered
        result.latency_s = time.perf_counter() - started
        self._metrics.record(entry.offered if entry else None, result)
        return result

    async def call_many(self, calls: Iterable[ToolCall]) -> list[ToolResult]:
        """The calls of one turn, run concurrently; results in the order of the calls."""
        return list(await asyncio.gather(*(self.call(c) for c in calls)))

    async def _dispatch(self, call: ToolCall, entry: ToolEntry | None, expired: bool = False) -> ToolResult:
        if not self._running:
            return infra_error(call.name, "transport", "Error: the tools are not running.")
        if entry is None and call.parse_error is not None:
            # Its JSON did not parse, so its name is a guess or '?': the model is told why the call could not be
            # read, not that it named no tool
            return model_error(call.name, "parse_error", f"Error: the tool call could not be read: {call.parse_error}.")
        if entry is None:
            available = ", ".join(e.offered for e in self._entries)
            text = f"Error: unknown tool {call.name!r}. Available tools: {available}."
            return model_error(call.name, "unknown_tool", text)
        name = entry.offered
        if call.arguments is None:
            reason = f": {call.parse_error}" if call.parse_error else ""
            return model_error(name, "parse_error", f"Error: the arguments of {name} are not valid JSON{reason}.")
        try:
            problem = argument_problem(self._validators[name], call.arguments)
        except Exception as exc:  # noqa: BLE001 -- a schema check_schema passes that cannot be applied: a `$ref` to
            # nothing or to a remote document, a recursion without end. Not enforced from now on, as an invalid one.
            if isinstance(exc, RecursionError) and nesting_depth(call.arguments) > MAX_ARGUMENT_DEPTH:
                # This call's fault, not the schema's: the check recurses once per level of a recursive schema (a
                # tree), and a call nested a few hundred deep ran out of stack. Taken for the schema's, it switched the
                # check off for the rest of the run, letting every later invalid call through to the server.
                return model_error(name, "bad_arguments", f"Error: invalid arguments for {name}: nested too deeply "
                                                          f"(more than {MAX_ARGUMENT_DEPTH} levels).")
            log.warning("tool server %r: tool %r's inputSchema cannot be applied, its arguments are not checked (the "
                        "server judges them): %s: %s", entry.server, entry.tool, type(exc).__name__, exc)
            self._validators[name] = None
            problem = argument_problem(None, call.arguments)
        if problem is not None:
            return model_error(name, "bad_arguments", f"Error: invalid arguments for {name}: {problem}")
        if expired:  # recorded as one the deadline cancelled while it ran is
            timed_out = infra_error(name, "episode_timeout", "Error: the episode ran out of time.")
            if self.recorder is not None:
                self.recorder.add(call, entry.server, entry.tool, timed_out, 0.0, "live")
            return timed_out
        started, source = time.perf_counter(), "live"
        result = self.replay.answer(call, entry.server, entry.tool) if self.replay is not None else None
        if result is not None:
            source = "replay"
        elif self.replay is not None and self.replay.on_miss == "fail":
            return infra_error(name, "replay_miss", f"Error: the replayed run has no answer for this call to {name}.")
        else:
            try:
                result, source = await self._cached_or_live(call, entry)
            except asyncio.CancelledError:
                # The episode's deadline (rollout.episode_timeout_s) cancelled it: recorded as the agent loop
                # answers it, since it reached the tool (whose side effects may have happened)
                if self.recorder is not None:
                    timed_out = infra_error(name, "episode_timeout", "Error: the episode ran out of time.")
                    self.recorder.add(call, entry.server, entry.tool, timed_out, time.perf_counter() - started, "live")
                raise
        if self.recorder is not None:
            self.recorder.add(call, entry.server, entry.tool, result, time.perf_counter() - started, source)
        return result

    async def _cached_or_live(self, call: ToolCall, entry: ToolEntry) -> tuple[ToolResult, str]:
        """The server's answer, from the cross-run cache when the server is marked `cache: true`. The cache
        is an optimisation: its sqlite calls run off the event loop (a write lock held by another run must
        not stall every call in flight), and a cache that fails (locked, full, corrupt) is passed by: the
        call goes to the live tool."""
        key = None
        if self._specs[entry.server].cache:
            self._cache = self._cache or ToolCache()
            try:
                if entry.server not in self._identities:  # once a run: it reads the server's code (off the loop)
                    self._identities[entry.server] = await asyncio.to_thread(
                        server_identity, self._specs[entry.server], self._base_dir)
                key = ToolCache.key(self._identities[entry.server], entry.tool, entry.input_schema, call.arguments)
                cached = await asyncio.to_thread(self._cache.get, key)
            except (sqlite3.Error, OSError) as exc:
                self._cache_failed(exc, entry.offered)
                cached = key = None
            else:
                self._metrics.server_event(entry.server, "cache_hits" if cached else "cache_misses")
            if cached is not None:
                return cached, "cache"
        try:
            result = await self._backends[entry.server].call(entry.tool, call.arguments)
        except (Exception, asyncio.CancelledError) as exc:  # a bug of ours must not end a rollout: count it as
            # infrastructure; a CancelledError too, unless the call was cancelled (the episode's deadline: _dispatch
            # records it so): one raised by a server's client code ended the whole rollout as if its deadline passed
            if isinstance(exc, asyncio.CancelledError) and being_cancelled():
                raise
            log.exception("tool call %s failed unexpectedly", entry.offered)
            return infra_error(entry.offered, "transport",
                               f"Error: the call to {entry.offered} failed ({type(exc).__name__})."), "live"
        if key is not None:
            try:
                await asyncio.to_thread(self._cache.put, key, result)
            except (sqlite3.Error, OSError) as exc:
                self._cache_failed(exc, entry.offered)
        return result, "live"

    def _cache_failed(self, exc: Exception, tool: str) -> None:
        """One warning per ToolBox (a broken cache would otherwise say so on every call)."""
        if not self._cache_warned:
            self._cache_warned = True
            log.warning("the tool cache %s failed (%s: %s): %s and later calls go to the live tools",
                        self._cache.path if self._cache else "", type(exc).__name__, exc, tool)

    def server_events(self) -> dict[str, dict[str, int]]:
        """Restarts and circuit opens since the last ask (and a cached server's hits and misses, 0 where it
        had none: a step without them logs 0, not a gap), and a fresh count (for the tools stage, whose
        callers count their calls themselves)."""
        events = self._metrics.take_server_events()
        for name, spec in self._specs.items():
            if getattr(spec, "cache", False):
                counts = events.setdefault(name, {})
                for event in ("cache_hits", "cache_misses"):
                    counts.setdefault(event, 0)
        return events

    def metrics(self, reset: bool = False) -> dict[str, float]:
        """Per-tool calls, model_errors, infra_errors, timeouts, errors, latency_s_p50/p95, and totals."""
        return self._metrics.snapshot(reset=reset)


class ToolStartError(RuntimeError):
    """The tools could not be started; the message names each server that failed and why."""


# ------------------------------------------------------------------------------------ pure helpers
Listed = tuple[str, str, dict[str, Any]]  # a tool as a server lists it: (name, description, inputSchema)


def allowed_only(server: str, tools: list[Listed], allowed: list[str] | None, listed_by: str) -> list[Listed]:
    """The tools `allowed_tools` keeps (all when it is unset); it must name only tools that are there."""
    if allowed is None:
        return tools
    missing = sorted(set(allowed) - {t[0] for t in tools})
    if missing:
        have = ", ".join(t[0] for t in tools)
        raise ToolStartError(f"{server}: allowed_tools names unknown tool(s) {missing}; {listed_by}: {have}")
    return [t for t in tools if t[0] in allowed]


def recorded_listings(specs: Mapping[str, ToolSpec],
                      listing: Mapping[str, list[dict[str, Any]]]) -> dict[str, list[Listed]]:
    """The spec's servers' tools as a recorded run's servers listed them (its `tools.json`, the tools it
    offered): what a replay that starts no server offers. A server the recording has no listing of (one
    added since) cannot be offered without starting it."""
    out: dict[str, list[Listed]] = {}
    for name, spec in specs.items():
        if name not in listing:
            raise ToolStartError(
                f"{name}: the replayed run had no tool server of this name, so its tools are not known without "
                "starting it; remove it from the spec, or set replay.on_miss=live to start the servers and call "
                "the tools for what the recording does not hold")
        tools = [(t["name"], t.get("description") or "", t["inputSchema"]) for t in listing[name]]
        out[name] = allowed_only(name, tools, spec.allowed_tools, "the replayed run's server offered")
    return out


def qualified_name(server: str, tool: str) -> str:
    """The name that always reaches `tool` of `server`, whether or not its bare name is unique."""
    return f"{server}{TOOL_QUALIFIER}{tool}"


def offered_tools(listings: Mapping[str, list[tuple[str, str, dict[str, Any]]]]) -> list[ToolEntry]:
    """Name each tool for the model: its own name when unique across servers, else `server__tool`.

    ToolStartError when two tools would be offered under one name (a tool whose own name has `__` in it can
    equal another's `server__tool`): the model could not tell them apart, and one would be reachable by no name.
    A server that lists one tool twice (a server's bug, a repeated page of its listing) is offered it once, its first
    listing, with a warning: no rename could part the two, and `allowed_tools` names both or neither."""
    listings = {server: _listed_once(server, tools) for server, tools in listings.items()}
    counts = Counter(tool for tools in listings.values() for tool, _, _ in tools)
    entries = [
        ToolEntry(
            offered=tool if counts[tool] == 1 else qualified_name(server, tool),
            server=server,
            tool=tool,
            description=description,
            input_schema=schema,
        )
        for server, tools in listings.items()
        for tool, description, schema in tools
    ]
    first: dict[str, ToolEntry] = {}
    for entry in entries:
        other = first.setdefault(entry.offered, entry)
        if other is not entry:
            raise ToolStartError(
                f"tools {other.server}.{other.tool} and {entry.server}.{entry.tool} would both be offered to the model "
                f"as {entry.offered!r} (a tool's name is `server{TOOL_QUALIFIER}tool` when another server has a tool "
                "of that name too): rename one, or leave one out with allowed_tools")
    return entries


def _listed_once(server: str, tools: list[tuple[str, str, dict[str, Any]]]) -> list[tuple[str, str, dict[str, Any]]]:
    """`tools` with each name's first listing only (see offered_tools), a warning naming those listed again."""
    seen: dict[str, tuple[str, str, dict[str, Any]]] = {}
    for listed in tools:
        seen.setdefault(listed[0], listed)
    if again := sorted(name for name, n in Counter(tool for tool, _, _ in tools).items() if n > 1):
        log.warning("tool server %s lists %s more than once: offered once, as first listed", server, ", ".join(again))
    return list(seen.values())


def routes(entries: Iterable[ToolEntry]) -> dict[str, ToolEntry]:
    """Every name a call may use: the offered name and, always, `server__tool`."""
    table: dict[str, ToolEntry] = {}
    for e in entries:
        table[qualified_name(e.server, e.tool)] = e
    for e in entries:
        table[e.offered] = e  # an offered name wins over a qualified one that happens to equal it
    return table


def compile_validator(entry: ToolEntry) -> Any | None:
    """A jsonschema validator for the tool's inputSchema (its declared draft, else 2020-12, MCP's default).

    A schema that is itself invalid is reported and not enforced: the server will judge the arguments.
    """
    cls = jsonschema.validators.validator_for(entry.input_schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(entry.input_schema)
    except jsonschema.exceptions.SchemaError as exc:
        log.warning("tool server %r: tool %r has an invalid inputSchema, its arguments are not checked (the "
                    "server judges them): %s", entry.server, entry.tool, exc.message)
        return None
    return cls(entry.input_schema)


# Arguments nested deeper than this that exhaust the stack in the schema check are the call's fault (a schema's
# endless recursion exhausts it at any depth). No tool's arguments need so many levels.
MAX_ARGUMENT_DEPTH = 64


def nesting_depth(value: Any) -> int:
    """How many levels of lists and dicts `value` nests (without recursion: it measures what recursion cannot)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            deepest = max(deepest, depth + 1)
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return deepest


def argument_problem(validator: Any | None, arguments: Any) -> str | None:
    """Why `arguments` do not fit the schema (one readable sentence), or None when they do."""
    if not isinstance(arguments, dict):
        return f"expected a JSON object of arguments, got {type(arguments).__name__}"
    try:  # what json.loads lets through but JSON-RPC cannot carry
        json.dumps(arguments, ensure_ascii=False, allow_nan=False).encode()
    except ValueError as exc:
        # NaN and Infinity: the SDK would send them as null. A lone surrogate (`"\ud800"`): the SDK's writer
        # failed to encode it and dropped the connection, so the model's call was taken for a server crash
        # (an infra error, retried on a restarted server, failing every call in flight on it).
        what = ("a string that is not valid Unicode (a lone surrogate such as \\ud800)"
                if isinstance(exc, UnicodeError) else "NaN or Infinity, which JSON has no number for")
        return f"the arguments hold {what}"
    if validator is None:
        return None
    error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{error.message}" + (f" (at {where})" if where else "")
