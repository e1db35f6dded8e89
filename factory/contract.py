"""The stage contract: what every stage actor is and declares, read by the compiler and the driver.

A stage class (in its stage's own package: `factory.data.stage:DataStage`, ...) subclasses `StageActor`:
its constructor takes the stage's slice of the plan and has no side effects, `setup(placement)` starts
what the stage needs, and `close()` stops it again (teardown calls it on every stage). Its `CONTRACT`
declares every method the plan's edges may call and how each call is dispatched over the stage's
replicas and its answers collected (`Call`), and what else the driver may ask of it (`Contract`).

The compiler checks each declaration against the plan (`check`): a method an edge calls that its class
does not declare, or a stage the loop needs to keep a position or checkpoints that cannot, is an error
when the plan is compiled, not an AttributeError in the middle of a run. The driver reads only these
declarations: it never probes a class for what it happens to have. (verl declares the same per method,
`@register(dispatch_mode=...)`; here it is one table per class, beside the methods.)
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_args

from factory.types import Placement
from factory.util import import_object

if TYPE_CHECKING:
    from factory.plan import Edge, Plan, Stage

Dispatch = Literal["one", "split", "all"]


class ContractError(Exception):
    """The plan's stage classes do not declare what its edges and the driver call: Factory is wrong (a
    stage class or the stage graph changed without the other), not the spec."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("the stage classes do not fit the plan:\n  " + "\n  ".join(problems))


@dataclass(frozen=True)
class Call:
    """How one method reaches a stage's replicas and how their answers become the stage's answer.

    `one`: each call goes to one replica (the replicas in turn), whose answer it is. `split`: the class's
    `split` cuts the first argument into one part per replica, each replica answers its part and the
    class's `merge` joins the answers. `all`: every replica receives the call (the ranks of a
    torch.distributed world must all take part) and replica 0's answer is the stage's.
    `stream`: the name of the method's streamed form (a `split` method: one stream per replica), so that a
    data edge out of this method can hand the parts of its answer on while the rest is still being
    computed. It takes the method's arguments and `part=` the edge's `Edge.stream` (what one part is: a
    "trajectory", a "group"), and yields the number of parts that follow (an int), each part as soon as it
    is done, then the answer itself."""

    dispatch: Dispatch = "all"
    stream: str | None = None


@dataclass(frozen=True)
class Contract:
    """What a stage class declares: every method the plan's edges call (`calls`), and what else it does.
    Each flag promises the methods named beside it; the compiler checks that the class has them."""

    calls: Mapping[str, Call] = field(default_factory=dict)
    # The replicas form one torch.distributed world: the driver asks replica 0 for a rendezvous
    # `address()` and gives every replica its rank and that address at setup.
    world: bool = False
    # `progress() -> (done, total, work)` may be polled while a call runs: (done, total) for the run's
    # display, and `work` a count that grows while the stage computes (the engine's forward steps), which
    # the call's deadline takes as a heartbeat even while nothing is done yet (factory.runtime.deadlines).
    progress: bool = False
    # `state()` / `restore(state)`: a position the driver saves with every checkpoint (the data stream's).
    state: bool = False
    # `save_checkpoint(directory, step, state)` / `load_checkpoint(directory, name)`: the trainer's.
    checkpoint: bool = False
    # `tool_listing()`: the tools offered to the model as the started servers list them (hashed into the
    # run's plan).
    lists_tools: bool = False
    # `take_recording()`: the tool calls recorded since the last take, for the run's tables, and the calls a
    # replay could not answer (factory.tools.recording); the recording to replay comes in its settings.
    records_tools: bool = False
    # The stage may serve its callers from inside their own process (an I/O stage, no model of its own):
    # `factory rescore` and the agent server then run it there instead of as a Ray actor.
    inline: bool = False

    FLAGS: ClassVar[dict[str, tuple[str, ...]]] = {
        "world": ("address",), "progress": ("progress",), "state": ("state", "restore"),
        "checkpoint": ("save_checkpoint", "load_checkpoint"), "lists_tools": ("tool_listing",),
        "records_tools": ("take_recording",)}

    def call(self, method: str) -> Call:
        """How `method` is dispatched: as declared in `calls`; a method a flag promises reaches every
        replica (replica 0's answer is the stage's), as the trainer's checkpoints need."""
        if method in self.calls:
            return self.calls[method]
        if any(method in names for flag, names in self.FLAGS.items() if getattr(self, flag)):
            return Call("all")
        raise KeyError(f"{method} is not declared in the stage's CONTRACT")

    def methods(self) -> list[str]:
        """Every method this contract promises, besides setup and close."""
        out = list(self.calls)
        out += [c.stream for c in self.calls.values() if c.stream]
        out += [m for flag, names in self.FLAGS.items() if getattr(self, flag) for m in names]
        return out


