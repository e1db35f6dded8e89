"""How a run stops: Ctrl-C finishes the step in flight and saves, and a driver killed outright leaves
nothing behind that outlives the next `factory run`.

Ctrl-C. (From Python, `factory.run(..., stop=event)` is the same request without a signal: any thread
may set the event, and a run in a thread other than the main one hears no SIGINT.) A terminal sends
SIGINT to its whole foreground process group (and plain `timeout` sends SIGTERM to its child, then to
its group). A local Ray's processes (GCS, raylet, agents) would be in the driver's group: they would die
at once, taking the update actor and the chance of a final checkpoint with them. So each begins a session
of its own (ray_starts_sessions), and is started with SIGINT ignored as well (children inherit an ignored
signal, and Python keeps it ignored; this still holds should a Ray release move the hook the first
relies on), and the driver alone decides: the first Ctrl-C or SIGTERM asks the loop to stop after the
step in flight (which is logged and checkpointed), a second one stops at once. A signal sent to every
process of a cgroup (a SLURM time limit, `systemctl stop`) still reaches Ray's processes too.

SIGKILL. Nothing runs in a killed driver. Ray's GCS, raylet and workers notice and exit within seconds
(Ray's workers also take their child processes, the MCP servers, with them), but its dashboard and
runtime-env agents linger for a minute or two. So each driver records the processes it started (pid and
start time, refreshed every step) in a session file, deletes it when it ends, and every `factory run`
first ends what the records of dead drivers still name.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import psutil

from factory.util import UserError


class UnsafeFolder(UserError):
    """The per-user folder exists but another user owns it or others may write in it."""


def private_dir() -> Path:
    """This user's folder on this machine (`factory-<uid>` in the system temp folder): the local Ray's
    session files in `ray/` (its unix sockets among them; Ray makes that folder writable by all, which this
    one's mode makes moot) and the driver records in `drivers/`. Its name is predictable, so another local
    user could make it first and watch or plant what goes in: it is made 0700, and one that already exists
    must be owned by this user and writable by nobody else (UnsafeFolder otherwise). (Factory used
    `factory-ray-<uid>` before, which Ray had made writable by all: it is left alone.)"""
    path = Path(tempfile.gettempdir()) / f"factory-{os.getuid()}"
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        owner = "a link" if stat.S_ISLNK(info.st_mode) else f"owned by uid {info.st_uid}, mode {info.st_mode & 0o777:o}"
        raise UnsafeFolder(f"{path} exists and is {owner}: another user may control what a run puts there "
                           "(Ray's sockets, the records of the processes it ends). Remove it, or set TMPDIR to a "
                           "folder of your own")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)  # ours, and readable by others (made by an older Factory or by Ray): close it
    return path


# Ray binds a local cluster's gRPC servers to every interface and advertises the machine's address unless
# this is "0" (then it takes 127.0.0.1 as the node address and binds that alone). Ray reads it once, when
# `ray` is first imported (ray._private.ray_constants.ENABLE_RAY_CLUSTER, which ray.init's node address
# comes from: services.get_node_ip_address; ray.init's own `_node_ip_address="127.0.0.1"` is resolved to
# the machine's address the same way): set after the import, the Ray that ray.init starts still listens on
# every interface, although its processes inherit the "0".
LOOPBACK_FLAG = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
IMPORTED_TOO_EARLY = (f"ray was imported in this process before Factory could set {LOOPBACK_FLAG}=0, and Ray reads "
                      "it once, at import: a local Ray started here would listen on every network interface: set "
                      f"{LOOPBACK_FLAG}=0 before importing ray (in the environment, or in os.environ above the "
                      "`import ray`), or start the run in a process of its own (`factory run SPEC`, a subprocess)")


# Said instead where it was an earlier run of this process, one that joined a cluster, whose driver imported ray: a
# joined driver needs the flag unset (with it, its own address is 127.0.0.1, which the cluster's nodes cannot reach).
JOINED_FIRST = ("an earlier run in this process joined a Ray cluster, so ray was imported without "
                f"{LOOPBACK_FLAG}=0 (a run that joins needs it unset), and Ray reads it once, at import: a local Ray "
                "started here would listen on every network interface: start this local run in a process of its own "
                "(`factory run SPEC`, a subprocess), or join a cluster again")
_imported_for_a_joined_run = False  # (`local_ray_on_loopback` of a joined run, ray not yet imported)

# Set where leaving a cluster gave up on a head that did not answer (factory.runtime.driver.stop_ray): its
# ray.shutdown still runs in a thread and holds Ray's connect lock, so the next ray.init here would wait for good.
left_hanging: str | None = None


def local_ray_on_loopback(ray_address: str | None, what: str = "the run") -> None:
    """Before `ray` is imported: a local Ray of our own (no `ray_address`) will listen on loopback only.
    Every entry point that may start one (factory.run, factory.evaluate, rescore) calls it first, and so
    refuses `what` at once where ray was imported too early for that (`check_ray_on_loopback`);
    factory.runtime.driver.start_ray checks again."""
    global _imported_for_a_joined_run
    if not ray_address:
        os.environ.setdefault(LOOPBACK_FLAG, "0")
        check_ray_on_loopback(what)
    elif "ray" not in sys.modules:
        _imported_for_a_joined_run = True


def ray_read_the_flag_too_early() -> bool:
    """`ray` was imported in this process while the loopback flag was unset, so a local Ray started here
    would listen on every interface whatever the environment says now. A user's own
    `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1` is theirs to choose. Not imported: nothing read yet."""
    if "ray" not in sys.modules:
        return False
    from ray._private import ray_constants

    return ray_constants.ENABLE_RAY_CLUSTER and os.environ.get(LOOPBACK_FLAG, "0") == "0"


def check_ray_on_loopback(what: str = "the run") -> None:
    """Refuse to start a local Ray that would listen on every interface: `ray` was imported (in a notebook's
    imports cell, by other code) before `local_ray_on_loopback` set the flag. Only setting it before the
    import, or a process of its own, helps."""
    if ray_read_the_flag_too_early():
        raise UserError(f"{what}: {_too_early()}")


def _too_early() -> str:
    return JOINED_FIRST if _imported_for_a_joined_run else IMPORTED_TOO_EARLY


def refuse_a_ray_up(what: str) -> None:
    """Refuse to start a run where a Ray is up in this process already (the caller's own `ray.init()`, another
    library's): a process holds one Ray, so the run's ray.init failed, and its clean-up then shut that Ray down
    under its owner. Their ray.shutdown() helps only where ray was imported with the loopback flag set
    (`check_ray_on_loopback`), else the advice is what does. Asked of `ray` only where it was imported:
    importing it here would come before `local_ray_on_loopback`."""
    if left_hanging is not None:
        raise UserError(f"{what}: the Ray head at {left_hanging} did not answer when an earlier run in this process "
                        "left it, and that disconnect still holds Ray's lock here: this process cannot start or join "
                        "a Ray again; restart it (a notebook's kernel), or start the run in a process of its own")
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        up = (f"{what}: a Ray is already up in this process (your own ray.init(), or another library's): a run "
              "starts a Ray of its own, and a process holds one Ray at a time")
        if ray_read_the_flag_too_early():
            raise UserError(f"{up}; ray.shutdown() yours would not be enough for a local Ray: {_too_early()}")
        raise UserError(f"{up}: ray.shutdown() yours first, or start the run in a process of its own (`factory run "
                        "SPEC`, a subprocess)")


def sessions_dir() -> Path:
    """One folder per user on this machine, beside the local Ray's own session files."""
    return private_dir() / "drivers"


# ---------------------------------------------------------------------------------- Ctrl-C
class GracefulStop:
    """While active (a context manager), a stop request ends the loop after its current step: the first
    SIGINT (Ctrl-C, or a notebook's "interrupt kernel") or SIGTERM to the driver (`kill PID`, `timeout
    --foreground`, a container or job being stopped), heard in the main thread only, where Python delivers
    signals; or `event` set by any thread (factory.run's `stop`). A second signal raises KeyboardInterrupt,
    as a second Ctrl-C does. (SIGTERM otherwise met Ray's handler in the driver, which aborts: exit code 134,
    the run FAILED, unsaved.) Plain `timeout` sends SIGTERM twice, to its child and then to its group, the
    driver's: a SIGTERM within ECHO_S of the one before is that same request (`_echo`), not a second."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, on_first: Any = None, event: threading.Event | None = None):
        self.event = event if event is not None else threading.Event()
        self._on_first = on_first  # called with what asked ("Ctrl-C", "SIGTERM") on the first signal (to tell the user)
        self._previous: dict[int, Any] = {}
        self._wakeup: tuple[socket.socket, socket.socket] | None = None  # (read, write): counts signals heard

    @property
    def requested(self) -> bool:
        return self.event.is_set()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGTERM and _echo():
            return
        # Python runs the handler once for all the SIGINTs that arrived while the main thread was in C code
        # (Ray's `get` looks for signals once a second): the wakeup fd holds a byte per signal, so two Ctrl-Cs
        # heard at once are still two. (SIGTERMs at once are `timeout`'s echo, above.)
        presses = self._heard().count(signal.SIGINT) if signum == signal.SIGINT else 1
        if self.requested:
            raise KeyboardInterrupt
        self.event.set()
        if self._on_first is not None:
            self._on_first("Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name)
        if presses > 1:
            raise KeyboardInterrupt

    def _heard(self) -> bytes:
        """The signal numbers delivered since the last call, one byte each (empty without a wakeup fd)."""
        if self._wakeup is None:
            return b""
        heard = b""
        with contextlib.suppress(BlockingIOError):
            while chunk := self._wakeup[0].recv(256):
                heard += chunk
        return heard

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
            read, write = socket.socketpair()
            read.setblocking(False)
            write.setblocking(False)
            before = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
            if before != -1:  # someone's own (an asyncio loop's signal handlers): theirs stays, no counting
                signal.set_wakeup_fd(before)
                read.close()
                write.close()
            else:
                self._wakeup = (read, write)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():  # None: a handler set outside Python (Ray's)
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        self._previous = {}
        if self._wakeup is not None:
            now = signal.set_wakeup_fd(-1)
            if now != self._wakeup[1].fileno():  # set since by another (an asyncio loop's): theirs stays
                signal.set_wakeup_fd(now)
            for end in self._wakeup:
                end.close()
            self._wakeup = None


def sigterm_interrupts() -> None:
    """From now on SIGTERM raises KeyboardInterrupt in the main thread, as a second Ctrl-C does: the driver
    tears its stages and Ray down and exits 130 (GracefulStop, once the steps begin, makes the first one a
    stop after the step). Called after ray.init, whose handler for SIGTERM in the driver aborts it: exit code
    134, a C stack dump, nothing torn down. Outside the main thread signals cannot be changed: no-op."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    if not _echo():  # (an echo would interrupt the teardown the first one began)
        raise KeyboardInterrupt


# Set when the driver heard SIGTERM: a stage lost right after it most likely heard it too (a SIGTERM to every
# process of a job, as SLURM's time limit or systemd's stop send, reaches Ray's processes, which end at once),
# and the lost-stage message says so.
sigterm_heard = threading.Event()
_sigterm_at = float("-inf")  # when the driver last heard SIGTERM (time.monotonic)
ECHO_S = 1.0


def _echo() -> bool:
    """Record a SIGTERM heard now; True when it echoes one heard less than ECHO_S before (one sender's
    two sends: plain `timeout` signals its child, then its whole group), which asks for nothing new."""
    global _sigterm_at
    now, before = time.monotonic(), _sigterm_at
    _sigterm_at = now
    sigterm_heard.set()
    return now - before < ECHO_S


def stopping_said(what: str) -> str:
    """What the display says when `what` ("Ctrl-C", "SIGTERM") first asks a run to stop. A SIGTERM within
    ECHO_S of this one is taken as its echo (`_echo`): a user who sends it again at once must wait that long."""
    again = f"{what} again" + (f" ({ECHO_S:g} s or more after this one)" if what == "SIGTERM" else "")
    return f"{what}: stopping after the step in progress (it is logged and checkpointed); {again} stops at once"


@contextlib.contextmanager
def sigterm_restored() -> Iterator[None]:
    """SIGTERM's handling as it was before, once the block is done: Ray's handler and `sigterm_interrupts`'
    are the run's, not the handling of a program or notebook that goes on after factory.run returns (where
    SIGTERM would raise KeyboardInterrupt ever after). Outside the main thread: nothing to restore."""
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL if before is None else before)


@contextlib.contextmanager
def children_ignore_sigint(started_ignoring: bool = False) -> Iterator[None]:
    """Processes started inside inherit SIGINT ignored (see the module doc); the caller's own handling is
    restored at once after. `started_ignoring`: the processes are started ignoring it by themselves
    (`ray_starts_sessions`' Popen), so the caller need not be deaf meanwhile: a SIGINT that comes is kept
    and raised once the block is done, handled as the caller handles it (a Ctrl-C while a local Ray started
    was lost, and the run went on). Outside the main thread (tests, embedding) signals cannot be changed:
    no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    heard: list[int] = []
    previous = signal.signal(signal.SIGINT, (lambda signum, frame: heard.append(signum)) if started_ignoring
                             else signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if heard:
        signal.raise_signal(signal.SIGINT)


def _ignoring_sigint(then: Callable[[], Any] | None) -> Callable[[], None]:
    """A Popen `preexec_fn` that makes the child ignore SIGINT (kept across exec), then runs `then`."""
    def preexec() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if then is not None:
            then()
    return preexec


# Set once a local Ray was started with its processes in sessions of their own (ray_starts_sessions): a SIGTERM
# to the driver's process group then no longer reaches them, and the lost-stage message says what still does.
ray_in_own_sessions = threading.Event()


@contextlib.contextmanager
def ray_starts_sessions() -> Iterator[bool]:
    """Each process a local Ray starts inside (GCS, raylet, its agents; the raylet's workers, the stage
    actors and the MCP servers and engines they start, inherit the raylet's) begins a session of its own, out
    of the driver's process group. A signal to that group then reaches the driver alone: plain `timeout`
    sends SIGTERM to its child and then to its whole group, and Ray's processes (which Ray shields from
    SIGINT, not SIGTERM) ended at once, so the run stopped as a lost stage, its step unsaved; now the driver
    finishes the step, checkpoints and shuts Ray down (by pid, which still reaches them). A driver killed
    outright still takes them along: Ray binds each to its parent's death (PR_SET_PDEATHSIG), sessions
    apart. A signal to every process of a job (SLURM's time limit, systemd's stop: by cgroup) still reaches
    them. Ray 2.60 starts them all through `ray._private.services.ConsolePopen` (a subprocess.Popen),
    which is swapped for the block's length (ray is pinned; tests/test_lifecycle.py fails should a release
    move it); a Ray without it starts them as before."""
    from ray._private import services

    base = getattr(services, "ConsolePopen", None)
    if base is None:
        yield False
        return

    class OwnSession(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("start_new_session", True)
            kwargs["preexec_fn"] = _ignoring_sigint(kwargs.get("preexec_fn"))  # (Ray passes one of its own)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnSession
    ray_in_own_sessions.set()
    try:
        yield True
    finally:
        services.ConsolePopen = base


# ---------------------------------------------------------------------------------- SIGKILL
def _identity(proc: psutil.Process) -> dict[str, Any]:
    """A process as (pid, start time): a pid alone may be reused by an unrelated process later."""
    return {"pid": proc.pid, "started": proc.create_time(), "name": proc.name()}


def _alive(entry: dict[str, Any]) -> psutil.Process | None:
    proc = _same(entry)
    return proc if proc is not None and _running(proc) else None


def _same(entry: dict[str, Any]) -> psutil.Process | None:
    """The recorded process, if its pid still names it (a zombie too)."""
    try:
        proc = psutil.Process(entry["pid"])
        return proc if abs(proc.create_time() - entry["started"]) < 0.01 else None
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _running(proc: psutil.Process) -> bool:
    """Not ended: a zombie has exited, its parent not yet having collected it. A dead driver's processes are
    orphans whose parent is PID 1, which collects them late or, in some containers, never (here a Ray agent
    stayed a zombie for seconds), so waiting on the pid alone waited out the whole timeout on the dead."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_ended(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait up to `timeout_s` for `procs` to end (exit or turn zombie); the ones still running after."""
    deadline = time.monotonic() + timeout_s
    while True:  # psutil's wait collects our own children's exit; a zombie of another parent counts as ended
        _, left = psutil.wait_procs(procs, timeout=max(0.0, min(0.1, deadline - time.monotonic())))
        procs = [p for p in left if _running(p)]
        if not procs or time.monotonic() >= deadline:
            return procs


