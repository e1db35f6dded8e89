"""The driver's loop (train_loop) in the order it calls its stages, with the stages, the trainer's updates and
the tracker replaced by fakes that note what they were asked: no Ray, no model, milliseconds. What a real run
adds (the stages themselves): tests/test_tools_recording.py (slow), tests/test_e2e.py."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import factory
from factory.compiler.compile import plan_json
from factory.contract import Contract
from factory.plan import Replayed
from factory.runtime import driver
from factory.runtime.resume import Resume
from factory.tools.recording import ReplayMiss
from factory.tracking.mlflow_tracker import TOOLS_IN_SERVER_ORDER
from factory.types import Trajectory

REPO = Path(__file__).resolve().parents[1]


@dataclass
class World:
    """What the fakes were asked, in order."""

    made: list[str] = field(default_factory=list)  # tool calls made since the last take (their origins)
    misses: list[str] = field(default_factory=list)
    submitted: list[int] = field(default_factory=list)  # the steps handed to the trainer
    tables: dict[int, list[str]] = field(default_factory=dict)  # step -> its tool_calls table's origins
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    eval_metric: list[float] = field(default_factory=list)  # what each evaluation returns, in turn
    miss_at: int | None = None  # the step whose rollout a replay cannot answer
    eval_miss_at: int | None = None  # the step whose evaluation a replay cannot answer
    rewards: list[float] = field(default_factory=list)  # each step's reward/mean, in turn
    replayed: Any = None  # the recording the tools stage was placed with (its settings' `replay`)
    ended: list[str] = field(default_factory=list)  # the tracked run's end status
    listing: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # the tools stage's tool_listing
    saved: list[tuple[int, Any]] = field(default_factory=list)  # (step, the data's place) of each checkpoint
    drawn: int = 0  # the steps' batches drawn (collected)
    texts: list[str] = field(default_factory=list)  # the names of the text artifacts logged, in order
    tags: dict[str, str] = field(default_factory=dict)  # the tags logged
    restore_error: str | None = None  # a resumed run's checkpoint fails to load, saying this


class FakeGroup:
    def __init__(self, world: World, contract: Contract):
        self.world, self.contract, self.info = world, contract, [{}]

    def call(self, method: str, *args: Any) -> Any:
        if method == "take_recording":
            taken = {"rows": [{"origin": o} for o in self.world.made], "misses": self.world.misses}
            self.world.made, self.world.misses = [], []
            return taken
        if method == "save_checkpoint":
            self.world.saved.append((args[1], args[2]["data"]))
        if method == "state":  # the data source's place: the batches drawn
            return {"drawn": self.world.drawn}
        return {"save_checkpoint": "step_x", "tool_listing": self.world.listing}[method]


class FakeUpdates:
    """driver.Updates' order without a trainer: a step finishes once more than max_staleness are in flight."""

    def __init__(self, world: World, g: Any, plan: Any, synced: int):
        self.world, self.k, self.pending = world, plan.driver.train.max_staleness, []

    def submit(self, step: int, trajs: list[Any], m: dict[str, float], t0: float) -> None:
        self.world.submitted.append(step)
        self.pending.append((step, trajs, m))

    def finish(self, drain: bool) -> list[tuple[int, list[Any], dict[str, float]]]:
        done = []
        while self.pending and (drain or len(self.pending) > self.k):
            done.append(self.pending.pop(0))
        return done


class FakeTracker:
    run_id, checkpoint_dir, logged, uri = "r", "/nonexistent", 0, "sqlite:///nowhere.db"

    def __init__(self, world: World):
        self.world = world

    def log_tool_calls(self, rows: list[dict[str, Any]], step: int) -> None:
        assert step not in self.world.tables  # one table per step (a second would replace the first)
        self.world.tables[step] = [r["origin"] for r in rows]

    def log_metrics(self, m: dict[str, float], step: int) -> None:
        self.world.metrics.setdefault(step, {}).update(m)

    def run(self, ref: str) -> Any:
        return type("Run", (), {"run_id": f"{ref}-id", "name": ref, "tags": {TOOLS_IN_SERVER_ORDER: "true"}})()

    def tool_calls(self, run_id: str) -> list[dict[str, Any]]:
        return [{"origin": "eval/0/0/0/0/0/0", "from": run_id}]

    def artifacts(self, run_id: str, folder: str = "") -> list[str]:
        return ["plan.json", "tools.json"]

    def download(self, run_id: str, path: str, into: Any) -> Path:
        assert path == "tools.json"
        (Path(into) / path).write_text('{"calc": [{"name": "calculate", "inputSchema": {"type": "object"}}]}')
        return Path(into) / path

    def start_run(self, plan: Any, *a: Any, **k: Any) -> Any:
        return plan

    def end(self, status: str) -> None:
        self.world.ended.append(status)

    def released(self) -> None:
        self.world.ended.append("released")

    def log_text(self, text: str, name: str) -> None:
        self.world.texts.append(name)

    def log_tags(self, tags: dict[str, str]) -> None:
        self.world.tags.update(tags)

    def log_trajectories(self, *a: Any, **k: Any) -> None: ...
    def prepare(self) -> None: ...
    def log_checkpoint(self, *a: Any) -> None: ...
    def flush_traces(self) -> None: ...


class Quiet:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


def fake_groups(world: World, plan: Any) -> dict[str, FakeGroup]:
    """The plan's stages as fakes; the tools stage records and lists tools, as its CONTRACT declares (the
    stage classes are not imported: the trainer's would bring DeepSpeed in)."""
    assert "tools" in {s.name for s in plan.stages}
    return {s.name: FakeGroup(world, Contract(records_tools=s.name == "tools", lists_tools=s.name == "tools"))
            for s in plan.stages}


def run_loop(monkeypatch: pytest.MonkeyPatch, world: World, overrides: list[str],
             resume: Any = None, batch: list[Any] | None = None, **kwargs: Any) -> driver.RunResult:
    """The driver's loop over fake stages; each step's rollout gives `batch` (default: no trajectories)."""
    monkeypatch.chdir(REPO)
    plan = factory.compile(REPO / "specs" / "tiny.yaml", overrides)
    fake_steps(monkeypatch, world, batch)
    return driver.train_loop(fake_groups(world, plan), plan, FakeTracker(world), Quiet(), Quiet(), resume=resume,
                             **kwargs)


