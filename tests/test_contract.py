"""The declared stage contract (factory.contract): what each stage class declares is checked when the plan
is compiled, peers reach a stage by the roles of its call edges, every stage closes (the trainer's too),
and no code outside the compiler finds a stage by its name."""
from __future__ import annotations

import ast
import asyncio
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest

from factory.compiler.compile import compile_file
from factory.contract import Call, Contract, ContractError, StageActor, check, peers_of
from factory.util import import_object

REPO = Path(__file__).resolve().parents[1]

# Every kind of stage: data, rollout, tools (called by the rollout and by a tool reward node), reward, a
# local judge model, update.
SPEC = """\
name: contract
model: {path: "factory:tiny-qwen3"}
data: {train: {generator: "factory.data:arithmetic", size: 8}}
tools:
  calc: {command: python, args: [-m, factory.examples.calculator]}
rewards:
  correct: {fn: "factory.rewards.math:numeric_match"}
  doubled: {tool: calc.calculate, arguments: {expression: "{{ answer }} * 2"}}
  judged: {llm_judge: judge.jinja, local: {path: "factory:tiny-qwen3"}}
  total: {sum: {correct: 1.0, doubled: 0.1, judged: 0.1}}
"""


def _write(project) -> str:
    project.file("judge.jinja", "Grade {{ completion }} (truth {{ answer }}). Score:")
    return project.spec(SPEC)


@pytest.fixture
def full_plan(project):
    return compile_file(_write(project))[1]


def test_every_stage_class_declares_what_the_plan_calls(full_plan):
    assert {s.name for s in full_plan.stages} == {"data", "rollout", "tools", "reward", "judge.judged", "update"}
    assert check(full_plan) == []
    for s in full_plan.stages:
        assert issubclass(import_object(s.cls), StageActor)


def test_a_method_an_edge_calls_that_its_class_does_not_declare_is_a_compile_error(project, monkeypatch):
    from factory.reward.stage import RewardStage
    from factory.rollout.stage import RolloutStage

    path = _write(project)
    with monkeypatch.context() as patch, pytest.raises(ContractError) as e:
        patch.setattr(RewardStage, "CONTRACT", Contract(calls={}))
        compile_file(path)
    assert e.value.problems == [
        "edge rollout -> reward (trajectories) calls reward.score, which RewardStage does not declare in its CONTRACT"]
    # a stream edge out of a method without a streamed form; a flag whose methods the class lacks
    with monkeypatch.context() as patch, pytest.raises(ContractError) as e:
        patch.setattr(RolloutStage, "CONTRACT", Contract(
            calls={"generate": Call("split", stream="generate_parts"), "evaluate": Call("split"),
                   "load_weights": Call("all")}, state=True))
        compile_file(path)
    assert e.value.problems == [
        "stage rollout: RolloutStage declares state() but has no such method",
        "stage rollout: RolloutStage declares restore() but has no such method",
        "edge rollout -> reward (trajectories) streams, but rollout.evaluate, which feeds it, declares no streamed "
        "form"]


def test_the_loop_needs_a_data_source_with_a_position_and_a_trainer_with_checkpoints(full_plan, monkeypatch):
    from factory.data.stage import DataStage
    from factory.update.stage import UpdateStage

    monkeypatch.setattr(DataStage, "CONTRACT", Contract(calls=DataStage.CONTRACT.calls))
    monkeypatch.setattr(UpdateStage, "CONTRACT", Contract(calls=UpdateStage.CONTRACT.calls, world=True))
    assert check(full_plan) == [
        "stage data: the data source must declare `state` (the loop saves and restores it)",
        "stage update: the trainer must declare `checkpoint` (the loop saves and restores it)"]


def test_peers_are_handed_by_the_roles_of_the_call_edges(full_plan):
    """The reward stage's slice names the roles it reads; the call edges out of it carry those roles."""
    reward = full_plan.stage("reward").settings
    handles = {s.name: f"<{s.name}>" for s in full_plan.stages}
    calls = [e for e in full_plan.edges if e.kind == "call"]
    assert peers_of(calls, "reward", handles) == {reward.tool_peer: "<tools>",
                                                  reward.judge_peers["judged"]: "<judge.judged>"}
    rollout = full_plan.stage("rollout").settings
    assert peers_of(calls, "rollout", handles) == {rollout.tool_peer: "<tools>"}
    assert peers_of(calls, "data", handles) == {}


def test_every_stage_closes_before_setup_and_the_update_releases_its_learner(full_plan):
    """teardown calls `close` on every stage (tests/test_overlap.py), also when setup never ran or failed."""
    from factory.update.stage import UpdateStage

    for s in full_plan.stages:
        stage = import_object(s.cls)(s.settings)
        closed = stage.close()
        if inspect.isawaitable(closed):
            asyncio.run(closed)
    update = UpdateStage(full_plan.stage("update").settings)
    released = []
    update.learner = SimpleNamespace(shutdown=lambda: released.append("shutdown"))
    update.close()
    update.close()
    assert released == ["shutdown"]  # once: the engine and the process group are gone


