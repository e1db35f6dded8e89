"""Tracked runs from the command line: `factory runs` (a table of runs, with the reward-hacking monitors that
fired in each) and `factory ui` (the MLflow UI).
Runs are read through the tracking seam (factory.tracking.tracker), which also finds a run by id, id
prefix or name for `factory diff`, `export`, `rescore` and `--resume`.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from factory.monitors import STOPPED_BY_TAG
from factory.tracking.mlflow_tracker import (DRIVER_TAG, IDLE_TAG, STARTED_TAG, STEPS_TAG, driver_alive,
                                             tracking_uri)
from factory.tracking.tracker import RunLookupError, TrackedRun, open_tracker, reading
from factory.util import fmt_number, missing_store, stdout_console


# ------------------------------------------------------------------------------------------- runs
def _num(v: Any) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def run_kind(run: TrackedRun) -> str:
    """train; eval (`factory eval`, tag factory.kind); rescore (`factory rescore`, tag factory.rescore_of)."""
    return "rescore" if "factory.rescore_of" in run.tags else run.tags.get("factory.kind", "train")


def run_summary(run: TrackedRun) -> dict[str, Any]:
    """What `factory runs` shows of one run. `driver_alive`: for a RUNNING run, whether its driver is (None:
    it cannot be told from here); a run whose driver was killed stays RUNNING in MLflow, with no end.
    `duration_s`: from the start of the command that opened the run (tag STARTED_TAG: its start-up
    included, as the run's summary counts; an older run's MLflow start) to its end, less the time a resumed run
    had no driver (its tag `factory.idle_s`)."""
    alive = driver_alive(run.tags.get(DRIVER_TAG)) if run.status == "RUNNING" else None
    # A RUNNING run's end time is stale when it has one: a resumed run keeps its last session's end
    if run.status == "RUNNING":
        end = time.time() if alive is not False else None
    else:
        end = run.end_time
    kind = run_kind(run)
    begin = float(run.tags[STARTED_TAG]) if STARTED_TAG in run.tags else run.start_time
    # an eval's or rescore's spec's steps are not its own; a resumed run's are its last resume's
    steps = run.tags.get(STEPS_TAG, run.params.get("train.steps")) if kind == "train" else None
    return {
        "run_id": run.run_id,
        "name": run.name,
        "experiment_id": run.experiment_id,
        "spec": run.tags.get("factory.spec_name", ""),
        "kind": kind,
        "status": run.status,
        "driver_alive": alive,
        "steps_done": int(run.tags["factory.step"]) if "factory.step" in run.tags else None,
        "steps": int(steps) if steps and steps.isdigit() else None,
        "final_reward": _num(run.metrics.get("reward/mean")),
        "eval": {k: _num(v) for k, v in sorted(run.metrics.items()) if k.startswith("eval/")},
        "start_time": run.start_time,
        "duration_s": end - begin - float(run.tags.get(IDLE_TAG, 0)) if begin and end else None,
        "plan_hash": run.tags.get("factory.plan_hash"),
        "monitors": monitors(run),
        "stopped_by": run.tags.get(STOPPED_BY_TAG),
    }


def monitors(run: TrackedRun) -> dict[str, dict[str, Any]]:
    """Each reward-hacking monitor the run logged (factory.monitors): its newest statistic, whether it fires
    at the newest step, and the step at which it first fired (None: never)."""
    names = {k.split("/")[1] for k in run.metrics if k.startswith("monitor/")}
    names |= {k.removeprefix("factory.monitor.") for k in run.tags if k.startswith("factory.monitor.")}
    fired = {n: run.tags.get(f"factory.monitor.{n}") for n in names}
    return {n: {"value": _num(run.metrics.get(f"monitor/{n}")),
                "firing": bool(run.metrics.get(f"monitor/{n}/fired", 0.0)),
                "fired_at": int(fired[n]) if fired[n] and fired[n].isdigit() else None} for n in sorted(names)}


def list_runs(experiment: str | None = None, *, limit: int = 100, uri: str | None = None) -> list[dict[str, Any]]:
    """`run_summary` of the tracked runs, newest first: of one experiment (by name), else of all
    (`factory runs`, factory.runs). RunLookupError when `uri` names a sqlite store that is not there (a typo is
    not "no runs"); the default's, not made yet, has none."""
    if (missing := missing_store(tracking_uri(uri))) is not None:  # none yet: not an empty store made here
        if uri is not None:
            raise RunLookupError(missing)
        return []
    tracker = open_tracker(uri, read=True)
    with reading(tracker.uri):  # (a store that goes down after it answered: exit 3, as one down from the start)
        return [run_summary(r) for r in tracker.runs(experiment, max_results=limit)]


