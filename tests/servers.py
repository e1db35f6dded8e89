"""Starting a test server process on a free 127.0.0.1 port, for the streamable-HTTP tests."""
from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def http_server(argv: list[str], port: int, *, cwd: Path, env: dict[str, str] | None = None,
                timeout_s: float = 30) -> Iterator[subprocess.Popen]:
    """Run `argv` (which must listen on `port`), wait until it accepts connections, stop it afterwards."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the HTTP test server did not start: {' '.join(argv)}") from None
                time.sleep(0.05)
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)
