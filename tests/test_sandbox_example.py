"""The sandboxed Python runner (factory.examples.sandbox): escape attempts against the real child process,
and the MCP server over stdio through the ToolBox."""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from factory.examples.sandbox import Limits, describe, run_sandboxed
from factory.examples.sandbox_child import landlock_abi
from factory.schema import StdioServer
from factory.tools import ToolBox
from factory.types import ToolCall

ROOT = Path(__file__).resolve().parents[1]
# The wall-clock limit is not what these tests check (the sleeping-program test sets its own): a loaded CI
# machine took over 3 s to start Python and import urllib in the sandbox, and killed a blocked connect.
FAST = Limits(timeout_s=15.0, cpu_s=1, memory_mb=256)

pytestmark = [pytest.mark.anyio,
              pytest.mark.skipif(landlock_abi() < 1, reason="the sandbox needs Landlock (Linux 5.13+)")]


async def run(code: str, limits: Limits = FAST) -> dict:
    return await run_sandboxed(code, limits)


def blocked(result: dict, error: str) -> bool:
    """The program ran sandboxed and died of `error` (e.g. PermissionError) raised by the kernel's refusal."""
    return result["sandboxed"] and result["exit_code"] == 1 and error in result["stderr"]


async def test_plain_code_runs_and_prints():
    result = await run("import math\nprint(math.factorial(20))\nprint('err', file=__import__('sys').stderr)")
    assert (result["exit_code"], result["stdout"], result["stderr"]) == (0, "2432902008176640000\n", "err\n")


async def test_threads_and_files_in_its_own_folder_work():
    code = ("import threading\nopen('data.txt', 'w').write('kept')\nout = []\n"
            "t = threading.Thread(target=lambda: out.append(open('data.txt').read()))\nt.start(); t.join()\nprint(out[0])")
    assert (await run(code))["stdout"] == "kept\n"


@pytest.mark.parametrize("code", [
    "import os; os.execv('/bin/sh', ['sh', '-c', 'id'])",
    "import subprocess; subprocess.run(['id'])",
    "import os; os.fork()",
    "import os\nwhile True: os.fork()",  # a fork bomb stops at the first fork
    "import multiprocessing as m; p = m.Process(target=print); p.start()",
    "import ctypes; assert ctypes.CDLL(None).fork() != -1, 'fork failed'",  # the syscall, not the Python wrapper
])
async def test_no_new_processes(code):
    result = await run(code)
    assert result["exit_code"] == 1 and ("PermissionError" in result["stderr"] or "fork failed" in result["stderr"]), result


async def test_os_system_cannot_start_a_shell(tmp_path):
    marker = tmp_path / "pwned"
    result = await run(f"import os; print(os.system('touch {marker}'))")
    assert result["stdout"] == "32512\n"  # 127 << 8: glibc's answer when it cannot spawn the shell
    assert not marker.exists()


@pytest.mark.parametrize("code", [
    "import socket; socket.create_connection(('127.0.0.1', 22), timeout=1)",
    "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('8.8.8.8', 53))",
    "import socket; socket.socket(socket.AF_UNIX).connect('/var/run/docker.sock')",
    "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000', timeout=1)",
])
async def test_no_network(code):
    result = await run(code)
    assert result["exit_code"] == 1 and ("PermissionError" in result["stderr"] or "Operation not permitted"
                                         in result["stderr"]), result


async def test_no_files_outside_its_folder(tmp_path):
    target = tmp_path / "escape.txt"
    assert blocked(await run(f"open({str(target)!r}, 'w').write('x')"), "PermissionError")
    assert not target.exists()
    assert blocked(await run("open('/etc/passwd').read()"), "PermissionError")
    assert blocked(await run(f"open({str(ROOT / 'README.md')!r}).read()"), "PermissionError")
    assert blocked(await run("import os; os.listdir('/etc')"), "PermissionError")


