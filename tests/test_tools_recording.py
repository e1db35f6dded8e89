"""Record, replay and cache at the ToolBox's seam (factory.tools.recording), with a python tool whose
answers change from call to call (tests/tool_servers/drifting.py): recorded rows, a replay that answers
exactly what was recorded without calling the tool, misses (fail or live), reward-node calls in order, the
cross-run cache (the tool_calls table through MLflow: tests/test_tracking.py::test_mlflow_run_roundtrip). A
real replayed run (the same trajectories, bit-for-bit weights): test_a_replayed_run_repeats_the_recorded_one
(slow)."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from factory.schema import PythonTool, StdioServer
from factory.tools.recording import Replay, ToolCache, canonical
from factory.tools.toolbox import ToolBox, ToolStartError
from factory.types import ToolCall
from tests.tool_servers import drifting

REPO = Path(__file__).resolve().parents[1]
TOOL = {"calculate": PythonTool(function="tests.tool_servers.drifting:answer")}
CACHED = {"calculate": PythonTool(function="tests.tool_servers.drifting:answer", cache=True)}


def call(expr: str, origin: str = "") -> ToolCall:
    return ToolCall("calculate", {"expression": expr}, raw="", origin=origin)


async def _calls(box: ToolBox, calls: list[ToolCall]) -> list:
    async with box:
        return [await box.call(c) for c in calls]


def test_record_then_replay_answers_what_was_recorded_without_calling_the_tool():
    calls = [call("2+3", "train/1/0/0/0/0/0"), call("2+3", "train/1/0/0/1/0/0"), call("7*6", "eval/0/0/1/0/0/0")]
    box = ToolBox.from_spec(TOOL, base_dir=REPO, record=True)
    live = asyncio.run(_calls(box, calls))
    assert [r.text.split(" [")[0] for r in live] == ["5", "5", "42"] and live[0].text != live[1].text  # it drifts
    rows = box.recorder.take()
    assert [(r["origin"], r["server"], r["tool"], r["arguments"], r["status"], r["source"]) for r in rows] == [
        (c.origin, "calculate", "calculate", canonical(c.arguments), "ok", "live") for c in calls]
    assert [r["text"] for r in rows] == [r.text for r in live] and all(r["latency_s"] >= 0 for r in rows)
    assert box.recorder.take() == []  # taken once

    before = drifting.calls_so_far()
    replayed = ToolBox.from_spec(TOOL, base_dir=REPO, record=True)
    replayed.replay = Replay(rows, "fail")
    again = asyncio.run(_calls(replayed, list(reversed(calls))))  # in another order: matched by origin
    assert [r.text for r in again] == [r.text for r in reversed(live)]
    assert all(r.status == "ok" and r.tool == "calculate" for r in again)
    assert drifting.calls_so_far() == before  # the tool was never called
    assert {r["source"] for r in replayed.recorder.take()} == {"replay"}  # a replayed run records too


async def nap(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long to sleep.
    """
    await asyncio.sleep(seconds)
    return "rested"


def test_a_call_the_episodes_deadline_cancels_is_recorded():
    """Cancelled after it reached the tool, the call left no row, though every call that reaches a tool is
    recorded (docs/tools.md); it is recorded as the agent loop answers it."""
    box = ToolBox.from_spec({"nap": PythonTool(function="tests.test_tools_recording:nap")}, record=True)

    async def cut_short() -> None:
        async with box:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(box.call(ToolCall("nap", {"seconds": 5.0}, raw="", origin="train/1/0/0/0/0/0")),
                                       0.2)

    asyncio.run(cut_short())
    (row,) = box.recorder.take()
    assert (row["origin"], row["tool"], row["status"], row["error_kind"], row["source"]) == (
        "train/1/0/0/0/0/0", "nap", "infra_error", "episode_timeout", "live")
    assert row["text"] == "Error: the episode ran out of time." and 0.15 < row["latency_s"] < 1.0


