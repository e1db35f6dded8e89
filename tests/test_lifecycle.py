"""Stopping, in isolation: the first Ctrl-C is a request, the second an interrupt; processes started while
SIGINT is ignored keep ignoring it; a killed driver's leftovers are ended by the next start.
(The same on real runs: tests/test_run_lifecycle.py.)"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from factory.runtime.lifecycle import GracefulStop, SessionRecord, children_ignore_sigint, reap_orphans


def test_first_ctrl_c_requests_a_stop_the_second_interrupts():
    told = []
    with GracefulStop(on_first=told.append) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler runs between bytecodes of the main thread
        assert stop.requested and told == ["Ctrl-C"]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_sigterm_stops_as_ctrl_c_does():
    """`kill PID`, `timeout` or a container's stop send SIGTERM: it met Ray's handler in the driver, which
    aborted (exit code 134, a C stack dump, the MLflow run FAILED) instead of stopping after the step."""
    told = []
    before = signal.getsignal(signal.SIGTERM)
    with GracefulStop(on_first=told.append) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.requested and told == ["SIGTERM"]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
    assert signal.getsignal(signal.SIGTERM) == before  # restored


def test_sigterm_before_the_steps_begin_interrupts():
    """SIGTERM while the stages start met Ray's handler, which aborted the driver (exit code 134, a C stack
    dump, nothing torn down): after ray.init it raises KeyboardInterrupt, as a second Ctrl-C does."""
    from factory.runtime.lifecycle import sigterm_interrupts

    before = signal.getsignal(signal.SIGTERM)
    try:
        sigterm_interrupts()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
    finally:
        signal.signal(signal.SIGTERM, before)


def test_children_started_while_ignoring_keep_ignoring_sigint():
    script = "import signal, sys, time; print(signal.getsignal(signal.SIGINT), flush=True); time.sleep(30)"
    with children_ignore_sigint():
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # ours is back at once
    try:
        assert child.stdout.readline().strip() in ("Handlers.SIG_IGN", "1")  # 1 == SIG_IGN
        child.send_signal(signal.SIGINT)
        time.sleep(0.3)
        assert child.poll() is None  # a terminal's Ctrl-C would not have ended it
    finally:
        child.kill()
        child.wait()


# A stand-in driver: records itself and a child that outlives it (in its own session, deaf to SIGTERM
# like a hung agent), then waits to be killed.
DRIVER = """
import subprocess, sys, time
from pathlib import Path
from factory.runtime.lifecycle import SessionRecord
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"], start_new_session=True)
record = SessionRecord(Path(sys.argv[1]))
record.update()
print(child.pid, flush=True)
time.sleep(120)
"""


def test_a_killed_drivers_leftovers_are_ended_by_the_next_start(tmp_path):
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    orphan = int(driver.stdout.readline())
    assert reap_orphans(tmp_path) == []  # its driver is alive: not ours to end
    driver.kill()
    driver.wait()
    assert psutil.pid_exists(orphan)  # SIGKILL left it behind
    ended = reap_orphans(tmp_path, timeout_s=1.0)  # deaf to SIGTERM: SIGKILL after the timeout
    assert len(ended) == 1 and ended[0].endswith(f"[{orphan}]")
    assert not _running(orphan)
    assert list(tmp_path.iterdir()) == []  # the record is gone


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE  # a zombie has ended, unreaped
    except psutil.NoSuchProcess:
        return False


def test_a_record_never_names_a_process_by_pid_alone(tmp_path):
    """A recorded pid that now belongs to another process (pid reuse) is left alone."""
    record = SessionRecord(tmp_path)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        record.update()
        parsed = json.loads(record.path.read_text())
        parsed["driver"]["pid"] = 999_999_999  # the driver is gone
        for child in parsed["children"]:
            child["started"] += 1000.0  # the same pid, a different process
        record.path.write_text(json.dumps(parsed))
        assert reap_orphans(tmp_path, timeout_s=0.5) == []
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()


# ------------------------------------------------------------------------------- a local Ray on loopback
def test_factory_evaluate_keeps_its_local_ray_on_loopback(monkeypatch):
    """`factory eval` (factory.evaluate) starts a local Ray as `factory run` does: the loopback flag must be
    set before the driver (and so ray) is imported, not only by factory.run."""
    import factory
    import factory.runtime.driver as driver
    from factory.runtime.lifecycle import LOOPBACK_FLAG

    seen = []
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.delenv(LOOPBACK_FLAG, raising=False)
    monkeypatch.setattr(driver, "evaluate_only", lambda plan, step, tags: seen.append(os.environ.get(LOOPBACK_FLAG)))
    factory.evaluate("specs/tiny.yaml")
    assert seen == ["0"]
    # a spec that joins a cluster leaves the cluster's own network settings alone
    monkeypatch.delenv(LOOPBACK_FLAG)
    factory.evaluate("specs/tiny.yaml", overrides=["resources.ray_address=ray://10.0.0.1:10001"])
    assert seen[-1] is None


def test_a_local_ray_is_refused_when_ray_was_imported_before_the_loopback_flag(monkeypatch):
    """A notebook that imported ray first: Ray read the flag already and would listen on every interface.
    start_ray says so before it starts anything; a user's own explicit `=1` is theirs to choose."""
    import ray
    from ray._private import ray_constants

    from factory.plan import ClusterSettings
    from factory.runtime.driver import start_ray
    from factory.runtime.lifecycle import LOOPBACK_FLAG, check_ray_on_loopback
    from factory.util import UserError

    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init reached"))
    monkeypatch.setenv(LOOPBACK_FLAG, "0")
    with pytest.raises(UserError, match=r"ray was imported before Factory could set "
                                        r"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0"):
        start_ray(ClusterSettings(ray_address=None, object_store_gb=1.0))
    monkeypatch.setenv(LOOPBACK_FLAG, "1")
    check_ray_on_loopback()  # asked for by the user: no error
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    monkeypatch.setenv(LOOPBACK_FLAG, "0")
    check_ray_on_loopback()