async def test_cannot_signal_the_server_or_lift_its_limits():
    assert blocked(await run("import os, signal; os.kill(os.getppid(), signal.SIGKILL)"), "PermissionError")
    result = await run("import resource; resource.setrlimit(resource.RLIMIT_CPU, (100, 100))")
    assert result["exit_code"] == 1 and "not allowed to raise" in result["stderr"]


async def test_huge_allocation_is_a_memory_error():
    assert blocked(await run("x = bytearray(4 * 2**30)"), "MemoryError")


async def test_no_memory_outside_the_address_space_limit():
    # --memory-mb is RLIMIT_AS: a memfd's pages are not in it (55 memfds of 16 MB held 880 MB under a 256 MB
    # limit), nor SysV segments and queues, which even outlive the program. Each call is refused; one the
    # kernel allowed is undone at once, so that the test leaves nothing behind where it fails.
    code = ("import ctypes, fcntl, os\nlibc = ctypes.CDLL(None, use_errno=True)\ngot = {}\n"
            "def tried(name, result, undo):\n"
            "    got[name] = ctypes.get_errno() if result == -1 else 0\n"
            "    if result != -1: undo(result)\n"
            "try:\n    os.close(os.memfd_create('m')); got['memfd_create'] = 0\n"
            "except OSError as e:\n    got['memfd_create'] = e.errno\n"
            "tried('shmget', libc.shmget(0, 4096, 0o1600), lambda i: libc.shmctl(i, 0, None))\n"  # 0: IPC_RMID
            "tried('msgget', libc.msgget(0, 0o1600), lambda i: libc.msgctl(i, 0, None))\n"
            "tried('mq_open', libc.mq_open(b'/factory-sandbox-test', os.O_CREAT | os.O_RDWR, 0o600, None),\n"
            "      lambda q: (os.close(q), libc.mq_unlink(b'/factory-sandbox-test')))\n"
            "r, w = os.pipe()\ntry:\n    fcntl.fcntl(r, fcntl.F_SETPIPE_SZ, 1 << 20); got['F_SETPIPE_SZ'] = 0\n"
            "except OSError as e:\n    got['F_SETPIPE_SZ'] = e.errno\nprint(got)")
    result = await run(code)
    assert result["exit_code"] == 0, result
    assert eval(result["stdout"]) == dict.fromkeys(["memfd_create", "shmget", "msgget", "mq_open", "F_SETPIPE_SZ"],
                                                   errno.EPERM)


async def test_infinite_loop_is_killed_by_the_cpu_limit():
    # A wall limit far above the CPU limit: on a loaded machine 1 s of CPU can take many seconds of wall time.
    limits = Limits(timeout_s=120.0, cpu_s=1, memory_mb=256)
    result = await run("while True: pass", limits)
    assert result["exit_code"] == -9 and not result["timed_out"]
    assert describe(result, limits) == "killed by signal SIGKILL (CPU time limit)"


async def test_a_program_killed_by_a_real_time_signal_gets_an_answer():
    # Signal 40 has no name in signal.Signals: describe() raised ValueError, and the call was a tool error.
    result = await run("import os; os.kill(os.getpid(), 40)")
    assert result["exit_code"] == -40 and describe(result, FAST) == "killed by signal 40"


async def test_a_program_exiting_97_ran_sandboxed():
    # 97 is the child's exit code when it cannot lock down; the program may exit with it too, and its answer
    # was "the code was not run". The child's word now comes on a pipe of its own, before the program starts.
    result = await run("print('I ran'); raise SystemExit(97)")
    assert result["sandboxed"] and describe(result, FAST) == "exit code 97\nstdout:\nI ran"


async def test_sleeping_program_is_killed_at_the_wall_clock_limit():
    t0 = time.monotonic()
    result = await run("import time; time.sleep(60)", Limits(timeout_s=1.0))
    assert result["timed_out"] and time.monotonic() - t0 < 10
    assert describe(result, FAST).startswith("killed: the program ran longer than")