def fake_steps(monkeypatch: pytest.MonkeyPatch, world: World, batch: list[Any] | None = None) -> None:
    """The driver's steps (rollout, evaluation, update, restore) as fakes that tell `world`."""

    def collect(g: Any, plan: Any, display: Any, step: int) -> tuple[list[Any], dict[str, float], list[Any]]:
        world.made += [f"train/{step}/0/0/0/0/0"]
        world.drawn += 1
        if step == world.miss_at:
            world.misses.append(f"calculate(...) at train/{step}/0/0/0/0/0")
        if not world.rewards:
            return list(batch or []), {"rollout/generated_tokens": 0.0}, list(batch or [])
        reward = world.rewards.pop(0)  # the step's one trajectory's (the monitors read the trajectories)
        scored = [Trajectory(prompt_index=0, sample_index=0, prompt_ids=[], response_ids=[], loss_mask=[], turns=[],
                             stop_reason="no_call", row={}, reward=reward)]
        return list(batch or scored), {"rollout/generated_tokens": 0.0, "reward/mean": reward}, list(batch or scored)

    def evaluate(g: Any, plan: Any, display: Any, step: int) -> tuple[dict[str, float], list[Any]]:
        world.made += [f"eval/{step}/0/0/0/0/0"]
        if step == world.eval_miss_at:
            world.misses.append(f"calculate(...) at eval/{step}/0/0/0/0/0")
        return {"eval/accuracy": world.eval_metric.pop(0) if world.eval_metric else 0.5}, []

    monkeypatch.setattr(driver, "collect", collect)
    monkeypatch.setattr(driver, "evaluate", evaluate)
    monkeypatch.setattr(driver, "Updates", lambda g, plan, synced, warn=None: FakeUpdates(world, g, plan, synced))
    def restore(g: Any, plan: Any, resume: Resume) -> int:
        if world.restore_error:
            raise RuntimeError(world.restore_error)
        return resume.step

    monkeypatch.setattr(driver, "restore", restore)


def test_the_monitors_read_the_trajectories_the_update_trains(monkeypatch):
    """Out of the loss, out of the monitors: a trajectory a tool's infrastructure failure hit (drop_infra_errors) or
    the budget cut (overlong.filter) counted in reward_dominance's variance shares and judge_disagreement; only
    drop_sample's were left out."""
    from factory.monitors import Watch

    def traj(i: int, **fault: Any) -> Trajectory:
        return Trajectory(prompt_index=0, sample_index=i, prompt_ids=[], response_ids=[], loss_mask=[], turns=[],
                          stop_reason="no_call", row={}, reward=float(i % 2), **fault)

    batch = [traj(0), traj(1), traj(2, infra_error=True), traj(3, truncated=True), traj(4, dropped="x: missing")]
    seen = []
    monkeypatch.setattr(Watch, "observe",
                        lambda self, step, trajs, signal: seen.append([t.sample_index for t in trajs]) or {})
    run_loop(monkeypatch, World(), ["train.steps=1", "algorithm.overlong.filter=true"], batch=batch)
    assert seen == [[0, 1]]
    # without overlong filtering the cut trajectory trains, and is read (the two settings are not one)
    run_loop(monkeypatch, World(), ["train.steps=1"], batch=batch)
    assert seen[1] == [0, 1, 3]


def test_a_run_warns_when_two_servers_offer_one_tool_name(monkeypatch):
    """Only `factory check --connect` said so: a run renamed the tools without a word."""
    said = []

    class Display(Quiet):
        def warning(self, text: str) -> None:
            said.append(text)

    monkeypatch.chdir(REPO)
    plan = factory.compile(REPO / "specs" / "tiny.yaml", [])
    for listing in ({s: [{"name": "calculate", "offered_as": f"{s}__calculate"}] for s in ("calc", "calc2")},
                    {"calc": [{"name": "calculate", "offered_as": "calculate"}]}):
        world = World(listing=listing)
        with driver.opened_run(FakeTracker(world), plan, fake_groups(world, plan), Display(),
                               lambda listing, resolved: plan, None):
            pass
    assert len(said) == 1 and said[0].startswith("2 servers offer a tool 'calculate' (calc, calc2): the model is "
                                                 "offered calc__calculate, calc2__calculate instead")


def resumed_at(step: int, logged: int, before: dict[str, float] | None = None) -> Resume:
    """A run resumed from its step-`step` checkpoint with metrics through step `logged` (restore is faked)."""
    return Resume("r" * 32, "tiny-x", Path("checkpoints"), f"step_{step}", step, logged, None, before=before or {})


def test_a_spec_change_is_recorded_on_the_run_once_its_checkpoint_has_loaded(monkeypatch):
    """`--resume --allow-spec-change`: the changed spec goes on the run (tag, `resumed/step_N/`) after the
    checkpoint loads. It was written when the run reopened, so a load that failed left a record of a spec that
    never ran, which `factory diff` and later resumes then read."""
    import dataclasses

    changed = dataclasses.replace(resumed_at(step=1, logged=1), changed=["train.steps"])
    loaded = World()
    run_loop(monkeypatch, loaded, ["train.steps=3"], resume=changed)
    assert loaded.texts == ["resumed/step_1/spec.yaml", "resumed/step_1/plan.json"]
    assert set(loaded.tags) == {"factory.resumed_spec_hash"}
    failed = World(restore_error="the checkpoint does not load")
    with pytest.raises(RuntimeError, match="does not load"):
        run_loop(monkeypatch, failed, ["train.steps=3"], resume=changed)
    assert failed.texts == [] and failed.tags == {}
    same = World()
    run_loop(monkeypatch, same, ["train.steps=3"], resume=resumed_at(step=1, logged=1))
    assert same.texts == [] and same.tags == {}
    sends = World()  # every step done: the resume only sends what its driver could not, and trains nothing
    run_loop(monkeypatch, sends, ["train.steps=3"], resume=dataclasses.replace(resumed_at(step=3, logged=3),
                                                                              changed=["train.lr"], complete=True))
    assert sends.texts == [] and sends.tags == {}


