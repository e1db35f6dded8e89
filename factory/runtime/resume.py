"""`factory run SPEC --resume [RUN]`: which run continues, from which checkpoint, and what it already logged.

A resumed run continues in its own MLflow run (MLflow sets it back to RUNNING) from the newest complete
checkpoint that run wrote: the learner's weights, optimizer state, LR step and RNG (`Learner.load_checkpoint`),
the data stream's position (`run_state.json` beside the checkpoint) and, from the learner, the rollout
engine's weights. Every other source of randomness is a function of (seed, step): the rollout's sampling
seeds, the learner's mini-batch shuffle, the data order of each epoch. So on CPU with a fixed seed the
resumed run's final weights equal an uninterrupted run's (tests/test_run_lifecycle.py).

No step twice, none missing: the driver logs a step's metrics BEFORE it writes that step's checkpoint, so
every checkpointed step is in the run's metrics. A run killed between the two has logged steps past its
newest checkpoint; the resumed run computes them again (it needs their updates) and the tracker does not
log them a second time (`Tracker.logged`).

Refused, with exit code 2 and what to do: a run of a different spec (its spec hash, prompt or chat
templates, reward code or data differ) unless `--allow-spec-change` (the change is then recorded on the
run: tag `factory.resumed_spec_hash`, artifacts `resumed/step_N/`); a run still going on in a live driver;
a run with no step left to do that has ended (FINISHED). One with every step done that never ended (its driver
killed after its last checkpoint) is resumed only to send what its driver left unsent and mark it FINISHED,
with no stage started (factory.runtime.driver.end_done).
"""
from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from factory.compiler.compile import plan_json
from factory.monitors import HALTED_BY_TAG
from factory.tracking.mlflow_tracker import (DRIVER_TAG, INPUT_KINDS, driver_alive, driver_tag, flatten, setting_text,
                                              uri_option)
from factory.tracking.runs import run_kind
from factory.tracking.tracker import RunLookupError, TrackedRun, Tracker
from factory.update.checkpoint import RUN_STATE, complete, manifested, read_run_state, run_folder, verify
from factory.util import UserError

# Logged once per training step, after the step's update (what "the run logged step N" means).
STEP_METRIC = "timing/step_s"
# Logged at step 0 when the spec has held-out data (the step-0 evaluation is done).
EVAL_METRIC = "eval/reward"
# Logged by each session of a run at the first step it logs (factory.runtime.startup).
STARTUP_METRIC = "timing/startup_s"
# Inputs whose hash must match for a resume (beside the spec's own): what else defines the training.
# (Not the tool schemas: a plan holds them only once its servers have listed them, after the resume is judged.)
HASHED_INPUTS = tuple(kind for kind in INPUT_KINDS if kind != "tools")
INPUT_WORDS = {"templates": "template", "rewards": "reward code", "data": "data", "code": "tool code"}


class ResumeError(UserError):
    """No run to resume, or one that must not be resumed as asked; the message says which and what to do."""


