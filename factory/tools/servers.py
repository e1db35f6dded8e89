"""The backends behind tool names: an MCP server (stdio replicas or one HTTP session) and a python function.

Each backend turns `call(tool, arguments)` into a ToolResult and never raises for a tool or server
problem. It owns the per-server policies of the spec: bounded concurrency, per-call timeout,
retries with backoff for infrastructure failures only, restart of a server that died, and a
circuit breaker. Argument validation and naming live one level up, in the ToolBox.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pydantic
from mcp import types as mcp_types
from mcp.shared.exceptions import MCPError

from factory.schema import HttpServer, PythonTool, StdioServer
from factory.tools.connection import (
    HttpRefusals,
    McpConnection,
    ServerStartError,
    TransportFactory,
    http_transport,
    stdio_transport,
)
from factory.tools.metrics import ToolMetrics
from factory.tools.resilience import CircuitBreaker, Resilience, backoff_delay
from factory.tools.results import answer, content_text, infra_error, model_error, value_text
from factory.types import ToolResult
from factory.util import AllStuck, Places, as_function, being_cancelled, import_object, is_async as is_async_fn

log = logging.getLogger(__name__)

# The message of the error the SDK raises itself when the transport closes under a request.
_SDK_CLOSED = "Connection closed"
# How the SDK's streamable-HTTP client begins the error (-32000) it makes up for a call whose response stream ended
# or broke with no answer: "SSE stream ended without a response", "SSE stream failed: ...", "SSE stream ended and
# reconnection attempts were exhausted" (a server killed during the call).
_SDK_HTTP_STREAM_LOST = "SSE stream "
# Stream errors: the connection under the session is gone (process died, pipe closed, HTTP broke).
_CONNECTION_ERRORS = (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream, OSError)



def _session_gone(exc: MCPError) -> bool:
    """An HTTP server's answer that it has no session of ours (it restarted, or ended the session): HTTP 404
    on a session id, which the SDK says as INVALID_REQUEST, "Session not found" in the server's body or
    "Session terminated" where there is no body."""
    return exc.code == mcp_types.INVALID_REQUEST and "session" in exc.message.lower()


async def with_retries(
    attempt: Callable[[], Awaitable[tuple[ToolResult, bool]]], retries: int, resilience: Resilience
) -> ToolResult:
    """Run `attempt` until it gives a final result, at most `retries` more times, with backoff.

    `attempt` returns (result, retryable); only infrastructure failures are retryable.
    """
    for number in range(retries + 1):
        result, retryable = await attempt()
        if not retryable or number == retries:
            return result
        await asyncio.sleep(backoff_delay(number, resilience.backoff_base_s, resilience.backoff_max_s))
    raise AssertionError("unreachable")


class McpServer:
    """An MCP server as a managed resource: `replicas` stdio processes, or one HTTP session.

    Calls go to the live replica with the fewest calls in flight; at most `concurrency` calls are in
    flight over all replicas. A replica whose connection ends is restarted at once (while the
    circuit is open: once it closes again); calls that were in flight on it fail with `crash` and
    are retried on the new process. Retried calls are sent again: set `retries: 0` for tools with side effects.
    """

    def __init__(
        self,
        name: str,
        spec: StdioServer | HttpServer,
        *,
        base_dir: Path | None,
        resilience: Resilience,
        metrics: ToolMetrics,
    ) -> None:
        self.name = name
        self.spec = spec
        self.resilience = resilience
        self._metrics = metrics
        # an HTTP server's error statuses, said in its errors (one session at a time: its only replica's)
        self.refusals = HttpRefusals(spec.headers_from_env) if isinstance(spec, HttpServer) else None
        self._transport: TransportFactory = (
            stdio_transport(spec, base_dir) if self.refusals is None else http_transport(spec, self.refusals)
        )
        count = spec.replicas if isinstance(spec, StdioServer) else 1
        self._replicas = [_Replica(self, index) for index in range(count)]
        self._slots = asyncio.Semaphore(spec.concurrency)
        self._breaker = CircuitBreaker(resilience.breaker_threshold, resilience.breaker_cooldown_s)
        self._background: set[asyncio.Task[Any]] = set()
        self._closed = False
        self.tools: list[mcp_types.Tool] = []

    async def start(self) -> None:
        """Start every replica in parallel; if any fails, stop the others and raise ServerStartError."""
        results = await asyncio.gather(*(r.start() for r in self._replicas), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.close()
            raise errors[0]
        self.tools = self._replicas[0].connection.tools if self._replicas[0].connection else []

    async def close(self) -> None:
        self._closed = True
        await asyncio.gather(*(r.close() for r in self._replicas), return_exceptions=True)
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    async def call(self, tool: str, arguments: dict[str, Any]) -> ToolResult:
        return await with_retries(lambda: self._attempt(tool, arguments), self.spec.retries, self.resilience)

    async def _attempt(self, tool: str, arguments: dict[str, Any]) -> tuple[ToolResult, bool]:
        if self._closed:
            return infra_error(tool, "transport", "Error: the tool servers are shut down."), False
        probe = self._breaker.state == "half_open"  # this call, if allowed, is the one probe
        if not self._breaker.allow():
            # Not retryable: the circuit stays open for seconds, a backoff of 0.1 s would not help.
            return self._circuit_open(tool), False
        try:
            return await self._call(tool, arguments, probe)
        finally:
            if probe:  # ended without a verdict (an error of no kind above, a cancellation): let another probe
                self._breaker.release_probe()  # (after a verdict: nothing left to release)

    async def _call(self, tool: str, arguments: dict[str, Any], probe: bool) -> tuple[ToolResult, bool]:
        async with self._slots:
            if self._closed:  # closed while this call waited for a slot: starting a server now would outlive close()
                return infra_error(tool, "transport", "Error: the tool servers are shut down."), False
            if not probe and self._breaker.state != "closed":
                # let in while the circuit was closed, it opened while this call waited for a slot: it fails fast
                # too (else each slot's worth of waiting calls would start the failing server again)
                return self._circuit_open(tool), False
            replica = self._pick()
            try:
                connection = await replica.get()
            except ServerStartError as exc:  # (counted by the start, once: every caller that waited on it is here)
                log.warning("%s", exc)
                what = "be reached" if isinstance(self.spec, HttpServer) else "be started"
                what = "was reached, but refused the session" if exc.refused else f"could not {what}"
                return infra_error(tool, "crash", f"Error: tool server {self.name!r} {what}."), True
            connection.in_flight += 1
            sent = time.monotonic()
            try:
                with anyio.fail_after(self.spec.timeout_s):
                    result = await connection.call_tool(tool, arguments)
            except TimeoutError:
                # A timeout says the call was slow. A server that answered other calls meanwhile is busy, not hung
                # (one that serves a call at a time times out a burst's tail); this many in a row, each with nothing
                # answered while it waited, say it answers nothing (a deadlock): it would stay so for the run.
                connection.unanswered = connection.unanswered + 1 if connection.answered_at < sent else 0
                if connection.unanswered >= self.resilience.hung_after:
                    # (Factory cannot restart a server it reaches by URL: it opens a new session)
                    what = "its session dropped for a new one" if isinstance(self.spec, HttpServer) else "restarted"
                    log.warning("tool server %s answered none of its last %d calls within timeout_s (%g s): taken "
                                "as hung, %s", replica.label, connection.unanswered, self.spec.timeout_s, what)
                    replica.lost(connection)
                return infra_error(tool, "timeout", f"Error: {tool} timed out after {self.spec.timeout_s:g} s."), True
            except Exception as exc:  # every other failure is classified, never raised
                connection.answered()
                return self._failure(tool, connection, replica, exc)
            finally:
                connection.in_flight -= 1
        connection.answered()
        self._breaker_success()
        if result.is_error:
            return model_error(tool, "tool_error", content_text(result) or f"Error: {tool} failed."), False
        return answer(tool, content_text(result)), False

    def _circuit_open(self, tool: str) -> ToolResult:
        return infra_error(tool, "circuit_open", f"Error: tool server {self.name!r} is failing; calls are paused "
                                                 "for a few seconds.")

    def _failure(
        self, tool: str, connection: McpConnection, replica: _Replica, exc: Exception
    ) -> tuple[ToolResult, bool]:
        """Classify an exception from tools/call into a ToolResult and whether to retry it."""
        if isinstance(exc, MCPError):
            # The SDK reports a closed transport as error -32000, a code servers may use for their own
            # errors too ("implementation-defined server error"); only a real close is a crash (over HTTP, the
            # call's own response stream lost: the session's streams stay open while the server is gone).
            if exc.code == mcp_types.CONNECTION_CLOSED and (
                connection.stream_ended or exc.message == _SDK_CLOSED
                or (isinstance(self.spec, HttpServer) and exc.message.startswith(_SDK_HTTP_STREAM_LOST))
            ):
                replica.lost(connection)
                if isinstance(self.spec, HttpServer):  # (it may run on: only the session is known to be gone)
                    text = f"Error: the session with tool server {self.name!r} ended during the call."
                else:
                    text = f"Error: tool server {self.name!r} stopped during the call."
                return infra_error(tool, "crash", text), True
            if isinstance(self.spec, HttpServer) and _session_gone(exc):
                # The server restarted (or dropped our session): its answer to every call on the old session is
                # this, so a new session is the only way on (the MCP spec: the client starts one)
                replica.lost(connection)
                return infra_error(tool, "crash", f"Error: tool server {self.name!r} lost the session."), True
            if (refused := connection.refused(exc)) is not None:
                # An HTTP error status (a token refused), which the SDK says only as "Server returned an error
                # response": the server answered; it is alive.
                self._breaker_success()
                log.warning("tool server %s refused %s: %s", self.name, tool, refused)
                text = f"Error: tool server {self.name!r} refused the call: {refused}"
                return infra_error(tool, "transport", text), True
            if exc.code == mcp_types.REQUEST_TIMEOUT:  # (no verdict: a probe's is released by _attempt)
                return infra_error(tool, "timeout", f"Error: {tool} timed out."), True
            if exc.code == mcp_types.INVALID_PARAMS:
                # The server's own validation refused arguments that passed the inputSchema check.
                self._breaker_success()
                log.info("tool server %s refused the arguments of %s: %s", self.name, tool, exc.message)
                return model_error(tool, "bad_arguments", f"Error: invalid arguments for {tool}: {exc.message}"), False
            self._breaker_success()  # the server answered; it is alive
            # The server's own words are the only clue to what went wrong: keep them in the result and the log.
            log.warning("tool server %s answered %s with JSON-RPC error %s: %s", self.name, tool, exc.code, exc.message)
            text = f"Error: tool server {self.name!r} answered with error {exc.code}: {exc.message}"
            return infra_error(tool, "transport", text), True
        if isinstance(exc, _CONNECTION_ERRORS):
            replica.lost(connection)
            return infra_error(tool, "crash", f"Error: lost the connection to tool server {self.name!r}."), True
        if isinstance(exc, pydantic.ValidationError):
            self._breaker_success()  # the server answered; it is alive
            log.warning("tool server %s sent a malformed result for %s: %s", self.name, tool, exc)
            return infra_error(tool, "transport", f"Error: tool server {self.name!r} sent a malformed result."), True
        # what the server said last may be why (the result the model sees stays short: no server internals)
        log.warning("tool server %s: %s failed: %r%s", self.name, tool, exc, connection.stderr_tail())
        return infra_error(tool, "transport", f"Error: the call to {tool} failed ({type(exc).__name__})."), True

    def _pick(self) -> _Replica:
        """The live replica with the fewest calls in flight; a dead one (to be restarted) if none lives."""
        live = [r for r in self._replicas if r.connection is not None and r.connection.alive]
        pool = live or self._replicas
        return min(pool, key=lambda r: r.connection.in_flight if r.connection is not None else 0)

    def _breaker_success(self) -> None:
        closes = self._breaker.state != "closed"
        self._breaker.record_success()
        if self._closed:
            return
        # Calls go to the live replicas, so nothing else starts a down one when `replicas` >= 2: one lost while the
        # circuit was open (lost() restarts none then) starts when it closes, one whose restart failed once its
        # pause (breaker_cooldown_s) is over; both had stayed down for the run.
        now = time.monotonic()
        for replica in self._replicas:
            if replica.down and (closes or now >= replica.retry_at):
                self._spawn(replica.get())

    def _breaker_failure(self) -> None:
        if self._breaker.record_failure():
            self._metrics.server_event(self.name, "circuit_opens")
            log.warning("tool server %s: circuit opened after repeated failures", self.name)

    def _spawn(self, coro: Awaitable[Any]) -> None:
        """Run a background task (restart, close) that close() will wait for."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # consume errors: they are logged


