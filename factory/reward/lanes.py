"""Reward functions run off the event loop, each node in threads of its own, within its `timeout_s`.

Python cannot stop a thread. A function that never returns keeps its thread past its node's `timeout_s`:
in one shared pool such threads used up the pool, and every node's calls then waited in its queue until they
too timed out, their clock having run while they queued -- one hung function took every reward with it. Here
a node's calls run in threads of its own `Lane` (daemon threads: a process that ends does not wait for a hung
one), the clock starts when a thread takes the call, and a call that times out keeps its place in the lane until
its thread ends: a hung function holds up its own node only, whose later calls fail at once once every place
is held by one that never returned. That holds for a function that lets go of the GIL (I/O, sleeps, C code that
releases it): one that holds it (a loop in Python, a regular expression running away on the model's output)
stops every thread of the process, the event loop and its clocks included, until it ends, and no timeout fires
meanwhile. Such a function belongs under `processes`.

A node with `processes: N` runs its calls in N worker processes of its own instead (`Processes`): a
CPU-bound function that holds the GIL then runs N at once, and a call past its timeout ends with its process.

Whatever the function raises is its failure, as an Exception the stage records: KeyboardInterrupt,
SystemExit (argparse, sys.exit) and CancelledError (`.result()` of a cancelled future) included, which would
otherwise end the call's task, the stage's event loop, or the run.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

import anyio

from factory.util import TIMEOUTS, AllStuck, Places

log = logging.getLogger(__name__)


class Lane:
    """At most `size` calls of one node's function at once, each in a thread of the lane's own; `places.stuck`:
    those past their timeout whose thread still runs (each keeps its place). A thread whose call returned waits
    for the node's next call (what a function keeps per thread, `threading.local`, lasts); one that never returns
    is never handed another."""

    def __init__(self, name: str, size: int):
        self.name, self.size = name, size
        self.places = Places(size)  # (all on the loop that runs the calls)
        self._idle: list[queue.SimpleQueue] = []  # the inboxes of threads waiting for a call
        self._threads: dict[queue.SimpleQueue, threading.Thread] = {}  # each inbox's thread
        self._closed = False

    async def run(self, fn: Callable[..., Any], timeout_s: float | None) -> Any:
        """`fn()`'s result, in one of the lane's threads once a place is free; TimeoutError past `timeout_s` of
        its run."""
        loop = asyncio.get_running_loop()
        try:
            await self.places.take()  # (the time spent waiting for a place is not the function's)
        except AllStuck:
            raise RuntimeError(f"its last {self.size} calls passed timeout_s and have not returned (a function "
                               "that never returns: Python cannot stop it), so it is not called again until one "
                               "does") from None
        done = loop.create_future()
        late = False
        inbox = self._idle.pop() if self._idle else None

        def ended() -> None:  # on the loop, when the thread's call ends: its place is free again
            if self._closed:  # (a call that outlived close: its thread ends now)
                inbox.put(None)
                self._threads.pop(inbox, None)
            else:
                self._idle.append(inbox)  # (its thread takes the next call from it)
            self.places.leave(stuck=late)

        def work() -> None:
            outcome = _outcome(fn)
            try:
                loop.call_soon_threadsafe(_settle, done, outcome, ended)
            except RuntimeError:  # the loop is closed (the stage ended while this ran): nothing waits, nor calls
                inbox.put(None)

        try:
            if inbox is None:
                inbox = queue.SimpleQueue()
                thread = threading.Thread(target=_serve, args=(inbox,), name=f"reward-{self.name}", daemon=True)
                thread.start()
                self._threads[inbox] = thread
            inbox.put(work)
        except BaseException:
            self.places.leave()
            raise
        try:
            return await asyncio.wait_for(asyncio.shield(done), timeout_s)
        except BaseException as e:  # past its timeout, or this call cancelled (a `fail` node ended the scoring)
            if done.done():  # what the function raised of its own (a socket.timeout too): not the wait's
                if isinstance(e, TIMEOUTS):  # or its outcome landed as the wait timed out: the call's, not lost
                    return done.result()
                raise
            late = True  # its thread runs on, holding its place until it ends
            self.places.abandon()
            # nobody awaits its outcome now: _settle leaves it unset (an error set there asyncio would log, at
            # ERROR, as never retrieved)
            done.cancel()
            if isinstance(e, TIMEOUTS):
                raise TimeoutError(f"took longer than timeout_s ({timeout_s:g} s)") from None
            raise

    async def close(self) -> None:
        """Ends its idle threads (each waited for a next call for the life of the process: every stage made
        left its threads behind); one whose call runs on ends when that call does, and one that never returns
        stays (Python cannot stop it; a daemon, it does not keep the process alive)."""
        self._closed = True
        idle, self._idle = self._idle, []
        for inbox in idle:
            inbox.put(None)
        for inbox in idle:  # (at once: each only reads the None and returns)
            self._threads.pop(inbox).join(1.0)


class Processes:
    """A node's calls in `size` worker processes of its own (pebble's pool, started at the first call): threads
    of one process take turns at a function that holds the GIL (sympy, a checker written in Python), processes
    do not. A call past its `timeout_s`, or whose caller was cancelled, ends its worker process (the pool
    starts another), which no thread can be made to do; a process that dies (a segfault, `os._exit`) fails its
    call only, and a pool that pebble finds broken (every worker gone) is replaced at the next call. Each call
    comes back as plain data (`_in_worker`): whatever the function raises or returns that cannot be sent back
    is its failure, said as text, never the pool's. The function and its arguments are pickled: the compiler
    checks the function and its `args` can be."""

    def __init__(self, name: str, size: int):
        self.name, self.size = name, size
        self._pool: Any = None
        self._calls: set[concurrent.futures.Future] = set()  # in flight: failed by close(), which stops them
        self._closing = False

    def _started(self) -> Any:
        if self._pool is not None and not self._pool.active:  # broken: its workers died idle, say
            old, self._pool = self._pool, None
            old.stop()
            threading.Thread(target=old.join, name=f"reward-{self.name}-old-pool", daemon=True).start()
        if self._pool is None:
            import multiprocessing

            from pebble import ProcessPool

            # spawn, not fork: a fork would copy this process's threads' locks (Ray's, the event loop's) mid-use
            self._pool = ProcessPool(max_workers=self.size, context=multiprocessing.get_context("spawn"),
                                     initializer=_worker_start, initargs=(os.getpid(),))
        return self._pool

    async def run(self, fn: Callable[..., Any], timeout_s: float | None) -> Any:
        """`fn()`'s result from a worker process; TimeoutError past `timeout_s` of its run there."""
        from pebble import ProcessExpired

        # (pebble's clock starts when a worker takes the call)
        future = self._started().schedule(_in_worker, args=(fn,), timeout=timeout_s)
        self._calls.add(future)
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def settled(f: concurrent.futures.Future) -> None:  # in pebble's thread
            self._calls.discard(f)
            try:
                loop.call_soon_threadsafe(_copy, f, done)
            except RuntimeError:  # the loop is closed: nothing waits
                pass

        future.add_done_callback(settled)
        try:
            ok, value = await done
        except asyncio.CancelledError:  # this call was cancelled (a `fail` node ended the scoring): end its worker
            future.cancel()
            raise
        except (*TIMEOUTS, concurrent.futures.TimeoutError):  # pebble's: the call ran past timeout_s
            raise TimeoutError(f"took longer than timeout_s ({timeout_s:g} s); its process was ended") from None
        except ProcessExpired as e:
            raise RuntimeError(f"its worker process ended during the call (exit code {e.exitcode}: a crash in "
                               "native code, os._exit or a signal)") from None
        except Exception as e:  # pebble's BrokenProcessPool: stopped by close(), or broken (a new one next call)
            if self._closing:
                raise RuntimeError("the reward stage closed during the call") from None
            raise RuntimeError(f"its worker pool broke during the call ({type(e).__name__}: {e}); the node's next "
                               "call starts a new one") from None
        if ok:
            return value
        raise value

    async def close(self) -> None:
        if self._pool is None:
            return
        self._closing = True
        self._pool.stop()  # (ends running calls' workers too)
        try:  # (pebble stops a worker that ignores SIGTERM 3 s later, one after another: not forever)
            await asyncio.wait_for(asyncio.to_thread(self._pool.join), 30)
        except TIMEOUTS:
            log.warning("reward node %s: its worker processes did not stop within 30 s", self.name)
        for call in list(self._calls):  # pebble leaves some unsettled: their callers would wait for ever
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                call.set_exception(RuntimeError("the reward stage closed during the call"))


