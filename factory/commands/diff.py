"""`factory diff RUN_A RUN_B`: how two tracked runs differ, and how their results compare.

1. What defines each run, from its `plan.json` artifact: spec settings, chat/prompt templates, reward
   code, data, python-tool code and MCP tool schemas (hashed when the run's servers started; `tools.json`
   says which tools were added, removed or changed). A run without a plan cannot be compared: that is an
   error, never "identical".
2. A warning when the results are not comparable (different data or model; another algorithm on the same rows
   and model is what such a comparison is for).
3. Metrics side by side with deltas (B - A): final and best reward, per-node rewards, eval metrics at
   step 0 and at the end, the reward-hacking monitors (final statistic, the step each first fired), mean
   step time and its split, tokens/s.
4. For prompts both runs saw (same split and data row, however rendered), their trajectories side by side.

The pure functions (`plan_changes`, `comparability`, `metric_rows`, `common_prompts`) take plain data;
`compare` reads MLflow and returns the whole report as a JSON-ready dict (what `--json` prints).
"""
from __future__ import annotations

import json
import math
import re
import tempfile
from dataclasses import dataclass, field
from collections.abc import Iterator
from typing import Any

from factory.plan import MASK
from factory.tracking.mlflow_tracker import SESSION_TAG, flatten, setting_text
from factory.tracking.runs import run_kind, run_summary
from factory.tracking.tracker import RunLookupError, TrackedRun, Tracker, open_tracker, reading
from factory.util import stdout_console

# plan.hashes section -> the kind of change it names
_HASH_KINDS = {"templates": "template", "rewards": "reward_code", "data": "data", "code": "tool_code",
               "tools": "tool_schema"}
# spec sections whose change makes results not comparable, and how the warning names them (not the algorithm:
# GRPO against DAPO, or turn credit against trajectory credit, on the same rows and model is the comparison
# docs/algorithms.md asks for)
_NOT_COMPARABLE = {"data": "data", "model": "model"}
# keys of those sections whose change is the experiment itself, not another task or model
_COMPARABLE_WAYS = ("model.lora", "data.prompt", "data.system_prompt", "data.shuffle")
# a data file is judged by its rows (plan.hashes.data's sha256: a `data` change), not by the name it is given
# (`./data/train.jsonl` for `data/train.jsonl`, the file moved)
_JUDGED_BY_CONTENT = ("data.train.path", "data.eval.path")
# tags that describe where a run ran (not part of its plan): shown when they differ
_ENVIRONMENT = ("factory.version.", "factory.cpu", "factory.gpu", "factory.git_commit", "factory.source_commit",
                "factory.ray_cluster")
_SESSION = re.compile(r"factory\.resumed\.(\d+)\.")  # the tags of a resumed session's environment (SESSION_TAG)


class NoPlanError(RunLookupError):
    """A run has no plan.json: it was not made by `factory run`, or its upload failed."""


@dataclass
class RunRecord:
    """What diff reads of one run."""

    run: TrackedRun
    plan: dict[str, Any]
    tools: dict[str, list[dict[str, Any]]] | None  # tools.json, when the run recorded it
    trajectories: list[dict[str, Any]] = field(default_factory=list)  # rows of every step's tables, with split
    # (checkpoint step, plan) of each `--resume --allow-spec-change` (its `resumed/step_N/plan.json`), in order
    resumed: list[tuple[int, dict[str, Any]]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.run.name} ({self.run.run_id[:8]})"


# ------------------------------------------------------------------------------------------- plans
def _flat(d: Any) -> dict[str, str]:
    return dict(flatten(d)) if isinstance(d, dict) else {}


def tool_changes(a: list[dict[str, Any]] | None, b: list[dict[str, Any]] | None) -> dict[str, list[str]]:
    """Tools of one server added, removed or changed (description or input schema) from A to B."""
    ta = {t["name"]: t for t in a or []}
    tb = {t["name"]: t for t in b or []}
    shape = lambda t: (t.get("description"), json.dumps(t.get("inputSchema"), sort_keys=True))  # noqa: E731
    return {"added": sorted(set(tb) - set(ta)), "removed": sorted(set(ta) - set(tb)),
            "changed": sorted(n for n in set(ta) & set(tb) if shape(ta[n]) != shape(tb[n]))}


