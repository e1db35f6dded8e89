"""One live MCP session -- a stdio server process or a streamable-HTTP session -- and its transports.

The SDK's transports and `ClientSession` are anyio context managers whose cancel scopes must be
entered and left by the same task, so each connection runs inside a task of its own (the "owner")
that opens the transport, initializes, lists the tools and then waits until it is told to close or
the server goes away. Calls come from any task of the same event loop through `call_tool`;
the SDK's dispatcher matches the concurrent requests to their responses.
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import anyio
import httpx2
import psutil
import pydantic
from mcp import types as mcp_types
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage

from factory.schema import HttpServer, StdioServer
from factory.util import LAUNCHERS, did_you_mean

log = logging.getLogger(__name__)

CLIENT_INFO = mcp_types.Implementation(name="factory", version="0.1.0")
# What an error message shows of a server's stderr: its last lines, within a bound (a traceback's end says why)
STDERR_TAIL_LINES = 20
STDERR_TAIL_CHARS = 2000
# The server's stderr file is cut back to its tail once past this size, so that a server that logs at every call
# (its file is unlinked: `du` does not see it) cannot fill the temp folder over a long run.
STDERR_KEEP_BYTES = 1 << 20
STDERR_CHECK_S = 5.0  # and between calls, this often (a server may log while no call comes)
# What is left of a stdio server's process group (its helpers) after the SDK's shutdown gets this long after SIGTERM
# before SIGKILL (the SDK's own grace), checked this often.
GROUP_GRACE_S = 2.0
GROUP_POLL_S = 0.05

# A transport, opened fresh for every (re)start: (stderr file) -> context manager of the stream pair.
TransportFactory = Callable[[IO[bytes]], AbstractAsyncContextManager[Any]]

# How a start error says what became of an HTTP server (`factory check --connect` reads the reason after it).
UNREACHED = "could not be reached"
REFUSED = "was reached, but refused"
# The errors the MCP SDK's streamable-HTTP client makes up for a request that the server answered with an HTTP error
# status and no JSON-RPC error of its own (any status but 404; 404 before a session): neither says the status.
SDK_HTTP_STATUS_ERRORS = frozenset({(mcp_types.INTERNAL_ERROR, "Server returned an error response"),
                                    (mcp_types.METHOD_NOT_FOUND, "Not Found")})


class ServerStartError(RuntimeError):
    """A server could not be started or did not answer initialize/tools/list in time; `refused`: an HTTP server
    answered, with an HTTP error status."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


def stdio_parameters(spec: StdioServer, base_dir: Path | None) -> StdioServerParameters:
    """The SDK's launch parameters for a stdio server spec.

    `python`/`python3` mean the interpreter running Factory, so a server module sees the same
    packages whether or not the venv is activated; such a server (or one whose command is that
    interpreter's path, as a program that writes `sys.executable` into a spec does) also gets Factory's
    PYTHONPATH (a checkout run without installing, packages installed with `pip --target`), which the
    SDK's default set leaves out. A relative command path with a slash and a relative `cwd` are resolved against
    `base_dir` (the spec's folder). The environment is the SDK's safe default set (HOME, PATH, ...)
    plus `env` from the spec.
    """
    command, env = spec.command, dict(spec.env)
    if command in ("python", "python3"):
        command = sys.executable
    if command == sys.executable:  # by path, not samefile: another venv's python links to the same binary
        if os.environ.get("PYTHONPATH") and "PYTHONPATH" not in env:
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    elif base_dir is not None and os.sep in command and not os.path.isabs(command):
        command = str((base_dir / command).resolve())
    cwd = spec.cwd
    if cwd is not None and base_dir is not None and not os.path.isabs(cwd):
        cwd = str((base_dir / cwd).resolve())
    return StdioServerParameters(command=command, args=list(spec.args), env=env or None, cwd=cwd)


