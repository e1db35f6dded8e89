"""The tracking seam: where a run is recorded and how tracked runs are read back.

`Tracker` is what the rest of Factory knows of a tracking store. The driver writes one run through it
(`start_run` ... `end`); `factory runs`, `diff`, `export`, `rescore` and `run --resume` read runs back
through it, as `TrackedRun` records. MLflow is the implementation (factory.tracking.mlflow_tracker); a
second store implements this protocol and `open_tracker` picks it by URI. Nothing else builds a store's
client.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from factory.plan import Plan
    from factory.types import Trajectory


MAX_RUNS = 50_000  # the most runs one search lists (MLflow's SEARCH_MAX_RESULTS_THRESHOLD: it refuses more)


class RunLookupError(Exception):
    """A run named on the command line does not exist, is ambiguous, or cannot be compared."""


class StoreUnreadable(RunLookupError):
    """The tracking store could not be read (a server down, credentials missing, a database MLflow must
    upgrade first): `factory` exits 3, as for other infrastructure, with the store's own words; it was an
    internal error."""


@dataclass(frozen=True)
class TrackedRun:
    """One tracked run as Factory reads it back, whatever store holds it."""

    run_id: str
    name: str
    experiment_id: str
    status: str  # RUNNING | FINISHED | FAILED | KILLED (KILLED: stopped by its user)
    start_time: float | None  # seconds since the epoch
    end_time: float | None
    tags: dict[str, str] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)  # each metric's latest value


class Tracker(Protocol):
    """A tracking store: one run written (the driver's, or a rescore's), runs read back."""

    uri: str
    run_id: str | None  # the run being written
    experiment_id: str | None
    logged: int  # the last step the run being written already holds (a resumed run's)
    checkpoint_dir: str | None  # the run's own checkpoint folder (factory.update.checkpoint.run_folder)
    notify: Any  # called with a line for the user when writing to the store stalls or resumes (or None)

    # ---- writing one run
    def prepare(self) -> None:
        """Open the store ahead of `start` (safe in a thread of its own; failures are left for `start`)."""
        ...

    def free_name(self, name: str) -> str:
        """`name`, or `name-2`, `-3`... when a run in the store has it already (a name to `start` a run with)."""
        ...

    def start(self, run_name: str, params: dict[str, Any], tags: dict[str, str], artifacts: dict[str, str]) -> str:
        """Open a new run with its params (flattened), tags and text artifacts; returns its id."""
        ...

    def start_run(self, plan: Plan, listing: dict[str, list[dict[str, Any]]],
                  extra_params: dict[str, Any] | None = None, extra_artifacts: dict[str, str] | None = None,
                  extra_tags: dict[str, str] | None = None) -> Plan:
        """Open the run of a compiled plan (see MlflowTracker.start_run); returns the plan with its tool
        schemas hashed."""
        ...

    def resume(self, resume: Any, plan: Plan, listing: dict[str, list[dict[str, Any]]],
               started: float | None = None, resolved: dict[str, Any] | None = None) -> Plan:
        """Reopen the run `resume` (factory.runtime.resume.Resume) names instead of starting one; `started`:
        when the resuming command started (its start-up is run time, not idle); `resolved`: what each stage chose
        on its device in this session (recorded with what the session runs on; None: no stage runs, nothing is)."""
        ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_trajectories(self, trajs: list[Trajectory], step: int, *, split: str = "train",
                         traces: int | None = None) -> None: ...

    def log_checkpoint(self, step: int, path: str) -> None: ...

    def flush_traces(self) -> None:
        """Wait until the traces logged so far are in the store (before a checkpoint is written); never raises."""
        ...

    def log_tool_calls(self, rows: list[dict[str, Any]], step: int) -> None:
        """The tool calls recorded since the last table (factory.tools.recording) as the step's table."""
        ...

    def log_text(self, text: str, name: str) -> None: ...

    def log_tags(self, tags: dict[str, str]) -> None: ...

    def end(self, status: str = "FINISHED") -> None: ...

    def released(self) -> None:
        """`release` the run this tracker opened, after the run's teardown; never raises."""
        ...

    # ---- reading runs back
    def claim(self, run_id: str) -> str:
        """Mark run `run_id` as this driver's (its DRIVER_TAG), before any stage starts, so that another
        `--resume` of it refuses; returns the tag as the store holds it after (another driver's, when two
        claimed at once and the other wrote last)."""
        ...

    def release(self, run_id: str) -> None:
        """Take this driver's DRIVER_TAG off run `run_id` (`claim`, or the run opened), once it no longer drives
        it: a process that lives on (a notebook kernel, a service calling factory.run) held the run against
        every other's `--resume` while it lived. Another driver's tag is left as it is."""
        ...

    def run(self, ref: str) -> TrackedRun:
        """The run `ref` names: a run id, a unique id prefix (8+ characters) or a unique run name;
        RunLookupError when there is none or several."""
        ...

    def runs(self, experiment: str | None = None, *, spec_name: str | None = None,
             max_results: int = 1000) -> list[TrackedRun]:
        """Runs of one experiment (by name; RunLookupError when there is none), else of every experiment,
        of one spec when `spec_name` is given; newest first."""
        ...

    def metric_history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        """(step, value) of every value logged for `key`."""
        ...

    def artifacts(self, run_id: str, folder: str = "") -> list[str]:
        """The paths of a run's artifacts directly in `folder`."""
        ...

    def download(self, run_id: str, path: str, into: str | Path) -> Path:
        """One artifact of a run, as a local file (or folder) under `into`."""
        ...

    def experiment_name(self, experiment_id: str) -> str: ...

    def tool_calls(self, run_id: str) -> list[dict[str, Any]]:
        """Every tool call a run recorded (its `tool_calls` tables), in order."""
        ...


def open_tracker(uri: str | None = None, experiment: str | None = None, *, read: bool = False) -> Tracker:
    """The tracking store at `uri` (default: the spec's, $MLFLOW_TRACKING_URI, else ./mlflow.db): MLflow,
    the one implementation. `experiment`: where a run it writes goes. `read`: for a command that reads runs,
    RunLookupError when the store is a sqlite file that does not exist (factory.util.missing_store), and
    StoreUnreadable when it does not answer."""
    from factory.tracking.mlflow_tracker import MlflowTracker, tracking_uri
    from factory.util import missing_store

    uri = tracking_uri(uri)
    if read and (problem := missing_store(uri)) is not None:
        raise RunLookupError(problem)
    tracker = MlflowTracker(uri, experiment)
    if read:  # asked once here: a store that cannot answer is said as such, not as whatever query met it first
        try:
            tracker.client.search_experiments(max_results=1)
        except Exception as e:  # noqa: BLE001 -- MLflow's, the HTTP client's or the database driver's
            raise unreadable(uri, e)
    return tracker


def unreadable(uri: str, e: BaseException) -> StoreUnreadable:
    """The store at `uri` failed a read with `e`, said in its own words."""
    said = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return StoreUnreadable(f"the tracking store {uri} could not be read ({type(e).__name__}: {said[:300]})"
                           + (": is the server up?" if uri.startswith(("http://", "https://")) else ""))


@contextlib.contextmanager
def reading(uri: str) -> Iterator[None]:
    """Reads of a store that answered open_tracker, which may go down while a command reads it (a server
    stopped, its artifact store gone): the store's failure is StoreUnreadable, as it is when open_tracker asks
    (exit 3); an answer about what was read (no such artifact) and any other error pass as they are."""
    from factory.tracking.mlflow_tracker import store_failed

    try:
        yield
    except Exception as e:
        if not store_failed(e):
            raise
        raise unreadable(uri, e) from e
