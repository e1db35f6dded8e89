"""Overlap between stages (issue 14), the driver's own code on real Ray actors.

Streaming: each trajectory (or, when a reward node reads its group, each group) goes to the reward stage
as soon as it is complete, so scoring overlaps generation (`Group.stream`, `pipe`: two replicas of a
stand-in rollout stage whose prompts finish one by one, and the real reward stage).
`train.max_staleness`: the training loop (`train_loop`) on stand-in stages that log what they do and
when: 0 keeps today's order, 1 runs a rollout while the previous update does."""
from __future__ import annotations

import asyncio
import math
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest
import ray

from factory.compiler.compile import stage_settings
from factory.contract import Call, Contract, StageActor
from factory.plan import Edge, Stage
from factory.rollout.stage import RolloutStage
from factory.runtime.driver import Group, carry, pipe, setup_group, start_group, teardown
from factory.types import Trajectory
from tests.test_reward_stage import make_spec

REPO = Path(__file__).resolve().parents[1]
FNS = "tests.fixtures.reward_fns"
GROUP, GAP_S = 2, 0.3  # samples per prompt; a replica's groups finish this far apart


class SteppedRollout(StageActor):
    """A rollout replica whose prompts finish GAP_S apart, a prompt's samples last to first (the real stage's
    streaming contract: the number of parts, then each part -- a group, or one trajectory -- then its
    answer), with the split and merge of the real stage."""

    CONTRACT = Contract(calls={"generate": Call("split", stream="generate_parts"), "load_weights": Call("all")},
                        progress=True)
    split = staticmethod(RolloutStage.split)

    def __init__(self, settings=None):
        self.done = 0

    async def generate_parts(self, batch: pa.Table, first_index: int = 0, *, step: int = 0, attempt: int = 0,
                             part: str = "group"):
        yield batch.num_rows * (GROUP if part == "trajectory" else 1)
        trajs = []
        for p in range(first_index, first_index + batch.num_rows):
            await asyncio.sleep(GAP_S)
            if "fail" in batch.column_names and p == 1:
                raise RuntimeError("the engine broke mid-batch")
            group = [Trajectory(prompt_index=p, sample_index=s, prompt_ids=[], response_ids=[], loss_mask=[],
                                turns=[], stop_reason="no_call", row={"answer": "1"}, messages=[{"role": "user", "content": "q"}],
                                completion="x" * (p + s)) for s in range(GROUP)]
            self.done += GROUP
            trajs += group
            if part == "group":
                yield group
            else:
                for t in reversed(group):
                    yield [t]
        yield trajs, time.time()

    async def progress(self):
        return self.done, self.done, self.done

    @staticmethod
    def merge(parts):
        return [t for trajs, _ in parts for t in trajs], {"timing/rollout_s": 1.0, "test/ended_at": max(e for _, e in parts)}


def _groups(rewards: dict) -> tuple[Group, Group]:
    rollout = Group(Stage("rollout", "test", "tests.test_streaming:SteppedRollout", None, (), ()), SteppedRollout,
                    [ray.remote(SteppedRollout).remote() for _ in range(2)])
    reward = start_group(Stage("reward", "test", "factory.reward.stage:RewardStage",
                               stage_settings(make_spec(rewards))["reward"], (), ()))
    reward.info = ray.get(setup_group(reward, {}))
    return rollout, reward


