"""`import factory`: the Python API is the same program as the CLI (factory/commands/api.py). Loading a spec
from a path, a YAML text or a dict; compiling; a run from a thread that is not the main one, stopped from
another thread after the step in flight; `factory eval` of a finished run giving the run's own final
evaluation, and `factory diff` comparing the two."""
from __future__ import annotations

import json
import os
import queue
import sys
import threading
from pathlib import Path

import pytest
import yaml

import factory
from factory.runtime.driver import eval_stages
from factory.runtime.lifecycle import GracefulStop
from factory.schema import Spec
from tests.tracked_runs import ENGINE, STEPS, factory as factory_cli, project_copy

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "specs" / "tiny.yaml"


# ------------------------------------------------------------------------------------- load, compile
def test_a_spec_loads_from_a_path_a_yaml_text_or_a_dict(monkeypatch):
    monkeypatch.chdir(REPO)
    text = TINY.read_text()
    specs = [factory.load(TINY, ["train.steps=3"]), factory.load(text, ["train.steps=3"]),
             factory.load(yaml.safe_load(text), ["train.steps=3"])]
    assert all(isinstance(s, Spec) and s.train.steps == 3 for s in specs)
    assert specs[0].model_dump() == specs[1].model_dump() == specs[2].model_dump()
    # compiled from the typed spec or from the path with its overrides: one plan, one hash
    assert factory.compile(specs[0]).hashes == factory.compile(str(TINY), ["train.steps=3"]).hashes


def test_a_loaded_spec_changed_in_place_is_checked_again_when_compiled(monkeypatch):
    """factory.load gives a frozen Spec, but its dicts and lists can still be changed in place: a notebook's
    `spec.rewards["fmt"] = {...}` was taken unchecked, and factory.compile(spec) failed with an internal
    AttributeError ('dict' object has no attribute 'inputs'). Compiled, the Spec is validated again: a mistake
    is a SpecErrors as loading reports it, a good change is compiled as the spec now reads."""
    monkeypatch.chdir(REPO)
    spec = factory.load(TINY)
    spec.rewards["fmt"] = {"fn": 3}
    spec.rewards["total"].sum["fmt"] = 0.5
    with pytest.raises(factory.SpecErrors) as e:
        factory.compile(spec)
    at = TINY.read_text().splitlines().index("rewards:") + 1  # (the place nearest to it that the file has)
    assert e.value.report() == f"{TINY}:{at}: rewards.fmt.fn: expected a string, got 3\n1 error in {TINY}"
    spec.rewards["fmt"] = {"fn": "factory.rewards.format:called_tool"}
    plan = factory.compile(spec)
    assert plan.spec["rewards"]["fmt"]["fn"] == "factory.rewards.format:called_tool"
    assert plan.hashes == factory.compile(TINY, ["rewards.fmt.fn=factory.rewards.format:called_tool",
                                                 "rewards.total.sum.fmt=0.5"]).hashes


def test_a_default_dict_changed_in_place_is_compiled_and_checked(monkeypatch):
    """A dict the spec file left at its default is not "set" in pydantic's eyes, so validating the Spec again from
    what was set dropped a change made to it in place: `spec.tracking.tags["team"] = "nlp"` and
    `spec.chat_template_kwargs["enable_thinking"] = False` compiled as if never made, and a bad value put there
    was never checked. What was left unset and unchanged stays unset."""
    from factory.compiler.load import checked_again, source_of

    monkeypatch.chdir(REPO)
    spec = factory.load(TINY)
    again = checked_again(spec, source_of(spec))
    assert again == spec and again.model_fields_set == spec.model_fields_set
    assert again.tracking.model_fields_set == spec.tracking.model_fields_set == {"experiment", "log_trajectories"}
    spec.tracking.tags["team"] = 5  # tags: dict[str, str]
    with pytest.raises(factory.SpecErrors, match=r"tracking\.tags\.team: "):
        factory.compile(spec)
    spec.tracking.tags["team"] = "nlp"
    spec.chat_template_kwargs["enable_thinking"] = False
    plan = factory.compile(spec)
    assert plan.spec["tracking"]["tags"] == {"team": "nlp"}
    assert plan.spec["chat_template_kwargs"] == {"enable_thinking": False}
    assert plan.hashes == factory.compile(TINY, ["tracking.tags.team=nlp",
                                                 "chat_template_kwargs.enable_thinking=false"]).hashes