def test_each_session_logs_its_start_up_at_the_first_step_it_logs(monkeypatch):
    """A fresh run's at step 0; a resumed one's at the step after the run's last logged (resumed from a
    step-1 checkpoint with step 2 logged: step 2 is computed again, not logged, step 3 is this session's)."""
    fresh = World()
    run_loop(monkeypatch, fresh, ["train.steps=2"])
    assert "timing/startup_s" in fresh.metrics[0] and "eval/accuracy" in fresh.metrics[0]
    resumed = World()
    resume = resumed_at(step=1, logged=2, before={"eval/accuracy": 0.5})
    run_loop(monkeypatch, resumed, ["train.steps=4"], resume=resume)
    assert [s for s, m in resumed.metrics.items() if "timing/startup_s" in m] == [3]
    assert 0 not in resumed.metrics and 0 not in resumed.tables  # its step-0 evaluation is the run's: not again
    done = World()  # nothing left to do: no start-up logged past the run's last step
    run_loop(monkeypatch, done, ["train.steps=2"], resume=resumed_at(step=2, logged=2))
    assert not any("timing/startup_s" in m for m in done.metrics.values())


@pytest.mark.parametrize("staleness", [0, 1])
def test_each_steps_tool_calls_table_holds_the_calls_that_step_made(monkeypatch, staleness):
    """With train.max_staleness 1 step n is logged after step n+1's rollout: its table must still hold step n's
    calls (and its evaluation's), not the next step's."""
    world = World()
    run_loop(monkeypatch, world, ["train.steps=3", f"train.max_staleness={staleness}", "train.eval_every=2"])
    assert world.tables == {0: ["eval/0/0/0/0/0/0"], 1: ["train/1/0/0/0/0/0"],
                            2: ["train/2/0/0/0/0/0", "eval/2/0/0/0/0/0"], 3: ["train/3/0/0/0/0/0", "eval/3/0/0/0/0/0"]}


def test_a_replay_miss_stops_the_run_before_the_step_is_trained_on(monkeypatch):
    """Under replay.on_miss: fail, the step whose rollout missed is never handed to the trainer, and the error
    names that step (not the step logged when the miss was taken). The steps before it are kept: they were
    lost (not logged, no checkpoint, the run FAILED with nothing to resume or export)."""
    world = World(miss_at=3)
    with pytest.raises(ReplayMiss, match=r"^step 3: the recording of run old has no answer for 1 tool call, first "
                                         r".*; steps 1-2 are logged and checkpointed$"):
        run_loop(monkeypatch, world, ["train.steps=4", "train.max_staleness=1", "replay.run=old"])
    assert world.submitted == [1, 2] and sorted(world.metrics) == [0, 1, 2]
    assert world.saved == [(2, {"drawn": 2})]  # the data where it was before step 3 drew its batch


def test_a_replay_miss_in_a_steps_evaluation_keeps_the_step(monkeypatch):
    """A miss in step 2's evaluation: step 2 trained as recorded, but it was neither logged nor saved (the run
    ended with steps 1-2's work lost past step 1). It is logged (without the evaluation that went elsewhere)
    and saved, and the miss says so."""
    world = World(eval_miss_at=2)
    with pytest.raises(ReplayMiss, match=r"^step 2 evaluation: the recording of run old has no answer for 1 tool "
                                         r"call.*; steps 1-2 are logged and checkpointed$"):
        run_loop(monkeypatch, world, ["train.steps=4", "train.max_staleness=1", "train.eval_every=2",
                                      "replay.run=old"])
    assert world.submitted == [1, 2] and sorted(world.metrics) == [0, 1, 2]
    assert "eval/accuracy" not in world.metrics[2] and [s for s, _ in world.saved] == [2]


def test_a_replay_miss_says_whether_the_recorded_run_got_that_far():
    """A replay that misses where the recorded run never got -- a step past those it trained, an evaluation at a
    step it did not evaluate -- says so; elsewhere this run went elsewhere. It read the last training step whose
    recording held a call: a recorded run whose last step made only malformed calls (no rows) had "gone on past
    what was recorded" at a step it trained, and an evaluation it never made "went elsewhere"."""
    from factory.plan import ToolsSettings
    from factory.runtime.replay import RUN_WENT_ELSEWHERE, replayed_in, why_missed

    plan = factory.compile(REPO / "specs" / "tiny.yaml", ["replay.run=old"])
    assert replayed_in(plan) is None  # not replaying yet
    recorded = Replayed(run="old", rows=[], listing=None, on_miss="fail", trained=3, evaluated=[0, 2])
    assert replayed_in(driver.replaying(plan, recorded)) == recorded
    assert any(isinstance(s.settings, ToolsSettings) for s in plan.stages)
    assert why_missed(recorded, 3, steps=4) == RUN_WENT_ELSEWHERE  # it trained step 3: this run went elsewhere
    assert why_missed(recorded, 4, steps=5) == ("run old trained 3 steps, and this run trains 5: it went on past "
                                                "what was recorded")
    assert why_missed(recorded, 2, steps=4, evaluation=True) == RUN_WENT_ELSEWHERE
    assert why_missed(recorded, 3, steps=4, evaluation=True) == ("run old made no evaluation at step 3 (it evaluated "
                                                                 "at steps 0, 2)")
    once = recorded.model_copy(update={"trained": 1, "evaluated": [0]})
    assert why_missed(once, 2, steps=2) == ("run old trained 1 step, and this run trains 2: it went on past what was "
                                            "recorded")
    assert why_missed(once, 1, steps=2, evaluation=True) == ("run old made no evaluation at step 1 (it evaluated at "
                                                             "step 0)")
    never = recorded.model_copy(update={"trained": 0, "evaluated": []})
    assert why_missed(never, 4, steps=4, evaluation=True) == "run old made no evaluation at step 4 (it made none)"
    assert why_missed(never, 1, steps=1) == ("run old trained no steps, and this run trains 1: it went on past what "
                                             "was recorded")
    assert why_missed(None, 9, steps=9) == RUN_WENT_ELSEWHERE


def test_the_recorded_run_s_steps_are_its_step_tag_its_rows_and_its_evaluations_tables():
    """What the recorded run trained: its factory.step tag (the last step it logged), or a later step whose
    rollout made a call (recorded before that step was logged); what it evaluated: its eval_trajectories tables
    and the evaluations' calls (an evaluation whose calls were all malformed recorded none)."""
    from factory.runtime.replay import evaluated_steps, trained_steps

    rows = [{"origin": "eval/0/0/0/0/0/0"}, {"origin": "train/1/0/0/0/0/0"}, {"origin": "reward/train/3/0/1/0/graded"},
            {"origin": "reward/eval/4/0/0/0/graded"}]
    assert trained_steps({"factory.step": "2"}, rows[:2]) == 2  # step 2 made only malformed calls
    assert trained_steps({"factory.step": "2"}, rows) == 3  # a tool reward node's call at step 3 is step 3's
    assert trained_steps({}, []) == 0
    tables = ["eval_trajectories/step_00000.parquet", "eval_trajectories/step_00006.parquet", "eval_trajectories/x"]
    assert evaluated_steps(tables, rows) == [0, 4, 6]