def test_a_call_the_episodes_deadline_cuts_is_counted_in_the_tools_metrics():
    """The tools stage's client counted the calls that came back, and one the deadline cancels comes back with
    nothing: a tool whose calls all outlast the episode's deadline was in no tools/* metric (they exist to show it)."""
    from factory.rollout.agent import call_tool
    from factory.tools.client import ToolsClient

    box = ToolBox.from_spec({"nap": PythonTool(function="tests.test_tools_recording:nap")})

    async def cut_short() -> dict:
        async with box:
            client = ToolsClient(box)  # a tools stage in process, as tests hand it
            await client.start()
            cut = ToolCall("nap", {"seconds": 5.0}, raw="", origin="train/1/0/0/0/0/0")
            with pytest.raises(asyncio.TimeoutError):  # what run_trajectory's in_time does at the deadline
                await asyncio.wait_for(asyncio.gather(call_tool(client, cut)), 0.2)
            return (await client.take_metrics()).snapshot()

    taken = asyncio.run(cut_short())
    assert (taken["tools/nap/calls"], taken["tools/nap/infra_errors"], taken["tools/infra_errors"]) == (1, 1, 1)
    assert 0.15 < taken["tools/nap/latency_s_p50"] < 1.0


def test_a_miss_fails_the_call_or_goes_live():
    rows = [{"origin": "train/1/0/0/0/0/0", "server": "calculate", "tool": "calculate",
             "arguments": canonical({"expression": "2+3"}), "text": "5 [recorded]", "status": "ok",
             "error_kind": None, "latency_s": 0.1, "source": "live"}]
    # the same place with other arguments, and a place the recording never saw
    missing = [call("2+4", "train/1/0/0/0/0/0"), call("2+3", "train/9/0/0/0/0/0")]
    box = ToolBox.from_spec(TOOL, base_dir=REPO)
    box.replay = Replay(rows, "fail")
    failed = asyncio.run(_calls(box, missing))
    assert [(r.status, r.error_kind) for r in failed] == [("infra_error", "replay_miss")] * 2
    assert box.replay.misses == ['calculate({"expression":"2+4"}) at train/1/0/0/0/0/0',
                                 'calculate({"expression":"2+3"}) at train/9/0/0/0/0/0']
    box = ToolBox.from_spec(TOOL, base_dir=REPO)
    box.replay = Replay(rows, "live")
    live = asyncio.run(_calls(box, missing))
    assert [r.text.split(" [")[0] for r in live] == ["6", "5"] and len(box.replay.misses) == 2


def test_calls_without_an_origin_take_the_recorded_answers_in_order():
    rows = [{"origin": "", "server": "calculate", "tool": "calculate", "arguments": canonical({"expression": "1+1"}),
             "text": f"2 [recorded {i}]", "status": "ok", "error_kind": None, "latency_s": 0.0, "source": "live"}
            for i in (1, 2)]
    box = ToolBox.from_spec(TOOL, base_dir=REPO)
    box.replay = Replay(rows, "fail")
    got = asyncio.run(_calls(box, [call("1+1"), call("1+1"), call("1+1")]))
    assert [r.text for r in got[:2]] == ["2 [recorded 1]", "2 [recorded 2]"] and got[2].error_kind == "replay_miss"


def test_a_reward_call_is_answered_by_its_origin_and_from_an_older_recording_in_order():
    """A tool reward node's call carries its place (factory.tools.recording.reward_origin) and gets the answer
    recorded there, whichever steps are replayed and in whatever order. A recording made before reward calls had
    origins holds them with none: they still answer reward calls in order, as they did then, so that run stays
    rescorable; a rollout's call never takes one of them."""
    def row(origin, text):
        return {"origin": origin, "server": "grade", "tool": "grade", "arguments": canonical({"text": "3"}),
                "text": text, "status": "ok", "error_kind": None, "latency_s": 0.0, "source": "live"}

    def ask(replay, origin):
        answer = replay.answer(ToolCall("grade", {"text": "3"}, raw="", origin=origin), "grade", "grade")
        return answer and answer.text

    step = {n: f"reward/train/{n}/0/0/0/graded" for n in (1, 3)}  # (reward_origin's, checked below)
    replay = Replay([row(step[1], "step 1's"), row(step[3], "step 3's")], "fail")
    assert [ask(replay, step[3]), ask(replay, step[1])] == ["step 3's", "step 1's"]
    assert ask(replay, "reward/eval/3/0/0/0/graded") is None  # not recorded: a miss, not another's answer
    old = Replay([row("", "first"), row("", "second")], "fail")
    assert ask(old, "train/1/0/0/0/0/0") is None
    assert [ask(old, step[3]), ask(old, step[1]), ask(old, step[1])] == ["first", "second", None]
    assert old.misses == ['grade({"text":"3"}) at train/1/0/0/0/0/0',
                          'grade({"text":"3"}) at reward/train/1/0/0/0/graded']

    from factory.tools.recording import reward_origin

    assert reward_origin("train/1/0/0/0", "graded") == step[1]
    assert reward_origin("eval/3/0/2/0", "each", 4) == "reward/eval/3/0/2/0/each/4"  # a per-turn node's, at turn 4
    assert reward_origin("", "graded") == ""  # a trajectory whose place is not known (an older table's)
    # and the spec reference says so (it said "by tool and arguments, in order", the older recordings' way)
    from factory.schema import ReplaySpec

    assert "by their trajectory's place and the node" in " ".join(ReplaySpec.model_fields["run"].description.split())


