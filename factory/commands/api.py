"""Factory from Python: the same program as the `factory` command, which is a thin layer over these functions.

    import factory
    spec = factory.load("specs/tiny.yaml", ["train.steps=2"])   # a path, YAML text or a dict -> the typed Spec
    plan = factory.compile(spec)                                   # -> the Plan (`factory plan`)
    result = factory.run(plan, on_step=lambda step, m: print(step, m.get("reward/mean")))  # step 0: eval only
    factory.runs(); factory.diff(a, b)                             # `factory runs`, `factory diff --json`
    factory.evaluate("specs/tiny.yaml", model=result.run_id)       # `factory eval`

A spec error raises `SpecErrors` (its `report()` is what the command prints, FILE:LINE first); a run that
cannot be found raises `RunLookupError`. `run` works from any thread and from a notebook kernel: `stop`, a
`threading.Event` any thread may set, ends it after the step in flight, as Ctrl-C does.
"""
from __future__ import annotations

import contextlib
import json
import operator
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from factory.compiler.compile import cluster_address, compile_file, compile_spec
from factory.compiler.errors import SpecErrors
from factory.compiler.load import SpecInput, SpecSource, checked_again, load, override_list, source_of
from factory.plan import Plan
from factory.runtime.lifecycle import check_ray_on_loopback, local_ray_on_loopback, refuse_a_ray_up
from factory.schema import Spec
from factory.util import FAIL_FAST, EnvChanges, UserError

if TYPE_CHECKING:
    from factory.runtime.driver import EvalResult, OnStep, RunResult


def load_spec(spec: SpecInput, overrides: Iterable[str] = ()) -> Spec:
    """The typed, validated spec: `spec` is a path, a YAML text (a string with a line break) or a dict;
    `overrides` are dot-lists (`train.lr=1e-5`). Raises `SpecErrors` listing every problem."""
    return load(spec, overrides)[0]


def _store_read() -> contextlib.AbstractContextManager[None]:
    """MLflow's fail-fast settings around a read of the tracking store, as the command has them (cli.main): a store
    that does not answer said in seconds, not after MLflow's retries (minutes). Only around the read: the caller's
    own MLflow calls keep MLflow's settings, and settings of the caller's own are kept."""
    return FAIL_FAST.held()  # (held with a run's tracker in another thread, which needs them as long as it writes)


def say_warnings(plan: Plan) -> None:
    """The plan's warnings (settings that do nothing here), on stderr: every command and call that compiles a
    spec says them."""
    for warning in plan.warnings:
        print(warning, file=sys.stderr)


def compile_plan(spec: Spec | SpecInput, overrides: Iterable[str] = (), *, connect: bool = False,
                 weights: bool = True) -> Plan:
    """The Plan of a spec (a Spec from `load`, a path, a YAML text or a dict): every reference resolved,
    the stage graph built, the run's hashes. Errors of loading and compiling are raised together as
    `SpecErrors`. `connect` also starts every tool server to check the tools the spec names; `weights`
    False lets `model.path` hold no weights (factory.compiler.compile.compile_file)."""
    if isinstance(spec, Spec):
        if overrides:  # a typed spec is final: overrides apply to what it was loaded from
            raise TypeError("overrides go with a path, YAML text or dict, not with a loaded Spec: "
                            "factory.load(spec, overrides) first")
        source = source_of(spec) or SpecSource("<spec>", Path.cwd(), "")  # a Spec built in code
        spec = checked_again(spec, source)  # (its dicts and lists may have been changed in place since)
        return compile_spec(spec, source, connect=connect, weights=weights)  # this Spec as it is: its servers too
    return compile_file(spec, overrides, connect=connect, weights=weights)[1]


# One run in this process at a time: each starts a Ray of its own (ray.init), and a process holds one Ray; a second
# run's start failed ("ray.init twice") and its clean-up shut the first run's Ray down under it.
_RUNNING = threading.Lock()
# What the run being made set in this process's environment before its driver started Ray (the loopback flag, what
# importing ray sets), put back when it returns, as the driver's stop_ray puts back what starting Ray set.
_SET_HERE = EnvChanges(lambda name: name.startswith("RAY_"))


