"""Fixtures shared by several test modules."""
import signal

import pytest

from tests.test_compiler_support import make_project
from tests.tracked_runs import tiny_runs, tracking_server  # noqa: F401 (session fixtures shared by modules)

# A shell without job control starts background commands with SIGINT ignored, and Python then leaves it
# ignored, in itself and in every process it starts: the Ctrl-C tests (tests/test_lifecycle.py,
# tests/test_run_lifecycle.py) would test that shell, not Factory. The suite runs as a terminal would.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A throwaway project folder (spec files, reward modules) as the working directory."""
    return make_project(tmp_path, monkeypatch)


@pytest.fixture(scope="module")
def anyio_backend():
    """Async tests run on asyncio (the event loop the rollout actor uses)."""
    return "asyncio"