GONE = {"calc": StdioServer(command=sys.executable, args=["-m", "factory.examples.no_such_server"])}
CALC_LISTING = {"calc": [{"name": "calculate", "offered_as": "calculate", "description": "Evaluate arithmetic.",
                          "inputSchema": {"type": "object", "properties": {"expression": {"type": "string"}},
                                          "required": ["expression"]}}]}
RECORDED = [{"origin": "train/1/0/0/0/0/0", "server": "calc", "tool": "calculate",
             "arguments": canonical({"expression": "2+3"}), "text": "5 [recorded]", "status": "ok", "error_kind": None,
             "latency_s": 0.1, "source": "live"}]


def test_a_replay_that_fails_on_a_miss_starts_no_server():
    """A run whose tool server is down or gone can be replayed: under on_miss fail no call reaches a server, so
    none is started; the tools are offered as the recorded run listed them, and their schemas still check calls."""
    box = ToolBox.from_spec(GONE, base_dir=REPO)
    box.replay = Replay(RECORDED, "fail", CALC_LISTING)
    got = asyncio.run(_calls(box, [call("2+3", "train/1/0/0/0/0/0"), call("2+3", "train/2/0/0/0/0/0"),
                                   ToolCall("calculate", {"expr": "1"}, raw="", origin="train/3/0/0/0/0/0")]))
    assert [(r.text, r.status, r.error_kind) for r in got[:2]] == [
        ("5 [recorded]", "ok", None),
        ("Error: the replayed run has no answer for this call to calculate.", "infra_error", "replay_miss")]
    assert got[2].error_kind == "bad_arguments"
    assert box.tool_listing() == CALC_LISTING and box.schemas()[0]["function"]["name"] == "calculate"
    # on_miss live calls the tools for what the recording lacks: the servers are started, and this one cannot be
    live = ToolBox.from_spec(GONE, base_dir=REPO)
    live.replay = Replay(RECORDED, "live", CALC_LISTING)
    with pytest.raises(ToolStartError, match="calc: tool server 'calc' failed to start"):
        asyncio.run(live.start())


def test_a_replay_without_a_server_names_what_the_recording_cannot_offer():
    added = ToolBox.from_spec({**GONE, "search": StdioServer(command="search-server")}, base_dir=REPO)
    added.replay = Replay(RECORDED, "fail", CALC_LISTING)
    with pytest.raises(ToolStartError, match=r"^search: the replayed run had no tool server of this name, so its "
                                             r"tools are not known without starting it; remove it from the spec, or "
                                             r"set replay.on_miss=live"):
        asyncio.run(added.start())
    narrowed = ToolBox.from_spec({"calc": GONE["calc"].model_copy(update={"allowed_tools": ["solve"]})}, base_dir=REPO)
    narrowed.replay = Replay(RECORDED, "fail", CALC_LISTING)
    with pytest.raises(ToolStartError, match=r"^calc: allowed_tools names unknown tool\(s\) \['solve'\]; the "
                                             r"replayed run's server offered: calculate$"):
        asyncio.run(narrowed.start())


