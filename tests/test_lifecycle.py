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

from factory.contract import StageActor
from factory.runtime.lifecycle import (GracefulStop, SessionRecord, children_ignore_sigint, prune_ray_sessions,
                                       ray_starts_sessions, reap_orphans, sigterm_restored)


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


def test_two_ctrl_cs_heard_at_once_are_still_two():
    """While the main thread is in C code (Ray's `get` looks for signals once a second), Python runs the
    handler once for any number of SIGINTs: two Ctrl-Cs 0.3 s apart finished the step and checkpointed,
    where the second should stop at once. The signals are counted as they arrive (a wakeup fd)."""
    import hashlib
    import threading

    told, data, took = [], bytes(800 << 20), []

    def press_twice():
        time.sleep(0.1)  # the main thread is in the hash by now
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.02)

    with GracefulStop(on_first=told.append) as stop:
        sender = threading.Thread(target=press_twice)
        t0 = time.perf_counter()
        sender.start()
        with pytest.raises(KeyboardInterrupt):
            try:
                hashlib.sha256(data).digest()  # C code: no Python handler runs until it returns
            finally:
                took.append(time.perf_counter() - t0)
            time.sleep(0.5)
        sender.join()
        assert stop.requested and told == ["Ctrl-C"]
    assert took[0] > 0.2, took  # both were sent while the hash ran


@pytest.fixture
def no_sigterm_yet(monkeypatch):
    """A SIGTERM an earlier test sent less than ECHO_S ago would make this test's first one an echo."""
    from factory.runtime import lifecycle

    monkeypatch.setattr(lifecycle, "_sigterm_at", float("-inf"))
    monkeypatch.setattr(lifecycle, "ECHO_S", 0.3)


def test_sigterm_stops_as_ctrl_c_does(no_sigterm_yet):
    """`kill PID`, `timeout` or a container's stop send SIGTERM: it met Ray's handler in the driver, which
    aborted (exit code 134, a C stack dump, the MLflow run FAILED) instead of stopping after the step.
    Plain `timeout` sends it twice at once (to its child, then to its group): the echo is the same request,
    not the second one that stops at once (which interrupted the step `timeout`'s first SIGTERM let finish)."""
    told = []
    before = signal.getsignal(signal.SIGTERM)
    with GracefulStop(on_first=told.append) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.requested and told == ["SIGTERM"]
        os.kill(os.getpid(), signal.SIGTERM)  # the echo
        time.sleep(0.05)
        time.sleep(0.3)  # past ECHO_S after it
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
    assert told == ["SIGTERM"]
    assert signal.getsignal(signal.SIGTERM) == before  # restored


def test_the_display_says_how_long_to_wait_before_a_second_sigterm():
    """A second SIGTERM within ECHO_S of the first is taken as its echo (plain `timeout`'s two sends): a user
    told "SIGTERM again stops at once" who sent it again at once saw nothing happen."""
    from factory.runtime.lifecycle import ECHO_S, stopping_said

    assert stopping_said("SIGTERM").endswith(f"SIGTERM again ({ECHO_S:g} s or more after this one) stops at once")
    assert stopping_said("Ctrl-C").endswith("; Ctrl-C again stops at once")


def test_sigterm_before_the_steps_begin_interrupts(no_sigterm_yet):
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


def test_a_sigint_while_children_start_ignoring_it_themselves_is_heard_after():
    """With Ray's processes started ignoring SIGINT by themselves (ray_starts_sessions' Popen), the driver is
    not deaf while Ray starts: a Ctrl-C then was dropped and the run trained on. It is raised once the block
    is done, as the driver handles SIGINT; the children still ignore it."""
    from ray._private import services

    script = "import signal, sys, time; print(signal.getsignal(signal.SIGINT), flush=True); time.sleep(30)"
    with pytest.raises(KeyboardInterrupt):
        with ray_starts_sessions() as own, children_ignore_sigint(started_ignoring=own):
            assert own  # (ray is pinned: tests/test_lifecycle.py says so should a release move the hook)
            child = services.ConsolePopen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # Python runs its handlers here: ours keeps it for later
            reached = True
    assert reached and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    try:
        assert child.stdout.readline().strip() in ("Handlers.SIG_IGN", "1")
        assert os.getsid(child.pid) == child.pid  # a session of its own
    finally:
        child.kill()
        child.wait()