@contextlib.contextmanager
def _alone(what: str) -> Iterator[None]:
    """`what` (factory.run, factory.evaluate) refused at once, before anything is done, where another run of this
    process is still going on (a notebook's in a thread) or a Ray is up here already (`refuse_a_ray_up`); once it
    returns, what it recorded in `_SET_HERE` put back. (One whose local Ray would listen on every interface, ray
    imported too early, is refused as soon as the spec says it starts one: `local_ray_on_loopback`.)"""
    if not _RUNNING.acquire(blocking=False):
        raise UserError(f"{what}: another factory.run or factory.evaluate is still running in this process: each "
                        "starts a Ray of its own, and a process holds one Ray at a time: wait for it to end (its "
                        "`stop` event ends it after the step in flight), or start this one in a process of its own "
                        "(`factory run SPEC`, a subprocess)")
    try:
        refuse_a_ray_up(what)
        yield
    finally:
        try:
            _SET_HERE.put_back()
        finally:
            _RUNNING.release()


@_alone("factory.run")
def run(plan: Plan | Spec | SpecInput, overrides: Iterable[str] = (), *, on_step: OnStep | None = None,
        stop: threading.Event | None = None, resume: str | None = None, allow_spec_change: bool = False,
        started_at: float | None = None) -> RunResult:
    """Train: place the plan's stages on Ray, run the loop, track the run in MLflow; returns the run's result
    (`run_id`, the `before` and `after` eval metrics, the last `checkpoint`, `status` FINISHED or KILLED).

    `plan` may also be anything `compile_plan` takes. `on_step(step, metrics)` hears every step's metrics as
    they are logged (step 0: the evaluation before training). `stop`: set it from any thread to end the run
    after the step in flight (logged and checkpointed; the MLflow run KILLED), as Ctrl-C does. `resume`:
    continue a killed or stopped run (its id, id prefix or name; "" for the newest unfinished run of this
    spec) from its newest checkpoint. `started_at` (epoch seconds): when the command started, for the run's
    duration and start-up times (default: this call's start)."""
    # now, not the driver's start: compiling the spec and looking the run up below are the run's start-up too
    started_at = time.time() if started_at is None else started_at
    _check_run_arguments(on_step, stop, resume)
    _check_no_mlflow_run("factory.run")
    if allow_spec_change and resume is None:  # (it allows nothing then: the command refuses it too)
        raise TypeError("allow_spec_change goes with resume: a run to continue under the changed spec")
    if not isinstance(plan, Plan):
        plan = compile_plan(plan, overrides)
        say_warnings(plan)  # (a Plan passed in was compiled by the caller, who has them: `factory run`)
    elif overrides:
        raise TypeError("overrides go with a spec, not with a compiled Plan")
    with _SET_HERE.recording():
        local_ray_on_loopback(plan.driver.resources.ray_address, "factory.run")  # before the driver imports ray
        from factory.runtime import driver  # noqa: F401 -- (importing ray sets RAY_CLIENT_MODE)
    found = None
    if resume is not None:
        from factory.runtime.resume import find
        from factory.tracking.mlflow_tracker import tracking_uri

        d = plan.driver
        with _store_read():
            found = find(plan, resume or None, tracking_uri(d.tracking.uri), train=d.train,
                         experiment=d.tracking.experiment, allow_spec_change=allow_spec_change)
        print(found.describe(), file=sys.stderr)
    try:
        return _run_plan(plan, found, on_step, stop, started_at)
    except KeyboardInterrupt as e:  # a second Ctrl-C or SIGTERM, or one before the steps began: stopped at once
        run_id = getattr(e, "run_id", None) or (found.run_id if found is not None else None)
        _note(e, "factory.run: stopped during start-up, before the run was recorded: there is nothing to resume; "
                 "the same call starts it again" if run_id is None else
                 f"factory.run: stopped at once, the step in flight unsaved: factory.run(..., resume={run_id!r}) "
                 "continues the run from its newest checkpoint (once its steps have begun)")
        raise
    finally:
        # its claim (find), where the run never reopened: the driver released one that did, after its teardown
        if found is not None:
            _release(plan, found.run_id)


def _release(plan: Plan, run_id: str) -> None:
    from factory.tracking.tracker import open_tracker

    try:
        with _store_read():
            open_tracker(plan.driver.tracking.uri).release(run_id)
    except Exception as e:  # noqa: BLE001 -- the store is down: what the run raised, or returned, matters more
        print(f"factory.run: run {run_id} could not be released ({type(e).__name__}: {str(e)[:200]}): another "
              "process resumes it once this one has exited", file=sys.stderr)


