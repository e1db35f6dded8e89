"""A stage's handle on the tools stage: the agent loop's `Tools` (schemas, call), wherever the tools run.

The tools stage is a Ray actor, usually in another process and maybe on another node; tests hand the
ToolsStage itself. Calls are counted here, on the caller's side (what this caller asked and how long it
waited), so each rollout replica reports its own calls and the driver adds them up.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import Any

from factory.tools.metrics import ToolMetrics
from factory.tools.results import infra_error, model_error
from factory.types import ToolCall, ToolResult

log = logging.getLogger(__name__)


async def _invoke(target: Any, method: str, *args: Any) -> Any:
    """`target.method(*args)` on a Ray actor handle (awaiting its ObjectRef) or on a local object."""
    fn = getattr(target, method)
    if hasattr(fn, "remote"):
        ref = fn.remote(*args)
        try:
            return await ref
        except asyncio.CancelledError:
            # The caller stopped waiting (the episode's deadline): the actor's task is cancelled too (an async actor's
            # coroutine receives it), as an in-process call's is. Left to run, the tools stage recorded the call's
            # late answer (`ok`) where the trajectory holds `episode_timeout`, and a replay of that recording
            # answered it and went on into turns the recorded episode never had.
            import ray  # (here: a caller with a local tools stage needs no Ray)

            try:
                ray.cancel(ref)
            except Exception as exc:  # noqa: BLE001 -- the cancellation goes on whatever Ray says
                log.warning("could not cancel the tools stage's %s: %s: %s", method, type(exc).__name__, exc)
            raise
    out = fn(*args)
    return await out if inspect.isawaitable(out) else out


class ToolsClient:
    """Calls the tools stage; with no tools stage (a spec without tools) every call is an unknown tool."""

    def __init__(self, stage: Any | None, *, counted: bool = True):
        self._stage = stage
        self._schemas: list[dict[str, Any]] = []
        self._offered: frozenset[str] = frozenset()  # the tools' names, as offered to the model
        self._metrics = ToolMetrics()
        self._counted = counted  # False: a caller that never takes its metrics (the reward stage) keeps none

    async def start(self) -> None:
        if self._stage is not None:
            self._schemas = await _invoke(self._stage, "schemas")
        self._offered = frozenset(t["function"]["name"] for t in self._schemas)

    def schemas(self) -> list[dict[str, Any]]:
        return self._schemas

    async def call(self, call: ToolCall, expired: bool = False) -> ToolResult:
        """One call, answered by the tools stage (never raises for tool problems: see ToolBox.call; `expired`
        too)."""
        started = time.perf_counter()
        if self._stage is None:
            result = model_error(call.name, "unknown_tool",
                                 f"Error: unknown tool {call.name!r}. No tools are available.")
        else:
            try:
                result = await _invoke(self._stage, "call", *((call, True) if expired else (call,)))
            except asyncio.CancelledError:
                # The episode's deadline cut the call: counted as the agent loop answers it, else a tool whose calls
                # all outlast the deadline was in no tools/* metric
                self._count(infra_error(call.name, "episode_timeout", "Error: the episode ran out of time."), started)
                raise
            except Exception as exc:
                # The hop failed (the tools actor died, Ray raised), not the tool. Answered here as agent.call_tool
                # would answer it, so that it is counted: raised, the trajectory held an infra_error crash that
                # tools/calls and tools/infra_errors never saw (they undercounted the failures they exist to show).
                log.warning("tool call %s could not reach the tools stage: %s: %s", call.name, type(exc).__name__, exc)
                result = infra_error(call.name, "crash", f"Error: the tool call failed ({type(exc).__name__}).")
        self._count(result, started)
        return result

    def _count(self, result: ToolResult, started: float) -> None:
        result.latency_s = time.perf_counter() - started  # what the caller waited, the hop included
        if self._counted:  # under its tool when it reached one (a call that could not be read has none: '?')
            offered = result.tool in self._offered and result.error_kind != "unknown_tool"
            self._metrics.record(result.tool if offered else None, result)

    async def take_metrics(self) -> ToolMetrics:
        """This caller's calls since the last take, with the servers' restarts and circuit opens."""
        taken, self._metrics = self._metrics, ToolMetrics()
        taken.offered(self._offered)
        if self._stage is not None:
            for server, events in (await _invoke(self._stage, "server_events")).items():
                for event, count in events.items():
                    taken.server_event(server, event, count)
        return taken
