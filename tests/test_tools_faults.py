"""Fault tests: the ToolBox against a real stdio server that misbehaves (tests/tool_servers/faulty.py).

Each fault has its own test and assertion; the last test runs a whole "rollout" (concurrent fake
trajectories, several calls per turn) through every fault at once, with the server killed midway,
and checks that every trajectory finishes and every fault lands in its counter.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

from factory.rollout.parse import parse_one
from factory.schema import StdioServer
from factory.tools import Resilience, ToolBox
from factory.types import ToolCall, ToolResult
from factory.util import TIMEOUTS

ROOT = Path(__file__).resolve().parents[1]
FAULTY = StdioServer(
    command="python",
    args=["tests/tool_servers/faulty.py"],
    cwd=str(ROOT),
    timeout_s=1.0,
    retries=1,
    max_result_chars=1000,
)

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
async def box():
    async with ToolBox.from_spec({"faulty": FAULTY}) as toolbox:
        yield toolbox


def call(name: str, **arguments) -> ToolCall:
    return ToolCall(name=name, arguments=arguments, raw="")


async def server_pid(box: ToolBox) -> int:
    result = await box.call(call("pid"))
    assert result.status == "ok", result
    return int(result.text)


def delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


async def run_trajectory(box: ToolBox, turns: list[list[ToolCall]]) -> list[list[ToolResult]]:
    """A fake trajectory: each turn's calls run together, turns one after another, as the rollout does."""
    return [await box.call_many(turn) for turn in turns]


async def kill_when_busy(box: ToolBox, pid: int, delay_s: float) -> None:
    await asyncio.sleep(delay_s)
    os.kill(pid, signal.SIGKILL)


class CallCounter:
    """Wraps a backend's call to count what reaches the server (a spy; the server stays real)."""

    def __init__(self, backend) -> None:
        self.calls = 0
        self._inner = backend.call

    async def __call__(self, tool, arguments):
        self.calls += 1
        return await self._inner(tool, arguments)


# --------------------------------------------------------------------------- one fault per test
async def test_server_killed_mid_rollout_is_restarted_and_calls_retried(box):
    before = box.metrics()
    old_pid = await server_pid(box)
    turns = [[call("echo", text=f"{t}.{c}", delay_s=0.2) for c in range(2)] for t in range(3)]
    trajectories = [run_trajectory(box, turns) for _ in range(16)]
    *results, _ = await asyncio.gather(*trajectories, kill_when_busy(box, old_pid, 0.3))
    assert len(results) == 16
    for trajectory in results:  # every in-flight call was retried on the restarted server
        assert [[r.text for r in turn] for turn in trajectory] == [[f"{t}.{c}" for c in range(2)] for t in range(3)]
    after = box.metrics()
    assert delta(before, after, "tool_servers/faulty/restarts") == 1
    assert delta(before, after, "tools/echo/infra_errors") == 0
    assert await server_pid(box) != old_pid


async def test_without_retries_in_flight_calls_fail_cleanly_as_crash():
    async with ToolBox.from_spec({"faulty": FAULTY.model_copy(update={"retries": 0})}) as box:
        pid = await server_pid(box)
        calls = [box.call(call("echo", text=str(i), delay_s=5.0)) for i in range(8)]
        started = time.perf_counter()
        *results, _ = await asyncio.gather(*calls, kill_when_busy(box, pid, 0.3))
        assert time.perf_counter() - started < 3.0  # failed at the kill, not after the 5 s echo
        assert {(r.status, r.error_kind) for r in results} == {("infra_error", "crash")}
        metrics = box.metrics()
        assert metrics["tools/echo/infra_errors"] == 8 and metrics["tools/echo/timeouts"] == 0
        assert (await box.call(call("echo", text="back"))).text == "back"
        assert box.metrics()["tool_servers/faulty/restarts"] == 1


async def helper_of(box: ToolBox) -> psutil.Process:
    """A helper process the server starts in its process group (as a browser- or kernel-backed server does)."""
    result = await box.call(call("spawn_helper"))
    assert result.status == "ok", result
    return psutil.Process(int(result.text))


