"""`factory rescore`'s pieces: saved trajectory records read back whole, and the --steps syntax."""
import pyarrow as pa
import pytest

from factory.commands.rescore import parse_steps, trajectory_from_record
from factory.rollout.parse import parse_tool_calls
from factory.tracking.mlflow_tracker import trajectory_records
from factory.types import ToolCall, ToolResult, Trajectory, Turn


def test_a_saved_trajectory_reads_back_whole():
    t = Trajectory(prompt_index=3, sample_index=1, prompt_ids=[1, 2], response_ids=[5, 6, 7, 8], loss_mask=[1, 1, 0, 1],
                   sampler_logprobs=[-0.5, -1.25, 0.0, -2.0],
                   turns=[Turn(text='<tool_call>{"name": "add"}</tool_call>', num_tokens=2,
                               calls=[ToolCall(name="add", arguments={"a": [1, 2]}, raw='{"name": "add"}')],
                               results=[ToolResult(tool="add", text="3", status="ok", latency_s=0.5)]),
                          Turn(text="<answer>3</answer>", num_tokens=1,
                               calls=[ToolCall(name="?", arguments=None, raw="{", parse_error="invalid JSON")])],
                   stop_reason="max_turns", row={"answer": "3", "question": "1 + 2", "level": 2},
                   messages=[{"role": "user", "content": "1 + 2"}], completion="...", rewards={"a": 1.0, "b": None},
                   reward=1.0, reward_details={"b": {"status": "skipped"}}, infra_error=True, truncated=True,
                   origin="train/4/0/3/1")
    # through a parquet table and back, as MLflow stores it
    (record,) = pa.Table.from_pylist(trajectory_records([t], step=4)).to_pylist()
    back = trajectory_from_record(record)
    t.rewards, t.reward, t.reward_details = {}, 0.0, {}  # a rescore starts from the episode, not its old scores
    assert back == t
    # a table saved before trajectories kept their place: not known (their reward calls replay in order)
    assert trajectory_from_record({k: v for k, v in record.items() if k != "origin"}).origin == ""


def test_a_call_whose_arguments_hold_a_lone_surrogate_is_saved_and_reads_back_whole():
    # json.loads reads a model's `"\\ud800"` (half an emoji's escape) as a lone surrogate, which Arrow's UTF-8
    # strings cannot hold: writing the step's table raised, and the driver with it.
    (call,) = parse_tool_calls('<tool_call>{"name": "say", "arguments": {"text": "\\ud83d und \u00fc"}}</tool_call>')
    refused = ToolResult(tool="say", text="no", status="model_error", error_kind="bad_arguments")
    t = Trajectory(prompt_index=0, sample_index=0, prompt_ids=[1], response_ids=[2], loss_mask=[1],
                   turns=[Turn(text="x", num_tokens=1, calls=[call], results=[refused])], stop_reason="no_call",
                   row={}, messages=[{"role": "user", "content": "s\u00fc\u00df"}], completion="x")
    (record,) = pa.Table.from_pylist(trajectory_records([t], step=1)).to_pylist()
    assert trajectory_from_record(record).turns == t.turns
    assert "\u00fc" in record["turns"] and "s\u00fc\u00df" in record["prompt"]  # other text stays as it is


def test_a_tool_server_that_cannot_start_is_a_stage_that_did_not_start(monkeypatch):
    """`factory rescore` (and the agent server) set the tools stage up in their own process: a server that would
    not start was an internal error (exit 1, "rerun with FACTORY_DEBUG=1"); `factory run` says it as here, exit 3."""
    import asyncio
    from pathlib import Path

    import yaml

    import factory
    from factory.runtime.health import StageStartError
    from factory.runtime.local import local_stages

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    data = yaml.safe_load((root / "specs" / "tiny.yaml").read_text())
    data["tools"] = {"calc": {"command": "python", "args": ["-m", "factory.examples.no_such_server"]}}

    async def start():
        async with local_stages(factory.compile(data), ["tools"]):
            pass

    with pytest.raises(StageStartError, match=r"(?s)^stage 'tools' did not start: ToolStartError: calc: tool server "
                                              r"'calc' failed to start: .*No module named factory.examples.no_such"):
        asyncio.run(start())