def test_a_replayed_run_that_trains_past_its_recording_says_so(monkeypatch):
    """`factory run` with replay.run: the loop got the plan before its recording was placed in it, so a miss
    at the step after the recording's last said "this run went elsewhere" even though it had only gone on."""
    import contextlib

    import factory.tracking.tracker as tracker_module

    class Recorded(FakeTracker):
        def tool_calls(self, run_id: str) -> list[dict[str, Any]]:
            return [{"origin": f"train/{step}/0/0/0/0/0"} for step in (1, 2)]

    @contextlib.contextmanager
    def placed(plan: Any, display: Any, startup: Any, **_: Any):
        yield fake_groups(world, plan), Quiet()

    world = World(miss_at=3)
    monkeypatch.chdir(REPO)
    plan = factory.compile(REPO / "specs" / "tiny.yaml", ["replay.run=old", "train.steps=4"])
    fake_steps(monkeypatch, world)
    monkeypatch.setattr(driver, "placed", placed)
    monkeypatch.setattr(driver, "placement_record", lambda groups: {})
    monkeypatch.setattr(tracker_module, "open_tracker", lambda uri, experiment: Recorded(world))
    with pytest.raises(ReplayMiss, match=r"step 3: .*: run old trained 2 steps, and this run trains 4: it went on "
                                         r"past what was recorded; replay.on_miss=live calls the tools instead;"):
        driver.run(plan)


def test_a_replay_missing_at_a_step_the_recorded_run_trained_says_the_run_went_elsewhere(monkeypatch):
    """The recorded run trained 2 steps, but its step 2 made only malformed calls (none recorded): replayed with
    another lr, the miss at step 2 was told "it went on past what was recorded", the on_miss=live hint twice,
    and "steps 1-1 are logged"."""
    import contextlib

    import factory.tracking.tracker as tracker_module

    class Recorded(FakeTracker):
        def run(self, ref: str) -> Any:
            return type("Run", (), {"run_id": f"{ref}-id", "name": ref,
                                    "tags": {TOOLS_IN_SERVER_ORDER: "true", "factory.step": "2"}})()

        def tool_calls(self, run_id: str) -> list[dict[str, Any]]:
            return [{"origin": "train/1/0/0/0/0/0"}]

    @contextlib.contextmanager
    def placed(plan: Any, display: Any, startup: Any, **_: Any):
        yield fake_groups(world, plan), Quiet()

    world = World(miss_at=2)
    monkeypatch.chdir(REPO)
    plan = factory.compile(REPO / "specs" / "tiny.yaml", ["replay.run=old", "train.steps=2", "train.lr=1e-4"])
    fake_steps(monkeypatch, world)
    monkeypatch.setattr(driver, "placed", placed)
    monkeypatch.setattr(driver, "placement_record", lambda groups: {})
    monkeypatch.setattr(tracker_module, "open_tracker", lambda uri, experiment: Recorded(world))
    with pytest.raises(ReplayMiss) as e:
        driver.run(plan)
    assert str(e.value) == ("step 2: the recording of run old has no answer for 1 tool call, first calculate(...) at "
                            "train/2/0/0/0/0/0: this run went elsewhere (a changed spec, model or data); "
                            "replay.on_miss=live calls the tools instead; step 1 is logged and checkpointed")


def test_factory_eval_replaying_a_step_the_recorded_run_never_evaluated_says_so(monkeypatch):
    """`factory eval --model RUN --replay RUN` at a step RUN never evaluated: every call missed, and the miss said
    "this run went elsewhere (a changed spec, model or data)" though nothing had changed."""
    import contextlib

    import factory.tracking.tracker as tracker_module

    class Recorded(FakeTracker):
        def tool_calls(self, run_id: str) -> list[dict[str, Any]]:
            return [{"origin": f"{split}/{n}/0/0/0/0/0"} for split, n in (("eval", 0), ("train", 1), ("train", 2))]

    @contextlib.contextmanager
    def placed(plan: Any, display: Any, startup: Any, **_: Any):
        yield fake_groups(world, plan), None

    world = World(eval_miss_at=2)
    monkeypatch.chdir(REPO)
    fake_steps(monkeypatch, world)
    monkeypatch.setattr(driver, "placed", placed)
    monkeypatch.setattr(tracker_module, "open_tracker", lambda uri, experiment: Recorded(world))
    with pytest.raises(ReplayMiss, match=r"^step 2 evaluation: the recording of run old has no answer for 1 tool call, "
                                         r"first calculate\(\.\.\.\) at eval/2/0/0/0/0/0: run old made no evaluation "
                                         r"at step 2 \(it evaluated at step 0\); replay.on_miss=live calls the tools "
                                         r"instead$"):
        driver.evaluate_only(factory.compile(REPO / "specs" / "tiny.yaml", ["replay.run=old"]), 2)