async def test_output_is_cut_and_the_folder_removed():
    result = await run("import os; print(os.getcwd()); print('x' * 10**6)", Limits(output_chars=100))
    workdir = result["stdout"].splitlines()[0]
    assert "more bytes cut" in result["stdout"] and len(result["stdout"]) < 200
    assert workdir.startswith("/") and not os.path.exists(workdir)


async def test_a_calls_folder_is_deleted_off_the_event_loop(monkeypatch):
    # The delete of a call's folder (seconds for a large tree) ran on the event loop: every other call of the
    # server waited for it. Here the delete waits until the loop has run another task, which on the loop it
    # could never see: it gave up after 10 s.
    import asyncio
    import threading

    from factory.examples import sandbox

    deleting, loop_ran, seen = threading.Event(), threading.Event(), []
    remove = sandbox._remove

    def slow_remove(path: str) -> None:
        deleting.set()
        seen.append(loop_ran.wait(10))
        remove(path)

    monkeypatch.setattr(sandbox, "_remove", slow_remove)

    async def another_call() -> None:
        while not deleting.is_set():
            await asyncio.sleep(0.01)
        loop_ran.set()

    result, _ = await asyncio.gather(run("import os; print(os.getcwd())"), another_call())
    assert seen == [True] and result["exit_code"] == 0 and not os.path.exists(result["stdout"].strip())


def test_a_cancelled_call_still_deletes_its_folder(tmp_path):
    # The delete runs in the loop's thread pool; a call cancelled while its delete waits there for a thread
    # (anyio cancels again at each await of a cancelled scope) must not drop it: the folder would outlive the
    # call. One thread, kept busy: the delete is queued when the call is cancelled.
    import asyncio
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from factory.examples.sandbox import _delete, _running

    folder = tmp_path / "call"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "f").write_text("x")

    async def main() -> bool:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(1))
        free = threading.Event()
        busy = asyncio.ensure_future(asyncio.to_thread(free.wait))
        call = asyncio.ensure_future(_delete(str(folder)))
        await asyncio.sleep(0)  # both have started: the thread waits on `free`, the delete behind it
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        queued = folder.exists() and str(folder) in _running
        free.set()
        await busy
        for _ in range(1000):  # the folder is the server's (a SIGTERM deletes it too) until it is gone
            if str(folder) not in _running:
                break
            await asyncio.sleep(0.01)
        return queued

    assert asyncio.run(main()) and not folder.exists()


async def test_a_call_that_cannot_write_its_program_leaks_no_descriptor():
    # The write end of the child's ready pipe was closed only around the child's start: a call whose main.py
    # could not be written (the disk full: ENOSPC; here EFBIG from a 1-byte file-size limit, which Python
    # raises rather than dying of SIGXFSZ) kept it open for good, one descriptor per call until EMFILE.
    import resource

    before = len(os.listdir("/proc/self/fd"))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1, hard))
    try:
        for _ in range(5):
            with pytest.raises(OSError, match="File too large"):
                await run("print(6 * 7)")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert len(os.listdir("/proc/self/fd")) == before


async def test_the_cut_marker_counts_all_that_the_program_printed():
    # The server keeps output_chars * 4 + 1024 bytes of a stream and counted the cut from those: "1324 more
    # characters cut" for a program that printed 1,000,001. Now the bytes printed past those shown (2 for "é").
    code = "import sys\nprint('x' * 10**6)\nprint('\u00e9' * 10**5, file=sys.stderr)"
    result = await run(code, Limits(timeout_s=15.0, output_chars=100))
    assert result["stdout"] == "x" * 100 + f"\n... [{10**6 + 1 - 100} more bytes cut]"
    assert result["stderr"] == "\u00e9" * 100 + f"\n... [{2 * 10**5 + 1 - 200} more bytes cut]"