# ----------------------------------------------------------------------------- no stage names outside
def stage_name_uses(source: str, names: set[str]) -> list[tuple[int, str]]:
    """Where `source` finds a stage by its name: a literal stage name passed to `.stage(...)`, used as a key
    of peers/groups/stages, compared with a `.name`/`.src`/`.dst`, and any text that starts like a
    stage family's name ("judge." ...), f-strings included."""
    prefixes = tuple(n.split(".")[0] + "." for n in names if "." in n)
    holders = ("peers", "groups", "stages", "handles", "g")

    def literal(node: ast.AST) -> str | None:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    def named(node: ast.AST) -> bool:
        value = literal(node)
        return value is not None and (value in names or value.startswith(prefixes))

    def holder(node: ast.AST) -> bool:
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        return name in holders or name.endswith(holders[:3])

    def parts(node: ast.AST) -> list[ast.AST]:
        return list(node.elts) if isinstance(node, ast.Tuple) else [node]

    hits = []
    for node in ast.walk(ast.parse(source)):
        found = False
        if isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)):
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            owner = node.func.value if isinstance(node.func, ast.Attribute) else None
            found = ((fn == "stage" and any(named(a) for a in node.args))
                     or (fn == "get" and owner is not None and holder(owner) and any(named(a) for a in node.args)))
        elif isinstance(node, ast.Subscript):
            found = holder(node.value) and named(node.slice)
        elif isinstance(node, ast.Compare):
            sides = [p for side in (node.left, *node.comparators) for p in parts(side)]
            found = (any(isinstance(p, ast.Attribute) and p.attr in ("name", "src", "dst") for p in sides)
                     and any(named(p) for p in sides))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and prefixes:
            found = node.value.startswith(prefixes)  # "judge.x", or the head of f"judge.{node}"
        if found:
            hits.append((node.lineno, ast.get_source_segment(source, node) or ""))
    return hits


OLD_WAYS = '''
judge = placement.peers[f"judge.{name}"]
tools = ToolsClient(placement.peers.get("tools"))
order = plan.stage("reward").settings.order
peers["tools"] = ToolsStage(plan.stage("tools").settings)
if any(e.kind == "call" and (e.src, e.dst) == ("reward", "tools") for e in plan.edges): pass
line = [s.name for s in plan.stages if s.name != "tools" and not s.name.startswith("judge.")]
'''


def test_no_stage_name_outside_the_compiler(full_plan):
    """A stage finds its peers by role and the runtime finds stages by what they are (the flow's source,
    the trainer, a slice's type): only the compiler, which names the stages, may use their names."""
    names = {s.name for s in full_plan.stages}
    old = stage_name_uses(OLD_WAYS, names)  # the checker sees each way the code used to do it
    assert len(old) == 8 and {line for line, _ in old} == {2, 3, 4, 5, 6, 7}
    found = []
    for path in sorted((REPO / "factory").rglob("*.py")):
        if "compiler" in path.relative_to(REPO / "factory").parts:
            continue
        found += [f"{path.relative_to(REPO)}:{line}: {text}" for line, text in stage_name_uses(path.read_text(), names)]
    assert found == []


def test_an_unknown_dispatch_is_a_compile_time_problem():
    """A misspelt `Call.dispatch` compiled clean, and the driver sent a value it does not know to every replica."""
    from factory.contract import _class_problems

    class Typo(StageActor):
        CONTRACT = Contract(calls={"score": Call("One")})

        def score(self, batch):
            return batch

    assert _class_problems(SimpleNamespace(name="s"), Typo) == [
        "stage s: Typo.score is dispatched 'One', which is none of 'one', 'split', 'all' (factory.contract.Call)"]


def test_a_split_call_needs_the_class_to_split_and_merge():
    """`split` and `merge` are the class's own (the base has none): a class dispatching `split` without them
    is a compile-time problem, not an AttributeError in the first step."""
    from factory.contract import _class_problems

    class Parts(StageActor):
        CONTRACT = Contract(calls={"score": Call("split")})

        def score(self, batch):
            return batch

    stage = SimpleNamespace(name="s")
    assert _class_problems(stage, Parts) == [
        "stage s: Parts.score is dispatched `split` but the class has no split/merge of its own"]
    Parts.split = staticmethod(lambda batch, replicas: [(batch,)])
    assert _class_problems(stage, Parts) == [
        "stage s: Parts.score is dispatched `split` but the class has no split/merge of its own"]
    Parts.merge = staticmethod(lambda answers: answers[0])
    assert _class_problems(stage, Parts) == []
    assert Parts().setup() == {}  # the base starts nothing