def _run_plan(plan: Plan, found: Any, on_step: OnStep | None, stop: threading.Event | None,
              started_at: float | None) -> RunResult:
    from factory.runtime.driver import run as run_plan

    # The run's stop request, which Ctrl-C sets too: the caller's event is left as it is, theirs to reuse (set,
    # their next run with it stopped before step 1)
    either = _Either(stop)
    if on_step is None:
        return run_plan(plan, found, started_at=started_at, stop=either)
    # on_step raising ended the run FAILED with the step it had just trained unsaved: it stops the run as
    # `stop` does (after the step, saved), and is raised then, saying how to resume
    raised: list[tuple[int, Exception]] = []

    def heard(step: int, metrics: dict[str, float]) -> None:
        if not raised:
            try:
                on_step(step, metrics)
            except Exception as e:
                raised.append((step, e))
                either.set()

    result = run_plan(plan, found, started_at=started_at, on_step=heard, stop=either)
    if raised:
        step, e = raised[0]
        if result.status == "FINISHED":  # raised at the last step: there was no step left to stop, nor to resume
            note = (f"factory.run: on_step raised this at step {step}; the run had finished every step (all "
                    f"{result.last_step}, FINISHED)"
                    + (f", the last saved in {result.checkpoint}" if result.checkpoint else ""))
        else:
            note = (f"factory.run: on_step raised this at step {step}; the run stopped after step {result.last_step}"
                    + (f", saved: factory.run(..., resume={result.run_id!r}) continues it" if result.checkpoint
                       else " with nothing trained"))
        _note(e, note)
        raise e
    return result


def _note(e: BaseException, note: str) -> None:
    """`note` added to what factory.run raises (how to take the run up), as the command prints it."""
    if hasattr(e, "add_note"):  # Python 3.11+
        e.add_note(note)
    else:
        print(note, file=sys.stderr)


class _Either:
    """A stop request that is set when the caller's `stop` event is, or by `set()` here (Ctrl-C, an on_step
    that raised): as threading.Event to the run, without setting the caller's."""

    def __init__(self, theirs: threading.Event | None):
        self.theirs, self.mine = theirs, threading.Event()

    def is_set(self) -> bool:
        return self.mine.is_set() or (self.theirs is not None and self.theirs.is_set())

    def set(self) -> None:
        self.mine.set()


def _check_no_mlflow_run(what: str) -> None:
    """Refuse, before anything starts, to run where the caller has an MLflow run active in this thread (a
    notebook's `mlflow.start_run()`): the tracker writes its run with MLflow's fluent API, which holds one active
    run per thread, and failed at its start_run once Ray and every stage had started (~40 s). Refused rather
    than nested: a nested run would be the child of a run in another store (the spec's `tracking.uri`), and
    setting the caller's run aside would reach into MLflow's private run stack."""
    if "mlflow" not in sys.modules:  # never imported: no run of the caller's can be active
        return
    import mlflow

    if (active := mlflow.active_run()) is not None:
        raise RuntimeError(f"{what}: an MLflow run of yours is active in this thread (run {active.info.run_id}), and "
                           f"Factory records its own run in its own store: end yours first (mlflow.end_run()), or "
                           f"call {what} outside its `with mlflow.start_run():` block")


def _check_run_arguments(on_step: Any, stop: Any, resume: Any) -> None:
    """TypeError for a Python mistake in `run`'s arguments, before anything starts: each was first used after
    Ray and every stage had started (30-60 s), and failed there as a bare "'str' object is not callable" (or
    "<lambda>() takes 1 positional argument but 2 were given")."""
    if on_step is not None:
        import inspect

        if not callable(on_step):
            raise TypeError(f"on_step: a function called as on_step(step, metrics), got {type(on_step).__name__}")
        if any(inspect.iscoroutinefunction(f) or inspect.isasyncgenfunction(f)
               for f in (on_step, getattr(on_step, "__call__", None))):
            raise TypeError("on_step: a plain function (def), got an async one: factory.run calls it and never awaits "
                            "it, so it would never run; pass a plain def (asyncio.run_coroutine_threadsafe in it hands "
                            "each step to your event loop)")
        try:
            signature = inspect.signature(on_step)
        except ValueError:  # a callable whose signature cannot be read (some builtins): taken as it is
            signature = None
        if signature is not None:
            try:
                signature.bind(0, {})
            except TypeError:
                raise TypeError(f"on_step: called as on_step(step, metrics), but it takes {signature}") from None
    if stop is not None and not (callable(getattr(stop, "is_set", None)) and callable(getattr(stop, "set", None))):
        raise TypeError(f"stop: a threading.Event (set it to stop the run), got {type(stop).__name__}")
    if resume is not None and not isinstance(resume, str):
        raise TypeError(f"resume: a run's id, id prefix or name, or \"\" for the newest unfinished run, got "
                        f"{type(resume).__name__}")