def runs_main(args: Any) -> int:
    from rich.table import Table
    from rich.text import Text

    rows = list_runs(args.experiment, limit=args.limit, uri=args.uri)
    if args.json:
        sys.stdout.write(json.dumps(rows, indent=2, sort_keys=True) + "\n")
        return 0
    if not rows:
        where = f" (experiment '{args.experiment}')" if args.experiment else ""
        uri = tracking_uri(args.uri)
        missing = missing_store(uri)
        print(f"no runs in {uri}{where}" if missing is None else f"no runs: {missing}")
        return 0
    eval_keys = sorted({k for r in rows for k in r["eval"]})
    # every name as it is, never as rich markup (`grid[lr=1e-5]`: a spec name may hold brackets)
    table = Table(title=Text(f"runs in {tracking_uri(args.uri)}"))
    for col in ("run id", "name", "spec", "status", "steps", "reward", *eval_keys, "monitors fired", "duration",
                "started"):
        numeric = col in ("steps", "reward", "duration") or col in eval_keys
        # the name may wrap, but never to nothing (as it did beside a long status): `factory diff` takes it
        table.add_column(Text(col), justify="right" if numeric else "left", no_wrap=col != "name",
                         min_width=min(max(len(r["name"]) for r in rows), 24) if col == "name" else None)
    for r in rows:
        steps = (f"{r['steps_done'] if r['steps_done'] is not None else '-'}/{r['steps'] if r['steps'] else '?'}"
                 if r["kind"] == "train" else r["kind"])
        # (a rescore or eval trained nothing: `--resume` refuses it)
        gone = " (driver gone: --resume)" if r["kind"] == "train" else " (driver gone)"
        status = r["status"] + gone if r["driver_alive"] is False else r["status"]
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["start_time"])) if r["start_time"] else "-"
        dur = f"{r['duration_s'] / 60:.1f} min" if r["duration_s"] is not None else "-"
        fired = ", ".join(f"{n} (step {m['fired_at']})" for n, m in r["monitors"].items() if m["fired_at"] is not None)
        cells = (r["run_id"][:8], r["name"], r["spec"], status, steps, fmt_number(r["final_reward"]),
                 *(fmt_number(r["eval"].get(k)) for k in eval_keys), fired or "-", dur, started)
        table.add_row(*map(Text, cells))
    console = stdout_console(piped_width=200, fit=table)  # piped or in a log: every column, whole
    console.print(table)
    return 0


# --------------------------------------------------------------------------------------------- ui
def server_command(uri: str, host: str, port: int) -> tuple[list[str], dict[str, str]]:
    """`mlflow server` with light settings: one worker and no job-execution processes (the default starts
    ~15 processes and 1.7 GB; this one 2 processes and ~360 MB). Artifacts of a local store stay where the
    runs wrote them."""
    mlflow = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow"
    argv = [mlflow, "server", "--backend-store-uri", uri, "--host", host, "--port", str(port), "--workers", "1"]
    return argv, {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def wait_until_up(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"mlflow server did not answer on {url} within {timeout_s:.0f} s")


def _port_free(host: str, port: int) -> bool:
    """Whether nothing answers on host:port, an IPv4 or IPv6 address or a name; RunLookupError (the user's to
    fix) when `host` names no address."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise RunLookupError(f"--host {host}: no such host or address ({e.strerror})") from None
    with socket.socket(family, kind, proto) as s:
        return s.connect_ex(address) != 0


def _exit(signum: int, frame: Any) -> None:
    signal.signal(signum, signal.SIG_IGN)  # a second one (plain `timeout` signals us, then our group) would cut
    raise SystemExit(128 + signum)          # the server's stop short; 143: the shell's code for a SIGTERM'd process


def ui_main(args: Any) -> int:
    uri = tracking_uri(args.uri)
    if uri.startswith(("http://", "https://")):
        print(f"the tracking store is a server already: open {uri}")
        return 0
    if (missing := missing_store(uri)) is not None:  # the server would make an empty store and show no run
        raise RunLookupError(missing)
    if not _port_free(args.host, args.port):
        raise RunLookupError(f"port {args.port} on {args.host} is in use; pick another with --port")
    argv, env = server_command(uri, args.host, args.port)
    url = f"http://{f'[{args.host}]' if ':' in args.host else args.host}:{args.port}"  # (an IPv6 address in [])
    # The server's log goes to a file (a pipe nobody reads would fill and stall it); shown if it fails.
    log = tempfile.TemporaryFile(mode="w+")
    # SIGTERM (`kill PID`, systemd's stop) or SIGHUP (the terminal closed) ended this process at once and left the
    # server running on the port: it now exits through the `finally` that stops the server, as Ctrl-C does
    main = threading.current_thread() is threading.main_thread()  # (elsewhere signals cannot be changed)
    # (one ignored is left so: `nohup factory ui &` keeps serving after the terminal closes; Windows has no HUP)
    stops = [s for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None))
             if s is not None and signal.getsignal(s) is not signal.SIG_IGN]
    previous = {s: signal.signal(s, _exit) for s in stops} if main else {}
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        print(f"starting the MLflow UI on {uri} ...", file=sys.stderr, flush=True)
        try:
            wait_until_up(url, proc)
        except RuntimeError as e:
            log.seek(0)
            raise RunLookupError(f"{e}\n{log.read()[-2000:]}".rstrip()) from None
        print(f"MLflow UI: {url}   (Ctrl-C stops it)", flush=True)
        proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0