@dataclass
class Resume:
    """Where a resumed run starts."""

    run_id: str
    run_name: str
    checkpoint_dir: Path
    checkpoint: str | None  # `step_<N>` to load; None: the run saved none, it starts over (in the same run)
    step: int  # steps done at that checkpoint (0 without one)
    logged: int  # the last step whose metrics the run holds (-1: none, not even the step-0 evaluation)
    data: dict[str, Any] | None  # the data stream's position at the checkpoint
    watch: dict[str, Any] | None = None  # the monitors' history at the checkpoint (factory.monitors.Watch)
    before: dict[str, float] = field(default_factory=dict)  # the step-0 evaluation, for the summary
    checkpoints: list[dict[str, Any]] = field(default_factory=list)  # the run's checkpoints.json
    changed: list[str] = field(default_factory=list)  # what differs from the run's spec (allowed)
    unreadable: list[str] = field(default_factory=list)  # newer checkpoints passed over, and why
    started: list[int] = field(default_factory=list)  # the steps at which earlier sessions logged their start-up
    unsent: int = 0  # tracking records its driver left unsent (a run with every step done resumes to send them)
    complete: bool = False  # every step is done: the resume only sends `unsent` and ends the run, starting no stage
    # an earlier resume at this step, killed before it saved, recorded another plan, which this one replaces
    replaces: bool = False

    def startup_step(self, steps: int) -> int | None:
        """The step this session logs its start-up times at: the one after the run's last logged step; None
        past the run's `steps`, or when an earlier session, killed before it logged that step, holds it (a
        second value at one step is a duplicate in the metric's history)."""
        first = self.logged + 1
        return None if first > steps or first in self.started else first

    def describe(self) -> str:
        if self.complete:
            sends = (f"to send the {self.unsent} tracking records its driver could not" if self.unsent
                     else "to mark it FINISHED, which its driver could not")
            return (f"resuming run {self.run_id} ({self.run_name}) {sends}: every step is done (its checkpoint "
                    f"{self.checkpoint_dir / self.checkpoint})")
        # without a checkpoint the run starts over: its step-0 evaluation too (logged once, as every step)
        where = (f"at step {self.step + 1}, from its checkpoint {self.checkpoint_dir / self.checkpoint}"
                 if self.checkpoint else "from the start (no checkpoint it saved is usable)" if self.unreadable
                 else "from the start (it saved no checkpoint)")
        first, last = (self.step + 1 if self.checkpoint else 0), self.logged
        again = ("" if last < first else f"; step {first} is computed again, not logged twice" if last == first
                 else f"; steps {first}-{last} are computed again, not logged twice")
        changed = f"; with a changed {', '.join(self.changed)} (--allow-spec-change)" if self.changed else ""
        passed = "".join(f"\n  passed over {u} (not as saved)" for u in self.unreadable)
        return f"resuming run {self.run_id} ({self.run_name}) {where}{again}{changed}{passed}"