def test_opening_the_store_and_reading_the_replayed_run_is_a_start_up_phase_of_its_own(monkeypatch):
    """What runs between the `command` lap and the stages' placing -- the tracking store opened, the run that
    replay.run names read from it (a slow store, a fresh sqlite store's tables made) -- went to the next lap,
    placed()'s `ray` (before that, `models`): neither starts Ray nor builds a model. It is the `store` phase."""
    import contextlib

    import factory.tracking.tracker as tracker_module
    from factory.runtime.startup import Startup

    now = [100.0]  # the start-up's clock: the replay lookup advances it by what it takes

    class Recorded(FakeTracker):
        experiment_id = "0"

        def tool_calls(self, run_id: str) -> list[dict[str, Any]]:
            now[0] += 5.0
            return super().tool_calls(run_id)

    at_placing = {}

    @contextlib.contextmanager
    def placed(plan: Any, display: Any, startup: Any, **_: Any):
        at_placing.update(startup.phases)
        now[0] += 2.0
        startup.lap("ray")  # (placed's first lap, after ending what a killed run left)
        yield fake_groups(world, plan), Quiet()

    world = World()
    monkeypatch.chdir(REPO)
    plan = factory.compile(REPO / "specs" / "tiny.yaml", ["replay.run=old", "replay.on_miss=live", "train.steps=1"])
    fake_steps(monkeypatch, world)
    monkeypatch.setattr(driver, "placed", placed)
    monkeypatch.setattr(driver, "placement_record", lambda groups: {})
    monkeypatch.setattr(driver, "Startup", lambda started_at: Startup(started_at, clock=lambda: now[0]))
    monkeypatch.setattr(tracker_module, "open_tracker", lambda uri, experiment: Recorded(world))
    driver.run(plan)
    assert at_placing == {"command": 0.0, "store": 5.0}
    startup = {k: v for k, v in world.metrics[0].items() if k.startswith("timing/startup")}
    assert startup == {"timing/startup_s": 7.0, "timing/startup/command_s": 0.0, "timing/startup/store_s": 5.0,
                       "timing/startup/ray_s": 2.0, "timing/startup/tracking_s": 0.0}


def test_the_update_syncs_in_the_dtype_the_rollout_resolved(monkeypatch):
    """The learner guessed the engine's dtype on its own device (an update on the CPU beside a GPU rollout:
    float32 to a bf16 engine); once the stages are placed it is told what the rollout resolved on its own."""
    monkeypatch.chdir(REPO)
    plan = factory.compile(REPO / "specs" / "tiny.yaml")
    asked = []

    class Group(SimpleNamespace):
        def call(self, method: str, *args: Any) -> Any:
            asked.append((self.name, method, *args))
            return {"weight_sync": f"full ({args[0]})"}

    groups = {s.name: Group(name=s.name, info=[{"resolved": {"dtype": "bfloat16"}}] if s.name == "rollout" else
                            [{"resolved": {"weight_sync": "full (float32)"}}, {}]) for s in plan.stages}
    driver.agree_sync_dtypes(plan, groups)
    assert asked == [("update", "use_sync_dtype", "bfloat16")]
    assert groups["update"].info[0]["resolved"] == {"weight_sync": "full (bfloat16)"}  # what the run's params say


def test_a_stop_on_monitor_reads_the_final_evaluation_and_stops_the_run_there(monkeypatch):
    """eval_every 0 (the default): evaluations at step 0 and the last step. train_eval_divergence speaks at the
    last step, once its evaluation is in, and its stop_on is heeded: the step is logged with the reading and
    checkpointed, and the run ends halted."""
    world = World(eval_metric=[0.5, 0.3], rewards=[0.0, 0.2, 0.4])
    result = run_loop(monkeypatch, world, ["train.steps=3", "train.stop_on=[train_eval_divergence]"])
    assert world.metrics[3]["monitor/train_eval_divergence/fired"] == 1.0
    assert world.tags["factory.monitor.train_eval_divergence"] == "3"  # `factory runs` shows when it fired
    assert result.halted.startswith("monitor train_eval_divergence fired at step 3") and result.checkpoint == str(Path.cwd() / "step_x")  # absolute


def test_factory_eval_replays_the_recorded_tool_calls_as_a_run_does(monkeypatch):
    """`factory eval SPEC replay.run=X` must answer from X's recording, not call the live tools while the
    setting says otherwise."""
    import contextlib

    import factory.tracking.tracker as tracker_module

    world = World()
    monkeypatch.chdir(REPO)
    plan = factory.compile(REPO / "specs" / "tiny.yaml", ["replay.run=old", "replay.on_miss=live"])

    @contextlib.contextmanager
    def placed(plan: Any, display: Any, startup: Any, **_: Any):
        world.replayed = plan.stage("tools").settings.replay
        yield fake_groups(world, plan), None

    monkeypatch.setattr(driver, "placed", placed)
    monkeypatch.setattr(driver, "evaluate", lambda g, plan, display, step: ({"eval/accuracy": 0.5}, []))
    monkeypatch.setattr(tracker_module, "open_tracker", lambda uri, experiment: FakeTracker(world))
    result = driver.evaluate_only(plan, 4)
    assert world.replayed == Replayed(run="old", rows=[{"origin": "eval/0/0/0/0/0/0", "from": "old-id"}],
                                      listing={"calc": [{"name": "calculate", "inputSchema": {"type": "object"}}]},
                                      on_miss="live", trained=0, evaluated=[0])
    assert plan_json(driver.replaying(plan, world.replayed)) == plan_json(plan)  # read at run time: not logged
    assert result.metrics == {"eval/accuracy": 0.5} and world.metrics == {4: {"eval/accuracy": 0.5}}
    assert world.ended == ["FINISHED", "released"]  # and what preparing the store set put back, as after a run


@pytest.mark.parametrize("command", ["run", "eval"])
def test_a_replay_of_a_run_that_is_not_there_fails_before_anything_is_placed(monkeypatch, command):
    """`replay.run` naming no run (or one that recorded no tool calls) is found out from the store alone,
    in seconds, not after Ray and every stage have started."""
    import factory.tracking.tracker as tracker_module
    from factory.tracking.tracker import RunLookupError
    from factory.util import UserError

    class NoSuchRun(FakeTracker):
        def run(self, ref: str) -> Any:
            if ref == "nosuchrun":
                raise RunLookupError(f"no run with id or name '{ref}'")
            return super().run(ref)

        def tool_calls(self, run_id: str) -> list[dict[str, Any]]:
            return []

    def placed(*a: Any, **k: Any) -> Any:
        raise AssertionError("stages placed before the replayed run was looked up")

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(driver, "placed", placed)
    monkeypatch.setattr(tracker_module, "open_tracker", lambda uri, experiment: NoSuchRun(World()))
    go = driver.run if command == "run" else lambda plan: driver.evaluate_only(plan, 0)
    with pytest.raises(RunLookupError, match="no run with id or name 'nosuchrun'"):
        go(factory.compile(REPO / "specs" / "tiny.yaml", ["replay.run=nosuchrun"]))
    with pytest.raises(UserError, match=r"replay: run old \(old-id\) recorded no tool calls"):
        go(factory.compile(REPO / "specs" / "tiny.yaml", ["replay.run=old"]))
    # a `factory rescore` run records none by design: the run it rescored is the one to replay (it was told its
    # tracking.record_tools was off, or it made none)
    rescored = {TOOLS_IN_SERVER_ORDER: "true", "factory.rescore_of": "abc123"}
    monkeypatch.setattr(NoSuchRun, "run", lambda self, ref: SimpleNamespace(run_id=f"{ref}-id", name=ref,
                                                                            tags=rescored))
    with pytest.raises(UserError, match=r"^replay: run old \(old-id\) is a `factory rescore` of run abc123, which "
                                        r"records no tool calls of its own: replay run abc123$"):
        go(factory.compile(REPO / "specs" / "tiny.yaml", ["replay.run=old"]))


