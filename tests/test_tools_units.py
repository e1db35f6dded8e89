"""Unit tests of the tools package's pure parts: truncation, naming, validation, breaker, metrics, schemas."""
from __future__ import annotations

import asyncio
import functools
import sys
from pathlib import Path

import pytest
from mcp import types as mcp_types

from factory.schema import PythonTool, StdioServer
from factory.tools.connection import ServerStartError, http_headers, stdio_parameters, unreadable_answer_id
from factory.tools.metrics import ToolMetrics
from factory.tools.resilience import CircuitBreaker, backoff_delay
from factory.tools.results import content_text, truncate_middle, value_text
from factory.tools.servers import function_schema
from factory.tools.toolbox import (
    ToolBox,
    allowed_only,
    ToolEntry,
    ToolStartError,
    argument_problem,
    compile_validator,
    offered_tools,
    routes,
)
from factory.types import ToolCall, ToolResult
from factory.util import import_object


# ------------------------------------------------------------------------------------- truncation
def test_truncate_keeps_short_text_unchanged():
    assert truncate_middle("hello", 5) == "hello"


def test_truncate_keeps_head_tail_and_marker_within_limit():
    text = "HEAD" + "x" * 10_000 + "TAIL"
    out = truncate_middle(text, 100)
    assert len(out) == 100
    head, marker, tail = out.split("\n")
    assert head.startswith("HEAD") and tail.endswith("TAIL")
    assert marker == f"...[{len(text) - len(head) - len(tail)} characters omitted]..."


def test_truncate_limit_smaller_than_marker_keeps_head_only():
    assert truncate_middle("abcdefghijklmnopqrstuvwxyz" * 10, 8) == "abcdefgh"


def test_truncate_keeps_a_text_of_exactly_the_limit_whole():
    # (at "hello", 5 a text cut wrongly comes back the same, its head alone; at 100 the cut puts a marker in it)
    assert truncate_middle("x" * 100, 100) == "x" * 100
    assert truncate_middle("x" * 101, 100) == "x" * 35 + "\n...[32 characters omitted]...\n" + "x" * 34


# ------------------------------------------------------------------------------------ result text
def test_content_text_joins_blocks_and_names_non_text():
    result = mcp_types.CallToolResult(
        content=[
            mcp_types.TextContent(type="text", text="a"),
            mcp_types.ImageContent(type="image", data="QUJD", mime_type="image/png"),
            mcp_types.TextContent(type="text", text="b"),
        ]
    )
    assert content_text(result) == "a\n[image: image/png, 4 base64 characters]\nb"


def test_content_text_falls_back_to_structured_content():
    result = mcp_types.CallToolResult(content=[], structured_content={"value": 3})
    assert content_text(result) == '{"value": 3}'
    # non-ASCII as it is, not as \u escapes the model would read (and pay tokens for)
    assert content_text(mcp_types.CallToolResult(content=[], structured_content={"city": "Zürich"})) == \
        '{"city": "Zürich"}'
    # only a fallback: a result with content shows its content (FastMCP sends both), not the JSON
    both = mcp_types.CallToolResult(content=[mcp_types.TextContent(type="text", text="3")], structured_content={"value": 3})
    assert content_text(both) == "3"


def test_content_text_shows_an_embedded_resources_text_and_names_the_rest():
    result = mcp_types.CallToolResult(content=[
        mcp_types.EmbeddedResource(type="resource", resource=mcp_types.TextResourceContents(uri="file:///a.txt",
                                                                                           text="inside")),
        mcp_types.EmbeddedResource(type="resource", resource=mcp_types.BlobResourceContents(uri="file:///b.bin",
                                                                                           blob="QUJD")),
        mcp_types.ResourceLink(type="resource_link", uri="file:///c", name="c"),
        mcp_types.AudioContent(type="audio", data="QUJDRA==", mime_type="audio/wav"),
    ])
    assert content_text(result) == ("inside\n[resource: file:///b.bin]\n[resource link: file:///c]\n"
                                    "[audio: audio/wav, 8 base64 characters]")


def test_value_text():
    assert value_text("x") == "x"
    assert value_text({"a": [1, 2]}) == '{"a": [1, 2]}'
    assert value_text({"city": "Zürich"}) == '{"city": "Zürich"}'  # not "Z\\u00fcrich"


