"""The ToolBox against real servers: the calculator shipped in this repo (stdio and streamable HTTP),
a python tool, and a third-party server from PyPI (mcp-server-time, in its own venv)."""
from __future__ import annotations

import argparse
import asyncio
import functools
import inspect
import logging
import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest

from factory.rollout.parse import parse_tool_calls
from factory.schema import HttpServer, PythonTool, StdioServer
from factory.tools import ToolBox, ToolStartError
from factory.tools.connection import refusal
from factory.types import ToolCall
from tests.servers import free_port
from tests.servers import http_server as run_http_server

ROOT = Path(__file__).resolve().parents[1]
CALC = StdioServer(command="python", args=["-m", "factory.examples.calculator"], cwd=str(ROOT), timeout_s=10)
TIME_SERVER = ROOT / ".factory/tool-venvs/mcp-server-time/bin/mcp-server-time"

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
async def box():
    """One calculator server (and a python tool) for the whole module: a stdio start costs ~0.6 s."""
    tools = {"calc": CALC, "count": PythonTool(function="tests.test_tools_servers:count_words")}
    async with ToolBox.from_spec(tools, base_dir=ROOT) as toolbox:
        yield toolbox


def count_words(text: str) -> int:
    """Count the words of a text.

    Args:
        text: The text whose words are counted.
    """
    return len(text.split())


async def slow_double(x: int) -> int:
    """Double a number, slowly.

    Args:
        x: The number to double.
    """
    await asyncio.sleep(0.2)
    return 2 * x


async def cancels_itself(x: int) -> int:
    """An async function whose inner task is cancelled (by a library it calls): it raises CancelledError though
    no one cancelled its call.

    Args:
        x: Anything.
    """
    inner = asyncio.ensure_future(asyncio.sleep(10))
    inner.cancel()
    return await inner


def flaky_divide(a: float, b: float) -> float:
    """Divide two numbers (a blocking, sync function).

    Args:
        a: The dividend.
        b: The divisor; 0 raises, and a negative one makes the call hang for a second.
    """
    if b < 0:
        time.sleep(1.0)
    return a / b


RUNNING = {"now": 0, "peak": 0}
RUNNING_LOCK = threading.Lock()


def one_at_a_time(seconds: float) -> str:
    """Sleep in a blocking way, counting how many of these run at once.

    Args:
        seconds: How long to sleep.
    """
    with RUNNING_LOCK:
        RUNNING["now"] += 1
        RUNNING["peak"] = max(RUNNING["peak"], RUNNING["now"])
    time.sleep(seconds)
    with RUNNING_LOCK:
        RUNNING["now"] -= 1
    return "slept"


HUNG = threading.Event()  # set at the end of the test that hangs on it: its threads end then


def hangs() -> str:
    """A function that does not return until its test lets it (a deadlocked one never would)."""
    HUNG.wait()
    return "returned"


def command_line(line: str) -> int:
    """A function that wraps a command line, as tools often are: argparse exits on what it refuses.

    Args:
        line: The command line, as `--n 3`.
    """
    parser = argparse.ArgumentParser(prog="count")
    parser.add_argument("--n", type=int, required=True)
    return parser.parse_args(line.split()).n


def call(name, arguments, raw=""):
    return ToolCall(name=name, arguments=arguments, raw=raw)


# ------------------------------------------------------------------------------------ calculator
async def test_schemas_are_function_tools(box):
    schemas = {s["function"]["name"]: s for s in box.schemas()}
    assert set(schemas) == {"calculate", "count"}
    calc = schemas["calculate"]
    assert calc["type"] == "function"
    assert calc["function"]["parameters"]["required"] == ["expression"]
    assert "arithmetic" in calc["function"]["description"]
    assert schemas["count"]["function"]["parameters"]["properties"]["text"]["type"] == "string"


async def test_calculate_evaluates(box):
    result = await box.call(call("calculate", {"expression": "(3 + 4) * 2 - 10 / 4"}))
    assert (result.status, result.text, result.error_kind) == ("ok", "11.5", None)
    assert result.latency_s > 0


async def test_calculator_refuses_code(box):
    result = await box.call(call("calculate", {"expression": "__import__('os').getpid()"}))
    assert result.status == "model_error" and result.error_kind == "tool_error"
    assert "unsupported" in result.text


async def test_tool_error_is_a_model_error(box):
    result = await box.call(call("calculate", {"expression": "1/0"}))
    assert (result.status, result.error_kind) == ("model_error", "tool_error")
    assert "division by zero" in result.text


@pytest.mark.parametrize("expression", ["1e309", "1e309 - 1e309", "-1e999 * 0", "1" + "0" * 400])
async def test_calculator_refuses_what_is_no_finite_number(box, expression):
    # Literals were never checked and nan passes `abs(x) > 1e300`: these answered inf, nan, nan and 400 digits.
    result = await box.call(call("calculate", {"expression": expression}))
    assert (result.status, result.error_kind) == ("model_error", "tool_error")
    assert "result too large or not a real number" in result.text