def test_malformed_calls_are_answered_live_not_replayed():
    box = ToolBox.from_spec(TOOL, base_dir=REPO)
    box.replay = Replay([], "fail")
    (bad,) = asyncio.run(_calls(box, [ToolCall("calculate", {"expr": "1"}, raw="", origin="train/1/0/0/0/0/0")]))
    assert bad.error_kind == "bad_arguments" and box.replay.misses == []


def test_the_cache_answers_a_second_run_and_keeps_no_infra_error(tmp_path, monkeypatch):
    monkeypatch.setenv("FACTORY_CACHE", str(tmp_path))
    first = ToolBox.from_spec(CACHED, base_dir=REPO, record=True)
    a = asyncio.run(_calls(first, [call("2+3"), call("2+3"), call("9-1")]))
    assert a[0].text == a[1].text  # the second call of the run was answered from the cache
    assert first.metrics()["tool_servers/calculate/cache_hits"] == 1.0
    assert first.metrics()["tool_servers/calculate/cache_misses"] == 2.0
    before = drifting.calls_so_far()
    second = ToolBox.from_spec(CACHED, base_dir=REPO, record=True)  # another run: a fresh ToolBox
    b = asyncio.run(_calls(second, [call("9-1"), call("2+3")]))
    assert [r.text for r in b] == [a[2].text, a[0].text] and drifting.calls_so_far() == before
    assert [r["source"] for r in second.recorder.take()] == ["cache", "cache"]
    # the counts add up over callers, as the driver adds the rollout replicas' (a real run merges them)
    from factory.tools.metrics import ToolMetrics

    merged = ToolMetrics()
    merged.add(first._metrics)
    merged.add(second._metrics)
    assert merged.snapshot()["tool_servers/calculate/cache_hits"] == 3.0
    # what the tools stage tells its callers, taken: a window without calls says 0, not nothing
    taken = second.server_events()["calculate"]
    assert (taken["cache_hits"], taken["cache_misses"]) == (2, 0)
    assert second.server_events() == {"calculate": {"cache_hits": 0, "cache_misses": 0}}
    # another schema is another key; an infrastructure failure is not kept
    cache = ToolCache(tmp_path / "tool-cache.sqlite")
    k = ToolCache.key("calculate", "calculate", {"type": "object"}, {"expression": "2+3"})
    assert cache.get(k) is None
    from factory.tools.results import infra_error

    cache.put(k, infra_error("calculate", "timeout", "Error: timed out"))
    assert cache.get(k) is None
    cache.close()


def test_a_cache_that_fails_is_passed_by_and_the_tool_answers_live(tmp_path, monkeypatch, caplog):
    """The cache is an optimisation: a corrupt (or locked, or full) sqlite file must not turn a call into an
    error nor escape ToolBox.call (which never raises); the call goes to the live tool, recorded as such."""
    monkeypatch.setenv("FACTORY_CACHE", str(tmp_path))
    (tmp_path / "tool-cache.sqlite").write_bytes(b"not a database" * 100)
    box = ToolBox.from_spec(CACHED, base_dir=REPO, record=True)
    before = drifting.calls_so_far()
    got = asyncio.run(_calls(box, [call("2+3"), call("9-1")]))
    assert [(r.status, r.text.split(" [")[0]) for r in got] == [("ok", "5"), ("ok", "8")]
    assert drifting.calls_so_far() == before + 2
    assert [r["source"] for r in box.recorder.take()] == ["live", "live"]
    assert sum("the tool cache" in r.message for r in caplog.records) == 1  # said once, not on every call


def test_the_cache_is_read_and_written_off_the_event_loop(tmp_path, monkeypatch):
    """sqlite waits (a write lock another run holds, an fsync per answer) must not stall the tools stage's
    event loop, where every call of the step is in flight."""
    import threading

    monkeypatch.setenv("FACTORY_CACHE", str(tmp_path))
    threads = []
    for name in ("get", "put"):
        real = getattr(ToolCache, name)
        monkeypatch.setattr(ToolCache, name, lambda self, *a, _real=real: threads.append(threading.get_ident())
                            or _real(self, *a))
    asyncio.run(_calls(ToolBox.from_spec(CACHED, base_dir=REPO), [call("2+3")]))
    assert len(threads) == 2 and threading.get_ident() not in threads


