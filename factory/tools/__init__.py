"""Tools for the rollout: MCP servers (stdio, streamable HTTP) and python functions as managed resources.

`ToolBox` is the entry point (see toolbox.py for the naming rule and the two kinds of failure).
"""
from factory.tools.resilience import Resilience
from factory.tools.toolbox import ToolBox, ToolStartError, qualified_name

__all__ = ["Resilience", "ToolBox", "ToolStartError", "qualified_name"]