class _Replica:
    """One process (or HTTP session) of a server: started once, restarted each time it is lost."""

    def __init__(self, server: McpServer, index: int) -> None:
        self.server = server
        self.label = f"{server.name}#{index}" if index else server.name
        self.connection: McpConnection | None = None
        self._starting: asyncio.Future[McpConnection] | None = None
        self._starts = 0
        self.retry_at = 0.0  # (monotonic) after a failed start: when another replica's success may start it again

    async def start(self) -> McpConnection:
        return await self.get()

    @property
    def down(self) -> bool:
        """No live connection, and no start under way."""
        live = self.connection is not None and self.connection.alive
        return not live and (self._starting is None or self._starting.done())

    async def get(self) -> McpConnection:
        """A live connection, starting one if needed; concurrent callers share one start. None is started once the
        server is closed (ServerStartError): close() has returned, or is waiting for the starts under way only."""
        if self.connection is not None and self.connection.alive:
            return self.connection
        if self.server._closed:
            raise ServerStartError(f"tool server {self.label!r} is shut down")
        if self._starting is None or self._starting.done():
            self._starting = asyncio.ensure_future(self._open())
            self._starting.add_done_callback(lambda t: t.cancelled() or t.exception())
        # shield: a caller that times out or is cancelled must not cancel the start the others wait on
        return await asyncio.shield(self._starting)

    async def _open(self) -> McpConnection:
        spec = self.server.spec
        connection = McpConnection(self.label, self.server._transport, self.lost,
                                   url=spec.url if isinstance(spec, HttpServer) else None,
                                   refusals=self.server.refusals)
        try:
            await connection.open(spec.start_timeout_s)
        except ServerStartError:
            # One server failure however many calls wait on this start: counted by each of them, three calls in
            # flight and one failed restart opened the circuit (threshold 3)
            self.retry_at = time.monotonic() + self.server.resilience.breaker_cooldown_s
            self.server._breaker_failure()
            raise
        except asyncio.CancelledError:
            if not self.server._closed:
                raise  # (the event loop's shutdown)
            # by close(): the calls that wait on this start fail as for any start the server's close cut short
            raise ServerStartError(f"tool server {self.label!r} was shut down while starting") from None
        if self.server._closed:
            # close() cancels a start it finds under way, this one too if it came in the tick the handshake
            # completed: the connection is closed whole all the same, and the waiting calls told "shut down"
            closing = asyncio.ensure_future(connection.close())
            try:
                await asyncio.shield(closing)
            except asyncio.CancelledError:
                await closing
            raise ServerStartError(f"tool server {self.label!r} was shut down while starting")
        self._starts += 1
        if self._starts > 1:  # (an HTTP server's new session counts as a restart: the metric keeps its one name)
            self.server._metrics.server_event(self.server.name, "restarts")
            if isinstance(spec, HttpServer):
                log.warning("tool server %s: a new session opened", self.label)
            else:
                log.warning("tool server %s restarted", self.label)
        self.connection = connection
        return connection

    def lost(self, connection: McpConnection) -> None:
        """The connection ended under us: count one failure, close it, restart unless the circuit is open (then
        McpServer._breaker_success restarts it once the circuit closes)."""
        if connection is not self.connection:
            return  # already handled (many in-flight calls fail for one crash)
        self.connection = None
        connection.lost = True
        log.warning("tool server %s: connection lost%s", self.label, connection.stderr_tail())
        server = self.server
        server._breaker_failure()
        server._spawn(connection.close())
        if not server._closed and server._breaker.state == "closed":
            server._spawn(self.get())

    async def close(self) -> None:
        if self._starting is not None and not self._starting.done():
            # Stopped, not waited for: a start that hangs ran to its start_timeout_s first (`factory check --connect`,
            # which cuts a start short so that it always returns, and a run's teardown during a restart waited it out)
            self._starting.cancel()
            await asyncio.wait({self._starting})
        if self.connection is not None:
            connection, self.connection = self.connection, None
            await connection.close()