async def test_a_deeply_nested_expression_is_a_model_error_that_says_so(box):
    # 999 characters, within the length bound: the evaluator's recursion ran out (RecursionError), and the model
    # read only "Error executing tool calculate" while the server logged a traceback.
    result = await box.call(call("calculate", {"expression": "-" * 998 + "1"}))
    assert (result.status, result.error_kind) == ("model_error", "tool_error")
    assert "expression nested deeper than 500 levels" in result.text


def test_the_nesting_bound_admits_every_chain_of_operations_within_the_length_bound():
    from factory.examples.calculator import MAX_DEPTH, MAX_EXPRESSION_CHARS, evaluate

    assert evaluate("+1" * (MAX_EXPRESSION_CHARS // 2 - 1) + "+1") == MAX_EXPRESSION_CHARS // 2  # 499 levels deep
    assert evaluate("-" * MAX_DEPTH + "1") == 1
    with pytest.raises(ValueError, match="expression nested deeper than 500 levels"):
        evaluate("-" * (MAX_DEPTH + 1) + "1")

    def from_a_deep_stack(depth):  # 50 frames short of the limit: ast.parse runs out while it builds the tree
        return from_a_deep_stack(depth - 1) if depth else evaluate("-" * 400 + "1")

    with pytest.raises(ValueError, match="^expression nested too deeply$"):
        from_a_deep_stack(sys.getrecursionlimit() - len(inspect.stack(0)) - 50)


async def test_schema_invalid_arguments_are_a_model_error_said_with_the_schemas_words(box):
    # (that they never reach the server: tests/test_tools_faults.py, whose spy counts the backend's calls)
    before = box.metrics().get("tools/calculate/calls", 0)  # 0 when no earlier test called it
    result = await box.call(call("calculate", {"expr": "1+1"}))
    assert (result.status, result.error_kind) == ("model_error", "bad_arguments")
    assert "'expression' is a required property" in result.text
    assert box.metrics()["tools/calculate/model_errors"] >= 1
    assert box.metrics()["tools/calculate/calls"] == before + 1


async def test_unparsable_json_is_a_parse_error(box):
    result = await box.call(ToolCall("calculate", None, raw='{"expression": "1+', parse_error="unterminated string"))
    assert (result.status, result.error_kind) == ("model_error", "parse_error")
    assert "unterminated string" in result.text


async def test_a_call_whose_name_could_not_be_read_is_a_parse_error(box):
    # The unknown-tool check came first: these were answered "unknown tool '?'" and counted as unknown_tool.
    single_quoted = "<tool_call>{'name': 'count', 'arguments': {'text': 'a b'}}</tool_call>"
    for text, why in [(single_quoted, "invalid JSON: Expecting property name enclosed in double quotes"),
                      ('<tool_call>["count", {"text": "a b"}]</tool_call>', "expected a JSON object, got list")]:
        [parsed] = parse_tool_calls(text)
        result = await box.call(parsed)
        assert (result.status, result.error_kind) == ("model_error", "parse_error")
        assert result.text.startswith(f"Error: the tool call could not be read: {why}")


async def test_unknown_tool_lists_the_real_ones(box):
    before = box.metrics()
    result = await box.call(call("calculator", {"expression": "1"}))
    assert (result.status, result.error_kind) == ("model_error", "unknown_tool")
    assert "Available tools: calculate, count" in result.text
    after = box.metrics()
    assert after["tools/model_errors"] == before["tools/model_errors"] + 1
    assert not any(k.startswith("tools/calculator/") for k in after)


async def test_qualified_name_is_accepted(box):
    result = await box.call(call("calc__calculate", {"expression": "2**10"}))
    assert (result.status, result.text, result.tool) == ("ok", "1024", "calculate")


async def test_python_tool_is_called_in_process(box):
    result = await box.call(call("count", {"text": "one two three"}))
    assert (result.status, result.text) == ("ok", "3")


async def test_calls_of_a_turn_run_concurrently_and_keep_order(box):
    calls = [call("calculate", {"expression": f"{i} * 3"}) for i in range(40)]
    results = await box.call_many(calls)
    assert [r.text for r in results] == [str(i * 3) for i in range(40)]


async def test_listing(box):
    listing = box.tool_listing()
    assert [t["name"] for t in listing["calc"]] == ["calculate"]
    assert listing["calc"][0]["offered_as"] == "calculate"
    assert listing["count"][0]["inputSchema"]["required"] == ["text"]


async def test_metrics_have_latency_percentiles(box):
    await box.call_many([call("calculate", {"expression": f"{i} + 1"}) for i in range(3)])  # alone too, not after others
    metrics = box.metrics()
    assert metrics["tools/calculate/latency_s_p50"] <= metrics["tools/calculate/latency_s_p95"]
    assert metrics["tools/calls"] >= metrics["tools/calculate/calls"]


# ------------------------------------------------------------------------------- start and stop
async def test_close_leaves_no_process_and_is_idempotent():
    before = set(_children(os.getpid()))
    box = ToolBox.from_spec({"calc": CALC.model_copy(update={"replicas": 2})})
    await box.start()
    children = set(_children(os.getpid())) - before
    assert len(children) == 2
    await box.close()
    await box.close()
    assert not any(_alive(p) for p in children)
    result = await box.call(call("calculate", {"expression": "1"}))
    assert result.status == "infra_error"


async def test_a_call_waiting_for_a_slot_during_close_starts_no_server():
    """The call waiting behind the one in flight got its slot when close() ended that one, found the server dead
    and started a fresh process: after close() had returned, and left running."""
    faulty = StdioServer(command="python", args=["tests/tool_servers/faulty.py"], cwd=str(ROOT), timeout_s=10,
                         concurrency=1, retries=1)
    before = set(_children(os.getpid()))  # (the module's calculator may be running)
    box = ToolBox.from_spec({"f": faulty})
    await box.start()
    calls = [asyncio.ensure_future(box.call(call("sleep", {"seconds": 5}))) for _ in range(3)]
    await asyncio.sleep(0.3)  # the first is in flight, the others wait for its slot
    await box.close()
    started_after_close = set(_children(os.getpid())) - before
    results = await asyncio.wait_for(asyncio.gather(*calls), 10)
    assert not started_after_close and not set(_children(os.getpid())) - before
    assert [r.status for r in results] == ["infra_error"] * 3
    assert results[1].text == results[2].text == "Error: the tool servers are shut down."


async def test_replicas_share_the_calls():
    async with ToolBox.from_spec({"calc": CALC.model_copy(update={"replicas": 2})}) as box:
        replicas = box._backends["calc"]._replicas
        assert all(r.connection is not None and r.connection.alive for r in replicas)
        results = await box.call_many([call("calculate", {"expression": f"{i}+1"}) for i in range(20)])
        assert all(r.status == "ok" for r in results)


async def test_a_server_that_cannot_start_fails_start_with_its_stderr():
    bad = StdioServer(command="python", args=["-c", "import sys; sys.stderr.write('no such thing'); sys.exit(2)"])
    before = set(_children(os.getpid()))
    box = ToolBox.from_spec({"calc": CALC, "bad": bad})
    with pytest.raises(ToolStartError, match="(?s)bad: .*no such thing"):
        await box.start()
    assert set(_children(os.getpid())) <= before  # the calculator that did start was stopped again


async def test_a_server_that_never_speaks_mcp_is_said_to_in_words():
    """A process that starts but never answers `initialize` (a wrong command): the start times out with what
    it waited for and how long (the spec's `start_timeout_s`), not a bare TimeoutError; and not that "the
    server's process ended" -- it was alive until the timeout ended it."""
    mute = StdioServer(command=sys.executable, args=["-c", "import time; time.sleep(30)"], start_timeout_s=0.5)
    before = set(_children(os.getpid()))
    box = ToolBox.from_spec({"mute": mute})
    with pytest.raises(ToolStartError, match=r"mute: .*failed to start: TimeoutError: no MCP handshake \(initialize, "
                                             r"tools/list\) within 0.5 s") as caught:
        await box.start()
    assert "process ended" not in str(caught.value)
    assert set(_children(os.getpid())) <= before  # the mute process was ended, not left sleeping


async def test_a_server_that_prints_to_stdout_is_said_to_in_one_line(caplog):
    """The SDK logged a server's stdout line that is not JSON-RPC with pydantic's traceback: `factory check
    --connect` of a server with a print() showed a traceback."""
    chatty = StdioServer(command=sys.executable, args=["-c", "print('hello')"])
    with pytest.raises(ToolStartError, match="chatty: .*failed to start"):
        await ToolBox.from_spec({"chatty": chatty}).start()
    said = [r for r in caplog.records if r.name == "mcp.client.stdio"]
    assert [(r.getMessage(), r.exc_info) for r in said] == [
        ("a tool server wrote a line that is not MCP (JSON-RPC) to stdout, its channel to Factory: 'hello'; a "
         "server prints its own messages to stderr", None)]


# A stdio server written without an MCP library (as a JavaScript one may be) whose tool answers with half an
# emoji, a lone surrogate escape that Python's json writes and reads but the SDK's parser refuses.
HALF_EMOJI = """
import json, sys
for line in sys.stdin:
    msg = json.loads(line)
    if "id" not in msg:
        continue
    result = {"initialize": {"protocolVersion": msg.get("params", {}).get("protocolVersion"),
                             "capabilities": {"tools": {}}, "serverInfo": {"name": "half", "version": "1"}},
              "tools/list": {"tools": [{"name": "snip", "inputSchema": {"type": "object"}}]},
              "tools/call": {"content": [{"type": "text", "text": "cut: \\ud83d"}]}}.get(msg["method"], {})
    print(json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": result}), flush=True)
"""


async def test_an_answer_the_sdk_cannot_read_fails_its_call_at_once(caplog):
    """It was said to be a line that is not MCP, with 'a server prints its own messages to stderr': the user
    looked for a print() while the call timed out. Then it was said to be an answer, and the call still waited
    for its whole timeout: the answer's request id can be read, so the call fails when the answer comes."""
    half = StdioServer(command=sys.executable, args=["-c", HALF_EMOJI], timeout_s=5, retries=0)
    async with ToolBox.from_spec({"half": half}) as box:
        started = time.perf_counter()
        result = await box.call(ToolCall("snip", {}, raw=""))
        waited = time.perf_counter() - started
    assert (result.status, result.error_kind) == ("infra_error", "transport")
    assert result.text.startswith("Error: tool server 'half' answered with error -32700: its answer is not JSON-RPC "
                                  "the MCP SDK can read (Invalid JSON: unexpected end of hex escape at line 1 column ")
    assert waited < 2  # not the 5 s timeout
    [said] = [r.getMessage() for r in caplog.records if r.name == "mcp.client.stdio"]
    assert re.fullmatch(r"a tool server sent an answer \(to request \d+\) the MCP SDK cannot read \(Invalid JSON: "
                        r"unexpected end of hex escape at line 1 column \d+\): '.*"
                        r"cut: \\\\ud83d\"}]}}'; its call fails", said), said


async def test_allowed_tools_filters_and_checks():
    async with ToolBox.from_spec({"calc": CALC.model_copy(update={"allowed_tools": ["calculate"]})}) as box:
        assert [s["function"]["name"] for s in box.schemas()] == ["calculate"]
    box = ToolBox.from_spec({"calc": CALC.model_copy(update={"allowed_tools": ["calc"]})})
    with pytest.raises(ToolStartError, match=r"allowed_tools names unknown tool\(s\) \['calc'\]"):
        await box.start()


async def test_async_python_tool_calls_overlap():
    async with ToolBox.from_spec({"double": PythonTool(function="tests.test_tools_servers:slow_double")}) as box:
        started = time.perf_counter()
        results = await box.call_many([call("double", {"x": i}) for i in range(10)])
        elapsed = time.perf_counter() - started
    assert [r.text for r in results] == [str(2 * i) for i in range(10)]
    assert elapsed < 1.0  # ten 0.2 s calls: 2 s one at a time


def _logged(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):  # a plain decorator: what it returns is the coroutine
        return fn(*args, **kwargs)
    return wrapper


@_logged
async def decorated_double(x: int) -> int:
    """Double a number, behind a decorator.

    Args:
        x: The number to double.
    """
    await asyncio.sleep(0.01)
    return 2 * x


@_logged
async def decorated_nap(seconds: float) -> float:
    """Sleep, behind a decorator.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return seconds


async def test_a_decorated_async_python_tool_past_its_timeout_is_stopped_and_gives_its_slot_back():
    """Its coroutine ran on past timeout_s (the wait is shielded, for a thread's sake) and held the tool's only
    slot: the next call failed at once."""
    spec = PythonTool(function="tests.test_tools_servers:decorated_nap", timeout_s=0.3, retries=0, concurrency=1)
    async with ToolBox.from_spec({"nap": spec}) as box:
        (late,) = await box.call_many([call("nap", {"seconds": 30})])
        await asyncio.sleep(0.2)
        (quick,) = await box.call_many([call("nap", {"seconds": 0})])
    assert "timed out" in late.text
    assert quick.text == "0", quick.text


async def test_an_async_python_tool_behind_a_plain_decorator_is_awaited():
    """inspect does not see an async function behind a plain decorator: each call answered '<coroutine object
    ...>' (never awaited) instead of its value."""
    async with ToolBox.from_spec({"double": PythonTool(function="tests.test_tools_servers:decorated_double")}) as box:
        (result,) = await box.call_many([call("double", {"x": 21})])
    assert result.text == "42", result.text


async def test_a_cancelled_error_a_python_tool_raises_of_its_own_is_its_error_and_its_timeout_still_cuts_it():
    """An async tool's own CancelledError (an inner task cancelled) went out of ToolBox.call and the agent loop,
    recorded as the episode's deadline, and ended the whole rollout."""
    tools = {"cancels": PythonTool(function="tests.test_tools_servers:cancels_itself", retries=0),
             "double": PythonTool(function="tests.test_tools_servers:slow_double", timeout_s=0.05, retries=0)}
    async with ToolBox.from_spec(tools, record=True) as box:
        own = await box.call(call("cancels", {"x": 1}))
        assert (own.status, own.error_kind, own.text) == ("model_error", "tool_error", "Error: CancelledError: ")
        assert [(r["status"], r["error_kind"]) for r in box.recorder.rows] == [("model_error", "tool_error")]
        cut = await box.call(call("double", {"x": 1}))  # its timeout cancels it: still a timeout, not its error
        assert (cut.status, cut.error_kind) == ("infra_error", "timeout")


def pairs(n: int) -> dict:
    """Counts keyed by (a, b) pairs: JSON has no such keys.

    Args:
        n: How many pairs.
    """
    return {(i, i + 1): i for i in range(n)}


def cycle() -> list:
    """A list that holds itself: JSON cannot write it."""
    loop: list = []
    loop.append(loop)
    return loop


async def test_a_python_tool_whose_value_cannot_be_written_as_text_is_its_own_error():
    """json.dumps raised out of the call (a dict keyed by tuples, a cycle, an int past Python's 4300 digits): the
    tool's own bug was logged with a traceback as Factory's and filed as an infra error ("transport"), which drops
    the trajectory and counts toward train.max_infra_error_rate."""
    tools = {"pairs": PythonTool(function="tests.test_tools_servers:pairs"),
             "cycle": PythonTool(function="tests.test_tools_servers:cycle")}
    async with ToolBox.from_spec(tools) as box:
        keyed, looped, fine = await box.call_many([call("pairs", {"n": 2}), call("cycle", {}), call("pairs", {"n": 0})])
    assert [(r.status, r.error_kind) for r in (keyed, looped)] == [("model_error", "tool_error")] * 2
    assert keyed.text == ("Error: its result cannot be written as text: TypeError: keys must be str, int, float, "
                          "bool or None, not tuple")
    assert looped.text == "Error: its result cannot be written as text: ValueError: Circular reference detected"
    assert (fine.status, fine.text) == ("ok", "{}")


async def test_sync_python_tool_errors_and_timeouts():
    spec = PythonTool(function="tests.test_tools_servers:flaky_divide", timeout_s=0.3, retries=0)
    async with ToolBox.from_spec({"divide": spec}) as box:
        assert (await box.call(call("divide", {"a": 1, "b": 4}))).text == "0.25"
        raised = await box.call(call("divide", {"a": 1, "b": 0}))
        assert (raised.status, raised.error_kind) == ("model_error", "tool_error")
        assert raised.text == "Error: ZeroDivisionError: division by zero"
        started = time.perf_counter()
        hung, quick = await asyncio.gather(
            box.call(call("divide", {"a": 1, "b": -1})), box.call(call("divide", {"a": 3, "b": 2}))
        )
        assert (hung.status, hung.error_kind) == ("infra_error", "timeout")
        assert quick.text == "1.5" and quick.latency_s < 0.3  # the blocking call runs in a thread, not the loop
        assert time.perf_counter() - started < 0.9  # the timed-out thread is abandoned, not awaited
        assert box.metrics()["tools/divide/timeouts"] == 1


async def test_a_timed_out_sync_python_tool_holds_its_slot_until_its_thread_ends():
    # A thread cannot be stopped: with its slot given back at the deadline, the next call (or the retry) ran
    # beside the abandoned one, past `concurrency` (a 1.5 s function at timeout 0.5 ran 3 at once).
    RUNNING["peak"] = 0
    spec = PythonTool(function="tests.test_tools_servers:one_at_a_time", timeout_s=0.2, retries=0, concurrency=1)
    async with ToolBox.from_spec({"nap": spec}) as box:
        slow, quick = await asyncio.gather(box.call(call("nap", {"seconds": 0.6})),
                                           box.call(call("nap", {"seconds": 0.01})))
        assert (slow.status, slow.error_kind) == ("infra_error", "timeout")
        assert slow.latency_s < 0.45  # answered at its deadline, not when its thread ends
        # it waited for the slot; the slow one passed its timeout, holding the only slot (it may never return)
        assert quick.error_kind == "timeout" and quick.latency_s < 0.45
        await asyncio.sleep(0.6)  # the slow one's thread ends (0.6 s after it started): its slot is free again
        assert (await box.call(call("nap", {"seconds": 0.01}))).text == "slept"
    assert RUNNING["peak"] == 1


async def test_python_tool_calls_time_out_once_every_slot_is_held_by_a_hung_one():
    """Once `concurrency` calls hung (their threads hold their slots), every later call waited for a slot for ever
    (its timeout counts its function's time, not its wait). Now a call waiting behind calls that pass their
    timeout, or one made once every slot is held by such a call, is answered at once; when one returns, calls
    run again."""
    HUNG.clear()
    spec = PythonTool(function="tests.test_tools_servers:hangs", timeout_s=0.2, retries=0, concurrency=2)
    try:
        async with ToolBox.from_spec({"hang": spec}) as box:
            first = [asyncio.ensure_future(box.call(call("hang", {}))) for _ in range(2)]
            await asyncio.sleep(0.05)  # both hold their slots
            waiting = await asyncio.wait_for(box.call(call("hang", {})), 2.0)  # before: for ever
            assert (waiting.status, waiting.error_kind) == ("infra_error", "timeout")
            assert waiting.latency_s < 0.45  # when the two it waited behind passed their timeout
            for hung in await asyncio.gather(*first):
                assert (hung.status, hung.error_kind) == ("infra_error", "timeout")
            later = await asyncio.wait_for(box.call(call("hang", {})), 2.0)
            assert (later.status, later.error_kind, later.text) == ("infra_error", "timeout",
                                                                   "Error: hang timed out after 0.2 s.")
            assert later.latency_s < 0.1  # at once: every slot is held by a call that never returned
            HUNG.set()  # the hung functions return, giving their slots back
            await asyncio.sleep(0.1)
            assert (await box.call(call("hang", {}))).text == "returned"
    finally:
        HUNG.set()


async def test_hung_calls_of_one_python_tool_leave_threads_for_the_others():
    """Sync python tools ran on anyio's one limiter of 40 threads per loop: 40 hung calls of one tool (threads
    that run on past their timeout) left an unrelated tool none, and its calls timed out waiting for one."""
    HUNG.clear()
    specs = {"hang": PythonTool(function="tests.test_tools_servers:hangs", timeout_s=0.2, retries=0, concurrency=40),
             "count": PythonTool(function="tests.test_tools_servers:count_words", timeout_s=1.0, retries=0)}
    try:
        async with ToolBox.from_spec(specs) as box:
            hung = await box.call_many([call("hang", {}) for _ in range(40)])
            assert {r.error_kind for r in hung} == {"timeout"}
            counted = await box.call(call("count", {"text": "two words"}))
            assert (counted.status, counted.text) == ("ok", "2")  # before: timed out after 1 s, no thread free
    finally:
        HUNG.set()


async def test_a_python_tool_runs_as_many_threads_as_its_concurrency_past_forty():
    # its 41st call waited for one of anyio's 40 threads while its timeout ran: timed out at 0.3 + 0.3 s
    spec = PythonTool(function="tests.test_tools_servers:one_at_a_time", timeout_s=0.5, retries=0, concurrency=41)
    async with ToolBox.from_spec({"nap": spec}) as box:
        results = await box.call_many([call("nap", {"seconds": 0.3}) for _ in range(41)])
    assert [r.text for r in results] == ["slept"] * 41


async def test_a_python_tool_that_exits_is_its_own_error_and_the_box_goes_on():
    # SystemExit is no Exception: it went through the ToolBox, and in the tools stage Ray ended the actor with
    # it, so one bad call from the model lost the run its tools.
    async with ToolBox.from_spec({"count": PythonTool(function="tests.test_tools_servers:command_line")}) as box:
        refused = await box.call(call("count", {"line": "--n many"}))
        assert (refused.status, refused.error_kind) == ("model_error", "tool_error")
        assert refused.text == "Error: SystemExit: 2"
        assert (await box.call(call("count", {"line": "--n 3"}))).text == "3"


def test_restart_in_a_new_event_loop_after_close():
    """A stage that runs `asyncio.run` per step starts and closes the same ToolBox in each loop."""
    box = ToolBox.from_spec({"calc": CALC})

    async def step(expression: str) -> str:
        await box.start()
        try:
            return (await box.call(call("calculate", {"expression": expression}))).text
        finally:
            await box.close()

    assert asyncio.run(step("1+1")) == "2"
    assert asyncio.run(step("2+2")) == "4"
    assert box.metrics()["tools/calculate/calls"] == 2


# ------------------------------------------------------------------------------ streamable HTTP
@pytest.fixture(scope="module")
def http_server():
    """The faulty test server over streamable HTTP on a free 127.0.0.1 port, stopped at module end."""
    port = free_port()
    with run_http_server([sys.executable, "tests/tool_servers/faulty.py", "--http", str(port)], port, cwd=ROOT) as proc:
        yield f"http://127.0.0.1:{port}/mcp", proc


async def test_http_transport_calls_concurrently_and_sends_env_headers(http_server, monkeypatch):
    url, _ = http_server
    monkeypatch.setenv("FACTORY_TEST_TOKEN", "Bearer test")
    spec = HttpServer(url=url, headers_from_env={"Authorization": "FACTORY_TEST_TOKEN"}, timeout_s=10)
    async with ToolBox.from_spec({"web": spec}) as box:
        assert (await box.call(call("header", {"name": "Authorization"}))).text == "Bearer test"
        started = time.perf_counter()
        results = await box.call_many([call("echo", {"text": str(i), "delay_s": 0.3}) for i in range(20)])
        assert time.perf_counter() - started < 3.0  # twenty 0.3 s calls (6 s one at a time) overlap over HTTP too
        assert [r.text for r in results] == [str(i) for i in range(20)]
        error = await box.call(call("boom", {}))
        assert error.error_kind == "tool_error"


async def test_http_server_gone_is_an_infra_error(http_server):
    url, proc = http_server
    async with ToolBox.from_spec({"web": HttpServer(url=url, timeout_s=5, retries=0)}) as box:
        assert (await box.call(call("echo", {"text": "up"}))).status == "ok"
        proc.terminate()
        proc.wait(timeout=10)
        result = await box.call(call("echo", {"text": "down"}))
    assert result.status == "infra_error" and result.error_kind == "crash"


async def test_an_http_server_killed_during_a_call_is_a_crash():
    """The SDK says a response stream that ends with no answer as JSON-RPC error -32000 "SSE stream ended without a
    response": it was taken for the server's own answer (kind `transport`, the circuit told the server was alive,
    the dead session kept)."""
    port = free_port()
    with run_http_server([sys.executable, "tests/tool_servers/faulty.py", "--http", str(port)], port, cwd=ROOT) as proc:
        spec = HttpServer(url=f"http://127.0.0.1:{port}/mcp", timeout_s=10, retries=0)
        async with ToolBox.from_spec({"web": spec}) as box:
            in_flight = asyncio.ensure_future(box.call(call("sleep", {"seconds": 5})))
            await asyncio.sleep(0.5)
            proc.kill()
            proc.wait(timeout=10)
            result = await in_flight
            assert box._backends["web"]._replicas[0].connection is None  # taken as lost: a new session is opened
    assert result.status == "infra_error" and result.error_kind == "crash", result
    assert result.text == "Error: the session with tool server 'web' ended during the call."



async def test_answers_to_a_dropped_http_session_log_no_traceback(caplog):
    """A session taken as hung is dropped with calls in flight; their answers, or the server's end of their streams,
    then meet the session's closed read stream, which the SDK logged as "Error parsing SSE message" with a 14-line
    BrokenResourceError traceback: nothing failed to parse, and the user saw it in the middle of the run."""
    caplog.set_level(logging.DEBUG, logger="mcp.client.streamable_http")
    port = free_port()
    with run_http_server([sys.executable, "tests/tool_servers/faulty.py", "--http", str(port)], port, cwd=ROOT):
        spec = HttpServer(url=f"http://127.0.0.1:{port}/mcp", timeout_s=0.5, retries=0)
        async with ToolBox.from_spec({"web": spec}) as box:
            first = [asyncio.ensure_future(box.call(call("sleep", {"seconds": 1.2}))) for _ in range(3)]
            await asyncio.sleep(0.2)
            results = await asyncio.gather(*first, box.call(call("sleep", {"seconds": 1.2})))  # in flight at the drop
            assert [r.error_kind for r in results[:3]] == ["timeout"] * 3  # taken as hung: the session is dropped
            await asyncio.sleep(1.5)  # the late answers arrive
    said = [r for r in caplog.records if r.name == "mcp.client.streamable_http" and r.levelno > logging.DEBUG]
    assert not [r for r in said if r.exc_info or "SSE message" in r.getMessage()], [r.getMessage() for r in said]


async def test_a_restarted_http_server_gets_a_new_session():
    """An HTTP server that restarts no longer knows the session: it answers every call on it 404 "Session not
    found". That is a lost connection, not an answer: a new session is started, and the calls go on."""
    port = free_port()
    command = [sys.executable, "tests/tool_servers/faulty.py", "--http", str(port)]
    url = f"http://127.0.0.1:{port}/mcp"
    with run_http_server(command, port, cwd=ROOT) as first:
        async with ToolBox.from_spec({"web": HttpServer(url=url, timeout_s=5, retries=1)}) as box:
            assert (await box.call(call("echo", {"text": "up"}))).text == "up"
            first.terminate()
            first.wait(timeout=10)
            with run_http_server(command, port, cwd=ROOT):  # the same server again: our session is unknown to it
                results = [await box.call(call("echo", {"text": f"again {i}"})) for i in range(3)]
            assert [r.text for r in results] == ["again 0", "again 1", "again 2"]
            assert box.server_events()["web"]["restarts"] == 1


async def test_an_http_server_taken_as_hung_is_said_to_get_a_new_session(caplog):
    """Factory cannot restart a server it reaches by URL, only open a new session: the log said "taken as hung,
    restarted" and "tool server web restarted". (Its count keeps the metric's name: `tool_servers/web/restarts`.)"""
    port = free_port()
    with run_http_server([sys.executable, "tests/tool_servers/faulty.py", "--http", str(port)], port, cwd=ROOT):
        spec = HttpServer(url=f"http://127.0.0.1:{port}/mcp", timeout_s=0.5, retries=0)
        async with ToolBox.from_spec({"web": spec}) as box:
            hung = await box.call_many([call("sleep", {"seconds": 1}) for _ in range(3)])
            assert [r.error_kind for r in hung] == ["timeout"] * 3
            assert (await box.call(call("echo", {"text": "again"}))).text == "again"
            assert box.metrics()["tool_servers/web/restarts"] == 1
    said = [r.getMessage() for r in caplog.records if r.name == "factory.tools.servers"]
    assert ("tool server web answered none of its last 3 calls within timeout_s (0.5 s): taken as hung, its session "
            "dropped for a new one") in said
    assert "tool server web: a new session opened" in said
    assert not [m for m in said if "restart" in m], said


def token_server(port: int, token: str):
    """The faulty test server over streamable HTTP, answering HTTP 401 to a request without `token`."""
    argv = [sys.executable, "tests/tool_servers/faulty.py", "--http", str(port), "--token", token]
    return run_http_server(argv, port, cwd=ROOT)


@pytest.mark.parametrize("token,path,said", [
    ("Bearer wrong", "/mcp", "HTTP 401 Unauthorized: check the header(s) headers_from_env sets ($FACTORY_TEST_TOKEN)"),
    ("Bearer test", "/", "HTTP 404 Not Found: no MCP endpoint at this path (an MCPServer serves /mcp)"),
])
async def test_an_http_server_that_refuses_the_session_is_said_with_its_status(monkeypatch, token, path, said):
    """A token refused (HTTP 401), or a path with no MCP endpoint (404), was said "could not be reached: MCPError:
    Server returned an error response" ("Not Found"): no status, and the server had been reached; the guide then
    told the user to start it."""
    monkeypatch.setenv("FACTORY_TEST_TOKEN", token)
    port = free_port()
    with token_server(port, "Bearer test"):
        url = f"http://127.0.0.1:{port}{path}"
        spec = HttpServer(url=url, headers_from_env={"Authorization": "FACTORY_TEST_TOKEN"})
        with pytest.raises(ToolStartError) as failed:
            async with ToolBox.from_spec({"web": spec}):
                pass
    assert str(failed.value) == f"web: tool server 'web' at {url} was reached, but refused: it answered {said}"


async def test_a_token_refused_during_a_run_is_said_with_its_status(monkeypatch):
    """The token no longer accepted (the server restarted with another, or it expired): every call was "answered
    with error -32603: Server returned an error response", the SDK's words for any HTTP error status."""
    monkeypatch.setenv("FACTORY_TEST_TOKEN", "Bearer old")
    port = free_port()
    spec = HttpServer(url=f"http://127.0.0.1:{port}/mcp", headers_from_env={"Authorization": "FACTORY_TEST_TOKEN"},
                      retries=0)
    with token_server(port, "Bearer old") as first:
        async with ToolBox.from_spec({"web": spec}) as box:
            assert (await box.call(call("echo", {"text": "up"}))).text == "up"
            first.terminate()
            first.wait(timeout=10)
            with token_server(port, "Bearer new"):
                refused = await box.call(call("echo", {"text": "refused"}))
    assert refused.status == "infra_error"
    assert refused.text == ("Error: tool server 'web' refused the call: it answered HTTP 401 Unauthorized: check the "
                            "header(s) headers_from_env sets ($FACTORY_TEST_TOKEN)")


@pytest.mark.parametrize("status,headers,said", [
    (403, {}, "it answered HTTP 403 Forbidden: it wants credentials, which headers_from_env sends (none is set)"),
    (401, {"Authorization": "A", "X-Key": "B"}, "it answered HTTP 401 Unauthorized: check the header(s) "
                                                 "headers_from_env sets ($A, $B)"),
    (503, {"Authorization": "A"}, "it answered HTTP 503 Service Unavailable"),
])
def test_an_http_refusal_says_what_to_check(status, headers, said):
    assert refusal(status, headers) == said


# ------------------------------------------------------------------------ third-party from PyPI
@pytest.mark.skipif(
    not TIME_SERVER.exists(), reason="mcp-server-time is not installed: run bin/install-tool-servers (CI does)"
)
async def test_third_party_time_server():
    spec = StdioServer(command=str(TIME_SERVER.relative_to(ROOT)), args=["--local-timezone", "UTC"])
    async with ToolBox.from_spec({"time": spec, "calc": CALC}, base_dir=ROOT) as box:
        names = {s["function"]["name"] for s in box.schemas()}
        assert {"get_current_time", "convert_time", "calculate"} <= names
        now = await box.call(call("get_current_time", {"timezone": "UTC"}))
        assert now.status == "ok" and '"timezone": "UTC"' in now.text
        converted = await box.call(
            call("convert_time", {"source_timezone": "UTC", "time": "12:00", "target_timezone": "Asia/Tokyo"})
        )
        assert converted.status == "ok" and "21:00" in converted.text
        missing = await box.call(call("get_current_time", {}))
        assert missing.error_kind == "bad_arguments"
        wrong_zone = await box.call(call("get_current_time", {"timezone": "Mars/Olympus"}))
        assert wrong_zone.status == "model_error"


# --------------------------------------------------------------------------------------- helpers
def _children(pid: int) -> list[int]:
    """Live child processes of `pid` (Linux /proc), excluding zombies."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