# A stand-in driver: records itself and a child that outlives it (in its own session, deaf to SIGTERM
# like a hung agent), then waits to be killed.
DRIVER = """
import subprocess, sys, time
from pathlib import Path
from factory.runtime.lifecycle import SessionRecord
record = SessionRecord(Path(sys.argv[1]))  # (made first: what it started before is not the run's)
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"], start_new_session=True)
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


def test_old_ray_sessions_of_ended_drivers_are_removed_and_a_live_ones_kept(tmp_path):
    """Ray keeps every local session's folder (logs, sockets): 159 runs had left 61 MB. The next start removes
    those of drivers no longer alive beyond the newest few; a concurrent run's is never touched (even with its
    name's local time hours off), nor kept for a pid alive now that started a day after it (the number reused)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone, mine = int(done.stdout), os.getpid()  # a driver that ended; one alive (this process)
    me = psutil.Process().create_time()

    def session(t: float, pid: int) -> str:
        name = f"session_{time.strftime('%Y-%m-%d_%H-%M-%S', time.localtime(t))}_000001_{pid}"
        (tmp_path / name / "logs").mkdir(parents=True)
        return name

    old, reused, older = session(me - 5 * 3600, gone), session(me - 25 * 3600, mine), session(me - 3 * 3600, gone)
    live, newest = session(me + 1, mine), [session(me + 2, gone), session(me + 3, gone)]
    west = session(me - 6 * 3600, mine)  # alive, its name's local time 6 h behind ours (its driver's TZ was west)
    (tmp_path / "session_latest").symlink_to(tmp_path / newest[-1])
    (tmp_path / "session_notes").mkdir()  # not a name Ray gives
    assert prune_ray_sessions(tmp_path, keep=2) == [reused, old, older]
    assert {p.name for p in tmp_path.iterdir()} == {west, live, *newest, "session_latest", "session_notes"}


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE  # a zombie has ended, unreaped
    except psutil.NoSuchProcess:
        return False


# A parent that never collects its child: the child exits and stays a zombie while the parent lives, as a dead
# driver's orphans do under a PID 1 that collects late (a Ray agent, seconds) or never (some containers).
UNCOLLECTING = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "pass"])
print(child.pid, flush=True)
subprocess._active = []  # (so Python's own clean-up never collects it either)
del child
time.sleep(120)
"""


def test_a_dead_drivers_process_that_is_a_zombie_is_not_waited_for(tmp_path):
    """A zombie has ended: the next start neither signals it nor waits out its timeout for it (it waited the
    whole 5 s before every run that followed a killed vLLM run: Ray's agents, zombies of PID 1 by then)."""
    parent = subprocess.Popen([sys.executable, "-c", UNCOLLECTING], stdout=subprocess.PIPE, text=True)
    try:
        zombie = psutil.Process(int(parent.stdout.readline()))
        deadline = time.monotonic() + 30
        while zombie.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.05)
        assert zombie.status() == psutil.STATUS_ZOMBIE
        dead = {"pid": 999_999_999, "started": 0.0, "name": "python"}
        record = {"driver": dead, "children": [{"pid": zombie.pid, "started": zombie.create_time(), "name": "agent"}]}
        (tmp_path / "1.json").write_text(json.dumps(record))
        started = time.monotonic()
        assert reap_orphans(tmp_path, timeout_s=60.0) == []  # nothing left running to end
        assert time.monotonic() - started < 30  # (the old wait: all 60 s, then a SIGKILL to the dead)
        assert list(tmp_path.iterdir()) == []
    finally:
        parent.kill()
        parent.wait()