@pytest.mark.parametrize("part", ["group", "trajectory"])
def test_parts_are_scored_while_the_rollout_still_generates(local_ray, part):
    """Each group, or each trajectory, is scored as soon as the rollout yields it; the answers come back in
    (prompt, sample) order (a prompt's samples end last to first here) with the whole batch's metrics."""
    rollout, reward = _groups({"at": {"fn": f"{FNS}:scored_at"}, "len": {"fn": f"{FNS}:length"},
                               "rank": {"fn": f"{FNS}:group_rank", "group": True},  # what one score call held
                               "kept": {"fn": f"{FNS}:none_for_empty", "on_missing": "drop_sample"},
                               "total": {"sum": {"len": 1.0, "kept": 0.0}}})
    batch = pa.table({"i": list(range(5))})  # 5 prompts over 2 replicas: 2 + 3, the last ends at 3 x GAP_S
    progress = []
    trajs, m = pipe(rollout, "generate", reward, "score", batch, part=part, progress=lambda *a: progress.append(a),
                    step=1)

    ended = m["test/ended_at"]
    scored = {(t.prompt_index, t.sample_index): t.rewards["at"] for t in trajs}
    # the first parts (one prompt per replica, after GAP_S) were scored about 2 x GAP_S before the rollout ended
    assert min(scored.values()) < ended - 1.5 * GAP_S, (scored, ended)
    assert [(t.prompt_index, t.sample_index) for t in trajs] == [(p, s) for p in range(5) for s in range(GROUP)]
    # a group part holds a prompt's samples (ranked among each other); a trajectory part one trajectory
    assert [t.rewards["rank"] for t in trajs] == [float(s) if part == "group" else 0.0
                                                   for p in range(5) for s in range(GROUP)]
    # the step's metrics describe the whole batch: means over the 9 kept trajectories (0.0 has no completion:
    # dropped; the part that holds it alone has no mean and weighs nothing), counts added up
    kept = [p + s for p in range(5) for s in range(GROUP) if p + s]
    assert m["rewards/len/mean"] == pytest.approx(statistics.fmean(kept))
    assert m["reward/mean"] == pytest.approx(statistics.fmean(kept)) and m["reward/dropped"] == 1.0
    assert m["rewards/kept/missing"] == 1.0
    # timing/reward_s: only the scoring after the rollout ended (the last part's), within the wall span
    assert 0 <= m["timing/reward_s"] < m["timing/reward_wall_s"] and m["timing/reward_s"] < GAP_S
    assert m["timing/rollout_s"] == 1.0 and progress and progress[-1][0] <= 5 * GROUP


def test_carry_streams_along_a_stream_edge_and_calls_whole_batches_otherwise(local_ray):
    rollout, reward = _groups({"at": {"fn": f"{FNS}:scored_at"}, "total": {"sum": {"at": 1.0}}})

    class Source(StageActor):  # the data stage's part: fetch a batch
        CONTRACT = Contract(calls={"next_batch": Call("one")})

    class Display:
        def progress(self, *a): ...
        def done(self): ...

    data = Group(Stage("data", "test", "x:Data", None, (), ()), Source, [ray.remote(_Data).remote()])
    g = {"data": data, "rollout": rollout, "reward": reward}
    edges = [Edge("data", "rollout", "batch", method="generate", fetch="next_batch"),
             Edge("rollout", "reward", "trajectories", method="score", stream="trajectory")]
    trajs, m = carry(g, edges, 4, display=Display(), label="step 1", step=1)
    # streamed: the first group was scored before the rollout ended (a whole batch would be scored after).
    # Not by a margin: on 2 loaded cores (CI beside another suite) the first score came 0.12 s before the
    # end, its group having ended 0.3 s before it.
    assert len(trajs) == 4 * GROUP and min(t.reward for t in trajs) < m["test/ended_at"]
    assert math.isfinite(m["timing/reward_wall_s"])


class _Data:
    def next_batch(self, n):
        return pa.table({"i": list(range(n))})


def test_a_replica_that_fails_mid_stream_fails_the_call_with_its_error(local_ray):
    rollout, reward = _groups({"total": {"fn": f"{FNS}:length"}})
    with pytest.raises(ray.exceptions.RayTaskError, match="the engine broke mid-batch"):
        pipe(rollout, "generate", reward, "score", pa.table({"fail": [0, 1, 2, 3]}), part="group",
             progress=lambda *a: None)


# ------------------------------------------------------------------------------- train.max_staleness
UPDATE_S = 0.8  # the stand-in update's time: longer than a rollout, so an overlap shows


class Fresh:
    def reset(self):  # a fresh start for each run on the module's actors
        self.__init__()


class Log(Fresh):
    """What the stand-in stages did, with timestamps (an actor: every stage writes to it)."""

    def __init__(self):
        self.events = []

    def add(self, *event):
        self.events.append((*event, time.time()))

    def read(self):
        return self.events


def _log():
    return ray.get_actor("stream-test-log")


class FakeData(Fresh, StageActor):
    CONTRACT = Contract(calls={"next_batch": Call("one"), "eval_batch": Call("one")}, state=True)

    def __init__(self, settings=None):
        self.pos = 0

    def next_batch(self, n):
        self.pos += n
        return pa.table({"i": list(range(n))})

    def eval_batch(self):
        return None  # no held-out data: no evaluation

    def state(self):
        return {"pos": self.pos}


class FakeRollout(SteppedRollout, Fresh):
    async def generate_parts(self, batch, first_index=0, *, step=0, attempt=0, part="group"):
        _log().add.remote("rollout", step)
        async for item in super().generate_parts(batch, first_index, step=step, attempt=attempt, part=part):
            yield item

    def load_weights(self, weights):
        _log().add.remote("load", weights["version"])


