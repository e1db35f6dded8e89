"""Replay (`replay.run`): the recorded run's tool calls read from the store and handed to the stages that
answer tool calls, before any is placed (factory.tools.recording says how they answer). `factory run`,
`factory eval` and `factory rescore` replay alike."""
from __future__ import annotations

import dataclasses
import json
import tempfile
from typing import Any

from factory.plan import Plan, Replayed, ToolsSettings
from factory.tools.recording import REWARD, ReplayMiss
from factory.tracking.mlflow_tracker import TOOLS_IN_SERVER_ORDER
from factory.tracking.tracker import Tracker
from factory.util import UserError


def recorded_tool_calls(tracker: Tracker, plan: Plan) -> Replayed | None:
    """The tool calls recorded by the run `replay.run` names, and the tools it offered (None: no replay).
    Read before any stage is placed, so that a run that cannot be replayed (none by that name, none
    recorded) fails in seconds."""
    replay = plan.driver.replay
    if not replay.run:
        return None
    run = tracker.run(replay.run)
    rows = tracker.tool_calls(run.run_id)
    if not rows:
        raise UserError(f"replay: run {run.name} ({run.run_id}) recorded no tool calls (its tracking.record_tools "
                        "was off, or it made none)")
    # A run recorded before tools.json kept its servers' key order has sorted schemas: offered from them, the
    # prompt would differ and the replay miss where the run's servers, started, replay it (None: they start).
    ordered = run.tags.get(TOOLS_IN_SERVER_ORDER) == "true"
    replayed = Replayed(run=replay.run, rows=rows, listing=_tool_listing(tracker, run.run_id) if ordered else None,
                        on_miss=replay.on_miss)
    if replayed.on_miss == "fail" and replayed.listing is not None:  # no server started (recording.Replay)
        # the tools stage offers what the recording listed: a server it has no listing of (added since) failed
        # that stage's start, exit 3, once Ray and every stage had started (~30 s); the spec's fault, said now
        from factory.tools.toolbox import ToolStartError, recorded_listings

        for stage in plan.stages:
            if isinstance(stage.settings, ToolsSettings):
                try:
                    recorded_listings(stage.settings.tools, replayed.listing or {})
                except ToolStartError as e:
                    raise UserError(f"replay: run {run.name} ({run.run_id}): tools.{e}") from None
    return replayed


def _tool_listing(tracker: Tracker, run_id: str) -> dict[str, list[dict[str, Any]]] | None:
    """The tools the run's servers offered (its `tools.json`); None where it saved none."""
    if "tools.json" not in tracker.artifacts(run_id):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        return json.loads(tracker.download(run_id, "tools.json", tmp).read_text())


def replaying(plan: Plan, replayed: Replayed | None) -> Plan:
    """The plan whose tools stage answers from `replayed` (unchanged when None). Handed to the stage at its
    construction, not after: under `replay.on_miss: fail` it starts no tool server at all."""
    if replayed is None:
        return plan
    stages = tuple(dataclasses.replace(s, settings=s.settings.model_copy(update={"replay": replayed}))
                   if isinstance(s.settings, ToolsSettings) else s for s in plan.stages)
    return dataclasses.replace(plan, stages=stages)


# Why a run's replay misses: its model sampled otherwise. A rescore samples nothing: its trajectories are the
# recorded run's own, so a miss is a reward node's call that run never made.
RUN_WENT_ELSEWHERE = "this run went elsewhere (a changed spec, model or data)"
RESCORE_ASKED_ELSEWHERE = ("the run never made this call (a tool reward node added, renamed or changed since it ran, "
                           "or one whose arguments differ)")


def recorded_through(plan: Plan) -> int | None:
    """The last training step at which the replayed run made a tool call, in its rollout or in a tool reward
    node (None: no replay, or it made none while training): a run that trains longer misses at the step after,
    having gone nowhere else."""
    for stage in plan.stages:
        replayed = getattr(stage.settings, "replay", None)
        if isinstance(replayed, Replayed):
            origins = (str(r.get("origin", "")).removeprefix(REWARD).split("/") for r in replayed.rows)
            return max((int(o[1]) for o in origins if o[0] == "train" and len(o) > 1 and o[1].isdigit()), default=None)
    return None


def beyond_recording(run: str | None, last: int, steps: int) -> str:
    """Why a replay misses at a step after the last at which the recording made a tool call (`last`)."""
    return (f"run {run} made its last tool call at step {last}, and this run trains {steps} steps: it went on past "
            "what was recorded (replay.on_miss=live calls the tools once the recording has no answer)")


def miss_error(misses: list[str], made_in: str, run: str | None, why: str = RUN_WENT_ELSEWHERE) -> ReplayMiss:
    """What stops a replay under `replay.on_miss: fail` once the calls made in `made_in` had `misses`."""
    calls = "1 tool call" if len(misses) == 1 else f"{len(misses)} tool calls"
    return ReplayMiss(f"{made_in}: the recording of run {run} has no answer for {calls}, first "
                      f"{misses[0]}: {why}; replay.on_miss=live calls the tools instead")
