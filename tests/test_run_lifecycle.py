"""Stopping real runs of specs/tiny.yaml (Ray + MCP + DeepSpeed + MLflow), as a user would:

1. a run SIGKILLed after its first checkpoint leaves processes behind (Ray's agents linger) -- the next
   `factory run` ends them;
2. that next run, given Ctrl-C (SIGINT to its whole process group, as a terminal sends it) after its first
   step, finishes the step in flight, checkpoints it, marks the MLflow run KILLED, exits 130 and leaves no
   process behind;
and on the way: every socket the runs listen on is on loopback, and a value from `${oc.env:...}` reaches
neither the MLflow store nor the logs.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
SECRET = "s3cret-7f1d2c"
# Secrets go where users put them: a tool server's environment, a tag.
OVERRIDES = ["train.steps=3", "train.checkpoint_every=1", "tools.calc.env={TOKEN: '${oc.env:FACTORY_TEST_SECRET}'}",
             "tracking.tags={owner: '${oc.env:FACTORY_TEST_SECRET}'}"]
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


@pytest.fixture(scope="module")
def work():
    # A short temp root of our own: Ray's session files (and unix sockets, whose paths are length-limited)
    # and Factory's driver records live under it, apart from every other Ray on this machine.
    tmp = Path(tempfile.mkdtemp(prefix="frl", dir="/tmp"))
    for folder in ("specs", "prompts"):
        shutil.copytree(REPO / folder, tmp / folder)
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db", "PYTHONPATH": str(REPO),
           "TMPDIR": str(tmp), "FACTORY_TEST_SECRET": SECRET}
    env.pop("RAY_ADDRESS", None)
    yield tmp, env
    shutil.rmtree(tmp, ignore_errors=True)


def start(work, *extra: str) -> subprocess.Popen:
    tmp, env = work
    # its own session: SIGINT to its process group is what a terminal's Ctrl-C is
    return subprocess.Popen([sys.executable, "-m", "factory.cli", "run", "specs/tiny.yaml", *OVERRIDES, *extra],
                            cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def tree(proc: subprocess.Popen) -> dict[tuple[int, float], psutil.Process]:
    """The driver's descendants, by (pid, start time)."""
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for p in kids:
        try:
            out[(p.pid, p.create_time())] = p
        except psutil.NoSuchProcess:
            pass
    return out


def listening(procs) -> set[str]:
    out = set()
    for p in procs:
        try:
            out |= {c.laddr.ip for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def running(procs) -> list[str]:
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{p.name()}[{p.pid}]")
        except psutil.NoSuchProcess:
            pass
    return alive


def wait_for(path: Path, proc: subprocess.Popen, timeout_s: float, seen: dict, ips: set) -> None:
    deadline = time.time() + timeout_s
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, f"{path} did not appear"
        procs = tree(proc)
        seen.update(procs)
        ips |= listening(procs.values())
        time.sleep(0.5)


def test_sigkill_then_ctrl_c(work):
    from mlflow.tracking import MlflowClient

    tmp, env = work
    # 1. SIGKILL after the first checkpoint
    first, first_seen, ips = start(work), {}, set()
    wait_for(tmp / "runs/tiny/latest", first, 300, first_seen, ips)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    leftovers = running(first_seen.values())

    # 2. the next run ends what the first left behind, then gets Ctrl-C after its first step
    second, seen = start(work, "train.checkpoint_dir=runs/second"), {}
    wait_for(tmp / "runs/second/latest", second, 300, seen, ips)
    assert running(first_seen.values()) == [], f"left by the killed run and still alive: {leftovers}"
    os.killpg(second.pid, signal.SIGINT)
    try:
        out, err = second.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(second.pid, signal.SIGKILL)
        raise
    assert second.returncode == 130, err[-3000:]
    deadline = time.time() + 10
    while running(seen.values()) and time.time() < deadline:
        time.sleep(0.2)
    assert running(seen.values()) == []  # Ray's processes, the stage actors, the MCP servers: all gone
    assert not list((tmp / f"factory-ray-{os.getuid()}" / "drivers").glob("*.json"))  # no record left

    # the step in flight was finished, logged and checkpointed; the run is KILLED
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    runs = {r.data.tags["mlflow.runName"]: r for r in client.search_runs([client.get_experiment_by_name("tiny").experiment_id])}
    killed = [r for r in runs.values() if r.info.status == "KILLED"]
    assert len(killed) == 1, [(r.info.run_id, r.info.status) for r in runs.values()]
    steps = [m.step for m in client.get_metric_history(killed[0].info.run_id, "timing/step_s")]
    last = int((tmp / "runs/second/latest").read_text().strip().removeprefix("step_"))
    assert sorted(steps) == list(range(1, last + 1)) and 1 <= last < 3  # each step once, the last one saved

    # every socket either run listened on was on loopback
    assert ips and ips <= set(LOOPBACK), ips
    # the secret reached neither the store nor the logs (Ray's session logs included)
    assert SECRET not in out + err
    for path in [tmp / "mlflow.db", *(tmp / "mlruns").rglob("*"), *(tmp / f"factory-ray-{os.getuid()}").rglob("*")]:
        if path.is_file() and not path.is_symlink():
            assert SECRET.encode() not in path.read_bytes(), path