# ----------------------------------------------------------------------------------------- naming
def test_unique_names_are_bare_and_clashes_are_qualified():
    schema = {"type": "object"}
    listings = {
        "calc": [("calculate", "", schema), ("now", "", schema)],
        "time": [("now", "", schema), ("convert", "", schema)],
    }
    offered = {(e.server, e.tool): e.offered for e in offered_tools(listings)}
    assert offered == {
        ("calc", "calculate"): "calculate",
        ("calc", "now"): "calc__now",
        ("time", "now"): "time__now",
        ("time", "convert"): "convert",
    }


def test_routes_accept_offered_and_qualified_names():
    entries = offered_tools({"calc": [("calculate", "", {"type": "object"})]})
    table = routes(entries)
    assert table["calculate"] is table["calc__calculate"]
    assert "now" not in table


def test_an_offered_name_wins_over_a_qualified_one_that_equals_it():
    """Server a's tool `b__c` is offered bare (unique); server b's tool `c` is also reachable as `b__c`: a call of
    the name the model was shown goes to the tool it was shown (a's), not to b's."""
    schema = {"type": "object"}
    table = routes(offered_tools({"a": [("b__c", "", schema)], "b": [("c", "", schema)]}))
    assert (table["b__c"].server, table["b__c"].tool) == ("a", "b__c")
    assert (table["c"].server, table["c"].tool) == ("b", "c")


def test_two_tools_offered_under_one_name_are_refused():
    """Servers a and c both have a tool b (offered `a__b` and `c__b`) and server x has a tool named `a__b`: two tools
    were offered to the model under one name, and a's b was reachable by none (`a__b` went to x's)."""
    schema = {"type": "object"}
    with pytest.raises(ToolStartError) as raised:
        offered_tools({"a": [("b", "", schema)], "c": [("b", "", schema)], "x": [("a__b", "", schema)]})
    assert str(raised.value) == (
        "tools a.b and x.a__b would both be offered to the model as 'a__b' (a tool's name is `server__tool` when "
        "another server has a tool of that name too): rename one, or leave one out with allowed_tools")


def test_a_tool_a_server_lists_twice_is_offered_once_with_a_warning(caplog):
    """The name-clash refusal took a server that lists one tool twice (its own bug, or a repeated page) for two tools,
    and told the user to rename one: no rename or allowed_tools could part them, and such a server used to start."""
    schema = {"type": "object"}
    with caplog.at_level("WARNING", logger="factory.tools.toolbox"):
        entries = offered_tools({"s": [("t", "first", schema), ("u", "", schema), ("t", "again", schema)]})
    assert [(e.offered, e.description) for e in entries] == [("t", "first"), ("u", "")]
    assert "tool server s lists t more than once: offered once, as first listed" in caplog.text


def test_allowed_tools_keeps_only_the_tools_it_names():
    """`allowed_tools` is how a spec keeps a server's other tools (a `delete`, a `shell`) from the model: they are
    neither offered nor routed. (The calculator server of the tools tests has one tool: keeping all passed.)"""
    tools = [("read", "", {}), ("delete", "", {}), ("list", "", {})]
    assert allowed_only("fs", tools, ["list", "read"], "the server has") == [("read", "", {}), ("list", "", {})]
    assert allowed_only("fs", tools, None, "the server has") == tools


def test_server_name_with_separator_is_rejected():
    with pytest.raises(ValueError, match="must not contain '__'"):
        ToolBox.from_spec({"my__calc": StdioServer(command="python")})


# ------------------------------------------------------------------------------------- validation
SCHEMA = {
    "type": "object",
    "properties": {"expression": {"type": "string"}, "digits": {"type": "integer", "minimum": 0}},
    "required": ["expression"],
}


def _validator(schema=SCHEMA):
    return compile_validator(ToolEntry("t", "s", "t", "", schema))


def test_valid_arguments_pass():
    assert argument_problem(_validator(), {"expression": "1+1", "digits": 2}) is None