class StageActor:
    """The base class of every stage actor. The driver constructs it in a Ray actor with its slice of the
    plan (`Class(settings)`), calls `setup(placement)` on every replica (callees before their callers),
    then the methods the plan's edges name, as `CONTRACT` says, and `close()` at the end of the run --
    on every replica whose setup ran, whatever happened, also when it failed. A start cut short (a Ctrl-C,
    another stage failing) kills the replicas whose setup is still running, or never ran, without a close:
    what a setup started as child processes ends with Ray's (factory.runtime.driver.teardown)."""

    CONTRACT: ClassVar[Contract] = Contract()

    # A class with a call dispatched `split` also defines two static methods (the compiler checks it):
    # `split(batch, replicas) -> [args, ...]`, the arguments of each replica's part (at most `replicas` parts),
    # and `merge(answers) -> answer`, the replicas' answers to their parts joined into the stage's answer.

    def setup(self, placement: Placement | None = None) -> dict[str, Any]:
        """Start what the stage needs (load a model, start servers, read data); returns what it reports
        about itself for the run's placement record (`resolved`: what it chose on its device). The base
        class starts nothing and reports nothing."""
        return {}

    def close(self) -> None:
        """Stop what setup started. Safe before setup, after a failed setup and twice."""


def peers_of(edges: Any, caller: str, handles: Mapping[str, Any]) -> dict[str, Any]:
    """What `caller`'s setup receives as `Placement.peers`: for each call edge it makes, the callee's
    handle (`handles`: stage name -> handle) under the edge's role, the name its slice knows it by."""
    return {e.role: handles[e.dst] for e in edges if e.kind == "call" and e.src == caller and e.method}


# ------------------------------------------------------------------------------------------- checks
def check(plan: Plan) -> list[str]:
    """Every way the plan's stage classes fall short of what its edges and the driver call: each class
    a StageActor whose declared methods exist; every method an edge calls or fetches declared by its
    stage; a stream edge out of a method that has a streamed form; the data source keeps a position and
    the trainer checkpoints (the loop saves and restores both); every peer role a slice names reached by
    a call edge of that stage."""
    out: list[str] = []
    classes: dict[str, type] = {}
    for s in plan.stages:
        try:
            cls = import_object(s.cls)
        except Exception as e:  # noqa: BLE001 -- any failure to import is this stage's problem
            out.append(f"stage {s.name}: cannot import {s.cls}: {type(e).__name__}: {e}")
            continue
        if not (isinstance(cls, type) and issubclass(cls, StageActor)):
            out.append(f"stage {s.name}: {s.cls} is not a StageActor (factory.contract)")
            continue
        classes[s.name] = cls
        out += _class_problems(s, cls)
    for e in plan.edges:
        out += _edge_problems(plan, e, classes)
    for what, flag, name in (("the data source", "state", plan.flow("data")[0].src),
                             ("the trainer", "checkpoint", plan.flow("data")[-1].dst)):
        if name in classes and not getattr(classes[name].CONTRACT, flag):
            out.append(f"stage {name}: {what} must declare `{flag}` (the loop saves and restores it)")
    for s in plan.stages:
        roles = {e.role for e in plan.edges if e.kind == "call" and e.src == s.name and e.method}
        for role in sorted(set(s.settings.peer_roles()) - roles if s.settings is not None else ()):
            out.append(f"stage {s.name}: its slice names the peer role {role!r} but no call edge of it has that role")
    return out


def _class_problems(stage: Stage, cls: type) -> list[str]:
    out = []
    c = cls.CONTRACT
    for method in ["setup", "close", *c.methods()]:
        if not callable(getattr(cls, method, None)):
            out.append(f"stage {stage.name}: {cls.__name__} declares {method}() but has no such method")
    for name, call in c.calls.items():
        if call.dispatch not in get_args(Dispatch):  # (the driver sent one it does not know to every replica)
            out.append(f"stage {stage.name}: {cls.__name__}.{name} is dispatched {call.dispatch!r}, which is none of "
                       f"{', '.join(map(repr, get_args(Dispatch)))} (factory.contract.Call)")
        if call.dispatch == "split" and not all(callable(getattr(cls, m, None)) for m in ("split", "merge")):
            out.append(f"stage {stage.name}: {cls.__name__}.{name} is dispatched `split` but the class has no "
                       "split/merge of its own")
        if call.stream and call.dispatch != "split":
            out.append(f"stage {stage.name}: {cls.__name__}.{name} streams but is not dispatched `split`")
    if c.world and any(call.dispatch == "one" for call in c.calls.values()):
        out.append(f"stage {stage.name}: {cls.__name__} forms a torch.distributed world; a call to one rank "
                   "alone would leave the others waiting in its collectives")
    return out


def _edge_problems(plan: Plan, e: Edge, classes: dict[str, type]) -> list[str]:
    out = []
    for stage, method, how in ((e.dst, e.method, "calls"), (e.src, e.fetch, "fetches from")):
        if method and stage in classes and method not in classes[stage].CONTRACT.calls:
            out.append(f"edge {e.src} -> {e.dst} ({e.carries}) {how} {stage}.{method}, which "
                       f"{classes[stage].__name__} does not declare in its CONTRACT")
    into = classes[e.dst].CONTRACT.calls.get(e.method) if e.dst in classes else None
    if e.stream and into is not None and into.dispatch != "one":
        out.append(f"edge {e.src} -> {e.dst} ({e.carries}) streams into {e.dst}.{e.method}, which is not "
                   "dispatched `one` (each part goes to one replica)")
    if e.stream and e.src in classes:  # every method that feeds the edge hands its answer on part by part
        calls = classes[e.src].CONTRACT.calls
        for p in plan.edges:
            if p.kind in ("data", "eval") and p.dst == e.src and p.method and not calls.get(p.method, Call()).stream:
                out.append(f"edge {e.src} -> {e.dst} ({e.carries}) streams, but {e.src}.{p.method}, which feeds it, "
                           "declares no streamed form")
    return out