def find(plan: Any, ref: str | None, uri: str, *, train: Any, experiment: str,
         allow_spec_change: bool = False) -> Resume:
    """The run to resume: `ref` (a training run's id, id prefix or name), else the newest unfinished training run
    of this plan's spec (same spec name and hash; not an eval or rescore run) in `experiment`. `train`: the
    spec's train settings (steps, and the checkpoint folder of a run that recorded none)."""
    from factory.tracking.tracker import open_tracker

    tracker = open_tracker(uri, read=True)  # a sqlite file not here: said so, not an empty store made
    name = plan.spec["name"]
    run = tracker.run(ref) if ref else _newest_resumable(tracker, plan, experiment, uri)
    tags = run.tags
    if tags.get("factory.spec_name") != name:
        raise ResumeError(f"run {run.run_id} is not a run of spec '{name}' "
                          f"(it ran '{tags.get('factory.spec_name', 'no Factory spec')}')")
    if (kind := run_kind(run)) != "train":  # named (a bare resume passes it over): the driver trained inside it
        of = tags.get("factory.rescore_of")
        raise ResumeError(f"run {run.run_id} is a `factory {kind}` run: it trained nothing to resume; resume the "
                          f"training run (`factory runs` lists it{f'; this run rescored {of}' if of else ''})")
    _refuse_if_driven(run.run_id, tags.get(DRIVER_TAG))
    directory = Path(tags["factory.checkpoint_dir"]) if "factory.checkpoint_dir" in tags else unrecorded_folder(
        Path(train.checkpoint_dir), run)
    skipped: list[str] = []
    checkpoint, state = newest_checkpoint(directory, run.run_id, skipped)
    step = int(state["step"]) if checkpoint else 0
    spooled = unsent_records(directory)
    # a resume's spec record the store has not had yet (it was down), the newest of each name
    texts = {r["name"]: r["text"] for r in spooled if r["kind"] == "text"}
    # Compared with the plan the checkpoint was trained under, not the run's first: after a resume under a changed
    # spec B, going back to the first spec A is a change (step N was trained under B), and B is none. A run with no
    # checkpoint starts over: compared with the plan its newest start from step 0 ran under.
    saving = _plan_saving(tracker, run.run_id, step if checkpoint else 1, texts)
    recorded = _recorded_plan(tracker, run.run_id, saving, texts)
    first = saving == "plan.json"
    changed = changes(plan, recorded, tags.get("factory.spec_hash" if first else "factory.resumed_spec_hash"))
    # The checkpoints this session saves are judged with the record of a resume at this very step where one is
    # (`_plan_saving` of the next step): one under another spec that saved nothing (killed) left its record, and
    # this session, no change against the checkpoint, must replace it: its own checkpoints were judged against that.
    later = _plan_saving(tracker, run.run_id, (step if checkpoint else 0) + 1, texts)
    replaces = later != saving and bool(changes(plan, _recorded_plan(tracker, run.run_id, later, texts),
                                                tags.get("factory.resumed_spec_hash")))
    if changed and not allow_spec_change:
        parts = []
        for what in changed:
            if what == "spec":
                shown = _some(spec_keys_changed(recorded or {}, plan))
                parts.append(f"spec{f' ({shown})' if shown else ''}")
            else:  # which files: "a different rewards" left the user to find the edited one
                files = _some(sources_changed(((recorded or {}).get("hashes") or {}).get(what),
                                              plan.hashes.get(what)))
                parts.append(f"{INPUT_WORDS[what]}{f' ({files})' if files else ''}")
        # which spec: that of a resume under a changed one, not the run's first (the user may not have it at hand)
        folder = saving.rsplit("/", 1)[0]
        since = "" if first else f" (since a resume that changed it: its artifact {folder}/spec.yaml)"
        raise ResumeError(f"run {run.run_id} was trained with another {' and '.join(parts)} than this spec and "
                          f"overrides give{since}: resume with the same spec and overrides, or pass "
                          "--allow-spec-change to continue it under the changed one (recorded on the run; `factory "
                          "diff` shows every change afterwards)")
    halted_by = tags.get(HALTED_BY_TAG)
    if halted_by and halted_by in train.stop_on:
        # its checkpoint holds the monitors' history: resumed, the monitor reads it again and stops the run after
        # one more step (that step trained on, the same exit code)
        raise ResumeError(f"run {run.run_id} was stopped by {tags.get('factory.stopped_by') or halted_by}. Resumed, it "
                          f"would read the same history and stop again after its next step: to train on past it, "
                          f"take {halted_by} out of train.stop_on (the monitor still reports, as monitor/{halted_by}) "
                          "and pass --allow-spec-change")
    saved = tags.get("factory.checkpoint_step")
    if not checkpoint and saved and not skipped:
        # the folder moved, a scratch disk not mounted, another machine: starting over would throw the run's
        # steps away without a word, and log steps again that its history already holds
        there = "does not exist" if not directory.is_dir() else "holds none of its checkpoints"
        raise ResumeError(f"run {run.run_id} saved a checkpoint at step {saved} in {directory}, which {there}: put "
                          "that folder back (or mount it) and resume again; to train from the start, start a new run")
    unsent = len(spooled)
    if step >= train.steps and not unsent and run.status == "FINISHED":
        # Not ended, a run with every step done is resumed to end it: with records its driver could not send (the
        # store was down at the end), which the resume sends; or with none, its driver killed after its last
        # checkpoint, before it marked the run ended (its end waits for the trace export). Left so, it stayed
        # RUNNING for good, and a bare --resume of the spec picked it before any older killed run.
        raise ResumeError(f"run {run.run_id} has done all {train.steps} steps (its checkpoint "
                          f"{directory / checkpoint}): nothing to resume")
    if checkpoint:
        _refuse_other_weights(recorded, plan, run.run_id, directory / checkpoint, uri)
        _refuse_other_model(recorded, plan, run.run_id, directory / checkpoint)
        _refuse_other_optimizer(recorded, plan, run.run_id, directory / checkpoint, uri)
    # Claimed now, not when the run reopens after Ray and every stage have started (30-60 s): a second
    # `--resume` in that time took the run too, and both drivers logged its steps (whatever its status).
    _refuse_if_driven(run.run_id, tracker.claim(run.run_id))
    # What the run logged is what its store holds and what its spool will send (the store was down): the tracker
    # sends the spool first, so a start-up counted from the store alone was logged again at the same step, or dropped
    # (at a step the spool's own step metrics then made logged).
    logged = max(logged_step(tracker, run), *spooled_steps(spooled, STEP_METRIC),
                 0 if 0 in spooled_steps(spooled, EVAL_METRIC) else -1)
    started = [s for s, _ in tracker.metric_history(run.run_id, STARTUP_METRIC)]
    return Resume(run.run_id, run.name, directory, checkpoint, step, logged,
                  state.get("data") if checkpoint else None, state.get("watch") if checkpoint else None,
                  before=step0_eval(tracker, run),
                  checkpoints=_artifact_json(tracker, run.run_id, "checkpoints.json") or [], changed=changed,
                  unreadable=skipped, started=sorted({*started, *spooled_steps(spooled, STARTUP_METRIC)}),
                  unsent=unsent, complete=step >= train.steps, replaces=replaces)


