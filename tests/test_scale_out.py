"""Scaling out on one machine (docs/scale.md, as a walkthrough tried it): joining a cluster that uses token
authentication, placement that cannot succeed, and a cluster that goes away mid-run."""
from __future__ import annotations

import os

import pytest

from factory.compiler.compile import compile_file
from factory.util import UserError
from tests.test_settings import _spec


def test_a_join_that_fails_says_how_to_join_a_cluster_with_token_authentication(monkeypatch):
    """`ray start --head` (Ray 2.60) takes token authentication where ~/.ray/auth_token exists; joining it
    said only 'ConnectionError: Failed to connect to Ray cluster at ...' (the docs' recipe, as written)."""
    from factory.plan import ClusterSettings
    from factory.runtime import driver
    from factory.runtime.health import RayStartError
    from factory.runtime.lifecycle import sigterm_restored

    def refused(cluster):
        raise ConnectionError("Failed to connect to Ray cluster at 192.0.2.2:1")

    monkeypatch.setattr(driver, "_start_ray", refused)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with sigterm_restored(), pytest.raises(RayStartError, match=r"^could not join the Ray cluster at 127\.0\.0\.1:1: ConnectionError: "
                                            r"Failed to connect .*; if the cluster uses token authentication .*set "
                                            r"RAY_AUTH_MODE=token"):
        driver.start_ray(ClusterSettings(ray_address="127.0.0.1:1", object_store_gb=1.0))
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # a token was used: nothing to add
    with sigterm_restored(), pytest.raises(RayStartError, match=r"192\.0\.2\.2:1$"):
        driver.start_ray(ClusterSettings(ray_address="127.0.0.1:1", object_store_gb=1.0))
    with sigterm_restored(), pytest.raises(RayStartError, match=r"^could not start a local Ray"):  # not a join: nothing to add
        driver.start_ray(ClusterSettings(ray_address=None, object_store_gb=1.0))


def test_joining_an_address_nothing_answers_on_fails_at_once_not_after_ray_s_retries(monkeypatch):
    """`resources.ray_address` (or $RAY_ADDRESS) naming a port nothing listens on: ray.init (2.60) retried its GCS
    client 20 times, each ~40 s (a 5 s connect, a 5 s pubsub connect, a 30 s wait for the cluster id), printing
    its own warnings: a typo in the address held `factory run` ~14 minutes. The address is tried first."""
    import time

    import ray

    from factory.plan import ClusterSettings
    from factory.runtime import driver
    from factory.runtime.health import RayStartError
    from factory.runtime.lifecycle import sigterm_restored
    from tests.servers import free_port

    def init(**kwargs):
        raise AssertionError("ray.init was reached")

    monkeypatch.setattr(ray, "init", init)
    port = free_port()
    t0 = time.monotonic()
    with sigterm_restored(), pytest.raises(RayStartError) as e:
        driver.start_ray(ClusterSettings(ray_address=f"127.0.0.1:{port}", object_store_gb=1.0))
    assert time.monotonic() - t0 < 5
    assert str(e.value) == (f"could not join the Ray cluster at 127.0.0.1:{port}: nothing answers there (connection "
                            "refused): start its head (`ray start --head --port=PORT`) or correct the address "
                            "(resources.ray_address, else $RAY_ADDRESS)")
    with sigterm_restored(), pytest.raises(RayStartError, match=r"at no-such-host\.invalid:6379: .*cannot be resolved"):
        driver.start_ray(ClusterSettings(ray_address="no-such-host.invalid:6379", object_store_gb=1.0))
    for address in ("auto", "ray://127.0.0.1:10001"):  # Ray's own forms: it reads a file, or is a Ray Client
        with sigterm_restored(), pytest.raises(RayStartError, match="ray.init was reached"):
            driver.start_ray(ClusterSettings(ray_address=address, object_store_gb=1.0))


