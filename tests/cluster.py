"""A local multi-node Ray cluster for tests: `ray start --head` and `ray start --address` on 127.0.0.1,
each node with its own custom resource, on ports and a temp folder of its own.

Each node is one `ray start --block` process in its own session; stopping it (SIGTERM) makes Ray stop
exactly that node's processes, so the test never touches another Ray on the machine (no `ray stop`).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests.servers import free_port


def _ports() -> list[str]:
    """Every port a node would otherwise take from Ray's fixed defaults (two nodes on one host clash)."""
    return [f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
            f"--metrics-export-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}", f"--runtime-env-agent-port={free_port()}"]


def _start(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    ray = str(Path(sys.executable).with_name("ray"))
    with open(log, "w") as out:
        return subprocess.Popen([ray, "start", "--block", "--node-ip-address=127.0.0.1", "--disable-usage-stats",
                                 *_ports(), *args], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to `ray start --block` (it stops its node's processes), then SIGKILL to whatever is left of
    the session it leads: that node's processes and nothing else."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


@contextlib.contextmanager
def ray_cluster(nodes: list[dict[str, float]], num_cpus: int = 2, timeout_s: float = 120) -> Iterator[str]:
    """Start one Ray node per entry of `nodes` (its custom resources), the first as the head; yield the
    cluster's address once every node has joined; stop them all afterwards."""
    temp = tempfile.mkdtemp(prefix="frc-", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    # tests/conftest.py keeps every local Ray on loopback with this flag at "0", which also makes `ray start
    # --address` refuse to join a node ("Multi-node Ray clusters are not supported on Windows and OSX")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
    env.pop("RAY_ADDRESS", None)
    address = f"127.0.0.1:{free_port()}"
    procs: list[subprocess.Popen] = []
    try:
        procs.append(_start(["--head", f"--port={address.split(':')[1]}", f"--temp-dir={temp}",
                             f"--ray-client-server-port={free_port()}",  # not the default 10001: others' heads
                             "--include-dashboard=false", f"--num-cpus={num_cpus}",
                             f"--resources={json.dumps(nodes[0])}"], Path(temp) / "head.log", env))
        _wait(address, 1, procs, temp, timeout_s)
        for i, resources in enumerate(nodes[1:], 1):
            procs.append(_start([f"--address={address}", f"--num-cpus={num_cpus}",
                                 f"--resources={json.dumps(resources)}"], Path(temp) / f"node{i}.log", env))
        _wait(address, len(nodes), procs, temp, timeout_s)
        yield address
    finally:
        for proc in reversed(procs):
            _stop(proc)
        shutil.rmtree(temp, ignore_errors=True)


def _wait(address: str, count: int, procs: list[subprocess.Popen], temp: str, timeout_s: float) -> None:
    """Until `count` nodes are alive in the cluster, asked from one short-lived process (so this one never
    holds a connection of its own) that polls until then: Ray is imported once, not once a second."""
    code = ("import ray, sys, time; deadline = time.monotonic() + float(sys.argv[3]); "
            "ray.init(address=sys.argv[1], log_to_driver=False)\n"
            "while sum(n['Alive'] for n in ray.nodes()) < int(sys.argv[2]) and time.monotonic() < deadline:\n"
            "    time.sleep(0.5)\n"
            "print(sum(n['Alive'] for n in ray.nodes()))")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        with contextlib.suppress(subprocess.TimeoutExpired):  # the head may not take connections yet
            out = subprocess.run([sys.executable, "-c", code, address, str(count), str(deadline - time.monotonic())],
                                 capture_output=True, text=True, timeout=max(deadline - time.monotonic(), 1) + 30,
                                 env={**os.environ, "RAY_AUTH_MODE": "disabled"}, check=False)
            if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(count)]:
                return
        time.sleep(1)
    logs = "\n".join(p.read_text()[-2000:] for p in Path(temp).glob("*.log"))
    raise RuntimeError(f"the Ray test cluster did not come up with {count} nodes:\n{logs}")