def test_a_replayed_rescore_starts_no_tool_server_and_stops_at_a_miss(monkeypatch):
    """`factory rescore RUN --replay RUN` answers the tool nodes' calls from RUN's recording: its tool server may
    be down or gone. A call the recording lacks stops the rescore (replay.on_miss: fail), naming the step."""
    import asyncio
    import contextlib
    from pathlib import Path

    import yaml

    import factory
    import factory.commands.rescore as rescore
    import factory.runtime.local as local
    from factory.plan import Replayed
    from factory.runtime.replay import replaying
    from factory.tools.recording import ReplayMiss, canonical

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    data = yaml.safe_load((root / "specs" / "tiny.yaml").read_text())
    data["tools"] = {"calc": {"command": "python", "args": ["-m", "factory.examples.no_such_server"]}}
    listing = {"calc": [{"name": "calculate", "offered_as": "calculate", "description": "",
                         "inputSchema": {"type": "object"}}]}
    row = {"origin": "", "server": "calc", "tool": "calculate", "arguments": canonical({"expression": "2+3"}),
           "text": "5", "status": "ok", "error_kind": None, "latency_s": 0.1, "source": "live"}
    plan = replaying(factory.compile(data, ["replay.run=old"]),
                     Replayed(run="old", rows=[row], listing=listing, on_miss="fail", trained=1, evaluated=[]))

    class Scorer:  # the reward stage, calling the tools stage as a tool node does
        async def score(self, trajs, *, step=0, attempt=0):
            got = [await tools.call(ToolCall("calculate", {"expression": e}, raw="")) for e in trajs]
            return trajs, {"reward/mean": float(sum(r.text == "5" for r in got))}

    @contextlib.asynccontextmanager
    async def stages(plan, names, remote):
        nonlocal tools
        async with real_stages(plan, [n for n in names if n == "tools"], remote) as started:
            tools = started["tools"]
            yield {**started, "reward": Scorer()}

    tools, real_stages = None, local.local_stages
    monkeypatch.setattr(rescore, "scorer", lambda plan: "reward")
    monkeypatch.setattr(local, "callees", lambda plan, name: ["tools"])
    monkeypatch.setattr(local, "local_stages", stages)
    assert asyncio.run(rescore._score_all(plan, {("train", 1): ["2+3"]}, {})) == {("train", 1): {"reward/mean": 1.0}}
    with pytest.raises(ReplayMiss, match=r"^step 2 evaluation: the recording of run old has no answer for 1 tool "
                                         r'call, first calculate\(\{"expression":"1\+1"\}\) at a reward node'
                                         r'.*: the run never made this call \(a tool reward node added'):
        asyncio.run(rescore._score_all(plan, {("eval", 2): ["1+1"]}, {}))


def test_a_rescore_of_a_run_that_did_not_finish_says_which_steps_it_had():
    from factory.commands.rescore import unfinished_note

    assert unfinished_note("FINISHED", "r1", {0, 1}) is None
    assert unfinished_note("FAILED", "r1", {0, 1, 2}) == "run r1 ended FAILED: the steps it saved were rescored (0, 1, 2)"
    assert unfinished_note("KILLED", "r1", {1}) == "run r1 was stopped before its last step: the steps it saved were " \
                                                    "rescored (1)"
    assert unfinished_note("RUNNING", "r1", {1}).startswith("run r1 is still running, or its driver was killed")


def test_steps_syntax():
    assert parse_steps("1,3-5, 9") == {1, 3, 4, 5, 9}
    for bad in ("1,,2", "5-3", "x"):
        with pytest.raises(ValueError):
            parse_steps(bad)


def test_a_run_stopped_by_on_missing_fail_says_why_in_one_line(monkeypatch, capsys):
    """Exit 2, as for bad input: the spec asked the run to stop on a missing value."""
    from factory.commands import cli
    from factory.reward import MissingReward

    def stopped(args):
        raise MissingReward("reward node 'judge' has no value for trajectory 3.1 and its on_missing is 'fail': "
                            "parse_failure: the reply does not match `parse`")

    monkeypatch.setattr(cli, "_run", stopped)
    assert cli.main(["run", "spec.yaml"]) == 2
    assert capsys.readouterr().err == ("factory: reward node 'judge' has no value for trajectory 3.1 and its "
                                       "on_missing is 'fail': parse_failure: the reply does not match `parse`\n")


