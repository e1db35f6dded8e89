"""The child side of the Python sandbox (`factory.examples.sandbox`): lock this process down, then run
the untrusted program `main.py` of the working directory as `__main__`.

    python -I -m factory.examples.sandbox_child LIMITS_JSON SERVER_PID READY_FD

Every restriction is a kernel mechanism applied to this process before the untrusted code starts, and
none of them can be lifted afterwards:
  1. resource limits (setrlimit): CPU seconds, address space, file size, open files, no core dumps;
  2. a new user, network and mount namespace (unshare) when the kernel allows it unprivileged: no
     network interface but a loopback that is down, and the working directory becomes a private tmpfs
     of `disk_mb` (and at most MAX_FILES files), so the program's files in all can never exceed its quota
     (the server checks the folder's size and file count itself where the namespace is not allowed);
  3. no capabilities, in the namespace or out of it (a server run as root where the kernel refuses the
     namespace would hand the program all of root's), and no_new_privs: no exec could grant any back;
  4. the kernel kills this process when the server dies, however it dies (PR_SET_PDEATHSIG): the
     server's wall-clock limit ends with it, and so does the program;
  5. Landlock: reads only under the Python installation and system library folders, writes only in
     the working directory (no device nodes there), no TCP bind/connect (ABI 4+), no signals or
     abstract UNIX sockets out of the sandbox (ABI 6+);
  6. seccomp (libseccomp): no execve (no shell, no subprocess), no fork (threads are allowed), no
     sockets, no ptrace, no namespace or mount changes, no device nodes (mknod), no I/O ports, signals
     only to itself (kill, tkill, tgkill, rt_sigqueueinfo and rt_tgsigqueueinfo aimed elsewhere are
     refused; pidfd signals entirely; no descriptor may name a process to signal when it is ready:
     fcntl F_SETOWN, F_SETOWN_EX, F_SETSIG, ioctl FIOSETOWN, SIOCSPGRP), no undoing 4. (prctl
     PR_SET_PDEATHSIG), no memory outside the address-space limit (memfd_create, SysV shared memory
     and message queues, POSIX message queues; pipes stay at their default size).
Landlock and seccomp are required: without them the child refuses to run anything (exit code 97).
Locked down, it writes one byte on READY_FD and closes it before the program starts: the server's only
evidence that the program ran sandboxed, since the exit code is the program's to choose.
"""
from __future__ import annotations

import ctypes
import errno
import itertools
import json
import os
import resource
import signal
import stat
import sys
from typing import Any

EXIT_NOT_SANDBOXED = 97
CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWNS, CLONE_THREAD = 0x10000000, 0x40000000, 0x00020000, 0x00010000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8
# Inodes of the private folder: many empty files fill a disk's inode table, not its bytes. The server
# allows the host folder as many entries where there is no private folder (sandbox._watch_disk).
MAX_FILES = 4096

# Landlock (linux/landlock.h): syscall numbers are the same on every architecture (444-446).
_LL_CREATE, _LL_ADD_RULE, _LL_RESTRICT = 444, 445, 446
_LL_CREATE_VERSION = 1
_LL_RULE_PATH_BENEATH = 1
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_MAKE_CHAR, _FS_MAKE_BLOCK = 1 << 6, 1 << 11
_FS_ALL_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1, 5: (1 << 16) - 1}
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1
_PR_SET_PDEATHSIG, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 1, 24, 38
_CAP_VERSION_3 = 0x20080522  # linux/capability.h: two 32-bit words per set
_S_IFMT = 0o170000  # a mode's file-type bits (stat.S_IFMT is a function)
_F_SETOWN, _F_SETSIG, _F_SETOWN_EX, _F_SETPIPE_SZ = 8, 10, 15, 1031
_FIOSETOWN, _SIOCSPGRP = 0x8901, 0x8902


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1  # the kernel's struct is packed: 12 bytes
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _syscall(number: int, *args: object) -> int:
    result = _libc.syscall(ctypes.c_long(number), *args)
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return result


def set_limits(limits: dict[str, int]) -> None:
    """Hard and soft limits alike, so that the program cannot raise them again."""
    for name, value in (("RLIMIT_CPU", limits["cpu_s"]), ("RLIMIT_AS", limits["memory_mb"] << 20),
                        ("RLIMIT_FSIZE", limits["file_mb"] << 20), ("RLIMIT_NOFILE", 64), ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))