def test_the_auth_variables_a_run_set_are_put_back_when_its_ray_stops(monkeypatch, tmp_path):
    """RAY_AUTH_MODE/RAY_AUTH_TOKEN, set for a local Ray (a fresh token) or a cluster join (auth off), stayed in
    the process's environment: in one notebook a local run after a cluster join started its Ray with no token,
    two local runs shared one, and a join after a local run sent that run's token. ray.init is a recorder here."""
    from factory.plan import ClusterSettings
    from factory.runtime import driver

    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    seen = []
    monkeypatch.setattr(driver.ray, "init", lambda *a, **k: seen.append((os.environ.get("RAY_AUTH_MODE"),
                                                                         os.environ.get("RAY_AUTH_TOKEN"))))
    monkeypatch.setattr(driver.ray, "shutdown", lambda: None)
    monkeypatch.setattr(driver, "check_ray_on_loopback", lambda: None)
    monkeypatch.setattr(driver, "private_dir", lambda: tmp_path)
    local = ClusterSettings(ray_address=None, object_store_gb=1.0)
    cluster = ClusterSettings(ray_address="ray://192.0.2.2:10001", object_store_gb=1.0)
    for settings in (cluster, local, local, cluster):
        driver._start_ray(settings)
        driver.stop_ray()
        assert "RAY_AUTH_MODE" not in os.environ and "RAY_AUTH_TOKEN" not in os.environ  # as before the run
    modes, tokens = zip(*seen)
    assert modes == ("disabled", "token", "token", "disabled")
    assert tokens[0] is None and tokens[3] is None and tokens[1] and tokens[2] and tokens[1] != tokens[2]
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the user's own: used, and left as it is
    driver._start_ray(local)
    driver.stop_ray()
    assert seen[-1] == ("disabled", None) and os.environ["RAY_AUTH_MODE"] == "disabled"


def test_what_starting_a_runs_ray_set_in_the_environment_is_put_back_when_it_stops(monkeypatch, tmp_path):
    """After factory.run returned, the caller's process kept what starting the run's Ray had set: ray.init's
    PYTHONBREAKPOINT hook (`breakpoint()` then asked for debugpy and returned: no pdb) and the stages' quiet
    settings (TRANSFORMERS_VERBOSITY=error, ...). One set since by someone else is theirs, left as it is; one the
    user had set before was never changed. ray.init sets here what the real one sets, while another thread of the
    run's puts MLflow's variable back (its tracker preparing the store): not Ray's to put back again."""
    from factory.plan import ClusterSettings
    from factory.runtime import driver
    from factory.runtime.lifecycle import sigterm_restored

    def init(*args, **kwargs):
        os.environ["PYTHONBREAKPOINT"] = "ray.util.rpdb._driver_set_trace"
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        del os.environ["MLFLOW_EXPERIMENT_ID"]  # (the tracker's use_store, in its thread, putting it back)

    monkeypatch.setattr(driver.ray, "init", init)
    monkeypatch.setattr(driver.ray, "shutdown", lambda: None)
    monkeypatch.setattr(driver, "check_ray_on_loopback", lambda: None)
    monkeypatch.setattr(driver, "private_dir", lambda: tmp_path)
    for key in ("PYTHONBREAKPOINT", "RAY_USAGE_STATS_ENABLED", "RAY_COLOR_PREFIX", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN",
                *driver._STAGE_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")  # the user's own
    before = dict(os.environ)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "1")  # set, for a moment, by the tracker's use_store
    with sigterm_restored():
        driver.start_ray(ClusterSettings(ray_address=None, object_store_gb=1.0))
    assert os.environ["PYTHONBREAKPOINT"] == "ray.util.rpdb._driver_set_trace"
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false" and os.environ["TRANSFORMERS_VERBOSITY"] == "info"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "0"  # the caller's, set while the run went on
    driver.stop_ray()
    assert os.environ.pop("HF_HUB_DISABLE_PROGRESS_BARS") == "0"
    assert dict(os.environ) == before