def test_each_batch_is_scored_under_its_own_step(monkeypatch):
    """Scored as step 0 every time, a node's missing values were warned of once for the whole rescore, and
    as step 0."""
    import asyncio
    import contextlib

    import factory.commands.rescore as rescore
    import factory.runtime.local as local

    seen = []

    class Stage:
        async def score(self, trajs, *, step=0, attempt=0):
            seen.append((len(trajs), step))
            return trajs, {"reward/mean": float(step)}

    @contextlib.asynccontextmanager
    async def stages(plan, names, remote):
        yield {"reward": Stage()}

    monkeypatch.setattr(rescore, "scorer", lambda plan: "reward")
    monkeypatch.setattr(local, "callees", lambda plan, name: [])
    monkeypatch.setattr(local, "local_stages", stages)
    out = asyncio.run(rescore._score_all(None, {("train", 2): [1, 2], ("eval", 4): [1]}, {}))
    assert seen == [(2, 2), (1, 4)] and out == {("train", 2): {"reward/mean": 2.0}, ("eval", 4): {"reward/mean": 4.0}}


def test_a_rescore_of_a_run_with_dynamic_sampling_says_its_tables_hold_the_kept_groups_only(tmp_path, monkeypatch):
    """Under dynamic sampling a step's table holds only the groups kept for training, while its reward/mean covers
    every sampling round: a rescore with the run's own graph printed a change that was not there, unexplained."""
    from pathlib import Path

    from factory.commands.rescore import rescore
    from factory.compiler.compile import compile_file
    from factory.tracking.tracker import open_tracker

    spec, plan = compile_file(Path(__file__).resolve().parents[1] / "specs" / "tiny.yaml", weights=False)
    monkeypatch.chdir(tmp_path)  # (where a tracker keeps what it has not sent yet)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    t = Trajectory(prompt_index=0, sample_index=0, prompt_ids=[1], response_ids=[2], loss_mask=[1], turns=[],
                   stop_reason="no_call", row={"answer": "3"}, messages=[{"role": "user", "content": "1 + 2"}],
                   completion="<answer>3</answer>")
    runs = {}
    for name, rounds in (("plain", {}), ("dapo", {"rollout/dynamic_sampling_rounds": 2.0})):
        old = open_tracker(uri, "t")
        old.start(name, {}, {}, {})
        old.log_metrics({"reward/mean": 0.5, **rounds}, step=1)
        old.log_trajectories([t], 1)
        old.end()
        runs[name] = old.run_id
    assert rescore(runs["plain"], plan, uri=uri).notes == []
    assert rescore(runs["dapo"], plan, uri=uri).notes == [
        f"run {runs['dapo']} used dynamic sampling: its step tables hold only the groups kept for training, while "
        "its reward/mean covers every sampling round, so 'before' and 'after' are means over different "
        "trajectories (for a 'before' over the same ones, rescore it with its own spec)"]


def test_a_rescore_says_why_a_run_is_not_found_and_names_each_of_its_runs_apart(tmp_path, monkeypatch):
    """A run named as `factory diff` takes it: a lookup that failed was said as "no run 'X'" whatever the tracker
    said (a name two runs share, an id prefix too short). And every rescore of a spec was named `SPEC-rescore`, so
    the second made that name ambiguous: rescoring a rescore by its name could not work."""
    from pathlib import Path

    from mlflow.tracking import MlflowClient

    from factory.commands.rescore import RescoreError, rescore
    from factory.compiler.compile import compile_file
    from factory.tracking.tracker import open_tracker

    spec, plan = compile_file(Path(__file__).resolve().parents[1] / "specs" / "tiny.yaml", weights=False)
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("e")
    twice = [client.create_run(exp, run_name="twice").info.run_id for _ in range(2)]
    with pytest.raises(RescoreError, match=r"^'twice' names 2 runs \(.*; give a run id$") as said:
        rescore("twice", plan, uri=uri)
    assert all(run_id in str(said.value) for run_id in twice)
    with pytest.raises(RescoreError, match="an id prefix needs 8 characters or more"):
        rescore(twice[0][:4], plan, uri=uri)

    old = open_tracker(uri, "t")
    old.start("old", {}, {}, {})
    old.log_trajectories([Trajectory(prompt_index=0, sample_index=0, prompt_ids=[1], response_ids=[2], loss_mask=[1],
                                     turns=[], stop_reason="no_call", row={"answer": "3"},
                                     messages=[{"role": "user", "content": "1 + 2"}], completion="3")], 1)
    old.end()
    store = open_tracker(uri, read=True)
    names = [store.run(rescore(old.run_id, plan, uri=uri).run_id).name for _ in range(2)]
    assert names[0] != names[1] and all(n.startswith(f"{spec.name}-rescore-") for n in names), names
    assert [store.run(n).name for n in names] == names  # each name finds its own rescore