class FakeReward(Fresh, StageActor):
    CONTRACT = Contract(calls={"score": Call("one")})

    def __init__(self, settings=None):
        pass

    async def score(self, group, *, step=0, attempt=0):
        return group, {"reward/mean": 0.5, "reward/dropped": 0.0, "timing/reward_s": 0.01}


class FakeUpdate(Fresh, StageActor):
    """A learner whose version counts its updates; each update takes UPDATE_S."""

    CONTRACT = Contract(calls={"step": Call("all"), "state_dict": Call("all")}, checkpoint=True)

    def __init__(self, settings=None):
        self.version = 0

    def step(self, trajs):
        _log().add.remote("update", self.version + 1)
        time.sleep(UPDATE_S)
        self.version += 1
        _log().add.remote("updated", self.version)
        return {"timing/update_s": UPDATE_S, "actor/version": float(self.version), "rollout/logprob_diff_mean": 0.01}

    def state_dict(self):
        return {"version": self.version}

    def save_checkpoint(self, directory, step, state):
        # awaited: the run's last event, which the test reads as soon as the run returns (a message from
        # this actor and one from the test to the log actor are not ordered)
        ray.get(_log().add.remote("checkpoint", self.version, state["data"]["pos"]))
        return f"{directory}/step_{step}"


class Tracker:
    run_id = "test"
    checkpoint_dir = "runs/test"

    def __init__(self):
        self.metrics = {}

    def log_metrics(self, m, step):
        self.metrics[step] = dict(m)

    def log_trajectories(self, *a, **k): ...

    def log_checkpoint(self, *a): ...

    def flush_traces(self): ...

    def log_tool_calls(self, *a): ...


class Quiet:
    def __getattr__(self, name):
        return lambda *a, **k: None


@pytest.fixture(scope="module")
def tiny_plan():
    from factory.compiler.compile import compile_file

    return compile_file(str(REPO / "specs/tiny.yaml"))[1]


STAND_INS = {"data": FakeData, "rollout": FakeRollout, "reward": FakeReward, "update": FakeUpdate, "tools": FakeData}


@pytest.fixture(scope="module")
def stand_ins(local_ray):
    """The stand-in stages' actors, started once for the module (starting an actor takes a second or two)."""
    log = ray.remote(Log).options(name="stream-test-log").remote()
    actors = {name: ray.remote(cls).remote() for name, cls in STAND_INS.items()}
    yield log, actors
    for actor in (log, *actors.values()):
        ray.kill(actor)


def _run(plan, stand_ins, staleness: int, steps: int = 4, checkpoint_every: int = 0, checkpoint_every_s: float = 1800.0):
    import dataclasses

    from factory.runtime.driver import train_loop

    train = plan.driver.train.model_copy(update={"max_staleness": staleness, "steps": steps,
                                                 "checkpoint_every": checkpoint_every,
                                                 "checkpoint_every_s": checkpoint_every_s})
    plan = dataclasses.replace(plan, driver=plan.driver.model_copy(update={"train": train}))
    log, actors = stand_ins
    ray.get([actor.reset.remote() for actor in (log, *actors.values())])
    g = {s.name: Group(s, STAND_INS[s.name], [actors[s.name]]) for s in plan.stages}
    tracker = Tracker()
    train_loop(g, plan, tracker, Quiet(), Quiet())
    return tracker.metrics, ray.get(log.read.remote())


def _times(events, kind):
    return {n: t for k, n, *_, t in events if k == kind}


def test_max_staleness_0_runs_each_rollout_after_the_previous_update_and_its_weight_sync(tiny_plan, stand_ins):
    metrics, events = _run(tiny_plan, stand_ins, staleness=0, steps=3)
    order = [(k, n) for k, n, *_ in events if k in ("rollout", "update", "load")]
    assert order == [("rollout", 1), ("update", 1), ("load", 1), ("rollout", 2), ("update", 2), ("load", 2),
                     ("rollout", 3), ("update", 3), ("load", 3)]
    assert [metrics[s]["train/staleness"] for s in (1, 2, 3)] == [0.0, 0.0, 0.0]
    assert [metrics[s]["actor/version"] for s in (1, 2, 3)] == [1.0, 2.0, 3.0]
    assert all("rollout/logprob_diff_mean" in metrics[s] for s in (1, 2, 3))
    for m in (metrics[s] for s in (1, 2, 3)):  # the update's own time, as today
        assert m["timing/update_s"] == UPDATE_S and m["timing/overhead_s"] > -0.05