def _key(proc: psutil.Process) -> tuple[int, float]:
    return proc.pid, proc.create_time()


class SessionRecord:
    """The session file of one driver: itself and every process it started, kept current. Made before the
    run starts anything (Ray): the driver's children then are the caller's own (a notebook's `mlflow server`
    or `vllm serve`), which the run's end, or the next run's start after a killed one, must not end; they and
    theirs are left out of the record."""

    def __init__(self, folder: Path | None = None):
        self.folder = folder or sessions_dir()
        self.me = psutil.Process()
        self.path = self.folder / f"{self.me.pid}.json"
        self.callers: set[tuple[int, float]] = set()
        for proc in self.me.children():
            with contextlib.suppress(psutil.Error):  # (one that ended meanwhile is no one's)
                self.callers.add(_key(proc))

    def update(self) -> None:
        """Write (or rewrite) the record with the driver's descendants as they are now, the caller's apart."""
        try:
            children = [_identity(q) for p in self.me.children() if _key(p) not in self.callers
                        for q in (p, *p.children(recursive=True))]
        except psutil.Error:
            return  # a child ended while we listed: the next update will catch up
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"driver": _identity(self.me), "children": children}))
        os.replace(tmp, self.path)

    def close(self, timeout_s: float = 10.0) -> list[str]:
        """The driver is ending in order, its cluster shut down: wait for the processes it started to exit,
        end those that linger (Ray's agents take a while), and drop the record. Returns what was ended."""
        ended = reap_orphans(self.folder, timeout_s, only=self.path, wait_s=timeout_s)
        self.path.unlink(missing_ok=True)
        return ended