def _graded(root, overrides=()):
    """tiny.yaml with one tool reward node, whose python tool grades otherwise at every call (a sampled LLM
    grader's way): a grade a replay gives back can only be the one recorded for that call."""
    import yaml

    from factory.compiler.compile import compile_file

    data = yaml.safe_load((root / "specs" / "tiny.yaml").read_text())
    data["data"]["prompt"] = str(root / data["data"]["prompt"])
    data["tools"] = {"grade": {"function": "tests.fixtures.reward_fns:drifting_grade"}}
    data["rewards"] = {"graded": {"tool": "grade.grade", "arguments": {"text": "{{ answer }}"}}}
    data["metrics"] = {"accuracy": "graded"}
    return compile_file(data, list(overrides), weights=False)


def _episodes(split, step, samples):
    """A step's trajectories as the rollout made them: each knows its place in the run (Trajectory.origin). All ask
    the grader the same question, so only where they were made tells their grades apart."""
    out = []
    for s in range(samples):
        t = Trajectory(prompt_index=0, sample_index=s, prompt_ids=[1], response_ids=[2], loss_mask=[1], turns=[],
                       stop_reason="no_call", row={"answer": "3"}, messages=[{"role": "user", "content": "1 + 2"}],
                       completion="3")
        t.origin = f"{split}/{step}/0/0/{s}"
        out.append(t)
    return out


async def _run_scoring(plan, tracker):
    """A run's scoring, as its driver orders it: step 1's training batch, step 1's evaluation, then step 3's, each
    step's recorded reward calls in its tool_calls table and its trajectories in its tables; what each batch was
    graded, by (split, step)."""
    from factory.reward import RewardStage
    from factory.tools.stage import ToolsStage
    from factory.types import Placement

    settings = plan.stage("reward").settings
    tools, reward = ToolsStage(plan.stage("tools").settings), RewardStage(settings)  # recording (record_tools)
    await tools.setup()
    await reward.setup(Placement(peers={settings.tool_peer: tools}))
    graded = {}
    try:
        for step in (1, 3):
            for split, samples in (("train", 2), ("eval", 1)):
                trajs, _ = await reward.score(_episodes(split, step, samples), step=step)
                graded[(split, step)] = [t.rewards["graded"] for t in trajs]
                tracker.log_trajectories(trajs, step, split=split)
            tracker.log_tool_calls((await tools.take_recording())["rows"], step)
    finally:
        await reward.close()
        await tools.close()
    return graded


def test_a_replayed_rescore_gives_each_trajectory_the_grades_recorded_for_it(tmp_path, monkeypatch):
    """`factory rescore RUN --replay RUN` answers a tool reward node's calls by where the run made them. Answered
    from one queue per tool and arguments over the whole recording, a rescore of step 3 alone got step 1's grades,
    and a full rescore, which scores a step's evaluation before its training batch (the run did the reverse),
    swapped the two."""
    import asyncio
    from pathlib import Path

    from factory.commands.rescore import rescore
    from factory.tracking.tracker import open_tracker

    root = Path(__file__).resolve().parents[1]
    spec, plan = _graded(root)
    monkeypatch.chdir(tmp_path)  # (where a tracker keeps what it has not sent yet)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run = open_tracker(uri, "t")
    run.start("graded", {}, {}, {})
    graded = asyncio.run(_run_scoring(plan, run))
    run.end()
    assert len({g for grades in graded.values() for g in grades}) == 6  # the grader never repeats itself
    spec, plan = _graded(root, [f"replay.run={run.run_id}"])  # replay.on_miss: fail (a miss stops the rescore)
    recorded = {(split, step): sum(grades) / len(grades) for (split, step), grades in graded.items()}
    for steps, batches in (({3}, [("eval", 3), ("train", 3)]), (None, [("eval", 1), ("train", 1), ("eval", 3),
                                                                       ("train", 3)])):
        rescored = rescore(run.run_id, plan, uri=uri, steps=steps)
        assert list(rescored.metrics) == batches  # in the order it scored them: each step's evaluation first
        assert {key: m["rewards/graded/mean" if key[0] == "train" else "eval/accuracy"]
                for key, m in rescored.metrics.items()} == {key: recorded[key] for key in batches}