def _serve(inbox: queue.SimpleQueue) -> None:
    """A lane's thread: each call handed to it, one after another, until None (its lane closed) (daemon: a
    process that ends does not wait for one that never returned)."""
    while (work := inbox.get()) is not None:
        work()
        del work  # (held while it waits, it would keep the call's future, and all it refers to, alive)


def _copy(source: concurrent.futures.Future, done: asyncio.Future) -> None:
    """`source`'s outcome into `done` (on the loop), unless its caller stopped waiting."""
    if done.cancelled():
        return
    if source.cancelled():  # not by this call's caller (that cancels `done` first): the pool's stop
        done.set_exception(RuntimeError("the reward stage closed during the call"))
    elif (error := source.exception()) is not None:
        done.set_exception(error)
    else:
        done.set_result(source.result())


def _outcome(call: Callable[[], Any]) -> tuple[bool, Any]:
    """(True, `call()`) or (False, the exception the stage is to raise): whatever the function raises is its
    failure, SystemExit, KeyboardInterrupt and CancelledError (not the stage's to end) as a RuntimeError."""
    try:
        return True, call()
    except Exception as e:  # noqa: BLE001 -- the function's own failure, handed to the caller
        return False, e
    except BaseException as e:  # noqa: BLE001 -- SystemExit, KeyboardInterrupt, CancelledError
        return False, RuntimeError(f"the function raised {type(e).__name__}({_args(e)})")