def prune_ray_sessions(folder: Path, keep: int = 10) -> list[str]:
    """Remove the local Ray's session folders (`session_<date>_<time>_<usec>_<driver pid>`: logs, sockets,
    ~0.4-2 MB each) of drivers no longer alive, all but the newest `keep` (a crashed run's logs stay a while
    for a look). Ray never removes them: 159 runs had left 61 MB here. A session whose driver may still run (a
    concurrent run: its pid alive, a process started before the session or within a day of it) is never
    touched. Returns the names removed."""
    sessions = sorted(p for p in folder.glob("session_2*") if p.is_dir() and not p.is_symlink())
    removed = []
    for path in sessions[:-keep] if keep else sessions:
        parts = path.name.split("_")  # session, date, time, microseconds, pid
        try:
            pid = int(parts[-1])
            started = time.mktime(time.strptime(f"{parts[1]}_{parts[2]}", "%Y-%m-%d_%H-%M-%S"))
        except (ValueError, IndexError):
            continue  # not a name Ray gives: not ours to remove
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            # Its driver alive: the pid alive and started before the session. The name's time is local and
            # the clock may have been stepped (another TZ, the hour repeated at the end of summer time), so a
            # day's slack: a pid reused within a day only keeps the folder until a later start.
            if psutil.Process(pid).create_time() <= started + 86400:
                continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path.name)
    return removed


