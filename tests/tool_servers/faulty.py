"""An MCP server whose tools fail in every way the ToolBox must survive.

Run: `python tests/tool_servers/faulty.py` (stdio) or `... --http PORT` (streamable HTTP on 127.0.0.1); with
`--http PORT --token TOKEN` it answers HTTP 401 to a request whose Authorization header is not TOKEN.
Each tool is one fault; `pid` lets a test kill the process; `header` shows what HTTP headers arrived.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.shared.exceptions import MCPError

# CRITICAL: the SDK would render every raised exception as a rich traceback, slowing the whole server.
server = MCPServer("faulty", log_level="CRITICAL")


@server.tool(structured_output=False)
async def echo(text: str, delay_s: float = 0.0) -> str:
    """Return `text`, after `delay_s` seconds."""
    await anyio.sleep(delay_s)
    return text


@server.tool(structured_output=False)
async def sleep(seconds: float) -> str:
    """Sleep, then answer: with `seconds` past the client's timeout this is a hung call."""
    await anyio.sleep(seconds)
    return f"slept {seconds}"


ONE_AT_A_TIME = threading.Lock()


@server.tool(structured_output=False)
def queued(seconds: float) -> str:
    """Work `seconds`, one call at a time (a single-threaded index, one GPU, a sandbox): a burst's tail waits."""
    with ONE_AT_A_TIME:  # (a plain function: the SDK runs it in a worker thread, the loop keeps answering)
        time.sleep(seconds)
    return "done"


@server.tool(structured_output=False)
async def freeze(seconds: float) -> str:
    """Block the server's event loop: alive, its pipes open, answering nothing (a deadlock) for `seconds`."""
    time.sleep(seconds)  # (in the loop, not awaited: nothing else runs)
    return "thawed"


@server.tool(structured_output=False)
def boom(message: str = "kaboom") -> str:
    """Raise, as a buggy tool does; the server turns it into an isError result."""
    raise ValueError(message)


@server.tool(structured_output=False)
def rpc_error(message: str, code: int = -32603) -> str:
    """Answer with a JSON-RPC error (a protocol error, not a tool's isError result)."""
    raise MCPError(code, message)


@server.tool(structured_output=False)
def huge(chars: int) -> str:
    """A result of exactly `chars` characters that starts with HEAD and ends with TAIL."""
    return "HEAD" + "x" * max(0, chars - 8) + "TAIL"


@server.tool(structured_output=False)
def pid() -> int:
    """This server's process id, so a test can kill it."""
    return os.getpid()


@server.tool(structured_output=False)
def spawn_helper() -> int:
    """Start a helper process that outlives this server unless ended (a browser, a kernel); its pid. Like such
    helpers, it never reads the server's stdin, so it does not end when the client closes it."""
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL)
    return helper.pid


@server.tool(structured_output=False)
def die() -> str:
    """Exit the process in the middle of the call: a crash."""
    os._exit(3)


@server.tool(structured_output=False)
def die_saying(lines: int) -> str:
    """Write `lines` numbered lines to stderr, the last one why, then exit mid-call: a crash with a cause."""
    for i in range(1, lines):
        print(f"stderr line {i}", file=sys.stderr)
    print("RuntimeError: the index file is gone", file=sys.stderr, flush=True)
    os._exit(3)


@server.tool(structured_output=False)
def chatter(lines: int, chars: int) -> str:
    """Answer at once, then write `lines` lines of `chars` characters to stderr from a thread (a server that
    logs between calls)."""
    def write():
        time.sleep(0.3)  # after the answer is read
        for i in range(lines):
            print(f"{i:06d}" + "y" * chars, file=sys.stderr, flush=True)

    threading.Thread(target=write, daemon=True).start()
    return "started"


@server.tool(structured_output=False)
def complain(text: str) -> str:
    """Write `text` to stderr, then answer `text`."""
    print(text, file=sys.stderr, flush=True)
    return text


@server.tool(structured_output=False)
def header(name: str, ctx: Context) -> str:
    """The value of HTTP request header `name` ('' over stdio or when absent)."""
    return (ctx.headers or {}).get(name.lower(), "")


def serve_with_token(port: int, token: str) -> None:
    """Streamable HTTP behind a check of the Authorization header, as a server that wants a token is."""
    import uvicorn
    from starlette.responses import PlainTextResponse

    app = server.streamable_http_app(host="127.0.0.1")

    async def checked(scope, receive, send):
        if scope["type"] == "http" and dict(scope["headers"]).get(b"authorization", b"").decode() != token:
            return await PlainTextResponse("unauthorized", status_code=401)(scope, receive, send)
        return await app(scope, receive, send)

    uvicorn.run(checked, host="127.0.0.1", port=port, log_level="critical")


if __name__ == "__main__":
    if os.path.exists(os.environ.get("FAULTY_NO_START", "")):  # a start that fails while the test holds this file
        sys.exit("faulty: refusing to start")
    if len(sys.argv) == 5 and sys.argv[1] == "--http" and sys.argv[3] == "--token":
        serve_with_token(int(sys.argv[2]), sys.argv[4])
    elif len(sys.argv) == 3 and sys.argv[1] == "--http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run("stdio")