def test_a_cut_is_at_least_what_was_read_when_the_program_was_killed_before_its_end():
    from factory.examples.sandbox import _cut

    assert _cut(b"abcdef", 6, 4, read_to_end=True) == "abcd\n... [2 more bytes cut]"
    assert _cut(b"abcdef", 10**6, 4, read_to_end=False) == "abcd\n... [at least 999996 more bytes cut]"
    assert _cut(b"abcd", 4, 4, read_to_end=False) == "abcd"
    # Bytes that are not UTF-8 are counted as printed: 3 shown as U+FFFD, 2 cut.
    assert _cut(b"\xff\xfe\xfd\xfc\xfb", 5, 3, read_to_end=True) == "\ufffd" * 3 + "\n... [2 more bytes cut]"


async def test_the_mcp_server_answers_over_stdio():
    server = StdioServer(command="python", args=["-m", "factory.examples.sandbox", "--timeout-s", "5"],
                         cwd=str(ROOT), timeout_s=20)
    async with ToolBox.from_spec({"py": server}, base_dir=ROOT) as box:
        assert [s["function"]["name"] for s in box.schemas()] == ["run_python"]
        ok = await box.call(ToolCall("run_python", {"code": "print(6 * 7)"}, raw=""))
        assert (ok.status, ok.text) == ("ok", "exit code 0\nstdout:\n42")
        bad = await box.call(ToolCall("run_python", {"code": "import os; os.system('id')\nraise SystemExit(2)"}, raw=""))
        assert bad.status == "ok" and bad.text == "exit code 2"  # a failing program is an answer, not a tool error


async def test_code_that_was_not_run_is_an_infra_error_not_the_models_answer(monkeypatch, tmp_path):
    # "The code was not run" (the sandbox not set up in time: a loaded machine; no Landlock or libseccomp) came
    # back as an ok answer: trained on as the model's output and cached by `cache: true`. It is now a JSON-RPC
    # error, which the ToolBox files as infra_error (retried, never cached), its reason kept. (The server's child
    # is never set up here: a 1 ms limit raced, and now and then the program ran and was killed.)
    monkeypatch.setenv("FACTORY_CACHE", str(tmp_path))
    server = StdioServer(command="python", args=["tests/tool_servers/unsandboxed.py", "--timeout-s", "0.001"],
                         cwd=str(ROOT), timeout_s=20, retries=0, cache=True)
    async with ToolBox.from_spec({"py": server}, base_dir=ROOT) as box:
        results = [await box.call(ToolCall("run_python", {"code": "print(1)"}, raw="")) for _ in range(2)]
    for result in results:  # the second call went to the server again: nothing was cached
        assert (result.status, result.error_kind) == ("infra_error", "transport"), result
        assert "the code was not run: the sandbox was not set up within 0.001 s" in result.text, result.text
    from mcp.shared.exceptions import MCPError

    with pytest.raises(MCPError, match="^the code was not run: the sandbox ended with exit code 1 before it was set"):
        describe({"sandboxed": False, "timed_out": False, "exit_code": 1, "stdout": "", "stderr": ""}, Limits())


async def test_a_program_that_closes_its_pipes_is_still_killed_at_the_wall_clock_limit():
    # Closing stdout and stderr ended the server's reads at once; it then waited for the process unbounded.
    t0 = time.monotonic()
    result = await run("import os, time\nprint(os.getpid(), flush=True)\nos.close(1); os.close(2)\ntime.sleep(60)",
                       Limits(timeout_s=2.0))
    assert result["timed_out"] and time.monotonic() - t0 < 2.0 + 5
    pid = int(result["stdout"].split()[0])
    assert not Path(f"/proc/{pid}").exists()  # nothing left: killed and reaped


