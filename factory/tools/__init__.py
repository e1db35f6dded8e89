"""Tools for the rollout: MCP servers (stdio, streamable HTTP) and python functions as managed resources.

`ToolBox` is the entry point (see toolbox.py for the naming rule and the two kinds of failure);
`list_tools` and `schema_hash` serve `factory check --connect` and the Plan.
"""
from factory.tools.listing import list_tools, schema_hash
from factory.tools.resilience import Resilience
from factory.tools.toolbox import ToolBox, ToolStartError, qualified_name

__all__ = ["ToolBox", "ToolStartError", "Resilience", "list_tools", "qualified_name", "schema_hash"]