def test_a_runs_end_collects_its_own_children_that_ended(tmp_path):
    """The driver's own children that have exited (zombies) are collected by its record's close, as before the
    zombie rule: a notebook's driver lives on, and would keep them."""
    record = SessionRecord(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    record.update()
    child.stdin.close()  # it ends, uncollected
    deadline = time.monotonic() + 30
    while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.05)
    assert record.close(timeout_s=5.0) == []
    assert not psutil.pid_exists(child.pid)  # collected, not left a zombie


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


@pytest.fixture
def placed_without_ray(tmp_path, monkeypatch):
    """`driver.placed` with what it would start stubbed out (Ray, the stages, their teardown) and its records in
    a private temp folder; everything else real (reap_orphans, the SessionRecord and its close). Yields the
    calls made to the stubs, and the arguments `placed` takes."""
    import tempfile
    from types import SimpleNamespace

    from factory.runtime import driver
    from factory.runtime.startup import Startup

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    calls: list[str] = []
    monkeypatch.setattr(driver, "build_models", lambda plan, status: None)
    monkeypatch.setattr(driver, "start_ray", lambda cluster: calls.append("start_ray"))
    monkeypatch.setattr(driver, "place", lambda plan, *a, **k: {})
    monkeypatch.setattr(driver, "teardown", lambda groups: calls.append("teardown"))
    monkeypatch.setattr(driver, "stop_ray", lambda *a: calls.append("stop_ray"))
    plan = SimpleNamespace(stages=(), driver=SimpleNamespace(resources=SimpleNamespace(ray_address=None),
                                                             train=SimpleNamespace(stage_timeout_s=60)))
    yield calls, (plan, SimpleNamespace(status=lambda said: None), Startup())


def test_a_run_leaves_the_callers_own_processes_alone(placed_without_ray):
    """factory.run / factory.evaluate from a script or notebook that started a process of its own before (an
    `mlflow server` for tracking.uri, a `vllm serve` judge endpoint): the run's record named it with Ray's, so
    the run's end waited 10 s for it, then ended it (and a killed run's next start would have too)."""
    from factory.runtime import driver

    _, args = placed_without_ray
    mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        with driver.placed(*args) as (_, record):
            ours = subprocess.Popen([sys.executable, "-c", "pass"])  # one the run started (as Ray's are)
            record.update()
            assert [c["pid"] for c in json.loads(record.path.read_text())["children"]] == [ours.pid]
            ours.wait()
        assert mine.poll() is None
    finally:
        mine.kill()
        mine.wait()


def test_a_ctrl_c_during_teardown_still_shuts_ray_down_and_drops_the_record(placed_without_ray, tmp_path,
                                                                            monkeypatch):
    """The user's Ctrl-C while teardown waits (up to 30 s) for the stages' close skipped the rest: Ray stayed up
    (a notebook's next factory.run then failed: ray.init twice) and the record stayed."""
    from factory.runtime import driver

    calls, args = placed_without_ray

    def interrupted(groups):
        calls.append("teardown")
        raise KeyboardInterrupt  # what Ctrl-C raises in teardown's ray.wait (no GracefulStop is active there)

    monkeypatch.setattr(driver, "teardown", interrupted)
    with pytest.raises(KeyboardInterrupt), driver.placed(*args):
        pass
    assert calls == ["start_ray", "teardown", "stop_ray"]
    assert list((tmp_path / f"factory-{os.getuid()}" / "drivers").glob("*.json")) == []


def test_a_ray_already_up_is_refused_and_left_alone(placed_without_ray, monkeypatch):
    """A Ray up in this process before the run placed its stages (the caller's ray.init(), another run's): the
    run's ray.init failed, and `placed` then shut that Ray down under its owner. Refused before anything starts."""
    from factory.runtime import driver
    from factory.util import UserError

    calls, args = placed_without_ray
    monkeypatch.setattr(driver.ray, "is_initialized", lambda: True)
    with pytest.raises(UserError, match=r"^the run: a Ray is already up in this process"), driver.placed(*args):
        pass
    assert calls == []  # neither started nor stopped


