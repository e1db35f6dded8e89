"""`factory rescore RUN --spec NEW.yaml [--steps 1,3-5]`: score a finished run's saved trajectories again
with another reward graph -- no new rollouts -- as a new MLflow run tagged `factory.rescore_of = RUN`.

Every `factory run` saves all of each step's trajectories in the step's table, with what a reward needs: the prompt, the completion, the data row and the structured turns. Rescoring reads them
back, evaluates the new spec's reward graph with the same reward stage (so judges, gates, `on_missing`
and the metrics are exactly those of a run), and logs the same per-node metrics at the same steps:
`rewards/<node>/*` and `reward/mean` for training steps, `eval/<metric>` for evaluations. The new run's
trajectory tables hold the re-scored trajectories, so it can be compared (`factory diff`) or rescored again.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import tempfile
from dataclasses import dataclass
from typing import Any

from factory.plan import Plan
from factory.reward.graph import eval_metrics
from factory.tracking.tracker import Tracker
from factory.types import ToolCall, ToolResult, Trajectory, Turn
from factory.util import UserError, stdout_console

SPLITS = {"train": "trajectories", "eval": "eval_trajectories"}  # split -> the run's artifact folder
_STEP_FILE = re.compile(r"step_(\d+)\.parquet$")


class RescoreError(UserError):
    """The run cannot be rescored as asked (no such run, no saved trajectories, steps not saved)."""


@dataclass
class Rescored:
    run_id: str  # the new MLflow run
    rescore_of: str
    metrics: dict[tuple[str, int], dict[str, float]]  # (split, step) -> the new run's metrics
    notes: list[str]  # what the user should know (steps saved only in part)


# ------------------------------------------------------------------------------- records -> trajectories
def trajectory_from_record(r: dict[str, Any]) -> Trajectory:
    """A trajectory as `factory.tracking.mlflow_tracker.trajectory_records` saved it (the inverse of that function)."""
    turns = [Turn(text=t["text"], num_tokens=t["num_tokens"], calls=[ToolCall(**c) for c in t["calls"]],
                  results=[ToolResult(**x) for x in t["results"]]) for t in json.loads(r["turns"])]
    return Trajectory(prompt_index=r["prompt_index"], sample_index=r["sample_index"], prompt_ids=list(r["prompt_ids"]),
                      response_ids=list(r["response_ids"]), loss_mask=list(r["loss_mask"]), turns=turns,
                      sampler_logprobs=list(r.get("sampler_logprobs") or []),
                      stop_reason=r["stop_reason"], row=json.loads(r["row"]), messages=json.loads(r["prompt"]),
                      completion=r["completion"], infra_error=r["infra_error"], truncated=r["truncated"],
                      # (none in a table saved before trajectories kept it: their reward calls replay in order)
                      origin=r.get("origin") or "")


def parse_steps(text: str) -> set[int]:
    """`1,3-5` -> {1, 3, 4, 5}; raises ValueError on anything else."""
    steps: set[int] = set()
    for part in text.split(","):
        found = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not found:
            raise ValueError(f"not a step or a range of steps: '{part}'")
        first, last = int(found[1]), int(found[2] or found[1])
        if last < first:
            raise ValueError(f"empty range of steps: '{part}'")
        steps.update(range(first, last + 1))
    return steps


def _saved(tracker: Tracker, run_id: str, folder: str) -> dict[int, str]:
    """step -> artifact path of the run's saved trajectory tables in `folder`."""
    return {int(m[1]): path for path in tracker.artifacts(run_id, folder) if (m := _STEP_FILE.search(path))}


