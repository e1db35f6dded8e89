"""What `factory check --connect` prints and what the Plan hashes: each server's offered tools."""
from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from factory.spec.schema import ToolSpec


def schema_hash(listing: Mapping[str, list[dict[str, Any]]]) -> str:
    """sha256 of the listing as canonical JSON: any change to a name, description or schema changes it."""
    canonical = json.dumps(listing, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def list_tools(tools: Mapping[str, ToolSpec], *, base_dir: Path | None = None) -> dict[str, list[dict[str, Any]]]:
    """Start every server, list its offered tools, stop them all; raises ToolStartError naming failures.

    Synchronous, for the CLI: it runs its own event loop, so call it outside one.
    """
    from factory.tools.toolbox import ToolBox

    async def connect() -> dict[str, list[dict[str, Any]]]:
        async with ToolBox.from_spec(tools, base_dir=base_dir) as box:
            return box.tool_listing()

    return asyncio.run(connect())