async def test_the_files_of_one_call_share_a_disk_quota():
    # 40 files of 1 MB each, each under the file-size limit: together over the 8 MB quota.
    code = ("import os\nn = 0\ntry:\n    for i in range(40):\n        with open(f'f{i}', 'wb') as f:\n"
            "            f.write(b'x' * 2**20)\n        n += 1\nfinally:\n"
            "    print(n, sum(os.path.getsize(p) for p in os.listdir('.')) // 2**20, flush=True)")
    result = await run(code, Limits(timeout_s=10.0, file_mb=4, disk_mb=8))
    assert result["sandboxed"] and not result["timed_out"], result
    if result.get("over_quota"):  # no private tmpfs here: the server measured the folder and stopped it
        assert describe(result, Limits(disk_mb=8)).startswith("killed: the program's files took more than 8 MB")
    else:  # the kernel refused the write past the quota
        written, total_mb = map(int, result["stdout"].split())
        assert written < 8 and total_mb <= 8 and "No space left on device" in result["stderr"], result


async def test_the_fallback_quota_stops_a_program_of_many_empty_files_too(tmp_path):
    # The private tmpfs holds at most MAX_FILES inodes; where the child could not make it, the server measured
    # the folder's bytes only: a program that made 200,000 empty files was never stopped. The folder may now
    # hold MAX_FILES entries (files, folders, links) in all, the tmpfs's number. (The tmpfs path is taken on
    # machines that allow unprivileged namespaces, so the server's watch is run here on a folder of its own.)
    import asyncio

    from factory.examples.sandbox import _folder_usage, _watch_disk
    from factory.examples.sandbox_child import MAX_FILES

    (tmp_path / "folder").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "folder")
    (tmp_path / "data").write_bytes(b"x" * 10)
    for i in range(MAX_FILES - 3):
        (tmp_path / "folder" / f"f{i}").touch()
    assert _folder_usage(str(tmp_path)) == (10, MAX_FILES)
    with pytest.raises(TimeoutError):  # at the limit, under the byte quota: it runs on
        await asyncio.wait_for(_watch_disk(str(tmp_path), 2**20), 0.5)
    (tmp_path / "folder" / "one-more").touch()
    await asyncio.wait_for(_watch_disk(str(tmp_path), 2**20), 10)  # past it: stopped
    assert describe({"sandboxed": True, "timed_out": False, "over_quota": True, "exit_code": -9, "stdout": "",
                     "stderr": ""}, Limits(disk_mb=8)) == (
        f"killed: the program's files took more than 8 MB or numbered more than {MAX_FILES}")


def test_the_seccomp_filter_alone_refuses_every_signal_syscall_aimed_at_another_process():
    # Landlock ABI 6+ scopes signals too; the filter must hold where the kernel's Landlock is older.
    # In a forked child with only the seccomp filter: each syscall aimed at the parent (signal 0, which
    # only checks permission) answers EPERM; aimed at itself it is allowed.
    import ctypes
    import errno as errno_

    import pyseccomp

    libc = ctypes.CDLL(None, use_errno=True)
    names = ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")
    nr = {n: pyseccomp.resolve_syscall(pyseccomp.system_arch(), n) for n in names}
    info = ctypes.create_string_buffer(128)  # a zeroed siginfo_t

    def send(name: str, pid: int) -> int:
        args = {"kill": (pid, 0), "tkill": (pid, 0), "tgkill": (pid, pid, 0), "rt_sigqueueinfo": (pid, 0, info),
                "rt_tgsigqueueinfo": (pid, pid, 0, info)}[name]
        ctypes.set_errno(0)
        return 0 if libc.syscall(nr[name], *args) == 0 else ctypes.get_errno()

    parent = os.getpid()
    answers = _under_seccomp_alone(lambda: [send(n, parent) for n in names] + [send("kill", os.getpid())])
    # rt_sigqueueinfo to another process with si_code 0 would be refused by the kernel anyway (EPERM too),
    # so it is the filter's answer only where the kernel allows it; the other four reach the parent today.
    assert answers == [errno_.EPERM] * len(names) + [0]


