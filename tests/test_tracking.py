import hashlib
import json
import logging
import socket
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from factory import device

from factory.rollout.stage import BusyClock
from factory.tracking.mlflow_tracker import MlflowTracker as Tracker
from factory.tracking.mlflow_tracker import STEP_KEY, flatten, trajectory_records
from factory.types import ToolCall, ToolResult, Trajectory, Turn

REPO = Path(__file__).resolve().parents[1]


def _traj():
    turn = Turn(text="<tool_call>..", num_tokens=3, calls=[ToolCall("calculate", {"expression": "1+2"}, raw="")],
                results=[ToolResult("calculate", "3", latency_s=0.1)])
    return Trajectory(prompt_index=0, sample_index=1, prompt_ids=[1, 2], response_ids=[5, 6, 7, 8],
                      loss_mask=[1, 1, 0, 1], turns=[turn, Turn(text="<answer>3</answer>", num_tokens=1)],
                      stop_reason="no_call", row={"answer": "3"}, completion="c", reward=1.0)


def test_flatten_is_sorted_and_keeps_lists_whole():
    assert list(flatten({"b": {"y": [1, 2], "x": "s"}, "a": 1})) == [("a", "1"), ("b.x", "s"), ("b.y", "[1, 2]")]


def test_trajectory_records_hold_tool_calls_and_mask():
    (rec,) = trajectory_records([_traj()], step=3)
    assert rec["tool_calls"][0]["name"] == "calculate" and rec["tool_calls"][0]["result"] == "3"
    assert rec["loss_mask"] == [1, 1, 0, 1] and rec["num_turns"] == 2 and rec["step"] == 3