def test_a_tools_stage_run_in_process_records_nothing(monkeypatch):
    """`factory rescore` and the agent server run the tools stage in their own process, where no driver takes
    the recording: it must not keep every call's whole result (a fetch tool's pages) for nobody."""
    import yaml

    import factory
    from factory.runtime.local import local_stages

    monkeypatch.chdir(REPO)
    data = yaml.safe_load((REPO / "specs" / "tiny.yaml").read_text())
    data["tools"] = {"calc": {"function": "tests.tool_servers.drifting:answer"}}  # in-process: nothing to start
    plan = factory.compile(data)
    assert plan.stage("tools").settings.record  # a run records (tracking.record_tools)

    async def recorder():
        async with local_stages(plan, ["tools"]) as stages:
            await stages["tools"].call(call("2+3"))
            return stages["tools"].box.recorder

    assert asyncio.run(recorder()) is None


# ------------------------------------------------------------------------------------------ a real run
def _spec(tmp_path: Path) -> Path:
    """specs/tiny.yaml with the drifting calculator as its MCP server (the calculator's listing, other answers)."""
    text = (REPO / "specs/tiny.yaml").read_text()
    line = "  calc: {command: python, args: [-m, factory.examples.calculator], timeout_s: 5}"
    assert line in text
    spec = tmp_path / "tiny-drifting.yaml"
    spec.write_text(text.replace(line, f"  calc: {{command: python, args: [{REPO}/tests/tool_servers/drifting.py], "
                                       "timeout_s: 5}"))
    return spec


def _run(tmp_path: Path, spec: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    return subprocess.run([sys.executable, "-m", "factory", "run", str(spec), f"train.checkpoint_dir={tmp_path}/runs",
                           *extra], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def _tables(tracker, run_id: str, folder: str) -> list[list[dict]]:
    import tempfile

    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory() as tmp:
        return [pq.read_table(tracker.download(run_id, p, tmp)).to_pylist()
                for p in sorted(tracker.artifacts(run_id, folder))]


@pytest.mark.slow  # two real runs of the tiny spec (Ray, MCP, DeepSpeed, MLflow): 144 s on 2 shared cores (AMD EPYC Zen 4)
def test_a_replayed_run_repeats_the_recorded_one(tmp_path):
    import torch
    from safetensors.torch import load_file

    from factory.tracking.tracker import open_tracker

    spec = _spec(tmp_path)
    first = _run(tmp_path, spec, "tracking.experiment=recorded")
    assert first.returncode == 0, first.stderr[-3000:]
    tracker = open_tracker(f"sqlite:///{tmp_path}/mlflow.db")
    (recorded,) = tracker.runs("recorded")
    # its tool server gone since: under replay.on_miss fail (the default) none is started, so the run goes on
    second = _run(tmp_path, spec, "--replay", recorded.run_id, "tracking.experiment=replayed",
                  f"tools.calc.args=[{tmp_path}/gone.py]")
    assert second.returncode == 0, second.stderr[-3000:]
    (replayed,) = tracker.runs("replayed")
    rows_a, rows_b = tracker.tool_calls(recorded.run_id), tracker.tool_calls(replayed.run_id)
    assert rows_a and {r["source"] for r in rows_a} == {"live"} and {r["source"] for r in rows_b} == {"replay"}
    assert " [call " in rows_a[0]["text"]  # the tool drifts: a live call would have answered otherwise
    key = lambda r: r["origin"]  # noqa: E731
    assert [(r["origin"], r["arguments"], r["text"]) for r in sorted(rows_a, key=key)] == \
           [(r["origin"], r["arguments"], r["text"]) for r in sorted(rows_b, key=key)]
    for folder in ("trajectories", "eval_trajectories"):  # the same episodes, token for token
        fields = ("step", "prompt_index", "sample_index", "response_ids", "loss_mask", "reward", "tool_calls")
        strip = lambda t: {k: ([{**c, "latency_s": 0} for c in t[k]] if k == "tool_calls" else t[k])  # noqa: E731
                           for k in fields}
        assert [[strip(t) for t in table] for table in _tables(tracker, recorded.run_id, folder)] == \
               [[strip(t) for t in table] for table in _tables(tracker, replayed.run_id, folder)]
    weights = [load_file(next(Path(run.tags["factory.checkpoint"]).glob("hf/*.safetensors")))
               for run in (tracker.run(recorded.run_id), tracker.run(replayed.run_id))]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])  # bit for bit