def _in_worker(call: Callable[[], Any]) -> tuple[bool, Any]:
    """In the worker: (True, the value) or (False, the exception to raise in the stage), checked to pickle. What
    the function raises goes back as a value, not through pebble: an exception that does not unpickle broke the
    whole pool there, and asyncio turns a CancelledError or TimeoutError of the function's into its own."""
    import pickle

    outcome = _outcome(call)
    try:
        pickle.loads(pickle.dumps(outcome))
    except Exception as e:  # noqa: BLE001 -- a value or exception of a class made inside the function, a lambda
        ok, value = outcome
        what = "its result" if ok else f"the {type(value).__name__} it raised ({value})"
        outcome = (False, RuntimeError(f"{what} cannot be sent back from its worker process: "
                                       f"{type(e).__name__}: {e}"))
    return outcome


def _worker_start(parent: int) -> None:
    """Each worker as it starts: it is killed when the process that started it dies (a stage's process ended by
    SIGKILL or the OOM killer would leave a worker computing for ever), Linux's PR_SET_PDEATHSIG."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before that
        os._exit(1)


def _settle(done: asyncio.Future, outcome: tuple[bool, Any], ended: Callable[[], None]) -> None:
    ended()
    if done.cancelled():  # the caller stopped waiting (past its timeout, or its scoring call ended)
        return
    ok, value = outcome
    if ok:
        done.set_result(value)
    else:
        done.set_exception(value)


def _args(e: BaseException) -> str:
    return ", ".join(repr(a) for a in e.args)


async def awaited(fn: Callable[..., Any], timeout_s: float | None, said: float | None = None) -> Any:
    """An async reward function's result within `timeout_s` (cancelled past it), run in the caller's task (a
    task of its own would hand a SystemExit to the event loop, which ends with it); what it raises of its own
    that is not an Exception (a CancelledError of its own, not this call's) is a RuntimeError saying so.
    `said`: the timeout_s its error names, where `timeout_s` is what was left of it."""
    try:
        with anyio.move_on_after(timeout_s) as scope:
            return await fn()
    except asyncio.CancelledError as e:
        current = asyncio.current_task()
        cancelling = getattr(current, "cancelling", None)  # (Python 3.11+; before, any is taken as this call's)
        if cancelling is None or cancelling():  # this call was cancelled: that is not the function's
            raise
        raise RuntimeError(f"the function raised CancelledError({_args(e)})") from None
    except (SystemExit, KeyboardInterrupt) as e:
        raise RuntimeError(f"the function raised {type(e).__name__}({_args(e)})") from None
    assert scope.cancelled_caught
    raise TimeoutError(f"took longer than timeout_s ({said or timeout_s:g} s)")