def test_a_rescore_with_a_local_judge_places_it_as_a_run_does_recorded_and_torn_down(tmp_path, monkeypatch):
    """A rescore whose graph calls a local judge model starts a Ray of its own: it wrote no session record (so
    the next `factory run` could not end what a killed rescore left), and a failure after Ray started and before
    its `try` left Ray up. It goes through `placed`, as `factory run` and `factory eval` do."""
    import os
    import tempfile
    from pathlib import Path

    import factory.commands.rescore as rescore
    from factory.compiler.compile import compile_file
    from factory.runtime import driver
    from factory.runtime.lifecycle import LOOPBACK_FLAG
    from factory.tracking.tracker import open_tracker

    spec, plan = compile_file(Path(__file__).resolve().parents[1] / "specs" / "deepsearch-cpu-judge.yaml",
                              weights=False)
    monkeypatch.chdir(tmp_path)  # (where a tracker keeps what it has not sent yet)
    monkeypatch.setenv(LOOPBACK_FLAG, "0")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # (the session records' folder)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    old = open_tracker(uri, "t")
    old.start("judged", {}, {}, {})
    old.log_trajectories([Trajectory(prompt_index=0, sample_index=0, prompt_ids=[1], response_ids=[2], loss_mask=[1],
                                     turns=[], stop_reason="no_call", row={}, messages=[], completion="x")], 1)
    old.end()
    calls: list[str] = []
    monkeypatch.setattr(driver, "build_models", lambda plan, status: None)
    monkeypatch.setattr(driver, "start_ray", lambda cluster: calls.append("start_ray"))
    monkeypatch.setattr(driver, "place", lambda plan, *a, **k: calls.append(f"place {[s.name for s in plan.stages]}")
                        or {})
    monkeypatch.setattr(driver, "teardown", lambda groups: calls.append("teardown"))
    monkeypatch.setattr(driver, "stop_ray", lambda *a: calls.append("stop_ray"))
    drivers = tmp_path / f"factory-{os.getuid()}" / "drivers"

    async def scoring(plan, batches, placed):
        assert (drivers / f"{os.getpid()}.json").exists()  # what reap_orphans reads, should this process be killed
        raise RuntimeError("the judge failed")

    monkeypatch.setattr(rescore, "_score_all", scoring)
    with pytest.raises(RuntimeError, match="the judge failed"):
        rescore.rescore(old.run_id, plan, uri=uri)
    assert calls == ["start_ray", "place ['judge.judge']", "teardown", "stop_ray"]
    assert list(drivers.glob("*.json")) == []


def _tiny_spec() -> dict:
    """specs/tiny.yaml as data, its prompt template named by an absolute path (the spec goes elsewhere)."""
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[1]
    data = yaml.safe_load((root / "specs" / "tiny.yaml").read_text())
    data["data"]["prompt"] = str(root / data["data"]["prompt"])
    return data


def _spec_file(tmp_path, data: dict):
    import yaml

    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    return spec


def _started_run(tmp_path, monkeypatch, name: str, steps=(1,), completion: str = "3", split: str = "train"):
    """A run in a sqlite store under tmp_path, started and holding one trajectory at each of `steps`; the caller
    logs more and ends it. Returns (the store's uri, its tracker)."""
    from factory.tracking.tracker import open_tracker

    monkeypatch.chdir(tmp_path)  # (where a tracker keeps what it has not sent yet)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    old = open_tracker(uri, "t")
    old.start(name, {}, {}, {})
    for step in steps:
        old.log_trajectories([Trajectory(prompt_index=0, sample_index=0, prompt_ids=[1], response_ids=[2],
                                         loss_mask=[1], turns=[], stop_reason="no_call", row={"answer": "3"},
                                         messages=[{"role": "user", "content": "1 + 2"}], completion=completion)],
                             step, split=split)
    return uri, old


