"""Small, real components that ship with Factory: the quickstart's MCP calculator server."""