async def ended(proc: psutil.Process, deadline_s: float = 10.0) -> bool:
    """Whether `proc` ends (exits, or is a zombie its new parent has yet to collect) within `deadline_s`."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        await asyncio.sleep(0.05)
    return False


async def test_a_servers_helpers_end_with_it_after_a_crash_and_after_the_close():
    """The SDK signals a server's process group only when the server has not exited 2 s after its stdin closed: a
    server that crashed, or that exits when its stdin closes, left its helpers running (a helper on a fixed port
    then made every restart fail). Its group is ended after the SDK's shutdown, on every path."""
    helpers = []
    try:
        async with ToolBox.from_spec({"faulty": FAULTY.model_copy(update={"retries": 0})}) as box:
            helpers.append(await helper_of(box))
            assert (await box.call(call("die"))).error_kind == "crash"
            assert await ended(helpers[0])  # the lost server's group is ended before its restart
            helpers.append(await helper_of(box))  # on the restarted server
            assert helpers[1].is_running()
        assert await ended(helpers[1])  # the server exits by itself when its stdin closes
    finally:
        for proc in helpers:  # (what a failing run of this test leaked)
            with contextlib.suppress(psutil.Error):
                proc.kill()


async def test_a_crash_is_logged_with_the_last_lines_of_the_servers_stderr(caplog):
    """Why the server died is in its stderr: the log says its last 20 lines, not the whole of it."""
    async with ToolBox.from_spec({"faulty": FAULTY.model_copy(update={"retries": 0})}) as box:
        with caplog.at_level("WARNING", logger="factory.tools.servers"):
            result = await box.call(call("die_saying", lines=30))
    assert (result.status, result.error_kind) == ("infra_error", "crash")
    said = "".join(r.getMessage() for r in caplog.records if "connection lost" in r.getMessage())
    expected = "\n".join([*(f"stderr line {i}" for i in range(11, 30)), "RuntimeError: the index file is gone"])
    assert said == f"tool server faulty: connection lost\n--- server stderr (last lines) ---\n{expected}"


async def test_a_call_that_fails_with_a_plain_exception_logs_the_servers_stderr(caplog, monkeypatch):
    """An exception the ToolBox has no class for was logged as its repr alone; what the server said is the clue."""
    from factory.tools.connection import McpConnection

    async def choke(self, name, arguments):
        await answer(self, name, arguments)  # the server writes to its stderr
        raise RuntimeError("the SDK choked")

    answer = McpConnection.call_tool
    async with ToolBox.from_spec({"faulty": FAULTY.model_copy(update={"retries": 0})}) as box:
        monkeypatch.setattr(McpConnection, "call_tool", choke)
        with caplog.at_level("WARNING", logger="factory.tools.servers"):
            result = await box.call(call("complain", text="warning: the index is stale"))
    assert result.text == "Error: the call to complain failed (RuntimeError)."  # the model's stays short
    assert ("tool server faulty: complain failed: RuntimeError('the SDK choked')\n--- server stderr (last lines) "
            "---\nwarning: the index is stale") in caplog.text


async def test_a_server_that_floods_its_stderr_keeps_a_bounded_file():
    """A server's stderr went to an unlinked temp file that grew without end: a chatty server (20 MB of
    logging a call) took 120 MB of /tmp in a 3-step tiny run, invisible to `du`. The file keeps its tail."""
    from factory.tools.connection import STDERR_KEEP_BYTES

    async with ToolBox.from_spec({"faulty": FAULTY.model_copy(update={"max_result_chars": 10})}) as box:
        pid = await server_pid(box)
        for i in range(12):
            assert (await box.call(call("complain", text=f"{i:02d}" + "x" * 300_000))).status == "ok"
        size = os.stat(f"/proc/{pid}/fd/2").st_size
        assert size <= STDERR_KEEP_BYTES + 300_010, size  # it was 3.6 MB
        assert (await box.call(call("complain", text="the last words"))).status == "ok"
        with open(f"/proc/{pid}/fd/2", "rb") as kept:  # what the error messages' tail reads
            assert kept.read().endswith(b"x" * 1000 + b"\nthe last words\n")


async def test_a_server_that_logs_between_calls_keeps_a_bounded_file(monkeypatch):
    """The file was cut back only after a call: a server logging while no call came (a heartbeat, a background
    index) grew it without bound until the next one. It is checked every STDERR_CHECK_S as well."""
    from factory.tools import connection

    monkeypatch.setattr(connection, "STDERR_CHECK_S", 0.1)
    async with ToolBox.from_spec({"faulty": FAULTY}) as box:
        pid = await server_pid(box)
        assert (await box.call(call("chatter", lines=30, chars=100_000))).status == "ok"  # 3 MB, after the call
        await asyncio.sleep(1.0)  # no call comes
        size = os.stat(f"/proc/{pid}/fd/2").st_size
        assert size <= connection.STDERR_KEEP_BYTES, size