def _load(tracker: Tracker, run_id: str, steps: set[int] | None,
          notes: list[str]) -> dict[tuple[str, int], list[Trajectory]]:
    """The run's saved trajectories by (split, step); a table that cannot be read is passed over, and `notes`
    hears which."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    found = {(split, step): path for split, folder in SPLITS.items()
             for step, path in _saved(tracker, run_id, folder).items() if steps is None or step in steps}
    if not found:
        raise RescoreError(f"run {run_id} has no saved trajectories" + (
            f" at steps {_shown(steps)}" if steps else ""))
    if steps and (absent := steps - {step for _, step in found}):
        raise RescoreError(f"run {run_id} saved no trajectories at steps {_shown(absent)}")
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for (split, step), path in sorted(found.items(), key=lambda kv: (kv[0][1], kv[0][0] != "eval")):
            # A store that fails the download (requests' errors are OSErrors) stops the rescore: the table
            # may be whole, and passing its step over would log a run short of it.
            local = tracker.download(run_id, path, tmp)
            try:
                table = pq.read_table(local)
            except (pa.ArrowInvalid, OSError) as e:  # a driver killed while it copied the table into the store
                notes.append(f"run {run_id}'s {split} table of step {step} ({path}) cannot be read, cut short or "
                             f"damaged: that step was not rescored ({e})")
                continue
            if "turns" not in table.column_names:
                raise RescoreError(f"run {run_id} saved its trajectories without their data rows and turns (it "
                                   "was made before `factory rescore` existed): it cannot be rescored")
            out[split, step] = [trajectory_from_record(r) for r in table.to_pylist()]
    if not out:
        raise RescoreError(f"none of run {run_id}'s saved trajectory tables can be read: " + "; ".join(notes))
    return out


def _shown(steps: set[int]) -> str:
    return ", ".join(str(s) for s in sorted(steps))


# ------------------------------------------------------------------------------------------- scoring
def scorer(plan: Plan) -> str:
    """The stage that scores a batch: the one whose answer the trainer receives."""
    return plan.flow("data")[-1].src


async def _score_all(plan: Plan, batches: dict[tuple[str, int], list[Trajectory]],
                     placed: dict[str, Any]) -> dict[tuple[str, int], dict]:
    """The plan's scoring stage in this process with the callees that may run inline (tool servers), calling
    the `placed` ones (local judge models on Ray: stage name -> actor) along the plan's call edges. Under a
    replay with `on_miss: fail` a batch whose tool calls the recording could not answer stops the rescore,
    as it stops a run."""
    from factory.runtime.local import callees, local_stages, records_tools
    from factory.runtime.replay import RESCORE_ASKED_ELSEWHERE, miss_error

    name = scorer(plan)
    inline = [c for c in callees(plan, name) if c not in placed]
    recorders = [c for c in inline if records_tools(plan, c)]
    out = {}
    async with local_stages(plan, [*inline, name], remote=placed) as stages:
        # each batch under its own step: the stage warns once per node and step, naming the step
        for (split, step), trajs in batches.items():
            out[(split, step)] = (await stages[name].score(trajs, step=step))[1]
            for recorder in recorders:
                misses = (await stages[recorder].take_recording())["misses"]
                if misses and plan.driver.replay.on_miss == "fail":
                    raise miss_error(misses, f"step {step}" + (" evaluation" if split == "eval" else ""),
                                     plan.driver.replay.run, RESCORE_ASKED_ELSEWHERE)
    return out


def rescore(run_id: str, plan: Plan, *, uri: str, steps: set[int] | None = None) -> Rescored:
    """Score run `run_id`'s saved trajectories with `plan`'s reward graph and log a new MLflow run."""
    from factory.runtime.replay import recorded_tool_calls, replaying
    from factory.tracking.tracker import RunLookupError, open_tracker, reading

    store = open_tracker(uri, read=True)
    with reading(uri):  # (a store that goes down after it answered: exit 3, as one down from the start)
        try:
            old = store.run(run_id)
        except RunLookupError as e:  # the tracker's words: no such run, a name two runs share, a prefix too short
            raise RescoreError(str(e)) from None
        run_id = old.run_id  # as given: an id, an id prefix or a run name
        tracker = open_tracker(uri, store.experiment_name(old.experiment_id))  # the new run goes beside the old
        notes: list[str] = []
        batches = _load(tracker, run_id, steps, notes)
        plan = replaying(plan, recorded_tool_calls(store, plan))  # replay.run: the tool nodes' calls answered from it
        # (the driver's `collect` logs this metric at every step of a run with dynamic sampling, and only there)
        trained = any(split == "train" for split, _ in batches)
        dynamic = trained and store.metric_history(run_id, "rollout/dynamic_sampling_rounds")
    if note := unfinished_note(old.status, run_id, {step for _, step in batches}):
        notes.append(note)
    if dynamic:
        notes.append(kept_groups_note(run_id))
    per_step = _int(old.params.get("train.prompts_per_step")) * _int(old.params.get("rollout.group_size"))
    for (split, step), trajs in batches.items():
        if split == "train" and per_step and len(trajs) < per_step:
            notes.append(f"step {step}: {len(trajs)} of {per_step} trajectories were saved (a run made before "
                         "every trajectory was kept); its metrics cover those")

    from factory.runtime.local import callees, runs_inline

    # a local judge model is a stage of its own: placed on Ray as `factory run` places it
    judges = [plan.stage(n) for n in callees(plan, scorer(plan)) if not runs_inline(plan, n)]
    placing: contextlib.AbstractContextManager = contextlib.nullcontext(({}, None))
    if judges:
        from factory.runtime.lifecycle import local_ray_on_loopback

        local_ray_on_loopback(plan.driver.resources.ray_address)  # before ray is imported
        from factory.runtime.display import Display
        from factory.runtime.driver import placed
        from factory.runtime.startup import Startup

        # as a run places its stages: what a killed run left ended first, a session record kept while Ray is up
        # (for the next run to end what a killed rescore leaves), everything torn down whatever happens
        placing = placed(dataclasses.replace(plan, stages=tuple(judges), edges=()), Display(0), Startup(),
                         again="`factory rescore` again rescores the run")
    with placing as (groups, _):
        scored = asyncio.run(_score_all(plan, batches, {name: g.actors[0] for name, g in groups.items()}))

    metrics: dict[tuple[str, int], dict[str, float]] = {}
    for (split, step), m in scored.items():
        metrics[(split, step)] = (m if split == "train" else eval_metrics(m, plan.metrics))

    from factory.compiler.compile import plan_json
    from factory.tracking.mlflow_tracker import run_name, run_tags

    # what identifies a run, as `factory run` tags it (spec name and hash, plan hash, what it ran on), and
    # what this one rescored; from the plan's view of the spec, as a run's, where values read from the
    # environment are masked (they never reach the store)
    shown = plan.spec
    tags = {**run_tags(plan.hashes, shown["name"], shown["tracking"]["tags"]), "factory.rescore_of": run_id,
            "factory.rescored_steps": _shown({s for _, s in batches})}
    # named apart as a run is (`factory rescore NAME` of a rescore: a name two runs share names neither)
    name = tracker.free_name(run_name(f"{shown['name']}-rescore"))
    # (the algorithm's params as a run records them: the preset's choices, not the nulls it filled in)
    tracker.start(name, plan.filled_spec, tags, {"plan.json": plan_json(plan), "spec.yaml": plan.spec_yaml})
    try:
        for (split, step), trajs in batches.items():
            tracker.log_metrics(metrics[(split, step)], step=step)
            tracker.log_trajectories(trajs, step, split=split, traces=0)
    except BaseException:
        tracker.end("FAILED")
        raise
    tracker.end("FINISHED")
    assert tracker.run_id is not None
    return Rescored(tracker.run_id, run_id, metrics, notes)


def unfinished_note(status: str, run_id: str, steps: set[int]) -> str | None:
    """What a rescore of a run that did not finish should say: only the steps it saved were rescored."""
    return {"FINISHED": None,
            "RUNNING": f"run {run_id} is still running, or its driver was killed before it could say it ended: the "
                       f"steps it had saved were rescored ({_shown(steps)})",
            "KILLED": f"run {run_id} was stopped before its last step: the steps it saved were rescored "
                      f"({_shown(steps)})"}.get(status, f"run {run_id} ended {status}: the steps it saved were "
                                                        f"rescored ({_shown(steps)})")


def kept_groups_note(run_id: str) -> str:
    """What a rescore of a run with dynamic sampling should say: its step tables hold the groups kept for training
    only (the driver's `collect` saves no others), while its logged reward/mean is over every sampling round, so
    even the run's own graph would print a change that is not there."""
    return (f"run {run_id} used dynamic sampling: its step tables hold only the groups kept for training, while its "
            "reward/mean covers every sampling round, so 'before' and 'after' are means over different trajectories "
            "(for a 'before' over the same ones, rescore it with its own spec)")


def _int(value: str | None) -> int:
    try:
        return int(value) if value is not None else 0
    except ValueError:
        return 0


# -------------------------------------------------------------------------------------------- command
def main(args: Any) -> int:
    """`factory rescore`: compile the new spec, rescore, print old -> new per step."""
    from rich.table import Table
    from rich.text import Text

    from factory.compiler.compile import compile_file
    from factory.tracking.mlflow_tracker import stored_metric_name, tracking_uri
    from factory.tracking.tracker import open_tracker, reading

    spec, plan = compile_file(args.spec, args.overrides)
    uri = args.uri or tracking_uri(spec.tracking.uri)
    result = rescore(args.run, plan, uri=uri, steps=args.steps)
    tracker = open_tracker(uri)
    console = stdout_console()
    # names and paths as they are, never as rich markup (a run named `abl[/judge]`)
    table = Table(title=Text(f"run {args.run} rescored with {args.spec}"))
    for column in ("step", "metric", "before", "after"):
        table.add_column(column, justify="right" if column != "metric" else "left")
    with reading(uri):
        # (a metric name MLflow refuses, `eval/pass@1`, is stored under another: the old run's is looked up)
        stored = tracker.run(result.rescore_of).metrics
        for (split, step), m in sorted(result.metrics.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            for key in (["reward/mean"] if split == "train" else [k for k in m if k.startswith("eval/")]):
                before = _history(tracker, result.rescore_of, stored_metric_name(key, stored), step)
                table.add_row(str(step), Text(key), "-" if before is None else f"{before:.4f}", f"{m[key]:.4f}")
    console.print(table)
    for note in result.notes:
        console.print(f"note: {note}", markup=False)
    console.print(f"MLflow run {result.run_id} (factory.rescore_of = {args.run}) in {uri}", markup=False)
    return 0


def _history(tracker: Tracker, run_id: str, key: str, step: int) -> float | None:
    values = [value for at, value in tracker.metric_history(run_id, key) if at == step]
    return values[-1] if values else None
