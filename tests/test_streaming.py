"""Streaming between stages (issue 14): a trajectory group goes to the reward stage as soon as it is
complete, so scoring overlaps generation. The driver's own `Group.stream` and `pipe`, on real Ray actors:
two replicas of a stand-in rollout stage (groups finish one by one) and the real reward stage."""
from __future__ import annotations

import asyncio
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pytest
import ray

from factory.compiler.compile import stage_settings
from factory.driver import Group, carry, pipe, setup_group, start_group
from factory.plan import Edge, Stage
from factory.rollout.stage import RolloutStage
from factory.types import Trajectory
from tests.test_reward_stage import make_spec

REPO = Path(__file__).resolve().parents[1]
FNS = "tests.fixtures.reward_fns"
GROUP, GAP_S = 2, 0.4  # samples per prompt; a replica's groups finish this far apart


class SteppedRollout:
    """A rollout replica whose groups finish GAP_S apart (the real stage's streaming contract: one item per
    prompt, then its answer), with the split and merge of the real stage."""

    SHARDED = frozenset({"generate"})
    STREAMS = {"generate": "generate_groups"}
    split = staticmethod(RolloutStage.split)

    def __init__(self, settings=None):
        self.done = 0

    async def generate_groups(self, batch: pa.Table, first_index: int = 0, *, step: int = 0, attempt: int = 0):
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
            yield group
        yield trajs, time.time()

    async def progress(self):
        return self.done, self.done

    @staticmethod
    def merge(parts):
        return [t for trajs, _ in parts for t in trajs], {"timing/rollout_s": 1.0, "test/ended_at": max(e for _, e in parts)}


@pytest.fixture(scope="module")
def local_ray():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="factory-stream-"),
             object_store_memory=200 * 2**20, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})  # the stand-in stage lives in tests/
    yield
    ray.shutdown()


def _groups(rewards: dict) -> tuple[Group, Group]:
    rollout = Group(Stage("rollout", "test", "tests.test_streaming:SteppedRollout", None, (), ()), SteppedRollout,
                    [ray.remote(SteppedRollout).remote() for _ in range(2)])
    reward = start_group(Stage("reward", "test", "factory.reward.stage:RewardStage",
                               stage_settings(make_spec(rewards))["reward"], (), ()))
    reward.info = ray.get(setup_group(reward, {}))
    return rollout, reward


def test_groups_are_scored_while_the_rollout_still_generates(local_ray):
    rollout, reward = _groups({"at": {"fn": f"{FNS}:scored_at"}, "len": {"fn": f"{FNS}:length"},
                               "total": {"sum": {"len": 1.0}}})
    batch = pa.table({"i": list(range(5))})  # 5 prompts over 2 replicas: 2 + 3, the last ends at 3 x GAP_S
    progress = []
    trajs, m = pipe(rollout, "generate", reward, "score", batch, progress=lambda *a: progress.append(a), step=1)

    ended = m["test/ended_at"]
    scored = {t.prompt_index: t.rewards["at"] for t in trajs}
    # the first groups (one per replica, after GAP_S) were scored about 2 x GAP_S before the rollout ended
    assert min(scored.values()) < ended - 1.5 * GAP_S, (scored, ended)
    assert [(t.prompt_index, t.sample_index) for t in trajs] == [(p, s) for p in range(5) for s in range(GROUP)]
    # the step's metrics describe the whole batch: means over all 10 trajectories, counts added up
    assert m["rewards/len/mean"] == pytest.approx(statistics.fmean(p + s for p in range(5) for s in range(GROUP)))
    assert m["reward/mean"] == pytest.approx(m["rewards/len/mean"]) and m["reward/dropped"] == 0.0
    # timing/reward_s: only the scoring after the rollout ended (the last group's), within the wall span
    assert 0 <= m["timing/reward_s"] < m["timing/reward_wall_s"] and m["timing/reward_s"] < GAP_S
    assert m["timing/rollout_s"] == 1.0 and progress and progress[-1][0] <= 5 * GROUP


def test_carry_streams_along_a_stream_edge_and_calls_whole_batches_otherwise(local_ray):
    rollout, reward = _groups({"at": {"fn": f"{FNS}:scored_at"}, "total": {"sum": {"at": 1.0}}})

    class Source:  # the data stage's part: fetch a batch
        SHARDED = frozenset()

    class Display:
        def progress(self, *a): ...
        def done(self): ...

    data = Group(Stage("data", "test", "x:Data", None, (), ()), Source, [ray.remote(_Data).remote()])
    g = {"data": data, "rollout": rollout, "reward": reward}
    edges = [Edge("data", "rollout", "batch", method="generate", fetch="next_batch"),
             Edge("rollout", "reward", "trajectories", method="score", stream=True)]
    trajs, m = carry(g, edges, 4, display=Display(), label="step 1", step=1)
    assert len(trajs) == 4 * GROUP and min(t.reward for t in trajs) < m["test/ended_at"] - GAP_S / 2
    assert math.isfinite(m["timing/reward_wall_s"])


class _Data:
    def next_batch(self, n):
        return pa.table({"i": list(range(n))})


def test_a_replica_that_fails_mid_stream_fails_the_call_with_its_error(local_ray):
    rollout, reward = _groups({"total": {"fn": f"{FNS}:length"}})
    with pytest.raises(ray.exceptions.RayTaskError, match="the engine broke mid-batch"):
        pipe(rollout, "generate", reward, "score", pa.table({"fail": [0, 1, 2, 3]}), progress=lambda *a: None)