def test_the_stderr_tail_keeps_the_last_lines_within_a_bound():
    from factory.tools.connection import last_lines

    assert last_lines(b"\n".join(b"line %d" % i for i in range(30)) + b"\n\n") == "\n".join(
        f"line {i}" for i in range(10, 30))
    assert last_lines(b"x" * 5000 + b"END") == "x" * 1997 + "END"
    assert last_lines(b"ine 3\nline 4", cut=True) == "line 4"  # read from inside the file: a piece of a line
    assert last_lines(b"\xe2\x82 why", cut=True) == "\ufffd why"  # no newline: nothing to drop
    assert last_lines(b"") == ""


async def test_starting_a_running_box_again_keeps_its_servers(box):
    """start() on a running box is a no-op: new servers in its place would leave the old ones running, unowned (the
    rollout stage starts its box once a step)."""
    pid = await server_pid(box)
    await box.start()
    assert await server_pid(box) == pid


async def test_call_past_its_timeout_is_an_infra_timeout_and_blocks_nobody(box):
    before = box.metrics()
    pid = await server_pid(box)
    slow = asyncio.create_task(box.call(call("sleep", seconds=30)))
    await asyncio.sleep(0.05)
    quick = await box.call(call("echo", text="quick"))
    assert quick.text == "quick" and quick.latency_s < 0.9  # not stuck behind the hung call (> 1 s)
    result = await slow
    assert (result.status, result.error_kind) == ("infra_error", "timeout")
    assert 2.0 <= result.latency_s < 4.0  # 1 s timeout, 1 retry with backoff, 1 s timeout
    after = box.metrics()
    assert delta(before, after, "tools/sleep/timeouts") == 1
    assert delta(before, after, "tools/sleep/infra_errors") == 1
    assert await server_pid(box) == pid  # a timeout is not a crash: the server keeps running


async def test_tool_that_raises_is_a_model_error(box):
    before = box.metrics()
    result = await box.call(call("boom", message="broken"))
    assert (result.status, result.error_kind) == ("model_error", "tool_error")
    assert "boom" in result.text
    after = box.metrics()
    assert delta(before, after, "tools/boom/model_errors") == 1
    assert delta(before, after, "tools/boom/infra_errors") == 0


async def test_a_tools_own_error_is_not_retried(box, monkeypatch):
    """isError is the tool's answer (model_error): sent once, though the server allows a retry (retries: 1); a retried
    one repeated the tool's side effects and waited through a backoff for the same answer."""
    from factory.tools.connection import McpConnection

    sent = []
    answer = McpConnection.call_tool

    async def counted(self, name, arguments):
        sent.append(name)
        return await answer(self, name, arguments)

    monkeypatch.setattr(McpConnection, "call_tool", counted)
    result = await box.call(call("boom", message="broken"))
    assert (result.status, result.error_kind) == ("model_error", "tool_error")
    assert sent == ["boom"]


async def test_json_rpc_error_keeps_the_servers_message_in_the_result_and_the_log(box, caplog):
    with caplog.at_level("WARNING", logger="factory.tools.servers"):
        result = await box.call(call("rpc_error", message="quota exhausted for key 7", code=-32000))
    assert (result.status, result.error_kind) == ("infra_error", "transport")
    assert result.text == "Error: tool server 'faulty' answered with error -32000: quota exhausted for key 7"
    assert "JSON-RPC error -32000: quota exhausted for key 7" in caplog.text
    refused = await box.call(call("rpc_error", message="x must be positive", code=-32602))  # INVALID_PARAMS
    assert (refused.status, refused.error_kind) == ("model_error", "bad_arguments")
    assert refused.text == "Error: invalid arguments for rpc_error: x must be positive"


async def test_ten_megabyte_result_is_truncated_head_and_tail():
    # Its own server with a roomy timeout: moving 10 MB through a pipe on a loaded 2-core box can take >1 s.
    async with ToolBox.from_spec({"faulty": FAULTY.model_copy(update={"timeout_s": 30.0})}) as box:
        result = await box.call(call("huge", chars=10_000_000))
    assert result.status == "ok", result
    assert len(result.text) == 1000
    assert result.text.startswith("HEADxxx") and result.text.endswith("xxxTAIL")
    assert "characters omitted]" in result.text