def test_a_cached_answer_belongs_to_the_server_that_gave_it(tmp_path, monkeypatch):
    """The cache's key was the server's name in the spec: a server started with other arguments, another
    project's `search`, or the same script after a fix answered from the old answers."""
    import factory.tools.recording as recording
    from factory.schema import HttpServer, StdioServer
    from factory.tools.recording import server_identity

    (tmp_path / "calc.py").write_text("print(1)\n")
    base = StdioServer(command="python", args=["calc.py"], cwd=".")  # (cwd: from the spec's folder, tmp_path)
    same = server_identity(base, tmp_path)
    assert server_identity(StdioServer(command="python", args=["calc.py"], cwd="."), tmp_path) == same
    assert server_identity(StdioServer(command="python", args=["calc.py", "--huge"], cwd="."), tmp_path) != same
    assert server_identity(StdioServer(command="python", args=["calc.py"], cwd=".", env={"K": "2"}), tmp_path) != same
    (tmp_path / "calc.py").write_text("print(2)\n")  # a fix to the server's code
    assert server_identity(base, tmp_path) != same
    # without cwd the server runs in factory's own folder (the project's root), not the spec's (specs/): its
    # script was looked for in the spec's folder, and a fix to it kept the old answers
    (tmp_path / "specs").mkdir()
    monkeypatch.chdir(tmp_path)
    rooted = StdioServer(command="python", args=["calc.py"])
    before = server_identity(rooted, tmp_path / "specs")
    (tmp_path / "calc.py").write_text("print(3)\n")
    assert server_identity(rooted, tmp_path / "specs") != before
    module = StdioServer(command="python", args=["-m", "tests.tool_servers.drifting"])
    assert server_identity(module, tmp_path) == server_identity(module, REPO)  # the module's file, wherever run from
    # an installed package run with -m: its __main__.py runs, and is what is hashed (not its __init__.py)
    assert recording._module_file("pip", tmp_path).name == "__main__.py"
    # a `-m` module in the server's own cwd (not on this process's path) is read there; one whose package
    # raises on import is not known, and the identity is still made
    (tmp_path / "servers" / "pkg").mkdir(parents=True)
    (tmp_path / "servers" / "pkg" / "__init__.py").write_text("raise RuntimeError('needs its API key')\n")
    (tmp_path / "servers" / "pkg" / "srv.py").write_text("v = 1\n")
    in_cwd = StdioServer(command="python", args=["-m", "pkg.srv"], cwd="servers")
    before = server_identity(in_cwd, tmp_path)
    (tmp_path / "servers" / "pkg" / "srv.py").write_text("v = 2\n")
    assert server_identity(in_cwd, tmp_path) != before
    monkeypatch.syspath_prepend(str(tmp_path / "servers"))  # found by this process: importing `pkg` raises
    server_identity(StdioServer(command="python", args=["-m", "pkg.other"]), tmp_path)
    # a large file among the arguments (an index) counts by its size and time, unread
    monkeypatch.setattr(recording, "_HASHED_BYTES", 4)
    (tmp_path / "index.bin").write_bytes(b"0123456789")
    assert recording._file_mark(tmp_path / "index.bin").startswith("10:")
    assert server_identity(HttpServer(url="http://a:1/mcp"), None) != server_identity(HttpServer(url="http://b:1/mcp"), None)
    # a python tool: its module's code is part of it
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "rc_tool_v.py").write_text("def f(x: int) -> int:\n    return x\n")
    tool = PythonTool(function="rc_tool_v:f")
    before = server_identity(tool, tmp_path)
    (tmp_path / "rc_tool_v.py").write_text("def f(x: int) -> int:\n    return x + 1\n")
    assert server_identity(tool, tmp_path) != before