def test_spec_errors_are_raised_together_with_their_place(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(factory.SpecErrors) as e:
        factory.compile("name: x\nmodel: {path: factory:tiny-qwen3}\ndata: {train: {path: a.jsonl}}\n"
                        "rewards: {a: {fn: nowhere:f}}\nbeta: 0.1\n")
    assert e.value.report() == (
        "<spec>:3: data.train.path: data file not found: a.jsonl\n"
        "<spec>:4: rewards.a.fn: cannot import 'nowhere:f': no module named 'nowhere'\n"
        "<spec>:5: beta: unknown key 'beta'; did you mean 'algorithm.kl.coef'? ('beta' is the TRL name)\n"
        "3 errors in <spec>")
    with pytest.raises(factory.SpecErrors, match=r"cannot read the spec: .*; YAML text is a string with a line break"):
        factory.load("name: x")  # one line is a path: the report says how YAML text is told apart
    with pytest.raises(factory.SpecErrors, match=r"<dict>: train.stepz: unknown key 'stepz'"):
        factory.load({**yaml.safe_load(TINY.read_text()), "train": {"stepz": 1}})
    # Python's own mistakes: one string of overrides was one "override" per character; None a raw TypeError
    with pytest.raises(TypeError, match=r"overrides: a list of 'KEY=VALUE' strings, got one string: "
                                        r"\['train.steps=3'\]\?"):
        factory.load(TINY, "train.steps=3")
    with pytest.raises(TypeError, match="a spec is a path, a YAML text or a dict, got NoneType"):
        factory.compile(None)
    # a dict of overrides gave its keys alone ("expected KEY=VALUE, got 'train.steps'"); a pair an AttributeError
    with pytest.raises(TypeError, match=r"^overrides: a list of 'KEY=VALUE' strings, got a dict: "
                                        r"\['train.steps=3', 'train.lr=1e-05'\]\?$"):
        factory.load(TINY, {"train.steps": 3, "train.lr": 1e-5})
    with pytest.raises(TypeError, match=r"^overrides: a list of 'KEY=VALUE' strings, got \('train.steps', 3\) "
                                        r"\(tuple\)$"):
        factory.compile(TINY, [("train.steps", 3)])
    # evaluate spread one string into a list of characters when it was given a model folder
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(TypeError, match=r"got one string: \['train.steps=3'\]\?"):
        factory.evaluate(TINY, model=folder, overrides="train.steps=3")
    # a typo under a dotted override is the override's, not the spec line of its first part
    with pytest.raises(factory.SpecErrors, match=r"^<override 1>: trian: unknown key 'trian'"):
        factory.load(TINY, ["trian.steps=3"])


async def _async_on_step(step, metrics):  # (called, it only makes a coroutine)
    print(step)


def test_python_mistakes_in_load_and_diff_are_said_as_such(monkeypatch):
    """`factory.load(spec, None)` (a notebook's "no overrides") raised "'NoneType' object is not iterable", and
    `factory.diff(a, b, prompt="1")` a bare TypeError from deep inside. A numpy integer (`np.argmax(...)`)
    indexes the prompts as an int does, so it is taken; a float or a bool is not an index."""
    import numpy as np

    from factory.commands import diff as diff_module

    monkeypatch.chdir(REPO)
    assert factory.load(TINY, None) == factory.load(TINY)  # None: no overrides
    for prompt, said in [("1", "str"), (1.0, "float"), (True, "bool")]:
        with pytest.raises(TypeError, match=r"^prompt: which prompt's trajectories to show \(an int: 0 for the "
                                            rf"first prompt both runs saw\), got {said}$"):
            factory.diff("a" * 8, "b" * 8, prompt=prompt)
    seen = []
    monkeypatch.setattr(diff_module, "diff_runs", lambda a, b, prompt, uri: (seen.append(prompt), None, None))
    factory.diff("a" * 8, "b" * 8, prompt=np.int64(1))
    assert seen == [1] and type(seen[0]) is int


def test_a_runs_python_mistakes_are_said_before_anything_starts(monkeypatch):
    """A callback that is not one, or takes other arguments, a stop that is not an Event, a run named by a
    number: each failed only when first used, after Ray and every stage had started (30-60 s), as a bare
    "'str' object is not callable"."""
    from factory.commands import api

    def started(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(api, "compile_plan", started)
    for kwargs, said in [({"on_step": "print"}, r"^on_step: a function called as on_step\(step, metrics\), got str$"),
                         ({"on_step": lambda metrics: None},
                          r"^on_step: called as on_step\(step, metrics\), but it takes \(metrics\)$"),
                         ({"on_step": _async_on_step},
                          r"^on_step: a plain function \(def\), got an async one: factory.run calls it and never "
                          r"awaits it, so it would never run"),
                         ({"stop": True}, r"^stop: a threading.Event \(set it to stop the run\), got bool$"),
                         ({"resume": 3}, r"^resume: a run's id, id prefix or name, or \"\" for the newest "
                                         r"unfinished run, got int$")]:
        with pytest.raises(TypeError, match=said):
            factory.run(TINY, **kwargs)
    with pytest.raises(TypeError, match="^allow_spec_change goes with resume"):  # as `factory run` refuses it
        factory.run(TINY, allow_spec_change=True)
    # what the docs show, and a callable whose signature Python cannot read, pass the checks
    with pytest.raises(AssertionError, match="the run started"):
        factory.run(TINY, on_step=lambda step, metrics: None, stop=threading.Event(), resume="")
    with pytest.raises(AssertionError, match="the run started"):
        factory.run(TINY, on_step=print)


def test_compiling_with_connect_compiles_the_spec_it_is_given(monkeypatch):
    """`connect` starts the tool servers of this Spec: a Spec built in code has no file to read again, and a
    loaded one changed in code (`model_copy`) must keep its changes."""
    monkeypatch.chdir(REPO)
    data = yaml.safe_load(TINY.read_text())
    data["tools"] = {"calc": {"function": "tests.tool_servers.drifting:answer"}}  # in-process: nothing to start
    built = Spec.model_validate(data)
    assert factory.compile(built, connect=True).tools == {"calc": ["calc"]}
    changed = factory.load(data).model_copy(update={"name": "changed"})
    plan = factory.compile(changed, connect=True)
    assert plan.spec["name"] == "changed" and plan.tools == {"calc": ["calc"]}


def test_a_stop_event_set_by_another_thread_is_a_stop_request():
    """GracefulStop in a thread that is not the main one: no signal handler (Python allows none there),
    and the event, set from yet another thread, asks the loop to stop."""
    event, seen = threading.Event(), []

    def loop():
        with GracefulStop(event=event) as stop:
            seen.append(stop.requested)
            threading.Thread(target=event.set).start()
            event.wait(5)
            seen.append(stop.requested)

    worker = threading.Thread(target=loop)
    worker.start()
    worker.join(10)
    assert seen == [False, True]


def test_an_evaluation_places_only_what_the_eval_flow_reaches(monkeypatch):
    monkeypatch.chdir(REPO)
    plan = eval_stages(factory.compile(TINY))
    assert [s.name for s in plan.stages] == ["data", "rollout", "tools", "reward"]
    assert {e.kind for e in plan.edges} == {"data", "eval", "call"} and "update" not in {e.dst for e in plan.edges}


def test_eval_of_a_lora_checkpoint_removes_the_merged_model_after(tmp_path, monkeypatch):
    """`factory eval --model` of a LoRA checkpoint merges the adapters into a full model (GBs for a real one):
    it is gone once the evaluation returns, or fails."""
    import factory.commands.api as api
    import factory.commands.export as export
    import factory.runtime.driver as driver

    monkeypatch.chdir(REPO)
    step = tmp_path / "run" / "step_00003"
    (step / "adapter").mkdir(parents=True)
    merged, seen = [], []
    monkeypatch.setattr(export, "export", lambda src, dst: (Path(dst).mkdir(parents=True), merged.append(Path(dst))))
    tiny = factory.compile(TINY)
    monkeypatch.setattr(api, "compile_plan", lambda spec, overrides, **k: seen.append(list(overrides)) or tiny)
    monkeypatch.setattr(driver, "evaluate_only", lambda plan, step, tags, started_at, **k: (merged[-1].is_dir(), step))
    assert factory.evaluate(TINY, model=step) == (True, 3)  # there while it is evaluated, at the checkpoint's step
    assert seen == [[f"model.path={json.dumps(str(merged[0]))}"]] and not merged[0].exists()

    def fails(plan, step, tags, started_at, **k):
        raise RuntimeError("the engine failed")

    monkeypatch.setattr(driver, "evaluate_only", fails)
    with pytest.raises(RuntimeError, match="the engine failed"):
        factory.evaluate(TINY, model=step)
    assert len(merged) == 2 and not merged[1].exists()


def _overrides_compiled(monkeypatch) -> list[list[str]]:
    """The overrides each compile of evaluate() is handed; the compile then stops the call ("stop here")."""
    import factory.commands.api as api

    seen: list[list[str]] = []

    def compiled(spec, overrides, **k):
        seen.append(list(overrides))
        raise RuntimeError("stop here")

    monkeypatch.setattr(api, "compile_plan", compiled)
    return seen


def test_eval_of_a_model_folder_whose_path_yaml_would_misread_takes_it_whole(tmp_path, monkeypatch):
    """The folder's path went into an override unquoted, read as YAML: `exp #2` was cut at ` #` (a comment),
    and `a: b` became a mapping ("<override 3>: model.path: model folder not found: .../exp")."""
    monkeypatch.chdir(REPO)
    folder = tmp_path / "exp #2: x"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    seen = _overrides_compiled(monkeypatch)
    with pytest.raises(RuntimeError, match="stop here"):
        factory.evaluate(TINY, model=folder)
    assert factory.load(TINY, seen[0]).model.path == str(folder.resolve())


def test_eval_of_a_spec_without_eval_data_says_so_before_the_model_is_found(monkeypatch):
    """It was said after the model had been found and, for a LoRA checkpoint, merged (minutes for a large
    model), without what to do."""
    from factory.commands import api
    from factory.util import UserError as raised

    UserError = factory.UserError  # what a caller catches: it was not exported from `factory`
    assert UserError is raised and issubclass(factory.ResumeError, UserError) and "UserError" in dir(factory)
    from factory.runtime.health import StageStartError  # the exit-3 kind a caller catches by a public name too
    assert issubclass(StageStartError, factory.InfraFailure) and "InfraFailure" in dir(factory)
    monkeypatch.chdir(REPO)

    def found(*args, **kwargs):
        raise AssertionError("the model was looked for")

    monkeypatch.setattr(api, "_eval_model", found)
    with pytest.raises(UserError, match=r"^<spec>: data.eval: not set; evaluation scores the spec's eval split: add "
                                        r"data.eval \(a file or generator of held-out rows\)$"):
        factory.evaluate(TINY.read_text(), model="a-lora-run", overrides=["data.eval=null"])
    with pytest.raises(UserError, match=rf"^{TINY}: data.eval: not set"):
        factory.evaluate(factory.load(TINY, ["data.eval=null"]), model="a-lora-run")
    # with the spec's other mistakes, all at once (it said this one, and the next only once it was fixed)
    with pytest.raises(factory.SpecErrors) as e:
        factory.evaluate(TINY, overrides=["data.eval=null", "rewards.correct.fn=nosuch:fn"])
    assert [err.path for err in e.value.errors] == ["data.eval", "rewards.correct.fn"]


def test_run_and_evaluate_print_the_plans_warnings_as_the_commands_do(monkeypatch, capsys):
    """`factory.run` and `factory.evaluate` of a spec (not a Plan) said none of `factory check`'s warnings."""
    import factory.compiler.connect as connect
    import factory.runtime.driver as driver

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(driver, "run", lambda plan, found, **kwargs: "ran")
    monkeypatch.setattr(driver, "evaluate_only", lambda plan, step, tags, started_at, **k: "evaluated")
    monkeypatch.setattr(connect, "unreachable", lambda url: None)  # as if a server answered there
    moot = ["rollout.engine=hf", "rollout.kv_cache_gb=4"]
    assert factory.run(TINY, moot) == "ran"
    said = "rollout.kv_cache_gb: warning: has no effect with engine 'hf' (vLLM only)\n"
    assert capsys.readouterr().err.endswith(said)
    assert factory.run(factory.compile(TINY, moot)) == "ran" and capsys.readouterr().err == ""  # (the caller has them)
    assert factory.evaluate(TINY, model="http://127.0.0.1:9/v1", overrides=moot) == "evaluated"
    assert capsys.readouterr().err.splitlines()[-2:] == [
        f"<override 2>: {said.strip()}", "warning: rollout.engine, rollout.kv_cache_gb: no effect with a served "
                                         "model (http://127.0.0.1:9/v1 generates with its own engine and weights)"]


def test_run_and_evaluate_count_their_own_compile_in_the_start_up(monkeypatch):
    """`factory.run(SPEC)` and `factory.evaluate(SPEC)` compile the spec (and `resume=` looks the run up) before
    the driver starts: with no `started_at` the driver's clock began after that, and the run's duration_s
    and timing/startup_s left the compile out (docs/python.md: "from the start of the ... factory.run call")."""
    import time

    import factory.compiler.connect as connect
    import factory.runtime.driver as driver
    from factory.commands import api

    monkeypatch.chdir(REPO)
    compiled_at, started = [], []
    compile_plan = api.compile_plan

    def timed(*a, **k):
        compiled_at.append(time.time())
        return compile_plan(*a, **k)

    monkeypatch.setattr(api, "compile_plan", timed)
    monkeypatch.setattr(driver, "run", lambda plan, found, started_at, **k: started.append(started_at))
    monkeypatch.setattr(driver, "evaluate_only", lambda plan, step, tags, started_at, **k: started.append(started_at))
    monkeypatch.setattr(connect, "unreachable", lambda url: None)  # as if a server answered there
    factory.run(TINY)
    factory.evaluate(TINY, model="http://127.0.0.1:9/v1")
    assert len(compiled_at) == 2 and None not in started, started
    assert started[0] <= compiled_at[0] and started[1] <= compiled_at[1], (started, compiled_at)
    factory.run(TINY, started_at=12.5)  # the command's start (its process's), as `factory run` passes it
    factory.evaluate(TINY, model="http://127.0.0.1:9/v1", started_at=12.5)
    assert started[2:] == [12.5, 12.5]


def test_eval_through_a_server_needs_no_weights_in_model_path(tmp_path, monkeypatch):
    """`factory eval --model URL` takes only the tokenizer and chat template from `model.path`: a folder
    without weights (a model served elsewhere) is fine there, and a spec error for a run, which loads them."""
    import shutil

    import factory.compiler.connect as connect
    import factory.runtime.driver as driver
    from factory.assets import resolve_model
    from factory.compiler.errors import SpecErrors

    monkeypatch.chdir(REPO)
    folder = tmp_path / "tokenizer-only"
    shutil.copytree(resolve_model("factory:tiny-qwen3"), folder, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(SpecErrors, match="model folder has no weights"):
        factory.compile(TINY, [f"model.path={folder}"])
    monkeypatch.setattr(driver, "evaluate_only", lambda plan, step, tags, started_at, **k: plan.stage("rollout").settings.endpoint)
    monkeypatch.setattr(connect, "unreachable", lambda url: None)  # as if a server answered there
    assert factory.evaluate(TINY, model="http://127.0.0.1:9/v1", overrides=[f"model.path={folder}"]) == (
        "http://127.0.0.1:9/v1")


def test_compile_with_connect_keeps_weights_false(tmp_path, monkeypatch):
    """A spec with tools is compiled again once its servers listed their tools: that second compile dropped
    `weights=False`, so `factory.compile(spec, connect=True, weights=False)` refused the folder without weights."""
    import shutil

    from factory.assets import resolve_model

    monkeypatch.chdir(REPO)
    folder = tmp_path / "tokenizer-only"
    shutil.copytree(resolve_model("factory:tiny-qwen3"), folder, ignore=shutil.ignore_patterns("*.safetensors"))
    overrides = [f"model.path={folder}"]
    assert factory.compile(TINY, overrides, connect=True, weights=False).hashes["tools"]
    assert factory.compile(factory.load(TINY, overrides), connect=True, weights=False).hashes["tools"]


def test_eval_of_a_model_folder_that_is_not_there_says_so(tmp_path, monkeypatch):
    """`--model ./path` that does not exist is not only "no run with that name": the user meant a folder."""
    import factory.tracking.tracker as tracker_module
    from factory.tracking.tracker import RunLookupError

    class NoRuns:
        def run(self, ref):
            raise RunLookupError(f"no run with id or name '{ref}' in sqlite:///mlflow.db")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tracker_module, "open_tracker", lambda uri=None, experiment=None, read=False: NoRuns())
    with pytest.raises(RunLookupError, match=r"^no model folder \./nope, and no run with id or name '\./nope'"):
        factory.evaluate(TINY, model="./nope")
    with pytest.raises(RunLookupError, match=r"^no run with id or name 'nope' in"):  # a name: a run it meant
        factory.evaluate(TINY, model="nope")


def test_eval_of_a_run_finds_it_in_the_specs_own_store(tmp_path, monkeypatch):
    """`factory eval SPEC --model RUN` looked RUN up in $MLFLOW_TRACKING_URI or ./mlflow.db, not in the spec's
    `tracking.uri`, where the spec's runs and the eval run itself are written (and rescore and --resume look):
    `factory.evaluate(spec, model=result.run_id)` failed with "no tracking store at sqlite:///mlflow.db"."""
    from mlflow.tracking import MlflowClient

    from factory.update.checkpoint import commit, staging

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    store = f"sqlite:///{tmp_path}/store.db"
    ckpt = tmp_path / "runs" / "tiny-run"
    hf = ckpt / staging(ckpt, "step_00002") / "hf"
    hf.mkdir(parents=True)
    for name in ("config.json", "tokenizer_config.json", "model.safetensors"):
        (hf / name).write_text("{}")
    commit(ckpt, "step_00002")
    client = MlflowClient(store)  # (not MLflow's fluent API, whose active experiment would outlive the test)
    run_id = client.create_run(client.create_experiment("tiny"), run_name="tiny-run",
                               tags={"factory.checkpoint_dir": str(ckpt)}).info.run_id
    seen = _overrides_compiled(monkeypatch)
    with pytest.raises(RuntimeError, match="stop here"):
        factory.evaluate(TINY, model=run_id[:8], overrides=[f"tracking.uri={store}"])
    assert seen == [[f"tracking.uri={store}", f"model.path={json.dumps(str(ckpt / 'step_00002' / 'hf'))}"]]


def test_evaluate_checks_its_server_from_a_running_event_loop_too():
    """A notebook cell runs in an event loop: `factory.evaluate(model="http://...")` met asyncio.run's
    "cannot be called from a running event loop" in its server check, before it could say the server is down."""
    import asyncio

    from factory.commands.api import _check_endpoint
    from factory.util import UserError
    from tests.servers import free_port

    url = f"http://127.0.0.1:{free_port()}/v1"

    async def cell():
        with pytest.raises(UserError, match=f"model {url}: no answer within"):
            _check_endpoint(url, joins=False)

    asyncio.run(cell())


# ------------------------------------------------------------------------------------ real runs
@pytest.mark.slow  # a tiny training run of 3 steps (about 1.5 min on 2 cores); issue 24's acceptance of item 1
def test_a_run_from_a_thread_stops_after_the_step_when_another_thread_asks(tmp_path, monkeypatch):
    """factory.run in a thread that is not the main one, each step's metrics streamed to on_step: the main
    thread sets `stop` once step 1 is logged, and the 3-step run ends after the step in flight, logged and
    checkpointed, KILLED as Ctrl-C leaves it: step 1 when the loop hears the stop before it moves on, else
    step 2 (which of the two is a race between the threads; the record agrees with itself either way). (A run that completes from a thread: the eval test's
    run below, and docs/python.md.)"""
    from mlflow.tracking import MlflowClient

    work = project_copy(tmp_path / "project")
    uri = f"sqlite:///{work}/mlflow.db"
    overrides = [f"tracking.uri={uri}", f"rollout.engine={ENGINE}", "train.steps=3"]
    steps: queue.Queue = queue.Queue()
    stop, out = threading.Event(), {}

    def train():
        try:
            out["result"] = factory.run("specs/tiny.yaml", overrides, stop=stop,
                                        on_step=lambda step, metrics: steps.put((step, dict(metrics))))
        except BaseException as e:  # noqa: BLE001 -- shown by the assertion below
            out["error"] = e

    monkeypatch.chdir(work)
    worker = threading.Thread(target=train)
    worker.start()
    seen = []
    while not seen or seen[-1][0] < 1:
        try:
            seen.append(steps.get(timeout=1))
        except queue.Empty:  # a run that failed before step 1 says why at once, not after the wait
            assert worker.is_alive(), out.get("error")
    stop.set()  # step 1 is logged; the loop is recording it, or step 2 is in flight
    worker.join(600)
    assert not worker.is_alive() and "error" not in out, out.get("error")
    result = out["result"]
    while not steps.empty():
        seen.append(steps.get())
    last = seen[-1][0]
    assert last in (1, 2) and [s for s, _ in seen] == list(range(last + 1)) and result.last_step == last
    assert (result.stopped, result.status) == (True, "KILLED")
    run = MlflowClient(uri).get_run(result.run_id)
    assert run.info.status == "KILLED" and run.data.tags["factory.step"] == str(last)
    assert run.data.metrics["reward/mean"] == seen[-1][1]["reward/mean"]  # what on_step heard is what was logged
    assert Path(result.checkpoint).name == f"step_{last}"


@pytest.mark.slow  # a `factory eval` of the shared tiny run: 34 s of its own on a 2-core AMD EPYC Zen 4 (#23's budget)
def test_eval_of_a_finished_run_gives_its_final_evaluation_and_diff_compares_them(tiny_runs, tmp_path):
    """`factory eval SPEC --model RUN` scores the run's newest checkpoint on the eval split, with the
    driver's own evaluation (greedy, the same seeds): the metrics the run logged at its last step; then
    `factory diff` compares the eval run with the training run (the model is what differs)."""
    import json

    run = tiny_runs.a
    # its own experiment: the tests that list the pair's experiment find the pair alone
    out = factory_cli("eval", "specs/tiny.yaml", "--model", run.info.run_id, f"train.steps={STEPS}",
                      f"rollout.engine={ENGINE}", "tracking.experiment=tiny-eval", cwd=tiny_runs.work_a,
                      uri=tiny_runs.uri)
    assert out.returncode == 0, out.stderr[-3000:]
    experiment = tiny_runs.client.get_experiment_by_name("tiny-eval").experiment_id
    (ev,) = tiny_runs.client.search_runs([experiment], f"tags.`factory.eval_of` = '{run.info.run_id}'")
    assert ev.info.status == "FINISHED" and ev.data.tags["factory.kind"] == "eval"
    # its duration counts from the command's start (the model found, a LoRA merged), as a training run's does
    assert float(ev.data.tags["factory.command_started"]) <= ev.info.start_time / 1000
    final = {k: v for k, v in run.data.metrics.items() if k.startswith("eval/")}
    assert final and ev.data.metrics == final
    history = tiny_runs.client.get_metric_history(ev.info.run_id, "eval/reward")
    assert [m.step for m in history] == [STEPS]
    diff = factory_cli("diff", run.info.run_id, ev.info.run_id, "--json", cwd=tiny_runs.work_a, uri=tiny_runs.uri)
    assert diff.returncode == 0, diff.stderr[-3000:]
    report = json.loads(diff.stdout)
    assert [c["key"] for c in report["changes"] if c["kind"] == "setting"] == ["tracking.experiment"]
    (model,) = [c for c in report["changes"] if c["kind"] == "model"]  # the run's checkpoint, evaluated
    assert model["b"] == ev.data.tags["factory.eval_model"] and model["b"].endswith(f"step_{STEPS}")
    # the eval's model is the run's checkpoint: no "not comparable: different model", a note instead
    assert report["warnings"] == [] and "B evaluates the other run's checkpoint" in " ".join(report["notes"])
    rows = {(m["metric"], m["agg"]): m for m in report["metrics"]}
    assert rows[("eval/reward", "final")]["delta"] == 0
    # a prompt past those both runs saw: an index out of range from Python (it was RunLookupError: "no such run")
    with pytest.raises(IndexError, match=r"^prompt 99 \(--prompt; prompt= from Python\): the runs share \d+ prompts"):
        factory.diff(run.info.run_id, ev.info.run_id, prompt=99, uri=tiny_runs.uri)


def test_on_step_raising_stops_the_run_saved_and_is_raised_with_how_to_resume(monkeypatch, capsys):
    """A notebook callback's typo ended a long run FAILED, the step it had just trained unsaved (a resume
    started over). It stops the run as `stop` does -- after the step, checkpointed -- and is raised then."""
    import factory.runtime.driver as driver
    from factory.runtime.driver import RunResult

    heard = []

    def fake_run(plan, found, *, started_at, on_step, stop):  # the driver: steps until `stop` is set
        for step in range(4):
            on_step(step, {"reward/mean": 0.5})
            heard.append(step)
            if stop.is_set():  # the step in flight ends, saved
                return RunResult("abc123", {}, {}, f"/runs/tiny/step_{step}", stopped=True, last_step=step)
        raise AssertionError("not stopped")

    def typo(step, metrics):
        if step == 2:
            metrics["reward/maen"]

    monkeypatch.setattr(driver, "run", fake_run)
    monkeypatch.chdir(TINY.parent.parent)
    theirs = threading.Event()
    with pytest.raises(KeyError) as caught:
        factory.run(TINY, on_step=typo, stop=theirs)
    assert heard == [0, 1, 2] and not theirs.is_set()  # the caller's event is theirs to reuse
    note = ("factory.run: on_step raised this at step 2; the run stopped after step 2, saved: "
            "factory.run(..., resume='abc123') continues it")
    if sys.version_info >= (3, 11):
        assert caught.value.__notes__ == [note]
    else:  # (no exception notes before 3.11: said on stderr)
        assert note in capsys.readouterr().err


def test_a_run_stopped_at_once_is_raised_with_how_to_resume(monkeypatch, capsys):
    """A second Ctrl-C (or one while the stages started) reached the caller as a bare KeyboardInterrupt(): the
    run's id was on it as `run_id`, said nowhere, where `factory run` prints the command that resumes it and an
    on_step that raised carries a note saying so."""
    import factory.runtime.driver as driver

    def interrupted(run_id):
        def fake_run(plan, found, **kwargs):
            e = KeyboardInterrupt()
            if run_id is not None:  # what the driver's opened_run sets once the run is recorded
                e.run_id = run_id
            raise e
        return fake_run

    monkeypatch.chdir(TINY.parent.parent)
    notes = []
    for run_id in ("abc123", None):
        monkeypatch.setattr(driver, "run", interrupted(run_id))
        with pytest.raises(KeyboardInterrupt) as caught:
            factory.run(TINY)
        assert getattr(caught.value, "run_id", None) == run_id
        notes.append(caught.value.__notes__ if sys.version_info >= (3, 11) else capsys.readouterr().err)
    said = ["factory.run: stopped at once, the step in flight unsaved: factory.run(..., resume='abc123') continues "
            "the run from its newest checkpoint (once its steps have begun)",
            "factory.run: stopped during start-up, before the run was recorded: there is nothing to resume; the same "
            "call starts it again"]
    if sys.version_info >= (3, 11):
        assert notes == [[said[0]], [said[1]]]
    else:  # (no exception notes before 3.11: said on stderr)
        assert [n.strip() for n in notes] == said


@pytest.mark.parametrize("with_on_step", [True, False])
def test_ctrl_c_stops_the_run_but_leaves_the_callers_stop_event_unset(monkeypatch, with_on_step):
    """Ctrl-C ("interrupt kernel") during factory.run(..., stop=ev) set the caller's own Event when no on_step
    was given (the driver's stop request was that Event), so their next factory.run(..., stop=ev), or the
    resume= it suggests, stopped before step 1. The driver's real loop over tests/test_driver_loop.py's fakes."""
    import os
    import signal
    import time

    import factory.runtime.driver as driver
    from tests import test_driver_loop as loop

    assert threading.current_thread() is threading.main_thread()  # (a notebook kernel runs cells here)

    def ctrl_c_at_step_1(trajs, rate, step):
        if step == 1:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
        return 0.0

    def fake_run(plan, found, *, started_at, stop, on_step=None):  # driver.run -> its real train_loop
        monkeypatch.setattr(driver, "check_infra", ctrl_c_at_step_1)
        return loop.run_loop(monkeypatch, loop.World(), ["train.steps=3"], on_step=on_step, stop_event=stop)

    monkeypatch.setattr(driver, "run", fake_run)
    monkeypatch.chdir(REPO)
    theirs = threading.Event()
    kwargs = {"on_step": lambda step, metrics: None} if with_on_step else {}
    result = factory.run(factory.compile(TINY, ["train.steps=3"]), stop=theirs, **kwargs)
    assert (result.status, result.last_step) == ("KILLED", 1)
    assert not theirs.is_set()  # theirs to reuse


def test_on_step_raising_at_the_last_step_says_the_run_finished(monkeypatch):
    """Raised at the last step, on_step stops nothing: the run ends FINISHED with every step done. The note said
    `resume=` continues it, which a resume then refused (nothing to resume). The driver's loop over the fakes of
    tests/test_driver_loop.py (no Ray); a raise mid-run still stops the run KILLED, saved, resumable."""
    import factory.runtime.driver as driver
    from tests import test_driver_loop as loop

    results = []

    def fake_run(plan, found, *, started_at, on_step, stop):
        steps = plan.driver.train.steps
        results.append(loop.run_loop(monkeypatch, loop.World(), [f"train.steps={steps}"], on_step=on_step,
                                     stop_event=stop))
        return results[-1]

    def raise_at(at):
        def on_step(step, metrics):
            if step == at:
                raise ValueError("my callback")
        return on_step

    monkeypatch.setattr(driver, "run", fake_run)
    monkeypatch.chdir(REPO)
    checkpoint = str(REPO / "step_x")  # the fakes' checkpoint folder
    for steps, at, status, note in [
        (2, 2, "FINISHED", f"the run had finished every step (all 2, FINISHED), the last saved in {checkpoint}"),
        (3, 2, "KILLED", "the run stopped after step 2, saved: factory.run(..., resume='r') continues it")]:
        with pytest.raises(ValueError) as caught:
            factory.run(factory.compile(TINY, [f"train.steps={steps}"]), on_step=raise_at(at))
        assert (results[-1].status, results[-1].last_step) == (status, 2)
        if sys.version_info >= (3, 11):
            assert caught.value.__notes__ == [f"factory.run: on_step raised this at step 2; {note}"]


def test_run_and_evaluate_refuse_at_once_where_the_caller_has_an_mlflow_run_active(monkeypatch, tmp_path):
    """A notebook's own `mlflow.start_run()` left open: factory.run failed after ~40 s, Ray and every stage
    started, at the tracker's start_run ("Run with UUID ... is already active"). Said before anything starts."""
    import mlflow

    import factory.runtime.driver as driver

    monkeypatch.setattr(driver, "run", lambda *a, **k: pytest.fail("the run started"))
    monkeypatch.chdir(REPO)
    before = os.environ.get("MLFLOW_TRACKING_URI")  # (set_tracking_uri mirrors itself there)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mine.db")
    try:
        with mlflow.start_run() as mine:
            for call, what in [(lambda: factory.run(TINY), "factory.run"),
                               (lambda: factory.evaluate(TINY), "factory.evaluate")]:
                with pytest.raises(RuntimeError) as e:
                    call()
                assert str(e.value) == (
                    f"{what}: an MLflow run of yours is active in this thread (run {mine.info.run_id}), and Factory "
                    f"records its own run in its own store: end yours first (mlflow.end_run()), or call {what} "
                    "outside its `with mlflow.start_run():` block")
    finally:
        mlflow.set_tracking_uri(before)  # (None: unset, as MLflow's own _use_tracking_uri puts one back)


def test_a_second_run_in_this_process_is_refused_at_once_and_the_first_goes_on(monkeypatch):
    """docs/python.md's "train in the background and keep working": a second factory.run (or evaluate) while the
    first still ran failed to start its Ray ("ray.init twice") and, on its way out, shut the first run's Ray down.
    Refused now before anything is compiled or started; one after the other, runs still go."""
    import factory.runtime.driver as driver
    from factory.commands import api

    monkeypatch.chdir(REPO)
    inside, release = threading.Event(), threading.Event()

    def first(plan, found, **kwargs):
        inside.set()
        assert release.wait(60)
        return "ran"

    monkeypatch.setattr(driver, "run", first)
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("result", factory.run(TINY)))
    thread.start()
    try:
        assert inside.wait(60)
        compiled = []
        monkeypatch.setattr(api, "compile_plan", lambda *a, **k: compiled.append(a))
        for call, what in [(lambda: factory.run(TINY), "factory.run"),
                           (lambda: factory.evaluate(TINY, model="http://127.0.0.1:9/v1"), "factory.evaluate")]:
            with pytest.raises(factory.UserError) as e:
                call()
            assert str(e.value) == (
                f"{what}: another factory.run or factory.evaluate is still running in this process: each starts a "
                "Ray of its own, and a process holds one Ray at a time: wait for it to end (its `stop` event ends "
                "it after the step in flight), or start this one in a process of its own (`factory run SPEC`, a "
                "subprocess)")
        assert compiled == []  # refused before anything was done
    finally:
        release.set()
        thread.join(60)
    assert out == {"result": "ran"}
    monkeypatch.undo()
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(driver, "run", lambda plan, found, **kwargs: "ran")
    assert factory.run(TINY) == factory.run(TINY) == "ran"  # one after the other: each its own Ray


def test_run_and_evaluate_refuse_at_once_where_a_ray_is_already_up(monkeypatch):
    """The caller's own `ray.init()` (or a library's) before factory.run: the run's ray.init failed, and its
    clean-up shut the caller's Ray down. `ray` is not imported just to ask."""
    import types

    import factory.runtime.driver as driver
    from factory.runtime.lifecycle import refuse_a_ray_up

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(driver, "run", lambda *a, **k: pytest.fail("the run started"))
    monkeypatch.setattr(driver, "evaluate_only", lambda *a, **k: pytest.fail("the evaluation started"))
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: True))
    for call, what in [(lambda: factory.run(TINY), "factory.run"),
                       (lambda: factory.evaluate(TINY, model="http://127.0.0.1:9/v1"), "factory.evaluate")]:
        with pytest.raises(factory.UserError) as e:
            call()
        assert str(e.value) == (
            f"{what}: a Ray is already up in this process (your own ray.init(), or another library's): a run starts "
            "a Ray of its own, and a process holds one Ray at a time: ray.shutdown() yours first, or start the run "
            "in a process of its own (`factory run SPEC`, a subprocess)")
    monkeypatch.delitem(sys.modules, "ray")
    refuse_a_ray_up("factory.run")
    assert "ray" not in sys.modules