def test_dynamic_sampling_keeps_each_rounds_groups_apart_whatever_the_batch_size(monkeypatch):
    """A refill round's prompts are renumbered so that no two prompts share a group id (the advantage's
    group). The offset was 1000 per round: with 1000 prompts a step or more, round 1's prompt 0 became
    round 0's prompt 1000, and the advantages of two different prompts were computed as one group."""
    monkeypatch.chdir(REPO)
    want = 1001
    plan = factory.compile(REPO / "specs" / "tiny.yaml", ["algorithm.name=dapo", f"train.prompts_per_step={want}",
                                                          "rollout.group_size=2"])
    asked = []

    def carry(g: Any, edges: Any, n: int, **k: Any) -> tuple[list[Any], dict[str, float]]:
        # one group kept a round: the first round's last prompt (index 1000), later rounds' first (index 0)
        asked.append(n)
        spreads = n - 1 if len(asked) == 1 else 0
        trajs = [SimpleNamespace(prompt_index=p, sample_index=s, reward=float(s if p == spreads else 0),
                                 num_model_tokens=1, origin=(len(asked), p), infra_error=None, truncated=False,
                                 dropped=False) for p in range(n) for s in range(2)]
        return trajs, {}

    monkeypatch.setattr(driver, "carry", carry)
    kept, m, _ = driver.collect({}, plan, Quiet(), step=1)
    assert asked == [want, want - 1, want - 2, want - 3] and m["rollout/dynamic_sampling_rounds"] == 4
    groups: dict[int, set] = {}
    for t in kept:
        groups.setdefault(t.prompt_index, set()).add(t.origin[:2])
    assert len(groups) == 4 and all(len(origins) == 1 for origins in groups.values())


def test_dynamic_sampling_monitors_read_the_task_over_every_sampled_trajectory(monkeypatch):
    """Accuracy rising 0.25 -> 0.75 by solving the easy half in every sample: the kept groups (a spread of rewards)
    leave those prompts out, so a monitor reading them saw a flat task (task_stalled) and longer answers in it."""
    from factory.monitors import Watch
    from factory.plan import WatchSettings
    from factory.schema import MonitorsSpec
    from factory.types import Turn

    d = SimpleNamespace(train=SimpleNamespace(prompts_per_step=8), dynamic_sampling=True, turn_gamma=None,
                        std_eps=1e-6, overlong_filter=False, drop_infra_errors=True)
    plan = SimpleNamespace(driver=d, flow=lambda name: [None, None])
    at = {"step": 0, "next": 0}

    def carry(g: Any, edges: Any, n: int, **k: Any) -> tuple[list[Any], dict[str, float]]:
        right = [0, 0, 0, 0, 1, 2, 3, 2] if at["step"] <= 2 else [4, 4, 4, 4, 1, 2, 3, 2]  # of 4 samples
        out = []
        for p in range(n):
            c, at["next"] = right[at["next"] % 8], at["next"] + 1
            out += [Trajectory(prompt_index=p, sample_index=s, prompt_ids=[], response_ids=[], loss_mask=[],
                               turns=[Turn(text="", num_tokens=100 if at["step"] <= 2 else 250)], stop_reason="no_call",
                               row={}, rewards={"correct": float(s < c)}, reward=float(s < c)) for s in range(4)]
        return out, {}

    monkeypatch.setattr(driver, "carry", carry)
    w = WatchSettings(task_metric="accuracy", task_node="correct", weights={}, judges=(), verifier=None, tools=False)
    watch = Watch(w, MonitorsSpec(), stop_on=("task_stalled", "length_drift"))
    for step in range(1, 6):
        at["step"] = step
        kept, _, sampled = driver.collect(None, plan, Quiet(), step)
        watch.observe(step, driver._trainable(sampled, d), driver._trainable(kept, d))  # as the driver's loop does
    assert [round(r["task"], 2) for r in watch.rows] == [0.25, 0.25, 0.75, 0.75, 0.75]
    assert watch.halt is None


def test_dynamic_sampling_counts_only_the_members_the_update_trains(monkeypatch):
    """Three right answers and one tool failure scored 0: the group spread, dynamic sampling kept it and did not
    refill, and the update, which drops the failed trajectory (rollout.drop_infra_errors), trained nothing of it.
    The same for a trajectory cut by the budget under overlong filtering, and one a drop_sample node dropped."""
    monkeypatch.chdir(REPO)
    plan = factory.compile(REPO / "specs" / "tiny.yaml", ["algorithm.name=dapo", "train.prompts_per_step=2",
                                                          "rollout.group_size=4", "algorithm.overlong.filter=true"])
    rounds = []

    def carry(g: Any, edges: Any, n: int, **k: Any) -> tuple[list[Any], dict[str, float]]:
        # prompt 0: its only 0 is a member the update drops (in turn: an infra error, a cut, a dropped one);
        # prompt 1: a real spread, besides such a member
        fault = ["infra_error", "truncated", "dropped"][len(rounds)] if len(rounds) < 3 else None
        rounds.append(n)
        trajs = []
        for p in range(n):
            for s in range(4):
                t = SimpleNamespace(prompt_index=p, sample_index=s, reward=1.0 if s else 0.0, num_model_tokens=1,
                                    infra_error=None, truncated=False, dropped=False, origin=(len(rounds), p))
                if p == 1:
                    t.reward = float(s % 2)
                if s == 0 and fault:
                    setattr(t, fault, "tool timed out" if fault == "infra_error" else True)
                trajs.append(t)
        return trajs, {}

    monkeypatch.setattr(driver, "carry", carry)
    kept, m, _ = driver.collect({}, plan, Quiet(), step=1)
    # round 1 keeps prompt 1's group (its spread is in the members that train) and refills prompt 0's, whose only
    # 0 was the faulty member's; so do rounds 2 and 3 (the other faults); round 4's prompt 0 has no fault
    assert rounds == [2, 1, 1, 1] and m["rollout/dynamic_sampling_rounds"] == 4
    assert sorted({t.origin for t in kept}) == [(1, 1), (4, 0)]
    assert len(kept) == 8  # a kept group keeps all four members: the update drops its own faulty one


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_stop_set_in_on_step_ends_the_run_after_that_step_when_nothing_is_in_flight(monkeypatch, staleness):
    """An early stop from on_step(N) (`factory.run(on_step=..., stop=...)`) ran one more step's rollout and
    update: the loop read the stop only before the step's record. It ends after the step in flight: N itself,
    or, with max_staleness 1 (N + 1's update is in flight when N is recorded), N + 1; checkpointed there."""
    world, stop = World(), threading.Event()

    def on_step(step: int, metrics: dict[str, float]) -> None:
        if step == 1:
            stop.set()

    result = run_loop(monkeypatch, world, ["train.steps=4", f"train.max_staleness={staleness}"], on_step=on_step,
                      stop_event=stop)
    assert (result.last_step, result.stopped) == (1 + staleness, True) and result.checkpoint is not None
    assert world.submitted == [1, 2][: 1 + staleness] and sorted(world.metrics) == [0, 1, 2][: 2 + staleness]