def test_a_rescore_records_no_value_read_from_the_environment(tmp_path, monkeypatch):
    """A spec name or tracking tag read from the environment is recorded as `***` by `factory run`: a rescore built
    its run name and tags from the runnable spec's real values, so they landed in MLflow in clear."""
    from mlflow.tracking import MlflowClient

    from factory.commands.rescore import rescore
    from factory.compiler.compile import compile_file

    monkeypatch.setenv("FACTORY_T_NAME", "name-s3cret")
    monkeypatch.setenv("FACTORY_T_TOKEN", "tok-s3cret")
    data = _tiny_spec()
    data["name"] = "${oc.env:FACTORY_T_NAME}"
    data["tracking"]["tags"] = {"owner": "${oc.env:FACTORY_T_TOKEN}"}
    spec, plan = compile_file(data, weights=False)
    uri, old = _started_run(tmp_path, monkeypatch, "old")
    old.end()
    new = MlflowClient(uri).get_run(rescore(old.run_id, plan, uri=uri).run_id)
    assert new.info.run_name.startswith("***-rescore-") and new.data.tags["owner"] == "***"
    assert [k for k, v in {"name": new.info.run_name, **new.data.tags}.items() if "s3cret" in v] == []


def test_a_rescore_records_the_algorithm_as_its_preset_resolved_it(tmp_path, monkeypatch):
    """`factory run` records algorithm.* params as the preset resolved them (grpo, ppo_clip, ...); a rescore of the
    same spec recorded the spec's nulls, so MLflow's compare view showed a run and its rescore differing in five
    algorithm settings that were the same."""
    from mlflow.tracking import MlflowClient

    from factory.commands.rescore import rescore
    from factory.compiler.compile import compile_file

    spec, plan = compile_file(_tiny_spec(), weights=False)
    assert plan.spec["algorithm"]["advantage"] is None  # left to the preset
    uri, old = _started_run(tmp_path, monkeypatch, "old")
    old.end()
    params = MlflowClient(uri).get_run(rescore(old.run_id, plan, uri=uri).run_id).data.params
    assert {k: params[k] for k in ("algorithm.name", "algorithm.advantage", "algorithm.loss", "algorithm.aggregation",
                                   "algorithm.clip", "algorithm.dynamic_sampling", "algorithm.kl.estimator")} == {
        "algorithm.name": "grpo", "algorithm.advantage": "grpo", "algorithm.loss": "ppo_clip",
        "algorithm.aggregation": "seq_mean_token_mean", "algorithm.clip": "[0.2, 0.2]",
        "algorithm.dynamic_sampling": "false", "algorithm.kl.estimator": "k3"}


def test_before_is_the_runs_own_value_of_a_metric_stored_under_another_name(tmp_path, monkeypatch, capsys):
    """A `metrics` entry whose name MLflow refuses (`pass@1`) is stored as `eval/pass_1`: "before" looked it up under
    the spec's name, found nothing and printed "-" as if the run had never logged it."""
    from factory.commands import cli
    from factory.tracking.mlflow_tracker import _hashed_name, stored_metric_name

    spec = _spec_file(tmp_path, {**_tiny_spec(), "metrics": {"pass@1": "correct"}})
    uri, old = _started_run(tmp_path, monkeypatch, "old", steps=(0,), completion="<answer>7</answer>", split="eval")
    old.log_metrics({"eval/pass@1": 0.25, "eval/reward": 0.25}, step=0)  # as the run logs them
    old.end()
    assert cli.main(["rescore", old.run_id, "--spec", str(spec), "--uri", uri]) == 0
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if "eval/pass@1" in ln]
    assert "0.2500" in line, out
    # a key whose plain name another key of the run had first is stored with a hash of its own
    assert stored_metric_name("eval/pass@1", {"eval/pass_1", "eval/reward"}) == "eval/pass_1"
    hashed = _hashed_name("eval/pass@1")
    assert stored_metric_name("eval/pass@1", {"eval/pass_1", hashed}) == hashed
    assert stored_metric_name("eval/reward", {"eval/reward"}) == "eval/reward"


