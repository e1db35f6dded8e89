"""Per-tool counters and latencies, in the names the tracking stage logs.

Names: `tools/<tool>/calls`, `.../model_errors`, `.../infra_errors`, `.../timeouts`, `.../errors` (both kinds),
`.../latency_s_p50`, `.../latency_s_p95`; totals `tools/calls`, `tools/model_errors`,
`tools/infra_errors`, `tools/timeouts`; per server `tool_servers/<server>/restarts` (an HTTP server's: the new
sessions opened after its first, as Factory cannot restart it) and `tool_servers/<server>/circuit_opens` (and
`cache_hits`, `cache_misses` for a server marked `cache: true`).
A call to a name that is no tool (the model made it up) is counted in the totals only, so a model cannot
grow the metric set without bound.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from factory.types import ToolResult


@dataclass
class _ToolStats:
    calls: int = 0
    model_errors: int = 0
    infra_errors: int = 0
    timeouts: int = 0
    latencies: list[float] = field(default_factory=list)

    def add(self, other: _ToolStats) -> None:
        self.calls += other.calls
        self.model_errors += other.model_errors
        self.infra_errors += other.infra_errors
        self.timeouts += other.timeouts
        self.latencies += other.latencies


def _no_events() -> dict[str, int]:  # a named function, not a lambda: ToolMetrics travels between actors
    return {"restarts": 0, "circuit_opens": 0}


class ToolMetrics:
    """Counters since the last reset. Not thread-safe: it lives in one event loop (the ToolBox's, or a
    caller's). Picklable, and `add` merges another's counts: rollout replicas each count their own calls
    and the driver adds them up."""

    def __init__(self) -> None:
        self._clear()

    def _clear(self) -> None:
        self._tools: dict[str, _ToolStats] = defaultdict(_ToolStats)
        self._totals = _ToolStats()
        self._servers: dict[str, dict[str, int]] = defaultdict(_no_events)

    def record(self, tool: str | None, result: ToolResult) -> None:
        """Count one finished call; `tool` is None when the name matched no tool."""
        targets = [self._totals] if tool is None else [self._totals, self._tools[tool]]
        for stats in targets:
            stats.calls += 1
            stats.model_errors += result.status == "model_error"
            stats.infra_errors += result.status == "infra_error"
            stats.timeouts += result.error_kind == "timeout"
            stats.latencies.append(result.latency_s)

    def offered(self, tools: Any) -> None:
        """Count these tools' calls even when there are none: a step whose calls all missed a tool logs
        `tools/<tool>/calls` 0, not nothing (a chart drew a line across the gap, as if it had calls)."""
        for name in tools:
            self._tools[name]  # noqa: B018 -- the defaultdict makes the entry

    def server_event(self, server: str, event: str, count: int = 1) -> None:
        """Count a server-level event: `restarts`, `circuit_opens`, or (a server marked `cache: true`)
        `cache_hits` and `cache_misses`."""
        self._servers[server][event] = self._servers[server].get(event, 0) + count

    def add(self, other: ToolMetrics) -> None:
        """Count another's calls and server events in this one too."""
        for name, stats in other._tools.items():
            self._tools[name].add(stats)
        self._totals.add(other._totals)
        for server, events in other._servers.items():
            for event, count in events.items():
                self.server_event(server, event, count)

    def take_server_events(self) -> dict[str, dict[str, int]]:
        """Server events since the last take, and a fresh start (the tools stage reports these to its
        callers, which count the calls themselves)."""
        events = dict(self._servers)
        self._clear()
        return events

    def snapshot(self, reset: bool = False) -> dict[str, float]:
        """All metrics as a flat dict of floats; `reset` starts a new window (e.g. per training step)."""
        out: dict[str, float] = {}
        for name, stats in sorted(self._tools.items()):
            out.update(_stats_dict(f"tools/{name}", stats, latency=True))
        out.update(_stats_dict("tools", self._totals, latency=False))
        for server, events in sorted(self._servers.items()):
            for event, count in events.items():
                out[f"tool_servers/{server}/{event}"] = float(count)
        if reset:
            self._clear()
        return out


def _stats_dict(prefix: str, stats: _ToolStats, *, latency: bool) -> dict[str, float]:
    out = {
        f"{prefix}/calls": float(stats.calls),
        f"{prefix}/model_errors": float(stats.model_errors),
        f"{prefix}/infra_errors": float(stats.infra_errors),
        f"{prefix}/timeouts": float(stats.timeouts),
    }
    if latency:
        out[f"{prefix}/errors"] = float(stats.model_errors + stats.infra_errors)
        if stats.latencies:
            p50, p95 = np.percentile(stats.latencies, [50, 95])
            out[f"{prefix}/latency_s_p50"] = float(p50)
            out[f"{prefix}/latency_s_p95"] = float(p95)
    return out