def test_mlflow_run_roundtrip(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/m.db"
    t = Tracker(uri, "exp")
    # what `factory run` does in a thread while its stages start: the new store's tables, the experiment
    t.prepare()
    assert MlflowClient(uri).get_experiment_by_name("exp") is not None
    Tracker(f"sqlite:///{tmp_path}/no/such/folder/m.db", "exp").prepare()  # an error is left for `start`
    listing = {"s": [{"name": "t", "offered_as": "t", "description": "", "inputSchema": {"type": "object"}}]}
    from factory.tracking.mlflow_tracker import TOOLS_IN_SERVER_ORDER

    run_id = t.start("r", {"train": {"lr": 1e-5}}, {"factory.spec_hash": "abc", TOOLS_IN_SERVER_ORDER: "true",
                                                    "factory.spec_name": "myspec"},
                     {"plan.json": "{}", "tools.json": json.dumps(listing)})
    # a spec's name is not its runs': the lookup says which runs it made (it said only "no run")
    from factory.tracking.tracker import RunLookupError

    with pytest.raises(RunLookupError, match=rf"^no run with id or name 'myspec' in .*; spec 'myspec' made 1 run\(s\), "
                                             rf"newest first: r \({run_id[:8]}\): name one$"):
        t.run("myspec")
    t.log_metrics({"reward/mean": 0.5, STEP_KEY: 1.0}, step=1)
    t.log_metrics({"reward/mean": 0.5, STEP_KEY: 1.0}, step=2)  # its step 2 made only malformed calls: none kept
    t.log_trajectories([_traj()], step=1)
    t.log_trajectories([_traj()], step=2, split="eval")
    calls = [{"origin": f"train/1/0/0/{i}/0/0", "server": "s", "tool": "t", "arguments": "{}", "text": "x" * 5000,
              "status": "ok", "error_kind": None, "latency_s": 0.5, "source": "live"} for i in range(3)]
    t.log_tool_calls(calls[:2], 1)
    t.log_tool_calls([], 2)  # nothing called: no table
    t.log_tool_calls(calls[2:], 3)
    t.end()
    # the recorded tool calls (what --replay serves): whole results, in order
    assert t.artifacts(run_id, "tool_calls") == ["tool_calls/step_00001.parquet", "tool_calls/step_00003.parquet"]
    assert t.tool_calls(run_id) == calls
    # and the tools its servers offered: a replay under on_miss fail offers them without starting a server
    from types import SimpleNamespace

    from factory.runtime.replay import recorded_tool_calls
    from factory.schema import ReplaySpec

    replay = SimpleNamespace(driver=SimpleNamespace(replay=ReplaySpec(run="r", on_miss="fail")), stages=())
    replayed = recorded_tool_calls(t, replay)  # type: ignore[arg-type]
    assert replayed is not None and replayed.rows == calls and replayed.listing == listing
    # how far it got: a replay missing past it went on, not elsewhere (its step tag, its evaluations' tables)
    assert replayed.trained == 2 and replayed.evaluated == [2]  # (every call kept has step 1's origin)
    # a server the recording has no listing of (added since): the spec's fault, said before any stage starts
    # (the tools stage failed its start, exit 3, once Ray and every stage had started)
    from factory.plan import ToolsSettings
    from factory.schema import StdioServer
    from factory.util import UserError

    servers = {name: StdioServer(command="python") for name in ("s", "units")}
    added = SimpleNamespace(driver=replay.driver, stages=(SimpleNamespace(settings=ToolsSettings(tools=servers,
                                                                                               base_dir=".")),))
    with pytest.raises(UserError, match=rf"^replay: run r \({run_id}\): tools.units: the replayed run had no tool "
                                        r"server of this name.*set replay.on_miss=live"):
        recorded_tool_calls(t, added)  # type: ignore[arg-type]
    client = MlflowClient(uri)
    # a run recorded before tools.json kept its servers' key order: its servers start (its sorted schemas would
    # prompt the model with other tokens, and the replay miss)
    client.delete_tag(run_id, TOOLS_IN_SERVER_ORDER)
    assert recorded_tool_calls(t, replay).listing is None  # type: ignore[arg-type, union-attr]
    run = client.get_run(run_id)
    assert run.data.params["train.lr"] == "1e-05" and run.data.tags["factory.spec_hash"] == "abc"
    assert [m.value for m in client.get_metric_history(run_id, "reward/mean")] == [0.5, 0.5]
    local = client.download_artifacts(run_id, "trajectories/step_00001.parquet", str(tmp_path))
    assert pq.read_table(local).to_pylist()[0]["tool_calls"][0]["name"] == "calculate"


def test_a_run_leaves_the_default_store_of_later_runs_as_it_was(tmp_path, monkeypatch):
    """MLflow's set_tracking_uri also sets $MLFLOW_TRACKING_URI: after factory.run of a spec with its own
    `tracking.uri`, a later spec without one, and factory.runs() with no uri, used that spec's store in the
    same Python process, not ./mlflow.db. MLflow's own calls still go to the run's store (docs/python.md)."""
    import os

    import mlflow

    import factory
    from factory.tracking.mlflow_tracker import tracking_uri

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
    a = f"sqlite:///{tmp_path}/a.db"
    try:
        t = Tracker(a, "a")
        t.prepare()
        t.start("a-run", {}, {}, {"plan.json": "{}"})
        t.end()
        assert tracking_uri(None) == "sqlite:///mlflow.db" and "MLFLOW_EXPERIMENT_ID" not in os.environ
        assert factory.runs() == [] and not (tmp_path / "mlflow.db").exists()
        assert mlflow.get_tracking_uri() == a
        mine = f"sqlite:///{tmp_path}/mine.db"  # one the caller set is kept as it was
        monkeypatch.setenv("MLFLOW_TRACKING_URI", mine)
        Tracker(f"sqlite:///{tmp_path}/b.db", "b").prepare()
        assert tracking_uri(None) == mine and mlflow.get_tracking_uri() == f"sqlite:///{tmp_path}/b.db"
    finally:
        mlflow.set_tracking_uri(None)



def test_a_tracker_sets_mlflows_http_settings_only_while_it_writes_a_run(tracking_server, tmp_path, monkeypatch):
    """A tracker of an HTTP store set MLflow's HTTP settings (1 retry, 30 s) for the whole process when it was
    built, and every read builds one (`factory.runs(uri=...)`, `diff`, `export`): a notebook's own MLflow calls
    then retried once, not 7 times with backoff. A download set the artifact progress bar off for good. They are
    set while a run is written (start to end), a setting the user gave kept, and then put back as they were."""
    import os

    import mlflow.environment_variables as ev

    names = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "MLFLOW_HTTP_REQUEST_TIMEOUT",
             "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")  # the user's own: kept throughout
    t = Tracker(tracking_server, "env")  # what open_tracker(uri, read=True) builds for `factory.runs()`
    assert {n: os.environ.get(n) for n in names} == {**dict.fromkeys(names), "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
    t.start("env", {}, {}, {"a.txt": "a"})
    assert ev.MLFLOW_HTTP_REQUEST_MAX_RETRIES.get() == 1 and os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "5"
    t.end()
    t.released()
    assert t.download(t.run_id, "a.txt", tmp_path).read_text() == "a"
    assert {n: os.environ.get(n) for n in names} == {**dict.fromkeys(names), "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
    assert ev.MLFLOW_HTTP_REQUEST_MAX_RETRIES.get() == 7  # MLflow's own, for the user's calls


def test_a_tracker_dropped_while_writing_leaves_later_settings_alone(monkeypatch):
    """The settings were held by a generator context manager: a tracker dropped without `end` (a test's, a
    notebook's after an exception) put them back when the garbage collector finalised it, at any later moment,
    popping a value set meanwhile (seen: a CI test's MLFLOW_HTTP_REQUEST_TIMEOUT=1 gone, its `end` then waited out
    MLflow's 120 s default). Only `end` and `released` put them back now."""
    import gc
    import os

    from factory.util import MLFLOW_FAIL_FAST

    for name in MLFLOW_FAIL_FAST:  # (monkeypatch puts back all three: the dropped tracker leaves them set)
        monkeypatch.delenv(name, raising=False)
    t = Tracker("http://127.0.0.1:9", "dropped")
    t._fail_fast()  # as `prepare` or `start` does
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "30"
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")  # set by someone else while it writes
    del t
    gc.collect()
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "1"
    t = Tracker("http://127.0.0.1:9", "ended")
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT")
    t._fail_fast()
    t.released()  # (no run: what was set is put back)
    assert "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ


def test_an_evaluation_whose_stages_fail_to_start_puts_mlflows_http_settings_back(monkeypatch):
    """`factory.evaluate` had no `released()` after it, as a run has: an evaluation whose stages failed to start
    (a model that does not fit, a tool server that will not start), after its store was prepared (which sets
    them), left MLflow's HTTP settings changed for the rest of a notebook's process."""
    import contextlib
    import os

    import factory
    from factory.runtime import driver

    names = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "MLFLOW_HTTP_REQUEST_TIMEOUT")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(REPO)
    plan = factory.compile(REPO / "specs" / "tiny.yaml", ["tracking.uri=http://127.0.0.1:9"], weights=False)
    real = driver.prepare_in_background

    def prepare(tracker):  # the store's preparing over (it cannot be reached) before the stages fail
        thread = real(tracker)
        thread.join()
        return thread

    @contextlib.contextmanager
    def placed(*_, **__):
        raise RuntimeError("stage 'rollout' did not start")
        yield

    monkeypatch.setattr(driver, "prepare_in_background", prepare)
    monkeypatch.setattr(driver, "placed", placed)
    with pytest.raises(RuntimeError, match="did not start"):
        driver.evaluate_only(plan)
    assert {n: os.environ.get(n) for n in names} == dict.fromkeys(names)


def test_each_kind_of_file_a_run_reads_has_a_hash_tag_of_its_own(monkeypatch):
    """MLflow's compare view showed a changed reward file, template or data only as another plan hash; each kind
    has a tag of its own, changed only by its own files, and none where the run reads none of that kind."""
    from factory.tracking import mlflow_tracker

    monkeypatch.setattr(mlflow_tracker, "environment_tags", dict)
    hashes = {"spec": "s", "run": "r", "code": {}, "rewards": {"rewards/task.py": "aa"},
              "templates": {"prompts/task.jinja": "bb"}, "data": {"train": {"path": "d.jsonl", "sha256": "cc"}},
              "tools": {"letters": "dd"}}
    tags = mlflow_tracker.run_tags(hashes, "demo", {"team": "x"})
    assert sorted(k for k in tags if k.startswith("factory.hash.")) == [
        "factory.hash.data", "factory.hash.rewards", "factory.hash.templates", "factory.hash.tools"]  # no code read
    changed = mlflow_tracker.run_tags({**hashes, "rewards": {"rewards/task.py": "ab"}}, "demo", {"team": "x"})
    assert {k for k in tags if tags[k] != changed[k]} == {"factory.hash.rewards"}
    assert len(tags["factory.hash.rewards"]) == 12 and tags["team"] == "x"


def test_busy_clock_splits_wall_time(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("factory.rollout.stage.time.perf_counter", lambda: now[0])
    c = BusyClock()
    c.enter("tools"); now[0] = 1.0          # 1 s tools only
    c.enter("generate"); now[0] = 3.0       # 2 s generate (tools overlapping)
    c.exit("tools"); c.exit("generate"); now[0] = 3.5  # 0.5 s idle
    assert c.read() == {"generate": 2.0, "tools": 1.0, "idle": 0.5}


def test_plan_changes_name_each_kind_of_change():
    from factory.commands.diff import plan_changes

    a = {"spec": {"train": {"lr": 1e-5, "steps": 10}, "tools": {"calc": {}}}, "version": "0.1.0",
         "hashes": {"rewards": {"rewards/math.py": "aa"}, "templates": {"p.jinja": "t1"}, "data": {"train": {"sha256": "d1"}},
                    "tools": {"calc": "h1"}, "code": {}, "spec": "s1", "run": "1"}}
    b = {"spec": {"train": {"lr": 3e-6, "steps": 10}, "tools": {"calc": {}}}, "version": "0.1.0",
         "hashes": {"rewards": {"rewards/math.py": "bb"}, "templates": {"p.jinja": "t2"}, "data": {"train": {"sha256": "d2"}},
                    "tools": {"calc": "h2"}, "code": {}, "spec": "s2", "run": "2"}}
    listing = {"calc": [{"name": "calculate", "description": "x", "inputSchema": {"type": "object"}}]}
    changed = {"calc": listing["calc"] + [{"name": "sqrt", "description": "y", "inputSchema": {}}]}
    assert plan_changes(a, b, listing, changed) == [
        {"kind": "setting", "key": "train.lr", "a": "1e-05", "b": "3e-06"},
        {"kind": "template", "key": "templates.p.jinja", "a": "t1", "b": "t2"},
        {"kind": "reward_code", "key": "rewards.rewards/math.py", "a": "aa", "b": "bb"},
        {"kind": "data", "key": "data.train.sha256", "a": "d1", "b": "d2"},
        {"kind": "tool_schema", "key": "tools.calc", "a": "h1", "b": "h2",
         "tools": {"added": ["sqrt"], "removed": [], "changed": []}},
    ]
    assert plan_changes(a, a) == []


def test_diff_of_a_training_run_and_its_evaluation_leaves_out_what_training_alone_reads():
    """`factory diff TRAIN EVAL`: the eval run's spec may give other train.* settings (it trains nothing): only
    what an evaluation reads is a change, and a note says what was left out."""
    from factory.commands.diff import RunRecord, compare
    from factory.tracking.tracker import TrackedRun

    def record(run_id, tags, spec):
        return RunRecord(TrackedRun(run_id, run_id, "0", "FINISHED", 1.0, 2.0, tags=tags), {"spec": spec}, None)

    trained = record("a", {}, {"model": {"path": "base"}, "train": {"lr": 5e-4, "steps": 3}})
    evaluated = record("b", {"factory.kind": "eval"}, {"model": {"path": "ckpt"}, "train": {"lr": 1e-3, "steps": 2}})
    report = compare(trained, evaluated, {}, {})
    assert report["changes"] == [{"kind": "model", "key": "evaluated model", "a": "base", "b": "ckpt"}]
    assert report["notes"] == ["B is an eval run: settings it does not read (train.*, algorithm.*, data.train.*) are "
                               "not compared"]
    both = compare(trained, record("c", {}, {"model": {"path": "base"}, "train": {"lr": 1e-3, "steps": 3}}), {}, {})
    assert [c["key"] for c in both["changes"]] == ["train.lr"] and both["notes"] == []


def test_evals_of_one_spec_that_scored_different_models_differ(tmp_path):
    """`factory eval SPEC --model URL` (a served model) or `--model RUN` of a LoRA run (its adapters added beside
    the spec's model) leave model.path as the spec has it; the model is in the tag factory.eval_model, which
    diff did not read: against an eval of the spec's own model, "no change" and no warning."""
    from factory.commands.diff import RunRecord, compare
    from factory.tracking.tracker import TrackedRun

    def record(run_id, tags):
        tags = {"factory.kind": "eval", **tags}
        return RunRecord(TrackedRun(run_id, run_id, "0", "FINISHED", 1.0, 2.0, tags=tags),
                         {"spec": {"model": {"path": "factory:tiny-qwen3"}}}, None)

    base = record("a", {})
    served = record("b", {"factory.eval_model": "http://127.0.0.1:8000/v1"})
    report = compare(base, served, {}, {})
    assert report["changes"] == [{"kind": "model", "key": "evaluated model", "a": "factory:tiny-qwen3",
                                  "b": "http://127.0.0.1:8000/v1"}]
    assert report["warnings"] == ["not comparable: different model (evaluated model)"]
    assert compare(served, served, {}, {})["changes"] == []
    # an evaluation of the other run's checkpoint: its model is that run's, not another (no warning)
    trained = RunRecord(TrackedRun("t", "t", "0", "FINISHED", 1.0, 2.0, tags={}),
                        {"spec": {"model": {"path": "factory:tiny-qwen3"}}}, None)
    of_trained = record("c", {"factory.eval_model": "/ckpt/step_00004", "factory.eval_of": "t"})
    assert compare(trained, of_trained, {}, {})["warnings"] == []


def test_two_evaluations_of_one_spec_and_model_are_identical(capsys):
    """Two `factory eval SPEC` runs of one model (and a run and its evaluation) changed nothing, both recorded
    their tool schemas: the informational notes (an eval run's unread settings, an evaluation of the other run's
    checkpoint) made them "not identical", and the text report said neither what differs nor "defined
    identically". Only a note that hides a difference (tool schemas not recorded, a resume under a changed spec)
    does."""
    from factory.commands.diff import RunRecord, compare, render
    from factory.tracking.tracker import TrackedRun

    def record(run_id, tags, hashes=None, resumed=()):
        plan = {"spec": {"model": {"path": "factory:tiny-qwen3"}, "tools": {"calc": {}}},
                "hashes": {"run": "abcdef0123456789", "tools": {"calc": "h"}} if hashes is None else hashes}
        return RunRecord(TrackedRun(run_id, run_id, "0", "FINISHED", 1.0, 2.0, tags=tags), plan, None,
                         resumed=list(resumed))

    a, b = record("a", {"factory.kind": "eval"}), record("b", {"factory.kind": "eval"})
    report = compare(a, b, {}, {})
    assert report["changes"] == [] and report["notes"] == [
        "A is an eval run and B is an eval run: settings it does not read (train.*, algorithm.*, data.train.*) are "
        "not compared"]
    assert report["identical"]
    render({**report, "trajectories": None}, a, b)
    assert "defined identically" in capsys.readouterr().out
    of_a = record("c", {"factory.kind": "eval", "factory.eval_of": "t"})
    assert compare(record("t", {}), of_a, {}, {})["identical"]
    # what hides a difference still blocks it
    unhashed = record("d", {"factory.kind": "eval"}, hashes={"run": "abcdef0123456789"})
    assert not compare(a, unhashed, {}, {})["identical"]
    resumed = record("e", {"factory.kind": "eval"}, resumed=[(2, a.plan)])
    assert not compare(a, resumed, {}, {})["identical"]


def test_a_run_that_has_not_finished_is_compared_with_a_warning():
    """`factory diff` of a finished run and one still running (or stopped, or failed) put their "final"
    values side by side with nothing said: B's eval "final" was its step-0 evaluation, against A's step 4."""
    from factory.commands.diff import RunRecord, compare
    from factory.tracking.tracker import TrackedRun

    params = {"train.steps": "4"}
    done = RunRecord(TrackedRun("a", "a", "0", "FINISHED", 1.0, 2.0, tags={"factory.step": "4"}, params=params), {}, None)
    going = RunRecord(TrackedRun("b", "b", "0", "FAILED", 1.0, 2.0, tags={"factory.step": "2"}, params=params), {}, None)
    history_a = {"eval/accuracy": [(0, 0.0), (4, 0.5)], "reward/mean": [(1, 0.1), (4, 0.3)]}
    history_b = {"eval/accuracy": [(0, 0.0)], "reward/mean": [(1, 0.1), (2, 0.2)]}
    report = compare(done, going, history_a, history_b)
    assert report["warnings"] == ["B has not finished (FAILED): 2 of 4 steps done; its final values are those it had "
                                  "logged so far",
                                  "their final evaluations are of different steps: A's of step 4, B's of step 0"]
    assert report["identical"] and compare(done, done, history_a, history_a)["warnings"] == []


def test_a_recorded_tool_answer_with_a_lone_surrogate_is_logged_as_its_escape(tmp_path, monkeypatch):
    # a python tool's os.fsdecode of a file name that is not UTF-8: writing the table raised, in the driver's
    # _log_step, ending the run
    monkeypatch.chdir(tmp_path)
    t = Tracker(f"sqlite:///{tmp_path}/m.db", "exp")
    t.prepare()
    run_id = t.start("r", {}, {}, {"plan.json": "{}"})
    row = {"origin": "train/1/0/0/0/0/0", "server": "s", "tool": "ls", "arguments": '{"folder":"\udcff"}',
           "text": "report_\udcff.txt", "status": "ok", "error_kind": None, "latency_s": 0.5, "source": "live"}
    t.log_tool_calls([row], 1)
    t.end()
    assert t.tool_calls(run_id) == [{**row, "arguments": '{"folder":"\\udcff"}', "text": "report_\\udcff.txt"}]


def test_a_trajectory_whose_calls_hold_a_lone_surrogate_is_logged_as_its_escape(tmp_path, monkeypatch):
    # a call's name json.loads read from the model's `"\\ud83d"` (and a parse error quoting it), a tool's answer
    # from a Tools that did not escape it: the tool_calls column was written as it was, Arrow raised in the
    # driver's _log_step and the run ended
    monkeypatch.chdir(tmp_path)
    t = Tracker(f"sqlite:///{tmp_path}/m.db", "exp")
    t.prepare()
    run_id = t.start("r", {}, {}, {"plan.json": "{}"})
    traj = _traj()
    traj.turns[0].calls = [ToolCall("\ud83d", None, raw="", parse_error="unknown name '\ud83d'")]
    traj.turns[0].results = [ToolResult("\ud83d", "caf\udce9.txt")]
    t.log_trajectories([traj], step=1, traces=0)
    t.end()
    with tempfile.TemporaryDirectory() as tmp:
        (row,) = pq.read_table(t.download(run_id, "trajectories/step_00001.parquet", tmp)).to_pylist()
    (call,) = row["tool_calls"]
    assert (call["name"], call["parse_error"], call["tool"], call["result"]) == (
        "\\ud83d", "unknown name '\\ud83d'", "\\ud83d", "caf\\udce9.txt")


def test_a_dropped_trajectory_whose_reason_holds_a_lone_surrogate_is_logged_as_its_escape(tmp_path, monkeypatch):
    # a drop_sample node's error quoting a file name that is not UTF-8 (os.fsdecode), or a tool name json.loads read
    # from the model's `"\\ud83d"`: the `dropped` column was written as it was, Arrow raised in the driver's
    # _log_step and the run ended ("internal error: UnicodeEncodeError")
    monkeypatch.chdir(tmp_path)
    t = Tracker(f"sqlite:///{tmp_path}/m.db", "exp")
    t.prepare()
    run_id = t.start("r", {}, {}, {"plan.json": "{}"})
    traj = _traj()
    traj.dropped = "rewards.has_file: error: FileNotFoundError: no output file r\udce9sultat.txt"
    t.log_trajectories([traj], step=1, traces=0)
    t.end()
    with tempfile.TemporaryDirectory() as tmp:
        (row,) = pq.read_table(t.download(run_id, "trajectories/step_00001.parquet", tmp)).to_pylist()
    assert row["dropped"] == "rewards.has_file: error: FileNotFoundError: no output file r\\udce9sultat.txt"


def test_a_run_resumed_under_a_changed_spec_is_not_identical(tmp_path, monkeypatch):
    """A run resumed with `--allow-spec-change train.steps=3` keeps its first spec's params and plan.json:
    `factory diff` of it and a run of that first spec said "defined identically"."""
    from factory.commands.diff import diff_runs

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/m.db"
    plan = {"spec": {"train": {"steps": 2, "lr": 0.001}}, "hashes": {"run": "h"}}
    ids = []
    for resumed in (False, True):
        t = Tracker(uri, "e")
        ids.append(t.start(f"r{resumed}", {}, {}, {"plan.json": json.dumps(plan)}))
        if resumed:  # what MlflowTracker.resume records of the change
            t.log_text(json.dumps({**plan, "spec": {"train": {"steps": 3, "lr": 0.001}}}), "resumed/step_2/plan.json")
        t.end()
    report, _, _ = diff_runs(*ids, uri=uri)
    assert report["notes"] == ["B was resumed after step 2 under a changed spec (--allow-spec-change): "
                               "train.steps 2 -> 3"]
    assert not report["identical"] and report["changes"] == []


def test_unrecorded_tool_schemas_are_a_note_not_identical():
    from factory.commands.diff import plan_changes, plan_notes

    a = {"spec": {"tools": {"calc": {}}}, "hashes": {"tools": {}}}
    b = {"spec": {"tools": {"calc": {}}}, "hashes": {"tools": {"calc": "h"}}}
    assert plan_changes(a, b) == []
    assert plan_notes(a, b, ("A", "B")) == [
        "run A did not record its tool schemas (its plan was compiled without the servers): a change of tool "
        "server would not show"]


def test_values_both_runs_read_from_the_environment_are_a_note():
    """Two rescores scored by different judges (JUDGE_URL) showed no difference at all: the endpoint is ***."""
    from factory.commands.diff import plan_changes, plan_notes

    judge = {"rewards": {"judge": {"endpoint": "***", "timeout_s": 5}}, "tracking": {"uri": "***"}}
    a, b = {"spec": judge}, {"spec": {**judge, "tracking": {"uri": "sqlite:///m.db"}}}
    assert plan_changes(a, b) == [{"kind": "setting", "key": "tracking.uri", "a": "***", "b": "sqlite:///m.db"}]
    assert plan_notes(a, b, ("A", "B")) == [
        "rewards.judge.endpoint: read from the environment in both runs and not recorded (***), so a difference "
        "there cannot be seen"]
    # a list is one setting (flatten keeps it whole): an env value inside one, a server's `--key ***` argument or
    # a masked leaf in a list of mappings, hid a difference there with no note
    tools = {"tools": {"search": {"args": ["--key", "***"], "env": [{"k": "***"}], "cwd": ["plain"]}}}
    a = b = {"spec": tools, "hashes": {"tools": {"search": "h"}}}
    assert plan_changes(a, b) == []
    assert plan_notes(a, b, ("A", "B")) == [
        "tools.search.args, tools.search.env: read from the environment in both runs and not recorded (***), so a "
        "difference there cannot be seen"]


def test_a_setting_one_run_lacks_or_holds_as_null_is_shown_unset():
    """Turning LoRA on made two rows of nothing ("model.lora: null -> None", "model.lora.alpha: None ->
    null") and printed the settings it set as "None -> 16"."""
    from factory.commands.diff import plan_changes, resumed_notes
    from factory.tracking.mlflow_tracker import setting_text

    a = {"spec": {"model": {"lora": None, "tokenizer": None}}}
    b = {"spec": {"model": {"lora": {"alpha": None, "r": 16}, "tokenizer": "t"}}}
    assert [(c["key"], setting_text(c["a"]), setting_text(c["b"])) for c in plan_changes(a, b)] == [
        ("model.lora.r", "(unset)", "16"), ("model.tokenizer", "(unset)", "t")]
    assert resumed_notes("B", a, [(3, b)]) == [
        "B was resumed after step 3 under a changed spec (--allow-spec-change): model.lora.r (unset) -> 16, "
        "model.tokenizer (unset) -> t"]
    assert plan_changes(b, a)[0]["a"] == "16" and setting_text("16") == "16"


def test_runs_that_differ_in_data_or_model_are_flagged():
    """Another algorithm on the same rows and model (GRPO against DAPO, turn credit against trajectory credit) is
    what docs/algorithms.md asks users to compare: it was flagged "not comparable: different algorithm"."""
    from factory.commands.diff import comparability

    changes = [{"kind": "setting", "key": "algorithm.name"}, {"kind": "data", "key": "data.train.sha256"},
               {"kind": "setting", "key": "model.path"}, {"kind": "setting", "key": "train.lr"}]
    assert comparability(changes) == ["not comparable: different data (data.train.sha256)",
                                      "not comparable: different model (model.path)"]
    assert comparability([{"kind": "setting", "key": "algorithm.credit"}, {"kind": "setting", "key": "algorithm.gamma"},
                          {"kind": "algorithm", "key": "algorithm.loss"}]) == []
    assert comparability([{"kind": "setting", "key": "train.lr"}]) == []
    # another prompt template for the same rows is what such a comparison is for (it said "different data")
    assert comparability([{"kind": "setting", "key": "data.prompt"}, {"kind": "setting", "key": "data.system_prompt"},
                          {"kind": "template", "key": "templates.prompts/arith.jinja"}]) == []


def test_evaluations_of_the_same_eval_rows_and_the_same_rows_in_another_order_are_comparable():
    """An evaluation reads data.eval only: two evals (or rescores) whose specs' data.train differed (its path, its
    rows' sha256) were "not comparable: different data" though they scored the very same rows. And data.shuffle
    orders the same rows another way: "different data" too. A training run's data.train change still is one."""
    from factory.commands.diff import RunRecord, comparability, compare, plan_changes
    from factory.tracking.tracker import TrackedRun

    def record(run_id, tags, train_sha):
        spec = {"model": {"path": "m"}, "data": {"train": {"path": f"{train_sha}.jsonl"}, "eval": {"path": "e.jsonl"}}}
        hashes = {"data": {"train": {"path": f"{train_sha}.jsonl", "sha256": train_sha},
                           "eval": {"path": "e.jsonl", "sha256": "e1"}}}
        return RunRecord(TrackedRun(run_id, run_id, "0", "FINISHED", 1.0, 2.0, tags=tags),
                         {"spec": spec, "hashes": hashes}, None)

    for tags in ({"factory.kind": "eval"}, {"factory.rescore_of": "r"}):
        report = compare(record("a", tags, "t1"), record("b", tags, "t2"), {}, {})
        assert report["warnings"] == [] and report["changes"] == [], report
        assert "data.train.*" in report["notes"][0]
    report = compare(record("a", {}, "t1"), record("b", {}, "t2"), {}, {})
    assert report["warnings"] == ["not comparable: different data (data.train.sha256)"], report

    def plan(shuffle):
        return {"spec": {"data": {"train": {"path": "t.jsonl"}, "shuffle": shuffle}},
                "hashes": {"data": {"train": {"sha256": "d"}}}}

    assert comparability(plan_changes(plan(True), plan(False))) == []


def test_the_same_data_file_named_another_way_is_comparable():
    """`./data/train.jsonl` for `data/train.jsonl` (or the file moved), its rows the same: "not comparable:
    different data (data.train.path, data.train.path)", the key twice (the spec's and the plan hash's). A file is
    judged by its sha256; a generator by its fields, each said once."""
    from factory.commands.diff import comparability, plan_changes

    def plan(path, sha):
        return {"spec": {"data": {"train": {"path": path}}},
                "hashes": {"data": {"train": {"path": path, "sha256": sha}}}}

    moved = plan_changes(plan("data/train.jsonl", "d1"), plan("./data/train.jsonl", "d1"))
    assert moved == [{"kind": "setting", "key": "data.train.path", "a": "data/train.jsonl", "b": "./data/train.jsonl"}]
    assert comparability(moved) == []
    other = plan_changes(plan("data/train.jsonl", "d1"), plan("data/train.jsonl", "d2"))
    assert comparability(other) == ["not comparable: different data (data.train.sha256)"]

    def generated(n):
        train = {"generator": "tasks:rows", "args": {"n": n}}
        return {"spec": {"data": {"train": train}}, "hashes": {"data": {"train": {**train, "source_sha256": "s"}}}}

    changes = plan_changes(generated(1), generated(2))
    assert changes == [{"kind": "setting", "key": "data.train.args.n", "a": "1", "b": "2"}]
    assert comparability(changes) == ["not comparable: different data (data.train.args.n)"]


def test_metric_rows_final_best_mean_and_deltas():
    from factory.commands.diff import metric_rows

    a = {"reward/mean": [(1, 0.2), (2, 0.6), (3, 0.4)], "eval/accuracy": [(0, 0.1), (3, 0.5)],
         "timing/step_s": [(1, 2.0), (2, 4.0), (3, 6.0)]}
    b = {"reward/mean": [(1, 0.3), (2, 0.5)], "eval/accuracy": [(0, 0.1), (2, 0.9)], "perf/tokens_per_s": [(1, 9.0)]}
    rows = [(r["metric"], r["agg"], r["a"], r["b"], r["delta"]) for r in metric_rows(a, b)]
    assert rows == [("reward/mean", "best", 0.6, 0.5, pytest.approx(-0.1)),
                    ("reward/mean", "final", 0.4, 0.5, pytest.approx(0.1)),
                    ("eval/accuracy", "final", 0.5, 0.9, pytest.approx(0.4)),
                    ("eval/accuracy", "step 0", 0.1, 0.1, 0.0),
                    ("timing/step_s", "mean", 4.0, None, None),
                    ("perf/tokens_per_s", "mean", None, 9.0, None)]


def test_common_prompts_pair_the_last_step_of_each_run():
    from factory.commands.diff import common_prompts

    def row(split, step, q, reward, sample=0):
        return {"split": split, "step": step, "prompt": json.dumps([{"role": "user", "content": q}]),
                "sample_index": sample, "reward": reward, "rewards": "{}", "completion": f"{q}:{reward}",
                "tool_calls": []}

    a = [row("eval", 0, "q1", 0.0), row("eval", 2, "q1", 1.0), row("train", 1, "q2", 0.5), row("train", 1, "q3", 0.0)]
    b = [row("eval", 0, "q1", 0.0), row("eval", 2, "q1", 0.0), row("train", 1, "q2", 0.25, 1)]
    prompts = common_prompts(a, b)
    assert [(p["split"], p["prompt"]) for p in prompts] == [("eval", "q1"), ("train", "q2")]
    assert [t["completion"] for t in prompts[0]["a"]] == ["q1:1.0"] and prompts[0]["b"][0]["step"] == 2
    assert prompts[1]["a_reward_mean"] == 0.5 and prompts[1]["b_reward_mean"] == 0.25


def test_common_prompts_pair_the_same_rows_under_another_prompt_template():
    """Runs that differ in data.system_prompt (or data.prompt) on the same rows, what diff is for, rendered no
    prompt alike: "no prompt was seen by both runs". They are paired by the data row each trajectory records;
    by the rendered prompt where the rows do not tell the prompts apart (a `prompt` column alone)."""
    from factory.commands.diff import common_prompts

    def row(system, q, answer, reward):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        return {"split": "eval", "step": 2, "sample_index": 0, "prompt": json.dumps(messages),
                "row": json.dumps({"answer": answer, "question": q}), "reward": reward, "rewards": "{}",
                "completion": f"{system}:{q}", "tool_calls": []}

    a = [row("You are a calculator.", "What is 8 - 3?", "5", 0.0), row("You are a calculator.", "2 + 2?", "4", 1.0)]
    b = [row("Think step by step.", "2 + 2?", "4", 1.0), row("Think step by step.", "What is 8 - 3?", "5", 1.0)]
    prompts = common_prompts(a, b)
    assert [(p["prompt"], p["a_reward_mean"], p["b_reward_mean"]) for p in prompts] == [
        ("What is 8 - 3?", 0.0, 1.0), ("2 + 2?", 1.0, 1.0)]
    assert prompts[0]["b"][0]["completion"] == "Think step by step.:What is 8 - 3?"
    # rows that are only their answer (the prompt messages a column `row` leaves out): one row, two prompts
    same = [{**r, "row": json.dumps({"answer": "5"})}
            for r in (row("s", "3 + 2?", "5", 0.0), row("s", "9 - 4?", "5", 1.0))]
    assert [p["prompt"] for p in common_prompts(same, same)] == ["3 + 2?", "9 - 4?"]


def test_environment_tags_name_versions_cpu_and_gpu():
    from factory.tracking.mlflow_tracker import environment_tags

    tags = environment_tags()
    assert tags["factory.version.torch"].startswith("2.") and tags["factory.version.mcp"] != "none"
    assert tags["factory.cpu"] and tags["factory.cpu"] != "unknown" and tags["factory.gpu"]
    assert tags["factory.cpu_kind"].endswith(("bf16 native (" + device.cpu().why + ")",
                                              "bf16 emulated (" + device.cpu().why + ")"))
    assert "factory.version.vllm" in tags and "factory.version.deepspeed" in tags


def test_trajectory_trace_has_a_span_per_turn_and_tool_call(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/m.db"
    t = Tracker(uri, "exp")
    t.start("r", {}, {}, {})
    traj = _traj()
    traj.turns[0].results[0] = ToolResult("calculate", "timed out", status="infra_error", error_kind="timeout",
                                          latency_s=0.5)
    traj.turns[0].started_at, traj.turns[0].generated_at, traj.turns[0].ended_at = 100.0, 101.0, 101.5
    traj.turns[1].started_at = traj.turns[1].generated_at = traj.turns[1].ended_at = 101.5
    t.log_trajectories([traj], step=2, split="eval")
    t.end()
    (trace,) = mlflow.search_traces(locations=[t.experiment_id], run_id=t.run_id, return_type="list")
    assert trace.info.tags["factory.split"] == "eval" and trace.info.tags["factory.step"] == "2"
    # the queue's "Flushing the async trace logging queue before program exit" came after the run's summary;
    # a new store's "Creating initial MLflow database tables..." and a new experiment's line cut into the display
    for name in ("mlflow.tracing.export.async_export_queue", "mlflow.tracking.fluent"):
        chatty = logging.getLogger(name)
        assert not chatty.isEnabledFor(logging.INFO) and chatty.isEnabledFor(logging.WARNING), name
    # a store that stops answering: a traceback per failure (60 in a 4-step run), which the spool says once
    for name in ("mlflow.store.db.utils", "mlflow.tracing.export.mlflow_v3"):
        assert not logging.getLogger(name).isEnabledFor(logging.ERROR), name
    spans = {s.name: s for s in trace.data.spans}
    assert set(spans) == {"trajectory", "turn 0", "turn 1", "calculate"}
    tool = spans["calculate"]
    assert tool.parent_id == spans["turn 0"].span_id and tool.status.status_code.value == "ERROR"
    assert (tool.start_time_ns, tool.end_time_ns) == (101_000_000_000, 101_500_000_000)
    assert tool.attributes["error_kind"] == "timeout" and tool.inputs == {"expression": "1+2"}
    assert (spans["trajectory"].start_time_ns, spans["trajectory"].end_time_ns) == (100_000_000_000, 101_500_000_000)


def test_a_too_short_id_prefix_says_how_long_one_must_be(tmp_path):
    from factory.tracking.tracker import RunLookupError

    t = Tracker(f"sqlite:///{tmp_path}/m.db", "exp")
    run_id = t.start("r", {}, {}, {})
    t.end()
    assert t.run(run_id[:8]).run_id == run_id
    with pytest.raises(RunLookupError, match=f"no run with id or name '{run_id[:4]}' .*; an id prefix needs 8 "):
        t.run(run_id[:4])
    with pytest.raises(RunLookupError, match=r"in sqlite:\S+$"):  # no hint for a name that is not a prefix
        t.run("zzzz")


def test_a_run_older_than_the_newest_1000_is_found_by_name_and_id_prefix(tmp_path):
    """A name or id prefix was looked for among the newest 1000 runs of the store only: in a team's store or
    after a sweep, `factory diff/export/eval --model/rescore/--resume` of an older run that `factory runs` listed
    said "no run with id or name"."""
    import sqlite3
    import uuid

    from mlflow.tracking import MlflowClient

    from factory.tracking.tracker import RunLookupError, open_tracker

    uri = f"sqlite:///{tmp_path}/m.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("sweep")
    old = client.create_run(exp, run_name="tiny-20261130-211818", start_time=1_000).info.run_id
    newer = client.create_run(exp, run_name="tiny-sweep", start_time=2_000).info.run_id
    # 1000 more runs, newer, as copies of one row of the runs table (the client takes ~15 s to make them)
    with sqlite3.connect(tmp_path / "m.db") as db:
        columns = [row[1] for row in db.execute("PRAGMA table_info(runs)")]
        copied = ", ".join("?" if c in ("run_uuid", "name", "start_time") else c for c in columns)
        db.executemany(f"INSERT INTO runs ({', '.join(columns)}) SELECT {copied} FROM runs WHERE run_uuid = ?",
                       [tuple({"run_uuid": uuid.uuid4().hex, "name": f"tiny-sweep-{i}", "start_time": 3_000 + i}[c]
                              for c in columns if c in ("run_uuid", "name", "start_time")) + (newer,)
                        for i in range(1000)])
    tracker = open_tracker(uri, read=True)
    assert old not in {r.run_id for r in tracker.runs()}  # (the newest 1000)
    assert tracker.run("tiny-20261130-211818").run_id == old
    assert tracker.run(old[:8]).run_id == old
    with pytest.raises(RunLookupError, match=f"no run with id or name '{old[:4]}' .*; an id prefix needs 8 "):
        tracker.run(old[:4])


def test_checkpoints_are_logged_as_tags_and_a_list(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/m.db"
    t = Tracker(uri, "exp")
    t.start("r", {}, {}, {})
    t.log_checkpoint(2, "runs/x/step_2")
    t.log_checkpoint(4, "runs/x/step_4")
    t.end()
    client = MlflowClient(uri)
    tags = client.get_run(t.run_id).data.tags
    assert tags["factory.checkpoint"] == str(tmp_path / "runs/x/step_4") and tags["factory.checkpoint_step"] == "4"
    listed = json.loads(open(client.download_artifacts(t.run_id, "checkpoints.json", str(tmp_path))).read())
    assert [(c["step"], c["hf"]) for c in listed] == [(2, str(tmp_path / "runs/x/step_2/hf")),
                                                      (4, str(tmp_path / "runs/x/step_4/hf"))]


def test_a_runs_algorithm_params_are_what_its_preset_decided(tmp_path, monkeypatch):
    """MLflow's params showed `algorithm.clip: null` for dapo (whose clip is (0.2, 0.28)): not comparable in
    its UI, where params are the spec as the run used it."""
    from mlflow.tracking import MlflowClient

    from factory.compiler.compile import compile_file

    _, plan = compile_file(REPO / "specs/tiny.yaml", ["algorithm.name=dapo", "algorithm.loss=dual_clip"])
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/m.db"
    t = Tracker(uri, "exp")
    t.start_run(plan, {"calc": []})
    t.end()
    params = MlflowClient(uri).get_run(t.run_id).data.params
    keys = ("clip", "dynamic_sampling", "dual_clip_c", "loss", "kl.apply")
    assert [params[f"algorithm.{k}"] for k in keys] == ["[0.2, 0.28]", "true", "3.0", "dual_clip", "loss"]
    assert plan.spec["algorithm"]["clip"] is None  # the plan (and its hash) keep the spec as written


def test_tools_json_keeps_each_schemas_keys_in_the_order_the_server_gave_them(tmp_path, monkeypatch):
    """The chat template writes a schema's keys into the prompt in their order; a replay offers the tools from
    tools.json: sorted there, the replayed model was prompted with other tokens, sampled otherwise and missed the
    recording at step 1 (tests/test_tools_recording.py::test_a_replayed_run_repeats_the_recorded_one)."""
    from factory.compiler.compile import compile_file

    _, plan = compile_file(REPO / "specs/tiny.yaml")
    monkeypatch.chdir(tmp_path)
    schema = {"type": "object", "properties": {"x": {"type": "number"}, "a": {"type": "string"}}, "required": ["x"]}
    listing = {"calc": [{"name": "calculate", "offered_as": "calculate", "description": "d", "inputSchema": schema}]}
    t = Tracker(f"sqlite:///{tmp_path}/m.db", "exp")
    t.start_run(plan, listing)
    t.end()
    saved = json.loads(t.download(t.run_id, "tools.json", tmp_path).read_text())
    assert json.dumps(saved) == json.dumps(listing)  # the same keys in the same order


def test_runs_of_one_spec_started_in_the_same_second_get_names_of_their_own(tmp_path, monkeypatch):
    """Two runs of a spec started in one second were both `tiny-<date>-<time>`: `factory diff NAME` then
    refused the name as ambiguous. The second gets `-2`, the third `-3`, in any experiment of the store."""
    import factory.tracking.mlflow_tracker as mt
    from factory.compiler.compile import compile_file

    _, plan = compile_file(REPO / "specs/tiny.yaml")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(mt, "run_name", lambda spec_name: f"{spec_name}-20261204-003000")  # one second
    names = []
    for experiment in ("a", "b", "a"):
        t = Tracker(f"sqlite:///{tmp_path}/m.db", experiment)
        t.start_run(plan, {"calc": []})
        t.end()
        names.append(t.run(t.run_id).name)
    assert names == ["tiny-20261204-003000", "tiny-20261204-003000-2", "tiny-20261204-003000-3"]
    assert t.run("tiny-20261204-003000-2").name == names[1]  # each name finds its own run


def test_run_time_tool_hash_equals_check_connect(monkeypatch):
    """`factory run` hashes the listing of its started servers exactly as `factory check --connect` does."""
    import asyncio

    from factory.compiler.compile import compile_file, with_tool_listing
    from factory.tools import ToolBox

    monkeypatch.chdir(REPO)
    spec, plain = compile_file("specs/tiny.yaml")
    _, connected = compile_file("specs/tiny.yaml", connect=True)
    assert plain.hashes["tools"] == {} and connected.hashes["tools"]

    async def listing():
        async with ToolBox.from_spec(spec.tools, base_dir=REPO) as box:
            return box.tool_listing()

    at_run = with_tool_listing(plain, asyncio.run(listing()))
    assert at_run.hashes == connected.hashes and at_run.tools == connected.tools == {"calc": ["calculate"]}


def test_environment_changes_cover_versions_hardware_and_resolved_dtypes():
    from factory.commands.diff import environment_changes
    from factory.tracking.tracker import TrackedRun

    def run(tags, params):
        return TrackedRun("r", "r", "0", "FINISHED", None, None, tags=tags, params=params)

    a = run({"factory.cpu": "AMD EPYC", "factory.version.torch": "2.13.0", "factory.plan_hash": "1"},
            {"resolved.rollout.dtype": "bfloat16", "train.lr": "1e-05"})
    b = run({"factory.cpu": "AMD EPYC", "factory.version.torch": "2.14.0", "factory.plan_hash": "2"},
            {"resolved.rollout.dtype": "float32", "train.lr": "3e-06"})
    assert environment_changes(a, b) == [
        {"key": "factory.version.torch", "a": "2.13.0", "b": "2.14.0"},
        {"key": "resolved.rollout.dtype", "a": "bfloat16", "b": "float32"}]


def test_environment_changes_name_the_ray_cluster_each_run_ran_on():
    """A local and a joined run of one spec: `factory diff` said "defined identically" and nothing of where they ran
    (the address is no part of the spec hash: the tag factory.ray_cluster records it)."""
    from factory.commands.diff import environment_changes
    from factory.tracking.tracker import TrackedRun

    def run(cluster):
        return TrackedRun("r", "r", "0", "FINISHED", None, None, tags={"factory.ray_cluster": cluster}, params={})

    assert environment_changes(run("local"), run("joined ***")) == [
        {"key": "factory.ray_cluster", "a": "local", "b": "joined ***"}]
    assert environment_changes(run("joined ***"), run("joined ***")) == []
    rescored = TrackedRun("r", "r", "0", "FINISHED", None, None, tags={"factory.rescore_of": "r"}, params={})
    assert environment_changes(run("local"), rescored) == []  # (a rescore records none: it ran none of the stages)


def test_environment_leaves_out_the_stages_an_eval_or_rescore_run_never_ran():
    """`factory diff TRAIN RESCORE` listed every resolved.rollout.* and resolved.update.* param of the training run
    as "X -> -" under where and how they ran: a rescore runs neither stage, an eval no update stage. Against such
    a run only what both resolved is compared; what both ran on still is."""
    from factory.commands.diff import environment_changes
    from factory.tracking.tracker import TrackedRun

    def run(tags, params):
        return TrackedRun("r", "r", "0", "FINISHED", None, None, tags=tags, params=params)

    resolved = {"resolved.rollout.engine": "hf", "resolved.rollout.dtype": "float32",
                "resolved.update.device": "cpu", "resolved.update.dtype": "float32"}
    trained = run({"factory.version.torch": "2.13.0"}, resolved)
    rescored = run({"factory.version.torch": "2.13.0", "factory.rescore_of": "r"}, {})
    evaluated = run({"factory.version.torch": "2.14.0", "factory.kind": "eval"},
                    {"resolved.rollout.engine": "hf", "resolved.rollout.dtype": "bfloat16"})
    assert environment_changes(trained, rescored) == []
    assert environment_changes(evaluated, trained) == [
        {"key": "factory.version.torch", "a": "2.14.0", "b": "2.13.0"},
        {"key": "resolved.rollout.dtype", "a": "bfloat16", "b": "float32"}]
    # two training runs: a stage one of them did not resolve is a difference
    assert environment_changes(trained, run({"factory.version.torch": "2.13.0"}, {})) == [
        {"key": k, "a": v, "b": None} for k, v in sorted(resolved.items())]


def test_records_wait_in_the_spool_while_the_server_is_down_and_each_step_is_logged_once(tracking_server, tmp_path,
                                                                                        monkeypatch):
    """A real `mlflow server` behind a forwarder whose cable is pulled after step 1 and put back before step
    4: steps 2 and 3 wait in the run's spool (each call returns at once, the run goes on), and are sent,
    in order, when the server answers again. A driver killed with records unsent leaves them in the spool;
    the resumed run's tracker sends them first and does not log those steps again."""
    import time

    from mlflow.tracking import MlflowClient

    import factory.tracking.mlflow_tracker as mt
    from tests.servers import Unpluggable

    monkeypatch.setattr(mt, "RETRY_S", 0.0)  # try the server again at every record (the run waits 10 s)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # each try fails at once
    cable = Unpluggable(int(tracking_server.rsplit(":", 1)[1]))
    uri = f"http://127.0.0.1:{cable.port}"
    notes: list[str] = []
    t = Tracker(uri, "spool")
    t.start("spool", {}, {}, {})
    t.notify = notes.append
    t.open_spool(tmp_path / "spool")

    def step(tracker, n):
        tracker.log_trajectories([_traj()], n, traces=0)
        tracker.log_metrics({"timing/step_s": 1.0, "reward/mean": n / 10}, step=n)

    step(t, 1)
    cable.down()
    t0 = time.monotonic()
    step(t, 2)
    step(t, 3)
    assert time.monotonic() - t0 < 20  # each record tried once, fast (MLflow's own retries: minutes)
    assert len(t.spool.records) == 4 and "does not answer" in notes[0]
    cable.up()
    step(t, 4)
    assert t.spool.records == [] and "answers again" in notes[-1]
    # the server goes away again at step 5, and the driver is killed before it comes back
    cable.down()
    step(t, 5)
    assert len(t.spool.records) == 2
    cable.up()
    resumed = Tracker(uri, "spool")
    resumed.run_id, resumed.logged = t.run_id, 4  # what factory.runtime.resume finds in the store: step 4
    resumed.open_spool(tmp_path / "spool")  # sends step 5, left by the killed driver
    assert resumed.logged == 5 and resumed.spool.records == []
    step(resumed, 5)  # computed again after the checkpoint: not logged twice
    step(resumed, 6)
    resumed.end("FINISHED")
    client = MlflowClient(tracking_server)
    assert [m.step for m in client.get_metric_history(t.run_id, "reward/mean")] == [1, 2, 3, 4, 5, 6]
    tables = [f.path for f in client.list_artifacts(t.run_id, "trajectories")]
    assert tables == [f"trajectories/step_{n:05d}.parquet" for n in range(1, 7)]
    assert client.get_run(t.run_id).info.status == "FINISHED"
    cable.down()


def test_a_store_that_hangs_holds_the_run_a_probe_per_retry_not_a_timeout_per_record(tracking_server, tmp_path,
                                                                                      monkeypatch):
    """A store that accepts connections and never answers (a network partition, a proxy whose backend is gone)
    held each send for MLflow's timeout, twice (2 x 30 s), and stamped before the send, the retry clock was
    past RETRY_S when the next record came: each record tried again, ~60 s a record, 2-5 records a step.
    Now the store is tried once when it stops answering, then at most a short probe (PROBE_S) per RETRY_S
    until it answers, and the spool is sent, in order. Scaled down: a request's timeout 1 s, RETRY_S 0.5 s,
    PROBE_S 0.2 s."""
    import time

    from mlflow.tracking import MlflowClient

    import factory.tracking.mlflow_tracker as mt
    from tests.servers import Unpluggable

    monkeypatch.setattr(mt, "RETRY_S", 0.5)
    monkeypatch.setattr(mt, "PROBE_S", 0.2)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    cable = Unpluggable(int(tracking_server.rsplit(":", 1)[1]))
    try:
        notes: list[str] = []
        t = Tracker(f"http://127.0.0.1:{cable.port}", "hang")
        t.start("hang", {}, {}, {})
        t.notify = notes.append
        t.open_spool(tmp_path / "spool")
        t.log_metrics({"timing/step_s": 1.0}, step=1)
        cable.hang()
        # What each record tried, counted: sends to the store, and probes (a wall-clock bound alone failed once on a
        # loaded 2-core machine: a later record held 1.46 s where 0.7 s was the bound)
        tried: list[str] = []
        send, probe = t._send, mt.store_answers
        monkeypatch.setattr(t, "_send", lambda *a: (tried.append("send"), send(*a))[1])
        monkeypatch.setattr(mt, "store_answers", lambda *a: (tried.append("probe"), probe(*a))[1])
        held = []
        for n in (2, 3):
            for record in (lambda: t.log_trajectories([_traj()], n, traces=0),
                           lambda: t.log_metrics({"timing/step_s": 1.0}, step=n)):
                t0 = time.monotonic()
                record()
                held.append(time.monotonic() - t0)
            time.sleep(mt.RETRY_S)  # the next step's first record tries the store again
        # the first record waits out one request (1 s); the next, within RETRY_S, tries nothing; step 3's first a
        # probe (0.2 s), which fails, so no request; its second nothing again
        assert tried == ["send", "probe"], (tried, held)
        assert held[0] < 5 and max(held[1:]) < 5, held  # (MLflow's own retries, not turned off: minutes)
        monkeypatch.setattr(t, "_send", send)
        monkeypatch.setattr(mt, "store_answers", probe)
        assert len(t.spool.records) == 4 and "does not answer" in notes[0], notes
        cable.up()
        time.sleep(mt.RETRY_S)
        t.log_metrics({"timing/step_s": 1.0}, step=5)
        assert t.spool.records == [] and "answers again" in notes[-1], notes
        # it hangs again at the end: the end waits two probes and the request marking the run ended (1 s), not
        # also a read of the run (1 s more), and says where the record left waits; `--resume` sends it
        cable.hang()
        t.log_metrics({"timing/step_s": 1.0}, step=6)
        t0 = time.monotonic()
        t.end("FINISHED")
        ended = time.monotonic() - t0
        assert ended < 1.9 and any("could not be sent" in n and "--resume" in n for n in notes), (ended, notes)
        cable.up()
        resumed = Tracker(t.uri, "hang")
        resumed.run_id, resumed.logged = t.run_id, 5
        resumed.open_spool(tmp_path / "spool")
        assert resumed.spool.records == []
        client = MlflowClient(tracking_server)
        assert [m.step for m in client.get_metric_history(t.run_id, "timing/step_s")] == [1, 2, 3, 5, 6]
        tables = [f.path for f in client.list_artifacts(t.run_id, "trajectories")]
        assert tables == [f"trajectories/step_{n:05d}.parquet" for n in (2, 3)]
    finally:
        cable.down()


def test_the_probe_tells_a_store_that_answers_from_one_that_refuses_or_hangs(tracking_server, tmp_path):
    """`store_answers`, the probe sent before the spool while the store is down: any answer counts (a
    server that does not know the run answers 404), a refused connection or a socket that never answers do
    not, the latter within about its timeout; a store that is not HTTP is simply tried."""
    import time

    from factory.tracking.mlflow_tracker import store_answers
    from tests.servers import free_port

    assert store_answers(tracking_server, "0" * 32, 0.5)
    assert not store_answers(f"http://127.0.0.1:{free_port()}", "0" * 32, 0.5)
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(8)  # the kernel completes the connection; nothing ever reads or answers it
        t0 = time.monotonic()
        assert not store_answers(f"http://127.0.0.1:{hole.getsockname()[1]}", "0" * 32, 0.2)
        assert time.monotonic() - t0 < 0.6
    assert store_answers(f"sqlite:///{tmp_path}/gone/m.db", "0" * 32, 0.2)


class _Gate:
    """A tracking server that answers every request with `status` (and an MLflow error body), or takes it (200)."""

    def __init__(self):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        gate = self
        self.status = 200

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                codes = {401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 429: "REQUEST_LIMIT_EXCEEDED",
                         400: "INVALID_PARAMETER_VALUE"}
                body = json.dumps({"error_code": codes[gate.status], "message": "Token expired"}
                                  if gate.status != 200 else {}).encode()
                self.send_response(gate.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.uri = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("status", [401, 403, 429])
def test_records_wait_while_the_store_refuses_our_credentials(tmp_path, monkeypatch, status):
    """A token that expired mid-run, an auth proxy's 401/403, a rate limit: the store's answer says nothing about
    the record, and every record was dropped as "refused", for good. They wait in the spool (the store counted as
    down, the note says it refuses our credentials), and are sent once it takes them. A record the store refuses
    as wrong (400: INVALID_PARAMETER_VALUE) is still dropped: sent again it is refused again."""
    import factory.tracking.mlflow_tracker as mt

    monkeypatch.setattr(mt, "RETRY_S", 0.0)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # (a 429 is retried by MLflow itself)
    gate = _Gate()
    try:
        t = Tracker(gate.uri, "e")
        notes: list[str] = []
        t.notify = notes.append
        t.run_id = "0" * 32  # a run opened before the token expired
        t.open_spool(tmp_path / "spool")
        gate.status = status
        t.log_metrics({"reward/mean": 0.5, "timing/step_s": 1.0}, step=7)
        t.log_tags({"factory.checkpoint_step": "7"})
        assert len(t.spool.records) == 2 and not any("dropped" in n for n in notes), notes
        assert ("refuses our credentials" in notes[0]) == (status != 429), notes
        gate.status = 200  # the token renewed
        t.log_metrics({"reward/mean": 0.6, "timing/step_s": 1.0}, step=8)
        assert t.spool.records == [] and "answers again" in notes[-1], notes
        gate.status = 400
        t.log_metrics({"reward/mean": 0.7, "timing/step_s": 1.0}, step=9)
        assert t.spool.records == [] and "refused and dropped" in notes[-1], notes
    finally:
        gate.close()


def test_a_refusal_is_told_from_a_store_that_does_not_take_our_request():
    """`_refusal`: what the store's answer says of the record. Wrong (dropped): a bad value, no such run, a body too
    large (an artifact upload through a proxy, a requests error); not about the record (it waits): our credentials
    refused, a rate limit, a server error."""
    import requests
    from mlflow.exceptions import MlflowException, RestException

    from factory.tracking.mlflow_tracker import _refusal

    def http_error(status):
        response = requests.Response()
        response.status_code = status
        return requests.HTTPError(f"{status} Client Error", response=response)

    assert _refusal(RestException({"error_code": "INVALID_PARAMETER_VALUE", "message": "bad name"})) == "record"
    assert _refusal(RestException({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no run"})) == "record"
    assert _refusal(http_error(413)) == "record"
    assert _refusal(RestException({"error_code": "UNAUTHENTICATED", "message": "expired"})) == "credentials"
    assert _refusal(RestException({"error_code": "PERMISSION_DENIED", "message": "no"})) == "credentials"
    assert _refusal(http_error(407)) == "credentials"
    assert _refusal(RestException({"error_code": "REQUEST_LIMIT_EXCEEDED", "message": "slow down"})) is None
    assert _refusal(http_error(408)) is None and _refusal(http_error(502)) is None
    assert _refusal(MlflowException("down")) is None and _refusal(ConnectionError("refused")) is None
    # a REST call answered by a proxy's HTML page: MLflow maps a status it has no error code for (407, 413) to
    # INTERNAL_ERROR, i.e. 500, so a too-large record waited for ever and refused proxy credentials read as "down"
    from mlflow.utils.rest_utils import verify_rest_response

    def proxy_page(status):
        response = requests.Response()
        response.status_code, response._content = status, b"<html><body>nginx</body></html>"
        try:
            verify_rest_response(response, "/api/2.0/mlflow/runs/log-batch")
        except MlflowException as e:
            return e
        raise AssertionError(f"MLflow took HTTP {status}")

    assert _refusal(proxy_page(413)) == "record" and _refusal(proxy_page(407)) == "credentials"
    assert _refusal(proxy_page(403)) == "credentials" and _refusal(proxy_page(502)) is None


def test_end_never_raises_and_says_where_the_records_wait(tmp_path, monkeypatch):
    """The store is gone at the end of the run: `end` tells where the unsent records are and returns, so the
    driver's teardown (tool servers, Ray) always runs after it."""
    from tests.servers import free_port

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    t = Tracker(f"http://127.0.0.1:{free_port()}", "gone")
    t.run_id = "0" * 32
    notes: list[str] = []
    t.notify = notes.append
    t.open_spool(tmp_path / "spool")
    t.log_metrics({"timing/step_s": 1.0}, step=1)
    t.end("FINISHED")
    assert any("could not be sent: they wait in" in n and str(tmp_path / "spool") in n for n in notes), notes


def test_runs_tell_a_dead_driver_and_an_eval_or_rescore_from_a_training_run():
    """`factory runs`: a SIGKILLed driver leaves its run RUNNING in MLflow forever (its duration grew on every
    listing); an eval or rescore run showed its spec's train.steps as if it had trained ("3/2")."""
    import subprocess
    import sys

    from psutil import Process

    from factory.tracking.mlflow_tracker import DRIVER_TAG, driver_tag
    from factory.tracking.runs import run_summary
    from factory.tracking.tracker import TrackedRun

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    started = Process(gone.pid).create_time()
    gone.wait()
    dead = json.dumps({"host": socket.gethostname(), "pid": gone.pid, "started": started})
    params = {"train.steps": "2"}
    s = run_summary(TrackedRun("r1", "a", "0", "RUNNING", 100.0, None, tags={DRIVER_TAG: dead}, params=params))
    assert s["driver_alive"] is False and s["duration_s"] is None and s["kind"] == "train" and s["steps"] == 2
    s = run_summary(TrackedRun("r2", "b", "0", "RUNNING", 100.0, None, tags={DRIVER_TAG: driver_tag()}, params=params))
    assert s["driver_alive"] is True and s["duration_s"] > 0
    # resumed after a stop, so MLflow still holds the stopped session's end time (a negative duration, -0.7 min)
    s = run_summary(TrackedRun("r1b", "a", "0", "RUNNING", 100.0, 110.0, tags={DRIVER_TAG: dead, "factory.idle_s": "50"},
                               params=params))
    assert s["duration_s"] is None
    s = run_summary(TrackedRun("r2b", "b", "0", "RUNNING", 100.0, 110.0, tags={DRIVER_TAG: driver_tag()}, params=params))
    assert s["duration_s"] > 1000
    other_host = json.dumps({"host": "elsewhere", "pid": 1, "started": 0.0})
    assert run_summary(TrackedRun("r3", "c", "0", "RUNNING", 1.0, None, tags={DRIVER_TAG: other_host}))["driver_alive"] is None
    ev = run_summary(TrackedRun("r4", "d", "0", "FINISHED", 1.0, 2.0, tags={"factory.kind": "eval"}, params=params))
    rescored = run_summary(TrackedRun("r5", "e", "0", "FINISHED", 1.0, 2.0, tags={"factory.rescore_of": "r1"},
                                      params=params))
    assert (ev["kind"], ev["steps"], rescored["kind"], rescored["steps"]) == ("eval", None, "rescore", None)


def test_a_runs_duration_counts_from_its_command_start_as_its_summary_does():
    """The summary counted from `factory run`'s start, `factory runs` from the MLflow run's start 30-60 s
    later: two durations for one run. A run that records its command's start is counted from it."""
    from factory.tracking.mlflow_tracker import STARTED_TAG
    from factory.tracking.runs import run_summary
    from factory.tracking.tracker import TrackedRun

    assert run_summary(TrackedRun("r", "a", "0", "FINISHED", 160.0, 400.0, tags={STARTED_TAG: "100.0"}))[
        "duration_s"] == 300.0
    resumed = TrackedRun("r", "a", "0", "FINISHED", 160.0, 400.0, tags={STARTED_TAG: "100.0", "factory.idle_s": "50"})
    assert run_summary(resumed)["duration_s"] == 250.0
    assert run_summary(TrackedRun("r", "a", "0", "FINISHED", 160.0, 400.0))["duration_s"] == 240.0  # an older run


def test_a_journal_line_cut_short_loses_no_later_record(tmp_path):
    """A kill or a full disk in the middle of a journal line: the next session appended its first record to that
    fragment, the two read as one unreadable line, and that step was never logged (later ones were, so nothing
    asked for it again). A `sent` written but not yet on disk at a power cut is empty: it read as an error."""
    from factory.tracking.spool import JOURNAL, SENT, Spool

    spool = Spool(tmp_path)
    for step in (1, 2):
        spool.add("metrics", step=step)
    with open(tmp_path / JOURNAL, "a") as f:
        f.write('{"kind": "metrics", "seq": 3, "st')  # the cut line: never acknowledged to anyone
    resumed = Spool(tmp_path)
    assert [r["step"] for r in resumed.records] == [1, 2]
    for step in (3, 4):
        resumed.add("metrics", step=step)
    assert [(r["seq"], r["step"]) for r in Spool(tmp_path).records] == [(1, 1), (2, 2), (3, 3), (4, 4)]
    (tmp_path / SENT).write_text("")
    assert Spool(tmp_path).sent == 0 and len(Spool(tmp_path).records) == 4


def _spooled_run(tmp_path: Path) -> tuple[Tracker, Path, list[str]]:
    """A run on a sqlite store with its spool, step 1 logged: (its tracker, the store's file, its notes)."""
    db = tmp_path / "t.db"
    t = Tracker(f"sqlite:///{db}", "e")
    t.start("r", {}, {}, {})
    t.open_spool(tmp_path / "spool")
    notes: list[str] = []
    t._note = notes.append
    t.log_metrics({"m": 1.0}, step=1)
    return t, db, notes


def test_records_that_wait_for_a_store_that_lost_the_run_are_not_promised_to_resume(tmp_path):
    """The store's sqlite file deleted mid-run: the end said `--resume RUN` sends the records that waited, and
    that command answered "no run with id ..."."""
    import os

    t, db, notes = _spooled_run(tmp_path)
    os.remove(db)
    t.log_metrics({"m": 2.0}, step=2)
    t.end()
    (said,) = [n for n in notes if "could not be sent" in n]
    assert f"no longer holds run {t.run_id}" in said and "--resume cannot find the run" in said
    assert "sends them" not in said


def test_a_disk_that_cannot_hold_the_spool_does_not_stop_the_run(tmp_path, monkeypatch):
    """The run's folder full (or read-only) mid-run: the spool's write raised out of the tracker and the run
    ended as an internal error (exit 1), where tracking never stops a run. Now the record goes straight to the
    store, after what waits, said once; lost only when the store does not take it either."""
    import errno

    from factory.tracking.spool import Spool

    t, db, notes = _spooled_run(tmp_path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Spool, "add", full)
    t.log_metrics({"m": 2.0}, step=2)
    t.log_tags({"after": "full"})
    assert [m.value for m in t.client.get_metric_history(t.run_id, "m")] == [1.0, 2.0]
    assert t.client.get_run(t.run_id).data.tags["after"] == "full"
    assert notes == [f"{tmp_path / 'spool'} cannot be written (No space left on device): records are sent to the "
                     "store without being kept on disk first"]
    import os

    os.remove(db)  # the store gone too: the record is lost, and said to be
    t.log_metrics({"m": 3.0}, step=3)
    assert "a metrics record was lost" in notes[-1]
    t.end()  # (the fluent run ended: the next test of this worker starts its own)


def test_a_spooled_step_is_logged_once_at_the_time_it_was_logged(tmp_path):
    """A step's metrics and its `factory.step` tag went as two requests: a store failing between them had the
    record sent again whole, and the step was twice in the metric history. And each metric was stamped when sent:
    after an outage every step that waited carried the moment the store came back."""
    import time

    t, _, _ = _spooled_run(tmp_path)
    real, sent = t.client.log_batch, []

    def took_it_then_failed(run_id, metrics=(), params=(), tags=(), synchronous=None):
        real(run_id, metrics=metrics, params=params, tags=tags, synchronous=synchronous)
        sent.append(tags)
        if len(sent) == 1:  # it took the batch, and the connection dropped before its answer
            raise ConnectionError("store went away")

    t.client.log_batch = took_it_then_failed
    logged = time.time()
    t.log_metrics({"timing/step_s": 1.0, "reward/mean": 0.5}, step=2)
    assert len(t.spool.records) == 1  # waits in the spool
    time.sleep(1.5)  # the outage
    assert t.flush(force=True)  # sent again whole: the store keeps the same metric (value, step, time) once
    t.client.log_batch = real
    t.end()
    assert [[tag.key for tag in tags] for tags in sent] == [["factory.step"], ["factory.step"]]  # one request a try
    history = t.client.get_metric_history(t.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(2, 0.5)]
    assert history[0].timestamp / 1000 == pytest.approx(logged, abs=0.5)
    assert t.client.get_run(t.run_id).data.tags["factory.step"] == "2"


def test_a_spec_key_the_store_refuses_as_a_name_is_written_as_it_takes_it(tmp_path):
    """A `metrics` entry named `pass@1` compiled, and the run's start raised MlflowException (Invalid value
    "metrics.pass@1"); so did a tracking.tags key with `=` and a key over 250 characters. Distinct keys stay
    distinct."""
    long = "k" * 300
    t = Tracker(f"sqlite:///{tmp_path / 't.db'}", "e")
    t.start("r", {"metrics": {"pass@1": "correct", "pass_1": "other", "ok": "x"}, "rewards": {long: {"w": 1}}},
            {"team=a": "1", "a//b": "2", "..": "3"}, {})
    t.end()
    run = t.client.get_run(t.run_id)
    hashed = "metrics.pass_1-" + hashlib.sha256(b"metrics.pass@1").hexdigest()[:8]
    assert run.data.params == {"metrics.pass_1": "other", hashed: "correct", "metrics.ok": "x",
                               f"rewards.{long}.w"[:250]: "1"}
    assert {k: v for k, v in run.data.tags.items() if not k.startswith(("factory.", "mlflow."))} == {
        "team_a": "1", "a__b": "2", "__": "3"}
    from factory.tracking.mlflow_tracker import mlflow_keys

    assert mlflow_keys(["a.b", "a/b", "a@b", "a#b"]) == {
        "a.b": "a.b", "a/b": "a/b", "a#b": "a_b", "a@b": "a_b-" + hashlib.sha256(b"a@b").hexdigest()[:8]}


def test_a_metric_name_the_store_refuses_is_written_as_it_takes_it(tmp_path):
    """One name MLflow refuses ('?' from a tool call that could not be read, a tool server's `web?search`) lost
    the whole record: every metric of the step."""
    t = Tracker(f"sqlite:///{tmp_path / 't.db'}", "e")
    t.start("r", {}, {}, {})
    t.open_spool(tmp_path / "spool")
    t.log_metrics({"tools/?/calls": 1.0, "tools/web?search/calls": 2.0, "reward/mean": 0.5}, step=1)
    t.end()
    metrics = t.client.get_run(t.run_id).data.metrics
    assert metrics == {"tools/_/calls": 1.0, "tools/web_search/calls": 2.0, "reward/mean": 0.5}


def test_a_metric_name_the_store_refuses_as_a_path_or_for_its_length_is_written_as_it_takes_it(tmp_path):
    """MLflow also refuses a metric name that is not a normal path (`a/`, `a//b`, `./a`, `a/../b`) or is over 250
    characters, and with it the whole record: a `metrics:` entry `pass@1/` (eval/pass_1/) or a reward node `fmt/`
    (rewards/fmt//mean) lost every metric of every step. Each name is written as a param name would be, the same
    at every step, and one that becomes another's name keeps its own."""
    t = Tracker(f"sqlite:///{tmp_path / 't.db'}", "e")
    t.start("r", {}, {}, {})
    notes: list[str] = []
    t.notify = notes.append
    t.open_spool(tmp_path / "spool")
    names = {"eval/pass@1/": 1.0, "rewards/fmt//mean": 2.0, "./a": 3.0, "a/../b": 4.0, "x" * 300: 5.0,
             "reward/mean": 0.5}
    for step in (1, 2):
        t.log_metrics(names, step=step)
    t.log_metrics({"eval_pass_1_": 6.0}, step=3)  # the name `eval/pass@1/` took: a key of its own now
    t.end()
    metrics = t.client.get_run(t.run_id).data.metrics
    assert not notes and len(metrics) == 7, (metrics, notes)
    assert {k: v for k, v in metrics.items() if k != "eval_pass_1_"} == {
        "rewards_fmt__mean": 2.0, "__a": 3.0, "a____b": 4.0, "x" * 250: 5.0, "reward/mean": 0.5,
        next(k for k in metrics if k.startswith("eval_pass_1_-")): 6.0}
    assert [m.step for m in t.client.get_metric_history(t.run_id, "eval_pass_1_")] == [1, 2]


def test_a_spool_line_whose_flush_failed_is_taken_back(tmp_path, monkeypatch):
    """A full disk can fail the journal's fsync after its line landed: the tracker then sends the record itself,
    and a later driver found the line and sent it again."""
    import errno

    from factory.tracking import spool as spool_module
    from factory.tracking.spool import Spool

    spool = Spool(tmp_path / "spool")
    spool.add("tags", tags={"a": "1"})

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(spool_module.os, "fsync", full)
    with pytest.raises(OSError):
        spool.add("tags", tags={"b": "2"})
    monkeypatch.undo()
    assert [r["tags"] for r in Spool(tmp_path / "spool").records] == [{"a": "1"}]