def test_a_replayed_answer_is_the_recorded_one_whole_matched_by_server_tool_and_arguments():
    """A replay gives back what the tool said, failures included: a recorded tool error replayed as `ok` (or
    without its kind) changes the episode's rewards and the tool metrics, and the replayed run is no longer the
    recorded one. The arguments match as canonical JSON (the model may write the keys in another order); the
    server must match too (a tool of the same name on another server is another tool)."""
    from factory.types import ToolResult

    row = {"origin": "train/1/0/0/0/0/0", "server": "calc", "tool": "calculate",
           "arguments": canonical({"a": 1, "b": 2}), "text": "Error: division by zero", "status": "model_error",
           "error_kind": "tool_error", "latency_s": 0.1, "source": "live"}
    replay = Replay([row, {**row, "origin": ""}], "fail")
    assert replay.answer(ToolCall("calculate", {"b": 2, "a": 1}, raw="", origin="train/1/0/0/0/0/0"), "calc",
                         "calculate") == ToolResult("calculate", "Error: division by zero", "model_error", "tool_error")
    # a reward node's call (no origin), its keys in yet another order
    assert replay.answer(ToolCall("calculate", {"b": 2, "a": 1}, raw=""), "calc", "calculate") == \
        ToolResult("calculate", "Error: division by zero", "model_error", "tool_error")
    assert replay.answer(ToolCall("calculate", {"a": 1, "b": 2}, raw="", origin="train/1/0/0/0/0/0"), "other",
                         "calculate") is None
    assert replay.misses == ['calculate({"a":1,"b":2}) at train/1/0/0/0/0/0']


def test_the_cache_key_is_server_tool_schema_and_arguments_and_an_answer_comes_back_whole(tmp_path):
    """A cached answer answers exactly this call: another server identity (another project's `search`), another
    schema (the tool's parameters changed), another tool or other arguments is another key; the order of the
    arguments' keys is not. A kept tool error comes back with its status and kind (read back as `ok` without a
    kind, it would be counted and trained as a success)."""
    from factory.types import ToolResult

    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    k = ToolCache.key("srv-1", "calculate", schema, {"a": 1, "b": 2})
    assert ToolCache.key("srv-1", "calculate", dict(reversed(schema.items())), {"b": 2, "a": 1}) == k
    others = [ToolCache.key("srv-2", "calculate", schema, {"a": 1, "b": 2}),
              ToolCache.key("srv-1", "solve", schema, {"a": 1, "b": 2}),
              ToolCache.key("srv-1", "calculate", {"type": "object"}, {"a": 1, "b": 2}),
              ToolCache.key("srv-1", "calculate", schema, {"a": 1, "b": 3})]
    assert len({k, *others}) == 5
    cache = ToolCache(tmp_path / "tool-cache.sqlite")
    cache.put(k, ToolResult("calculate", "Error: division by zero", "model_error", "tool_error"))
    got = cache.get(k)
    assert (got.text, got.status, got.error_kind) == ("Error: division by zero", "model_error", "tool_error")
    assert all(cache.get(o) is None for o in others)
    cache.close()


def test_a_server_identity_holds_its_folder_its_started_script_and_a_packages_main(tmp_path):
    """More of what makes a server's answers its own (test_a_cached_answer_belongs_to_the_server_that_gave_it):
    the folder it runs in (the same script in two folders reads two folders' data), a script started as the
    command itself (`./srv.py`: a fix to it is a new key), and a package in its cwd run with `-m` (what runs is
    its __main__.py, not its __init__.py)."""
    from factory.tools.recording import server_identity

    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "srv.py").write_text("print(open('data.txt').read())\n")
    assert server_identity(StdioServer(command="python", args=["srv.py"], cwd="a"), tmp_path) != \
        server_identity(StdioServer(command="python", args=["srv.py"], cwd="b"), tmp_path)
    script = StdioServer(command="./a/srv.py")
    before = server_identity(script, tmp_path)
    (tmp_path / "a" / "srv.py").write_text("print('fixed')\n")
    assert server_identity(script, tmp_path) != before
    (tmp_path / "srvpkg").mkdir()
    (tmp_path / "srvpkg" / "__init__.py").write_text("")
    (tmp_path / "srvpkg" / "__main__.py").write_text("v = 1\n")
    package = StdioServer(command="python", args=["-m", "srvpkg"], cwd=".")
    before = server_identity(package, tmp_path)
    (tmp_path / "srvpkg" / "__main__.py").write_text("v = 2\n")
    assert server_identity(package, tmp_path) != before


