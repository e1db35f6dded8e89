"""Test-only MCP servers that misbehave on purpose (slow, crashing, raising, huge output)."""
