"""The tools stage: every tool server of a spec, started once for the whole cluster.

One Ray actor holds the ToolBox (MCP sessions over stdio and HTTP, python tools). Rollout replicas on any
node and the reward stage call it through `ToolsClient`, so a stdio server runs once per cluster (or
`replicas` times, as the spec says), not once per rollout process or node.
"""
from __future__ import annotations

from typing import Any

from factory.contract import Call, Contract, StageActor
from factory.plan import ToolsSettings
from factory.types import Placement, ToolCall, ToolResult
from factory.util import enter_workdir, node_id


class ToolsStage(StageActor):
    """The tools actor. Its methods are coroutines: Ray runs it as an async actor with one event loop
    for its life, which the MCP sessions need, and serves many calls at once. Its callers (the rollout,
    tool reward nodes) call `schemas`, `call` and `server_events` through their `ToolsClient`."""

    CONTRACT = Contract(calls={"call": Call("one"), "schemas": Call("one"), "server_events": Call("one")},
                        lists_tools=True, records_tools=True, inline=True)

    def __init__(self, settings: ToolsSettings):
        self.settings = settings
        self.box: Any = None

    async def setup(self, placement: Placement | None = None) -> dict[str, Any]:
        from pathlib import Path

        from factory.tools.recording import Replay
        from factory.tools.toolbox import ToolBox

        enter_workdir((placement or Placement()).workdir)
        self.box = ToolBox.from_spec(self.settings.tools, base_dir=Path(self.settings.base_dir),
                                     record=self.settings.record)
        if (replayed := self.settings.replay) is not None:  # before start: a replay may need no server
            self.box.replay = Replay(replayed.rows, replayed.on_miss, replayed.listing)
        await self.box.start()
        return {"node": node_id(), "tools": [s["function"]["name"] for s in self.box.schemas()]}

    async def schemas(self) -> list[dict[str, Any]]:
        return self.box.schemas()

    async def call(self, call: ToolCall, expired: bool = False) -> ToolResult:
        return await self.box.call(call, expired)

    async def tool_listing(self) -> dict[str, list[dict[str, Any]]]:
        """server -> [{name, offered_as, description, inputSchema}] of the tools offered to the model, as the
        started servers list them (what the run's tool-schema hash is computed from)."""
        return self.box.tool_listing()

    async def take_recording(self) -> dict[str, Any]:
        """The calls recorded since the last take (factory.tools.recording: table rows; [] when the run does
        not record), and the calls a replay could not answer meanwhile."""
        rows = self.box.recorder.take() if self.box.recorder is not None else []
        misses = self.box.replay.misses if self.box.replay is not None else []
        if self.box.replay is not None:
            self.box.replay.misses = []
        return {"rows": rows, "misses": misses}

    async def server_events(self) -> dict[str, dict[str, int]]:
        """Restarts and circuit opens since the last ask (callers count their own calls)."""
        return self.box.server_events()

    async def close(self) -> None:
        if self.box is not None:
            box, self.box = self.box, None
            await box.close()
