"""The code sandbox's MCP server (factory.examples.sandbox) on a machine where the sandbox is never set up in
time: every call's child is reported as not locked down when its wall-clock limit passed, as the real child is
on a machine too loaded to start Python within the limit (a 1 ms limit raced: now and then the child was up).
Run: `python tests/tool_servers/unsandboxed.py [sandbox options]`."""
from __future__ import annotations

from factory.examples import sandbox


async def not_set_up(code: str, limits: sandbox.Limits) -> dict[str, object]:
    return {"sandboxed": False, "timed_out": True, "exit_code": None, "stdout": "", "stderr": ""}


if __name__ == "__main__":
    sandbox.run_sandboxed = not_set_up
    sandbox.main()