def unreadable_answer_id(exc: Exception) -> int | str | None:
    """The request id of a server's answer that the SDK's parser refused (`exc`, the pydantic error it hands
    on), when one can be read; None for anything else (a line that is no JSON, a request or notification
    from the server, whose ids are not ours). Python's json reads what that parser refuses for a lone
    surrogate escape ("\\ud83d", half an emoji), so the answer can be matched to its call."""
    errors = exc.errors() if isinstance(exc, pydantic.ValidationError) else []
    raw = errors[0].get("input") if errors else None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError):  # (an answer nested past the parser's depth: raised out of the
            return None                       # SDK's receive loop, it ended the session in silence)
    if not isinstance(raw, dict) or "method" in raw or not ("result" in raw or "error" in raw):
        return None
    request_id = raw.get("id")
    # JSON-RPC ids are strings or integers; a bool is an int to Python but no id
    return request_id if isinstance(request_id, (int, str)) and not isinstance(request_id, bool) else None


def unreadable_answer_error(request_id: int | str, exc: Exception) -> SessionMessage:
    """A JSON-RPC parse error (-32700) answering `request_id` in place of the answer the SDK could not read:
    its call fails at once instead of waiting for its timeout (the SDK's HTTP transport answers a response
    it cannot parse the same way; its stdio transport hands the error on and the call waits)."""
    errors = exc.errors() if isinstance(exc, pydantic.ValidationError) else []
    why = errors[0].get("msg") if errors else str(exc)
    error = mcp_types.ErrorData(code=mcp_types.PARSE_ERROR, message=f"its answer is not JSON-RPC the MCP SDK can "
                                                                    f"read ({why})")
    return SessionMessage(mcp_types.JSONRPCError(jsonrpc="2.0", id=request_id, error=error))


def _not_json_rpc(record: logging.LogRecord, exc: BaseException) -> bool:
    """The SDK's stdio client logs each line of a server's stdout that is not JSON-RPC with its traceback: a print()
    in a tool server, or a command that is no MCP server, filled the terminal with pydantic's traceback. One line
    instead: the line, and where a server's own output goes."""
    errors = exc.errors() if hasattr(exc, "errors") else []
    line = errors[0].get("input") if errors else str(exc)
    if errors and (request_id := unreadable_answer_id(exc)) is not None:
        # A server's answer the SDK's parser refuses (a lone surrogate escape, "\ud83d": an emoji a
        # JavaScript server cut in half, is invalid JSON to it), not a print(): `_WatchedReadStream`
        # fails the call it answers.
        record.msg = ("a tool server sent an answer (to request %r) the MCP SDK cannot read (%s): %r; its "
                      "call fails")
        record.args = (request_id, errors[0].get("msg"), str(line)[:200])
    elif errors and '"jsonrpc"' in str(line):
        # JSON-RPC whose request id cannot be read: the call it may answer waits for its timeout.
        record.msg = ("a tool server sent a JSON-RPC message the MCP SDK cannot read (%s): %r; an answer "
                      "lost this way makes its call time out")
        record.args = (errors[0].get("msg"), str(line)[:200])
    else:
        record.msg = ("a tool server wrote a line that is not MCP (JSON-RPC) to stdout, its channel to "
                      "Factory: %r; a server prints its own messages to stderr")
        record.args = (str(line)[:200],)
    return True


def _late_on_a_dropped_session(record: logging.LogRecord, exc: BaseException) -> bool:
    """The SDK's streamable-HTTP client logs "Error parsing SSE message" with its traceback when what came on a
    call's response stream (its answer, or the stream's end) finds the session's read stream closed: the session
    was dropped (taken as hung, or closed) while the call was in flight. Nothing failed to parse, and nothing is
    wrong now: the call had its result already. One debug line (a real parse error keeps the SDK's words)."""
    if not isinstance(exc, (anyio.BrokenResourceError, anyio.ClosedResourceError)):
        return False
    record.msg = "a tool server's answer came after its HTTP session was dropped: not read (%s)"
    record.args = (type(exc).__name__,)
    # (a filter runs before the handlers' levels are checked: at DEBUG, a terminal's WARNING handler drops it)
    record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
    return True