def test_a_rescore_of_a_run_whose_name_holds_brackets_says_it_as_it_is(tmp_path, monkeypatch, capsys):
    """The run's name (RUN as given) went to rich as markup: `[/judge]` in it made the rescore an internal error
    after its new run was logged."""
    from factory.commands import cli

    spec = _spec_file(tmp_path, _tiny_spec())
    uri, old = _started_run(tmp_path, monkeypatch, "abl[/judge]")
    old.end()
    assert cli.main(["rescore", "abl[/judge]", "--spec", str(spec), "--uri", uri]) == 0
    out = capsys.readouterr().out
    assert "run abl[/judge] rescored with" in out and "(factory.rescore_of = abl[/judge])" in out, out


def test_a_step_table_cut_short_is_passed_over_with_a_note(tmp_path, monkeypatch, capsys):
    """A step's table cut short (its driver killed while the table was copied into the store) made the rescore an
    internal error (ArrowInvalid): the steps the run had saved whole are rescored, and the note names the other."""
    from factory.commands import cli

    spec = _spec_file(tmp_path, _tiny_spec())
    uri, old = _started_run(tmp_path, monkeypatch, "killed", steps=(1, 2))
    old.end("KILLED")  # (stopped while step 2's table was being copied)
    (table,) = [p for p in tmp_path.rglob("step_00002.parquet") if "trajectories" in p.parts]
    table.write_bytes(table.read_bytes()[:40])
    assert cli.main(["rescore", old.run_id, "--spec", str(spec), "--uri", uri]) == 0
    out = " ".join(capsys.readouterr().out.split())  # (as wrapped to the terminal's width)
    assert (f"note: run {old.run_id}'s train table of step 2 (trajectories/step_00002.parquet) cannot be read, cut "
            "short or damaged: that step was not rescored (") in out, out
    assert "the steps it saved were rescored (1)" in out and "│ 1 │ reward/mean" in out and "│ 2 │" not in out, out


def test_a_store_that_fails_a_download_stops_the_rescore_and_calls_no_table_damaged(tmp_path, monkeypatch, capsys):
    """The download was inside the guard for a table cut short: a store down for a moment (requests'
    ConnectionError is an OSError) dropped that step from the new run under a note calling the run's table
    damaged, and the rescore ended 0. A store error stops the rescore, as before, with nothing logged; and, as a
    store that does not answer when the command opens it, with exit 3 and the store named (it was exit 1, an
    internal error): a store that goes down after it answered, at a download or at a listing of the run's tables."""
    import requests
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from factory.commands import cli
    from factory.tracking.mlflow_tracker import MlflowTracker

    spec = _spec_file(tmp_path, _tiny_spec())
    uri, old = _started_run(tmp_path, monkeypatch, "whole", steps=(1, 2))
    old.end()
    real_download, real_artifacts = MlflowTracker.download, MlflowTracker.artifacts

    def flaky(self, run_id, path, into):
        if path.endswith("step_00002.parquet"):
            raise requests.ConnectionError("Max retries exceeded with url: /api/2.0/mlflow-artifacts/...")
        return real_download(self, run_id, path, into)

    def down(self, run_id, folder=""):  # MLflow's words for a REST call to a server that is gone
        raise MlflowException("API request to http://127.0.0.1:5000/api/2.0/mlflow/artifacts/list failed with "
                              "exception HTTPConnectionPool(host='127.0.0.1', port=5000): Max retries exceeded")

    for patch in [("download", flaky), ("artifacts", down)]:
        monkeypatch.setattr(MlflowTracker, *patch)
        rc = cli.main(["rescore", old.run_id, "--spec", str(spec), "--uri", uri])
        out, err = capsys.readouterr()
        assert rc == 3 and f"factory rescore: error: the tracking store {uri} could not be read (" in err, (rc, err)
        assert "Max retries exceeded" in err and "internal error" not in err, err
        assert "cut short or damaged" not in out, out
        assert [r.info.run_name for r in MlflowClient(uri).search_runs([old.experiment_id])] == ["whole"]
        monkeypatch.setattr(MlflowTracker, "download", real_download)
        monkeypatch.setattr(MlflowTracker, "artifacts", real_artifacts)