def test_a_start_cut_short_raises_its_own_error_where_its_processes_cannot_be_recorded(monkeypatch):
    """place()'s clean-up records what the stages started, then tears them down and raises the start's error; a
    record that could not be written (a full disk) raised its OSError instead, the user's Ctrl-C (or a
    PlacementError, a StageTimeout with how to resume) left only as its __context__."""
    from types import SimpleNamespace

    from factory.runtime import driver

    plan = SimpleNamespace(stages=[SimpleNamespace(name="rollout", resources={}, replicas=1)],
                           driver=SimpleNamespace(resources=SimpleNamespace(ray_address=None)))
    monkeypatch.setattr(driver.ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(driver, "object_store_bytes", lambda: 1.0)

    def interrupted(stage, status):
        raise KeyboardInterrupt  # Ctrl-C while the stage is placed

    def record():
        raise OSError(28, "No space left on device")

    torn, said = [], []
    monkeypatch.setattr(driver, "start_group", interrupted)
    monkeypatch.setattr(driver, "teardown", lambda groups, **k: torn.append(groups))
    with pytest.raises(KeyboardInterrupt):
        driver.place(plan, said.append, record=record)
    assert torn == [{}] and said[-1].startswith("warning: the processes the stages started could not be recorded "
                                                "([Errno 28] No space left on device)")


def test_leaving_a_cluster_whose_head_does_not_answer_says_so_and_goes_on(monkeypatch):
    """A joined cluster's head that stopped answering (frozen, not gone) held `factory run` in ray.shutdown after
    its last step, with no word and no deadline. The disconnect is waited for SHUTDOWN_WAIT_S, then the run says
    why it leaves without it, puts back what starting Ray set, and drops Ray's exit hook (which would wait on the
    shutdown in flight as the process exits). A local Ray's shutdown (its own processes) is waited for."""
    import threading
    import time

    from factory.runtime import driver

    answers = threading.Event()
    monkeypatch.setattr(driver.ray, "shutdown", lambda: answers.wait(30))
    monkeypatch.setattr(driver, "SHUTDOWN_WAIT_S", 0.2)
    unhooked, said = [], []
    monkeypatch.setattr(driver.atexit, "unregister", unhooked.append)
    monkeypatch.setattr(driver, "_restore_ray_env", lambda: said.append("restored"))
    monkeypatch.setattr(driver.lifecycle, "left_hanging", None)
    t0 = time.monotonic()
    try:
        driver.stop_ray("192.0.2.2:6379", said.append)
        assert time.monotonic() - t0 < 5
        assert said == ["the Ray head at 192.0.2.2:6379 does not answer; leaving without disconnecting", "restored"]
        assert unhooked == [driver.ray.shutdown]
        # the disconnect left running holds Ray's lock: the next run here would wait in ray.init for good
        with pytest.raises(UserError, match=r"^factory.run: the Ray head at 192.0.2.2:6379 did not answer .* "
                                            r"cannot start or join a Ray again; restart it"):
            driver.lifecycle.refuse_a_ray_up("factory.run")
    finally:
        answers.set()
    said.clear()
    driver.stop_ray("192.0.2.2:6379", said.append)  # one that answers: nothing to say
    assert said == ["restored"] and len(unhooked) == 1
    answers.clear()
    threading.Timer(0.5, answers.set).start()
    driver.stop_ray(None, said.append)  # ours: waited for
    assert answers.is_set() and said == ["restored", "restored"]

    def refused():
        raise ConnectionError("refused")

    monkeypatch.setattr(driver.ray, "shutdown", refused)  # what it raises, raised as before
    with pytest.raises(ConnectionError):
        driver.stop_ray("192.0.2.2:6379", said.append)


def test_a_reservation_the_cluster_cannot_hold_is_an_infrastructure_failure(monkeypatch):
    """It said 'internal error: RuntimeError' and exited 1."""
    import ray

    from factory.plan import Stage
    from factory.runtime import driver
    from factory.runtime.health import InfraFailure, PlacementError

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    stage = Stage.__new__(Stage)
    object.__setattr__(stage, "name", "rollout")
    object.__setattr__(stage, "resources", {"CPU": 8.0})
    object.__setattr__(stage, "replicas", 1)
    object.__setattr__(stage, "strategy", "PACK")
    with pytest.raises(PlacementError, match=r"stage 'rollout' needs 1 x \{'CPU': 8\.0\} but the Ray cluster has "
                                             r"\{'CPU': 2\.0\}"):
        driver._placement_group(stage)
    assert issubclass(PlacementError, InfraFailure)  # exit 3

    class NeverReady:  # room the run's other stages hold: the wait ends, naming only what the stage asks for
        def ready(self):
            return "ref"

    object.__setattr__(stage, "resources", {"CPU": 1.0})
    monkeypatch.setattr(driver, "PLACEMENT_TIMEOUT_S", 0)
    import sys

    monkeypatch.setattr(sys.modules["ray.util.placement_group"], "placement_group", lambda *a, **k: NeverReady())
    monkeypatch.setattr(ray, "wait", lambda refs, timeout: ([], refs))
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 0.0, "memory": 2.4e10, "bundle_group_0_ab": 999.9})
    with pytest.raises(PlacementError, match=r"^stage 'rollout': 1 x \{'CPU': 1\.0\} \(PACK\) found no room in 0 s; "
                                             r"free: \{'CPU': 0\.0\} of \{'CPU': 2\.0\} \(the run's other stages"):
        driver._placement_group(stage)