def test_the_seccomp_filter_alone_refuses_a_descriptor_that_would_signal_another_process():
    # fcntl(F_SETOWN, pid) + F_SETSIG + O_ASYNC makes the kernel send the owner any signal (SIGKILL too) when
    # the descriptor is ready: the parent here stands for the server. Each way to name an owner answers EPERM
    # (a command with high bits set too: the kernel reads 32), and the parent gets no signal.
    import ctypes
    import errno as errno_
    import fcntl
    import signal

    import pyseccomp

    libc = ctypes.CDLL(None, use_errno=True)
    nr_fcntl = pyseccomp.resolve_syscall(pyseccomp.system_arch(), "fcntl")
    got: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
    parent = os.getpid()

    def errno_of(result: int) -> int:
        return ctypes.get_errno() if result == -1 else 0

    def probe() -> list[int]:
        r, w = os.pipe()
        owner = ctypes.c_int(parent)
        answers = [errno_of(libc.fcntl(r, 8, parent)),  # F_SETOWN
                   errno_of(libc.fcntl(r, 15, ctypes.byref((ctypes.c_int * 2)(1, parent)))),  # F_SETOWN_EX
                   errno_of(libc.fcntl(r, 10, int(signal.SIGUSR1))),  # F_SETSIG
                   errno_of(libc.syscall(nr_fcntl, r, ctypes.c_ulong((1 << 32) | 8), parent)),
                   errno_of(libc.ioctl(r, 0x8901, ctypes.byref(owner))),  # FIOSETOWN
                   errno_of(libc.ioctl(r, 0x8902, ctypes.byref(owner)))]  # SIOCSPGRP
        fcntl.fcntl(r, fcntl.F_SETFL, fcntl.fcntl(r, fcntl.F_GETFL) | os.O_ASYNC)
        os.write(w, b"x")  # the signal, had an owner been set
        return answers

    try:
        answers = _under_seccomp_alone(probe)
        time.sleep(0.2)  # a signal sent would have arrived
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert (answers, got) == ([errno_.EPERM] * 6, [])


def test_the_seccomp_filter_alone_refuses_device_nodes_and_port_io(tmp_path):
    # A program that holds CAP_MKNOD (root where the kernel refused the user namespace) made a node of the
    # host's root disk, or of /dev/kmsg, in its own folder and read it past Landlock; CAP_SYS_RAWIO gives it
    # the I/O ports. Raw syscalls (glibc's mknod is mknodat): both calls, a char and a block node, each refused;
    # a FIFO is not a device and stays allowed, as do iopl/ioperm asking for no more than the process has.
    import ctypes
    import stat

    import pyseccomp

    libc = ctypes.CDLL(None, use_errno=True)
    nr = {n: pyseccomp.resolve_syscall(pyseccomp.system_arch(), n) for n in ("mknod", "mknodat", "iopl", "ioperm")}
    if min(nr.values()) < 0:
        pytest.skip("mknod, iopl and ioperm are x86 system calls")

    def errno_of(*args) -> int:
        ctypes.set_errno(0)
        return 0 if libc.syscall(*(ctypes.c_long(a) if isinstance(a, int) else a for a in args)) == 0 \
            else ctypes.get_errno()

    def probe() -> list[int]:
        at = ctypes.c_long(-100)  # AT_FDCWD
        null, loop = os.makedev(1, 3), os.makedev(7, 0)
        return [errno_of(nr["mknod"], bytes(tmp_path / "c1"), stat.S_IFCHR | 0o600, null),
                errno_of(nr["mknod"], bytes(tmp_path / "b1"), stat.S_IFBLK | 0o600, loop),
                errno_of(nr["mknodat"], at, bytes(tmp_path / "c2"), stat.S_IFCHR | 0o600, null),
                errno_of(nr["mknodat"], at, bytes(tmp_path / "b2"), stat.S_IFBLK | 0o600, loop),
                errno_of(nr["iopl"], 0), errno_of(nr["ioperm"], 0x80, 1, 0),
                errno_of(nr["mknodat"], at, bytes(tmp_path / "fifo"), stat.S_IFIFO | 0o600, 0)]

    assert _under_seccomp_alone(probe) == [errno.EPERM] * 6 + [0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]