def test_max_staleness_1_overlaps_the_next_rollout_with_the_update(tiny_plan, stand_ins):
    metrics, events = _run(tiny_plan, stand_ins, staleness=1, steps=4, checkpoint_every=2)
    rollouts, updated = _times(events, "rollout"), _times(events, "updated")
    # the rollout of step 2 (and 4) started before the update of step 1 (and 3) ended
    assert rollouts[2] < updated[1] - UPDATE_S / 2 and rollouts[4] < updated[3] - UPDATE_S / 2
    # step 2 waits for its checkpoint: step 3 samples with step 2's weights (on-policy), as a resumed run would
    assert rollouts[3] > updated[2]
    assert [metrics[s]["train/staleness"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 0.0, 1.0]
    assert [metrics[s]["actor/version"] for s in (1, 2, 3, 4)] == [1.0, 2.0, 3.0, 4.0]  # each step its own update
    # the learner/sampler gap of a step that sampled with older weights holds the policy's drift: named apart
    assert [sorted(k for k in metrics[s] if "logprob_diff" in k) for s in (1, 2)] == [
        ["rollout/logprob_diff_mean"], ["rollout/stale_logprob_diff_mean"]]
    # weights reach the rollout in order, each before the rollout that needs it
    loads = [(e[1], e[-1]) for e in events if e[0] == "load"]
    assert [n for n, _ in loads] == [1, 2, 3, 4] and loads[0][1] < rollouts[3] and loads[2][1] > rollouts[4]
    # a checkpoint holds that step's update and the data position after its batch (2 prompts a step)
    assert [e[1:3] for e in events if e[0] == "checkpoint"] == [(2, 4), (4, 8)]
    for m in (metrics[s] for s in (1, 2, 3, 4)):  # the step's parts stay apart: update_s is what it waited for
        assert m["timing/update_busy_s"] == UPDATE_S and m["timing/update_s"] <= m["timing/step_s"]
        assert m["timing/overhead_s"] > -0.05
    # step 3 waited for no update (update 3 ran behind rollout 4); step 2 for the end of update 1, which ran
    # behind rollout 2 (2 x GAP_S), and update 2 (its checkpoint needs it) but for the part that ran while update
    # 1's weights were loaded, which is weight_sync_s (on a loaded machine update 1 ends before rollout 2 does,
    # update 2 starts at its submission, and the wait alone was 0.786 s of UPDATE_S = 0.8)
    assert metrics[3]["timing/update_s"] == 0.0
    assert UPDATE_S - 0.05 < metrics[2]["timing/update_s"] + metrics[2]["timing/weight_sync_s"]
    assert metrics[2]["timing/update_s"] < 2 * UPDATE_S - GAP_S


class WeightsHolder(StageActor):
    """A rollout stand-in that keeps the weights it is sent."""

    CONTRACT = Contract(calls={"load_weights": Call("all")})

    def __init__(self, settings=None):
        self.weights = None

    def load_weights(self, weights):
        self.weights = weights

    def read(self):
        return self.weights


def test_max_staleness_0_trains_bit_for_bit_what_the_sequential_loop_trained(local_ray, small_path, monkeypatch):
    """The overlap machinery at 0 (`Updates`: the update and its weights fetched at once, then awaited and
    loaded) gives the real learner's weights and statistics of the loop before it (call the update, then
    `sync_weights`), bit for bit, over two steps. On the tiny Qwen3 with a 5k vocab (small_path): what is
    compared is the machinery's order of calls, which a 152k-wide lm_head only slows. With an object store
    (said to be) smaller than a sync, the run is told so once, when the first sync's size is reported."""
    import torch

    from factory.runtime.driver import Updates, sync_weights

    said: list[str] = []
    from tests.test_update import batch
    from tests.test_update import make_spec as update_spec

    spec = update_spec(small_path)
    plan = SimpleNamespace(flow=lambda _: [Edge("reward", "update", "scored_trajectories", method="step")],
                           edges=[Edge("update", "rollout", "weights", "weight_sync", method="load_weights",
                                       fetch="state_dict")], driver=SimpleNamespace(train=spec.train))

    def stages():
        update = start_group(Stage("update", "test", "factory.update.stage:UpdateStage",
                                   stage_settings(spec)["update"], (), ()))
        holder = Group(Stage("rollout", "test", "x:Holder", None, (), ()), WeightsHolder,
                       [ray.remote(WeightsHolder).remote()])
        return {"update": update, "rollout": holder}

    before, after = stages(), stages()
    after["update"].store_bytes = 1e6  # (as place read it) 1 MB: less than the tiny model's weights
    # both learners set up at once (each its own world of one), as the driver sets up its stages
    setups = [setup_group(g["update"], {}) for g in (before, after)]
    for g, refs in zip((before, after), setups):
        g["update"].info = ray.get(refs)
    updates = Updates(after, plan, synced=0, warn=said.append)
    try:
        initial = ray.get(before["update"].submit("state_dict"))[0]
        for step in (1, 2):
            trajs = batch(seed=step)
            old = before["update"].call("step", trajs)
            sync_weights(before, plan)
            updates.submit(step, trajs, {"rollout/generated_tokens": 1.0}, time.perf_counter())
            ((n, _, new),) = updates.finish(drain=False)
            assert n == step and new.pop("train/staleness") == 0.0
            same = [k for k in old if not k.startswith(("timing/", "perf/"))]
            assert len(same) > 8 and {k: new[k] for k in same} == {k: old[k] for k in same}
            # step 2's update reports the sync after step 1: said then, and only then
            mb = new.get("perf/weight_sync_mb")
            assert (mb is None) == (step == 1) and len(said) == step - 1
        assert f"one weight sync is {mb:.0f} MB, more than Ray's object store holds (1 MB)" in said[0]
        a, b = (ray.get(g["rollout"].actors[0].read.remote()) for g in (before, after))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert any(not torch.equal(a[k], initial[k]) for k in a)  # the two steps did train
    finally:
        for g in (before, after):
            teardown(g)  # every stage closed, the real update's engine and process group included


class Closes(StageActor):
    """A stage stand-in that records its close() in the test's log actor."""

    def __init__(self, name):
        self.name = name

    def close(self):
        ray.get(ray.get_actor("teardown-log").add.remote("closed", self.name))


def test_teardown_closes_every_stage_the_update_included(tiny_plan, local_ray):
    """teardown asks every stage to close -- not only those that happen to have a `close` -- before the
    actors go: the trainer's process group, the engines and the tool servers all get their chance."""
    log = ray.remote(Log).options(name="teardown-log").remote()
    try:
        groups = {s.name: Group(s, Closes, [ray.remote(Closes).remote(s.name)]) for s in tiny_plan.stages}
        # started first, as a run's stages are before its teardown: teardown's 30 s are for the closes, and five
        # workers starting on a loaded 2-core machine took longer (none had closed: a CI failure, AVX2-emulated)
        ray.get([a.__ray_ready__.remote() for g in groups.values() for a in g.actors])
        teardown(groups)
        closed = [event[1] for event in ray.get(log.read.remote())]
        assert sorted(closed) == sorted(s.name for s in tiny_plan.stages)
        assert tiny_plan.flow("data")[-1].dst in closed  # the trainer's
    finally:
        ray.kill(log)


class FailsToStart(StageActor):
    """A stage stand-in whose setup raises what its settings name: a tool server that will not start, or
    bad input (a UserError)."""

    def __init__(self, settings):
        self.error = settings

    def setup(self, placement=None):
        import os

        from factory.util import UserError

        if self.error == "dies":  # as the OOM killer or a crash in native code ends it
            os._exit(9)
        raise (UserError if self.error == "user" else RuntimeError)("calc: tool server 'calc' failed to start")


def test_a_stage_that_cannot_start_stops_the_run_with_one_line_naming_it(tiny_plan, local_ray):
    """A setup that raises ends `place` with the stage and the cause in one message (`factory run` exits
    3 with it), not Ray's remote traceback as an internal error; bad input stays a UserError (exit 2)."""
    import dataclasses

    from factory.runtime.driver import place
    from factory.runtime.health import StageStartError
    from factory.util import UserError

    def plan(error):
        stage = Stage("tools", "test", "tests.test_overlap:FailsToStart", error, (), ())
        return dataclasses.replace(tiny_plan, stages=(stage,), edges=())

    with pytest.raises(StageStartError) as caught:
        place(plan("infra"))
    assert str(caught.value) == ("stage 'tools' did not start: RuntimeError: calc: tool server 'calc' failed to "
                                 "start")
    with pytest.raises(UserError) as caught:
        place(plan("user"))
    # the stage's own error, not Ray's wrapper of it (whose text, in Python, is the remote traceback)
    assert type(caught.value) is UserError and str(caught.value) == ("stage 'tools': calc: tool server 'calc' "
                                                                     "failed to start")
    with pytest.raises(StageStartError, match=r"^stage 'tools' did not start: its process ended \(ActorDiedError"):
        place(plan("dies"))


class HalfStarts(StageActor):
    """A stage stand-in of two replicas: replica 0's setup fails at once (its GPU out of memory), replica 1's
    goes on for a minute (a model still loading, or a world's rank waiting in a collective for rank 0)."""

    def __init__(self, settings):
        pass

    async def setup(self, placement=None):  # (async: teardown's close is answered while replica 1 waits)
        if placement.rank == 0:
            raise RuntimeError("replica 0: CUDA out of memory")
        await asyncio.sleep(60)
        return {}


class SlowerSecond(StageActor):
    """Replica 0 is set up at once, replica 1 after `settings` seconds (engines load at different speeds)."""

    def __init__(self, settings):
        self.seconds = settings

    def setup(self, placement=None):
        if placement.rank == 1:
            time.sleep(self.seconds)
        return {}


class WorldRank0Fails(StageActor):
    """A torch.distributed world (the update stage) whose rank 0 process ends (the OOM killer, a native crash)
    before it answers `address`, or (settings "hangs") never answers."""

    CONTRACT = Contract(world=True)

    def __init__(self, settings):
        self.hangs = settings == "hangs"

    async def address(self):  # (async: teardown's close is answered while it hangs)
        import os

        if self.hangs:
            await asyncio.sleep(60)
        os._exit(9)


def _two_replicas(plan, cls: str, settings=None):
    import dataclasses

    stage = Stage("update", "test", f"tests.test_overlap:{cls}", settings, (), (), replicas=2)
    return dataclasses.replace(plan, stages=(stage,), edges=())


def test_a_replica_whose_setup_failed_fails_the_start_at_once_with_its_error(tiny_plan, local_ray):
    """place waited for every replica of a stage before it looked at any: one whose setup had failed was only
    reported once the others were done, and a world's other ranks wait for it until the stage's timeout, so
    the user saw a StageTimeout, never the error."""
    from factory.runtime.deadlines import Deadlines
    from factory.runtime.driver import place
    from factory.runtime.health import StageStartError

    with pytest.raises(StageStartError, match=r"^stage 'update' did not start: RuntimeError: replica 0: CUDA out "
                                              r"of memory$"):
        place(_two_replicas(tiny_plan, "HalfStarts"), deadlines=Deadlines(limit_s=30))


def test_place_does_not_spin_while_one_replica_is_still_setting_up(tiny_plan, local_ray, monkeypatch):
    """place waited again on the replicas already set up, which returns at once: 85814 ray.wait calls in
    4.9 s, a core busy while an engine loaded."""
    from factory.runtime.deadlines import POLL_S
    from factory.runtime.driver import object_store_bytes, place

    waits = []
    real = ray.wait
    monkeypatch.setattr(ray, "wait", lambda *a, **k: (waits.append(1), real(*a, **k))[1])
    t0 = time.monotonic()
    groups = place(_two_replicas(tiny_plan, "SlowerSecond", 2.0))
    took = time.monotonic() - t0
    teardown(groups)
    assert {g.store_bytes for g in groups.values()} == {object_store_bytes()}  # read once, for the weight syncs
    assert len(waits) <= 2 * took / POLL_S + 10, (len(waits), took)  # a poll every POLL_S, and one when answered


def test_a_world_whose_rank_0_gave_no_address_is_a_stage_start_error(tiny_plan, local_ray, monkeypatch):
    """`factory run` exits 3 with StageStartError for a stage whose process ended during setup; a world stage's
    rank 0 ending before `address` answered, or never answering, escaped place as Ray's own error (exit 1,
    "internal error")."""
    from factory.runtime import driver
    from factory.runtime.health import StageStartError

    with pytest.raises(StageStartError, match=r"^stage 'update' did not start: its process ended \(ActorDiedError"):
        driver.place(_two_replicas(tiny_plan, "WorldRank0Fails"))
    monkeypatch.setattr(driver, "ADDRESS_TIMEOUT_S", 1)
    with pytest.raises(StageStartError, match=r"^stage 'update' did not start: its rank 0 gave no address for its "
                                              r"torch.distributed world within 1 s$"):
        driver.place(_two_replicas(tiny_plan, "WorldRank0Fails", "hangs"))


@pytest.mark.slow
def test_a_tiny_run_with_max_staleness_1_completes_and_logs_its_staleness(tmp_path):
    """The whole stack (Ray, the calculator MCP server, DeepSpeed, MLflow) at max_staleness 1: ~3 min here."""
    from mlflow.tracking import MlflowClient

    from tests.tracked_runs import ENGINE, factory, project_copy

    work, uri = project_copy(tmp_path / "work"), f"sqlite:///{tmp_path}/mlflow.db"
    out = factory("run", "specs/tiny.yaml", "train.steps=4", "train.max_staleness=1", f"rollout.engine={ENGINE}",
                  cwd=work, uri=uri)
    assert out.returncode == 0, out.stderr[-4000:]
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])

    def history(key):
        return [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]

    assert history("train/staleness") == [0.0, 1.0, 1.0, 1.0]  # the last step waits for its update, not its rollout
    assert len(history("rollout/logprob_diff_mean")) == 1 and len(history("rollout/stale_logprob_diff_mean")) == 3
    assert len(history("timing/update_busy_s")) == 4 and len(history("actor/pg_loss")) == 4
    assert (work / "runs" / "tiny" / "newest" / "step_4" / "hf" / "model.safetensors").exists()


