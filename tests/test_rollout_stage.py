"""The rollout stage's worker-group protocol (split a batch over replicas, merge their parts) and its
tools client against a tools stage it calls (in-process here; a Ray actor in a run)."""
from __future__ import annotations

import asyncio
import json
import pickle

import pyarrow as pa
import pytest

from factory.data import from_table
from factory.rollout.stage import RolloutPart, RolloutStage
from factory.tools.client import ToolsClient
from factory.tools.metrics import ToolMetrics
from factory.types import ToolCall, ToolResult, Trajectory, Turn


def test_split_gives_contiguous_prompts_and_their_first_number():
    batch = pa.table({"messages": [json.dumps([{"role": "user", "content": str(i)}]) for i in range(5)],
                      "row": ["{}"] * 5})
    parts = RolloutStage.split(batch, 2)
    assert [(from_table(p)[0][0][0]["content"], p.num_rows, first) for p, first in parts] == [
        ("0", 2, 0), ("2", 3, 2)]
    assert [first for _, first in RolloutStage.split(batch, 8)] == [0, 1, 2, 3, 4]  # no empty part
    assert RolloutStage.split(batch, 1)[0][0].num_rows == 5


def _traj(prompt: int, tokens: int, calls: int) -> Trajectory:
    turn = Turn(text="", num_tokens=tokens, calls=[ToolCall("calc", {}, "")] * calls)
    return Trajectory(prompt_index=prompt, sample_index=0, prompt_ids=[1], response_ids=[2] * tokens,
                      loss_mask=[1] * tokens, turns=[turn], stop_reason="no_call", row={})


def _tools(latencies: list[float], restarts: int = 0) -> ToolMetrics:
    m = ToolMetrics()
    for latency in latencies:
        m.record("calc", ToolResult(tool="calc", text="1", latency_s=latency))
    m.server_event("calc", "restarts", restarts)
    return pickle.loads(pickle.dumps(m))  # parts travel between actors


def test_merge_adds_counts_averages_over_all_trajectories_and_times_the_slowest_replica():
    fast = RolloutPart([_traj(0, 4, 1)], {"generate": 1.0, "tools": 0.5, "idle": 0.5}, 2.0, 1, _tools([0.1], 1))
    slow = RolloutPart([_traj(1, 8, 2), _traj(2, 6, 0)], {"generate": 3.0, "tools": 1.0, "idle": 0.0}, 4.0, 2,
                       _tools([0.2, 0.3]))
    trajs, m = RolloutStage.merge([fast, slow])
    assert [t.prompt_index for t in trajs] == [0, 1, 2]
    assert (m["timing/rollout_s"], m["timing/generate_s"], m["timing/tools_only_s"]) == (4.0, 3.0, 1.0)
    assert m["response_length/mean"] == 6.0 and m["tool_calls/mean"] == 1.0
    assert m["rollout/engine_batches"] == 3.0
    assert m["perf/generate_tokens_per_s"] == pytest.approx(4 / 1.0 + 14 / 3.0)  # replicas' rates add up
    assert m["tools/calc/calls"] == 3.0 and m["tools/calc/latency_s_p50"] == pytest.approx(0.2)
    assert m["tool_servers/calc/restarts"] == 1.0


class FakeToolsStage:
    """What ToolsClient needs of the tools stage."""

    def __init__(self):
        self.events = {"calc": {"restarts": 2, "circuit_opens": 0}}

    async def schemas(self):
        return [{"type": "function", "function": {"name": "calc", "description": "", "parameters": {}}}]

    async def call(self, call: ToolCall) -> ToolResult:
        if call.parse_error is not None:  # as the ToolBox answers a call that could not be read
            return ToolResult(tool=call.name, text="no", status="model_error", error_kind="parse_error")
        if call.name != "calc":
            return ToolResult(tool=call.name, text="no", status="model_error", error_kind="unknown_tool")
        return ToolResult(tool="calc", text="42", latency_s=123.0)

    def server_events(self):
        events, self.events = self.events, {}
        return events