def diff(run_a: str, run_b: str, *, prompt: int = 0, uri: str | None = None) -> dict[str, Any]:
    """Two tracked runs (id, id prefix of 8+ characters, or name) compared, as `factory diff --json` prints
    it: what defined them (`changes`: settings, templates, reward code, data, tool schemas), their
    `metrics` side by side, and the `trajectories` of the `prompt`-th prompt both saw."""
    from factory.commands.diff import diff_runs

    said = (f"prompt: which prompt's trajectories to show (an int: 0 for the first prompt both runs saw), "
            f"got {type(prompt).__name__}")
    if isinstance(prompt, bool):  # an index to Python, but never a prompt's number
        raise TypeError(said)
    try:  # (a str met a bare TypeError deep inside); operator.index also takes numpy's integers, as a list does
        prompt = operator.index(prompt)
    except TypeError:
        raise TypeError(said) from None
    with _store_read():
        return diff_runs(run_a, run_b, prompt=prompt, uri=uri)[0]


def runs(experiment: str | None = None, *, limit: int = 100, uri: str | None = None) -> list[dict[str, Any]]:
    """The tracked runs, newest first, as `factory runs --json` prints them (status, steps done, final
    reward, eval metrics, duration...; `duration_s` counts from the start of the command or `factory.run` call
    that opened the run, start-up included, as the run's summary does, less the time a resumed run had no
    driver). `uri`: the tracking store (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)."""
    from factory.tracking.runs import list_runs
    from factory.tracking.tracker import MAX_RUNS

    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:  # MLflow's own error said max_results
        raise ValueError(f"limit: at least 1 run, got {limit!r}")
    if limit > MAX_RUNS:
        raise ValueError(f"limit: at most {MAX_RUNS} runs, got {limit}")
    with _store_read():
        return list_runs(experiment, limit=limit, uri=uri)