class Stuck(StageActor):
    """A stage whose `step` never answers (a hung engine); its stream yields one group, then hangs."""

    CONTRACT = Contract(calls={"step": Call("all"), "generate": Call("split", stream="generate_parts")})
    split = staticmethod(RolloutStage.split)

    def __init__(self, settings=None):
        pass

    async def step(self, trajs, **context):
        await asyncio.sleep(3600)

    async def generate_parts(self, batch: pa.Table, first_index: int = 0, **context):
        yield 2
        yield []
        await asyncio.sleep(3600)


class Working(StageActor):
    """A rollout that computes for WORK_S before its first part, its engine stepping every 0.05 s (a batch of
    long first turns on a busy CPU); with `stall`, its engine stops stepping after the first steps."""

    CONTRACT = Contract(calls={"generate": Call("split", stream="generate_parts")}, progress=True)
    split = staticmethod(RolloutStage.split)

    def __init__(self, settings=None):
        self.steps = 0

    async def generate_parts(self, batch: pa.Table, first_index: int = 0, *, stall: bool = False, **context):
        yield 1
        for _ in range(int(WORK_S / 0.05)):
            await asyncio.sleep(0.05)
            self.steps += 0 if stall and self.steps >= 3 else 1
        yield []
        yield [], time.time()

    async def progress(self):
        return 0, 1, self.steps

    @staticmethod
    def merge(parts):
        return parts