def test_tools_client_counts_the_callers_calls_and_takes_server_events():
    async def go():
        client = ToolsClient(FakeToolsStage())
        await client.start()
        assert [s["function"]["name"] for s in client.schemas()] == ["calc"]
        ok = await client.call(ToolCall("calc", {}, ""))
        await client.call(ToolCall("nope", {}, ""))
        await client.call(ToolCall("?", None, "", parse_error="invalid JSON"))  # counted, under no tool
        assert ok.text == "42" and ok.latency_s < 1.0  # the wait the caller saw, not the stage's number
        first, second = (await client.take_metrics()).snapshot(), (await client.take_metrics()).snapshot()
        return first, second

    first, second = asyncio.run(go())
    assert first["tools/calls"] == 3.0 and first["tools/calc/calls"] == 1.0 and "tools/nope/calls" not in first
    assert not [k for k in first if "?" in k]  # a name the tracking store refuses (it dropped the whole step's)
    assert first["tool_servers/calc/restarts"] == 2.0
    assert second["tools/calls"] == 0.0 and "tool_servers/calc/restarts" not in second
    assert second["tools/calc/calls"] == 0.0  # an offered tool without calls is a 0, not a gap in its chart


def test_a_call_whose_hop_to_the_tools_stage_fails_is_answered_and_counted():
    """A dead tools actor's call raised out of ToolsClient: agent.call_tool answered it as an infra_error crash,
    and tools/calls and tools/infra_errors never counted it."""
    class DeadToolsStage(FakeToolsStage):
        async def call(self, call: ToolCall) -> ToolResult:
            raise RuntimeError("The actor died unexpectedly before finishing this task.")  # as Ray's RayActorError

    async def go():
        client = ToolsClient(DeadToolsStage())
        await client.start()
        return await client.call(ToolCall("calc", {}, "")), (await client.take_metrics()).snapshot()

    result, metrics = asyncio.run(go())
    assert (result.tool, result.status, result.error_kind, result.text) == (
        "calc", "infra_error", "crash", "Error: the tool call failed (RuntimeError).")
    assert (metrics["tools/calls"], metrics["tools/infra_errors"], metrics["tools/calc/infra_errors"]) == (1, 1, 1)


def test_a_call_its_caller_stops_waiting_for_is_cancelled_in_the_tools_actor_too(monkeypatch):
    """Over Ray the episode's deadline cancelled only the caller's wait: the actor's call ran on and was recorded
    `ok` where the trajectory holds `episode_timeout`. With a real actor (slow):
    tests/test_tools_recording.py::test_a_call_the_episode_deadline_cuts_over_ray_is_recorded_as_cut."""
    import ray

    cancelled = []
    monkeypatch.setattr(ray, "cancel", cancelled.append)

    class Method:  # an actor method: `.remote()` gives the ref the caller awaits (here a future of this loop)
        def __init__(self, fn):
            self.fn, self.refs = fn, []

        def remote(self, *args):
            self.refs.append(asyncio.ensure_future(self.fn(*args)))
            return self.refs[-1]

    class Actor:
        schemas = Method(FakeToolsStage().schemas)
        call = Method(lambda c: asyncio.sleep(10))

    async def go():
        client = ToolsClient(Actor())
        await client.start()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.call(ToolCall("calc", {}, "")), 0.05)

    asyncio.run(go())
    assert len(Actor.call.refs) == 1 and cancelled == Actor.call.refs  # the call's ref; `schemas` ended by itself


def test_a_caller_that_never_takes_its_metrics_keeps_none():
    """The reward stage's client recorded every tool node's call and latency, and nothing ever took them."""
    async def go():
        client = ToolsClient(FakeToolsStage(), counted=False)
        await client.start()
        for _ in range(3):
            assert (await client.call(ToolCall("calc", {}, ""))).text == "42"
        return client._metrics.snapshot()

    assert asyncio.run(go()).get("tools/calls", 0.0) == 0.0


def test_without_a_tools_stage_every_call_is_an_unknown_tool():
    async def go():
        client = ToolsClient(None)
        await client.start()
        return client.schemas(), await client.call(ToolCall("calc", {"a": 1}, ""))

    schemas, result = asyncio.run(go())
    assert schemas == [] and (result.status, result.error_kind) == ("model_error", "unknown_tool")