def test_ray_that_will_not_start_is_an_infrastructure_failure(monkeypatch):
    """On a machine with a load average of 38, Ray's node timed out starting: `factory run` said "internal
    error" and asked for FACTORY_DEBUG=1."""
    from factory.plan import ClusterSettings
    from factory.runtime import driver
    from factory.runtime.health import InfraFailure, RayStartError
    from factory.util import UserError

    def timed_out(cluster):
        raise Exception("The current node timed out during startup. This could happen because some of the "
                        "raylet failed to startup or the GCS has become overloaded.\nmore")

    monkeypatch.setattr(driver, "_start_ray", timed_out)
    with pytest.raises(RayStartError, match=r"^could not start a local Ray \(load average [\d.]+ on \d+ cores\): "
                                            r"Exception: The current node timed out during startup\. .*overloaded\.$"):
        driver.start_ray(ClusterSettings(ray_address=None, object_store_gb=1.0))
    assert issubclass(RayStartError, InfraFailure)  # exit 3, as the CLI's other infrastructure failures

    def ours(cluster):
        raise UserError("ray was imported before Factory could set ...")

    monkeypatch.setattr(driver, "_start_ray", ours)
    with pytest.raises(UserError):  # our own message, as it is
        driver.start_ray(ClusterSettings(ray_address=None, object_store_gb=1.0))


def test_sigterm_is_handled_as_before_once_a_run_is_over():
    """The driver makes SIGTERM a stop (Ray's own handler aborted it); a program or notebook that goes on
    after factory.run returned kept that handler, and a later SIGTERM raised KeyboardInterrupt there."""
    import signal

    from factory.runtime.lifecycle import sigterm_interrupts, sigterm_restored

    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        with sigterm_restored():
            signal.signal(signal.SIGTERM, lambda s, f: None)  # as Ray's init does
            sigterm_interrupts()
            assert signal.getsignal(signal.SIGTERM) is not mine
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)