WORK_S = 2.5


def test_a_stage_whose_engine_steps_is_not_timed_out_before_its_first_part(local_ray):
    """The deadline (1 s) is shorter than the time to the first part (WORK_S): the engine's steps, polled
    through `progress`, are the heartbeat. An engine that stops stepping is timed out all the same."""
    from factory.runtime.deadlines import Deadlines, StageTimeout

    actors = [ray.remote(Working).remote() for _ in range(2)]
    ray.get([a.__ray_ready__.remote() for a in actors])
    working, stalled = (Group(Stage("rollout", "test", "tests.test_overlap:Working", None, (), ()), Working, [a],
                              deadlines=Deadlines(limit_s=1.0)) for a in actors)
    t0 = time.monotonic()
    working.stream("generate", pa.table({"i": [0]}), part="trajectory", on_part=lambda _: None, step=1)
    assert time.monotonic() - t0 > WORK_S
    with pytest.raises(StageTimeout, match=r"stage 'rollout' did not answer generate \(step 1\) within 1 s"):
        stalled.stream("generate", pa.table({"i": [0]}), part="trajectory", on_part=lambda _: None, step=1,
                       stall=True)
    for a in actors:
        ray.kill(a)


def test_a_stage_that_never_answers_fails_the_run_naming_it_and_what_it_did(local_ray):
    from factory.runtime.deadlines import Deadlines, StageTimeout

    # Both actors are up before the 1 s deadlines start: on a loaded machine a worker process alone takes
    # longer to start, and the rollout's first group would then arrive after its deadline.
    actors = [ray.remote(Stuck).remote() for _ in range(2)]
    ray.get([a.__ray_ready__.remote() for a in actors])
    stuck = Group(Stage("update", "test", "tests.test_overlap:Stuck", None, (), ()), Stuck, [actors[0]],
                  deadlines=Deadlines(limit_s=1.0))
    t0 = time.monotonic()
    with pytest.raises(StageTimeout, match=r"stage 'update' did not answer step \(step 3\) within 1 s "
                                           r"\(train.stage_timeout_s\); waited 1 s"):
        stuck.call("step", [], step=3)
    rollout = Group(Stage("rollout", "test", "tests.test_overlap:Stuck", None, (), ()), Stuck,
                    [actors[1]], deadlines=Deadlines(limit_s=1.0))
    with pytest.raises(StageTimeout, match=r"stage 'rollout' did not answer generate \(step 2\) .*its last "
                                           r"progress: 1 groups done"):
        rollout.stream("generate", pa.table({"i": [0, 1]}), part="group", on_part=lambda _: None, step=2)
    assert time.monotonic() - t0 < 6
    for g in (stuck, rollout):
        ray.kill(g.actors[0])