def test_a_stop_asked_at_the_last_step_leaves_a_finished_run(monkeypatch):
    """A Ctrl-C or SIGTERM that came just as the last step was recorded made a complete run KILLED (exit 130)
    for good: `--resume` refuses a run that has no step left."""
    world, stop = World(), threading.Event()

    def on_step(step: int, metrics: dict[str, float]) -> None:
        if step == 3:
            stop.set()

    result = run_loop(monkeypatch, world, ["train.steps=3"], on_step=on_step, stop_event=stop)
    assert (result.last_step, result.stopped, result.status) == (3, False, "FINISHED")
    assert world.submitted == [1, 2, 3] and result.checkpoint is not None


@pytest.mark.parametrize("when", ["on_step(0)", "start-up"])
def test_a_stop_asked_before_the_first_step_runs_no_step(monkeypatch, when):
    """A stop set in on_step(0) (an early stop on the evaluation before training), or by another thread while the
    stages started, ran step 1's rollout, update and checkpoint: the loop read the stop only after a step."""
    world, stop = World(), threading.Event()
    if when == "start-up":
        stop.set()

    def on_step(step: int, metrics: dict[str, float]) -> None:
        if step == 0:
            stop.set()

    result = run_loop(monkeypatch, world, ["train.steps=4"], on_step=on_step, stop_event=stop)
    assert (result.last_step, result.stopped, result.status, result.checkpoint) == (0, True, "KILLED", None)
    assert world.submitted == [] and sorted(world.metrics) == [0]  # step 0's evaluation, logged


def test_a_resumed_run_that_saves_nothing_returns_the_checkpoint_it_resumed_from(monkeypatch):
    """RunResult.checkpoint is the newest checkpoint's folder, fresh or resumed run alike: a resumed session
    stopped before its first step, or one with every step already done, returned None (it saved none itself)."""
    import dataclasses

    resumed_from = str(Path.cwd() / "checkpoints" / "step_1")  # absolute, as a fresh run's
    stop = threading.Event()
    stop.set()
    world = World()
    result = run_loop(monkeypatch, world, ["train.steps=3"], resume=resumed_at(step=1, logged=1), stop_event=stop)
    assert (result.last_step, result.stopped, result.checkpoint, world.saved) == (1, True, resumed_from, [])
    complete = dataclasses.replace(resumed_at(step=1, logged=1), complete=True)
    result = run_loop(monkeypatch, World(), ["train.steps=1"], resume=complete)
    assert (result.last_step, result.stopped, result.checkpoint) == (1, False, resumed_from)
    result = run_loop(monkeypatch, World(), ["train.steps=2"], resume=resumed_at(step=1, logged=1))
    assert result.checkpoint == str(Path.cwd() / "step_x")  # one it saved itself is newer


def test_the_summary_of_a_resume_that_only_sent_records_says_the_final_evaluation_is_an_earlier_sessions(
        monkeypatch):
    """`--resume` of a run that had done every step but not sent all its records (Resume.complete): the summary
    said "Factory run finished" and, below it, that the run "stopped before its next" evaluation."""
    import dataclasses
    import io

    from rich.console import Console

    from factory.runtime.display import Display

    complete = dataclasses.replace(resumed_at(step=3, logged=3, before={"eval/accuracy": 0.5}), complete=True)
    result = run_loop(monkeypatch, World(), ["train.steps=3"], resume=complete)
    out = io.StringIO()
    Display(3, console=Console(file=out, width=200, log_path=False)).summary(
        result, experiment="e", experiment_id="3", uri="sqlite:///m.db", wall_s=6)
    text = out.getvalue()
    assert "Factory run finished" in text and "stopped before" not in text, text
    assert ("every step was done before this session: the evaluation after step 3 is an earlier session's (in the "
            "MLflow run)") in text


def test_store_advice_speaks_only_for_a_sync_the_store_cannot_hold():
    """SmolLM2-135M's 538 MB of float32 weights against a 0.5 GiB store (the case measured: ~1 s a sync
    outside the store, ~0.1 s inside a 1 GiB one): the advice names a size with a quarter spare per sync in
    flight; a store that holds the sync says nothing."""
    from factory.runtime.driver import store_advice

    said = store_advice(538.06, 0.5 * 2**30, staleness=0)
    assert said is not None and "538 MB" in said and "(537 MB)" in said
    assert said.endswith("set resources.object_store_gb: 1 or more")
    assert store_advice(538.06, 0.5 * 2**30, staleness=1).endswith("object_store_gb: 1.5 or more")
    assert store_advice(538.06, 2**30, staleness=0) is None
    assert store_advice(538.06, 538.06e6, staleness=0) is None  # exactly full still fits


def test_a_resumed_run_takes_up_the_monitors_history_its_checkpoint_saved(monkeypatch):
    """The monitors' history (the step-0 evaluation, readings so far) is in the checkpoint: a resume that did not
    restore it started every monitor over, its baselines from nothing."""
    import dataclasses

    from factory.monitors import Watch

    restored = []
    monkeypatch.setattr(Watch, "restore", lambda self, state: restored.append(state))
    run_loop(monkeypatch, World(), ["train.steps=3"],
             resume=dataclasses.replace(resumed_at(step=1, logged=1), watch={"saved": "history"}))
    assert restored == [{"saved": "history"}]