@_alone("factory.evaluate")
def evaluate(spec: Spec | SpecInput, model: str | os.PathLike | None = None, overrides: Iterable[str] = (), *,
             uri: str | None = None, started_at: float | None = None) -> EvalResult:
    """Score a model on the spec's eval split with the spec's reward graph, without training, as a training
    run evaluates (the driver's own evaluation: greedy, the same seeds, `eval/<metric>` the same); logged as
    an MLflow run (tagged `factory.kind=eval`) that `factory.diff` compares with a training run. Returns its
    `run_id`, the `step` it is logged at and the `metrics`.

    `model`: None (the spec's model), a Hugging Face folder, a checkpoint folder (a run's, or one step's), a
    tracked run (id, id prefix or name, in `uri`: default the spec's `tracking.uri`, where the eval run is
    written, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db): its newest checkpoint, logged at that
    checkpoint's step, so that the eval run's metrics stand beside the run's final evaluation; or the base
    URL of an OpenAI-compatible server (`http://127.0.0.1:8000/v1`: vLLM, SGLang) that generates in place of a local
    engine (factory.rollout.engine_endpoint; the spec's model still gives the tokenizer and chat template).
    LoRA adapters (a LoRA run's checkpoint, a peft folder) are added beside the spec's model, as the run's
    weight syncs added them, when the spec's `model.lora` fits them; otherwise merged into their base first.
    `started_at` (epoch seconds): when the command started, for the run's duration (default: this call's start)."""
    # now, not the driver's start: finding the model and compiling the spec below are the run's start-up too
    started_at = time.time() if started_at is None else started_at
    _check_no_mlflow_run("factory.evaluate")
    overrides = override_list(overrides)  # (before one string or a dict is spread into a list below)
    # a spec with nothing to evaluate is said before the model is found (a LoRA checkpoint's merge takes minutes
    # for a large model); one with mistakes is compiled below, which says them all, loading's and compiling's
    if isinstance(spec, Spec) and overrides:
        raise TypeError("overrides go with a path, YAML text or dict, not with a loaded Spec")
    try:
        loaded = spec if isinstance(spec, Spec) else load_spec(spec, overrides)
    except SpecErrors:
        loaded = None
    if loaded is not None and not cluster_address(loaded):  # before the model is found and its server asked
        check_ray_on_loopback("factory.evaluate")  # (one that did not load: local_ray_on_loopback, below)
    if loaded is not None and loaded.data.eval is None:
        why = ("not set; evaluation scores the spec's eval split: add data.eval (a file or generator of held-out "
               "rows)")
        source = source_of(loaded)
        try:  # the spec's other mistakes with it, all at once (compiled without the model's weights: seconds)
            compile_plan(spec, overrides, weights=False)
        except SpecErrors as e:
            if source is None:
                raise
            raise SpecErrors([*e.errors, source.error("data.eval", why)], e.file) from None
        raise UserError(f"{source.file if source else '<spec>'}: data.eval: {why}")
    # a LoRA checkpoint whose adapters the spec's model.lora cannot add is merged into a full model (GBs) in
    # here, removed once evaluated or failed
    if uri is None and loaded is not None:  # a run is looked for where the spec's runs (and this eval's) are written
        uri = loaded.tracking.uri
    with tempfile.TemporaryDirectory(prefix="factory-eval-") as scratch:
        path, step, tags, adapters = _eval_model(model, uri, Path(scratch), loaded)
        endpoint = path if path is not None and path.startswith(("http://", "https://")) else None
        if endpoint is None and path is not None:
            if isinstance(spec, Spec):
                spec = spec.model_copy(update={"model": spec.model.model_copy(update={"path": path})})
            else:
                # quoted: an override's value is read as YAML, where ` #` starts a comment and `: ` a mapping
                overrides = [*overrides, f"model.path={json.dumps(path)}"]
        plan = compile_plan(spec, overrides, weights=endpoint is None)  # a server's model: only its tokenizer here
        say_warnings(plan)
        if endpoint is not None:
            plan = with_endpoint(plan, endpoint)
            if moot := served_elsewhere(loaded):
                print(f"warning: {', '.join(moot)}: no effect with a served model ({endpoint} generates with its "
                      "own engine and weights)", file=sys.stderr)
            _check_endpoint(endpoint, joins=plan.driver.resources.ray_address is not None)
        if path is not None and Path(path).is_relative_to(scratch):  # LoRA adapters merged into a scratch copy
            plan = tracked_model(plan, tags["factory.eval_model"])
        with _SET_HERE.recording():
            local_ray_on_loopback(plan.driver.resources.ray_address, "factory.evaluate")  # before the driver imports it
            from factory.runtime.driver import evaluate_only

        return evaluate_only(plan, step, tags, started_at, adapters=adapters)


def _check_endpoint(url: str, joins: bool) -> None:
    """A server that does not answer is said before Ray starts: the engine's requests retried it for minutes.
    On a cluster (`joins`) only a warning, as the server may answer only on the cluster's network."""
    from factory.compiler.connect import unreachable
    from factory.endpoints import JUDGE_PROBE_S

    why = unreachable(url)
    if why is None:
        return
    said = (f"model {url}: no answer within {JUDGE_PROBE_S:.0f} s ({why}): is the server up, and the URL its "
            "OpenAI-compatible base (ending in /v1)?")
    if not joins:
        raise UserError(said)
    print(f"warning: {said}", file=sys.stderr)