def test_a_stage_waiting_for_room_on_a_busy_cluster_says_so_once(monkeypatch):
    """A stage whose reservation other jobs held waited up to PLACEMENT_TIMEOUT_S (600 s) in one silent ray.wait:
    the run's last line stayed "starting the stages". It waits in slices, and after the first says, in one line,
    what it waits for, what is free now and until when."""
    import sys

    import ray

    from factory.plan import Stage
    from factory.runtime import driver

    stage = Stage.__new__(Stage)
    for key, value in (("name", "rollout"), ("resources", {"CPU": 1.0}), ("replicas", 1), ("strategy", "PACK")):
        object.__setattr__(stage, key, value)

    class Group:
        def ready(self):
            return "ready"

    waits, said = [], []
    pg = Group()
    monkeypatch.setattr(sys.modules["ray.util.placement_group"], "placement_group", lambda *a, **k: pg)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 4.0})
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 0.0, "memory": 2.4e10})
    monkeypatch.setattr(ray, "wait", lambda refs, timeout: (waits.append(timeout), ([], refs) if len(waits) < 4
                                                            else (refs, []))[1])
    monkeypatch.setattr(driver.time, "time", lambda: 1_000_000.0)
    assert driver._placement_group(stage, said.append) is pg
    assert waits == [5.0] * 4  # 600 s in 120 slices: ready in the fourth
    until = driver.time.strftime("%H:%M:%S", driver.time.localtime(1_000_000.0 + 595))
    assert said == [f"rollout waits for room on Ray: 1 x {{'CPU': 1.0}} (PACK); free now {{'CPU': 0.0}} of "
                    f"{{'CPU': 4.0}} (other jobs, or the run's other stages, hold the rest); it gives up at {until}"]


def test_a_joined_run_whose_stages_exceed_the_cluster_says_so_before_it_waits(monkeypatch):
    """A run's own Ray that cannot hold every stage at once is refused (room_problem); a joined cluster's was not
    looked at as a whole (each stage alone fit), so the stages placed last waited 600 s each without a word."""
    from types import SimpleNamespace

    import ray

    from factory.runtime import driver

    def stage(name, cpus):
        return SimpleNamespace(name=name, resources={"CPU": cpus}, replicas=1)

    plan = SimpleNamespace(stages=[stage("rollout", 2.0), stage("update", 2.0)],
                           driver=SimpleNamespace(resources=SimpleNamespace(ray_address="192.0.2.2:6379")))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 3.0})
    monkeypatch.setattr(driver, "object_store_bytes", lambda: 1.0)

    def start_group(stage, status):
        raise RuntimeError("placing")

    monkeypatch.setattr(driver, "start_group", start_group)
    monkeypatch.setattr(driver, "teardown", lambda groups, **k: None)  # (its ray.wait would start a local Ray)
    said = []
    with pytest.raises(RuntimeError, match="placing"):
        driver.place(plan, said.append)
    assert said == ["warning: the stages reserve 4 CPU in all (rollout 2, update 2; replicas counted) but the Ray "
                    "cluster at 192.0.2.2:6379 has 3, and each stage holds its share for the whole run: the stages "
                    "placed last wait for nodes to join, up to 600 s each (else reserve less: the spec's "
                    "`resources`)"]


def test_a_cluster_that_went_away_is_an_infrastructure_failure_that_says_resume(monkeypatch):
    """The head node killed during a step: 'internal error: ActorUnavailableError', exit 1, nothing about
    --resume."""
    import threading

    import ray

    from factory.runtime import driver, lifecycle
    from factory.runtime.driver import LOST, lost_error
    from factory.runtime.health import InfraFailure

    monkeypatch.setattr(lifecycle, "sigterm_heard", threading.Event())  # (the module's own, whatever ran before)
    monkeypatch.setattr(driver, "sigterm_heard", lifecycle.sigterm_heard)
    monkeypatch.setattr(lifecycle, "_sigterm_at", float("-inf"))  # (a SIGTERM within ECHO_S would be its echo)
    monkeypatch.setattr(driver, "ray_in_own_sessions", threading.Event())
    monkeypatch.setattr(lifecycle, "ray_in_own_sessions", driver.ray_in_own_sessions)
    e = ray.exceptions.ActorUnavailableError("The actor abc is unavailable: RpcError: Socket closed", b"\0" * 16)
    assert isinstance(e, LOST)
    said = lost_error(e)
    assert isinstance(said, InfraFailure)
    assert str(said).startswith("a stage's process or the Ray cluster went away mid-run (ActorUnavailableError: ")
    assert "factory run SPEC --resume" in str(said) and "SIGTERM" not in str(said)
    # an evaluation or a rescore cannot be resumed: its loss says to run it again (it said --resume)
    again = str(lost_error(e, "`factory rescore` again rescores the run"))
    assert again.endswith("; `factory rescore` again rescores the run, on this cluster once it is back or on another")
    with pytest.raises(KeyboardInterrupt):  # the driver heard SIGTERM (`timeout` signals the whole group)
        lifecycle._interrupt(15, None)
    # Ray's processes in the driver's group (a Ray whose start Factory could not move out of it): plain `timeout`
    assert "SIGTERM reached Ray's processes as well as the driver (a signal to its whole process group, as plain " \
           "`timeout` sends" in str(lost_error(e))
    driver.ray_in_own_sessions.set()  # in sessions of their own: what still reaches them is a job's signal
    assert "SIGTERM reached Ray's processes as well as the driver (a signal to every process of a job, as SLURM's " \
           "time limit" in str(lost_error(e))
    coloured = ray.exceptions.ActorUnavailableError("\x1b[36mray::RolloutStage.load_weights()\x1b[39m", b"\0" * 16)
    assert "ray::RolloutStage.load_weights()" in str(lost_error(coloured)) and "\x1b" not in str(lost_error(coloured))
    # a stage whose process ended (a reward function that called os._exit): which stage, from Ray's later lines
    died = ray.exceptions.ActorUnavailableError("The actor died unexpectedly before finishing this task.\n"
                                                "\tclass_name: RewardStage\n\tactor_id: 7f", b"\0" * 16)
    assert ("this task. (the RewardStage actor); a reward function runs in that process: one that ends it (os._exit, "
            "a crash in C code, memory past the machine's) ends it again when the step is scored again)") in str(lost_error(died))