@pytest.mark.parametrize(
    "arguments, expected",
    [
        ({}, "'expression' is a required property"),
        ({"expression": 3}, "3 is not of type 'string' (at expression)"),
        ({"expression": "1", "digits": -1}, "-1 is less than the minimum of 0 (at digits)"),
        (["1+1"], "expected a JSON object of arguments, got list"),
    ],
)
def test_invalid_arguments_are_explained(arguments, expected):
    assert argument_problem(_validator(), arguments) == expected


def test_invalid_schema_is_not_enforced(caplog):
    validator = _validator({"type": "object", "properties": {"x": {"type": 12}}})
    assert validator is None
    assert argument_problem(validator, {"x": "anything"}) is None
    # the warning names the server (it named only the tool, which several servers may have)
    assert "tool server 's': tool 't' has an invalid inputSchema, its arguments are not checked" in caplog.text


def test_a_schema_whose_ref_resolves_nowhere_is_not_enforced(caplog):
    """`{"$ref": "#/$defs/Query"}` without the definition passes check_schema, then raised out of the checker at
    every call: each call to the tool was an infrastructure crash, its trajectory dropped, the call unrecorded."""
    from factory.tools.toolbox import ToolEntry

    async def run() -> list:
        async with ToolBox.from_spec({"t": PythonTool(function="tests.test_tools_units:word_count")}) as box:
            (name,) = box._validators
            box._validators[name] = compile_validator(ToolEntry(name, "t", name, "", {
                "type": "object", "properties": {"text": {"$ref": "#/$defs/Query"}}, "required": ["text"]}))
            return [await box.call(ToolCall(name, {"text": "two words"}, raw="")) for _ in range(2)]

    results = asyncio.run(run())
    assert [(r.status, r.text) for r in results] == [("ok", "2")] * 2
    assert caplog.text.count("inputSchema cannot be applied, its arguments are not checked") == 1  # once


def test_one_call_nested_too_deep_for_a_recursive_schema_leaves_the_check_on(caplog):
    """A tree-shaped inputSchema is checked by recursion, level by level: one call nested 400 deep ran out of stack,
    was taken for a schema that cannot be applied, and switched the tool's check off for the rest of the run."""
    tree = {"type": "object", "properties": {"text": {"$ref": "#/$defs/tree"}}, "required": ["text"],
            "$defs": {"tree": {"type": "array", "items": {"$ref": "#/$defs/tree"}}}}
    deep: list = []
    for _ in range(400):
        deep = [deep]

    async def run() -> list:
        async with ToolBox.from_spec({"t": PythonTool(function="tests.test_tools_units:word_count")}) as box:
            (name,) = box._validators
            box._validators[name] = compile_validator(ToolEntry(name, "t", name, "", tree))
            results = [await box.call(ToolCall(name, arguments, raw="")) for arguments in
                       ({"text": deep}, {"text": "a string, not a tree"})]
            # a schema that recurses without end runs out of stack at any depth: still its own fault, not enforced
            box._validators[name] = compile_validator(ToolEntry(name, "t", name, "", {"$ref": "#"}))
            return results + [await box.call(ToolCall(name, {"text": "two words"}, raw=""))]

    nested, flat, endless = asyncio.run(run())
    assert (nested.status, nested.error_kind, nested.text) == (
        "model_error", "bad_arguments", "Error: invalid arguments for t: nested too deeply (more than 64 levels).")
    assert (flat.error_kind, flat.text) == ("bad_arguments", "Error: invalid arguments for t: 'a string, not a tree' "
                                                             "is not of type 'array' (at text)")
    assert (endless.status, endless.text) == ("ok", "2")
    assert caplog.text.count("inputSchema cannot be applied, its arguments are not checked") == 1  # the endless one


# ---------------------------------------------------------------------------------------- breaker
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_threshold_and_probes_after_cooldown():
    clock = FakeClock()
    breaker = CircuitBreaker(threshold=3, cooldown_s=5.0, clock=clock)
    assert [breaker.record_failure() for _ in range(3)] == [False, False, True]
    assert breaker.state == "open" and not breaker.allow()
    clock.now = 5.0
    assert breaker.allow()  # the probe
    assert not breaker.allow()  # only one probe at a time
    assert breaker.record_failure()  # the probe failed: open again for a full cooldown
    clock.now = 9.0
    assert not breaker.allow()
    clock.now = 10.0
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state == "closed" and breaker.allow()