def _eval_model(model: str | os.PathLike | None, uri: str | None, scratch: Path,
                spec: Spec | None = None) -> tuple[str | None, int, dict[str, str], str | None]:
    """(the Hugging Face folder to load, the step to log at, the eval run's tags, LoRA adapters to add) for
    `evaluate`'s `model`. LoRA adapters (a checkpoint's, a peft folder) that `spec`'s `model.lora` fits
    (factory.lora.adapter_misfit) are added beside the spec's own model (the folder to load: None), as the
    run's weight syncs added them, so the evaluation samples as the run's did; others are merged into their
    base model under `scratch`, which the caller removes."""
    from factory.commands.export import ExportError, checkpoint_dir, export, hf_folder, step_folder
    from factory.update.checkpoint import ADAPTER

    def beside(folder: Path) -> str | None:
        """`folder`'s adapters added by the spec's rollout (None: merge them; the reason said)."""
        from factory.assets import resolve_model
        from factory.compiler.compile import with_cached_models
        from factory.lora import adapter_misfit

        if spec is None:
            return None
        if spec.model.lora is None:
            print(f"note: {folder}: evaluated merged into its base model (the spec has no model.lora to add them "
                  "with)", file=sys.stderr)
            return None
        try:
            why = adapter_misfit(folder, spec.model.lora, resolve_model(with_cached_models(spec).model.path))
        except Exception as e:  # noqa: BLE001 (the model not found here: compiling says it; a bad config)
            why = f"{type(e).__name__}: {e}"
        if why is None:
            return str(folder.resolve())
        print(f"note: {folder}: evaluated merged into its base model ({why})", file=sys.stderr)
        return None

    if model is None:
        return None, 0, {}, None
    ref = str(model)
    if ref.startswith(("http://", "https://")):  # an OpenAI-compatible server (its base URL, .../v1)
        return ref, 0, {"factory.eval_model": ref}, None
    local = Path(ref).expanduser()
    if (local / "config.json").is_file():  # a Hugging Face folder
        return str(local.resolve()), 0, {"factory.eval_model": str(local.resolve())}, None
    if (local / "adapter_config.json").is_file():  # a peft folder (`export --adapter`, a checkpoint's adapter/)
        from factory.commands.export import merge_adapters

        if (added := beside(local)) is not None:
            return None, 0, {"factory.eval_model": added}, added
        merged = scratch / "model"
        try:
            merge_adapters(local, merged)
        except ExportError as e:
            raise ExportError(f"model {ref}: {e}") from None
        return str(merged), 0, {"factory.eval_model": str(local.resolve())}, None
    tags = {}
    if not local.is_dir():  # a tracked run: its own checkpoint folder
        from factory.tracking.tracker import RunLookupError, StoreUnreadable, open_tracker

        with _store_read():
            try:
                run_id = open_tracker(uri, read=True).run(ref).run_id
            except RunLookupError as e:
                if not isinstance(e, StoreUnreadable) and ("/" in ref or ref.startswith(".")):  # meant as a folder
                    raise RunLookupError(f"no model folder {ref}, and {e}") from None
                raise
            local, tags = checkpoint_dir(run_id, uri), {"factory.eval_of": run_id}
    folder = step_folder(local)
    step = int(folder.name.removeprefix("step_")) if folder.name.startswith("step_") else 0
    tags["factory.eval_model"] = str(folder.resolve())
    if (folder / ADAPTER).is_dir():  # LoRA adapters: beside the spec's model, else merged as `factory export` does
        if (added := beside(folder / ADAPTER)) is not None:
            return None, step, tags, added
        merged = scratch / "model"
        export(str(folder), merged)
        return str(merged), step, tags, None
    try:
        return str(hf_folder(folder).resolve()), step, tags, None
    except ExportError as e:
        raise ExportError(f"model {ref}: {e}") from None


def tracked_model(plan: Plan, source: str) -> Plan:
    """The plan whose params and spec.yaml name `source` (the adapters the user gave) as `model.path`, not the
    merged copy it loads, which is removed once evaluated; its stages still load the copy."""
    import dataclasses

    import yaml

    from factory.compiler.compile import spec_hash
    from factory.compiler.refs import sha256_json

    spec = {**plan.spec, "model": {**plan.spec["model"], "path": source}}
    hashes = {k: v for k, v in plan.hashes.items() if k != "run"}
    hashes["spec"] = spec_hash(spec)  # (the same adapters, the same hash: not the scratch folder's)
    hashes["run"] = sha256_json(hashes)
    return dataclasses.replace(plan, spec=spec, hashes=hashes, spec_yaml=yaml.safe_dump(
        spec, sort_keys=True, allow_unicode=True, default_flow_style=False))


def served_elsewhere(spec: Spec | None) -> list[str]:
    """The settings the spec writes that only a local engine reads: moot when a served model generates."""
    if spec is None:
        return []
    from factory.compiler.settings import VLLM_ONLY

    engine = ("engine", "dtype", "batch_size", "max_model_len", *VLLM_ONLY)
    return ([f"rollout.{f}" for f in engine if f in spec.rollout.model_fields_set] +
            [f"model.{f}" for f in ("dtype", "lora") if f in spec.model.model_fields_set])


def with_endpoint(plan: Plan, url: str) -> Plan:
    """The plan with its rollout generating through the OpenAI-compatible server at `url` (its base URL,
    `.../v1`) instead of a local engine: the model is not loaded; its tokenizer still is, from `model.path`."""
    import dataclasses

    from factory.plan import RolloutSettings

    stages = tuple(dataclasses.replace(s, settings=s.settings.model_copy(update={"endpoint": url}))
                   if isinstance(s.settings, RolloutSettings) else s for s in plan.stages)
    return dataclasses.replace(plan, stages=stages)
