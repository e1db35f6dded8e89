"""Tools for the rollout: MCP servers (stdio, streamable HTTP) and python functions as managed resources.

`ToolBox` is the entry point (see toolbox.py for the naming rule and the two kinds of failure). The names
below are imported on first use (PEP 562): the compiler imports the tools stage's actor class to check its
contract, and that must not cost the MCP SDK's import.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from factory.tools.resilience import Resilience
    from factory.tools.toolbox import ToolBox, ToolStartError, qualified_name

_WHERE = {"Resilience": "factory.tools.resilience", "ToolBox": "factory.tools.toolbox",
          "ToolStartError": "factory.tools.toolbox", "qualified_name": "factory.tools.toolbox"}
__all__ = ["Resilience", "ToolBox", "ToolStartError", "qualified_name"]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