def unrecorded_folder(root: Path, run: TrackedRun) -> Path:
    """The checkpoint folder of a run that recorded none (its train.checkpoint_dir, or the spec name its default
    holds, came from the environment and is masked): its own under this spec's `root` (`run_folder`, named after
    the MLflow run), else `root` itself for a run saved before each run had one, whose checkpoints are there."""
    own = run_folder(root, run.name, run.run_id)
    return root if not own.is_dir() and newest_checkpoint(root, run.run_id)[0] else own


def spooled_steps(records: list[dict[str, Any]], metric: str) -> list[int]:
    """The steps at which the spool's `records` (`unsent_records`) log `metric`."""
    return [r["step"] for r in records if r["kind"] == "metrics" and metric in r["values"]]


def unsent_records(directory: Path) -> list[dict[str, Any]]:
    """The tracking records a run's driver left in its spool (factory.tracking.spool), unsent, oldest first."""
    from factory.tracking.mlflow_tracker import SPOOL
    from factory.tracking.spool import Spool

    return Spool(directory / SPOOL).records if (directory / SPOOL).is_dir() else []


def record_spec_change(tracker: Tracker, resume: Resume, plan: Any) -> None:
    """Record on the run the spec that `--allow-spec-change` let a resume continue under (tag
    `factory.resumed_spec_hash`; `resumed/step_N/spec.yaml` and `plan.json`, which `factory diff` and the
    checkpoints saved from step N + 1 on are read with), when it is not the one those checkpoints would be read
    with (`Resume.changed`, `Resume.replaces`). Called by every resume once the checkpoint has loaded: a resume
    that fails there leaves no record of a spec that never ran."""
    if not (resume.changed or resume.replaces) or resume.complete:  # (one that only sends records trains nothing)
        return
    tracker.log_tags({"factory.resumed_spec_hash": plan.hashes["spec"]})
    tracker.log_text(plan.spec_yaml, f"resumed/step_{resume.step}/spec.yaml")
    tracker.log_text(plan_json(plan), f"resumed/step_{resume.step}/plan.json")


def _plan_saving(tracker: Tracker, run_id: str, step: int, unsent: dict[str, str]) -> str:
    """The plan a run ran under when it saved its checkpoint of `step`: that of its newest resume at a step
    before it (a resume at step N logs `resumed/step_N/plan.json` and saves N + 1 on), else its first. Under
    --allow-spec-change a resume may have turned LoRA on: its later checkpoints hold adapters, not what the
    first plan trained. `unsent`: the run's text records still in its spool, which hold such a record while
    the store was down."""
    resumed = [int(m.group(1)) for path in tracker.artifacts(run_id, "resumed")
               if (m := re.fullmatch(r"resumed/step_(\d+)", path))]
    resumed += [int(m.group(1)) for name in unsent if (m := re.fullmatch(r"resumed/step_(\d+)/plan\.json", name))]
    before = [n for n in resumed if n < step]
    return f"resumed/step_{max(before)}/plan.json" if before else "plan.json"


def _recorded_plan(tracker: Tracker, run_id: str, path: str, unsent: dict[str, str]) -> dict[str, Any] | None:
    """A plan the run recorded (`_plan_saving`'s path), from its spool's text records where it waits there."""
    return json.loads(unsent[path]) if path in unsent else _artifact_json(tracker, run_id, path)