def test_server_events_outside_a_training_rollout_are_logged_with_the_next_one(monkeypatch):
    """A tool server's restarts and circuit opens between batches, or during an evaluation (whose tool
    metrics are not logged), were taken at the next batch's start and dropped: a run's log said "restarted"
    twice and MLflow counted 1."""
    from pathlib import Path

    from factory.compiler.compile import compile_file
    from factory.data import DataStage
    from factory.types import Placement

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(repo)  # the spec's prompts/ resolve from the repository root
    _, plan = compile_file(repo / "specs" / "tiny.yaml", ["rollout.engine=hf", "rollout.max_turns=1"])
    data = DataStage(plan.stage("data").settings)
    data.setup()
    rollout, tools = RolloutStage(plan.stage("rollout").settings), FakeToolsStage()

    async def go():
        await rollout.setup(Placement(peers={rollout.settings.tool_peer: tools}))
        try:
            tools.events = {"calc": {"restarts": 2, "circuit_opens": 0}}  # since the last take
            await rollout.evaluate(data.next_batch(1))
            # during the evaluation, say; its cache hits are its calls', not counted (as every tools/* metric)
            tools.events = {"calc": {"restarts": 0, "circuit_opens": 1, "cache_hits": 3, "cache_misses": 1}}
            return RolloutStage.merge([await rollout.generate(data.next_batch(1))])[1]
        finally:
            await rollout.close()

    m = asyncio.run(go())
    assert (m["tool_servers/calc/restarts"], m["tool_servers/calc/circuit_opens"]) == (2.0, 1.0)
    assert m.get("tool_servers/calc/cache_hits", 0.0) == 0.0 and m.get("tool_servers/calc/cache_misses", 0.0) == 0.0


class NoToolsStage(FakeToolsStage):
    """A tools stage whose servers list no tools (an MCP server offering none, allowed_tools matching none)."""

    async def schemas(self):
        return []


