"""Fixtures shared by several test modules."""
import logging
import os
import signal
import tempfile
from pathlib import Path

import pytest

# Ray reads whether a local cluster listens on loopback once, at its first import, and test modules import
# it as they are collected (the driver does, at its top); factory.run sets the flag just before it would
# import ray, and refuses to start a Ray that read it too early. Set here as a user's environment would be,
# or a test's factory.run failed depending on which module was collected first (the slow test_api stop test
# failed alone; its 600 s wait for a step made that look like a hang). tests/test_lifecycle.py tests the
# refusal itself.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from tests.test_compiler_support import make_project
from tests.lifecycle_runs import killed, resumed, stopped, user_project  # noqa: F401 (session fixtures shared by modules)
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


@pytest.fixture(scope="session")
def small_path(tmp_path_factory) -> str:
    """The tiny Qwen3 with a 5k vocab, built once: the lm_head and log-softmax over 152k logits dominate the
    tiny model's update, and the tests of the update's arithmetic need the arithmetic only. Imports in
    here: the stand-in stages' Ray workers import the test modules, and torch at a top would slow each."""
    import torch
    from transformers import AutoConfig, Qwen3ForCausalLM

    from factory.assets import resolve_model

    config = AutoConfig.from_pretrained(resolve_model("factory:tiny-qwen3"))
    config.vocab_size, config.pad_token_id, config.bos_token_id, config.eos_token_id = 5120, 0, 0, 1
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("small-qwen3")
    Qwen3ForCausalLM(config).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def local_ray():
    """One small Ray in this process for the tests of a module that place stage actors themselves (test_overlap,
    test_update_ranks, test_reward_judge, test_rollout_vllm): starting Ray costs seconds, so they share one. Shut
    down with the module: factory.run and factory.evaluate refuse to start where a Ray is up already (the next
    test file on this worker may call them). Each test kills the actors it starts. Stand-in stages some of them
    place live in tests/ (PYTHONPATH)."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # PYTHONPATH reaches the workers through the environment Ray's processes start with (set for ray.init
    # only), not a runtime_env: that would start a worker per actor through Ray's runtime-env agent while
    # the workers Ray starts ahead of time sit idle (factory.runtime.driver.start_ray does the same).
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), *([old] if old else [])])
    try:
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="factory-tests-ray-"),
                 object_store_memory=512 * 2**20, log_to_driver=False)
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    yield
    ray.shutdown()


# bin/test runs the suite on two pytest-xdist workers (`-n 2 --dist loadgroup`): the unit tests keep one
# core busy while the real runs' start-ups and waits leave gaps on the other. A worker takes one group of
# tests at a time, so what a group builds once is still built once: a group is a test file (its module
# fixtures: a vLLM engine, a Ray session), or the files below, which read one session fixture of real
# runs. (xdist's own loadgroup reads `xdist_group` marks by renaming the tests' node ids, which pytest 9
# no longer lets a plugin do; the scheduler below groups by file instead.)
_SHARED_RUNS = {  # group: (the session fixtures of real runs, the test files that read them)
    "tracked": ({"tiny_runs", "tracking_server"},
                {"tests/test_api.py", "tests/test_e2e.py", "tests/test_tracking.py", "tests/test_tracking_server.py"}),
    "lifecycle": ({"killed", "resumed", "stopped", "user_project"},
                  {"tests/test_run_lifecycle.py", "tests/test_user_project.py"}),
}
_GROUP_OF_FILE = {file: group for group, (_, files) in _SHARED_RUNS.items() for file in files}


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _GROUP_OF_FILE.get(_file(nodeid), _file(nodeid))

    return ByGroup(config, log)


MISGROUPED = pytest.StashKey[list]()  # tests that read a shared fixture of real runs outside its group


def pytest_collection_modifyitems(config, items):
    # Read before -m deselects anything, so that a slow test is checked too; tests/test_suite.py reports
    # them (an error raised here would only crash the xdist worker, without a message).
    config.stash[MISGROUPED] = [
        f"{item.nodeid} reads the session fixture of the {group!r} runs: add {_file(item.nodeid)} to "
        f"_SHARED_RUNS[{group!r}] in tests/conftest.py, or each worker that runs it builds the runs again"
        for item in items for group, (fixtures, files) in _SHARED_RUNS.items()
        if fixtures & set(item.fixturenames) and _file(item.nodeid) not in files]
    if hasattr(config, "workerinput"):
        # The groups of real runs take minutes: they go first (bin/test turns xdist's reordering off), so
        # that neither is the tail of a worker while the other worker has nothing left to do.
        items.sort(key=lambda item: _file(item.nodeid) not in _GROUP_OF_FILE)


@pytest.fixture(autouse=True)
def _sigterm_stays_as_it_was():
    """A test that leaves SIGTERM's handler changed (start_ray sets the driver's; a run restores it) fails here,
    rather than a later test on the same worker, whose SIGTERM would then raise KeyboardInterrupt."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    after = signal.getsignal(signal.SIGTERM)
    if after is not before:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if before is None else before)
        pytest.fail(f"the test left SIGTERM's handler changed ({after!r}): wrap it in lifecycle.sigterm_restored()")


@pytest.fixture(autouse=True)
def _factory_loggers_stay_enabled():
    """A test that disables Factory's loggers (a library's `logging.config.dictConfig` run in this process
    disables every logger that exists) fails here, not some later test on the same worker that reads a
    warning: which test runs after which depends on how the workers share the files."""
    yield
    loggers = logging.root.manager.loggerDict.items()
    disabled = [name for name, logger in loggers if name.startswith("factory") and getattr(logger, "disabled", False)]
    for name in disabled:  # enabled again, so that only the test that disabled them fails
        logging.getLogger(name).disabled = False
    assert not disabled, f"this test disabled the loggers {disabled}; run what configures logging in a subprocess"
