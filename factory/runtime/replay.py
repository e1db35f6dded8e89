"""Replay (`replay.run`): the recorded run's tool calls read from the store and handed to the stages that
answer tool calls, before any is placed (factory.tools.recording says how they answer). `factory run`,
`factory eval` and `factory rescore` replay alike."""
from __future__ import annotations

import dataclasses
import json
import re
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
        if of := run.tags.get("factory.rescore_of"):  # (factory.commands.rescore: it scores, it rolls nothing out)
            raise UserError(f"replay: run {run.name} ({run.run_id}) is a `factory rescore` of run {of}, which "
                            f"records no tool calls of its own: replay run {of}")
        raise UserError(f"replay: run {run.name} ({run.run_id}) recorded no tool calls (its tracking.record_tools "
                        "was off, or it made none)")
    # A run recorded before tools.json kept its servers' key order has sorted schemas: offered from them, the
    # prompt would differ and the replay miss where the run's servers, started, replay it (None: they start).
    ordered = run.tags.get(TOOLS_IN_SERVER_ORDER) == "true"
    replayed = Replayed(run=replay.run, rows=rows, listing=_tool_listing(tracker, run.run_id) if ordered else None,
                        on_miss=replay.on_miss, trained=trained_steps(run.tags, rows),
                        evaluated=evaluated_steps(tracker.artifacts(run.run_id, "eval_trajectories"), rows))
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


def _origin_steps(rows: list[dict[str, Any]], split: str) -> set[int]:
    """The steps of `split` ("train", "eval") whose rollouts or tool reward nodes made the calls in `rows`."""
    origins = (str(r.get("origin", "")).removeprefix(REWARD).split("/") for r in rows)
    return {int(o[1]) for o in origins if o[0] == split and len(o) > 1 and o[1].isdigit()}


def trained_steps(tags: dict[str, str], rows: list[dict[str, Any]]) -> int:
    """The steps the recorded run trained: its `factory.step` tag (the last step it logged; 0 where it logged
    none), or a later step whose calls were recorded before that step was logged. Not the last step whose
    recording holds a call: a step whose calls were all malformed recorded none, and was trained all the same."""
    logged = tags.get("factory.step", "")
    return max(_origin_steps(rows, "train") | ({int(logged)} if logged.isdigit() else set()), default=0)


def evaluated_steps(tables: list[str], rows: list[dict[str, Any]]) -> list[int]:
    """The steps the recorded run evaluated at: its `eval_trajectories/step_NNNNN.parquet` tables (`tables`),
    and the steps its evaluations' calls were recorded at (an evaluation whose calls were all malformed
    recorded none; one whose table was not logged still made its calls)."""
    logged = {int(m[1]) for t in tables if (m := re.fullmatch(r"(?:.*/)?step_(\d+)\.parquet", t))}
    return sorted(logged | _origin_steps(rows, "eval"))


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


def replayed_in(plan: Plan) -> Replayed | None:
    """The recording the plan's tools stage answers from (None: no replay, or not placed in the plan yet)."""
    for stage in plan.stages:
        replayed = getattr(stage.settings, "replay", None)
        if isinstance(replayed, Replayed):
            return replayed
    return None


def why_missed(replayed: Replayed | None, step: int, *, steps: int, evaluation: bool = False) -> str:
    """Why a replay missed at `step`'s rollout (`evaluation`: its evaluation) in a run of `steps` steps: the
    recorded run never got there (trained fewer steps, made no evaluation at that step), or this run went
    elsewhere."""
    if replayed is None:
        return RUN_WENT_ELSEWHERE
    if evaluation and step not in replayed.evaluated:
        at = replayed.evaluated
        made = ("it made none" if not at else f"it evaluated at step {at[0]}" if len(at) == 1
                else f"it evaluated at steps {', '.join(map(str, at))}")
        return f"run {replayed.run} made no evaluation at step {step} ({made})"
    if not evaluation and step > replayed.trained:
        trained = {0: "no steps", 1: "1 step"}.get(replayed.trained, f"{replayed.trained} steps")
        return f"run {replayed.run} trained {trained}, and this run trains {steps}: it went on past what was recorded"
    return RUN_WENT_ELSEWHERE


def miss_error(misses: list[str], made_in: str, run: str | None, why: str = RUN_WENT_ELSEWHERE) -> ReplayMiss:
    """What stops a replay under `replay.on_miss: fail` once the calls made in `made_in` had `misses`."""
    calls = "1 tool call" if len(misses) == 1 else f"{len(misses)} tool calls"
    return ReplayMiss(f"{made_in}: the recording of run {run} has no answer for {calls}, first "
                      f"{misses[0]}: {why}; replay.on_miss=live calls the tools instead")