def test_named_templates_are_chosen_by_the_tools_listed_at_run_time(monkeypatch, tmp_path):
    """Of a tokenizer's named chat templates the rollout rendered with `tool_use` whenever the spec had tool
    servers, also where they listed no tools: its prompts are rendered without tools (`tools=None`), for which
    apply_chat_template picks `default`."""
    import shutil
    from pathlib import Path

    from factory.assets import resolve_model
    from factory.compiler.compile import compile_file
    from factory.types import Placement

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(repo)
    own = Path(resolve_model("factory:tiny-qwen3"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # the default: Qwen3's
        shutil.copy(own / name, tmp_path / name)
    (tmp_path / "additional_chat_templates").mkdir()
    tool_use = (repo / "prompts" / "chatml_tools.jinja").read_text()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text(tool_use)
    _, plan = compile_file(repo / "specs" / "tiny.yaml", ["rollout.engine=hf", f"model.tokenizer={tmp_path}"])

    async def chosen(tools: FakeToolsStage) -> str:
        rollout = RolloutStage(plan.stage("rollout").settings)
        try:
            await rollout.setup(Placement(peers={rollout.settings.tool_peer: tools}))
            return rollout.chat.template_text
        finally:
            await rollout.close()

    assert asyncio.run(chosen(FakeToolsStage())) == tool_use
    assert asyncio.run(chosen(NoToolsStage())) == (own / "chat_template.jinja").read_text()


def test_the_specs_max_model_len_bounds_the_rollout(monkeypatch):
    """`rollout.max_model_len` is the rollout's context: recorded in the resolved params, and a prompt that
    leaves no room under it is not generated from."""
    from pathlib import Path

    from factory.compiler.compile import compile_file
    from factory.data import DataStage
    from factory.types import Placement

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(repo)
    _, plan = compile_file(repo / "specs" / "tiny.yaml",
                           ["rollout.engine=hf", "rollout.max_turns=1", "rollout.max_model_len=16"])
    data = DataStage(plan.stage("data").settings)
    data.setup()
    rollout = RolloutStage(plan.stage("rollout").settings)

    async def go():
        info = await rollout.setup(Placement(peers={rollout.settings.tool_peer: FakeToolsStage()}))
        try:
            return info, await rollout.generate(data.next_batch(1))
        finally:
            await rollout.close()

    info, part = asyncio.run(go())
    assert info["resolved"]["max_model_len"] == 16
    trajs, _ = RolloutStage.merge([part])
    assert trajs and {t.stop_reason for t in trajs} == {"prompt_too_long"}


def test_a_max_model_len_beyond_the_models_config_is_the_rollouts_context(monkeypatch):
    """The compiler lets `rollout.max_model_len` exceed the config's context where the model may run longer
    (rope scaling, or VLLM_ALLOW_LONG_MAX_MODEL_LEN), and the engine runs at it; the rollout still cut every
    trajectory at the config's context, and the run's params recorded that."""
    from pathlib import Path

    from factory.assets import context_tokens, resolve_model
    from factory.compiler.compile import compile_file
    from factory.types import Placement

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(repo)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    _, plan = compile_file(repo / "specs" / "tiny.yaml", ["rollout.engine=hf", "rollout.max_model_len=8192"])
    rollout = RolloutStage(plan.stage("rollout").settings)
    assert context_tokens(resolve_model(rollout.settings.model.path)) == 4096

    async def go():
        try:
            return await rollout.setup(Placement(peers={rollout.settings.tool_peer: FakeToolsStage()}))
        finally:
            await rollout.close()

    info = asyncio.run(go())
    assert rollout.context == 8192 and info["resolved"]["max_model_len"] == 8192


def test_evaluation_samples_seeded_at_eval_temperature(monkeypatch):
    """Evaluation was always greedy (a reasoning model loops so); `rollout.eval_temperature` samples it,
    seeded: the same step evaluates the same trajectories twice, and not the greedy ones."""
    from pathlib import Path

    from factory.compiler.compile import compile_file
    from factory.data import DataStage
    from factory.types import Placement

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(repo)
    _, plan = compile_file(repo / "specs" / "tiny.yaml", ["rollout.engine=hf", "rollout.max_turns=1",
                                                          "rollout.max_new_tokens=24", "rollout.eval_temperature=2.0"])
    data = DataStage(plan.stage("data").settings)
    data.setup()
    rollout = RolloutStage(plan.stage("rollout").settings)
    batch = data.next_batch(4)

    async def go():
        await rollout.setup(Placement(peers={rollout.settings.tool_peer: FakeToolsStage()}))
        try:
            sampled = [[t.response_ids for t in (await rollout.evaluate(batch, step=3)).trajs] for _ in range(2)]
            s = rollout.settings
            rollout.settings = s.model_copy(update={"rollout": s.rollout.model_copy(update={"eval_temperature": 0.0})})
            greedy = [t.response_ids for t in (await rollout.evaluate(batch, step=3)).trajs]
            return sampled, greedy
        finally:
            await rollout.close()

    (first, again), greedy = asyncio.run(go())
    assert first == again and first != greedy


def test_vllm_sleeps_after_a_training_rollout_only(monkeypatch):
    """`rollout.vllm_sleep`: the engine gives its GPU memory back once a step's rollout is done (the update comes
    next), not after an evaluation (a rollout or the run's end comes next). Setup decides it for vLLM only
    (`engine: auto` may take transformers); this one's engine stands in for vLLM."""
    from pathlib import Path

    from factory.compiler.compile import compile_file
    from factory.data import DataStage
    from factory.types import Placement

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(repo)
    _, plan = compile_file(repo / "specs" / "tiny.yaml", ["rollout.engine=hf", "rollout.max_turns=1",
                                                          "rollout.max_new_tokens=4"])
    data = DataStage(plan.stage("data").settings)
    data.setup()
    s = plan.stage("rollout").settings
    rollout = RolloutStage(s.model_copy(update={"rollout": s.rollout.model_copy(update={"vllm_sleep": True})}))
    slept = []

    async def go():
        info = await rollout.setup(Placement(peers={rollout.settings.tool_peer: FakeToolsStage()}))
        try:
            assert not rollout.sleeps and "vllm_sleep" not in info["resolved"]  # transformers: nothing to sleep
            rollout.sleeps = True

            async def sleep():
                slept.append(rollout._done)  # every trajectory of the rollout done by then

            rollout.engine.sleep = sleep
            await rollout.evaluate(data.next_batch(1))
            assert slept == []
            await rollout.generate(data.next_batch(1))
        finally:
            await rollout.close()

    asyncio.run(go())
    assert slept == [rollout.settings.rollout.group_size]