async def test_malformed_json_never_reaches_the_server(box, monkeypatch):
    spy = CallCounter(box._backends["faulty"])
    monkeypatch.setattr(box._backends["faulty"], "call", spy)
    before = box.metrics()
    result = await box.call(ToolCall("echo", None, raw='{"text": "unterminated', parse_error="Unterminated string"))
    assert (result.status, result.error_kind) == ("model_error", "parse_error")
    assert spy.calls == 0
    assert delta(before, box.metrics(), "tools/echo/model_errors") == 1


async def test_schema_invalid_arguments_never_reach_the_server(box, monkeypatch):
    spy = CallCounter(box._backends["faulty"])
    monkeypatch.setattr(box._backends["faulty"], "call", spy)
    result = await box.call(call("echo", text=5))
    assert (result.status, result.error_kind) == ("model_error", "bad_arguments")
    assert "5 is not of type 'string'" in result.text
    assert spy.calls == 0


async def test_arguments_json_rpc_cannot_carry_never_reach_the_server(box, monkeypatch):
    # json.loads takes both from a model's text. A lone surrogate made the SDK's writer fail and drop the
    # connection: the model's call was a server crash (infra error, retried, the server restarted); NaN went as null.
    spy = CallCounter(box._backends["faulty"])
    monkeypatch.setattr(box._backends["faulty"], "call", spy)
    for raw in ('{"name": "echo", "arguments": {"text": "\\ud800"}}',
                '{"name": "echo", "arguments": {"text": "x", "delay_s": NaN}}'):
        result = await box.call(parse_one(raw))
        assert (result.status, result.error_kind) == ("model_error", "bad_arguments"), result
    assert "not valid Unicode" in (await box.call(parse_one('{"name": "echo", "arguments": {"\\udfff": 1}}'))).text
    assert spy.calls == 0


async def test_unknown_tool_is_a_model_error(box):
    before = box.metrics()
    result = await box.call(call("rm_rf", path="/"))
    assert (result.status, result.error_kind) == ("model_error", "unknown_tool")
    after = box.metrics()
    assert delta(before, after, "tools/model_errors") == 1 and delta(before, after, "tools/calls") == 1


async def test_circuit_breaker_stops_hammering_then_probes():
    # Threshold 1 keeps the test to two server starts; counting up to a threshold is unit-tested.
    resilience = Resilience(breaker_threshold=1, breaker_cooldown_s=0.5)
    spec = FAULTY.model_copy(update={"retries": 2})
    async with ToolBox.from_spec({"faulty": spec}, resilience=resilience) as box:
        crash = await box.call(call("die"))  # kills the server; the retry finds the circuit open
        assert (crash.status, crash.error_kind) == ("infra_error", "circuit_open")
        fast = await box.call(call("echo", text="x"))
        assert (fast.status, fast.error_kind) == ("infra_error", "circuit_open")
        assert fast.latency_s < 0.05  # answered without touching the server
        await asyncio.sleep(0.6)
        probe = await box.call(call("echo", text="probe"))  # the probe restarts the server
        assert probe.text == "probe"
        metrics = box.metrics()
        assert metrics["tool_servers/faulty/circuit_opens"] == 1
        assert metrics["tools/echo/infra_errors"] == 1 and metrics["tools/die/infra_errors"] == 1
        assert metrics["tool_servers/faulty/restarts"] == 1  # by the probe, not by a restart loop


async def test_a_replica_lost_while_the_circuit_opened_is_restarted_once_it_closes():
    """With `replicas: 2`, a replica whose crash opened the circuit was never restarted: lost() restarts none while
    the circuit is open, the half-open probe went to the live replica (calls go to live ones), its answer closed
    the circuit, and the server ran on one process for the rest of the run."""
    resilience = Resilience(breaker_threshold=1, breaker_cooldown_s=0.3)
    spec = FAULTY.model_copy(update={"retries": 0, "replicas": 2})
    async with ToolBox.from_spec({"faulty": spec}, resilience=resilience) as box:
        replicas = box._backends["faulty"]._replicas
        assert (await box.call(call("die"))).error_kind == "crash"  # one replica dies; the circuit opens
        await asyncio.sleep(0.4)
        probe = await box.call(call("echo", text="probe"))  # the probe, on the live replica: the circuit closes
        assert probe.text == "probe"
        for _ in range(100):  # the restart runs in the background
            if all(r.connection is not None and r.connection.alive for r in replicas):
                break
            await asyncio.sleep(0.1)
        pids = {r.text for r in await box.call_many([call("pid") for _ in range(4)])}
        assert len(pids) == 2, pids  # two processes serve the calls again
        assert box.metrics()["tool_servers/faulty/restarts"] == 1