class _SdkTracebackInOneLine(logging.Filter):
    """Some records the MCP SDK logs with a traceback (`logger.exception`) say in one line, by their message:
    the traceback is the SDK's, of no use to the user, and many lines long each time."""

    # the message the SDK logs -> what rewrites its record (whether it did: a record it leaves keeps its traceback)
    ONE_LINE: dict[str, Callable[[logging.LogRecord, BaseException], bool]] = {
        "Failed to parse JSONRPC message from server": _not_json_rpc,  # (mcp.client.stdio)
        "Error parsing SSE message": _late_on_a_dropped_session,  # (mcp.client.streamable_http)
    }

    def filter(self, record: logging.LogRecord) -> bool:
        rewrite = self.ONE_LINE.get(record.msg) if record.exc_info and isinstance(record.msg, str) else None
        if rewrite is not None and rewrite(record, record.exc_info[1]):
            record.exc_info = record.exc_text = None
        return True


_IN_ONE_LINE = _SdkTracebackInOneLine()


def launch_problem(params: StdioServerParameters) -> tuple[str, str] | None:
    """Why the server's process cannot be started, before trying, as (the spec field at fault: `cwd` or
    `command`, why): the SDK's own error was only the OS's "[Errno 2] No such file or directory: 'pyhton'",
    the same words for a missing command and a missing cwd."""
    if params.cwd is not None and not os.path.isdir(params.cwd):
        return "cwd", f"its cwd is not a folder: {params.cwd}"
    path = (params.env or {}).get("PATH", os.environ.get("PATH", os.defpath))
    if shutil.which(params.command, path=path) is None:
        if os.sep in params.command:
            return "command", f"command {params.command!r} is not an executable file"
        return "command", f"command {params.command!r} not found on PATH{did_you_mean(params.command, LAUNCHERS)}"
    return None


def stdio_transport(spec: StdioServer, base_dir: Path | None) -> TransportFactory:
    """Opens the SDK's stdio client: spawns the server in its own process group, speaks over its pipes."""
    params = stdio_parameters(spec, base_dir)
    logging.getLogger("mcp.client.stdio").addFilter(_IN_ONE_LINE)  # once: a filter already there is kept

    def transport(errlog: IO[bytes]) -> AbstractAsyncContextManager[Any]:
        # errlog is a binary temp file: the SDK only hands it to the subprocess as its stderr (needs a fileno).
        if (problem := launch_problem(params)) is not None:
            raise FileNotFoundError(problem[1])
        return _ending_its_group(stdio_client(params, errlog=errlog))  # type: ignore[arg-type]

    return transport


@contextlib.asynccontextmanager
async def _ending_its_group(client: AbstractAsyncContextManager[Any]) -> AsyncIterator[Any]:
    """The SDK's `stdio_client`, then what is left of the server's process group ended. A server's helpers (a
    browser, a kernel) are in its group, which the SDK signals only when the server has not exited 2 s after its
    stdin closed: a server that crashed, or that exits when its stdin closes, left them running, unowned (one
    holding a port made every restart of its server fail)."""
    server: tuple[int, psutil.Process | None] | None = None
    try:
        async with client as streams:
            server = spawned_process(client)
            yield streams
    finally:
        if server is not None:
            await end_group(*server)


def spawned_process(client: AbstractAsyncContextManager[Any]) -> tuple[int, psutil.Process | None] | None:
    """The process that the SDK's `stdio_client` (entered) started, as (pid, its handle: None when it has ended
    already), or None when it cannot be read. The SDK keeps its process object to itself, as the local `process`
    of the generator behind its context manager (a release that renames it leaves the group to the SDK alone:
    tests/test_tools_faults.py's helper test then fails)."""
    frame = getattr(getattr(client, "gen", None), "ag_frame", None)
    pid = getattr(frame.f_locals.get("process") if frame is not None else None, "pid", None)
    if not isinstance(pid, int):
        return None
    try:
        return pid, psutil.Process(pid)
    except psutil.Error:
        return pid, None