def _refuse_other_weights(recorded: dict[str, Any] | None, plan: Any, run_id: str, checkpoint: Path,
                          uri: str) -> None:
    """ResumeError when the checkpoint holds other tensors than this plan trains: LoRA turned on or off, or
    another rank or set of adapted layers (`--allow-spec-change` allows a changed spec, but a checkpoint's
    weights and optimizer state load only into the shapes they were saved from: the learner failed with an
    internal error in DeepSpeed after Ray and every stage had started, and left the run FAILED)."""
    def trains(lora: dict[str, Any] | None) -> str:
        return ("full weights" if lora is None
                else f"LoRA adapters (r {lora.get('r')}, target_modules {lora.get('target_modules')})")

    if not recorded:
        return
    then = ((recorded.get("spec") or {}).get("model") or {}).get("lora")
    now = (plan.spec.get("model") or {}).get("lora")
    if trains(then) == trains(now):
        return
    if then and now and then.get("r") == now.get("r") and _same_layers(then.get("target_modules"),
                                                                      now.get("target_modules"), plan):
        return
    raise ResumeError(f"run {run_id}'s checkpoint {checkpoint} holds {trains(then)}, and this spec trains "
                      f"{trains(now)} (model.lora): a checkpoint loads only into what it was saved from; resume "
                      f"without changing model.lora, or start a new run from its model: `factory export {run_id} "
                      f"--out DIR{uri_option(uri)}`, then model.path=DIR")


def _refuse_other_optimizer(recorded: dict[str, Any] | None, plan: Any, run_id: str, checkpoint: Path,
                            uri: str) -> None:
    """ResumeError when `--allow-spec-change` gave another train.optimizer.name: the checkpoint's optimizer state is
    that of the optimizer it was saved from (torch loaded SGD's into AdamW, and the first step failed with KeyError
    'betas' after Ray and every stage had started). Its settings may change: the learner applies the spec's."""
    def name(spec: dict[str, Any] | None) -> Any:
        return (((spec or {}).get("train") or {}).get("optimizer") or {}).get("name")

    then, now = name((recorded or {}).get("spec")), name(plan.spec)
    if then is None or then == now:  # (nothing recorded to compare with)
        return
    raise ResumeError(f"run {run_id}'s checkpoint {checkpoint} holds the state of optimizer '{then}', and this spec "
                      f"trains with '{now}' (train.optimizer.name): its optimizer state is the saved optimizer's own; "
                      f"resume with train.optimizer.name={then}, or start a new run from its model: `factory export "
                      f"{run_id} --out DIR{uri_option(uri)}`, then model.path=DIR")


SHAPE_KEYS = ("architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")


def _refuse_other_model(recorded: dict[str, Any] | None, plan: Any, run_id: str, checkpoint: Path) -> None:
    """ResumeError when `--allow-spec-change` gave another model.path whose shapes are not the checkpoint's
    (its Hugging Face folder's config; a LoRA checkpoint's, which holds adapters and no hf/: that of the base
    model its adapters name, else of the recorded model.path): its weights load only into the architecture
    they were saved from (the learner failed with an internal error after Ray and every stage had started,
    the run left FAILED)."""
    from factory.assets import resolve_model
    from factory.update.checkpoint import ADAPTER, HF

    then = ((recorded or {}).get("spec") or {}).get("model") or {}
    now = plan.spec.get("model") or {}
    if then.get("path") == now.get("path"):
        return
    saved, adapters = checkpoint / HF / "config.json", checkpoint / ADAPTER / "adapter_config.json"
    if not saved.is_file() and not adapters.is_file():
        return  # nothing saved to compare (and no model to resolve, a factory: one built, for nothing)
    try:
        if not saved.is_file() and adapters.is_file():
            named = json.loads(adapters.read_text()).get("base_model_name_or_path")
            base = named if named and (Path(named) / "config.json").is_file() else resolve_model(then["path"])
            saved = Path(base) / "config.json"
        current = Path(resolve_model(now["path"])) / "config.json"
        a, b = json.loads(saved.read_text()), json.loads(current.read_text())
    except (OSError, ValueError, KeyError, AttributeError):  # a hub id not on disk yet, say (the learner's load says
        # what it finds), or a config that is no JSON object
        return
    differ = [k for k in SHAPE_KEYS if a.get(k) != b.get(k)]
    if differ:
        shown = ", ".join(f"{k} {a.get(k)} -> {b.get(k)}" for k in differ[:4])
        raise ResumeError(f"run {run_id}'s checkpoint {checkpoint} holds a model of other shapes than model.path "
                          f"{now['path']} ({shown}): a checkpoint loads only into the model it was saved from; "
                          f"resume with model.path={then.get('path')}, or start a new run")