# What only training reads: left out when a side is an evaluation or a rescoring run (`factory eval`, `rescore`).
# (an evaluation reads data.eval's rows, a rescoring the run's saved ones: two evals of the same eval rows whose
# specs named other training files were "not comparable: different data")
TRAINING_ONLY = ("train.", "algorithm.", "data.train.")


def plan_changes(a: dict[str, Any], b: dict[str, Any], tools_a: dict[str, Any] | None = None,
                 tools_b: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every difference in what defines the two runs, as {kind, key, a, b} (plus `tools` for a tool-schema
    change when both runs recorded their listing). Kinds: setting (a spec key), template, reward_code, data,
    tool_code, tool_schema, algorithm (a preset that resolved differently under the same spec), version."""
    out: list[dict[str, Any]] = []
    sa, sb = _flat(a.get("spec")), _flat(b.get("spec"))
    # a key one spec lacks and a null say the same (unset): turning LoRA on changed `model.lora` from null to
    # absent and `model.lora.alpha` from absent to null, two rows that differed in nothing a user set
    out += [{"kind": "setting", "key": k, "a": sa.get(k), "b": sb.get(k)}
            for k in sorted(set(sa) | set(sb)) if setting_text(sa.get(k)) != setting_text(sb.get(k))]
    ha, hb = a.get("hashes", {}), b.get("hashes", {})
    settings = {c["key"] for c in out}
    for section, kind in _HASH_KINDS.items():
        fa, fb = _flat(ha.get(section, {})), _flat(hb.get(section, {}))
        if section == "tools" and (not fa or not fb):
            continue  # not recorded for one run: reported as a note, not as a change
        for k in sorted(set(fa) | set(fb)):
            # (a data file's path, a generator's name and args are in the hash as the spec gives them: one row)
            if fa.get(k) == fb.get(k) or f"{section}.{k}" in settings:
                continue
            change = {"kind": kind, "key": f"{section}.{k}", "a": fa.get(k), "b": fb.get(k)}
            if kind == "tool_schema" and tools_a is not None and tools_b is not None:
                server = k.split(".")[0]
                change["tools"] = tool_changes(tools_a.get(server), tools_b.get(server))
            out.append(change)
    if a.get("spec", {}).get("algorithm") == b.get("spec", {}).get("algorithm"):
        aa, ab = _flat(a.get("algorithm", {})), _flat(b.get("algorithm", {}))
        out += [{"kind": "algorithm", "key": f"algorithm.{k} (resolved)", "a": aa.get(k), "b": ab.get(k)}
                for k in sorted(set(aa) | set(ab)) if aa.get(k) != ab.get(k)]
    if a.get("version") != b.get("version"):
        out.append({"kind": "version", "key": "factory version", "a": a.get("version"), "b": b.get("version")})
    return out


def plan_notes(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str]) -> list[str]:
    """What the comparison cannot see: a run whose tool schemas were not hashed; values both runs read
    from the environment (recorded as *** only, so that tokens and private URLs stay out of the store)."""
    notes = []
    for plan, name in zip((a, b), names):
        if plan.get("spec", {}).get("tools") and not plan.get("hashes", {}).get("tools"):
            notes.append(f"run {name} did not record its tool schemas (its plan was compiled without the "
                         "servers): a change of tool server would not show")
    hidden = sorted(set(_masked(a.get("spec", {}))) & set(_masked(b.get("spec", {}))))
    if hidden:
        notes.append(f"{', '.join(hidden)}: read from the environment in both runs and not recorded (***), so "
                     "a difference there cannot be seen")
    return notes


def _masked(d: Any, prefix: str = "") -> Iterator[str]:
    """The dotted paths of a plan's spec whose value was read from the environment (shown as ***). A list is
    one setting (`flatten` keeps it whole), so one holding a masked value anywhere is named as a whole."""
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _masked(v, f"{prefix}{k}.")
    elif isinstance(d, list):
        if any(True for item in d for _ in _masked(item)):
            yield prefix.rstrip(".")
    elif d == MASK:
        yield prefix.rstrip(".")


def resumed_notes(side: str, plan: dict[str, Any], resumed: list[tuple[int, dict[str, Any]]]) -> list[str]:
    """What a run resumed under a changed spec (`--allow-spec-change`) changed, each time: its params and
    plan.json are those of its first spec, which the comparison above reads."""
    notes = []
    for step, later in resumed:
        shown = ", ".join(f"{c['key']} {setting_text(c['a'])} -> {setting_text(c['b'])}" if c["kind"] == "setting"
                          else c["key"]
                          for c in plan_changes(plan, later))
        notes.append(f"{side} was resumed after step {step} under a changed spec (--allow-spec-change): "
                     f"{shown or 'nothing in its plan changed'}")
        plan = later
    return notes


def evaluated_model(r: RunRecord) -> str | None:
    """The model a run evaluated: an eval run's `--model` (the tag factory.eval_model: a checkpoint's folder,
    a Hugging Face or adapter folder, a server's URL), else its spec's model.path."""
    return r.run.tags.get("factory.eval_model") or r.plan.get("spec", {}).get("model", {}).get("path")


def comparability(changes: list[dict[str, Any]]) -> list[str]:
    """Warnings when the results are not comparable: different data or model."""
    warnings = []
    for section, what in _NOT_COMPARABLE.items():
        # LoRA trains the same model another way (model.lora.*), a prompt template asks the same rows another way
        # (data.prompt, data.system_prompt; as the chat template does), data.shuffle gives the same rows in another
        # order: comparing the two is the point
        keys = [c["key"] for c in changes
                if (c["kind"] == "setting" and c["key"].split(".")[0] == section
                    and not c["key"].startswith(_COMPARABLE_WAYS) and c["key"] not in _JUDGED_BY_CONTENT)
                or c["kind"] == section]  # (a data file's sha256; an eval run's model)
        if keys:
            shown = ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
            warnings.append(f"not comparable: different {what} ({shown})")
    return warnings


def progress(runs: dict[str, TrackedRun], histories: dict[str, dict[str, list[tuple[int, float]]]]) -> list[str]:
    """Warnings when a side's "final" values are not of a finished run, or the final evaluations are of
    different steps: a run still going on, stopped or failed is compared as far as it got (its eval
    metrics' "final" may be its step-0 evaluation)."""
    out = []
    for side, run in runs.items():
        if run.status == "FINISHED" or run_kind(run) != "train":
            continue
        s = run_summary(run)
        state = run.status + (", its driver gone" if s["driver_alive"] is False else "")
        done = s["steps_done"] if s["steps_done"] is not None else "?"
        out.append(f"{side} has not finished ({state}): {done} of {s['steps'] or '?'} steps done; its final "
                   "values are those it had logged so far")
    last = {side: max((st for k, pts in h.items() if k.startswith("eval/") for st, _ in pts), default=None)
            for side, h in histories.items()}
    if None not in last.values() and len(set(last.values())) > 1:
        out.append("their final evaluations are of different steps: "
                   + ", ".join(f"{side}'s of step {step}" for side, step in last.items()))
    return out


def sessions(run: TrackedRun) -> list[tuple[int | None, dict[str, str]]]:
    """Where and how each session of the run ran, oldest first, as (the step it resumed after, None for the
    first; versions, CPU, GPU, commits, the Ray cluster and what each stage chose on its device: `resolved.*`).
    The run's own tags and params are its first session's; each resumed one is tagged `factory.resumed.N.*`
    (factory.tracking.mlflow_tracker.session_tags; a run resumed before they were has none)."""
    def environment(values: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in values.items() if k.startswith((*_ENVIRONMENT, "resolved."))}

    out: list[tuple[int | None, dict[str, str]]] = [(None, environment({**run.tags, **run.params}))]
    numbers = sorted({int(m[1]) for k in run.tags if (m := _SESSION.match(k))})
    for n in numbers:
        prefix = SESSION_TAG.format(n=n)
        tags = {k[len(prefix):]: v for k, v in run.tags.items() if k.startswith(prefix)}
        after = tags.get("after_step")
        out.append((int(after) if after and after.isdigit() else None, environment(tags)))
    return out


def environment_changes(run_a: TrackedRun, run_b: TrackedRun) -> list[dict[str, Any]]:
    """Where and how the runs ran, when it differs: versions, CPU, GPU, commits, Ray cluster (tags) and what each
    stage chose on its device (`resolved.*` params: engine, device, dtypes), of each run's newest session (`sessions`):
    the steps a resumed run ended with ran there. Against an eval run (no update stage) or a rescore (neither
    stage) only the stages both resolved are compared: one the other never ran is no difference in where it ran;
    nor is the Ray cluster a rescore does not record (it places no stage of the run's)."""
    a, b = sessions(run_a)[-1][1], sessions(run_b)[-1][1]
    keys = set(a) | set(b)
    if {"eval", "rescore"} & {run_kind(run_a), run_kind(run_b)}:
        keys = {k for k in keys if not k.startswith(("resolved.", "factory.ray_cluster")) or (k in a and k in b)}
    return [{"key": k, "a": a.get(k), "b": b.get(k)} for k in sorted(keys) if a.get(k) != b.get(k)]


def session_notes(side: str, run: TrackedRun) -> list[str]:
    """What changed in where and how a run ran when it was resumed (`sessions`), each time it did."""
    notes = []
    said = sessions(run)
    for (_, before), (step, after) in zip(said, said[1:]):
        changed = [f"{k} {before.get(k) or '(none)'} -> {after.get(k) or '(none)'}"
                   for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)]
        if changed:
            when = f"after step {step}" if step is not None else "later"
            shown = ", ".join(changed[:6]) + (f" and {len(changed) - 6} more" if len(changed) > 6 else "")
            notes.append(f"{side} was resumed {when} where it ran otherwise: {shown}")
    return notes


# ----------------------------------------------------------------------------------------- metrics
def _num(v: float | None) -> float | None:
    return None if v is None or math.isnan(v) else v


def _summaries(history: dict[str, list[tuple[int, float]]]) -> dict[tuple[str, str], float | None]:
    """(metric, aggregate) -> value, from each metric's (step, value) history."""
    out: dict[tuple[str, str], float | None] = {}
    for key, points in history.items():
        points = sorted(points)
        values = [v for _, v in points if not math.isnan(v)]
        if not points:
            continue
        if key == "reward/mean":
            out[(key, "final")] = _num(points[-1][1])
            out[(key, "best")] = max(values) if values else None
        elif key.startswith("rewards/") and key.endswith("/mean"):
            out[(key, "final")] = _num(points[-1][1])
        elif key.startswith("eval/"):
            if points[0][0] == 0:
                out[(key, "step 0")] = _num(points[0][1])
            out[(key, "final")] = _num(points[-1][1])
        elif key.startswith("monitor/") and key.endswith("/fired"):  # the step it first fired (None: never)
            out[(key.removesuffix("/fired"), "first fired")] = next((float(st) for st, v in points if v >= 1), None)
        elif key.startswith("monitor/"):
            out[(key, "final")] = _num(points[-1][1])
        elif key.startswith(("timing/", "perf/")):
            out[(key, "mean")] = sum(values) / len(values) if values else None
    return out


_ORDER = ("reward/", "rewards/", "eval/", "monitor/", "timing/step_s", "timing/", "perf/")


def metric_rows(history_a: dict[str, list[tuple[int, float]]],
                history_b: dict[str, list[tuple[int, float]]]) -> list[dict[str, Any]]:
    """Metrics side by side: {metric, agg, a, b, delta (b - a)}, rewards first, then eval, time, speed."""
    sa, sb = _summaries(history_a), _summaries(history_b)

    def rank(item: tuple[str, str]) -> tuple[int, str, str]:
        return next(i for i, p in enumerate(_ORDER + ("",)) if item[0].startswith(p)), item[0], item[1]

    rows = []
    for metric, agg in sorted(set(sa) | set(sb), key=rank):
        a, b = sa.get((metric, agg)), sb.get((metric, agg))
        rows.append({"metric": metric, "agg": agg, "a": a, "b": b,
                     "delta": b - a if a is not None and b is not None else None})
    return rows


def _histories(tracker: Tracker, run: TrackedRun) -> dict[str, list[tuple[int, float]]]:
    keys = [k for k in run.metrics if k == "reward/mean" or k.startswith(("eval/", "monitor/", "timing/", "perf/"))
            or (k.startswith("rewards/") and k.endswith("/mean"))]
    return {k: tracker.metric_history(run.run_id, k) for k in keys}


# ------------------------------------------------------------------------------------ trajectories
def _prompt_text(prompt_json: str) -> str:
    """The last user message of a prompt (what a reader recognises it by)."""
    try:
        messages = json.loads(prompt_json)
    except (TypeError, ValueError):
        return str(prompt_json)
    users = [m.get("content", "") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    return str(users[-1] if users else messages[-1].get("content", "") if messages else "")


def _trajectory_view(row: dict[str, Any]) -> dict[str, Any]:
    rewards = row.get("rewards")
    if isinstance(rewards, str):
        rewards = json.loads(rewards)
    return {"step": row.get("step"), "sample_index": row.get("sample_index"), "reward": row.get("reward"),
            "rewards": rewards, "num_turns": row.get("num_turns"), "stop_reason": row.get("stop_reason"),
            "completion": row.get("completion"),
            "tool_calls": [{k: c.get(k) for k in ("turn", "name", "arguments", "status", "result")}
                           for c in row.get("tool_calls") or []]}


def common_prompts(rows_a: list[dict[str, Any]], rows_b: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Prompts both runs saw in the same split (eval first), each with both runs' trajectories of the last
    step in which they saw it (the prompt shown is A's). A prompt is its data row, as each trajectory records
    it (`row`), however it was rendered: runs that differ in data.prompt or data.system_prompt, what diff is
    for, had no rendered prompt in common. Runs recorded without rows, or whose rows do not tell their prompts
    apart (a `prompt` column alone: `row` leaves it out), are paired by the rendered prompt."""
    def names_its_prompt(rows: list[dict[str, Any]]) -> bool:
        prompts: dict[tuple[str, str], set[str]] = {}
        for r in rows:
            if not r.get("row"):
                return False
            prompts.setdefault((r["split"], r["row"]), set()).add(r["prompt"])
        return all(len(p) == 1 for p in prompts.values())

    by = "row" if names_its_prompt(rows_a) and names_its_prompt(rows_b) else "prompt"

    def latest(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
        groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for r in rows:
            groups.setdefault((r["split"], r[by]), []).append(r)
        out = {}
        for key, group in groups.items():
            last = max(r["step"] for r in group)
            out[key] = sorted((r for r in group if r["step"] == last), key=lambda r: r.get("sample_index") or 0)
        return out

    la, lb = latest(rows_a), latest(rows_b)
    order = list(dict.fromkeys((r["split"], r[by]) for r in rows_a))
    keys = [k for k in order if k in lb]
    keys.sort(key=lambda k: k[0] != "eval")  # stable: eval prompts first, each split in A's order
    out = []
    for i, key in enumerate(keys):
        a, b = [_trajectory_view(r) for r in la[key]], [_trajectory_view(r) for r in lb[key]]
        mean = lambda ts: sum(t["reward"] for t in ts) / len(ts) if ts else None  # noqa: E731
        out.append({"index": i, "split": key[0], "prompt": _prompt_text(la[key][0]["prompt"]),
                    "a_reward_mean": mean(a), "b_reward_mean": mean(b), "a": a, "b": b})
    return out


def _trajectory_rows(tracker: Tracker, run_id: str) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for folder, split in (("eval_trajectories", "eval"), ("trajectories", "train")):
            for path in (p for p in tracker.artifacts(run_id, folder) if p.endswith(".parquet")):
                local = tracker.download(run_id, path, tmp)
                rows += [{**r, "split": split} for r in pq.read_table(local).to_pylist()]
    return rows


# ------------------------------------------------------------------------------------------- compare
def load(tracker: Tracker, ref: str) -> RunRecord:
    run = tracker.run(ref)
    run_id = run.run_id
    names = set(tracker.artifacts(run_id))
    if "plan.json" not in names:
        raise NoPlanError(f"run {run.name} ({run_id}) has no plan.json artifact: it was not made by "
                          "`factory run`, or its upload failed; what defined it is unknown, so it cannot be compared")
    with tempfile.TemporaryDirectory() as tmp:
        plan = json.loads(tracker.download(run_id, "plan.json", tmp).read_text())
        tools = json.loads(tracker.download(run_id, "tools.json", tmp).read_text()) if "tools.json" in names else None
        folders = tracker.artifacts(run_id, "resumed") if "resumed" in names else []
        resumed = sorted((int(f.rsplit("_", 1)[1]), json.loads(tracker.download(run_id, f"{f}/plan.json", tmp).read_text()))
                         for f in folders)
    return RunRecord(run, plan, tools, _trajectory_rows(tracker, run_id), resumed)


def _side(r: RunRecord) -> dict[str, Any]:
    return {"run_id": r.run.run_id, "name": r.run.name, "spec": r.run.tags.get("factory.spec_name"),
            "status": r.run.status, "plan_hash": r.plan.get("hashes", {}).get("run")}


def compare(a: RunRecord, b: RunRecord, history_a: dict[str, list[tuple[int, float]]],
            history_b: dict[str, list[tuple[int, float]]]) -> dict[str, Any]:
    """The whole report as plain data (see the README for an example)."""
    changes = plan_changes(a.plan, b.plan, a.tools, b.tools)
    # the notes that hide a difference (tool schemas not recorded, values masked, a resume under another spec):
    # with one, the runs are not known to be identical; the notes below only say what was left out and why
    blocking = plan_notes(a.plan, b.plan, ("A", "B"))
    blocking += resumed_notes("A", a.plan, a.resumed) + resumed_notes("B", b.plan, b.resumed)
    notes = list(blocking)
    kinds = {side: run_kind(r.run) for side, r in (("A", a), ("B", b))}
    if {"eval", "rescore"} & set(kinds.values()):
        # an evaluation or a rescoring trains nothing: its spec's training settings were never read
        changes = [c for c in changes if c["kind"] != "algorithm" and not c["key"].startswith(TRAINING_ONLY)]
        notes.append(" and ".join(f"{side} is {'an' if kind == 'eval' else 'a'} {kind} run"
                                  for side, kind in kinds.items() if kind != "train")
                     + f": settings it does not read ({', '.join(p + '*' for p in TRAINING_ONLY)}) are not compared")
    if "eval" in kinds.values():
        # an evaluation's model is the one `factory eval --model` gave it, which its model.path does not always
        # name (a server's URL, a LoRA run's adapters added beside the spec's model): two evals of one spec
        # that scored different models were "identical" but for their metrics
        models = [evaluated_model(r) for r in (a, b)]
        changes = [c for c in changes if c["key"] != "model.path"]
        if models[0] != models[1]:
            changes.insert(0, {"kind": "model", "key": "evaluated model", "a": models[0], "b": models[1]})
    warnings = comparability(changes)
    if a.run.tags.get("factory.eval_of") == b.run.run_id or b.run.tags.get("factory.eval_of") == a.run.run_id:
        # an evaluation of the other run's checkpoint: its model is that run's, whatever its model.path says
        warnings = [w for w in warnings if not w.startswith("not comparable: different model")]
        notes.append(f"{'A' if a.run.tags.get('factory.eval_of') else 'B'} evaluates the other run's checkpoint "
                     "(its model.path is where that checkpoint was read from)")
    warnings += progress({"A": a.run, "B": b.run}, {"A": history_a, "B": history_b})
    prompts = common_prompts(a.trajectories, b.trajectories)
    return {
        "a": _side(a), "b": _side(b),
        "identical": not changes and not blocking,
        "changes": changes,
        # (where a run ran is not part of its plan: not a reason to call two runs defined otherwise)
        "notes": notes + session_notes("A", a.run) + session_notes("B", b.run),
        "warnings": warnings,
        "environment": environment_changes(a.run, b.run),
        "metrics": metric_rows(history_a, history_b),
        "prompts": [{k: p[k] for k in ("index", "split", "prompt", "a_reward_mean", "b_reward_mean")} for p in prompts],
        "trajectories": None,
        "_prompts_full": prompts,
    }


class NoSuchPrompt(RunLookupError, IndexError):
    """`prompt` is past the prompts the two runs share: an index out of range from Python (IndexError), a
    refused argument (exit 2) on the command line."""


def diff_runs(run_a: str, run_b: str, *, prompt: int = 0, uri: str | None = None
              ) -> tuple[dict[str, Any], RunRecord, RunRecord]:
    """Two tracked runs (id, id prefix or name) compared (`compare`), with the trajectories of the
    `prompt`-th prompt both saw; and the two runs."""
    tracker = open_tracker(uri, read=True)
    with reading(tracker.uri):  # (a store that goes down after it answered: exit 3, as one down from the start)
        a, b = load(tracker, run_a), load(tracker, run_b)
        histories = _histories(tracker, a.run), _histories(tracker, b.run)
    report = compare(a, b, *histories)
    full = report.pop("_prompts_full")
    if full:
        if not 0 <= prompt < len(full):
            raise NoSuchPrompt(f"prompt {prompt} (--prompt; prompt= from Python): the runs share {len(full)} prompts "
                               f"(0..{len(full) - 1})")
        report["trajectories"] = full[prompt]
    return report, a, b


def main(args: Any) -> int:
    report, a, b = diff_runs(args.run_a, args.run_b, prompt=args.prompt, uri=args.uri)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True, ensure_ascii=False))
    else:
        render(report, a, b)
    return 0


# -------------------------------------------------------------------------------------------- text
def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _cut(text: str | None, n: int = 600) -> str:
    text = text or ""
    return text if len(text) <= n else text[:n] + f" ... [{len(text) - n} more]"


def render(report: dict[str, Any], a: RunRecord, b: RunRecord) -> None:
    from rich.table import Table
    from rich.text import Text

    console = stdout_console(piped_width=160)  # piped or in a log: room for the side-by-side tables
    console.print(Text(f"A = {a.label}   B = {b.label}", style="bold"))
    for w in report["warnings"]:
        console.print(Text(f"warning: {w}", style="yellow"))
    for n in report["notes"]:
        console.print(Text(f"note: {n}", style="yellow"))
    if report["changes"]:
        table = Table(title="what differs")
        for col in ("kind", "key", "A", "B"):
            table.add_column(col, overflow="fold")
        for c in report["changes"]:
            extra = ""
            if c.get("tools"):
                extra = "; ".join(f"{k}: {', '.join(v)}" for k, v in c["tools"].items() if v)
            fmt = setting_text if c["kind"] == "setting" else _fmt
            table.add_row(c["kind"], c["key"] + (f"\n({extra})" if extra else ""), fmt(c["a"]), fmt(c["b"]))
        console.print(table)
    elif report["identical"]:
        # (an eval or rescore run's plan hash covers the training settings it does not read: two such runs may
        # be defined identically in all they read and yet hash otherwise)
        hashes = dict.fromkeys(str(report[side]["plan_hash"])[:12] for side in ("a", "b"))
        console.print(f"defined identically: same spec, templates, reward code, data and tool schemas "
                      f"(plan{'s' if len(hashes) > 1 else ''} {' and '.join(hashes)})")
    if report["environment"]:
        env = Table(title="where and how they ran (not part of the plan)")
        for col in ("tag", "A", "B"):
            env.add_column(col, overflow="fold")
        for e in report["environment"]:
            env.add_row(e["key"], _fmt(e["a"]), _fmt(e["b"]))
        console.print(env)
    metrics = Table(title="metrics")
    for col, justify in (("metric", "left"), ("", "left"), ("A", "right"), ("B", "right"), ("B - A", "right")):
        metrics.add_column(col, justify=justify)
    for m in report["metrics"]:
        delta = "-" if m["delta"] is None else f"{m['delta']:+.4g}"
        metrics.add_row(m["metric"], m["agg"], _fmt(m["a"]), _fmt(m["b"]), delta)
    console.print(metrics)
    shown = report["trajectories"]
    if shown is None:
        console.print("no prompt was seen by both runs")
        return
    console.print(Text(f"{len(report['prompts'])} prompts seen by both runs; prompt {shown['index']} "
                       f"({shown['split']}, --prompt N shows another):", style="bold"))
    console.print(Text(shown["prompt"]))
    side = Table(show_lines=True)
    side.add_column(f"A {a.label}", overflow="fold", ratio=1)
    side.add_column(f"B {b.label}", overflow="fold", ratio=1)

    def cell(t: dict[str, Any] | None) -> Text:
        if t is None:
            return Text("")
        head = f"step {t['step']} sample {t['sample_index']}  reward {_fmt(t['reward'])}  {t['stop_reason']}\n"
        return Text(head + _cut(t["completion"]))

    for i in range(max(len(shown["a"]), len(shown["b"]))):
        side.add_row(cell(shown["a"][i] if i < len(shown["a"]) else None),
                     cell(shown["b"][i] if i < len(shown["b"]) else None))
    console.print(side)