def test_breaker_success_resets_the_count():
    breaker = CircuitBreaker(threshold=2, cooldown_s=1.0, clock=FakeClock())
    breaker.record_failure()
    breaker.record_success()
    assert not breaker.record_failure()
    assert breaker.state == "closed"


def test_breaker_released_probe_lets_another_through():
    clock = FakeClock()
    breaker = CircuitBreaker(threshold=1, cooldown_s=1.0, clock=clock)
    breaker.record_failure()
    clock.now = 1.0
    assert breaker.allow() and not breaker.allow()
    breaker.release_probe()
    assert breaker.allow()


def test_a_recovered_breaker_counts_to_its_threshold_again():
    """After a probe succeeded the breaker is as new: it opens on the threshold's failure, not on the next one (a
    probe flag left set made the first failure after a recovery open it)."""
    clock = FakeClock()
    breaker = CircuitBreaker(threshold=3, cooldown_s=5.0, clock=clock)
    assert [breaker.record_failure() for _ in range(3)] == [False, False, True]
    clock.now = 5.0
    assert breaker.allow()  # the probe
    breaker.record_success()
    assert [breaker.record_failure() for _ in range(3)] == [False, False, True]


def test_failures_while_open_do_not_reopen_the_circuit():
    """A failure reported while the circuit is already open (another replica's calls in flight when it opened) is no
    new opening: it does not count as one in `circuit_opens`, nor push the probe a full cooldown away."""
    clock = FakeClock()
    breaker = CircuitBreaker(threshold=2, cooldown_s=5.0, clock=clock)
    assert [breaker.record_failure() for _ in range(2)] == [False, True]  # opened at 0
    clock.now = 3.0
    assert not breaker.record_failure() and breaker.state == "open"
    clock.now = 5.0
    assert breaker.state == "half_open" and breaker.allow()  # 5 s after it opened, not after the late failure


def test_backoff_doubles_caps_and_jitters_within_half():
    assert backoff_delay(0, 0.1, 2.0, rng=lambda: 1.0) == pytest.approx(0.1)
    assert backoff_delay(3, 0.1, 2.0, rng=lambda: 1.0) == pytest.approx(0.8)
    assert backoff_delay(10, 0.1, 2.0, rng=lambda: 1.0) == pytest.approx(2.0)
    assert backoff_delay(3, 0.1, 2.0, rng=lambda: 0.0) == pytest.approx(0.4)


# ---------------------------------------------------------------------------------------- metrics
def test_metrics_count_each_kind_and_reset():
    metrics = ToolMetrics()
    metrics.record("calc", ToolResult("calc", "1", latency_s=0.1))
    metrics.record("calc", ToolResult("calc", "e", status="model_error", error_kind="bad_arguments", latency_s=0.2))
    metrics.record("calc", ToolResult("calc", "e", status="infra_error", error_kind="timeout", latency_s=0.3))
    metrics.record(None, ToolResult("nope", "e", status="model_error", error_kind="unknown_tool"))
    metrics.server_event("srv", "restarts")
    snap = metrics.snapshot(reset=True)
    assert snap["tools/calc/calls"] == 3
    assert snap["tools/calc/model_errors"] == 1
    assert snap["tools/calc/infra_errors"] == 1
    assert snap["tools/calc/timeouts"] == 1
    assert snap["tools/calc/errors"] == 2
    assert snap["tools/calc/latency_s_p50"] == pytest.approx(0.2)
    assert snap["tools/calc/latency_s_p95"] == pytest.approx(0.29)
    assert snap["tools/calls"] == 4 and snap["tools/model_errors"] == 2 and snap["tools/infra_errors"] == 1
    assert snap["tool_servers/srv/restarts"] == 1
    assert not any(k.startswith("tools/nope") for k in snap)
    empty = {"tools/calls": 0.0, "tools/model_errors": 0.0, "tools/infra_errors": 0.0, "tools/timeouts": 0.0}
    assert metrics.snapshot() == empty