async def test_a_replica_whose_restart_failed_is_started_again_while_others_serve(tmp_path):
    """With `replicas: 2`, a lost replica whose restart failed (two server failures, under the threshold of 3: the
    circuit stays closed) stayed down for the run: calls went to the live replica, and nothing started it again.
    It is tried again, at most once a `breaker_cooldown_s`, when a call succeeds on another replica."""
    refuse = tmp_path / "refuse"
    resilience = Resilience(breaker_cooldown_s=0.3)
    spec = FAULTY.model_copy(update={"retries": 0, "replicas": 2, "env": {"FAULTY_NO_START": str(refuse)}})
    async with ToolBox.from_spec({"faulty": spec}, resilience=resilience) as box:
        replicas = box._backends["faulty"]._replicas
        refuse.touch()  # from here, a start fails
        assert (await box.call(call("die"))).error_kind == "crash"
        for _ in range(50):  # its restart, in the background, fails
            if any(r.down and r._starting.exception() for r in replicas):  # (down: no start under way)
                break
            await asyncio.sleep(0.1)
        assert sum(r.down for r in replicas) == 1
        refuse.unlink()
        for _ in range(50):  # calls on the live replica; the down one is tried again once its pause is over
            assert (await box.call(call("echo", text="x"))).text == "x"
            if all(r.connection is not None and r.connection.alive for r in replicas):
                break
            await asyncio.sleep(0.1)
        pids = {r.text for r in await box.call_many([call("pid") for _ in range(4)])}
        assert len(pids) == 2, pids  # two processes serve the calls again
        assert box._backends["faulty"]._breaker.state == "closed"


async def test_a_probe_that_ends_without_a_verdict_lets_another_probe_through():
    """A half-open circuit's probe that was cancelled (an episode's timeout), or that failed in a way counted
    neither as the server's success nor its failure (a result that breaks its schema), left the probe taken:
    every later call met the open circuit, for the rest of the run."""
    resilience = Resilience(breaker_threshold=1, breaker_cooldown_s=0.3)
    async with ToolBox.from_spec({"faulty": FAULTY}, resilience=resilience) as box:
        await box.call(call("die"))  # the circuit opens
        await asyncio.sleep(0.4)
        with pytest.raises(TIMEOUTS):  # the probe, cancelled while the server answers slowly
            await asyncio.wait_for(box.call(call("echo", text="slow", delay_s=5.0)), 1.0)
        after = await box.call(call("echo", text="next"))  # another probe, not "circuit_open"
        assert (after.status, after.text) == ("ok", "next")


async def test_a_server_that_answers_nothing_is_taken_as_hung_and_restarted():
    """A server alive with its pipes open that answers nothing (a deadlock): timeouts do not count as failures, so
    it was never restarted, and every later call of the run timed out. `hung_after` calls in a row unanswered,
    with no answer between, restart it."""
    resilience = Resilience(hung_after=2)
    spec = FAULTY.model_copy(update={"retries": 0})
    async with ToolBox.from_spec({"faulty": spec}, resilience=resilience) as box:
        first = await box.call(call("pid"))
        frozen = await box.call(call("freeze", seconds=60))  # blocks the server's only thread
        stuck = await box.call(call("echo", text="stuck"))  # the second call unanswered: taken as hung
        assert [(r.status, r.error_kind) for r in (frozen, stuck)] == [("infra_error", "timeout")] * 2
        again = await box.call(call("pid"))
        assert again.status == "ok" and again.text != first.text  # another process
        assert box.metrics()["tool_servers/faulty/restarts"] == 1


async def test_a_busy_server_that_answers_one_call_at_a_time_is_not_taken_as_hung():
    """A burst to a server that serves one call at a time times out its tail while the server answers the head:
    those timeouts were counted "in a row", and the server was restarted as hung after every burst."""
    resilience = Resilience(hung_after=2)
    spec = FAULTY.model_copy(update={"retries": 0})
    async with ToolBox.from_spec({"faulty": spec}, resilience=resilience) as box:
        first = await box.call(call("pid"))
        burst = await box.call_many([call("queued", seconds=0.6) for _ in range(5)])  # answered 0.6 s apart
        assert [r.status for r in burst].count("ok") == 1 and [r.error_kind for r in burst].count("timeout") == 4
        await asyncio.sleep(2.5)  # the server works through the rest of the burst
        assert (await box.call(call("pid"))).text == first.text  # the same process
        assert box.metrics().get("tool_servers/faulty/restarts", 0) == 0


