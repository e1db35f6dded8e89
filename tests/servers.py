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


class Unpluggable:
    """A TCP forwarder on 127.0.0.1 in front of `target_port`, whose cable can be pulled: `down()` closes
    its listening socket and every connection through it (a client then meets "connection refused", as
    from a server that died), `up()` listens again on the same port. `hang()` keeps accepting connections
    and never answers them (a network partition, a proxy whose backend is gone, a wedged server): a client
    waits out its timeout; `up()` forwards again."""

    def __init__(self, target_port: int):
        import threading

        self.target, self.port = target_port, free_port()
        self._lock, self._conns, self._server = threading.Lock(), [], None
        self.hanging = False
        self.up()

    def hang(self) -> None:
        self.hanging = True
        self._cut()  # (a client's pooled connection, still forwarded, would go on answering)

    def up(self) -> None:
        import threading

        if self.hanging:  # listening still: forward again
            self.hanging = False
            self._cut()
            return
        self._server = socket.socket()
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", self.port))
        self._server.listen(64)
        threading.Thread(target=self._accept, args=(self._server,), daemon=True).start()

    def down(self) -> None:
        with contextlib.suppress(OSError):  # wakes the accepting thread (a close alone would leave it listening)
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()
        self.hanging = False
        self._cut()

    def _cut(self) -> None:
        """Close every connection accepted so far."""
        with self._lock:
            for c in self._conns:
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
                    c.close()
            self._conns.clear()

    def _accept(self, server: socket.socket) -> None:
        import threading

        while True:
            try:
                client, _ = server.accept()
            except OSError:  # closed by down()
                return
            if self.hanging:  # held open, never read nor answered
                with self._lock:
                    self._conns.append(client)
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target))
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