def _same_layers(a: list[str] | str | None, b: list[str] | str | None, plan: Any) -> bool:
    """Whether two `target_modules` adapt the same layers of the plan's model (`all-linear` and the list
    of its linear layers' names do), read from its config.json; False when the model folder is not on disk
    or its config does not build (the settings then differ as written)."""
    from factory.assets import tokenizer_files
    from factory.lora import linear_layers, targeted
    from factory.plan import UpdateSettings

    if a is None or b is None:
        return False
    # the model the learner loads the checkpoint into (a hub id already its cached folder)
    model = next(s.settings.model for s in plan.stages if isinstance(s.settings, UpdateSettings))
    folder = tokenizer_files(model.path)  # the model folder when on disk
    try:
        layers = linear_layers(folder) if folder else None
    except (OSError, ValueError, KeyError):  # an unreadable config, an architecture transformers lacks
        return False
    return bool(layers) and targeted(a, layers) == targeted(b, layers)


def _newest_resumable(tracker: Tracker, plan: Any, experiment: str, uri: str) -> TrackedRun:
    name = plan.spec["name"]
    try:
        runs = tracker.runs(experiment, spec_name=name, max_results=200)
    except RunLookupError:  # no such experiment: no run to resume
        runs = []
    # a `factory eval` or `factory rescore` run carries the spec's name and hash too but trains nothing: one
    # stopped after the training run was killed would be picked, and trained from step 0 without its checkpoints
    unfinished = [r for r in runs if r.status != "FINISHED" and run_kind(r) == "train"]
    # the spec a run now trains under: that of its newest resume under a changed spec, else its first
    ours = spec_hashes(plan)
    same = [r for r in unfinished
            if (r.tags.get("factory.resumed_spec_hash") or r.tags.get("factory.spec_hash")) in ours]
    if same:
        return same[0]
    others = "; ".join(f"{r.run_id} ({r.name}, {r.status})" for r in unfinished[:5])
    raise ResumeError(f"no unfinished run of spec '{name}' with this spec and overrides in experiment "
                      f"'{experiment}' ({uri})"
                      + (f"; unfinished runs of another version of the spec: {others} -- give one as "
                         "`--resume RUN` (with --allow-spec-change)" if others else
                         ": start it without --resume"))


def spec_hashes(plan: Any) -> tuple[str, str]:
    """The hashes a run of this plan's spec may have recorded: the spec's, and the same with `resources.ray_address`
    in it, as runs that joined a cluster hashed it before (factory.compiler.compile.spec_hash): resumed with the same
    spec, one was refused as trained under another, with no key named (for a local run the two are one)."""
    from factory.compiler.refs import sha256_json

    return plan.hashes["spec"], sha256_json(plan.spec)


def changes(plan: Any, recorded: dict[str, Any] | None, spec_hash: str | None) -> list[str]:
    """What of this plan differs from `recorded`, the plan the resumed checkpoint was trained under (its
    plan.json, `_plan_saving`): "spec" and the names of HASHED_INPUTS. Without that record (a run started
    before plan.json was logged) the spec hash its tag holds, `spec_hash`, is compared alone."""
    hashes = (recorded or {}).get("hashes") or {}
    recorded_spec = hashes.get("spec", spec_hash)  # (the older hash is worked out only where the spec's differs)
    out = [] if recorded_spec == plan.hashes["spec"] or recorded_spec in spec_hashes(plan) else ["spec"]
    if hashes:
        out += [k for k in HASHED_INPUTS if not same_sources(hashes.get(k), plan.hashes.get(k))]
    return out


def spec_keys_changed(recorded: dict[str, Any], plan: Any) -> list[str]:
    """The spec keys whose values differ between a run's plan.json and this plan, as `key: then -> now`
    (a refused resume said only "a different spec", and the user had to find which override it was). A key
    one side lacks and a null are alike "(unset)" (`setting_text`), as in `factory diff`. Keys masked in
    either (paths from the environment, "***") are left out."""
    then, now = dict(flatten(recorded.get("spec") or {})), dict(flatten(json.loads(plan_json(plan))["spec"]))
    cut = lambda v: v if len(v) <= 60 else v[:57] + "..."  # noqa: E731 -- a list setting is one JSON value
    pairs = {k: (setting_text(then.get(k)), setting_text(now.get(k))) for k in set(then) | set(now)
             if "***" not in (then.get(k), now.get(k))}
    return [f"{k}: {cut(a)} -> {cut(b)}" for k, (a, b) in sorted(pairs.items()) if a != b]