def test_a_stage_that_makes_progress_is_not_timed_out(local_ray):
    """A heartbeat: the stand-in rollout's parts arrive GAP_S apart, 3 x GAP_S in all, past a 2 x GAP_S
    deadline that each part starts again; a call's time then sets the next deadline of its kind."""
    from factory.runtime.deadlines import FLOOR_S, Deadlines

    rollout, reward = _groups({"len": {"fn": f"{FNS}:length"}, "total": {"sum": {"len": 1.0}}})
    # the replicas up before the 0.6 s deadlines start (a worker process can take longer to start on 2 cores)
    ray.get([a.__ray_ready__.remote() for a in rollout.actors])
    rollout.deadlines = reward.deadlines = Deadlines(limit_s=2 * GAP_S)
    trajs, _ = pipe(rollout, "generate", reward, "score", pa.table({"i": list(range(5))}), part="trajectory",
                    progress=lambda *a: None, step=1)
    assert len(trajs) == 5 * GROUP
    assert rollout.deadlines.longest["rollout.generate"] > 2 * GAP_S
    assert Deadlines(limit_s=3600, longest={"a.b": 100.0}).budget("a.b") == 500.0
    assert Deadlines(limit_s=3600, longest={"a.b": 1.0}).budget("a.b") == FLOOR_S
    assert Deadlines(limit_s=300, longest={"a.b": 100.0}).budget("a.b") == 300