def test_a_stop_asked_during_a_steps_rollout_saves_that_step(monkeypatch):
    """A Ctrl-C (or a stop_on monitor) heard before the step is recorded: the step trains, is logged and is
    checkpointed before the run ends, whatever train.checkpoint_every says -- else its update was lost."""
    stop = threading.Event()
    monkeypatch.setattr(driver, "check_infra", lambda trajs, limit, step: stop.set() if step == 2 else 0.0)
    world = World()
    result = run_loop(monkeypatch, world, ["train.steps=4", "train.checkpoint_every=100"], stop_event=stop)
    assert (result.last_step, result.stopped) == (2, True) and [s for s, _ in world.saved] == [2]


def test_a_replay_that_goes_live_on_a_miss_does_not_stop_the_run(monkeypatch):
    """replay.on_miss: live answers what the recording lacks from the live tool: a miss is no error."""
    world = World(miss_at=2)
    result = run_loop(monkeypatch, world, ["train.steps=3", "replay.run=old", "replay.on_miss=live"])
    assert result.last_step == 3 and world.submitted == [1, 2, 3] and world.tables[2] == ["train/2/0/0/0/0/0"]


def test_each_refill_round_of_dynamic_sampling_is_its_own_groups(monkeypatch):
    """3 prompts wanted, one group with a spread a round: round 0 keeps its prompt 1, round 1 (2 prompts asked)
    its prompt 0, round 2 (1 asked) its prompt 0. Each is its own group (renumbered by 3 a round: 1, 3, 6), the
    step's tokens are every round's, and its metrics are weighted over every round's trajectories."""
    monkeypatch.chdir(REPO)
    plan = factory.compile(REPO / "specs" / "tiny.yaml", ["algorithm.name=dapo", "train.prompts_per_step=3",
                                                          "rollout.group_size=2"])
    asked = []

    def carry(g: Any, edges: Any, n: int, **k: Any) -> tuple[list[Any], dict[str, float]]:
        asked.append(n)
        spreads = 1 if len(asked) == 1 else 0
        trajs = [SimpleNamespace(prompt_index=p, sample_index=s, reward=float(s if p == spreads else 0),
                                 num_model_tokens=10, origin=len(asked), infra_error=None, truncated=False,
                                 dropped=False) for p in range(n) for s in range(2)]
        return trajs, {"num_turns/mean": float(len(asked))}

    monkeypatch.setattr(driver, "carry", carry)
    kept, m, _ = driver.collect({}, plan, Quiet(), step=1)
    assert asked == [3, 2, 1]
    assert sorted({(t.prompt_index, t.origin) for t in kept}) == [(1, 1), (3, 2), (6, 3)]
    assert m["rollout/generated_tokens"] == 10.0 * 2 * (3 + 2 + 1)
    assert m["num_turns/mean"] == pytest.approx((1 * 6 + 2 * 4 + 3 * 2) / 12)


def test_an_evaluation_counts_the_trajectories_an_infrastructure_failure_hit(monkeypatch):
    """They are scored as they ended (an evaluation has no update to protect), and eval/infra_errors says how
    many: without it an evaluation's drop from a tool server gone down reads as the model's."""
    monkeypatch.chdir(REPO)
    plan = factory.compile(REPO / "specs" / "tiny.yaml", [])
    failed = SimpleNamespace(turns=[SimpleNamespace(results=[SimpleNamespace(tool="calculate", status="infra_error",
                                                                             error_kind="timeout")])],
                             reward_details={})
    fine = SimpleNamespace(turns=[], reward_details={})
    said = []

    class Display(Quiet):
        def warning(self, text: str) -> None:
            said.append(text)

    metrics = {"rewards/correct/mean": 0.5, "reward/mean": 0.5, "reward/dropped": 0.0, "num_turns/mean": 1.5,
               "tool_calls/mean": 2.0}
    monkeypatch.setattr(driver, "carry", lambda g, edges, **k: ([fine, failed, fine], metrics))
    out, trajs = driver.evaluate({}, plan, Display(), 4)
    assert out == {"eval/accuracy": 0.5, "eval/reward": 0.5, "eval/dropped": 0.0, "eval/num_turns": 1.5,
                   "eval/tool_calls": 2.0, "eval/infra_errors": 1.0} and len(trajs) == 3
    assert len(said) == 1 and said[0].startswith("step 4 evaluation: 1 of 3 trajectories met an infrastructure "
                                                 "failure (first: tool calculate: timeout)")


def test_the_first_weight_sync_checks_the_store_size_read_when_the_stages_were_placed(monkeypatch):
    """The store-size check at the first weight sync asked the Ray head (ray.nodes()) mid-run: a joined cluster's
    head that stopped answering (frozen, not gone) hung the run there, with no deadline, while the stages' own
    calls went on. It reads the size `place` read when it placed the trainer's stage."""
    from factory.plan import Edge

    def frozen_head():
        raise AssertionError("the Ray head was asked mid-run")

    monkeypatch.setattr(driver.ray, "nodes", frozen_head)
    monkeypatch.setattr(driver, "fetch_weights", lambda g, plan: [])
    monkeypatch.setattr(driver, "load_weights", lambda g, fetched: 0.1)
    stats = {"perf/weight_sync_mb": 538.0, "timing/update_s": 1.0}
    update = SimpleNamespace(submit=lambda method, trajs: ["update"], store_bytes=0.5 * 2**30,
                             deadlines=SimpleNamespace(get=lambda *a, **k: [dict(stats)]))
    plan = SimpleNamespace(flow=lambda _: [Edge("reward", "update", "scored_trajectories", method="step")],
                           driver=SimpleNamespace(train=SimpleNamespace(max_staleness=0)))
    said: list[str] = []
    updates = driver.Updates({"update": update}, plan, synced=0, warn=said.append)
    for step in (1, 2):
        updates.submit(step, [], {"rollout/generated_tokens": 1.0}, 0.0)
        assert [n for n, _, _ in updates.finish(drain=False)] == [step]
    assert len(said) == 1 and said[0].startswith("one weight sync is 538 MB, more than Ray's object store holds "
                                                 "(537 MB)"), said