class PythonFunction:
    """A plain python function called in-process. Sync functions run in a worker thread so a slow one
    never blocks the event loop; a sync call that times out is abandoned (its thread runs to its end, and
    holds its slot under `concurrency` until then). Once every slot is held by an abandoned call, the next
    calls time out at once, until one of those returns. An exception from the function, or a value that JSON cannot
    write, is the tool's own error (model_error), like an MCP tool's isError.
    """

    def __init__(self, name: str, spec: PythonTool, *, resilience: Resilience) -> None:
        self.name = name
        self.spec = spec
        self.resilience = resilience
        self._slots = Places(spec.concurrency)
        # Its own threads: on anyio's default limiter (40 threads, shared by every sync tool of the loop) the
        # hung calls of one tool, whose threads run on past their timeout, left another tool none, and calls past
        # the 40th of one tool waited for a thread while their timeout ran. `_slots` bounds the threads in use.
        self._threads = anyio.CapacityLimiter(spec.concurrency)
        self.fn: Callable[..., Any] | None = None
        self.schema: dict[str, Any] = {}

    async def start(self) -> None:
        self.fn = import_object(self.spec.function)  # from the working directory, as the compiler checked it
        self.schema = function_schema(self.fn, self.name)

    async def close(self) -> None:
        pass  # nothing to release: no process, no session

    async def call(self, tool: str, arguments: dict[str, Any]) -> ToolResult:
        return await with_retries(lambda: self._attempt(tool, arguments), self.spec.retries, self.resilience)

    async def _attempt(self, tool: str, arguments: dict[str, Any]) -> tuple[ToolResult, bool]:
        fn = self.fn
        assert fn is not None, "PythonFunction.start() was not called"
        is_async = is_async_fn(fn)  # (an object with an async __call__ too)
        def timed_out() -> tuple[ToolResult, bool]:
            return infra_error(tool, "timeout", f"Error: {tool} timed out after {self.spec.timeout_s:g} s."), True

        try:
            # A wait for a slot is not the function's time (nor a reward lane's, nor an MCP server's call's): behind
            # calls that run, it ends when one returns or passes its own timeout. Behind `concurrency` calls past
            # their timeout (functions that may never return) it was for ever; it ends at once now (AllStuck).
            await self._slots.take()
        except AllStuck:
            return timed_out()
        abandoned = False
        # The slot is given back when the function ends, not when the wait for it does: a thread cannot be
        # stopped, so a timed-out sync call's thread runs on, and the retry or the next call must not run
        # beside it past `concurrency` (a tool that is not thread-safe, or a backend it must not flood).
        deadline = time.monotonic() + self.spec.timeout_s
        work = asyncio.ensure_future(self._run(tool, fn, arguments, is_async, self._threads, deadline))
        work.add_done_callback(lambda _: self._slots.leave(stuck=abandoned))
        try:
            with anyio.fail_after(self.spec.timeout_s):
                # an async function is cancelled with the wait; a sync one's thread is only no longer waited for
                return await (work if is_async else asyncio.shield(work))
        except TimeoutError:
            return timed_out()
        finally:
            if not work.done():  # past its timeout (or its caller cancelled): it runs on
                abandoned = True
                self._slots.abandon()
                if self._slots.stuck == self._slots.size:
                    log.warning("python tool %s: all %d of its slots are held by calls past timeout_s whose function "
                                "has not returned (Python cannot stop a thread): its calls time out at once until "
                                "one returns", self.name, self._slots.size)

    @staticmethod
    async def _run(tool: str, fn: Callable[..., Any], arguments: dict[str, Any], is_async: bool,
                   threads: anyio.CapacityLimiter, deadline: float) -> tuple[ToolResult, bool]:
        try:
            if is_async:
                value = await fn(**arguments)
            else:  # abandon_on_cancel: only the loop's shutdown cancels this (the caller waits through a shield)
                value = await anyio.to_thread.run_sync(functools.partial(fn, **arguments), abandon_on_cancel=True,
                                                       limiter=threads)
                if inspect.isawaitable(value):  # an async function behind a plain decorator: seen by what it returns
                    # (the caller's wait is shielded, for a thread; a coroutine can be stopped, so it is, at the
                    # call's deadline, and gives its slot back)
                    with anyio.fail_after(max(0.0, deadline - time.monotonic())):
                        value = await value
        except (Exception, SystemExit, asyncio.CancelledError) as exc:
            # SystemExit too: a function that wraps a command line (argparse on arguments it refuses, a
            # sys.exit) raised it through the tools stage, and Ray ended that actor with it: the run lost
            # its tools stage over one call (raised out of this task, it would stop the event loop).
            # A CancelledError of the function's own (an inner task it awaited was cancelled) too: raised, it
            # was taken for the episode's deadline and ended the whole rollout. This call's own cancellation
            # (its timeout, its caller's deadline, the loop's shutdown) is raised on.
            if isinstance(exc, asyncio.CancelledError) and being_cancelled():
                raise
            return model_error(tool, "tool_error", f"Error: {type(exc).__name__}: {exc}"), False
        try:
            text = value_text(value)
        except Exception as exc:  # noqa: BLE001 -- a value JSON cannot hold (a dict keyed by tuples, a cycle, an int
            # past Python's 4300 digits, an object whose str() raises) is the tool's own bug, not an outage of ours
            return model_error(tool, "tool_error", f"Error: its result cannot be written as text: "
                                                   f"{type(exc).__name__}: {exc}"), False
        return answer(tool, text), False


def function_schema(fn: Callable[..., Any], name: str) -> dict[str, Any]:
    """The OpenAI/HF function-tool schema of `fn`, from its type hints and Google-style docstring.

    Uses transformers' `get_json_schema` (what `apply_chat_template(tools=[fn])` and TRL use), so
    a function documents itself the same way everywhere: every argument needs a type hint and an
    `Args:` line. The tool's name is its key in the spec, not the function's name. An object with
    `__call__`, or a functools.partial, is described by what calling it takes (factory.util.as_function).
    """
    from transformers.utils import get_json_schema  # lazy: transformers is heavy and only python tools need it

    schema = get_json_schema(as_function(fn))
    schema["function"]["name"] = name
    schema["function"].pop("return", None)
    return schema