def drop_capabilities() -> None:
    """Give up every capability for good, then set no_new_privs. Root where the kernel refuses the user
    namespace would otherwise hand the program all of root's: CAP_MKNOD (a device node of the host's disk
    or /dev/kmsg in its own folder, read past Landlock), CAP_DAC_OVERRIDE, CAP_SYS_RAWIO...; in the
    namespace the program would hold them over the files its ids own. Dropping them keeps root's server
    usable where failing closed would refuse every call (root in a container, whose seccomp profile refuses
    the namespace, is the common case). no_new_privs: an exec grants nothing back (seccomp refuses exec
    anyway), and Landlock requires it of a process without CAP_SYS_ADMIN."""
    # The bounding set (what an exec could grant) where we may change it (CAP_SETPCAP); without that, no
    # capability is in reach of an exec once no_new_privs is set. EINVAL: past the kernel's last capability.
    for cap in itertools.count():
        if _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            code = ctypes.get_errno()
            if code in (errno.EINVAL, errno.EPERM):
                break
            raise OSError(code, os.strerror(code))
    # Effective, permitted and inheritable, all empty (the ambient set goes with them). This thread's: the
    # program's threads start later and inherit it.
    header, empty = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0), (ctypes.c_uint32 * 6)()
    if _libc.capset(header, empty) != 0 or _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"cannot drop capabilities: {os.strerror(code)}")


def die_with(server_pid: int) -> None:
    """SIGKILL this process when the server dies, by SIGKILL or the OOM killer too (no handler of its runs
    then). The kernel signals at the end of the thread that started us: the server's event loop, which
    lives as long as the server."""
    if _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    if os.getppid() != server_pid:  # it died before the prctl: we were given to another parent
        raise OSError(errno.ESRCH, "the server is gone")


def private_namespaces(workdir: str, disk_mb: int) -> bool:
    """A fresh user + network + mount namespace whose working directory is a tmpfs of `disk_mb` (the
    program's main.py is read before): no network, and the kernel refuses a write past the quota
    (ENOSPC) whatever the number of files. The tmpfs goes with the last process of the namespace, so
    nothing the program wrote outlives it. False when unprivileged namespaces are not allowed here
    (seccomp still forbids sockets; the server then measures the folder itself)."""
    uid, gid = os.getuid(), os.getgid()
    if _libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS) != 0:
        return False
    # Map our own ids (the kernel refuses files on the new tmpfs from an unmapped owner); no setgroups.
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    options = f"size={disk_mb}m,nr_inodes={MAX_FILES},mode=0700".encode()
    if _libc.mount(b"tmpfs", workdir.encode(), b"tmpfs", ctypes.c_ulong(_MS_NOSUID | _MS_NODEV | _MS_NOEXEC),
                   options) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"cannot mount the private folder: {os.strerror(code)}")
    os.chdir(workdir)  # the mount, not the folder under it
    return True


def landlock_abi() -> int:
    try:
        return _syscall(_LL_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(_LL_CREATE_VERSION))
    except OSError:
        return 0