def test_ending_what_a_killed_run_left_is_timed_as_starting_ray_not_as_building_models(placed_without_ray,
                                                                                       monkeypatch):
    """`placed` ended a killed run's processes (up to 10 s: its Ray among them) before it built the models and
    lapped "models": timing/startup/models_s, "building built-in models (first use only)", held the reaping."""
    from factory.runtime import driver
    from factory.runtime.startup import Startup

    _, (plan, display, _) = placed_without_ray
    now = [0.0]  # the start-up's clock: each fake advances it by the seconds it takes

    def took(seconds, result=None):
        return lambda *a: (now.__setitem__(0, now[0] + seconds), result)[1]

    order = []
    monkeypatch.setattr(driver, "reap_orphans", lambda: (order.append("reap"), took(8.0, ["raylet[123]"])())[1])
    monkeypatch.setattr(driver, "build_models", lambda *a: (order.append("build"), took(3.0)())[1])
    startup = Startup(0.0, clock=lambda: now[0])
    with driver.placed(plan, display, startup):
        pass
    assert startup.phases == {"models": 3.0, "ray": 8.0, "stages": 0.0}
    assert order == ["reap", "build"]  # a model build does not share the machine with the killed run's engines


@pytest.mark.parametrize("again", [None, "`factory eval` again evaluates it"])
def test_a_stage_that_hangs_says_how_its_work_is_taken_up(placed_without_ray, monkeypatch, again):
    """A stage that hung in `factory eval` or a rescore (its setup, a call) said "`factory run SPEC --resume`
    continues the run", which neither can: the deadline says what `placed` was told, as a lost stage does."""
    from factory.runtime import driver
    from factory.runtime.deadlines import StageTimeout

    _, args = placed_without_ray

    def place(plan, status, deadlines, ready, **kwargs):  # a setup that never answers
        deadlines.fail("rollout.setup", "starting", 61.0, deadlines.budget("rollout.setup"))

    monkeypatch.setattr(driver, "place", place)
    with pytest.raises(StageTimeout) as e, driver.placed(*args, **({"again": again} if again else {})):
        pass
    assert str(e.value).endswith(f"; {again or driver.RESUME_SAID}"), str(e.value)


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
    monkeypatch.setattr(driver, "evaluate_only", lambda plan, step, tags, started_at, **k: seen.append(os.environ.get(LOOPBACK_FLAG)))
    monkeypatch.setattr(driver, "run", lambda plan, found, **k: seen.append(os.environ.get(LOOPBACK_FLAG)))
    factory.evaluate("specs/tiny.yaml")
    factory.run("specs/tiny.yaml")
    assert seen == ["0", "0"]
    assert LOOPBACK_FLAG not in os.environ  # put back once each returned: a Ray the caller starts later is theirs
    # a spec that joins a cluster leaves the cluster's own network settings alone
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
    with sigterm_restored(), pytest.raises(UserError, match=r"the run: ray was imported in this process before Factory "
                                        r"could set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, and Ray reads it once"):
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
    with sigterm_restored(), pytest.raises(
            RayStartError, match=r"^could not start a local Ray \(load average [\d.]+ on \d+ cores\): "
                                 r"Exception: The current node timed out during startup\. .*overloaded\.$"):
        driver.start_ray(ClusterSettings(ray_address=None, object_store_gb=1.0))
    assert issubclass(RayStartError, InfraFailure)  # exit 3, as the CLI's other infrastructure failures

    def ours(cluster):
        raise UserError("ray was imported before Factory could set ...")

    monkeypatch.setattr(driver, "_start_ray", ours)
    with sigterm_restored(), pytest.raises(UserError):  # our own message, as it is
        driver.start_ray(ClusterSettings(ray_address=None, object_store_gb=1.0))


