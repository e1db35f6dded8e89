"""Fixtures shared by several test modules."""
import pytest

from tests.test_compiler_support import make_project
from tests.tracked_runs import tiny_runs, tracking_server  # noqa: F401 (session fixtures shared by modules)


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A throwaway project folder (spec files, reward modules) as the working directory."""
    return make_project(tmp_path, monkeypatch)


@pytest.fixture(scope="module")
def anyio_backend():
    """Async tests run on asyncio (the event loop the rollout actor uses)."""
    return "asyncio"
