"""Runs you can compare, through a real `mlflow server` on 127.0.0.1: `factory diff`, `factory runs`, the
REST API, MLflow traces, and the MLflow UI in a real headless browser.

The pair of tiny runs (tests/tracked_runs.py) differs in one reward weight only.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from tests.tracked_runs import CHANGE, REPO, STEPS, factory, factory_here, project_copy

ARTIFACTS = REPO / "test-artifacts"  # git-ignored; CI keeps it


def _diff(tiny_runs, *args: str) -> subprocess.CompletedProcess[str]:
    return factory_here("diff", *args, cwd=tiny_runs.work_a, uri=tiny_runs.uri)


@pytest.fixture(scope="module")
def report(tiny_runs):
    out = _diff(tiny_runs, tiny_runs.a.info.run_id, tiny_runs.b.info.run_name, "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "diff.json").write_text(out.stdout)  # kept by CI: what a user would see
    return json.loads(out.stdout)


def test_diff_names_exactly_the_changed_reward_weight(report, tiny_runs):
    key, a, b = CHANGE
    assert [(c["kind"], c["key"], c["a"], c["b"]) for c in report["changes"]] == [("setting", key, a, b)]
    assert report["identical"] is False and report["warnings"] == [] and report["notes"] == []
    assert report["a"]["run_id"] == tiny_runs.a.info.run_id and report["b"]["run_id"] == tiny_runs.b.info.run_id
    assert report["a"]["plan_hash"] != report["b"]["plan_hash"]


def test_diff_shows_both_metric_sets_with_deltas(report, tiny_runs):
    rows = {(m["metric"], m["agg"]): m for m in report["metrics"]}
    for key in (("reward/mean", "final"), ("reward/mean", "best"), ("rewards/correct/mean", "final"),
                ("rewards/well_formed/mean", "final"), ("eval/accuracy", "step 0"), ("eval/accuracy", "final"),
                ("timing/step_s", "mean"), ("timing/generate_s", "mean"), ("timing/update_s", "mean"),
                ("perf/tokens_per_s", "mean")):
        row = rows[key]
        assert row["a"] is not None and row["b"] is not None, key
        assert row["delta"] == pytest.approx(row["b"] - row["a"]), key
    assert rows[("reward/mean", "final")]["a"] == pytest.approx(tiny_runs.a.data.metrics["reward/mean"])
    assert rows[("reward/mean", "final")]["b"] == pytest.approx(tiny_runs.b.data.metrics["reward/mean"])
    assert rows[("reward/mean", "best")]["a"] >= rows[("reward/mean", "final")]["a"]


def test_diff_shows_trajectories_of_a_shared_prompt_side_by_side(report, tiny_runs):
    # Same seed and data: both runs saw the 4 eval questions (and the same training prompts).
    assert len(report["prompts"]) >= 4 and report["prompts"][0]["split"] == "eval"
    shown = report["trajectories"]
    assert shown["index"] == 0 and shown["prompt"] == report["prompts"][0]["prompt"]
    assert shown["prompt"].startswith("What is ")  # the question itself, not the messages' JSON
    for side in ("a", "b"):
        (t,) = shown[side]  # greedy eval: one trajectory per prompt, the last step's
        assert t["step"] == STEPS and t["completion"] and isinstance(t["reward"], float)
        assert set(t["rewards"]) == {"correct", "well_formed", "total"}
    other = json.loads(_diff(tiny_runs, tiny_runs.a.info.run_id, tiny_runs.b.info.run_id, "--json", "--prompt", "1").stdout)
    assert other["trajectories"]["prompt"] == report["prompts"][1]["prompt"]


def test_diff_as_text(tiny_runs):
    out = _diff(tiny_runs, tiny_runs.a.info.run_name, tiny_runs.b.info.run_id[:8])
    assert out.returncode == 0, out.stderr[-3000:]
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "diff.txt").write_text(out.stdout)
    assert "what differs" in out.stdout and CHANGE[0] in out.stdout and "reward/mean" in out.stdout
    assert "prompts seen by both runs" in out.stdout


def test_a_run_without_a_plan_is_an_error_never_identical(tiny_runs):
    client = tiny_runs.client
    exp = client.get_experiment_by_name("tiny").experiment_id
    bare = client.create_run(exp, run_name="not-from-factory")
    client.log_param(bare.info.run_id, "train.lr", "1e-05")
    client.set_terminated(bare.info.run_id)
    out = _diff(tiny_runs, tiny_runs.a.info.run_id, bare.info.run_id, "--json")
    assert out.returncode == 2 and out.stdout == ""
    assert f"run not-from-factory ({bare.info.run_id}) has no plan.json artifact" in out.stderr
    assert "identical" not in out.stderr
    client.delete_run(bare.info.run_id)


def test_runs_lists_both_runs(tiny_runs):
    out = factory_here("runs", "--experiment", "tiny", "--json", cwd=tiny_runs.work_a, uri=tiny_runs.uri)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["run_id"]: r for r in json.loads(out.stdout)}
    for run in (tiny_runs.a, tiny_runs.b):
        r = rows[run.info.run_id]
        assert r["status"] == "FINISHED" and r["spec"] == "tiny" and r["steps_done"] == STEPS == r["steps"]
        assert r["final_reward"] == pytest.approx(run.data.metrics["reward/mean"])
        assert set(r["eval"]) >= {"eval/accuracy", "eval/reward"} and r["duration_s"] > 0
    text = factory_here("runs", cwd=tiny_runs.work_a, uri=tiny_runs.uri)
    assert tiny_runs.a.info.run_id[:8] in text.stdout and "FINISHED" in text.stdout


def test_rest_api_returns_both_runs_with_params_and_artifacts(tiny_runs):
    exp = tiny_runs.a.info.experiment_id
    found = requests.post(f"{tiny_runs.uri}/api/2.0/mlflow/runs/search", json={"experiment_ids": [exp]},
                          timeout=30).json()["runs"]
    runs = {r["info"]["run_id"]: r for r in found}
    key, a, b = CHANGE
    for run, weight in ((tiny_runs.a, a), (tiny_runs.b, b)):
        r = runs[run.info.run_id]
        params = {p["key"]: p["value"] for p in r["data"]["params"]}
        assert params[key] == weight and params["train.steps"] == str(STEPS)
        tags = {t["key"]: t["value"] for t in r["data"]["tags"]}
        for tag in ("factory.spec_hash", "factory.plan_hash", "factory.version.torch", "factory.version.mcp",
                    "factory.version.deepspeed", "factory.version.vllm", "factory.cpu", "factory.gpu",
                    "factory.checkpoint"):
            assert tags.get(tag), tag
        listed = requests.get(f"{tiny_runs.uri}/api/2.0/mlflow/artifacts/list", params={"run_id": run.info.run_id},
                              timeout=30).json()["files"]
        assert {f["path"] for f in listed} >= {"plan.json", "spec.yaml", "tools.json", "checkpoints.json",
                                               "trajectories", "eval_trajectories"}


def test_the_run_records_what_defined_it(tiny_runs):
    """The tool listing is hashed at run time (the plan of `factory check` has no tool hash), and the
    checkpoint tag points at the saved checkpoint."""
    client, run = tiny_runs.client, tiny_runs.a
    folder = Path(client.download_artifacts(run.info.run_id, "", str(tiny_runs.work_a / "artifacts-a")))
    plan = json.loads((folder / "plan.json").read_text())
    tools = json.loads((folder / "tools.json").read_text())
    assert [t["name"] for t in tools["calc"]] == ["calculate"] and tools["calc"][0]["inputSchema"]
    assert set(plan["hashes"]["tools"]) == {"calc"} and plan["hashes"]["run"] == run.data.tags["factory.plan_hash"]
    checkpoints = json.loads((folder / "checkpoints.json").read_text())
    assert [c["step"] for c in checkpoints] == [STEPS]
    assert run.data.tags["factory.checkpoint"] == checkpoints[-1]["path"]
    folder = Path(run.data.tags["factory.checkpoint_dir"])  # factory export reads it: the run's own folder
    assert folder == tiny_runs.work_a / "runs" / "tiny" / f"{run.info.run_name}-{run.info.run_id[:8]}"
    assert Path(checkpoints[-1]["path"]).parent == folder
    assert (Path(checkpoints[-1]["hf"]) / "model.safetensors").is_file()


def test_trajectories_are_mlflow_traces(tiny_runs):
    import mlflow

    mlflow.set_tracking_uri(tiny_runs.uri)
    traces = mlflow.search_traces(locations=[tiny_runs.a.info.experiment_id], run_id=tiny_runs.a.info.run_id,
                                  return_type="list")
    by_split = {s: [t for t in traces if t.info.tags.get("factory.split") == s] for s in ("train", "eval")}
    assert len(by_split["train"]) == STEPS * 8 and len(by_split["eval"]) == 2 * 4  # log_trajectories: 8, eval: 4
    spans = [s for t in traces for s in t.data.spans]
    tools = [s for s in spans if s.span_type == "TOOL"]
    # named as the model called them (an unknown name is the model's error, recorded as such)
    assert any(s.name == "calculate" and s.attributes["status"] == "ok" for s in tools)
    assert all(s.attributes["latency_s"] >= 0 and s.inputs is not None for s in tools)
    assert all(s.status.status_code.value == ("OK" if s.attributes["status"] == "ok" else "ERROR") for s in tools)
    turns = [s for s in spans if s.span_type == "LLM"]
    assert turns and all(s.name.startswith("turn ") and s.end_time_ns >= s.start_time_ns for s in turns)


# ------------------------------------------------------------------------------------- tool servers
_TOOLS_A = '''"""The calculator MCP server, as installed at first."""
from factory.examples.calculator import server

if __name__ == "__main__":
    server.run("stdio")
'''
_TOOLS_B = _TOOLS_A.replace("as installed at first", "after an upgrade that added a tool").replace(
    'if __name__', '''@server.tool(description="The square root of a non-negative number.")
def sqrt(x: float) -> str:
    return str(x ** 0.5)


if __name__''')


def _track_plan(work: Path, uri: str, monkeypatch) -> str:
    """What `factory run` records before it trains: the plan compiled from the spec, the tool servers started
    (a real ToolBox), their listing hashed into the plan, the MLflow run opened. Returns the run id."""
    from factory.compiler.compile import compile_file
    from factory.tools import ToolBox
    from factory.tracking.mlflow_tracker import MlflowTracker as Tracker

    monkeypatch.chdir(work)
    spec, plan = compile_file("specs/tiny.yaml", ["tools.calc.args=[-m,calc_tools]"])

    async def listing():
        async with ToolBox.from_spec(spec.tools, base_dir=work) as box:
            return box.tool_listing()

    tracker = Tracker(uri, "tool-change")
    tracker.start_run(plan, asyncio.run(listing()))
    tracker.end()
    return tracker.run_id


def test_a_changed_tool_server_shows_as_a_tool_schema_change(tracking_server, tmp_path, monkeypatch):
    """Same spec; the MCP server behind it gained a tool (as after an upgrade of its package)."""
    work = project_copy(tmp_path / "project")
    (work / "calc_tools.py").write_text(_TOOLS_A)
    run_a = _track_plan(work, tracking_server, monkeypatch)
    (work / "calc_tools.py").write_text(_TOOLS_B)
    run_b = _track_plan(work, tracking_server, monkeypatch)
    out = factory_here("diff", run_a, run_b, "--json", cwd=tmp_path, uri=tracking_server)
    assert out.returncode == 0, out.stderr[-3000:]
    changes = json.loads(out.stdout)["changes"]
    assert len(changes) == 1, changes
    (change,) = changes
    assert change["kind"] == "tool_schema" and change["key"] == "tools.calc"
    assert change["tools"] == {"added": ["sqrt"], "removed": [], "changed": []}


# ------------------------------------------------------------------------------------------ browser
@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium")
    if chromium is None:
        if os.environ.get("CI"):
            # (CI runs every test: a skip there would leave the MLflow UI untested, unnoticed)
            pytest.fail("chromium is missing (CI is set): bin/test installs it (apt-get install chromium)")
        pytest.skip("chromium is not installed (bin/test installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # Debian's chromium (playwright's own browser download cannot work here); the flags keep it from
        # reaching for Google's hosts on a machine without a network.
        b = p.chromium.launch(executable_path=chromium, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        yield b
        b.close()


def test_mlflow_ui_shows_the_runs_metric_chart_and_a_trace(tiny_runs, browser):
    ARTIFACTS.mkdir(exist_ok=True)
    run = tiny_runs.a
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    base = f"{tiny_runs.uri}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    page.goto(f"{base}/model-metrics")
    # The metric charts: filtered to reward/mean, its chart card (a plotly line, legend "<run> (reward/mean)").
    page.get_by_placeholder("Search metric charts").fill("reward/mean")
    card = page.locator("[data-testid='experiment-view-compare-runs-card']", has_text="(reward/mean)").first
    card.wait_for(timeout=90_000)
    card.locator(".js-plotly-plot .scatterlayer path").first.wait_for(timeout=60_000)
    assert f"{run.info.run_name} (reward/mean)" in card.inner_text()
    page.get_by_placeholder("Search metric charts").fill("reward")  # the reward charts, for the screenshot
    page.locator(".js-plotly-plot .scatterlayer path").first.wait_for(timeout=60_000)
    page.wait_for_timeout(2000)  # the other charts of the filter draw
    assistant = page.get_by_role("button", name="Close", exact=True)  # MLflow 3.17's chat panel: not ours to show
    if assistant.count():
        assistant.first.click()
    page.screenshot(path=str(ARTIFACTS / "mlflow-run-metrics.png"))

    page.goto(f"{base}/traces")
    question = page.get_by_text("What is", exact=False).first
    question.wait_for(timeout=90_000)
    question.click()
    for span in ("trajectory", "turn 0"):
        page.get_by_text(span, exact=True).first.wait_for(timeout=60_000)
    page.screenshot(path=str(ARTIFACTS / "mlflow-run-trace.png"))
    page.close()
    assert (ARTIFACTS / "mlflow-run-metrics.png").stat().st_size > 10_000


@pytest.mark.slow
def test_a_changed_tool_server_shows_in_the_diff_of_two_full_runs(tracking_server, tmp_path):
    """As above, through two whole `factory run`s (slow: two more tiny runs)."""
    from mlflow.tracking import MlflowClient

    for name, module in (("a", _TOOLS_A), ("b", _TOOLS_B)):
        work = project_copy(tmp_path / name)
        (work / "calc_tools.py").write_text(module)
        out = factory("run", "specs/tiny.yaml", "train.steps=1", "tools.calc.args=[-m,calc_tools]",
                      "tracking.experiment=tool-change-runs", cwd=work, uri=tracking_server)
        assert out.returncode == 0, out.stderr[-4000:]
    client = MlflowClient(tracking_server)
    runs = client.search_runs([client.get_experiment_by_name("tool-change-runs").experiment_id],
                              order_by=["attributes.start_time ASC"])
    ids = [r.info.run_id for r in runs]
    out = factory_here("diff", *ids, "--json", cwd=tmp_path, uri=tracking_server)
    assert out.returncode == 0, out.stderr[-3000:]
    (change,) = json.loads(out.stdout)["changes"]
    assert change["kind"] == "tool_schema" and change["tools"]["added"] == ["sqrt"]


def test_factory_ui_serves_the_configured_store(tmp_path):
    """`factory ui` starts the MLflow UI on 127.0.0.1 over the store MLFLOW_TRACKING_URI names, prints the URL,
    and the runs of that store (with their artifacts) are there."""
    import time

    from factory.tracking.mlflow_tracker import MlflowTracker as Tracker
    from tests.servers import free_port

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker(uri, "ui")
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the run's artifacts go to ./mlruns of the store's folder, as for a user
    try:
        tracker.start("r", {"train": {"lr": 1e-5}}, {}, {"plan.json": "{}"})
        tracker.end()
    finally:
        os.chdir(cwd)
    port = free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "factory.commands.cli", "ui", "--port", str(port)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"MLflow UI: http://127.0.0.1:{port}"), line
        url = f"http://127.0.0.1:{port}"
        found = requests.post(f"{url}/api/2.0/mlflow/runs/search",
                              json={"experiment_ids": [tracker.experiment_id]}, timeout=30).json()["runs"]
        assert [r["info"]["run_id"] for r in found] == [tracker.run_id]
        files = requests.get(f"{url}/api/2.0/mlflow/artifacts/list", params={"run_id": tracker.run_id},
                             timeout=30).json()["files"]
        assert [f["path"] for f in files] == ["plan.json"]
    finally:
        proc.send_signal(signal.SIGINT)  # what Ctrl-C does: the server goes with it
        t0 = time.monotonic()
        assert proc.wait(timeout=30) == 0 and time.monotonic() - t0 < 30
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{url}/health", timeout=5)


@pytest.mark.parametrize("signum, nohup", [(signal.SIGTERM, False), (signal.SIGHUP, False), (signal.SIGHUP, True)],
                         ids=["SIGTERM", "SIGHUP", "SIGHUP-under-nohup"])
def test_factory_ui_stopped_by_sigterm_or_sighup_stops_its_server(tmp_path, signum, nohup):
    """`kill PID` (systemd's stop, a job's time limit) or SIGHUP (the terminal closed, an ssh session gone) ended
    `factory ui` at once and left its `mlflow server` running on the port. The server here is a stand-in that
    writes its pid and sleeps (a real one takes ~10 s to start; the test above stops one with Ctrl-C). Under
    `nohup` (SIGHUP ignored) a hangup leaves it serving, as asked, and SIGTERM still stops both."""
    from tests.servers import free_port

    server = "import os, time; open('server.pid', 'w').write(str(os.getpid())); time.sleep(120)"
    code = (("import signal; signal.signal(signal.SIGHUP, signal.SIG_IGN); " if nohup else "")
            + "import sys; from factory.tracking import runs; from factory.commands.cli import main; "
            f"runs.server_command = lambda uri, host, port: ([sys.executable, '-c', {server!r}], None); "
            "runs.wait_until_up = lambda url, proc: None; sys.exit(main(['ui', '--port', sys.argv[1]]))")
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db", "PYTHONPATH": str(REPO)}
    (tmp_path / "mlflow.db").touch()  # a store that is there (one that is not is refused first)
    proc = subprocess.Popen([sys.executable, "-c", code, str(free_port())], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline().startswith("MLflow UI: ")
        pid_file = tmp_path / "server.pid"
        for _ in range(200):
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.05)
        pid = int(pid_file.read_text())
        proc.send_signal(signum)
        if nohup:
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(timeout=1)
            signum = signal.SIGTERM
            proc.send_signal(signum)
        assert proc.wait(timeout=30) == 128 + signum
    finally:
        proc.kill()
    with pytest.raises(ProcessLookupError):  # stopped and reaped by `factory ui`
        os.kill(pid, 0)