def test_a_checkpoint_every_so_many_seconds(tiny_plan, stand_ins):
    """`train.checkpoint_every_s`: with a limit shorter than any step (it is read when the step's batch is
    scored), every step saves; with the default (1800 s) only the last does."""
    _, events = _run(tiny_plan, stand_ins, staleness=0, steps=2, checkpoint_every_s=0.01)
    assert [n for k, n, *_ in events if k == "checkpoint"] == [1, 2]
    _, events = _run(tiny_plan, stand_ins, staleness=0, steps=2)
    assert [n for k, n, *_ in events if k == "checkpoint"] == [2]


class HeldLoop(StageActor):
    """An async stage whose call holds its event loop (an async reward function calling a blocking client)."""

    CONTRACT = Contract(calls={"hold": Call("one")}, progress=True)

    def __init__(self, settings=None):
        self.work = 0

    async def hold(self, seconds: float):
        time.sleep(seconds)  # the loop is held: `progress` cannot answer meanwhile
        self.work += 1

    async def progress(self):
        return 0, 0, self.work


def test_a_stage_that_cannot_answer_progress_gives_no_heartbeat_and_no_error(local_ray, monkeypatch):
    """Polling `progress` waited 60 s and raised Ray's GetTimeoutError out of the call's deadline: a held
    event loop ended the run with a raw Ray error even when the call ended in its budget."""
    import factory.runtime.driver as driver

    monkeypatch.setattr(driver, "PROGRESS_WAIT_S", 0.2)
    g = Group(Stage("held", "test", "tests.test_overlap:HeldLoop", None, (), ()), HeldLoop,
              [ray.remote(HeldLoop).remote()])
    ray.get(g.actors[0].__ray_ready__.remote())
    held = g.actors[0].hold.remote(1.5)
    time.sleep(0.3)  # the hold has the loop
    t0 = time.monotonic()
    assert g.progress() == (0, 0, 0) and g.progress() == (0, 0, 0)  # the last counts, no error
    assert time.monotonic() - t0 < 1.0  # asked once: the second poll waits on the same answer
    ray.get(held)
    deadline = time.monotonic() + 10
    while g.progress() != (0, 0, 1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert g.progress() == (0, 0, 1)