IMPORTED_FIRST = '''
import sys

import ray  # a notebook's imports cell, before any factory.run: Ray reads the loopback flag here

import factory
import factory.runtime.driver as driver

driver.run = driver.evaluate_only = lambda *a, **k: sys.exit("a run started")
for call in (lambda: factory.run(sys.argv[1]), lambda: factory.evaluate(sys.argv[1], model="http://127.0.0.1:9/v1")):
    try:
        call()
    except factory.UserError as e:
        print(e)
ray.is_initialized = lambda: True  # as after the caller's own ray.init(), which would start a Ray seconds long
try:
    factory.run(sys.argv[1])
except factory.UserError as e:
    print(e)
'''


def test_a_run_where_ray_was_imported_first_is_refused_at_once_saying_what_helps():
    """A notebook that imported ray before its first factory.run: Ray had read RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER
    at import, so a local Ray would listen on every interface, and the run was refused 1.5 s in (its leftovers
    ended, its models built), saying to import ray later. With the caller's own Ray up it said "ray.shutdown()
    yours first", after which the next run was refused all the same. A real `import ray` in a process of its
    own (the suite's sets the flag first, conftest.py); the driver is stopped there before it starts anything."""
    import subprocess

    from factory.runtime.lifecycle import LOOPBACK_FLAG

    env = {k: v for k, v in os.environ.items() if k != LOOPBACK_FLAG}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    out = subprocess.run([sys.executable, "-c", IMPORTED_FIRST, str(TINY)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    said = out.stdout.splitlines()
    why = ("ray was imported in this process before Factory could set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, and Ray "
           "reads it once, at import: a local Ray started here would listen on every network interface")
    fix = ("set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before importing ray (in the environment, or in os.environ above "
           "the `import ray`), or start the run in a process of its own (`factory run SPEC`, a subprocess)")
    assert said == [
        f"factory.run: {why}: {fix}",
        f"factory.evaluate: {why}: {fix}",
        "factory.run: a Ray is already up in this process (your own ray.init(), or another library's): a run starts "
        f"a Ray of its own, and a process holds one Ray at a time; ray.shutdown() yours would not be enough for a "
        f"local Ray: {why}: "
        f"{fix}"]


JOINED_FIRST = '''
import sys

from factory.runtime import lifecycle

assert "ray" not in sys.modules
lifecycle.local_ray_on_loopback("192.0.2.1:6379", "factory.run")  # a run that joins a cluster ...
import ray  # ... whose driver imports ray, the flag unset (a joined driver needs it so)

try:
    lifecycle.local_ray_on_loopback(None, "factory.run")  # the next run in this process is a local one
except lifecycle.UserError as e:
    print(e)
'''


def test_a_local_run_after_a_joined_one_in_one_process_is_refused_saying_why(tmp_path):
    """A notebook's first run joined a cluster (its driver imported ray without the loopback flag, as a joined
    driver must); the next, local one was refused saying ray was imported "before Factory could set" the flag and to
    set it "above the `import ray`": a line the user never wrote."""
    import subprocess

    from factory.runtime.lifecycle import LOOPBACK_FLAG

    env = {k: v for k, v in os.environ.items() if k != LOOPBACK_FLAG}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    out = subprocess.run([sys.executable, "-c", JOINED_FIRST], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("factory.run: an earlier run in this process joined a Ray cluster, so ray was "
                                 "imported without RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0")
    assert "start this local run in a process of its own" in out.stdout and "import ray`" not in out.stdout


def test_runs_with_no_room_for_a_run_is_a_value_error():
    """MLflow's own error named its max_results."""
    for limit in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="limit: at least 1 run"):
            factory.runs(limit=limit)


def test_runs_of_a_store_that_is_not_there_says_so(tmp_path, monkeypatch):
    """factory.runs(uri=...) of a mistyped store path returned [], as if it held no run (the CLI's table said
    why; Python said nothing)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(factory.RunLookupError, match=r"^no tracking store at sqlite:////nonexistent/x.db"):
        factory.runs(uri="sqlite:////nonexistent/x.db")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert factory.runs() == [] and not (tmp_path / "mlflow.db").exists()  # the default, not made yet: no runs


def test_a_store_read_beside_a_run_in_a_thread_leaves_mlflows_settings_to_the_run(monkeypatch, tmp_path):
    """A read (factory.runs) and a run in another thread (its tracker) each saved MLflow's fail-fast settings and
    put back what they had saved, whatever the other had done since: a read during a run left the run writing
    without them (MLflow's minutes of retries), and the run's end put them back set in the user's process for
    good. Held together, they are in force while either holds them and put back when both have let go."""
    from factory.tracking import runs as runs_module
    from factory.tracking.mlflow_tracker import MlflowTracker
    from factory.util import MLFLOW_FAIL_FAST

    monkeypatch.chdir(tmp_path)
    for name in MLFLOW_FAIL_FAST:
        monkeypatch.delenv(name, raising=False)

    def settings() -> dict[str, str | None]:
        return {name: os.environ.get(name) for name in MLFLOW_FAIL_FAST}

    unset = dict.fromkeys(MLFLOW_FAIL_FAST)
    tracker = MlflowTracker("http://127.0.0.1:9", "exp")  # the background run's (an HTTP store)
    # the run starts writing during the read, then ends; then it starts before a read and ends during it
    for during_read, read_done, after in [(tracker._fail_fast, MLFLOW_FAIL_FAST, tracker._settled),
                                          (tracker._settled, unset, None)]:
        monkeypatch.setattr(runs_module, "list_runs", lambda *a, **k: during_read() or [])
        if after is None:
            tracker._fail_fast()
        factory.runs()
        assert settings() == read_done
        if after is not None:
            after()
        assert settings() == unset


def test_reads_of_a_store_that_does_not_answer_fail_fast(monkeypatch):
    """`factory runs --uri http://...` of a store that does not answer says so in seconds (cli.main: MLflow's
    fail-fast settings); factory.runs, factory.diff, evaluate(model=RUN) and run(resume=...) waited out MLflow's
    default retries: 250 s. The settings are in force around those reads only: a user's own are kept."""
    import time

    import factory.commands.diff as diff
    import factory.runtime.resume as resume
    import factory.tracking.tracker as tracker
    from factory.util import MLFLOW_FAIL_FAST
    from tests.servers import free_port

    monkeypatch.chdir(REPO)
    for name in MLFLOW_FAIL_FAST:
        monkeypatch.delenv(name, raising=False)
    dead = f"http://127.0.0.1:{free_port()}/"
    out: dict = {}

    def runs():
        started = time.time()
        with pytest.raises(tracker.StoreUnreadable, match=f"^the tracking store {dead} could not be read"):
            factory.runs(uri=dead)
        out["s"] = time.time() - started

    asked = threading.Thread(target=runs, daemon=True)  # (a daemon: never waited for 4 minutes, should it fail)
    asked.start()
    asked.join(60)
    assert out.get("s", 999) < 30, "factory.runs waited out MLflow's retries"
    # each other read, as it reads: MLflow's settings then (a spy), and after
    seen = []

    def read(*args, **kwargs):
        seen.append({name: os.environ.get(name) for name in MLFLOW_FAIL_FAST})
        raise tracker.StoreUnreadable("down")

    monkeypatch.setattr(diff, "diff_runs", read)
    monkeypatch.setattr(resume, "find", read)
    monkeypatch.setattr(tracker, "open_tracker", read)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")  # the user's own: kept
    for call in (lambda: factory.diff("a" * 8, "b" * 8, uri=dead), lambda: factory.run(TINY, resume="a" * 8),
                 lambda: factory.evaluate(TINY, model="a" * 8, uri=dead)):
        with pytest.raises(tracker.StoreUnreadable):
            call()
    assert seen == [{**MLFLOW_FAIL_FAST, "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}] * 3
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "5"
    assert not {"MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"} & set(os.environ)