def signal_group(pgid: int, leader: psutil.Process | None, sig: int) -> bool:
    """Send `sig` to process group `pgid`, that of the server `leader` (the SDK starts a server in a new session:
    its pid is its group's id), while the group is still that server's; whether there was a group to signal.
    The pid of a server that has ended is not given to a new process while its group has members; once it has
    been, a group of that id is another process's, left alone."""
    if not (leader is not None and leader.is_running()) and psutil.pid_exists(pgid):
        return False  # (is_running: the same process, its start time checked, or its zombie)
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # some members cannot be signalled (macOS says so of a zombie): the group may still be there
    return True


async def end_group(pgid: int, leader: psutil.Process | None, grace_s: float = GROUP_GRACE_S) -> None:
    """SIGTERM what is left of the server's process group, SIGKILL what is still there after `grace_s` (or at once
    when cancelled). A group already gone, the usual case, costs no wait."""
    if not signal_group(pgid, leader, signal.SIGTERM):
        return
    try:
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            await asyncio.sleep(GROUP_POLL_S)
            if not group_running(pgid):
                return
    finally:
        signal_group(pgid, leader, signal.SIGKILL)  # (not sent to a group that is gone)


def group_running(pgid: int) -> bool:
    """Whether process group `pgid` has a member that has not ended. A zombie has, yet keeps its group there to
    signal: an orphan's exit is collected by PID 1, late, or in some containers never, so the group's mere
    presence held every close for the whole grace."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) == pgid and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return True
        except (OSError, psutil.Error):
            continue  # (ended meanwhile)
    return False


def http_headers(headers_from_env: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """HTTP headers whose values come from environment variables; a missing variable is an error."""
    missing = [var for var in headers_from_env.values() if var not in environ]
    if missing:
        raise ServerStartError(f"environment variable(s) not set for headers_from_env: {', '.join(missing)}")
    return {header: environ[var] for header, var in headers_from_env.items()}


def refusal(status: int, headers_from_env: Mapping[str, str]) -> str:
    """How an HTTP server refused a request, by the status it answered, with what to check."""
    said = f"it answered HTTP {status} {httpx2.codes.get_reason_phrase(status)}".rstrip()
    if status in (401, 403):
        if not headers_from_env:
            return f"{said}: it wants credentials, which headers_from_env sends (none is set)"
        names = ", ".join(f"${var}" for var in headers_from_env.values())
        return f"{said}: check the header(s) headers_from_env sets ({names})"
    if status == 404:  # (the SDK says a 404 once there is a session as that session gone: the server restarted)
        return f"{said}: no MCP endpoint at this path (an MCPServer serves /mcp)"
    return said


class HttpRefusals:
    """The last HTTP error status (>= 400) that an HTTP server answered one of our requests with, seen by a response
    hook on the client the SDK's transport uses: the error the SDK makes up for it says no status ("Server returned
    an error response": a token refused was said as a server that could not be reached, or that answered a JSON-RPC
    error)."""

    def __init__(self, headers_from_env: Mapping[str, str]) -> None:
        self.headers_from_env = headers_from_env
        self.status: int | None = None

    async def seen(self, response: httpx2.Response) -> None:
        # POSTs only (they carry the requests): a server may answer the optional GET stream 405, and the DELETE that
        # ends a session says nothing of a call.
        if response.request.method == "POST" and response.status_code >= 400:
            self.status = response.status_code

    def said(self, exc: BaseException) -> str | None:
        """How the server refused the request that failed with `exc`; None unless `exc` is the SDK's stand-in for an
        HTTP error status (a server's own JSON-RPC error keeps its words)."""
        exc = leaf(exc)
        stand_in = isinstance(exc, MCPError) and (exc.code, exc.message) in SDK_HTTP_STATUS_ERRORS
        if self.status is None or not stand_in:
            return None
        return refusal(self.status, self.headers_from_env)


def http_transport(spec: HttpServer, refusals: HttpRefusals) -> TransportFactory:
    """Opens the SDK's streamable-HTTP client with the spec's headers; the server runs elsewhere. `refusals` hears the
    HTTP error statuses of the session last opened."""
    logging.getLogger("mcp.client.streamable_http").addFilter(_IN_ONE_LINE)

    @contextlib.asynccontextmanager
    async def open_http(_errlog: IO[bytes]) -> AsyncIterator[Any]:
        headers = http_headers(spec.headers_from_env, os.environ)  # read at each (re)connect: tokens rotate
        # The SDK's own defaults: 30 s to connect/write, a long read because a server may hold an
        # event stream open. Per-call timeouts are ours, above this layer.
        timeout = httpx2.Timeout(30.0, read=300.0)
        refusals.status = None  # (a new session: one refused before is not this one's)
        async with httpx2.AsyncClient(headers=headers, timeout=timeout,
                                      event_hooks={"response": [refusals.seen]}) as client:
            async with streamable_http_client(spec.url, http_client=client) as streams:
                yield streams

    return open_http


class _WatchedReadStream:
    """The transport's read stream, passed through, with an event set when the server's side ends.

    The SDK's dispatcher fails in-flight requests when the stream ends but has no public hook to
    tell the owner of the session; this wrapper (implementing the SDK's public `ReadStream`
    protocol) is that hook, so a server that dies while idle is restarted before the next call.
    It also turns an answer the SDK's parser refused into a parse error for its request
    (`unreadable_answer_error`): the dispatcher only logs such an error, and the call waited.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.ended = asyncio.Event()

    async def receive(self) -> Any:
        try:
            item = await self._inner.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self.ended.set()
            raise
        if isinstance(item, Exception) and (request_id := unreadable_answer_id(item)) is not None:
            return unreadable_answer_error(request_id, item)
        return item

    async def aclose(self) -> None:
        await self._inner.aclose()

    def __aiter__(self) -> _WatchedReadStream:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> _WatchedReadStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.ended.set()
        await self.aclose()

    def __getattr__(self, name: str) -> Any:  # e.g. `last_context`, read by the dispatcher via getattr
        return getattr(self._inner, name)


class McpConnection:
    """One MCP session owned by its own task; `open` it, `call_tool` from anywhere, `close` it once.

    `on_lost` is called (from the owner task) when the server side ends without us closing it:
    the process died or the HTTP session broke.
    """

    def __init__(self, label: str, transport: TransportFactory, on_lost: Callable[[McpConnection], None],
                 url: str | None = None, refusals: HttpRefusals | None = None) -> None:
        self.label = label
        self.url = url  # an HTTP server's: it runs elsewhere, so it is reached, not started
        self._refusals = refusals  # (an HTTP server's)
        self._transport = transport
        self._on_lost = on_lost
        self._closing = asyncio.Event()
        self._owner: asyncio.Task[None] | None = None
        self._stderr: IO[bytes] | None = None
        self.session: ClientSession | None = None
        self.tools: list[mcp_types.Tool] = []
        self.in_flight = 0
        self.lost = False
        self.unanswered = 0  # calls in a row that timed out with no answer while they waited (McpServer: hung)
        self.answered_at = 0.0  # time.monotonic() of the last call the server answered, in any way
        self._watched: _WatchedReadStream | None = None

    @property
    def stream_ended(self) -> bool:
        """The server's side of the transport has ended (EOF): the process died or the session broke."""
        return self._watched is not None and self._watched.ended.is_set()

    @property
    def alive(self) -> bool:
        return self.session is not None and not self.lost and not self._closing.is_set()

    async def open(self, timeout_s: float) -> None:
        """Start the server, initialize and list its tools; ServerStartError (with stderr) if that fails."""
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._owner = asyncio.create_task(self._own(ready, timeout_s), name=f"mcp:{self.label}")
        try:
            await ready
        except asyncio.CancelledError:
            # Cut short (a server's close() during its start): the owner would run on to the handshake's timeout,
            # and past a handshake hold the process with nothing left to close it. It is stopped with the start
            # (the SDK's stop of the process is shielded from the cancellation: it still ends the process).
            self._owner.cancel()
            await asyncio.wait({self._owner})
            self._close_stderr()
            raise
        except Exception as exc:
            await self.close(keep_stderr=True)  # the process has ended: its stderr is complete
            refused = self.refused(exc)
            what = f"at {self.url} {REFUSED if refused else UNREACHED}" if self.url else "failed to start"
            said = self.stderr_tail()
            # the SDK's words were only "Connection closed" (a server past the handshake's timeout did not end
            # by itself: the timeout ended it)
            if not said and not self.url and self.stream_ended and not isinstance(leaf(exc), TimeoutError):
                said = ("; the server's process ended before the MCP handshake and wrote nothing to stderr (is the "
                        "command an MCP server speaking on stdio?)")
            message = f"tool server {self.label!r} {what}: {refused or describe(exc)}{said}"
            self._close_stderr()
            raise ServerStartError(message, refused=refused is not None) from exc

    async def _own(self, ready: asyncio.Future[None], timeout_s: float) -> None:
        lost = False
        # The server's stderr goes to a file of its own (not our terminal): kept for error messages.
        self._stderr = tempfile.TemporaryFile()
        # Append mode (the flag is the open file's, the server's too): after a cut its writes go to the new end.
        fd = self._stderr.fileno()
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
        try:
            async with self._transport(self._stderr) as (read_stream, write_stream):
                watched = self._watched = _WatchedReadStream(read_stream)
                async with ClientSession(watched, write_stream, client_info=CLIENT_INFO) as session:
                    try:
                        with anyio.fail_after(timeout_s):
                            await session.initialize()
                            self.tools = await _list_all_tools(session)
                    except TimeoutError:  # said in words: a bare TimeoutError reads as nothing
                        raise TimeoutError(f"no MCP handshake (initialize, tools/list) within {timeout_s:g} s: is "
                                           "the command an MCP server on stdio, or the URL its endpoint? (one that "
                                           "takes longer to start: raise its start_timeout_s)") from None
                    self.session = session
                    ready.set_result(None)
                    await _first_of(self._closing.wait(), watched.ended.wait(), self._keep_stderr_bounded())
                    lost = not self._closing.is_set()
                    self.lost = lost
        except Exception as exc:  # the server failed to start, or its transport broke while running
            if not ready.done():
                ready.set_exception(exc)
            else:
                lost = not self._closing.is_set()
                log.warning("tool server %s: connection ended: %s%s", self.label, describe(exc), self.stderr_tail())
        finally:
            self.session = None
            if not ready.done():  # cancelled before it was ready
                ready.set_exception(ServerStartError("start was cancelled"))
        if lost:
            self.lost = True
            self._on_lost(self)

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> mcp_types.CallToolResult:
        """Send one tools/call; raises what the SDK raises (MCPError, stream errors, ...)."""
        session = self.session
        if session is None:
            raise anyio.ClosedResourceError(f"connection to {self.label} is not open")
        try:
            return await session.call_tool(name, arguments)
        finally:
            self._bound_stderr()

    async def _keep_stderr_bounded(self) -> None:
        """Never ends by itself: its end would read as the server lost (`_own`). `_bound_stderr` says nothing
        of the OSErrors it meets; anything else stops the checks, said once."""
        while True:
            await asyncio.sleep(STDERR_CHECK_S)
            try:
                self._bound_stderr()
            except Exception as exc:  # noqa: BLE001 -- the server runs on, only its stderr goes unchecked
                log.warning("tool server %s: its stderr file is no longer kept short: %s", self.label, describe(exc))
                await asyncio.Event().wait()

    def _bound_stderr(self) -> None:
        """Past STDERR_KEEP_BYTES, cut the server's stderr file back to the tail error messages read."""
        if self._stderr is None or self._stderr.closed:
            return
        try:
            fd = self._stderr.fileno()
            size = os.fstat(fd).st_size
            if size <= STDERR_KEEP_BYTES:
                return
            keep = 8 * STDERR_TAIL_CHARS
            tail = os.pread(fd, keep, size - keep)
            os.ftruncate(fd, 0)
            os.write(fd, tail)  # appended: lines the server wrote since the truncate come before it (rare)
        except (OSError, ValueError):
            pass

    def refused(self, exc: BaseException) -> str | None:
        """How an HTTP server refused the request that failed with `exc` (its HTTP status, what to check); None when
        it did not, or for a stdio server."""
        return self._refusals.said(exc) if self._refusals is not None else None

    def answered(self) -> None:
        """The server answered a call (a result or an error): it is not hung."""
        self.answered_at = time.monotonic()
        self.unanswered = 0

    def stderr_tail(self) -> str:
        """The last lines the server wrote to stderr, for error messages ('' when there are none)."""
        if self._stderr is None or self._stderr.closed:
            return ""
        try:
            # pread, not seek+read: the server shares this file's offset and may still be writing.
            fd = self._stderr.fileno()
            size = os.fstat(fd).st_size
            start = max(0, size - 4 * STDERR_TAIL_CHARS)  # (UTF-8: 4 bytes a character at most)
            data = os.pread(fd, size - start, start)
        except (OSError, ValueError):
            return ""
        text = last_lines(data, cut=start > 0)
        return f"\n--- server stderr (last lines) ---\n{text}" if text else ""

    async def close(self, timeout_s: float = 15.0, keep_stderr: bool = False) -> None:
        """Shut the session and its process down (stdin closed, then SIGTERM/SIGKILL by the SDK; then its process
        group, for a stdio server: `_ending_its_group`)."""
        self._closing.set()
        owner = self._owner
        if owner is not None and not owner.done():
            # The SDK's shutdown is shielded and bounded (~6 s worst case); cancel only as a last resort.
            done, _ = await asyncio.wait({owner}, timeout=timeout_s)
            if not done:
                owner.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await owner
        if not keep_stderr:
            self._close_stderr()

    def _close_stderr(self) -> None:
        if self._stderr is not None and not self._stderr.closed:
            self._stderr.close()


def last_lines(data: bytes, cut: bool = False, lines: int = STDERR_TAIL_LINES, chars: int = STDERR_TAIL_CHARS) -> str:
    """The last `lines` lines of a server's stderr `data`, at most `chars` characters (a longer last line
    keeps its end). `cut`: `data` starts inside the file, so its first line may be a piece of one: dropped."""
    text = data.decode("utf-8", errors="replace")
    if cut and "\n" in text:
        text = text.split("\n", 1)[1]
    return "\n".join(text.strip().splitlines()[-lines:])[-chars:]


def leaf(exc: BaseException) -> BaseException:
    """The first leaf exception: anyio task groups wrap errors in ExceptionGroups."""
    while getattr(exc, "exceptions", None):  # duck-typed: BaseExceptionGroup is 3.11+, we support 3.10
        exc = exc.exceptions[0]  # type: ignore[attr-defined]
    return exc


def describe(exc: BaseException) -> str:
    """`Type: message` of the first leaf exception."""
    exc = leaf(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def _list_all_tools(session: ClientSession) -> list[mcp_types.Tool]:
    """Every tool of a server, following tools/list pagination."""
    tools: list[mcp_types.Tool] = []
    cursor: str | None = None
    while True:
        params = mcp_types.PaginatedRequestParams(cursor=cursor) if cursor else None
        page = await session.list_tools(params=params)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            return tools


async def _first_of(*awaitables: Any) -> None:
    """Wait until the first of several awaitables finishes; cancel the rest."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