# ---------------------------------------------------------------------------- transports, schemas
def test_stdio_parameters_resolve_python_and_relative_paths(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    spec = StdioServer(command="python", args=["-m", "x"], cwd="sub", env={"A": "1"})
    params = stdio_parameters(spec, tmp_path)
    assert params.command == sys.executable
    assert params.cwd == str(tmp_path / "sub")
    assert params.env == {"A": "1"}
    venv_cmd = stdio_parameters(StdioServer(command=".venvs/srv/bin/srv"), tmp_path).command
    assert venv_cmd == str(tmp_path / ".venvs/srv/bin/srv")
    assert stdio_parameters(StdioServer(command="uvx"), tmp_path).command == "uvx"


def test_a_python_server_sees_factorys_pythonpath_and_a_foreign_one_does_not(tmp_path: Path, monkeypatch):
    # the SDK passes only HOME, PATH, ...: a checkout run from PYTHONPATH (not installed) found no
    # `factory.examples.calculator` in its own tool server (seen on a GPU machine with carried wheels)
    monkeypatch.setenv("PYTHONPATH", "/repo:/site")
    assert stdio_parameters(StdioServer(command="python", args=["-m", "x"]), tmp_path).env == {"PYTHONPATH": "/repo:/site"}
    own = StdioServer(command="python3", env={"PYTHONPATH": "/mine"})
    assert stdio_parameters(own, tmp_path).env == {"PYTHONPATH": "/mine"}  # the spec's own wins
    assert stdio_parameters(StdioServer(command="uvx", args=["srv"]), tmp_path).env is None  # its own venv
    # the interpreter named by its path (bench/agentic.py writes sys.executable into its spec): seen on the GPU
    # machine, whose tool server found no pydantic from the carried wheels
    by_path = stdio_parameters(StdioServer(command=sys.executable, args=["srv.py"]), tmp_path)
    assert by_path.env == {"PYTHONPATH": "/repo:/site"}


def test_http_headers_come_from_the_environment():
    assert http_headers({"Authorization": "TOKEN"}, {"TOKEN": "Bearer x"}) == {"Authorization": "Bearer x"}
    with pytest.raises(ServerStartError, match="TOKEN"):
        http_headers({"Authorization": "TOKEN"}, {})


def _refused(line: str) -> Exception:
    """The error the SDK's parser hands on for a line of a server's stdout."""
    try:
        mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False)
    except ValueError as exc:
        return exc
    raise AssertionError(f"the SDK read {line!r}")


def test_the_request_an_unreadable_answer_answers_is_read_where_it_can_be():
    half = '"text": "cut: \\ud83d"'  # a lone surrogate escape: the SDK's parser refuses the whole line
    assert unreadable_answer_id(_refused('{"jsonrpc": "2.0", "id": 7, "result": {%s}}' % half)) == 7
    error = '{"jsonrpc": "2.0", "id": "a", "error": {"code": 1, "message": "\\ud83d"}}'
    assert unreadable_answer_id(_refused(error)) == "a"
    assert unreadable_answer_id(_refused('{"jsonrpc": "2.0", "id": 7, "result": "not an object"}')) == 7
    # the server's own request: its id is the server's, not one of ours
    request = '{"jsonrpc": "2.0", "id": 7, "method": "x", "params": {%s}}' % half
    assert unreadable_answer_id(_refused(request)) is None
    assert unreadable_answer_id(_refused('{"jsonrpc": "2.0", "id": true, "result": {%s}}' % half)) is None
    assert unreadable_answer_id(_refused('{"jsonrpc": "2.0", "result": {%s}}' % half)) is None
    assert unreadable_answer_id(_refused("hello")) is None  # a print(): no JSON at all
    assert unreadable_answer_id(ValueError("not the parser's")) is None
    # nested past Python's parser too: its RecursionError, raised in the SDK's receive loop, ended the session
    # with nothing said, and every later call of that server waited for its timeout
    deep = '{"jsonrpc": "2.0", "id": 7, "result": {"content": %s}}' % ("[" * 100_000 + "]" * 100_000)
    assert unreadable_answer_id(_refused(deep)) is None


def word_count(text: str, min_length: int = 1) -> int:
    """Count the words of a text.

    Args:
        text: The text to count words in.
        min_length: Only words at least this long count.
    """
    return sum(len(w) >= min_length for w in text.split())