def test_an_object_store_ray_has_no_room_for_is_said_with_the_setting(monkeypatch, tmp_path):
    """ray.init's ValueError for an object store that leaves its tasks too little memory (Ray's words alone, no
    spec key) was an internal error; check refuses one above the machine's memory, but memory in use may leave
    less: the run says which setting to lower."""
    import ray

    from factory.plan import ClusterSettings
    from factory.runtime import driver
    from factory.util import UserError

    said = ("After taking into account object store and redis memory usage, the amount of memory on this node "
            "available for tasks and actors (-3.2 GB) is less than -13% of total.")

    def refuses(**kwargs):
        raise ValueError(said)

    for key, value in {**driver._STAGE_ENV, "RAY_AUTH_MODE": "disabled"}.items():  # (set by _start_ray)
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(driver, "private_dir", lambda: tmp_path)
    monkeypatch.setattr(ray, "init", refuses)
    with sigterm_restored(), pytest.raises(UserError, match=r"^a local Ray would not start with "
                                                            r"resources\.object_store_gb 20 \([\d.e+]+ GB of this "
                                                            r"machine's memory is free now\): lower it \(1 is usual\) "
                                                            r"or free memory\. Ray said: After taking into account"):
        driver.start_ray(ClusterSettings(ray_address=None, object_store_gb=20.0))

    def other(**kwargs):
        raise ValueError("some other mistake")

    monkeypatch.setattr(ray, "init", other)
    with sigterm_restored(), pytest.raises(ValueError, match="^some other mistake$"):
        driver.start_ray(ClusterSettings(ray_address=None, object_store_gb=1.0))


def test_a_sigterm_while_ray_starts_stops_as_a_ctrl_c_does(monkeypatch):
    """A SIGTERM while Ray started met ray.init's handler (sys.exit(15): exit 15, nothing said) or, before
    it was set, the default one: now it is a KeyboardInterrupt, which the command says and exits 130 on."""
    import signal

    from factory.plan import ClusterSettings
    from factory.runtime import driver
    from factory.runtime.lifecycle import _interrupt

    handlers = []

    def heard_in_init(cluster):
        handlers.append(signal.getsignal(signal.SIGTERM))
        raise SystemExit(signal.SIGTERM)  # what ray.init's own handler does

    monkeypatch.setattr(driver, "_start_ray", heard_in_init)
    with sigterm_restored(), pytest.raises(KeyboardInterrupt):
        driver.start_ray(ClusterSettings(ray_address=None, object_store_gb=1.0))
    assert handlers == [_interrupt]  # ours already, before Ray sets its own

    monkeypatch.setattr(driver, "_start_ray", lambda cluster: sys.exit(2))
    with sigterm_restored(), pytest.raises(SystemExit):  # another exit is not a signal: as it was
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


# A stand-in driver: starts a local Ray as `factory run` does, hears SIGTERM, waits for a line, then needs Ray.
RAY_DRIVER = """
import os, signal, sys
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
import psutil, ray
from factory.plan import ClusterSettings
from factory.runtime.driver import start_ray
start_ray(ClusterSettings(ray_address=None, object_store_gb=0.3))
signal.signal(signal.SIGTERM, lambda *a: print("heard SIGTERM", flush=True))
groups = {os.getpgid(p.pid) for p in psutil.Process().children(recursive=True)}
print("ray processes in the driver's group:", os.getpgrp() in groups, flush=True)
sys.stdin.readline()
print("ray answers:", ray.get(ray.remote(lambda: 7).remote(), timeout=60), flush=True)
ray.shutdown()
"""