def _some(items: list[str], most: int = 6) -> str:
    return ", ".join(items[:most]) + (f" and {len(items) - most} more" if len(items) > most else "")


def sources_changed(a: Any, b: Any) -> list[str]:
    """The sources of a {source: sha256} table whose contents differ between a run's record `a` and now `b`:
    edited or added (`b`'s keys whose hash `a` lacks), and removed (`a`'s whose hash `b` lacks, marked so)."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return []
    then, now = set(map(str, a.values())), set(map(str, b.values()))
    return ([k for k, v in sorted(b.items()) if str(v) not in then]
            + [f"{k} (gone)" for k, v in sorted(a.items()) if str(v) not in now and k not in b])


def same_sources(a: Any, b: Any) -> bool:
    """Whether two recorded hashes of one input say the same: for a {source: sha256} table, the same
    contents whatever the keys (a reward's source was keyed by its file's path, absolute where Factory
    lies outside the working directory, before it was keyed by module path: a run started then must still
    resume with the same code)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return sorted(map(str, a.values())) == sorted(map(str, b.values()))
    return a == b


def newest_checkpoint(directory: Path, run_id: str,
                      skipped: list[str] | None = None) -> tuple[str | None, dict[str, Any]]:
    """The newest complete checkpoint in `directory` written by run `run_id` (its run_state.json says so:
    runs saved before each run had its own folder shared one) whose files are as they were saved
    (`verify`), and its run state; (None, {}) when there is none. A newer one that fails the check is
    passed over, and `skipped` hears why."""
    names = complete(directory)
    kept = manifested(directory, names)  # (a run saved before manifests: none has)
    for name in reversed(names):
        try:
            state = read_run_state(directory / name)
        except (OSError, ValueError) as e:  # cut short, say: whose it is cannot be told, but this is its folder
            if skipped is not None:
                skipped.append(f"{name}: its {RUN_STATE} is unreadable ({e})")
            continue
        if not state:
            if skipped is not None:
                skipped.append(f"{name}: it has no {RUN_STATE}")
            continue
        if state.get("run_id") != run_id:
            continue
        problem = verify(directory / name, kept)
        if problem is None:
            return name, state
        if skipped is not None:
            skipped.append(f"{name}: {problem}")
    return None, {}


def logged_step(tracker: Tracker, run: TrackedRun) -> int:
    """The last step whose metrics the run holds: a training step, else 0 when the step-0 evaluation is
    there, else -1."""
    steps = [step for step, _ in tracker.metric_history(run.run_id, STEP_METRIC)]
    if steps:
        return max(steps)
    return 0 if tracker.metric_history(run.run_id, EVAL_METRIC) else -1


def step0_eval(tracker: Tracker, run: TrackedRun) -> dict[str, float]:
    out = {}
    for key in run.metrics:
        if key.startswith("eval/"):
            for step, value in tracker.metric_history(run.run_id, key):
                if step == 0:
                    out[key] = value
    return out


def _artifact_json(tracker: Tracker, run_id: str, path: str) -> Any:
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = tracker.download(run_id, path, tmp)
        except Exception:  # noqa: BLE001 -- a store raises its own errors for a missing artifact
            return None
        return json.loads(local.read_text())


def _refuse_if_driven(run_id: str, tag: str | None) -> None:
    """ResumeError when a live driver other than this process holds the run (its DRIVER_TAG): one still
    training it, or another `--resume` of it still starting."""
    if tag and tag != driver_tag() and driver_alive(tag):  # None (another machine's driver): taken as gone
        raise ResumeError(f"run {run_id} is held by a live driver (pid {json.loads(tag)['pid']}): it is still "
                          "running, or another --resume of it is starting; stop that one first (Ctrl-C saves "
                          "a checkpoint)")
