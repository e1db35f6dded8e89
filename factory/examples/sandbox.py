"""A sandboxed Python runner as an MCP server: the code-execution agent's tool.

    python -m factory.examples.sandbox [--timeout-s 10] [--cpu-s 5] [--memory-mb 512]

One tool, `run_python(code)`: the code runs as `main.py` in a fresh temporary folder, in a child
process of its own session, with the standard library only, and the tool answers with its exit code,
stdout and stderr (each cut to `--output-chars`). The child locks itself down with kernel mechanisms
before the code starts (see `factory.examples.sandbox_child`): resource limits, network and mount
namespaces where the kernel allows them (the folder becomes a private tmpfs of `--disk-mb`), no
capabilities (a root server's too), Landlock (reads limited to the Python installation and system
libraries, writes to the temporary folder) and seccomp (no exec, no fork, no sockets, no device nodes,
signals only to itself). The server adds a wall-clock limit: a
program still running after `--timeout-s` (pipes closed or not) is killed with its whole process group,
and so is one whose files outgrow `--disk-mb` (or the tmpfs's file count) where the kernel could not
enforce it. The folder is deleted after each call. No program outlives the server: the kernel kills the
child when the server dies, however it dies, and a server stopped by SIGTERM first kills the calls under
way and deletes their folders.

Linux only; Landlock (kernel 5.13+, enabled in the LSM list) and libseccomp are required: where either
is missing nothing runs, and every call fails with a JSON-RPC error that says why.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import stat
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError
from mcp.types import INTERNAL_ERROR
from pydantic import Field

from factory.examples import serve
from factory.examples.sandbox_child import MAX_FILES


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0   # wall clock, enforced by the server
    cpu_s: int = 5            # CPU time (RLIMIT_CPU): SIGKILL after the soft limit, the hard one is the same
    memory_mb: int = 512      # address space (RLIMIT_AS): a larger allocation raises MemoryError
    file_mb: int = 16         # largest file the program may write (RLIMIT_FSIZE)
    disk_mb: int = 64         # all its files together: a private tmpfs of this size (see sandbox_child)
    output_chars: int = 4000  # stdout and stderr are each cut to this in the answer


# The calls under way, folder -> the child's pid (None while it starts): what a SIGTERM ends (_on_sigterm).
_running: dict[str, int | None] = {}


async def run_sandboxed(code: str, limits: Limits) -> dict[str, object]:
    """Run `code` in the sandbox: {exit_code, stdout, stderr, timed_out, sandboxed}."""
    workdir = tempfile.mkdtemp(prefix="factory-sandbox-")
    _running[workdir] = None
    ready = None
    try:
        Path(workdir, "main.py").write_text(code, encoding="utf-8")  # a small local file: no need for a thread
        # The child says on it that it is locked down (sandbox_child.main). Made after the write, which may fail
        # (the disk full): the finally below closes only the read end.
        ready, ready_w = os.pipe()
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir,
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1"}
        # -I: no user site, no PYTHON* variables, no working directory on sys.path. The child imports
        # its set-up code from the installed package, then forgets it.
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-m", "factory.examples.sandbox_child", json.dumps(asdict(limits)),
                str(os.getpid()), str(ready_w), pass_fds=(ready_w,), cwd=workdir, env=env,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                start_new_session=True)
        finally:
            os.close(ready_w)  # the child's copy is the only one: its end is the pipe's end
        _running[workdir] = proc.pid
        cap = limits.output_chars * 4 + 1024  # bytes: a flood of output is not read into memory

        out, err = _Captured(), _Captured()  # what was read, kept when the program is killed

        async def finish() -> None:
            # The deadline covers the process's end too: a program that closes its pipes and sleeps on
            # is still timed.
            await asyncio.gather(_read_capped(proc.stdout, cap, out), _read_capped(proc.stderr, cap, err))
            await proc.wait()

        watch = asyncio.create_task(_watch_disk(workdir, limits.disk_mb << 20))
        finishing = asyncio.ensure_future(finish())
        timed_out = over_quota = False
        try:
            done, _ = await asyncio.wait({finishing, watch}, timeout=limits.timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            timed_out, over_quota = not done, watch in done
            read_to_end = finishing in done
        finally:
            watch.cancel()
            _kill_group(proc.pid)
            finishing.cancel()
            if proc.returncode is None:
                await proc.wait()
        return {"exit_code": proc.returncode, "timed_out": timed_out, "over_quota": over_quota,
                "sandboxed": _locked_down(ready),
                "stdout": _cut(bytes(out.kept), out.total, limits.output_chars, read_to_end),
                "stderr": _cut(bytes(err.kept), err.total, limits.output_chars, read_to_end)}
    finally:
        if ready is not None:
            os.close(ready)
        await _delete(workdir)


async def _delete(workdir: str) -> None:
    """Delete a call's folder in a thread: a large tree takes seconds, which on the event loop every other
    call of the server would wait out. Shielded: a cancelled call (anyio cancels again at each await of a
    cancelled scope) still deletes it, where a delete still queued for a thread would have been dropped.
    The folder stays in `_running` until it is gone, so that a SIGTERM meanwhile deletes it too; its
    program's group was killed already (no pid: a reaped one may be another process's by now)."""
    _running[workdir] = None
    deleting = asyncio.ensure_future(asyncio.to_thread(_remove, workdir))
    deleting.add_done_callback(lambda _: _running.pop(workdir, None))
    await asyncio.shield(deleting)


def _on_sigterm(signum: int, frame: object) -> None:
    """A server stopped by SIGTERM (the MCP client's shutdown after stdin closes, Ray's teardown) would
    die without running a `finally`: the calls under way are killed with their process groups (the
    children lead their own sessions, out of reach of a kill of the server's group) and their folders
    deleted, then the server dies of the signal as it would have."""
    for workdir, pid in list(_running.items()):
        if pid is not None:
            _kill_group(pid)
        _remove(workdir)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _locked_down(ready: int) -> bool:
    """Whether the child wrote its byte: read once it has ended, so the pipe holds all it will ever hold."""
    os.set_blocking(ready, False)
    try:
        return os.read(ready, 1) == b"1"
    except BlockingIOError:
        return False


@dataclass
class _Captured:
    """What one of the program's streams gave: its first bytes, up to the server's cap, and how many in all."""
    kept: bytearray = field(default_factory=bytearray)
    total: int = 0


async def _read_capped(stream: asyncio.StreamReader | None, cap: int, into: _Captured) -> None:
    """Read a stream to its end, keeping at most `cap` bytes and counting them all (the rest is drained so
    the child never blocks on a full pipe)."""
    while stream is not None and (chunk := await stream.read(65536)):
        into.total += len(chunk)
        if len(into.kept) < cap:
            into.kept += chunk[: cap - len(into.kept)]


async def _watch_disk(workdir: str, quota: int) -> None:
    """Returns when the files in `workdir` hold more than `quota` bytes or are more than MAX_FILES (the
    private tmpfs's inodes: many empty files fill a disk's inode table, not its bytes). Only where the
    child could not make its private tmpfs (no unprivileged namespaces) does the host folder fill: the
    kernel enforces both limits there, this check (every 0.1 s) is the fallback."""
    while True:
        await asyncio.sleep(0.1)
        size, entries = await asyncio.to_thread(_folder_usage, workdir)  # a large tree takes a while to walk
        if size > quota or entries > MAX_FILES:
            return


def _folder_usage(path: str) -> tuple[float, float]:
    """The bytes of the files under `path` and how many entries (files, folders, links) it holds; both
    infinite where a part of it cannot be read: a folder the program made unreadable (0o300: its owner may
    still write in it) would hide its files from the count. A file or folder deleted while it is walked is
    no error."""
    def unless_gone(error: OSError) -> None:
        if not isinstance(error, FileNotFoundError):
            raise error

    total = entries = 0
    try:
        for root, folders, files in os.walk(path, onerror=unless_gone):
            entries += len(folders) + len(files)
            for name in files:
                with contextlib.suppress(FileNotFoundError):
                    total += os.lstat(os.path.join(root, name)).st_size
    except OSError:
        return math.inf, math.inf
    return total, entries


def _remove(path: str) -> None:
    """Delete a call's folder whatever modes the program left in it: rmtree cannot empty a folder it may not
    read or write, and left it behind. Each folder is made the owner's to list and empty first, from the top
    down. The program is dead by now (or SIGKILLed: it makes no more system calls), so the tree holds still
    under this walk and lstat tells a folder from a symlink, which is never followed out of the tree."""
    folders = [path]
    while folders:
        folder = folders.pop()
        with contextlib.suppress(OSError):
            if stat.S_ISDIR(os.lstat(folder).st_mode):
                os.chmod(folder, stat.S_IRWXU)
                with os.scandir(folder) as entries:
                    folders += [entry.path for entry in entries if entry.is_dir(follow_symlinks=False)]
    shutil.rmtree(path, ignore_errors=True)


def _kill_group(pid: int) -> None:
    # The child leads its own session (start_new_session), so its group holds whatever it started.
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _cut(kept: bytes, total: int, limit: int, read_to_end: bool) -> str:
    """The output as text, cut to `limit` characters. The cut is counted in bytes, of all that the program
    printed (`total`), not of the `kept` bytes only: "at least" where it was killed before its output was
    read to the end."""
    text = kept.decode("utf-8", "surrogateescape")  # a character per byte that is not UTF-8: bytes shown known
    if len(text) <= limit and total == len(kept):
        return kept.decode("utf-8", "replace")
    shown = text[:limit].encode("utf-8", "surrogateescape")
    bound = "" if read_to_end else "at least "
    return f"{shown.decode('utf-8', 'replace')}\n... [{bound}{total - len(shown)} more bytes cut]"


def describe(result: dict[str, object], limits: Limits) -> str:
    """The answer the model reads. Raises MCPError where the code was not run: the failure is the sandbox's,
    not the program's, so it goes back as a JSON-RPC error, which a client files as an infrastructure failure
    (Factory's ToolBox: infra_error, retried, never cached) rather than as an answer to train on."""
    if not result["sandboxed"]:
        why = str(result["stderr"]).strip() or (
            f"the sandbox was not set up within {limits.timeout_s:g} s" if result["timed_out"]
            else f"the sandbox ended with exit code {result['exit_code']} before it was set up")
        raise MCPError(INTERNAL_ERROR, "the code was not run: " + why)
    if result["timed_out"]:
        head = f"killed: the program ran longer than {limits.timeout_s:g} s"
    elif result.get("over_quota"):
        head = f"killed: the program's files took more than {limits.disk_mb} MB or numbered more than {MAX_FILES}"
    elif isinstance(result["exit_code"], int) and result["exit_code"] < 0:
        sig = -result["exit_code"]
        why = {signal.SIGKILL: " (CPU time limit)", signal.SIGXCPU: " (CPU time limit)",
               signal.SIGXFSZ: " (file size limit)"}.get(sig, "")
        try:
            name = signal.Signals(sig).name
        except ValueError:  # a real-time signal (SIGRTMIN + n) has no name of its own
            name = str(sig)
        head = f"killed by signal {name}{why}"
    else:
        head = f"exit code {result['exit_code']}"
    parts = [head]
    if result["stdout"]:
        parts.append("stdout:\n" + str(result["stdout"]).rstrip("\n"))
    if result["stderr"]:
        parts.append("stderr:\n" + str(result["stderr"]).rstrip("\n"))
    return "\n".join(parts)


# WARNING: INFO logs a line per request to stderr, which costs time under many concurrent calls.
server = MCPServer("factory-sandbox", log_level="WARNING")
_limits = Limits()


@server.tool(
    description="Run a Python program (standard library only; no network, no files outside its own folder, "
                "no subprocesses) and return its exit code, stdout and stderr. Print what you want to see.",
    structured_output=False,
)
async def run_python(code: Annotated[str, Field(description="The whole Python program to run.")]) -> str:
    """The program's exit code and output as text."""
    return describe(await run_sandboxed(code, _limits), _limits)


def _options(parser: argparse.ArgumentParser) -> None:
    d = Limits()
    parser.add_argument("--timeout-s", type=float, default=d.timeout_s, help="wall-clock limit per call")
    parser.add_argument("--cpu-s", type=int, default=d.cpu_s, help="CPU-time limit per call")
    parser.add_argument("--memory-mb", type=int, default=d.memory_mb, help="address-space limit per call")
    parser.add_argument("--file-mb", type=int, default=d.file_mb, help="largest file a program may write")
    parser.add_argument("--disk-mb", type=int, default=d.disk_mb, help="all of a program's files together")
    parser.add_argument("--output-chars", type=int, default=d.output_chars, help="stdout/stderr kept per call")


def _configure(args: argparse.Namespace) -> None:
    global _limits
    _limits = Limits(timeout_s=args.timeout_s, cpu_s=args.cpu_s, memory_mb=args.memory_mb, file_mb=args.file_mb,
                     disk_mb=args.disk_mb, output_chars=args.output_chars)


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, _on_sigterm)
    serve(server, __doc__, argv, before=_configure, options=_options)


if __name__ == "__main__":
    main()