def test_function_schema_from_hints_and_docstring():
    schema = function_schema(word_count, "count")
    assert schema == {
        "type": "function",
        "function": {
            "name": "count",
            "description": "Count the words of a text.",
            "parameters": {
                "type": "object",
                "properties": {
                    "text": {"type": "string", "description": "The text to count words in."},
                    "min_length": {"type": "integer", "description": "Only words at least this long count."},
                },
                "required": ["text"],
            },
        },
    }


class WordCounter:
    """Counts words, each worth `weight`."""

    def __init__(self, weight: int) -> None:
        self.weight = weight

    def __call__(self, text: str, min_length: int = 1) -> int:
        """Count the words of a text.

        Args:
            text: The text to count words in.
            min_length: Only words at least this long count.
        """
        return self.weight * word_count(text, min_length)


def weighted_count(weight: int, text: str, min_length: int = 1, *, skip: str = "") -> int:
    """Count the words of a text.

    Args:
        weight: What each word is worth.
        text: The text to count words in.
        min_length: Only words at least this long count.
        skip: A word not counted.
    """
    return weight * word_count(" ".join(w for w in text.split() if w != skip), min_length)


count_twice = WordCounter(2)
count_thrice = functools.partial(weighted_count, 3, skip="the")


@pytest.mark.parametrize("ref", ["count_twice", "count_thrice"])
def test_a_callable_object_or_partial_is_described_by_what_calling_it_takes(ref):
    """A python tool that is an instance with `__call__`, or a functools.partial, failed as the tools stage
    started: transformers reads the type hints of functions only ("... is not a module, class, method, or
    function"). Its schema is now its `__call__`'s (without self), or the partial's function's without the
    arguments it binds; and it is called as the model asks."""
    assert function_schema(globals()[ref], "count") == function_schema(word_count, "count")

    async def run() -> ToolResult:
        async with ToolBox.from_spec({"count": PythonTool(function=f"tests.test_tools_units:{ref}")}) as box:
            assert box.schemas() == [function_schema(word_count, "count")]
            return await box.call(ToolCall("count", {"text": "the cat sat", "min_length": 3}, raw=""))

    result = asyncio.run(run())
    assert (result.status, result.text) == ("ok", "6")  # 3 words, 2 each; or "the" skipped, 2 words 3 each


def test_load_function_by_import_path():
    assert import_object("tests.test_tools_units:word_count") is word_count
    with pytest.raises(ValueError, match="module:function"):
        import_object("tests.test_tools_units.word_count")


def test_a_python_tool_imports_as_the_compiler_checked_it_from_the_working_directory(tmp_path, monkeypatch):
    """`factory check` imports `tools.NAME.function` from the working directory only; the tools stage also
    looked in the spec's folder (and left it at the front of sys.path), so the two disagreed on what a spec
    may name, and the stage's extra rule was never reached past the check."""
    spec_dir = tmp_path / "conf"
    spec_dir.mkdir()
    (spec_dir / "beside_spec_tools.py").write_text("def echo(text: str) -> str:\n    return text\n")
    monkeypatch.chdir(tmp_path)
    box = ToolBox.from_spec({"t": PythonTool(function="beside_spec_tools:echo")}, base_dir=spec_dir)
    with pytest.raises(ToolStartError, match="no module named 'beside_spec_tools'"):
        asyncio.run(box.start())
    assert str(spec_dir) not in sys.path


def test_from_spec_has_no_side_effects_and_start_names_the_failure():
    box = ToolBox.from_spec({"gone": PythonTool(function="no_such_module_xyz:fn")})  # nothing imported yet
    assert "no_such_module_xyz" not in sys.modules
    with pytest.raises(ToolStartError,
                       match="gone: cannot import 'no_such_module_xyz:fn': no module named 'no_such_module_xyz'"):
        asyncio.run(box.start())


class FakeBackend:
    """A started server's stand-in: answers `<tool> answered`, or raises (a bug of ours below the ToolBox)."""

    def __init__(self, fails: bool | BaseException = False) -> None:
        self.fails = fails

    async def call(self, tool, arguments):
        if self.fails:
            raise self.fails if isinstance(self.fails, BaseException) else RuntimeError("a bug")
        return ToolResult(tool, f"{tool} answered")

    async def close(self) -> None:
        pass