async def test_calls_waiting_for_a_slot_fail_fast_once_the_circuit_opens(tmp_path):
    """Calls let in while the circuit was closed, then queued for a slot, each started the failing server again
    once the circuit had opened: 16 slots' worth of calls each waited out a start."""
    from factory.tools.metrics import ToolMetrics
    from factory.tools.servers import McpServer

    hangs = StdioServer(command="python", args=["-c", "import time; time.sleep(60)"], start_timeout_s=0.5,
                        timeout_s=1.0, retries=0, concurrency=1)
    server = McpServer("hangs", hangs, base_dir=None, resilience=Resilience(breaker_threshold=1), metrics=ToolMetrics())
    started = time.monotonic()  # (not started first: ToolBox would refuse it; the calls start it, and fail)
    results = await asyncio.gather(*(server.call("x", {}) for _ in range(6)))
    took = time.monotonic() - started
    await server.close()
    assert [r.error_kind for r in results] == ["crash"] + ["circuit_open"] * 5
    assert took < 5.0  # one start, not six


async def test_one_failed_start_shared_by_the_waiting_calls_is_one_failure():
    """A start that failed was counted once per call that waited on it: three calls in flight and one failed
    restart opened the circuit (threshold 3), where a failed start is one server failure."""
    from factory.tools.metrics import ToolMetrics
    from factory.tools.servers import McpServer

    dies = StdioServer(command="python", args=["-c", "import sys; sys.exit(1)"], start_timeout_s=5.0, timeout_s=5.0,
                       retries=0, concurrency=3)  # its start fails: no MCP handshake
    metrics = ToolMetrics()
    server = McpServer("dies", dies, base_dir=None, resilience=Resilience(breaker_threshold=3), metrics=metrics)
    try:
        results = await asyncio.gather(*(server.call("x", {}) for _ in range(3)))  # the three share one start
    finally:
        await server.close()
    assert [r.error_kind for r in results] == ["crash"] * 3
    assert (server._breaker.state, server._breaker._failures) == ("closed", 1)
    assert metrics.snapshot().get("tool_servers/dies/circuit_opens", 0) == 0


async def test_close_stops_a_start_under_way_without_waiting_out_its_start_timeout():
    """close() waited for a start under way to run to its start_timeout_s: `factory check --connect`, which cuts a
    start short so that it always returns, and a run's teardown during a hung restart waited that long."""
    import psutil

    marker = "hangs at its start"
    hangs = StdioServer(command="python", args=["-c", f"import time; time.sleep(60)  # {marker}"], start_timeout_s=30.0)
    box = ToolBox.from_spec({"hangs": hangs})
    with pytest.raises(TIMEOUTS):
        await asyncio.wait_for(box.start(), 0.5)  # as factory check --connect bounds the listing
    started = time.monotonic()
    await box.close()
    assert time.monotonic() - started < 10.0  # the SDK's stop of the process (~2 s), not the start's 30 s

    def ours(process: psutil.Process) -> bool:
        try:
            return marker in " ".join(process.cmdline())
        except psutil.Error:  # ended meanwhile
            return False

    assert [p for p in psutil.Process().children(recursive=True) if ours(p)] == []  # its process is stopped


async def test_slow_calls_between_answers_restart_nothing():
    resilience = Resilience(hung_after=2)
    spec = FAULTY.model_copy(update={"retries": 0})
    async with ToolBox.from_spec({"faulty": spec}, resilience=resilience) as box:
        for _ in range(2):
            assert (await box.call(call("sleep", seconds=5))).error_kind == "timeout"
            assert (await box.call(call("echo", text="x"))).text == "x"
        assert box.metrics().get("tool_servers/faulty/restarts", 0) == 0