def apply_landlock(workdir: str, read_roots: list[str]) -> int:
    """Restrict the file system (and, where the kernel can, TCP and signals); returns the ABI used."""
    abi = landlock_abi()
    if abi < 1:
        raise OSError(errno.ENOSYS, "Landlock is not available in this kernel")
    fs_all = _FS_ALL_BY_ABI.get(abi, (1 << 16) - 1)
    attr = _RulesetAttr(handled_access_fs=fs_all,
                        handled_access_net=(_NET_BIND_TCP | _NET_CONNECT_TCP) if abi >= 4 else 0,
                        scoped=(_SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL) if abi >= 6 else 0)
    size = ctypes.sizeof(_RulesetAttr) if abi >= 6 else (16 if abi >= 4 else 8)
    ruleset = _syscall(_LL_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    try:
        read = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
        # Everything in its folder but device nodes: one of the host's disk would be a way past every rule.
        write = fs_all & ~(_FS_MAKE_CHAR | _FS_MAKE_BLOCK)
        for path, access in [*((p, read) for p in read_roots), (workdir, write)]:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # a root that does not exist on this system (/lib64 on some)
            try:
                # A rule on a file (not a folder) may only name file rights.
                allowed = access if os.path.isdir(path) else access & (_FS_EXECUTE | _FS_READ_FILE | _FS_WRITE_FILE)
                rule = _PathBeneath(allowed_access=allowed, parent_fd=fd)
                _syscall(_LL_ADD_RULE, ruleset, ctypes.c_int(_LL_RULE_PATH_BENEATH), ctypes.byref(rule),
                         ctypes.c_uint32(0))
            finally:
                os.close(fd)
        _syscall(_LL_RESTRICT, ruleset, ctypes.c_uint32(0))
    finally:
        os.close(ruleset)
    return abi


def apply_seccomp(seccomp: Any) -> None:
    """Deny the system calls that would leave the sandbox; everything else (files, threads, memory) is
    allowed. EPERM makes Python raise PermissionError, which the program can read and report.
    `seccomp` is the pyseccomp module, imported before Landlock hides its folder."""
    deny = seccomp.ERRNO(errno.EPERM)
    f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    for name in ("execve", "execveat", "fork", "vfork", "socket", "socketpair", "ptrace", "process_vm_readv",
                 "process_vm_writev", "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "bpf",
                 "perf_event_open", "keyctl", "add_key", "request_key", "userfaultfd", "io_uring_setup",
                 "pidfd_open", "pidfd_send_signal", "pidfd_getfd", "personality", "kexec_load", "init_module",
                 "finit_module", "reboot", "swapon", "setrlimit", "prlimit64",
                 # Memory the kernel holds outside the address space that RLIMIT_AS caps: a memfd's pages (no
                 # path, so not Landlock's), SysV segments and queues (which outlive the program) and POSIX
                 # queues. Files in the folder are the disk quota's.
                 "memfd_create", "shmget", "msgget", "mq_open"):
        f.add_rule(deny, name)
    # Device nodes (the mode's file type: S_IFCHR, S_IFBLK), which would name the host's disk or memory
    # past Landlock, and the I/O ports; files, FIFOs and sockets stay the program's to make.
    for file_type in (stat.S_IFCHR, stat.S_IFBLK):
        f.add_rule(deny, "mknod", seccomp.Arg(1, seccomp.MASKED_EQ, _S_IFMT, file_type))
        f.add_rule(deny, "mknodat", seccomp.Arg(2, seccomp.MASKED_EQ, _S_IFMT, file_type))
    for name in ("iopl", "ioperm"):
        f.add_rule(deny, name)
    # A pipe grown to 1 MB (F_SETPIPE_SZ) is kernel memory too; 64 KB each, 64 descriptors at most, is
    # little. The command is an unsigned int: only the argument's low 32 bits count.
    f.add_rule(deny, "fcntl", seccomp.Arg(1, seccomp.MASKED_EQ, 0xFFFFFFFF, _F_SETPIPE_SZ))
    f.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD, 0))  # a new process, not a thread
    f.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")  # its flags sit in memory; ENOSYS: libc falls back to clone
    # Every system call that sends a signal, aimed anywhere but this process (its first argument is a
    # pid, a thread group or, for tkill, a thread id: this process's main thread has its pid).
    me = os.getpid()
    for name in ("kill", "tgkill", "tkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"):
        f.add_rule(deny, name, seccomp.Arg(0, seccomp.NE, me))
    # And the kernel's own signals for I/O: the owner a descriptor names (fcntl F_SETOWN / F_SETOWN_EX,
    # ioctl FIOSETOWN / SIOCSPGRP) gets SIGIO, or any signal F_SETSIG picks (SIGKILL included), when it is
    # ready, whoever the owner is among the user's processes. Commands are unsigned ints: low 32 bits only.
    for cmd in (_F_SETOWN, _F_SETOWN_EX, _F_SETSIG):
        f.add_rule(deny, "fcntl", seccomp.Arg(1, seccomp.MASKED_EQ, 0xFFFFFFFF, cmd))
    for request in (_FIOSETOWN, _SIOCSPGRP):
        f.add_rule(deny, "ioctl", seccomp.Arg(1, seccomp.MASKED_EQ, 0xFFFFFFFF, request))
    # The program dies with the server (die_with): it may not take that back.
    f.add_rule(deny, "prctl", seccomp.Arg(0, seccomp.MASKED_EQ, 0xFFFFFFFF, _PR_SET_PDEATHSIG))
    f.load()  # sets no_new_privs first


def read_roots() -> list[str]:
    """What the interpreter needs to read: its own installation and the system's shared libraries."""
    roots = {sys.base_prefix, sys.base_exec_prefix, os.path.dirname(os.path.realpath(sys.executable)),
             "/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/share/zoneinfo", "/etc/localtime", "/dev/null",
             "/dev/urandom", "/dev/zero"}
    return sorted(roots)


def main(argv: list[str]) -> None:
    limits, server_pid, ready_fd = json.loads(argv[0]), int(argv[1]), int(argv[2])
    workdir = os.getcwd()
    with open("main.py", encoding="utf-8") as f:
        code = f.read()
    try:
        import pyseccomp

        set_limits(limits)
        if private_namespaces(workdir, limits["disk_mb"]):
            with open("main.py", "w", encoding="utf-8") as f:  # into the private folder: tracebacks show lines
                f.write(code)
        drop_capabilities()  # after the namespace's mount, which needs CAP_SYS_ADMIN in it
        die_with(server_pid)  # after unshare: a change of credentials may clear it
        apply_landlock(workdir, read_roots())
        apply_seccomp(pyseccomp)
        os.write(ready_fd, b"1")
        os.close(ready_fd)
    except Exception as e:  # noqa: BLE001 -- fail closed: never run the program half-sandboxed
        print(f"sandbox: cannot isolate the program: {e}", file=sys.stderr)
        os._exit(EXIT_NOT_SANDBOXED)
    # The program sees the standard library only: the packages we imported to set up are forgotten, and
    # their folders are outside what Landlock lets it read anyway.
    sys.path[:] = [p for p in sys.path if "-packages" not in p]
    for name in [m for m in sys.modules if m.startswith(("pyseccomp", "factory"))]:
        del sys.modules[name]
    sys.argv = ["main.py"]
    globals_ = {"__name__": "__main__", "__file__": os.path.join(workdir, "main.py"), "__builtins__": __builtins__}
    try:
        exec(compile(code, "main.py", "exec"), globals_)  # noqa: S102 -- running it is the point; the kernel confines it
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 -- the program's own traceback, without this module's frame
        import traceback

        traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
