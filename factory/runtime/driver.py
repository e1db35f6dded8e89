"""`factory run`: the single controller. It places the plan's stages on Ray and runs the loop along the
plan's edges (`factory plan` lists them):

    batch = data.next_batch(n); trajs = rollout.generate(batch); trajs = reward.score(trajs)   # plan.flow("data")
    stats = update.step(trajs)                                                                # ... its last edge
    rollout.load_weights(update.state_dict())                                                # the weight_sync edge

where `reward.score` receives each trajectory as soon as it ends -- each group once its last sample ends,
when a reward node reads its group -- (a `stream` edge, `Edge.stream`), so scoring overlaps generation.

Each stage is a `Group` of replicas (Ray actors in one placement group) called as if it were one local
object, as its class's `CONTRACT` declares (factory.contract: how each method is dispatched over the
replicas, whether it streams, what else the stage does). Nothing here names a stage or probes a class:
placement, wiring (call edges, by role) and the loop all read the plan and the declared contracts.
Everything that branches (algorithm, backend, dynamic sampling) lives outside `train_loop`.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import graphlib
import json
import logging
import math
import os
import re
import secrets
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from factory.contract import Contract, peers_of
from factory.plan import ClusterSettings, DriverSettings, Edge, Plan, Replayed, Stage, StreamPart
from factory.monitors import HALTED_BY_TAG, STOPPED_BY_TAG, Watch
from factory.runtime import lifecycle
from factory.runtime.deadlines import POLL_S, Deadlines
from factory.runtime.health import (RESUME_SAID, CheckpointWriteError, PlacementError, RayStartError,
                                     StageLostError, StageStartError, check_infra, infra_causes, write_problem)
from factory.runtime.lifecycle import (GracefulStop, SessionRecord, check_ray_on_loopback, children_ignore_sigint,
                                       private_dir, prune_ray_sessions, ray_in_own_sessions, ray_starts_sessions,
                                       reap_orphans, refuse_a_ray_up, sigterm_heard, sigterm_interrupts,
                                       sigterm_restored, stopping_said)
from factory.runtime.replay import miss_error, recorded_tool_calls, replayed_in, replaying, why_missed
from factory.runtime.startup import Startup
from factory.tools.recording import ReplayMiss
from factory.types import Placement, Trajectory, trains
from factory.util import EnvChanges, UserError, import_object

if TYPE_CHECKING:
    from factory.runtime.resume import Resume
    from factory.tracking.tracker import Tracker

# How long a stage's placement group may wait for its resources on a cluster that has them in total
# (busy with other jobs, or an autoscaler adding nodes) before the run gives up with a clear message.
PLACEMENT_TIMEOUT_S = 600
PLACEMENT_SLICE_S = 5.0  # waited in slices: after the first, the run says what it waits for (else silent 600 s)


@dataclass
class RunResult:
    run_id: str
    before: dict[str, float]
    after: dict[str, float]
    checkpoint: str | None  # the newest checkpoint's folder, absolute (fresh or resumed run alike)
    stopped: bool = False  # Ctrl-C (or a `stop` event) ended it early, after a logged, checkpointed step
    halted: str | None = None  # a `train.stop_on` monitor ended it early (after a logged, checkpointed step): why
    after_step: int = 0  # the step `after` was measured at: 0 when no evaluation followed step 0's (stopped first)
    last_step: int = 0  # the last step done

    @property
    def status(self) -> str:
        """The MLflow run's status: FINISHED, or KILLED (MLflow's word for stopped by its user: Ctrl-C, a
        `stop` event, or a monitor the spec's train.stop_on names)."""
        return "KILLED" if self.stopped or self.halted else "FINISHED"