# ------------------------------------------------------------------------- every fault at once
def fault_plan(index: int) -> list[list[ToolCall]]:
    """Trajectory `index`'s three turns of three calls; every trajectory meets several faults."""
    kinds = [
        call("echo", text=f"ok{index}", delay_s=0.1),
        call("boom"),
        call("huge", chars=50_000),
        call("no_such_tool"),
        ToolCall("echo", None, raw="{", parse_error="Expecting value"),
        call("echo", text=["not", "a", "string"]),
        call("echo", text="late", delay_s=0.3),
    ]
    turns = [[kinds[(index + 3 * t + c) % len(kinds)] for c in range(3)] for t in range(3)]
    if index == 0:
        turns[1][0] = call("sleep", seconds=30)  # one hung call in one trajectory
    return turns


EXPECTED_KIND = {  # (status, error_kind) per call, by what the model asked for
    "ok": ("ok", None),
    "boom": ("model_error", "tool_error"),
    "no_such_tool": ("model_error", "unknown_tool"),
    "parse": ("model_error", "parse_error"),
    "bad": ("model_error", "bad_arguments"),
    "sleep": ("infra_error", "timeout"),
}


def expected(c: ToolCall) -> tuple[str, str | None]:
    if c.name == "no_such_tool":
        return EXPECTED_KIND["no_such_tool"]
    if c.arguments is None:
        return EXPECTED_KIND["parse"]
    if c.name == "echo" and not isinstance(c.arguments["text"], str):
        return EXPECTED_KIND["bad"]
    return EXPECTED_KIND.get(c.name, EXPECTED_KIND["ok"])


async def test_rollout_through_every_fault_loses_nothing(box):
    before = box.metrics()
    pid = await server_pid(box)
    plans = [fault_plan(i) for i in range(16)]
    started = time.perf_counter()
    *results, _ = await asyncio.gather(*(run_trajectory(box, p) for p in plans), kill_when_busy(box, pid, 0.2))
    # nothing hangs: the hung call sleeps 30 s; the bound leaves room for a loaded 2-core CI (8.3 s seen at load 9)
    assert time.perf_counter() - started < 20.0
    outcomes: Counter[tuple[str, str | None]] = Counter()
    for plan, trajectory in zip(plans, results):
        assert [len(turn) for turn in trajectory] == [3, 3, 3]  # no call silently lost
        for planned_turn, result_turn in zip(plan, trajectory):
            for c, r in zip(planned_turn, result_turn):
                assert (r.status, r.error_kind) == expected(c), (c, r)
                outcomes[(r.status, r.error_kind)] += 1
                if c.name == "huge":
                    assert len(r.text) == 1000 and r.text.endswith("TAIL")
    after = box.metrics()
    assert delta(before, after, "tools/calls") == 16 * 9 + 1  # + the pid call
    assert delta(before, after, "tools/timeouts") == outcomes[("infra_error", "timeout")] == 1
    assert delta(before, after, "tools/infra_errors") == 1  # the kill was absorbed by retries
    model_errors = sum(n for (status, _), n in outcomes.items() if status == "model_error")
    assert delta(before, after, "tools/model_errors") == model_errors
    assert delta(before, after, "tool_servers/faulty/restarts") == 1


async def test_close_in_the_tick_a_start_completes_fails_the_waiting_calls_as_shut_down(monkeypatch):
    """A close() in the loop tick in which a start's handshake completed cancelled that start while it closed the
    connection it had just opened: the calls waiting on it got a bare CancelledError, not "shut down"."""
    from factory.tools import servers
    from factory.tools.connection import ServerStartError
    from factory.tools.metrics import ToolMetrics

    started, handshake, closed = asyncio.Event(), asyncio.Event(), []

    class Connection:  # opens when the test says so; its close takes a moment, as the SDK's stop of a process does
        def __init__(self, *args, **kwargs) -> None:
            self.alive = True

        async def open(self, timeout_s: float) -> None:
            started.set()
            await handshake.wait()

        async def close(self) -> None:
            await asyncio.sleep(0.05)
            closed.append(self)

    monkeypatch.setattr(servers, "McpConnection", Connection)
    server = servers.McpServer("late", FAULTY, base_dir=None, resilience=Resilience(), metrics=ToolMetrics())
    waiting = asyncio.ensure_future(server._replicas[0].get())
    await started.wait()  # the start is under way, waiting for its handshake
    closing = asyncio.ensure_future(server.close())  # runs first in the next tick: the server is closed ...
    handshake.set()  # ... then the start's handshake completes and it finds the server closed
    await closing
    with pytest.raises(ServerStartError, match="shut down"):
        await waiting
    assert len(closed) == 1  # the connection it opened is closed, before close() returned
