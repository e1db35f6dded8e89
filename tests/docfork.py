"""A fork server for the docs harness's `factory` commands: the same program, without its imports each time.

A docs page runs ~60 `factory` commands (its console blocks, and `factory check` of its specs); a fresh
interpreter imports the compiler's dependencies (pydantic, pyarrow, numpy...) for ~0.6 s of the ~0.9 s each
takes on a 2-core Zen 4. Here one process imports them once and forks a copy per command. `factory` on the
harness's PATH is then a small client (`shim`) that hands the server its argv, working folder, environment
and its own stdin/stdout/stderr (the file descriptors themselves), waits, and exits with the command's exit
status: what the command reads, prints and returns is what the installed `factory` would have.

The client runs the installed `factory` instead (exec) when its environment differs from the server's in
anything but the shell's own variables (`HF_HOME=... factory check`, an `export`): a library that reads a
variable when it is imported would have read the server's. A command left running when its client goes
(the harness's timeout) is killed with the server (its process group) at the end of the session.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys

VOLATILE = {"PWD", "OLDPWD", "SHLVL", "_"}  # what bash itself sets per command
PRELOAD = ("factory.commands.cli", "factory.commands.api", "factory.compiler.compile")
PARENT_CHECK_S = 1.0  # how often the server looks whether the process that started it is still there


def _env_key(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in VOLATILE}


def _run(argv: list[str], cwd: str, env: dict[str, str], fds: list[int]) -> None:
    """In the forked worker: become `factory ARGV` in CWD on the client's descriptors, then exit as it would."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = argv
    from factory.commands.cli import main

    sys.exit(main(argv[1:]))  # the interpreter's normal exit: atexit handlers, flushed streams


def serve(path: str) -> None:
    """Listen at `path` until killed, or until the process that started it is gone (a test session killed
    hard never reaches its `finally`: the server, and any command it forked, would outlive it); per request
    a forked waiter, which forks the worker and reports its pid, then its exit status. Nothing here starts a
    thread: a forked copy has the imports and nothing else."""
    parent = os.getppid()
    for name in PRELOAD:
        __import__(name)
    own = _env_key(dict(os.environ))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(64)
    listener.settimeout(PARENT_CHECK_S)  # (an accepted connection still blocks: the default timeout is None)
    os.rename(path + ".new", path)  # the path appears once it accepts
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            if os.getppid() != parent:  # orphaned: end, with every command still running from here
                if os.getpgrp() == os.getpid():  # (its own group, as fork_server starts it; never a shell's)
                    os.killpg(os.getpgrp(), signal.SIGKILL)
                os._exit(0)
            continue
        _reap()
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        request = json.loads(msg)
        if _env_key(request["env"]) != own or len(fds) != 3:
            conn.sendall(b"exec\n")
        elif os.fork() == 0:
            listener.close()
            worker = os.fork()
            if worker == 0:
                conn.close()
                _run(request["argv"], request["cwd"], request["env"], fds)  # exits, through __main__
            for fd in fds:  # the client's pipes close when the worker's copies do
                os.close(fd)
            conn.sendall(f"pid {worker}\n".encode())
            code = os.waitstatus_to_exitcode(os.waitpid(worker, 0)[1])
            conn.sendall(f"exit {code if code >= 0 else 128 - code}\n".encode())
            os._exit(0)
        conn.close()
        for fd in fds:
            os.close(fd)


def _reap() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


SHIM = """#!{python} -IS
# `factory` through the docs harness's fork server (tests/docfork.py); the installed one when it is not there.
import json, os, signal, socket, sys
real, path = {real!r}, os.environ.get("FACTORY_DOCS_FORK", "")
def fallback():
    os.execv(real, [real, *sys.argv[1:]])
if not path:
    fallback()
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(path)
msg = json.dumps({{"argv": [real, *sys.argv[1:]], "cwd": os.getcwd(), "env": dict(os.environ)}}).encode()
socket.send_fds(s, [msg], [0, 1, 2])
f = s.makefile("rb")
first = f.readline().decode().split()
if first == ["exec"]:
    s.close()
    fallback()
pid = int(first[1])
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, lambda n, _: os.kill(pid, n))
last = f.readline().decode().split()
sys.exit(int(last[1]) if last[:1] == ["exit"] else 1)
"""


def write_shim(folder: str, python: str, real: str) -> None:
    """`folder`/factory: the client (put `folder` first on PATH)."""
    target = os.path.join(folder, "factory")
    with open(target, "w") as f:
        f.write(SHIM.format(python=python, real=real))
    os.chmod(target, 0o755)


if __name__ == "__main__":
    # As the installed console script's interpreter would have it: its own folder first on sys.path, not tests/.
    sys.path[0] = os.path.dirname(sys.executable)
    serve(sys.argv[1])