def test_a_sigterm_to_the_drivers_process_group_leaves_its_local_ray_running():
    """Plain `timeout` sends SIGTERM to its child and then to its whole group: Ray's processes were in the
    driver's group and ended at once (a lost stage, the step in flight unsaved); each now begins a session
    of its own (lifecycle.ray_starts_sessions), so the driver alone hears it, and Ray still answers."""
    driver = subprocess.Popen([sys.executable, "-c", RAY_DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        line = driver.stdout.readline()
        if line != "ray processes in the driver's group: False\n":
            os.killpg(driver.pid, signal.SIGKILL)  # (its stderr ends only with it)
            pytest.fail(line + driver.communicate()[1][-3000:])
        os.killpg(driver.pid, signal.SIGTERM)  # as `timeout` does: the group, the driver among it
        assert driver.stdout.readline() == "heard SIGTERM\n"
        time.sleep(1)  # (what SIGTERM ends, it ends at once)
        out, err = driver.communicate("go\n", timeout=120)
        assert driver.returncode == 0 and out == "ray answers: 7\n", err[-3000:]
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()


def test_rays_note_that_a_thread_set_no_sigterm_handler_is_not_shown():
    """factory.run from a thread (docs/python.md's example) printed Ray's "SIGTERM handler is not set because
    current thread is not the main thread", which asks nothing of the user; Ray's other warnings stay."""
    import logging

    from factory.runtime.driver import _no_sigterm_handler_note

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("ray._private.worker", logging.WARNING, "worker.py", 1681, msg, (), None)

    assert not _no_sigterm_handler_note(record("SIGTERM handler is not set because current thread is not the main "
                                               "thread."))
    assert _no_sigterm_handler_note(record("Failed to connect to the GCS"))


# ------------------------------------------------------------------------------- Ctrl-C while the stages start
class ClosesAtOnce(StageActor):
    """A stage stand-in set up at once, which notes its `close` in the folder its settings name."""

    def __init__(self, settings):
        self.folder = settings

    def setup(self, placement=None):
        return {}

    def close(self):
        open(os.path.join(self.folder, f"closed-{type(self).__name__}"), "w").close()


class StillSettingUp(ClosesAtOnce):
    """A synchronous stage whose setup starts a process (an engine, a tool server) and then takes a minute: a
    `close` sent meanwhile is answered only once setup returns."""

    def setup(self, placement=None):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        with open(os.path.join(self.folder, "child.pid"), "w") as f:
            f.write(str(child.pid))
        time.sleep(60)
        return {}


def test_a_ctrl_c_while_the_stages_start_says_so_and_stops_without_waiting_for_their_setup(tmp_path, monkeypatch):
    """A Ctrl-C (a notebook's interrupt) while a stage was still setting up: nothing was said, and the
    KeyboardInterrupt came 17-28 s later (up to 30 s: teardown sent `close` to every stage and waited, and a
    synchronous stage answers only once its setup is done). Now a line says it at once; the stages set up are
    closed, the one still setting up is killed, and what its setup started ends with it. A real local Ray."""
    import dataclasses
    import tempfile
    import threading
    from types import SimpleNamespace

    from factory.compiler.compile import compile_file
    from factory.plan import Stage
    from factory.runtime import driver
    from factory.runtime.startup import Startup

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    short = tempfile.mkdtemp(prefix="f-", dir="/tmp")  # (Ray's unix sockets go under it: a short path)
    monkeypatch.setattr(tempfile, "tempdir", short)  # this run's own Ray folder and driver records
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([repo, *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setattr(driver, "build_models", lambda plan, status: None)
    plan = compile_file(os.path.join(repo, "specs", "tiny.yaml"), weights=False)[1]
    plan = dataclasses.replace(plan, edges=(), stages=tuple(
        Stage(name, "test", f"tests.test_lifecycle:{cls}", str(tmp_path), (), ())
        for name, cls in (("ready", "ClosesAtOnce"), ("slow", "StillSettingUp"))))
    said: list[str] = []
    sent: list[float] = []

    def ctrl_c_once_setting_up():
        deadline = time.monotonic() + 120
        while not (tmp_path / "child.pid").exists() or not any(s.startswith("ready ready") for s in said):
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=ctrl_c_once_setting_up, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt), driver.placed(plan, SimpleNamespace(status=said.append), Startup()):
            pytest.fail("the stages were placed")
        took = time.monotonic() - sent[0]
    finally:
        import shutil

        shutil.rmtree(short, ignore_errors=True)
    assert said[-1] == "stopping: closing the stages that are set up, ending those still setting up", said
    assert took < 10, took  # Ray's shutdown and the wait for its processes to end: not the stage's setup (60 s)
    assert sorted(p.name for p in tmp_path.glob("closed-*")) == ["closed-ClosesAtOnce"]
    child = int((tmp_path / "child.pid").read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