def reap_orphans(folder: Path | None = None, timeout_s: float = 5.0, *, only: Path | None = None,
                 wait_s: float = 0.0) -> list[str]:
    """End the processes that drivers no longer alive left behind (SIGTERM, then SIGKILL after
    `timeout_s`), and drop their records. Returns what was ended, as `name[pid]`. `only`: just this
    record, whose driver is the caller (alive); its processes get `wait_s` to exit by themselves first."""
    folder = folder or sessions_dir()
    ended: list[psutil.Process] = []
    labels: list[str] = []
    paths = [only] if only is not None else (sorted(folder.glob("*.json")) if folder.is_dir() else [])
    for path in paths:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            continue
        if only is None and _alive(record["driver"]) is not None:
            continue  # another run is going on: its processes are its own
        if wait_s:
            # (zombies too: psutil's wait collects those that are the driver's own, which it would keep otherwise)
            _wait_ended([p for e in record["children"] if (p := _same(e)) is not None], wait_s)
        for entry in record["children"]:
            proc = _alive(entry)
            if proc is not None:
                with contextlib.suppress(psutil.Error):
                    proc.terminate()
                    ended.append(proc)
                    labels.append(f"{entry['name']}[{entry['pid']}]")
        path.unlink(missing_ok=True)
    stubborn = _wait_ended(ended, timeout_s)
    for proc in stubborn:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    _wait_ended(stubborn, 5.0)  # (a SIGKILL is delivered, not done, when kill returns: gone before this does)
    return labels