def _fake_box(listings: dict[str, list[str]], fails: bool | BaseException = False) -> ToolBox:
    """A running ToolBox over fake backends: server -> its tool names."""
    box = ToolBox.from_spec({name: PythonTool(function="tests.test_tools_units:word_count") for name in listings})
    box._backends = {name: FakeBackend(fails) for name in listings}
    box._offer({name: [(tool, "", {"type": "object"}) for tool in tools] for name, tools in listings.items()})
    box._running = True
    return box


def test_a_clashing_tools_answer_and_listing_carry_the_name_it_is_offered_as():
    """Two servers with a tool `now`: each is offered, answered and listed as `<server>__now` (the server itself knows
    it as `now`, the name its answer came back with), so the model's tool message and the per-tool metrics say which."""
    box = _fake_box({"calc": ["now"], "time": ["now", "convert"]})
    results = asyncio.run(box.call_many([ToolCall("time__now", {}, raw=""), ToolCall("convert", {}, raw="")]))
    assert [(r.status, r.tool, r.text) for r in results] == [("ok", "time__now", "now answered"),
                                                            ("ok", "convert", "convert answered")]
    assert box.metrics()["tools/time__now/calls"] == 1
    assert box.tool_listing()["time"] == [
        {"name": "now", "offered_as": "time__now", "description": "", "inputSchema": {"type": "object"}},
        {"name": "convert", "offered_as": "convert", "description": "", "inputSchema": {"type": "object"}}]


def test_a_backend_that_raises_is_an_infra_error_not_the_models():
    """A bug of ours below the ToolBox must not train the model away from a tool it called correctly."""
    result = asyncio.run(_fake_box({"calc": ["add"]}, fails=True).call(ToolCall("add", {}, raw="")))
    assert (result.status, result.error_kind, result.text) == (
        "infra_error", "transport", "Error: the call to add failed (RuntimeError).")


def test_a_cancelled_error_a_backend_raises_of_its_own_is_an_infra_error_and_a_cancelled_call_still_raises():
    """A CancelledError raised below the ToolBox, with no one cancelling the call, went through it as if the
    episode's deadline had cut the call, and ended the whole rollout."""
    box = _fake_box({"calc": ["add"]}, fails=asyncio.CancelledError("an inner task of the client"))
    result = asyncio.run(box.call(ToolCall("add", {}, raw="")))
    assert (result.status, result.error_kind, result.text) == (
        "infra_error", "transport", "Error: the call to add failed (CancelledError).")

    async def cancelled() -> None:  # the deadline's cancellation of the call is raised on, as before
        slow = _fake_box({"calc": ["add"]})
        slow._backends["calc"].call = lambda tool, arguments: asyncio.sleep(10)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(slow.call(ToolCall("add", {}, raw="")), 0.05)

    asyncio.run(cancelled())


def test_a_box_that_is_not_running_answers_infra_errors():
    """Not started (or closed): every call is ours to answer for, not the model's "unknown tool"."""
    box = ToolBox.from_spec({"count": PythonTool(function="tests.test_tools_units:word_count")})
    result = asyncio.run(box.call(ToolCall("count", {"text": "a b"}, raw="")))
    assert (result.status, result.error_kind) == ("infra_error", "transport")


RAISED = []


def always_raises(text: str) -> str:
    """Refuse every text, counting the calls.

    Args:
        text: Anything.
    """
    RAISED.append(text)
    raise ValueError(f"no {text}")


def test_a_python_tool_that_raises_is_called_once_whatever_its_retries():
    """The tool's own error is the model's to read, not an infrastructure failure to retry: a retried one ran the
    function (and its side effects) retries + 1 times, and the caller waited through the backoffs."""
    RAISED.clear()

    async def run() -> ToolResult:
        spec = PythonTool(function="tests.test_tools_units:always_raises", retries=2)
        async with ToolBox.from_spec({"refuse": spec}) as box:
            return await box.call(ToolCall("refuse", {"text": "x"}, raw=""))

    result = asyncio.run(run())
    assert (result.status, result.error_kind, result.text) == ("model_error", "tool_error", "Error: ValueError: no x")
    assert RAISED == ["x"]