# ------------------------------------------------------------------------------------------ Ray
# Stage processes log through Ray to this terminal; keep library chatter (weight-loading bars, advisory
# warnings) out of the run's display.
_QUIET = {"TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
          "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
# What every Ray process of a run starts with: the quiet libraries above, and a stage that reserved no GPU
# sees none (CUDA_VISIBLE_DEVICES=""), which factory.device.stage_device rests on. Ray 2.60 stopped hiding
# them by itself (ray#54868): such an actor saw every GPU of its machine, so on a GPU machine a CPU stage's
# vLLM (upstream's CUDA build, what bin/setup installs there) found CUDA and computed on a GPU nobody had
# reserved, beside the stages that had, while the run's params said cpu. This switch is Ray's way back.
_STAGE_ENV = {**_QUIET, "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "1"}


def start_ray(cluster: ClusterSettings) -> None:
    """`_start_ray`, with a failure of Ray itself (a node that timed out starting on an overloaded machine,
    an address nothing answers on) as a RayStartError, exit 3, naming Ray's reason: not an internal error."""
    try:
        sigterm_interrupts()  # a SIGTERM while Ray starts stops the command as a Ctrl-C then does (exit 130) ...
        _start_ray(cluster)
        sigterm_interrupts()  # ... and after: Ray's own SIGTERM handler, set in ray.init, aborts the driver
    except SystemExit as e:
        if e.code != signal.SIGTERM:
            raise
        # ray.init's handler, heard before it returned, exits with the signal's number: exit 15, said nowhere
        raise KeyboardInterrupt from None
    except (UserError, ValueError, TypeError, RayStartError):  # ours: a mistake to show as it is
        raise
    except Exception as e:  # noqa: BLE001 -- Ray raises a bare Exception for a node that timed out starting
        where = (f"join the Ray cluster at {cluster.ray_address}" if cluster.ray_address else
                 f"start a local Ray (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
        first = (str(e).strip().splitlines() or [""])[0]
        raise RayStartError(f"could not {where}: {type(e).__name__}: {first}{auth_hint(cluster)}") from e


def auth_hint(cluster: ClusterSettings) -> str:
    """When joining without a token failed: Ray (2.60) gives an explicit address no token unless
    RAY_AUTH_MODE=token, while `ray start --head` takes token authentication wherever ~/.ray/auth_token
    exists (Ray writes it at a plain local `ray.init()`): its "Failed to connect" says nothing of it."""
    if not cluster.ray_address or os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        return ""
    return ("; if the cluster uses token authentication (what `ray start` does where ~/.ray/auth_token exists; "
            "its log says 'InvalidAuthToken'), set RAY_AUTH_MODE=token, with the cluster's token in "
            "~/.ray/auth_token or $RAY_AUTH_TOKEN")


def _no_sigterm_handler_note(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("SIGTERM handler is not set")


# What _start_ray set in this process's environment, ray.init's own settings with ours (the auth variables, the
# stages' quiet settings, ray.init's PYTHONBREAKPOINT hook). stop_ray puts them back: a later run in the same
# process (a notebook's, a script calling factory.run twice) starts its local Ray with a fresh token and a cluster
# join sends none of ours, and the caller's process is left as it was (its `breakpoint()` opened no pdb). Ray's
# names and ours alone: the run's tracker sets and puts back MLflow's in another thread meanwhile.
_RAY_ENV = EnvChanges(lambda name: name.startswith("RAY_") or name in ("PYTHONBREAKPOINT", *_STAGE_ENV))
_AUTH = {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}


def _set_auth_env(**values: str) -> None:
    os.environ.update(values)
    _reload_ray_auth()


def _reload_ray_auth() -> None:
    """Ray read its config (the auth mode, the token) when it was imported: have this process read them again,
    as ray's own token set-up does, or its GCS client would knock with the environment's old token (or none)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _restore_ray_env() -> None:
    """What _start_ray set back as it was (each variable only while it still holds the value set)."""
    if _RAY_ENV.put_back() & _AUTH:
        _reload_ray_auth()


# How long leaving a joined cluster (ray.shutdown: a disconnect) is waited for. Its head frozen (not gone: nothing
# refuses) held it for good, after the run's last step, without a word.
SHUTDOWN_WAIT_S = 10.0


def stop_ray(joined: str | None = None, status: Callable[[str], None] = lambda said: print(said, file=sys.stderr)
             ) -> None:
    """ray.shutdown, and what the run's _start_ray set in this process's environment back as it was. From the
    cluster joined at `joined` the run leaves after SHUTDOWN_WAIT_S at most, telling `status` when its head did
    not answer; a local Ray's shutdown (ending its processes, ours) is waited for."""
    try:
        if joined is None:
            ray.shutdown()
        elif not _returned_within(SHUTDOWN_WAIT_S, ray.shutdown):
            # Ray's exit hook, ray.shutdown again, would wait for the one in flight (its lock) as the process exits
            atexit.unregister(ray.shutdown)
            lifecycle.left_hanging = joined  # (the next run in this process is refused: refuse_a_ray_up)
            status(f"the Ray head at {joined} does not answer; leaving without disconnecting")
    finally:
        _restore_ray_env()


def _returned_within(seconds: float, call: Callable[[], object]) -> bool:
    """Whether `call`, run in a daemon thread (left behind if it does not return), returned within `seconds`;
    what it raised, raised here."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as e:  # noqa: BLE001 -- raised in the caller's thread below
            raised.append(e)

    thread = threading.Thread(target=run, name="factory-ray-shutdown", daemon=True)
    thread.start()
    thread.join(seconds)
    if raised:
        raise raised[0]
    return not thread.is_alive()


def _start_ray(cluster: ClusterSettings) -> None:
    """Join the cluster the compiler chose (resources.ray_address, else $RAY_ADDRESS), else start a small
    local Ray of our own.

    A local Ray listens on loopback (factory.runtime.lifecycle.local_ray_on_loopback, checked here), where
    any user of the machine can reach it:
    unless RAY_AUTH_MODE says otherwise it requires a token, fresh for each run and known only to this
    driver's environment (inherited by the Ray processes it starts), and keeps its session files in this
    user's private folder (factory.runtime.lifecycle.private_dir: its owner and mode are checked)."""
    # factory.run from a thread (a notebook's, docs/python.md): ray.init says it set no SIGTERM handler there, which
    # asks nothing of the user (the run's stop is the caller's `stop` event, and Ctrl-C the main thread's)
    logging.getLogger("ray._private.worker").addFilter(_no_sigterm_handler_note)
    _restore_ray_env()  # an earlier run's, should it have ended without stop_ray
    with _RAY_ENV.recording():
        _init_ray(cluster)


def _init_ray(cluster: ClusterSettings) -> None:
    if not (sys.stdout.isatty() and sys.stderr.isatty()):  # the stages' lines Ray prints here, into a log file:
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # no terminal colour codes around their prefixes
    address = cluster.ray_address
    if address and (problem := unreachable(address)):
        raise RayStartError(f"could not join the Ray cluster at {address}: {problem}")
    if address:  # a cluster's own settings (its token, if it has one) decide
        if "RAY_AUTH_MODE" not in os.environ:
            _set_auth_env(RAY_AUTH_MODE="disabled")
        ray.init(address=address, log_to_driver=True, runtime_env={"env_vars": _STAGE_ENV})
        return
    check_ray_on_loopback()
    temp = private_dir() / "ray"
    prune_ray_sessions(temp)  # what earlier runs' Ray left there (Ray keeps every session's folder)
    if "RAY_AUTH_MODE" not in os.environ:
        _set_auth_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    # The Ray processes inherit this environment: a job-level runtime_env would make every stage actor
    # wait for a worker started for that env (setup_worker.py, through Ray's runtime-env agent) while the
    # workers Ray starts ahead of time for plain tasks sit idle -- two more Python start-ups per run.
    for key, value in _STAGE_ENV.items():
        os.environ.setdefault(key, value)
    # a terminal's Ctrl-C, and any signal to the driver's process group, reaches the driver alone
    with ray_starts_sessions() as own, children_ignore_sigint(started_ignoring=own):  # (factory.runtime.lifecycle)
        try:
            ray.init(num_cpus=os.cpu_count(), object_store_memory=int(cluster.object_store_gb * 2**30),
                     include_dashboard=False, _temp_dir=str(temp), log_to_driver=True,
                     logging_level=logging.WARNING)  # its "Started a local Ray instance." repeats the display's line
        except ValueError as e:
            if "object store" not in str(e):
                raise
            raise UserError(store_too_large(cluster.object_store_gb, str(e))) from None


JOIN_PROBE_S = 10.0  # how long a cluster's head has to accept a connection before joining it is given up


def unreachable(address: str, timeout_s: float = JOIN_PROBE_S) -> str | None:
    """Why nothing answers at a cluster's `HOST:PORT`, tried with one TCP connection; None when something does, or
    for Ray's other forms (`auto`, `ray://...`). ray.init retries an address nothing answers on 20 times, ~40 s
    each, printing its own warnings: a typo in the address held the run ~14 minutes."""
    import socket
    from urllib.parse import urlsplit

    if "://" in address:
        return None
    try:
        parts = urlsplit(f"//{address}")
        host, port = parts.hostname, parts.port
    except ValueError:  # a port that is not a number: Ray's to refuse
        return None
    if not host or port is None:
        return None
    fix = ("start its head (`ray start --head --port=PORT`) or correct the address (resources.ray_address, else "
           "$RAY_ADDRESS)")
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except socket.gaierror:
        return f"the host {host} cannot be resolved: correct the address (resources.ray_address, else $RAY_ADDRESS)"
    except ConnectionRefusedError:
        return f"nothing answers there (connection refused): {fix}"
    except TimeoutError:  # a firewall that drops the connection, a host that is off
        return f"nothing answers there (no answer within {timeout_s:g} s): {fix}"
    except OSError as e:  # no route to the host, the network down
        return f"nothing answers there ({e.strerror or e}): {fix}"
    return None


def store_too_large(gb: float, said: str) -> str:
    """Ray's refusal of an object store that leaves its tasks and actors too little of the memory free now (factory
    check refuses one above the machine's memory; memory in use since may leave less), with the setting to change."""
    import psutil

    free = psutil.virtual_memory().available / 2**30
    return (f"a local Ray would not start with resources.object_store_gb {gb:g} ({free:.3g} GB of this machine's "
            f"memory is free now): lower it (1 is usual) or free memory. Ray said: {said}")


# --------------------------------------------------------------------------------------- groups
PROGRESS_WAIT_S = 5.0  # a replica's answer to `progress` waited for at most this long


@dataclass
class Group:
    """The replicas of one stage, called as one object, each method as the class's CONTRACT declares it
    (factory.contract.Call): `one` goes to one replica (in turn), `split` cuts its input over the replicas
    (`cls.split`) and joins their answers (`cls.merge`), `all` reaches every replica alike and replica 0's
    answer is the group's (for a torch.distributed world: rank 0's)."""

    stage: Stage
    cls: type
    actors: list[Any]
    placement_group: Any = None
    info: list[dict[str, Any]] = field(default_factory=list)  # what each replica's setup reported
    turn: int = 0  # the replica the next `one` call goes to
    deadlines: Deadlines = field(default_factory=Deadlines)  # every wait on it ends (factory.runtime.deadlines)
    store_bytes: float = math.inf  # the cluster's smallest object store as `place` read it (object_store_bytes)
    # `progress`: the replicas' answers asked for and not yet read, and the last counts read
    _asked: list[Any] | None = None
    _counts: tuple[int, int, int] = (0, 0, 0)

    @property
    def contract(self) -> Contract:
        return self.cls.CONTRACT

    def submit(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` on every replica; their ObjectRefs, replica 0's first."""
        if len(self.actors) > 1:  # serialise a big argument once, not once per replica
            args = tuple(a if isinstance(a, ray.ObjectRef) else ray.put(a) for a in args)
        return [getattr(actor, method).remote(*args, **kwargs) for actor in self.actors]

    def next_replica(self) -> Any:
        """The replica whose turn it is for a `one` call (the replicas in turn)."""
        actor = self.actors[self.turn % len(self.actors)]
        self.turn += 1
        return actor

    def call(self, method: str, *args: Any, progress: Callable[[int, int], None] | None = None, **kwargs: Any) -> Any:
        """`method` on the group, as if it were one object. `progress(done, total)`, when given and the
        stage declares `progress`, hears the replicas' summed progress about twice a second meanwhile."""
        dispatch = self.contract.call(method).dispatch
        if dispatch == "split":
            parts = self.cls.split(args[0], len(self.actors))
            refs = [getattr(actor, method).remote(*part, *args[1:], **kwargs)
                    for actor, part in zip(self.actors, parts)]
        elif dispatch == "one":
            refs = [getattr(self.next_replica(), method).remote(*args, **kwargs)]
        else:
            refs = self.submit(method, *args, **kwargs)
        answers = self.deadlines.get(refs, f"{self.stage.name}.{method}", _doing(kwargs), self._progress(progress))
        return self.cls.merge(answers) if dispatch == "split" else answers[0]

    def progress(self) -> tuple[int, int, int]:
        """(done, total, work) summed over the replicas (a stage that declares `progress`). A replica that has
        not answered within PROGRESS_WAIT_S (its event loop held: an async reward function that blocks it) is
        asked no more until it does, and the last counts stand: no heartbeat, and no error of its own (the
        call's deadline decides; a raw GetTimeoutError ended the run)."""
        if self._asked is None:
            self._asked = [actor.progress.remote() for actor in self.actors]
        ready, _ = ray.wait(self._asked, num_returns=len(self._asked), timeout=PROGRESS_WAIT_S)
        if len(ready) == len(self._asked):
            counts, self._asked = ray.get(self._asked), None
            self._counts = tuple(sum(column) for column in zip(*counts))  # type: ignore[assignment]
        return self._counts

    def _progress(self, show: Callable[[int, int], None] | None) -> Callable[[], tuple[int, int, int]] | None:
        """For a stage that declares `progress`: a poll of the replicas' summed (done, total, work), its
        (done, total) shown by `show` when given; the deadline takes any change as a heartbeat."""
        if not self.contract.progress:
            return None

        def poll() -> tuple[int, int, int]:
            done, total, work = self.progress()
            if show is not None:
                show(done, total)
            return done, total, work

        return poll

    def stream(self, method: str, batch: Any, *, part: StreamPart, on_part: Callable[[Any], None],
               progress: Callable[[int, int], None] | None = None, **kwargs: Any) -> Any:
        """A `split` method in its streamed form (its Call's `stream`, factory.contract): each replica's part
        of `batch` streams its parts (`part`: what one is, the edge's `Edge.stream`) and then its answer.
        `on_part` receives each part's ObjectRef as soon as any replica yields it (the part stays in Ray's
        object store, unread here); returns the replicas' answers joined (`cls.merge`), as `call` would.

        A stream's first item is the number of parts that follow (read here: a small int): this process
        never reads the parts, so that count is how it tells the last part from the answer, whatever a part
        is and however many samples a prompt has."""
        shares = self.cls.split(batch, len(self.actors))
        streamed = self.contract.calls[method].stream
        streams: dict[Any, int | None] = {getattr(actor, streamed).remote(*share, part=part, **kwargs): None
                                          for actor, share in zip(self.actors, shares)}  # stream -> parts to come
        pending, answers, last, polled = list(streams), {}, {}, time.perf_counter()
        kind, start = f"{self.stage.name}.{method}", time.monotonic()
        # a heartbeat: a part from any replica, or (a stage that declares `progress`) more work done
        budget, beat, done, work = self.deadlines.budget(kind), start, 0, None
        while pending:
            if time.monotonic() - beat > budget:
                self.deadlines.fail(kind, _doing(kwargs), time.monotonic() - start, budget, f"{done} {PLURAL[part]} done")
            ready, pending = ray.wait(pending, num_returns=1, timeout=0.5, fetch_local=False)
            beat = time.monotonic() if ready else beat
            for s in ready:
                item = next(s, None)
                if item is None:  # ended early: a replica that raised yields its error as its last item
                    if s in last:
                        ray.get(last[s])
                    raise RuntimeError(f"{self.stage.name}.{method}: a replica's stream ended before its answer")
                last[s] = item
                if streams[s] is None:
                    streams[s] = ray.get(item)
                    pending.append(s)
                elif streams[s]:
                    streams[s] -= 1
                    done += 1
                    on_part(item)
                    pending.append(s)
                else:
                    answers[s] = item
            if self.contract.progress and time.perf_counter() - polled > 0.5:
                polled = time.perf_counter()
                shown, total, now = self.progress()
                beat, work = beat if now == work else time.monotonic(), now
                if progress is not None:
                    progress(shown, total)
        self.deadlines.took(kind, time.monotonic() - start)
        return self.cls.merge(ray.get([answers[s] for s in streams]))


Groups = dict[str, Group]
PLURAL = {"trajectory": "trajectories", "group": "groups"}


def room_problem(stages: Iterable[Stage], total: Mapping[str, float], joined: str | None = None) -> str | None:
    """Why a Ray of the run's own (one node, no other jobs) can never hold every stage at once, or None.
    Each stage's placement group holds its share for the whole run, so the shares must fit together: else
    the last stage placed waited PLACEMENT_TIMEOUT_S for room only the run itself held. For the cluster
    `joined` (whose nodes may yet grow: an autoscaler) the same, said as what the last stages will wait for."""
    shares: dict[str, list[tuple[str, float]]] = {}
    for stage in stages:
        for key, amount in stage.resources.items():
            if amount > 0:
                shares.setdefault(key, []).append((stage.name, amount * stage.replicas))
    for key, asks in shares.items():
        need, have = sum(n for _, n in asks), total.get(key, 0.0)
        if need > have + 1e-9:
            listed = ", ".join(f"{name} {n:g}" for name, n in asks)
            if joined:
                return (f"the stages reserve {need:g} {key} in all ({listed}; replicas counted) but the Ray cluster "
                        f"at {joined} has {have:g}, and each stage holds its share for the whole run: the stages "
                        f"placed last wait for nodes to join, up to {PLACEMENT_TIMEOUT_S} s each (else reserve less: "
                        "the spec's `resources`)")
            return (f"the stages reserve {need:g} {key} in all ({listed}; replicas counted) but the run's own local "
                    f"Ray has {have:g}, and each stage holds its share for the whole run: reserve less (the spec's "
                    "`resources`), or join a Ray cluster that has room (resources.ray_address or $RAY_ADDRESS)")
    return None


def _placement_group(stage: Stage, status: Callable[[str], None] = lambda _: None) -> Any:
    """A placement group reserving one bundle per replica, or None when a replica reserves nothing. One that
    is not ready after a first PLACEMENT_SLICE_S is told to `status`, once (the run waits for room)."""
    if not stage.resources:
        return None
    from ray.util.placement_group import placement_group

    total = ray.cluster_resources()
    short = [k for k, v in stage.resources.items() if total.get(k, 0.0) < v * stage.replicas]
    if short:  # Ray would wait forever for bundles the cluster cannot hold
        raise PlacementError(f"stage {stage.name!r} needs {stage.replicas} x {stage.resources} but the Ray cluster "
                             f"has {({k: total.get(k, 0.0) for k in short})} in all: reserve less for it (the "
                             "spec's `resources`) or add nodes")
    pg = placement_group([dict(stage.resources)] * stage.replicas, strategy=stage.strategy)
    ready, slices = pg.ready(), max(1, math.ceil(PLACEMENT_TIMEOUT_S / PLACEMENT_SLICE_S))
    for n in range(slices):
        if ray.wait([ready], timeout=PLACEMENT_TIMEOUT_S / slices)[0]:
            return pg
        if n == 0 and slices > 1:
            status(waiting_said(stage, ray.available_resources(), total,
                                time.time() + PLACEMENT_TIMEOUT_S * (slices - 1) / slices))
    free = _free_of(stage, ray.available_resources(), total)
    raise PlacementError(f"stage {stage.name!r}: {stage.replicas} x {stage.resources} ({stage.strategy}) found "
                         f"no room in {PLACEMENT_TIMEOUT_S} s; free: {free} (the run's other stages and other jobs "
                         "hold the rest): reserve less (the spec's `resources`) or add nodes")


def _free_of(stage: Stage, free: Mapping[str, float], total: Mapping[str, float]) -> str:
    """What is free of what the stage asks for, of the cluster's total: only those (not Ray's bundle and memory
    entries)."""
    return f"{({k: free.get(k, 0.0) for k in stage.resources})} of {({k: total.get(k, 0.0) for k in stage.resources})}"


def waiting_said(stage: Stage, free: Mapping[str, float], total: Mapping[str, float], until: float) -> str:
    """One line: the stage waits for room (what it asks, what is free now, of what), until `until` (epoch s)."""
    return (f"{stage.name} waits for room on Ray: {stage.replicas} x {dict(stage.resources)} ({stage.strategy}); free "
            f"now {_free_of(stage, free, total)} (other jobs, or the run's other stages, hold the rest); it gives up "
            f"at {time.strftime('%H:%M:%S', time.localtime(until))}")


def start_group(stage: Stage, status: Callable[[str], None] = lambda _: None) -> Group:
    """The stage's replicas as Ray actors: constructed with the stage's slice (nothing else), each in
    its own bundle of the stage's placement group (a wait for room told to `status`)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cls = import_object(stage.cls)
    pg = _placement_group(stage, status)
    custom = {k: v for k, v in stage.resources.items() if k not in ("CPU", "GPU")}
    actors = []
    for i in range(stage.replicas):
        options: dict[str, Any] = {"num_cpus": stage.resources.get("CPU", 0), "num_gpus": stage.resources.get("GPU", 0),
                                   "resources": custom}
        if pg is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
        if stage.env:  # (a worker started for it: this environment must be there when its process starts)
            options["runtime_env"] = {"env_vars": stage.env}
        actors.append(ray.remote(cls).options(**options).remote(stage.settings))
    return Group(stage, cls, actors, pg)


def place(plan: Plan, status: Callable[[str], None] = lambda _: None, deadlines: Deadlines | None = None,
          ready: Callable[[str, float], None] = lambda name, seconds: None,
          record: Callable[[], None] = lambda: None) -> Groups:
    """Start every stage's group and set its replicas up, callees before their callers (each caller
    gets a handle on the stages its call edges reach, under each edge's role); a torch.distributed
    group first meets at rank 0's address. `status` hears each stage as it is ready, and `ready` its
    name and the seconds since placing began. Should it fail or be interrupted, what is placed is torn
    down: the replicas whose setup ran closed, the others killed (`teardown`'s `closing`), after `record()`
    (the session record's update: what a setup still running started, an engine or tool servers, is ended
    with Ray's processes)."""
    groups: Groups = {}
    setups: dict[Any, Any] = {}  # setup ref -> the replica (its actor) it was sent to
    unanswered: dict[Any, str] = {}  # setup ref -> its stage, until it answers
    t0 = time.perf_counter()
    joined = plan.driver.resources.ray_address
    if why := room_problem(plan.stages, ray.cluster_resources(), joined):
        if joined is None:
            raise PlacementError(why)
        status(f"warning: {why}")  # a cluster's room may grow (nodes join): only ours is fixed
    # read now, while placing needs the head anyway: asked at the first weight sync (Updates), a joined cluster's
    # head that stopped answering held the run there with no deadline, while the stages' own calls went on
    store = object_store_bytes()
    try:
        for stage in plan.stages:
            groups[stage.name] = start_group(stage, status)
            groups[stage.name].store_bytes = store
            if deadlines is not None:  # one for the run: the waits on every stage share its record
                groups[stage.name].deadlines = deadlines
        calls = [e for e in plan.edges if e.kind == "call" and e.method]
        order = graphlib.TopologicalSorter({s.name: {e.dst for e in calls if e.src == s.name} for s in plan.stages})
        order.prepare()
        handles = {name: g.actors[0] for name, g in groups.items()}
        # A stage's setup starts as soon as the stages it calls are ready, not when every stage of the
        # previous wave is: the rollout's engine does not wait for the update's DeepSpeed start.
        pending: dict[str, tuple[list[Any], float]] = {}  # stage -> its replicas' setup refs, when they began
        answers: dict[Any, Any] = {}  # setup ref -> what its replica reported, until its stage is ready
        while order.is_active():
            for name in order.get_ready():
                try:
                    pending[name] = setup_group(groups[name], peers_of(calls, name, handles)), time.monotonic()
                except ray.exceptions.RayError as e:  # a world's rank 0 died (or raised) before it gave its address
                    raise start_error(name, e) from None
                unanswered.update(dict.fromkeys(pending[name][0], name))
                setups.update(zip(pending[name][0], groups[name].actors))
            # Only the unanswered are waited on (an answered ref returns at once: the loop spun), and each is
            # fetched as it answers: a failed setup fails the start now, not once its stage's other replicas
            # are done (a world's other ranks wait for it until the stage's timeout: a StageTimeout, no error)
            if ray.wait(list(unanswered), num_returns=1, timeout=POLL_S)[0]:
                for ref in ray.wait(list(unanswered), num_returns=len(unanswered), timeout=0)[0]:
                    name = unanswered.pop(ref)
                    try:
                        answers[ref] = ray.get(ref)
                    except ray.exceptions.RayError as e:  # it raised, or its process died (out of memory, a crash)
                        raise start_error(name, e) from None
            for name, (refs, began) in list(pending.items()):
                kind, d = f"{name}.setup", groups[name].deadlines
                if any(ref in unanswered for ref in refs):
                    if time.monotonic() - began > d.budget(kind):
                        d.fail(kind, "starting", time.monotonic() - began, d.budget(kind))
                    continue
                groups[name].info = [answers.pop(ref) for ref in refs]
                d.took(kind, time.monotonic() - began)
                del pending[name]
                ready(name, time.perf_counter() - t0)
                status(f"{name} ready ({time.perf_counter() - t0:.1f} s)")
                order.done(name)
        agree_sync_dtypes(plan, groups)
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):  # said now: Ray's shutdown and its processes' end still take seconds
            status("stopping: closing the stages that are set up, ending those still setting up")
        try:
            record()
        except Exception as failed:  # noqa: BLE001 -- the start's own error is what the caller must see
            status(f"warning: the processes the stages started could not be recorded ({failed}): those of a setup "
                   "cut short may outlive the run")
        finally:
            teardown(groups, closing=[actor for ref, actor in setups.items() if ref not in unanswered])
        raise
    return groups


def agree_sync_dtypes(plan: Plan, groups: Groups) -> None:
    """Each weight sync sent in the dtype its destination's engine holds, as that stage resolved it on its own
    device (its setup's report): the source guessed it on its own device, which may not be the destination's (an
    update on the CPU beside a GPU rollout sent float32 to a bf16 engine). What the source then resolves replaces
    its setup's report, which the run's params record."""
    for e in plan.edges:
        dtype = groups[e.dst].info[0].get("resolved", {}).get("dtype") if e.kind == "weight_sync" else None
        if dtype is not None:
            groups[e.src].info[0]["resolved"] = groups[e.src].call("use_sync_dtype", dtype)


def start_error(name: str, e: ray.exceptions.RayError) -> BaseException:
    """What to raise when stage `name`'s setup failed with `e`: a UserError as the stage raised it, its
    message naming the stage (bad input, exit 2), anything else as a StageStartError that says which stage
    and why in one message (Ray's own text of a task's error is the remote traceback, which says nothing
    more to a user)."""
    from factory.util import UserError

    if isinstance(e, ray.exceptions.RayTaskError):  # setup raised
        cause = e.cause if isinstance(e.cause, BaseException) else e
        if isinstance(cause, UserError):  # itself, not Ray's wrapper (whose text is the remote traceback)
            if len(cause.args) == 1 and isinstance(cause.args[0], str):
                cause.args = (f"stage '{name}': {cause.args[0]}",)
            return cause
        if type(cause) is ray.exceptions.RayError and (said := last_exception(e.traceback_str or "")):
            # the stage's exception could not be pickled (vLLM's pydantic errors hold objects that cannot):
            # Ray's stand-in says only that; the exception's own text is the remote traceback's last
            return StageStartError(f"stage '{name}' did not start: {said}")
        return StageStartError(f"stage '{name}' did not start: {type(cause).__name__}: {cause}")
    said = str(e).strip().splitlines()
    return StageStartError(f"stage '{name}' did not start: its process ended ({type(e).__name__}"
                           f"{': ' + said[0] if said else ''}); a model larger than the memory left is a common cause")


def last_exception(traceback: str, limit: int = 600) -> str | None:
    """The last exception of a traceback's text, `Type: message` with the message's indented lines after it
    joined into one (at most `limit` characters); None when there is none."""
    lines = traceback.rstrip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i]
        if line and not line[0].isspace() and ": " in line and not line.startswith("Traceback"):
            return " ".join(part.strip() for part in lines[i:] if part.strip())[:limit]
    return None


ADDRESS_TIMEOUT_S = 300  # a world's rank 0 gives the address its ranks meet at within this long


def setup_group(g: Group, peers: dict[str, Any]) -> list[Any]:
    """Start every replica's setup (ObjectRefs of what each reports), telling it its rank and peers (role ->
    handle)."""
    workdir, world = os.getcwd(), len(g.actors)
    addr, port = "", 0
    if g.contract.world and world > 1:
        try:
            addr, port = ray.get(g.actors[0].address.remote(), timeout=ADDRESS_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:  # (its process may well be alive: not start_error's message)
            raise StageStartError(f"stage '{g.stage.name}' did not start: its rank 0 gave no address for its "
                                  f"torch.distributed world within {ADDRESS_TIMEOUT_S} s") from None
    return [actor.setup.remote(Placement(workdir, rank, world, addr, port, peers))
            for rank, actor in enumerate(g.actors)]


def teardown(groups: Groups, closing: Iterable[Any] | None = None) -> None:
    """Close every stage (tool servers, engines, the trainer's process group: each stage's `close`) before
    the actors go, then free the placement groups. A close that fails or hangs (30 s) does not keep the
    others from running nor the actors from being killed. `closing`: only these replicas are closed, those
    whose setup ran (`place` cut short by a Ctrl-C or a stage that failed); the others are killed without a
    close: one whose setup is still running, a synchronous actor, would answer it only once setup is done
    (minutes, for an engine loading), and one whose setup never ran has started nothing."""
    close = [a for g in groups.values() for a in g.actors] if closing is None else list(closing)
    refs = [actor.close.remote() for actor in close]
    ray.wait(refs, num_returns=len(refs), timeout=30)
    for g in groups.values():
        for actor in g.actors:
            ray.kill(actor)
        if g.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(g.placement_group)


def placement_record(groups: Groups) -> dict[str, Any]:
    """What was placed, as each replica reported it (MLflow's placement.json, next to plan.json)."""
    return {name: {"cls": g.stage.cls, "replicas": len(g.actors), "resources": g.stage.resources,
                   "strategy": g.stage.strategy, "setup": g.info} for name, g in groups.items()}


# ----------------------------------------------------------------------------------------- flows
def carry(g: Groups, edges: list[Edge], *args: Any, display: Any, label: str,
          **context: Any) -> tuple[Any, dict[str, float]]:
    """Carry one batch along `edges`: the first edge's source fetches it (`fetch(*args)`), then each
    edge's destination receives the previous answer -- part by part, as the source streams it, along a
    `stream` edge (`pipe`) -- and `context` (the step and the dynamic-sampling attempt, which seed the
    sampling). Returns the last answer and every stage's metrics; the display shows the progress of
    stages that report it."""
    x = g[edges[0].src].call(edges[0].fetch, *args)
    metrics: dict[str, float] = {}
    if x is None:  # no held-out data
        return None, metrics

    def shown(stage: str) -> Callable[[int, int], None]:  # the first stage's under the flow's label
        said = label if stage == edges[0].dst else f"{label}: {stage}"
        return lambda done, total: display.progress(said, done, total)

    todo = list(edges)
    while todo:
        e = todo.pop(0)
        if todo and (part := todo[0].stream):
            into = todo.pop(0)
            x, m = pipe(g[e.dst], e.method, g[into.dst], into.method, x, part=part, progress=shown(e.dst),
                        dst_progress=shown(into.dst), **context)
        else:
            x, m = g[e.dst].call(e.method, x, progress=shown(e.dst), **context)
        display.done()
        metrics.update(m)
    return x, metrics


def pipe(src: Group, method: str, dst: Group, dst_method: str, x: Any, *, part: StreamPart,
         progress: Callable[[int, int], None], dst_progress: Callable[[int, int], None] | None = None,
         **context: Any) -> tuple[list[Any], dict[str, float]]:
    """`src.method(x)` streamed into `dst.dst_method`: each part (`part`, the edge's `Edge.stream`: one
    trajectory as soon as it ends, or one prompt's group once its last sample ends) goes to `dst` (its
    replicas in turn; an async actor works on several at once) at once, so `dst`'s work overlaps `src`'s.
    Returns `dst`'s trajectories in `src`'s order (prompt, sample) and the metrics of both: `src`'s
    answer's, and `dst`'s merged over the parts (`_merge`, by trajectory counts), except that
    `timing/<dst>_s` is the time `dst` worked after `src` ended -- the part of its work generation did not
    hide, which the step waits for -- and `timing/<dst>_wall_s` runs from the first part to the last answer.
    `progress` shows `src`'s progress while it streams, `dst_progress` `dst`'s while the step waits for it
    (a stage that declares `progress`)."""
    refs: list[Any] = []
    t_first = 0.0

    def send(trajs: Any) -> None:
        nonlocal t_first
        t_first = t_first or time.perf_counter()
        refs.append(getattr(dst.next_replica(), dst_method).remote(trajs, **context))

    _, metrics = src.stream(method, x, part=part, on_part=send, progress=progress, **context)
    t_src = time.perf_counter()
    answers = dst.deadlines.get(refs, f"{dst.stage.name}.{dst_method}", _doing(context), dst._progress(dst_progress))
    answers = sorted(answers, key=lambda a: (a[0][0].prompt_index, a[0][0].sample_index))  # in (prompt, sample) order
    joined: dict[str, float] = {}
    seen = 0
    for trajs, m in answers:
        joined = _merge(joined, m, seen, len(trajs))
        seen += len(trajs)
    name = dst.stage.name
    joined[f"timing/{name}_s"] = time.perf_counter() - t_src
    joined[f"timing/{name}_wall_s"] = time.perf_counter() - t_first
    return [t for trajs, _ in answers for t in trajs], {**metrics, **joined}


def evaluate(g: Groups, plan: Plan, display: Any, step: int) -> tuple[dict[str, float], list[Any]]:
    """The eval flow up to (not into) the trainer; `eval/<metric>` is the mean of that reward node."""
    trajs, m = carry(g, plan.flow("eval")[:-1], display=display, label=f"step {step} evaluation", step=step)
    if trajs is None:
        return {}, []
    from factory.reward.graph import eval_metrics

    out = eval_metrics(m, plan.metrics)  # the training reward's missing-value rule (on_missing)
    out["eval/num_turns"] = m["num_turns/mean"]
    out["eval/tool_calls"] = m["tool_calls/mean"]
    # trajectories that met a tool or judge failure are scored as the model's answers: say how many, as a
    # training step does (max_infra_error_rate stops those; an evaluation has no update to protect)
    causes = [c for t in trajs if (c := infra_causes(t))]
    out["eval/infra_errors"] = float(len(causes))
    if causes:
        display.warning(f"step {step} evaluation: {len(causes)} of {len(trajs)} trajectories met an infrastructure "
                        f"failure (first: {causes[0][0]}): its eval metrics score them as they ended, a reward "
                        "node without a value as its on_missing says (0, or left out under drop_sample); "
                        "eval/infra_errors counts them")
    return out, trajs


def _trained(trajs: list[Any], d: DriverSettings) -> list[bool]:
    """Which of `trajs` the update trains (factory.types.trains)."""
    return [trains(t, d.overlong_filter, d.drop_infra_errors) for t in trajs]


def _trainable(trajs: list[Any], d: DriverSettings) -> list[Any]:
    """Those of `trajs` the update would train (factory.types.trains)."""
    return [t for t, k in zip(trajs, _trained(trajs, d)) if k]


def collect(g: Groups, plan: Plan, display: Any, step: int) -> tuple[list[Any], dict[str, float], list[Any]]:
    """One step's scored trajectories: the data flow up to (not into) the trainer. With dynamic sampling
    (DAPO), groups whose rewards all agree carry no signal: they are dropped and more prompts are
    sampled, up to 3 extra rounds. Returns the batch to train, the step's metrics, and every trajectory its
    sampling rounds made (the batch itself without dynamic sampling): the monitors read the task on those, not
    on the kept groups only, which leave out every prompt the policy solves in each sample."""
    from factory.update.batch import with_signal  # (torch: imported when a step is collected, not at start-up)

    edges, d = plan.flow("data")[:-1], plan.driver
    want, kept, sampled, metrics, seen, generated = d.train.prompts_per_step, [], [], {}, 0, 0
    for attempt in range(4 if d.dynamic_sampling else 1):
        trajs, m = carry(g, edges, want - len({t.prompt_index for t in kept}) if attempt else want, display=display,
                         label=f"step {step} rollout", step=step, attempt=attempt)
        for t in trajs:  # keep group ids unique across rounds (a round's prompt indices are below `want`)
            t.prompt_index += want * attempt
        metrics = _merge(metrics, m, seen, len(trajs))
        seen += len(trajs)
        generated += sum(t.num_model_tokens for t in trajs)
        if not d.dynamic_sampling:
            return trajs, {**metrics, "rollout/generated_tokens": float(generated)}, trajs
        sampled += trajs
        kept += [t for t, k in zip(trajs, with_signal(trajs, d.turn_gamma, d.std_eps, _trained(trajs, d))) if k]
        if len({t.prompt_index for t in kept}) >= want:
            break
    metrics["rollout/dynamic_sampling_rounds"] = float(attempt + 1)
    metrics["rollout/dynamic_sampling_kept"] = float(len(kept))  # the trained batch; the means are over all rounds
    return kept or trajs, {**metrics, "rollout/generated_tokens": float(generated)}, sampled


def _merge(a: dict[str, float], b: dict[str, float], na: int, nb: int) -> dict[str, float]:
    """One step's metrics from two sampling rounds (or two streamed parts: groups, single trajectories) of
    `na` and `nb` trajectories, so that they describe the step's whole batch: a mean (`.../mean`), rate
    (`_per_s`) or percentile (`_p50`, `_p95`) is weighted by what it is over -- trajectories, the kept ones
    for `reward/` means, generate time, tool calls, a per-turn node's turns -- and a round or part without a
    value (NaN) weighs nothing; everything else (times, counts) adds up."""
    def weight(k: str, m: dict[str, float], n: int) -> float:
        if math.isnan(m[k]):
            return 0.0
        if k.endswith("_per_s"):  # perf/generate_tokens_per_s: tokens over generate time
            return m.get("timing/generate_s", 0.0)
        if k.endswith(("_p50", "_p95")):  # tools/<tool>/latency_s_p50: over that tool's calls
            return m.get(k.rsplit("/", 1)[0] + "/calls", 0.0)
        if k.endswith("/turns/mean"):  # rewards/<node>/turns/mean: over that per-turn node's turns
            return m.get(k.removesuffix("/mean"), 0.0)
        if k.removesuffix("/mean") + "/values" in m:  # a gated node's mean: over the trajectories it has a value for
            return m[k.removesuffix("/mean") + "/values"]
        return n - m.get("reward/dropped", 0.0) if k.startswith(("reward/", "rewards/")) else n

    out = dict(a)
    for k, v in b.items():
        if k not in a:
            out[k] = v
        elif k.endswith(("/mean", "_per_s", "_p50", "_p95")):
            wa, wb = weight(k, a, na), weight(k, b, nb)
            out[k] = v if not wa else a[k] if not wb else (a[k] * wa + v * wb) / (wa + wb)
        else:
            out[k] = a[k] + v
    return out


def sync_weights(g: Groups, plan: Plan) -> float:
    """Every weight_sync edge: the source's weights (rank 0's; every rank takes part in gathering them)
    go to every replica of the destination, through Ray's object store, never through this process."""
    return load_weights(g, fetch_weights(g, plan))


def fetch_weights(g: Groups, plan: Plan) -> list[tuple[Edge, list[Any]]]:
    """Each weight_sync edge with its source's weights as every rank's ObjectRef (rank 0's holds them)."""
    return [(e, g[e.src].submit(e.fetch)) for e in plan.edges if e.kind == "weight_sync"]


def load_weights(g: Groups, fetched: list[tuple[Edge, list[Any]]]) -> float:
    """Fetched weights into every replica of each edge's destination; the seconds it took."""
    t0 = time.perf_counter()
    for e, weights in fetched:
        dst = g[e.dst]
        dst.deadlines.get(dst.submit(e.method, weights[0]) + weights[1:], f"{e.dst}.{e.method}", f"weights from {e.src}")
    return time.perf_counter() - t0


def restore(g: Groups, plan: Plan, resume: Resume) -> int:
    """Put the stages where the resumed run's checkpoint left them (factory.runtime.resume): every rank loads the
    trainer's checkpoint, the data source its position, the engines the trainer's weights; returns its step."""
    if resume.checkpoint is not None:
        data, trainer = plan.flow("data")[0].src, plan.flow("data")[-1].dst
        g[trainer].call("load_checkpoint", str(resume.checkpoint_dir), resume.checkpoint)
        g[data].call("restore", resume.data)
        sync_weights(g, plan)
    return resume.step


# ------------------------------------------------------------------------------------------ loop
# The parts a step's wall time (`timing/step_s`) is split into, none overlapping another: generate (a
# generation in flight), tools_only (tool calls in flight and no generation), reward (scoring the step
# waited for: with trajectories streamed to the reward stage, only what was left after the rollout ended;
# `timing/reward_wall_s` spans all of it), update, weight_sync; `timing/overhead_s` is the rest (moving
# batches between actors, the data stage, rollout bookkeeping). With train.max_staleness > 0 a step's wall
# time runs from its rollout to the next one, and update / weight_sync are what it waited for (an earlier
# step's update, running behind this rollout, and its weight sync); `timing/update_busy_s` is the step's
# own update time.
STEP_PARTS = ("generate", "tools_only", "reward", "update", "weight_sync")


@dataclass
class _Pending:
    """A step whose update is in flight."""

    step: int
    trajs: list[Any]
    metrics: dict[str, float]
    t0: float  # when the step's rollout began
    update: list[Any]  # every rank's ObjectRef of the update's stats
    weights: list[tuple[Edge, list[Any]]]  # the weights right after it (fetch_weights)
    submitted: float = 0.0  # time.monotonic() when the update was asked for: its deadline counts from there


class Updates:
    """The trainer's updates in flight (`train.max_staleness`). A step's update is submitted as soon as its
    batch is scored, and its weights fetched right behind it (an actor runs its calls in order, so they are
    that update's, whatever is submitted next). A step finishes -- its update awaited, its weights loaded
    into every rollout replica -- once more than `max_staleness` steps are in flight, or at once when the
    loop drains (a step that evaluates, checkpoints or ends the run). So with 0 the next rollout waits for
    this update (on-policy), with 1 it runs while this update does, with the previous step's weights."""

    def __init__(self, g: Groups, plan: Plan, synced: int, warn: Callable[[str], None] | None = None):
        self.g, self.plan, self.k = g, plan, plan.driver.train.max_staleness
        self.synced = synced  # the step whose update's weights the rollout holds
        self.pending: deque[_Pending] = deque()
        self.warn = warn  # once, at the first sync's size: one that Ray's object store cannot hold (store_advice)

    def submit(self, step: int, trajs: list[Any], m: dict[str, float], t0: float) -> None:
        trainer = self.plan.flow("data")[-1]
        m["train/staleness"] = float(step - 1 - self.synced)  # updates the sampling weights were behind
        if self.k:  # what this step waits for, added up in `finish`
            m["timing/update_s"] = m["timing/weight_sync_s"] = 0.0
        update = self.g[trainer.dst].submit(trainer.method, trajs)
        self.pending.append(_Pending(step, trajs, m, t0, update, fetch_weights(self.g, self.plan), time.monotonic()))

    def finish(self, drain: bool) -> list[tuple[int, list[Any], dict[str, float]]]:
        """The steps that finish now, oldest first: (step, trajectories, complete metrics)."""
        if not self.pending:  # all finished already (the loop drains a second time for a stop)
            return []
        current, done = self.pending[-1], []
        while self.pending and (drain or len(self.pending) > self.k):
            p = self.pending.popleft()
            t0 = time.perf_counter()
            trainer = self.plan.flow("data")[-1]
            stats = self.g[trainer.dst].deadlines.get(p.update, f"{trainer.dst}.{trainer.method}", f"step {p.step}",
                                                      since=p.submitted)[0]
            waited, synced = time.perf_counter() - t0, load_weights(self.g, p.weights)
            self.synced = p.step
            if self.k:  # the update ran behind the next rollout: a step counts the part it waited for
                stats["timing/update_busy_s"] = stats.pop("timing/update_s")
                current.metrics["timing/update_s"] += waited
                current.metrics["timing/weight_sync_s"] += synced
            else:
                p.metrics["timing/weight_sync_s"] = synced
            p.metrics.update(stale_named(stats, p.metrics["train/staleness"]))
            if self.warn and "perf/weight_sync_mb" in stats:  # checked once: every sync is the same size
                said = store_advice(stats["perf/weight_sync_mb"], self.g[trainer.dst].store_bytes, self.k)
                if said:
                    self.warn(said)
                self.warn = None
            done.append((p.step, p.trajs, p.metrics))
        m = current.metrics
        m["timing/step_s"] = time.perf_counter() - current.t0
        m["timing/overhead_s"] = m["timing/step_s"] - sum(m.get(f"timing/{k}_s", 0.0) for k in STEP_PARTS)
        # tokens the model generated in the step (every sampling round), not tool results or template text
        m["perf/tokens_per_s"] = m["rollout/generated_tokens"] / m["timing/step_s"]
        return done


def stale_named(stats: dict[str, float], lag: float) -> dict[str, float]:
    """A step's update statistics, with the rollout/learner log-prob gap renamed `rollout/stale_logprob_diff_*`
    where the weights that sampled were `lag` > 0 updates behind the learner's: that gap is the policy's drift
    over those updates as well as the engine's mismatch, which `rollout/logprob_diff_*` alone measures."""
    if not lag:
        return stats
    return {k.replace("rollout/logprob_diff_", "rollout/stale_logprob_diff_"): v for k, v in stats.items()}


def store_advice(sync_mb: float, store_bytes: float, staleness: int) -> str | None:
    """What to say when one weight sync (`sync_mb`, 1e6 bytes) is more than Ray's object store holds
    (`store_bytes`, the smallest node's): Ray then writes each sync outside the store, to disk-backed memory.
    Measured on SmolLM2-135M's float32 weights (538 MB; bench/vs_trl.py's run, AMD EPYC Zen 4, 2 cores):
    `timing/weight_sync_s` 1.1-1.6 s with a 0.5 GiB store, 0.15-0.17 s with 1 GiB; the difference is between
    the update's answer and the rollout's load, i.e. in Ray's put and get.
    The advice leaves a quarter spare, per sync in flight (`train.max_staleness` more)."""
    if sync_mb * 1e6 <= store_bytes:
        return None
    need = math.ceil(sync_mb * 1e6 / 2**30 * (1 + staleness) * 1.25 * 2) / 2  # GiB, in halves
    return (f"one weight sync is {sync_mb:.0f} MB, more than Ray's object store holds ({store_bytes / 1e6:.0f} MB): "
            "every sync is written outside it, to slower disk-backed memory (538 MB on a 2-core CPU: 1.1-1.6 s a sync "
            f"instead of 0.15-0.17 s); set resources.object_store_gb: {need:g} or more")


def object_store_bytes() -> float:
    """The smallest object store of the Ray cluster's live nodes (a weight sync is put on the update's node
    and read on every rollout replica's)."""
    stores = [n["Resources"].get("object_store_memory", 0.0) for n in ray.nodes() if n.get("Alive")]
    return min(stores) if stores else math.inf


OnStep = Callable[[int, dict[str, float]], None]  # (step, its metrics as logged); step 0: the first evaluation


def train_loop(g: Groups, plan: Plan, tracker: Tracker, display: Any, record: SessionRecord,
               resume: Resume | None = None, startup: Startup | None = None, on_step: OnStep | None = None,
               stop_event: threading.Event | None = None) -> RunResult:
    d, traces = plan.driver, plan.driver.tracking.log_trajectories
    on_step = on_step or (lambda step, metrics: None)
    done, before, watch = _begin(g, plan, tracker, display, resume, startup or Startup(), on_step)
    after, after_step, updates = before, 0, Updates(g, plan, synced=done, warn=display.warning)
    # the newest checkpoint: a resumed run's is the one it resumed from until it saves one (it may save none)
    checkpoint = str((resume.checkpoint_dir / resume.checkpoint).absolute()) if resume and resume.checkpoint else None
    tool_calls: dict[int, list[dict[str, Any]]] = {}  # step -> the tool calls its rollout and evaluation made
    saved_at = time.monotonic()  # train.checkpoint_every_s counts from here
    stop = GracefulStop(on_first=lambda what: display.status(stopping_said(what)), event=stop_event)
    if stop.requested:  # asked before the first step (in on_step(0), or while the stages started): none runs
        return RunResult(tracker.run_id, before, after, checkpoint, stopped=True, last_step=done)
    saved_step = done  # the step of the newest checkpoint (a resumed run's: the one it resumed from)
    replays = bool(d.replay.run) and d.replay.on_miss == "fail"
    with stop:
        for step in range(done + 1, d.train.steps + 1):
            t0 = time.perf_counter()
            drawn_from = g[plan.flow("data")[0].src].call("state") if replays else None  # the data before this step
            trajs, m, sampled = collect(g, plan, display, step)  # data -> rollout (<-> tools) -> reward
            try:
                tool_calls[step] = take_tool_calls(g, plan, step)  # a replay miss stops the run here
            except ReplayMiss as miss:  # the steps before it are kept: logged and saved, the data where it was before it
                keep_before(step, miss, updates, lambda n, t, m_n: _log_step(tracker, display, on_step, n, t,
                                                                          tool_calls.pop(n), m_n, traces),
                            None if saved_step == step - 1 else lambda: _save(g, plan, tracker, step - 1, watch,
                                                                                 data=drawn_from))
            m["train/infra_failed_share"] = check_infra(trajs, d.train.max_infra_error_rate, step)
            m.update(watch.observe(step, _trainable(sampled, d), _trainable(trajs, d)))  # hacking monitors
            updates.submit(step, trajs, m, t0)                # advantages + DeepSpeed update, then its weights
            # read once here, and once more below; a stop_on monitor stops after this step
            stopping = stop.requested or watch.halt is not None
            evaluating = _due(step, d.train.eval_every, d.train.steps)
            saving = (stopping or _due(step, d.train.checkpoint_every, d.train.steps)
                      or time.monotonic() - saved_at >= d.train.checkpoint_every_s)
            for drain in (evaluating or saving, True):  # a second pass only for a stop asked during the first
                for n, trajs_n, m_n in updates.finish(drain=drain):  # its weights -> every rollout replica
                    if n == step and evaluating:
                        (after, eval_trajs), after_step = evaluate(g, plan, display, step), step
                        try:
                            tool_calls[n] += take_tool_calls(g, plan, step, evaluation=True)
                        except ReplayMiss as miss:  # the step itself trained as recorded: kept (logged without
                            # its evaluation, saved), as a miss in a rollout keeps the steps before it
                            _log_step(tracker, display, on_step, n, trajs_n, tool_calls.pop(n), m_n, traces)
                            if saved_step != step:
                                _save(g, plan, tracker, step, watch)
                            raise ReplayMiss(f"{miss}; {_kept(step)}") from None
                        m_n.update(after)
                        m_n.update(watch.evaluated(step, after))  # the monitors again, with this evaluation
                        tracker.log_trajectories(eval_trajs, step, split="eval", traces=traces)
                    _log_step(tracker, display, on_step, n, trajs_n, tool_calls.pop(n), m_n, traces)
                if stopping or not (stop.requested or watch.halt is not None):
                    break
                # asked while steps were recorded (a stop set in on_step, a Ctrl-C; the monitors of the step's own
                # evaluation): the run ends after the step in flight, saved, not after one more step
                stopping = saving = True
            heed(watch, step, display, tracker)
            if saving:  # drained: the trainer holds this step's update, the data source is past its batch
                checkpoint, saved_at, saved_step = _save(g, plan, tracker, step, watch), time.monotonic(), step
            record.update()  # what this run has started, for the next run to end should this one be killed
            if stopping:
                break
    last = step if done < d.train.steps else done  # (a resumed run with no step left never enters the loop)
    checkpoint = checkpoint and str(Path(checkpoint).absolute())  # a fresh run's folder is the spec's, often relative
    # a stop asked once every step was done stops nothing: the run is complete (FINISHED, exit 0), and a
    # resume would have no step left to run
    return RunResult(tracker.run_id, before, after, checkpoint, stopped=stop.requested and last < d.train.steps,
                     halted=watch.halt, after_step=after_step, last_step=last)


def _begin(g: Groups, plan: Plan, tracker: Tracker, display: Any, resume: Resume | None, startup: Startup,
           on_step: OnStep) -> tuple[int, dict[str, float], Watch]:
    """Before the first step: a resumed run's state restored, the start-up's timings logged, and step 0's
    evaluation (a resumed run's own, as it logged it) with the monitors' history. (steps done, step 0's
    metrics, the monitors)."""
    d, done = plan.driver, 0
    if resume:
        done = restore(g, plan, resume)
        from factory.runtime.resume import record_spec_change

        record_spec_change(tracker, resume, plan)
        startup.lap("restore")
    # The first rollout request goes out next (the evaluation's, or step 1's): logged now, whatever follows,
    # at the first step this session logs (step 0; a resumed one's, the step after the run's last logged).
    started = startup.finish()
    first = resume.startup_step(d.train.steps) if resume else 0
    if first is not None:
        tracker.log_metrics(started, step=first)
    display.status(startup.describe())
    if done:
        before = resume.before  # its step-0 evaluation, as the run logged it
    else:
        before, eval_trajs = evaluate(g, plan, display, 0)
        tracker.log_trajectories(eval_trajs, 0, split="eval", traces=d.tracking.log_trajectories)
        tracker.log_tool_calls(take_tool_calls(g, plan, 0, evaluation=True), 0)
        tracker.log_metrics(before, step=0)
        display.step(0, before, completed=0)
        on_step(0, before)
    watch = Watch(d.watch, d.train.monitors, d.train.stop_on)  # the reward-hacking monitors (factory.monitors)
    if resume and resume.watch is not None:
        watch.restore(resume.watch)  # the history up to the checkpoint, step 0's evaluation included
    else:
        watch.evaluated(0, before)
    return done, before, watch


def _log_step(tracker: Tracker, display: Any, on_step: OnStep, n: int, trajs: list[Trajectory],
              tool_calls: list[dict[str, Any]], m: dict[str, float], traces: Any) -> None:
    """Step n's record: the tables first, the metrics last -- a step with metrics is a step with its tables (a
    run killed between them computes the step again on --resume, and logs the tables again, under the same
    names, and its traces again once the resumed tracker deleted the killed driver's: MlflowTracker.
    _delete_traces) -- and both before its checkpoint: a checkpointed step is a logged one."""
    from factory.reward.graph import failing_everywhere

    tracker.log_trajectories(trajs, n, traces=traces)  # the table keeps all: `factory rescore` reads it
    tracker.log_tool_calls(tool_calls, n)  # the calls step n made (tracking.record_tools)
    tracker.log_metrics(m, step=n)
    display.step(n, m, failing=failing_everywhere(trajs), trajectories=len(trajs))
    on_step(n, m)


def keep_before(step: int, miss: ReplayMiss, updates: Any, log: Callable[[int, list[Trajectory], dict[str, float]], None],
                save: Callable[[], Any] | None) -> None:
    """A replay that missed at `step`'s rollout stops the run before that step trains; the steps before it are
    kept: the updates in flight finished and logged (`log`), the last one saved (`save`, None when it is), and
    the miss raised again saying so (they were lost: no checkpoint, nothing to resume or export)."""
    for n, trajs, m in updates.finish(drain=True):
        log(n, trajs, m)
    if save is not None and step > 1:
        save()
    raise ReplayMiss(f"{miss}; {_kept(step - 1)}" if step > 1 else str(miss)) from None


def _kept(last: int) -> str:
    """What a replay miss after step `last` kept."""
    return f"{'step 1 is' if last == 1 else f'steps 1-{last} are'} logged and checkpointed"


def _save(g: Groups, plan: Plan, tracker: Tracker, step: int, watch: Watch, data: dict[str, Any] | None = None) -> str:
    """A checkpoint after `step` (drained: the trainer holds its update, the data source is past its batch),
    with what --resume needs besides the trainer's state: the run, the data source's place (`data`: the one
    given, where it drew a later step's batch since), the monitors."""
    data = data if data is not None else g[plan.flow("data")[0].src].call("state")
    state = {"run_id": tracker.run_id, "data": data, "watch": watch.state()}
    tracker.flush_traces()  # a checkpointed step is never computed again: its traces go in before it is written
    try:
        checkpoint = g[plan.flow("data")[-1].dst].call("save_checkpoint", tracker.checkpoint_dir, step, state)
    except Exception as e:  # noqa: BLE001 -- the disk's fault is said as such; anything else as it is
        if (why := write_problem(e, tracker.checkpoint_dir)) is None:
            raise
        raise CheckpointWriteError(f"could not save step {step}'s checkpoint: {why}; the checkpoints before it are "
                                   "whole: make room, then `factory run SPEC --resume` continues from the newest "
                                   "one") from None
    tracker.log_checkpoint(step, checkpoint)
    return checkpoint


def take_tool_calls(g: Groups, plan: Plan, step: int, *, evaluation: bool = False) -> list[dict[str, Any]]:
    """The tool calls recorded since the last take (the rows of `step`'s rollout, or of its evaluation, taken
    right after it: its `tool_calls` table). A replay that could not answer some of them stops the run here
    under `replay.on_miss: fail` (factory.tools.recording), before the step is checked or trained on the
    errors the misses answered."""
    rows: list[dict[str, Any]] = []
    for group in (x for x in g.values() if x.contract.records_tools):
        taken = group.call("take_recording")
        rows += taken["rows"]
        if taken["misses"] and plan.driver.replay.on_miss == "fail":
            why = why_missed(replayed_in(plan), step, steps=plan.driver.train.steps, evaluation=evaluation)
            raise miss_error(taken["misses"], f"step {step}" + (" evaluation" if evaluation else ""),
                             plan.driver.replay.run, why)
    return rows


def heed(watch: Watch, step: int, display: Any, tracker: Tracker) -> None:
    """A monitor that fired for the first time: one warning line, and a tag on the run naming the step
    (`factory runs` and `factory diff` show them); a stop_on monitor's, the tag of what stopped the run."""
    for name, reading in watch.new:
        display.status(f"warning: monitor {name} fired at step {step}: {reading.why}")
        tracker.log_tags({f"factory.monitor.{name}": str(step)})
    if watch.halted_at == step:
        tracker.log_tags({STOPPED_BY_TAG: watch.halt[:5000], HALTED_BY_TAG: watch.halted_by})


def _doing(context: dict[str, Any]) -> str:
    """What a call is for, from the context it carries: "step 3", "step 3, attempt 1", "step 0" (the first
    evaluation: a hang there said no step at all)."""
    parts = [f"step {context['step']}"] if "step" in context else []
    return ", ".join(parts + ([f"attempt {context['attempt']}"] if context.get("attempt") else []))


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def run(plan: Plan, resume: Resume | None = None, started_at: float | None = None, *, on_step: OnStep | None = None,
        stop: threading.Event | None = None) -> RunResult:
    """Run a compiled plan end to end (or continue the run `resume` names, see factory.runtime.resume); returns the
    MLflow run id and before/after eval metrics. `started_at` (epoch seconds): when the command started,
    for the time to first step (`timing/startup_s`); default now. `on_step(step, metrics)` hears each step's
    metrics as they are logged (step 0: the first evaluation); `stop`, set by any thread, ends the run after
    the step in flight as Ctrl-C does (logged, checkpointed, the MLflow run KILLED). Any thread may call it."""
    from factory.runtime.display import Display
    from factory.tracking.mlflow_tracker import STARTED_TAG
    from factory.tracking.tracker import open_tracker

    startup = Startup(started_at)
    startup.lap("command")
    d = plan.driver
    display = Display(d.train.steps, turn_credit=d.turn_gamma is not None)
    tracker = open_tracker(d.tracking.uri, d.tracking.experiment)
    tracker.notify = display.status  # hears when the store stops and starts answering (the spool)
    uri = tracker.uri
    if resume and resume.complete:
        return end_done(plan, resume, tracker, display, startup)
    replayed = recorded_tool_calls(tracker, plan)  # before the store is prepared in a thread, and anything placed
    # the stages and the loop both get the plan with its recording (the loop reads how far it went: replay is
    # no part of the plan hash, nor of the plan logged)
    plan = replaying(plan, replayed)
    prepared = prepare_in_background(tracker)
    startup.lap("store")  # (left for placed()'s first lap, it was counted as starting Ray)

    def start(listing: dict[str, Any], resolved: dict[str, Any]) -> Plan:
        prepared.join()
        if resume:
            return tracker.resume(resume, plan, listing, started=startup.t0, resolved=resolved)
        placement = json.dumps(placement_record(groups), indent=2, sort_keys=True, default=str) + "\n"
        # the command's start: `factory runs` counts the run's duration from it, as the summary below does
        return tracker.start_run(plan, listing, {"resolved": resolved}, {"placement.json": placement},
                                 {STARTED_TAG: f"{startup.t0:.3f}"})

    try:
        with display, placed(plan, display, startup) as (groups, record):
            with opened_run(tracker, plan, groups, display, start, replayed) as opened:
                startup.lap("tracking")
                display.status((f"MLflow run {tracker.run_id} resumed at step {resume.step + 1}" if resume.checkpoint
                                else f"MLflow run {tracker.run_id} resumed from the start") if resume else
                               f"MLflow run {tracker.run_id}")  # (step 0's line says whether it evaluated)
                result = train_loop(groups, opened.plan, tracker, display, record, resume, startup, on_step, stop)
                opened.status = result.status
    finally:
        # the stages torn down and Ray stopped (`placed`): only now may another process's --resume take the run (a
        # process that lives on, a notebook kernel, held it against every other while it lived)
        tracker.released()
    display.summary(result, experiment=d.tracking.experiment, experiment_id=tracker.experiment_id, uri=uri,
                    wall_s=time.time() - startup.t0, run_s=whole_run_s(tracker) if resume else None)
    return result


def end_done(plan: Plan, resume: Resume, tracker: Tracker, display: Any, startup: Startup) -> RunResult:
    """A resume of a run whose every step is done (`Resume.complete`: its driver killed after its last checkpoint,
    before it ended the run, or with records it could not send): what waits in its spool is sent and the run is
    marked FINISHED. No stage is placed: Ray and every stage started (30-60 s, and the run's devices) only to
    train nothing."""
    end_leftovers(display)  # (its driver, SIGKILLed after the last checkpoint, is the very case)
    status = "FAILED"  # (the reopen raised: the store refused, say)
    try:
        tracker.resume(resume, plan, {}, started=startup.t0)  # sends what waits in the spool
        display.status(f"run {tracker.run_id} had done every step: no stage started (nothing to train); it ends "
                       "FINISHED")  # (the end says so where the store does not take it)
        status = "FINISHED"
    finally:
        tracker.end(status)  # never raises by itself
        tracker.released()
    checkpoint = str((resume.checkpoint_dir / resume.checkpoint).absolute()) if resume.checkpoint else None
    result = RunResult(tracker.run_id, resume.before, resume.before, checkpoint, last_step=resume.step)
    d = plan.driver
    display.summary(result, experiment=d.tracking.experiment, experiment_id=tracker.experiment_id, uri=tracker.uri,
                    wall_s=time.time() - startup.t0, run_s=whole_run_s(tracker))
    return result


def whole_run_s(tracker: Tracker) -> float | None:
    """A resumed run's time over all its sessions, as `factory runs` counts it (less the time it had no
    driver); None when the store cannot say it now (its records still spooled)."""
    from factory.tracking.runs import run_summary

    try:
        return run_summary(tracker.run(tracker.run_id))["duration_s"]
    except Exception:  # noqa: BLE001 -- the summary says this session's time alone
        return None


def prepare_in_background(tracker: Tracker) -> threading.Thread:
    """The store opened (a new sqlite store's tables created, the experiment found or made) in a thread,
    while Ray and the stages start: ~1-2 s off the time to the first step. Join it before the run starts."""
    thread = threading.Thread(target=tracker.prepare, name="factory-tracker-prepare", daemon=True)
    thread.start()
    return thread


def end_leftovers(display: Any) -> None:
    """End what killed drivers left (their Ray, engines, tool servers), saying so: every `factory run` does,
    first (docs/reliability.md)."""
    if ended := reap_orphans():
        display.status(f"ended what a killed run left behind: {', '.join(ended)}")


@contextlib.contextmanager
def placed(plan: Plan, display: Any, startup: Startup, *,
           again: str = RESUME_SAID) -> Iterator[tuple[Groups, SessionRecord]]:
    """The plan's stages placed on Ray (a Ray of our own, or the cluster's), set up and ready; whatever
    happens inside, every stage is closed, Ray shut down and this driver's session record dropped after. A stage
    lost meanwhile is a StageLostError (`lost_error`), one that hangs a StageTimeout, each ending with `again`: how
    the user takes the work up."""
    refuse_a_ray_up("the run")  # (not ours: never shut down below)
    # First, so that a model build does not share the machine with a killed run's engines; timed as the `ray`
    # phase (what a killed run left is its Ray above all, and ending it, up to 10 s, is no model building)
    end_leftovers(display)
    startup.lap("ray")
    build_models(plan, display.status)
    startup.lap("models")
    display.status("starting Ray")
    sigterm_heard.clear()  # (this run's: a notebook's earlier run may have heard one)
    record = SessionRecord()  # (before Ray: the processes the caller runs already are not the run's)
    with sigterm_restored():  # (Ray's handler, then ours: the run's only)
        try:
            start_ray(plan.driver.resources)
        except BaseException:  # a Ctrl-C heard while Ray started (children_ignore_sigint): it stops at once
            stop_ray()  # (ours, partly started: a Ray up before was refused above)
            raise
        startup.lap("ray")
        record.update()
        groups: Groups = {}
        try:
            stages = ", ".join(s.name + (f" x{s.replicas}" if s.replicas > 1 else "") for s in plan.stages)
            display.status(f"starting the stages: {stages}")
            deadlines = Deadlines(plan.driver.train.stage_timeout_s, again=again)
            groups = place(plan, display.status, deadlines, startup.stage_ready, record=record.update)
            startup.lap("stages")
            record.update()
            try:
                yield groups, record
            except LOST as e:
                raise lost_error(e, again) from e
        finally:  # (nested: a Ctrl-C in teardown's wait of up to 30 s still shuts Ray down and drops the record)
            try:
                teardown(groups)
            finally:
                try:
                    stop_ray(plan.driver.resources.ray_address, display.status)
                finally:
                    record.close()


# What Ray raises when a stage's process, its node or the cluster itself went away (a replica killed or out
# of memory, a node or the head stopped): an infrastructure failure that `--resume` continues from.
LOST = (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError, ray.exceptions.ObjectLostError,
        ray.exceptions.WorkerCrashedError, ray.exceptions.LocalRayletDiedError, ray.exceptions.RaySystemError)


def lost_error(e: BaseException, again: str = RESUME_SAID) -> StageLostError:
    """`e` (one of LOST) as one line: what went away, and `again`: how the work is taken up (a run's: that
    `factory run SPEC --resume` continues it from its newest checkpoint; an evaluation or a rescore: run again)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e).strip())  # Ray colours its names
    said = (text.splitlines() or [""])[0][:300]
    if (actor := re.search(r"class_name: (\w+)", text)) and actor.group(1) not in said:  # which stage's process
        said += f" (the {actor.group(1)} actor)"
    if "RewardStage" in text:  # the process that runs the spec's own reward code: what ends one there, likely
        said += ("; a reward function runs in that process: one that ends it (os._exit, a crash in C code, memory "
                 "past the machine's) ends it again when the step is scored again")
    why = ("" if not sigterm_heard.is_set() else
           "; SIGTERM reached Ray's processes as well as the driver (a signal to every process of a job, as "
           "SLURM's time limit or systemd's stop send; a signal to the driver alone, `kill PID`, or to its process "
           "group, `timeout`, stops it after the step)" if ray_in_own_sessions.is_set() else
           "; SIGTERM reached Ray's processes as well as the driver (a signal to its whole process group, as plain "
           "`timeout` sends; `timeout --foreground` or `kill PID` signal the driver alone, which then stops after "
           "the step)")
    return StageLostError(f"a stage's process or the Ray cluster went away mid-run ({type(e).__name__}: {said})"
                          f"{why}; {again}, on this cluster once it is back or on another")


def eval_stages(plan: Plan) -> Plan:
    """The plan cut to what its eval flow reaches: the stages along it (up to, not into, the trainer) and
    every stage they call, with the edges among them (no trainer, no weight sync)."""
    keep = {s for e in plan.flow("eval")[:-1] for s in (e.src, e.dst)}
    calls = [e for e in plan.edges if e.kind == "call"]
    while grown := {e.dst for e in calls if e.src in keep} - keep:
        keep |= grown
    return dataclasses.replace(plan, stages=tuple(s for s in plan.stages if s.name in keep),
                               edges=tuple(e for e in plan.edges if e.src in keep and e.dst in keep))


@dataclass
class OpenedRun:
    plan: Plan  # with the tool schemas the started servers offer hashed in (tracker.start_run)
    status: str = "FINISHED"  # what the tracked run ends as, unless the block raises


@contextlib.contextmanager
def opened_run(tracker: Tracker, plan: Plan, groups: Groups, display: Any,
               start: Callable[[dict[str, Any], dict[str, Any]], Plan],
               replayed: Replayed | None) -> Iterator[OpenedRun]:
    """The tracked run of the placed `groups`, for `factory run` and `factory eval` alike (`replayed`: the
    recording the stages were placed with, `factory.runtime.replay`; None: no replay): `start(tool listing,
    what each stage resolved)` opens it. It ends with the block: FAILED
    when it raised, KILLED on Ctrl-C, else the status the block set."""
    from factory.compiler.compile import shared_tools

    status = "FAILED"
    try:
        listing = next((g.call("tool_listing") for g in groups.values() if g.contract.lists_tools), {})
        for _, said in shared_tools({server: [t["name"] for t in tools] for server, tools in listing.items()}):
            display.warning(said)  # `factory check --connect` says it too; a run compiles without the listing
        # what each stage chose on its device (engine, dtypes), as its replica 0 reported it
        resolved = {name: g.info[0]["resolved"] for name, g in groups.items() if "resolved" in g.info[0]}
        display.context = resolved.get("rollout", {}).get("max_model_len")
        for said in auto_unused(groups, resolved):
            display.warning(said)
        if replayed is not None:
            alone = replayed.on_miss == "fail" and replayed.listing is not None  # (factory.tools.recording)
            display.status(f"tool calls answered from run {replayed.run}'s recording (replay.on_miss: "
                           f"{replayed.on_miss}{'; no tool server started' if alone else ''})")
        opened = OpenedRun(start(listing, resolved))
        yield opened
        status = opened.status
    except KeyboardInterrupt as e:
        status = "KILLED"  # MLflow's word for a run stopped by its user
        e.run_id = tracker.run_id  # type: ignore[attr-defined]  # (the command says how to resume it, if any)
        raise
    finally:
        tracker.end(status)  # never raises by itself; the teardown follows (`placed`)


def auto_unused(groups: Groups, resolved: dict[str, Any]) -> list[str]:
    """The vLLM-only rollout settings a spec wrote that `engine: auto` made moot by taking transformers on
    this machine (`factory check` cannot know its choice; it says so for an explicit `engine: hf`)."""
    from factory.compiler.settings import vllm_only

    said = []
    for name, chose in resolved.items():
        rollout = getattr(groups[name].stage.settings, "rollout", None)
        if chose.get("engine") == "hf" and rollout is not None and rollout.engine == "auto":
            why = chose.get("engine_reason") or chose.get("engine_fallback") or "its rule"
            said += [f"rollout.{field}: has no effect: engine auto took transformers here ({why}); only vLLM reads it"
                     for field in vllm_only(rollout)]
    return said


@dataclass
class EvalResult:
    run_id: str
    step: int  # the step the metrics are logged at (the evaluated checkpoint's)
    metrics: dict[str, float]  # eval/<metric>, as a training run logs them at its evaluations


def evaluate_only(plan: Plan, step: int = 0, tags: dict[str, str] | None = None,
                  started_at: float | None = None, adapters: str | None = None) -> EvalResult:
    """Score the plan's model on its eval split with its reward graph, without training: the stages the eval
    flow reaches are placed, `evaluate` (the driver's own evaluation, as a training run's step-`step`
    evaluation) runs once, and the metrics and trajectories are logged as an MLflow run of the plan,
    tagged `factory.kind=eval` and `tags`, which `factory diff` compares with a training run. `started_at`
    (epoch seconds): when the command started (its duration counts from it, as a training run's); default now.
    `adapters`: a LoRA checkpoint's peft folder, which every stage the run's weights sync to (its rollout) adds
    beside the plan's model before evaluating, as the run's syncs did."""
    from factory.runtime.display import Display
    from factory.tracking.mlflow_tracker import STARTED_TAG
    from factory.tracking.tracker import open_tracker

    d, startup = plan.driver, Startup(started_at)
    display = Display(0)
    tracker = open_tracker(d.tracking.uri, d.tracking.experiment)
    tracker.notify = display.status
    replayed = recorded_tool_calls(tracker, plan)  # before the store is prepared in a thread, and anything placed
    # the recording in the plan the evaluation reads too, not only in its stages': a miss says how far it got
    plan = replaying(plan, replayed)
    prepared = prepare_in_background(tracker)

    def start(listing: dict[str, Any], resolved: dict[str, Any]) -> Plan:
        prepared.join()
        return tracker.start_run(plan, listing, {"resolved": resolved},
                                 extra_tags={"factory.kind": "eval", STARTED_TAG: f"{startup.t0:.3f}", **(tags or {})})

    try:
        with display, placed(eval_stages(plan), display, startup,
                             again="`factory eval` again evaluates it") as (groups, _):
            with opened_run(tracker, plan, groups, display, start, replayed) as opened:
                if adapters is not None:
                    for e in plan.edges:
                        if e.kind == "weight_sync":
                            groups[e.dst].call("load_adapters", adapters)
                display.status(f"MLflow run {tracker.run_id}; evaluating")
                metrics, trajs = evaluate(groups, opened.plan, display, step)
                tracker.log_trajectories(trajs, step, split="eval", traces=d.tracking.log_trajectories)
                tracker.log_tool_calls(take_tool_calls(groups, opened.plan, step, evaluation=True), step)
                tracker.log_metrics(metrics, step=step)
    finally:
        # as after a run: what preparing the store set (MLflow's fail-fast HTTP settings) put back, also where the
        # stages never started and no run was opened to end
        tracker.released()
    shown = "  ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items()))
    display.console.print(f"{shown}\nMLflow run {tracker.run_id} in experiment '{d.tracking.experiment}' "
                          f"({tracker.uri}), {time.time() - startup.t0:.0f} s", markup=False)
    return EvalResult(tracker.run_id, step, metrics)


def build_models(plan: Plan, status: Callable[[str], None]) -> None:
    """Build the built-in models the stages will load (first use only) here, once, before Ray starts,
    rather than in whichever stage's setup comes first."""
    from factory.assets import is_built, resolve_model

    for path in sorted({path for s in plan.stages for path in s.settings.models()}):
        if not is_built(path):
            status(f"building the model {path} into the cache (first use only)")
            resolve_model(path)