def test_what_a_local_ray_cannot_hold_is_said_before_a_run(project, monkeypatch):
    """Custom resources and STRICT_SPREAD on a local Ray, and the stages' CPUs together past the machine's:
    `factory check` said ok; the run then stopped at placement, or waited there 10 minutes in silence."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    path = _spec(project, "sw_room", "resources:\n  rollout: {replicas: 2, num_cpus: 1, strategy: STRICT_SPREAD}\n"
                                     "  update: {num_cpus: 1}\n  reward: {custom: {node_b: 1}}\n")
    _, plan = compile_file(path)
    said = "\n".join(plan.warnings)
    assert "resources.reward.custom: warning: custom resource 'node_b' exists only on a Ray cluster" in said
    assert "resources.rollout.strategy: warning: STRICT_SPREAD puts each of the 2 replicas on its own node" in said
    assert ("resources.update.num_cpus: warning: the stages reserve 3 CPUs in all (resources.rollout.num_cpus 2, "
            "resources.update.num_cpus 1, replicas counted) but a local Ray has 2") in said
    _, joined = compile_file(path, ["resources.ray_address=127.0.0.1:1"])  # a cluster's nodes decide
    assert not [w for w in joined.warnings if "local Ray" in w]


def test_stages_that_a_local_ray_cannot_hold_together_fail_at_once():
    """Each stage fitted alone, so the last one placed waited 600 s for room the run's own stages held
    before PlacementError; on the run's own local Ray that room never frees: said before placing."""
    from factory.plan import Stage
    from factory.runtime.driver import room_problem

    def stage(name, resources, replicas=1):
        s = Stage.__new__(Stage)
        for key, value in (("name", name), ("resources", resources), ("replicas", replicas)):
            object.__setattr__(s, key, value)
        return s

    stages = [stage("data", {}), stage("rollout", {"CPU": 1.0}, 2), stage("update", {"CPU": 1.0, "GPU": 0.0})]
    assert room_problem(stages, {"CPU": 3.0}) is None
    assert room_problem(stages, {"CPU": 2.0}) == (
        "the stages reserve 3 CPU in all (rollout 2, update 1; replicas counted) but the run's own local Ray has 2, "
        "and each stage holds its share for the whole run: reserve less (the spec's `resources`), or join a Ray "
        "cluster that has room (resources.ray_address or $RAY_ADDRESS)")
    assert "reserve 0.5 judge_slot in all" in room_problem([stage("judge", {"judge_slot": 0.5})], {"CPU": 2.0})


class _Visible:
    def cuda(self) -> str | None:
        return os.environ.get("CUDA_VISIBLE_DEVICES")


def test_a_stage_that_reserved_no_gpu_sees_none(local_ray):
    """Ray 2.60 left an actor with num_gpus=0 every GPU of its machine (CUDA_VISIBLE_DEVICES untouched): on a GPU
    machine a CPU stage's vLLM computed on a GPU nobody had reserved. Every Ray process of a run starts with
    the environment the driver gives them (factory.runtime.driver._STAGE_ENV), which hides them again."""
    import ray

    from factory.runtime.driver import _STAGE_ENV

    actor = ray.remote(_Visible).options(num_cpus=0, num_gpus=0, runtime_env={"env_vars": _STAGE_ENV}).remote()
    try:
        assert ray.get(actor.cuda.remote(), timeout=120) == ""
    finally:
        ray.kill(actor)