def test_landlock_alone_refuses_device_nodes_in_the_programs_folder(tmp_path):
    # The folder's rule held every right, MAKE_CHAR and MAKE_BLOCK too: only a missing capability stood
    # between the program and a device node. Here root (where it runs as root) keeps its capabilities, so
    # Landlock's answer (EACCES) is the only one; a FIFO and a file are still the program's to make.
    import stat

    from factory.examples.sandbox_child import apply_landlock

    def probe() -> list[int]:
        answers = []
        for name, mode, dev in (("c", stat.S_IFCHR, os.makedev(1, 3)), ("b", stat.S_IFBLK, os.makedev(7, 0)),
                                ("fifo", stat.S_IFIFO, 0), ("file", stat.S_IFREG, 0)):
            try:
                os.mknod(tmp_path / name, mode | 0o600, dev)
                answers.append(0)
            except OSError as e:
                answers.append(e.errno)
        return answers

    def landlocked() -> list[int]:
        import ctypes

        ctypes.CDLL(None).prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: Landlock asks for it without CAP_SYS_ADMIN
        apply_landlock(str(tmp_path), [])
        return probe()

    assert _in_child(landlocked) == [errno.EACCES, errno.EACCES, 0, 0]


def test_root_without_a_user_namespace_keeps_no_capability(tmp_path):
    # Where the kernel refuses the child's user namespace (user.max_user_namespaces=0, a container's seccomp
    # profile) a server run as root handed the program all of root's capabilities: it made a node of /dev/kmsg
    # in its folder and read the kernel log. The child (this tree's, the namespace forced off) now drops them.
    if os.geteuid() != 0:
        pytest.skip("the capabilities at stake are root's")
    program = ("import ctypes, os, stat\nlibc = ctypes.CDLL(None, use_errno=True)\n"
               "header, data = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()\n"
               "assert libc.capget(header, data) == 0\nprint('capabilities', list(data))\n"
               "try:\n    os.mknod('kmsg', stat.S_IFCHR | 0o600, os.makedev(1, 11))\n"
               "    print('made', os.read(os.open('kmsg', os.O_RDONLY | os.O_NONBLOCK), 8192)[:40])\n"
               "except PermissionError:\n    print('refused')\n")
    (tmp_path / "main.py").write_text(program)
    child = (f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nimport factory.examples.sandbox_child as c\n"
             "c.private_namespaces = lambda workdir, disk_mb: False  # as where unshare(CLONE_NEWUSER) is refused\n"
             "c.main(sys.argv[1:])\n")
    ready, ready_w = os.pipe()
    try:
        limits = json.dumps(dataclasses.asdict(FAST))
        proc = subprocess.run([sys.executable, "-I", "-c", child, limits, str(os.getpid()), str(ready_w)],
                              pass_fds=(ready_w,), cwd=tmp_path, capture_output=True, text=True, timeout=60,
                              env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
        os.close(ready_w)
        sandboxed = os.read(ready, 1) == b"1"
    finally:
        os.close(ready)
    assert sandboxed and proc.stdout == "capabilities [0, 0, 0, 0, 0, 0]\nrefused\n", (proc.stdout, proc.stderr)
    assert not (tmp_path / "kmsg").exists()


def test_a_folder_the_program_made_unreadable_still_counts_and_is_deleted(tmp_path):
    # Where the child has no private tmpfs the server measures the folder itself: a program that made a folder
    # 0o300 (still writable by its owner) filled it unseen (os.walk skipped it silently), and the folder then
    # outlived the call (rmtree with ignore_errors left it). A server that is not root is bound by those modes:
    # here a forked child without capabilities. A symlink out of the folder is never followed.
    import math
    import stat

    from factory.examples.sandbox import _folder_usage, _remove
    from factory.examples.sandbox_child import drop_capabilities

    work, outside = tmp_path / "work", tmp_path / "outside"
    for folder in (work / "hidden", work / "listed" / "shut", work / "kept", outside):
        folder.mkdir(parents=True)
    (work / "hidden" / "f").write_bytes(b"x" * 2**20)
    (work / "listed" / "shut" / "f").write_bytes(b"x")
    (work / "kept" / "f").write_bytes(b"x")
    (work / "out").symlink_to(outside)
    os.chmod(work / "hidden", 0o300)  # writable, not readable: its files cannot be listed
    os.chmod(work / "listed", 0o600)  # listed, not searchable: its entries cannot be looked at
    os.chmod(work / "kept", 0o500)    # not writable: its file cannot be deleted
    os.chmod(outside, 0o500)

    def probe() -> list[int]:
        drop_capabilities()  # as a server that is not root
        sizes = []
        for hidden, listed in ((0o300, 0o700), (0o700, 0o600), (0o700, 0o700)):
            os.chmod(work / "hidden", hidden)
            os.chmod(work / "listed", listed)
            sizes.append(_folder_usage(str(work)))
        os.chmod(work / "hidden", 0o300)
        os.chmod(work / "listed", 0o600)
        _remove(str(work))
        # 8 entries: hidden, hidden/f, listed, listed/shut, listed/shut/f, kept, kept/f and the link out
        return [sizes[0] == (math.inf,) * 2, sizes[1] == (math.inf,) * 2, sizes[2] == (2**20 + 2, 8), work.exists(),
                stat.S_IMODE(outside.stat().st_mode) == 0o500]

    try:
        assert _in_child(probe) == [True, True, True, False, True]
    finally:
        os.chmod(outside, 0o700)


def _in_child(probe) -> list[int]:
    """What `probe` returns (small ints: errnos) in a forked child."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.write(write, bytes(probe()))
        finally:
            os._exit(0)
    os.close(write)
    answers = os.read(read, 64)
    os.waitpid(child, 0)
    os.close(read)
    return list(answers)


def _under_seccomp_alone(probe) -> list[int]:
    """What `probe` returns (small ints: errnos) in a forked child that has applied only the seccomp filter."""
    import pyseccomp

    from factory.examples.sandbox_child import apply_seccomp

    def filtered() -> list[int]:
        apply_seccomp(pyseccomp)
        return probe()

    return _in_child(filtered)


def _alive(pid: int) -> bool:
    try:  # a zombie has ended: whoever adopted it reaps it when it will
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_a_program_dies_with_its_server(how, tmp_path):
    # The child leads its own session (a kill of the server's group misses it) and only the server timed it: a
    # server stopped by SIGTERM (the MCP client's shutdown) or SIGKILL (the OOM killer) left it sleeping for
    # ever. Now the kernel kills it with the server either way, and on SIGTERM the server deletes its folder.
    server = subprocess.Popen([sys.executable, "-m", "factory.examples.sandbox", "--timeout-s", "60"], cwd=ROOT,
                              env={**os.environ, "TMPDIR": str(tmp_path)}, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    children: list[int] = []
    try:
        hello = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
        for message in [{"id": 1, "method": "initialize", "params": hello}, {"method": "notifications/initialized"},
                        {"id": 2, "method": "tools/call",
                         "params": {"name": "run_python", "arguments": {"code": "import time; time.sleep(600)"}}}]:
            server.stdin.write((json.dumps({"jsonrpc": "2.0", **message}) + "\n").encode())
            server.stdin.flush()
        deadline = time.monotonic() + 30
        while not children and time.monotonic() < deadline:
            time.sleep(0.1)
            children = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) == server.pid]
        assert children and list(tmp_path.glob("factory-sandbox-*"))
        time.sleep(1.0)  # past its lockdown: the program sleeps
        server.send_signal(how)
        server.wait(10)
        deadline = time.monotonic() + 10
        while any(map(_alive, children)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, children))
        if how == signal.SIGTERM:
            assert server.returncode == -signal.SIGTERM and not list(tmp_path.glob("factory-sandbox-*"))
    finally:
        for pid in children:  # this test's own processes, should they have outlived the server
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if server.poll() is None:
            server.kill()


def _parent(proc: Path) -> int | None:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