@pytest.mark.slow  # 28 s: starting Ray (16 s) and an actor that imports the ToolBox (10 s)
def test_a_call_the_episode_deadline_cuts_over_ray_is_recorded_as_cut(local_ray):
    """Over Ray (how the rollout reaches the tools stage) the deadline cancelled only the caller's wait: the actor's
    call ran on and was recorded `ok`, where the trajectory holds `episode_timeout` and an in-process call is
    recorded so. A replay answered it `ok` at once and the replayed episode went on into turns never recorded."""
    import ray

    from factory.tools.client import ToolsClient

    @ray.remote
    class Tools:  # what the tools stage does: an async actor whose call is its ToolBox's
        async def start(self) -> None:
            self.box = ToolBox.from_spec({"nap": PythonTool(function="tests.test_tools_recording:nap")}, record=True)
            await self.box.start()

        async def schemas(self) -> list:
            return self.box.schemas()

        async def call(self, c: ToolCall):
            return await self.box.call(c)

        async def rows(self) -> list:
            return self.box.recorder.take()

    async def go() -> list:
        actor = Tools.remote()
        try:
            await actor.start.remote()
            client = ToolsClient(actor)
            await client.start()
            cut = ToolCall("nap", {"seconds": 1.0}, raw="", origin="train/0/0/0/0/0/0")
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(client.call(cut), 0.3)  # as the agent loop's deadline cancels a call
            for _ in range(40):  # the recording is written when the actor's call ends (cancelled at once, or at 1 s)
                if rows := await actor.rows.remote():
                    return rows
                await asyncio.sleep(0.05)
            return []
        finally:
            ray.kill(actor)

    rows = asyncio.run(go())
    assert [(r["origin"], r["status"], r["error_kind"]) for r in rows] == [
        ("train/0/0/0/0/0/0", "infra_error", "episode_timeout")]


def test_a_call_whose_arguments_hold_a_lone_surrogate_is_answered_alike_live_and_replayed():
    """json.loads reads a model's `"\\ud83d"` (half an emoji's escape) as a lone surrogate, which the tool_calls
    table holds only as its escape (MlflowTracker.log_tool_calls): a recorded row could never match the raw
    arguments of the call again. None is written: the call is refused (bad_arguments) before it is replayed or
    recorded, in the recorded run and its replay alike."""
    import json

    made = ToolCall("calculate", json.loads('{"expression": "1+1 \\ud83d"}'), raw="", origin="train/1/0/0/0/0/0")
    box = ToolBox.from_spec(TOOL, base_dir=REPO, record=True)
    (live,) = asyncio.run(_calls(box, [made]))
    assert (live.status, live.error_kind) == ("model_error", "bad_arguments") and box.recorder.take() == []
    replayed = ToolBox.from_spec(TOOL, base_dir=REPO, record=True)
    replayed.replay = Replay([], "fail")
    (again,) = asyncio.run(_calls(replayed, [made]))
    assert (again.text, again.error_kind) == (live.text, "bad_arguments") and replayed.replay.misses == []


def test_a_reward_node_name_holds_no_slash(project):
    """A per-turn tool node's call at turn 1 is named (its origin) `reward/<episode>/check/1`: a node named
    `check/1` had that name too, and a replay of the run that made both answered one of them only."""
    from factory.compiler.compile import compile_file
    from factory.compiler.errors import SpecErrors
    from factory.tools.recording import reward_origin
    from tests.test_compiler_support import base_spec, report

    assert reward_origin("train/1/0/0/0", "check", 1) == reward_origin("train/1/0/0/0", "check/1")
    path = project.spec(base_spec(project, "rec_slash") + '  "check/1": {fn: "rec_slash:exact"}\n')
    with pytest.raises(SpecErrors) as e:
        compile_file(path)
    assert report(e) == ("spec.yaml:9: rewards.check/1: a reward node's name holds no '/', which separates the "
                         "parts of its metrics' names (rewards/<node>/...) and of its tool calls' origins\n"
                         "1 error in spec.yaml")
