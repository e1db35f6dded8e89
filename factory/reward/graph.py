"""The reward graph as pure functions: which nodes read which, how combinators combine, how a judge's
reply becomes a score, and the step metrics of scored trajectories (the one rule for training and eval).

A node's value for one trajectory is a float, or None when it has none: a leaf whose `on_missing` is
`drop_sample` had no value (the trajectory is then dropped, and every node that reads it is None too), or
a gate did not evaluate it there ("skipped"). Every mean is over the trajectories that were not dropped
and over the values that exist.
"""
from __future__ import annotations

import inspect
import json
import math
import re
import statistics
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

from factory.schema import (
    ClipNode,
    FnNode,
    GateNode,
    JudgeNode,
    MaxNode,
    MinNode,
    NormalizeNode,
    ProductNode,
    Spec,
    SumNode,
    ToolNode,
)
from factory.types import Trajectory
from factory.util import THINK_CLOSE, THINK_OPEN, UserError, import_object, template_env, without_reasoning

LEAVES = (FnNode, JudgeNode, ToolNode)
# A leaf's outcomes that leave it without a value (its `on_missing` applies): counted in `/missing`.
MISSING = ("missing", "error", "parse_failure", "non_finite")
NORMALIZE_EPS = 1e-6  # below this std all values agree: a normalised node is 0 there


class MissingReward(UserError, RuntimeError):
    """A node with `on_missing: fail` had no value: the run stops (the message names node, trajectory,
    reason; the CLI shows it alone and exits 2)."""


class NonFiniteReward(UserError, RuntimeError):
    """A combinator's value overflowed to inf or NaN from finite inputs: the run stops, naming the node, the
    trajectory and the inputs."""


def node_inputs(node: Any) -> list[str]:
    """The other nodes a node reads."""
    return [name for name, _ in node.inputs()]


def takes_turns(fn: Callable[..., Any]) -> bool:
    """Whether a reward function declares a `turns` parameter: only then does the reward stage pass the
    turns (a `**row` catch-all keeps receiving exactly the row). The compiler asks once per function."""
    try:
        return "turns" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def row_keywords(fn: Callable[..., Any], node: FnNode) -> tuple[str, ...] | None:
    """The row columns a reward function names, which the reward stage passes it (sorted): the parameters after
    `prompt` and `completion`, less the node's `args` and what the stage passes itself (`_passed`), as
    `required_columns` reads them. None when it takes every column (`**row`) or its signature cannot be read.
    So `f(prompt, completion, answer)` works on rows with more columns. The compiler asks once per function."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return tuple(sorted(p.name for p in params[2:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                        and p.name not in node.args and p.name not in _passed(node)))


def required_columns(spec: Spec, fns: Mapping[str, Callable[..., Any]] | None = None) -> dict[str, str]:
    """Data columns the reward functions cannot do without: column -> the node that needs it. `fns`: each
    function node's function, as the compiler imported it (default: imported here).

    A reward function is called as `fn(prompt, completion, **row, **args)` (plus `turns` when it asks; a
    per-turn one also gets `turn` and `index`), so every other parameter that has no default and is not
    bound by the node's `args` must come from the row; its `answer` is the row's `data.answer_key` column.
    The data stage checks every row for them before the first step."""
    needed: dict[str, str] = {}
    for name, node in spec.rewards.items():
        if not isinstance(node, FnNode) or node.group:
            continue
        try:
            fn = fns.get(name) if fns is not None else import_object(node.fn)
            if fn is None:  # it did not import: the compiler says so at its key
                continue
            every = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):  # no introspectable signature: nothing to require
            continue
        for p in every[2:]:
            if (p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                    and p.name not in node.args and p.name not in _passed(node)):
                column = spec.data.answer_key if p.name == "answer" else p.name
                needed.setdefault(column, f"rewards.{name}{_shape_hint([q.name for q in every], p.name)}")
    return needed


# What a judge's template and a tool node's arguments are rendered with besides the row's columns
# (factory.reward.stage's context): the trajectory's fields, and at one turn of a per-turn node that turn's.
_TRAJECTORY_NAMES = frozenset({"prompt", "completion", "turns"})
_TURN_NAMES = frozenset({"turn", "index"})


def template_columns(spec: Spec, texts: Mapping[str, tuple[str, str]]) -> dict[str, str]:
    """Data columns the reward graph's templates read: column -> the node's key. `texts`: where -> (node,
    template text). A name a template reads that is neither the trajectory's nor a jinja global, and that it
    does not test with `is defined`, is a row column: a row without it would fail that node on every call."""
    import jinja2
    import jinja2.meta
    from jinja2 import nodes

    env = template_env()
    needed: dict[str, str] = {}
    for where, (name, text) in texts.items():
        own = _TRAJECTORY_NAMES | (_TURN_NAMES if spec.rewards[name].per == "turn" else frozenset())
        try:
            ast = env.parse(text)
            read = jinja2.meta.find_undeclared_variables(ast)  # compiles it: an unknown filter is found here
        except jinja2.TemplateSyntaxError:  # the compiler says so at the template's key
            continue
        optional = {t.node.name for t in ast.find_all(nodes.Test)
                    if t.name in ("defined", "undefined") and isinstance(t.node, nodes.Name)}
        for v in sorted(read - own - optional - set(env.globals)):
            needed.setdefault(spec.data.answer_key if v == "answer" else v, f"rewards.{where}")
    return needed


def _shape_hint(names: list[str], column: str) -> str:
    """What a missing column may really say: the function has another node's shape than its node declares."""
    if column == "rows" or names[:2] == ["prompts", "completions"]:
        return ", which looks like a group reward: set `group: true` on the node"
    if column == "turn" or (column == "index" and "turn" in names):  # (`index` alone is a common column)
        return ", which looks like a per-turn reward: set `per: turn` on the node"
    return ""


def per_turn_nodes(nodes: Mapping[str, Any]) -> set[str]:
    """The nodes with one value per model turn: function, judge and tool nodes with `per: turn`, and every combinator or
    gate that reads one, directly or not (a trajectory-level input counts at every turn there). A
    `normalize` node never is one: the compiler refuses one that reads a per-turn node."""
    out = {name for name, node in nodes.items() if isinstance(node, LEAVES) and node.per == "turn"}
    changed = True
    while changed:  # to a fixed point: a chain of readers is found whatever the nodes' order
        changed = False
        for name, node in nodes.items():
            if (name not in out and not isinstance(node, (*LEAVES, NormalizeNode))
                    and any(inp in out for inp in node_inputs(node))):
                out.add(name)
                changed = True
    return out


def turn_mean(values: list[float | None]) -> float | None:
    """A per-turn node's value for the whole trajectory: the mean over the turns that have a value (None
    when none has: no turns, or a gate evaluated it nowhere)."""
    present = [v for v in values if v is not None]
    return math.fsum(present) / len(present) if present else None


def _passed(node: FnNode) -> tuple[str, ...]:
    """The keyword arguments the reward stage passes besides the row (never data columns)."""
    return ("turns", "turn", "index") if node.per == "turn" else ("turns",)


def roots(nodes: dict[str, Any], train: str) -> list[str]:
    """The nodes evaluated on every trajectory: the training node and every node no other node reads.
    The rest are evaluated where a reader needs them (so a gate's `then` runs only where it passes)."""
    read = {inp for node in nodes.values() for inp in node_inputs(node)}
    return [n for n in nodes if n == train or n not in read]


def conditional(nodes: dict[str, Any], train: str) -> set[str]:
    """The nodes a gate may leave unevaluated: those reachable from the roots only through a gate's
    `then`."""
    always, todo = set(), roots(nodes, train)
    while todo:
        name = todo.pop()
        if name in always:
            continue
        always.add(name)
        node = nodes[name]
        todo += [node.gate] if isinstance(node, GateNode) else node_inputs(node)
    return set(nodes) - always


def prompt_text(messages: list[dict[str, Any]]) -> str:
    """What reward functions get as `prompt`: the last user message (the task as posed)."""
    users = [m["content"] for m in messages if m.get("role") == "user"]
    return users[-1] if users else ""


def combine(node: Any, values: list[float]) -> float:
    """A sum, min, max, product or clip node's value from its inputs' values (in `node.inputs()` order)."""
    if isinstance(node, SumNode):
        return _sum([w * v for w, v in zip(node.sum.values(), values)])
    if isinstance(node, ProductNode):
        return math.prod(values)
    if isinstance(node, MinNode):
        return min(values)
    if isinstance(node, MaxNode):
        return max(values)
    if isinstance(node, ClipNode):
        lower = -math.inf if node.lower is None else node.lower
        upper = math.inf if node.upper is None else node.upper
        return min(max(values[0], lower), upper)
    raise TypeError(f"not a combinator: {type(node).__name__}")


def _sum(terms: list[float]) -> float:
    """The exact sum, rounded once; inf or nan where it is no finite float, for the caller to report with its
    node and trajectory (math.fsum raises instead: ValueError for inf + -inf, OverflowError once a partial
    sum is past float range, which the whole may not be: 1e308 + 1e308 - 1e308)."""
    try:
        return math.fsum(terms)
    except ValueError:
        return math.nan
    except OverflowError:
        if not all(map(math.isfinite, terms)):
            return sum(terms)  # the infinities decide it: inf, -inf, or nan for both
        exact = sum(map(Fraction, terms))  # (floats are exact as fractions)
        try:
            return float(exact)
        except OverflowError:
            return math.inf if exact > 0 else -math.inf


def gate_passes(node: GateNode, condition: float) -> bool:
    return condition >= node.threshold


def standardize(values: list[float | None]) -> list[float | None]:
    """(v - mean) / std over the values that exist (population std); all 0 when they agree."""
    present = [v for v in values if v is not None]
    if not present:
        return list(values)
    mean = statistics.fmean(present)
    std = statistics.pstdev(present, mu=mean)
    return [None if v is None else (0.0 if std < NORMALIZE_EPS else (v - mean) / std) for v in values]


# ------------------------------------------------------------------------------------ judge replies
_NUMBER = re.compile(r"-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")  # (`1.`, `.5`: numbers as written)


def parse_score(reply: str, node: JudgeNode) -> float:
    """The score in a judge's reply, by the node's regex (first group, else the whole match) or JSON field;
    raises ValueError saying why a reply does not parse. Read after the judge's reasoning is left out: a
    thinking judge drafts verdicts before its last word, and a reply cut off while thinking has none. A
    `<think>` left open after the reply's own words is the judge quoting the marker (`{"reason": "it wrote
    <think> tags", "score": 1}`), not reasoning: where the reply does not parse without it, it is read as text."""
    try:
        return _read_score(without_reasoning(reply), node)
    except ValueError:
        head, opener, tail = reply.rpartition(THINK_OPEN)
        words = without_reasoning(head)
        if not opener or THINK_CLOSE in tail or not words.strip():
            raise  # no `<think>` left open, or one that opened the reply: cut off while thinking
        return _read_score(words + opener + tail, node)


def _read_score(reply: str, node: JudgeNode) -> float:
    if node.json_field is not None:
        objects = list(_json_objects(reply))
        if not objects:
            raise ValueError("no JSON object in the reply")
        found = next((o for o in objects if node.json_field in o), None)
        if found is None:
            raise ValueError(f"the reply's JSON has no field '{node.json_field}'")
        return _number(found[node.json_field])
    found = re.search(node.parse, reply)
    if found is None:
        raise ValueError("the reply does not match `parse`")
    return _number(found.group(1) if found.groups() else found.group())


def _json_objects(text: str):
    """Each JSON object in `text`, in order, read from each `{` where one starts (not the first `{` to the
    last `}`: a reply with two objects, or braces in its prose, held none)."""
    decoder, start = json.JSONDecoder(), text.find("{")
    while start >= 0:
        try:
            obj, end = decoder.raw_decode(text, start)
        # JSONDecodeError is a ValueError, as is an integer past Python's 4300 digits (not a JSONDecodeError): an
        # object that holds one is skipped, the next read; RecursionError: a reply nested past the parser's depth
        except (ValueError, RecursionError):
            start = text.find("{", start + 1)
            continue
        if isinstance(obj, dict):
            yield obj
        start = text.find("{", end)


def _number(value: Any) -> float:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        try:
            return float(value)
        except OverflowError:  # an int of 400 digits: out of range, as "1e400" is (the node's non_finite)
            return math.inf if value > 0 else -math.inf
    if isinstance(value, str) and (m := _NUMBER.fullmatch(value.strip())):
        return float(m.group())
    raise ValueError(f"not a number: {str(value)[:40]!r}")


# ------------------------------------------------------------------------------------------ metrics
def _mean(values: list[float]) -> float:
    return math.fsum(values) / len(values) if values else float("nan")


FAILED = ("error", "parse_failure", "non_finite")  # the MISSING outcomes that are failures, not a chosen None


def failing_everywhere(trajs: list[Trajectory]) -> list[str]:
    """The reward nodes that failed (raised, did not parse, not finite) on every one of `trajs`: a function that
    raised on every call ran a whole run with one line a step from the reward stage ("1 of 1" when trajectories
    are scored one at a time), and read as a model that learns nothing."""
    names = {name for t in trajs for name in t.reward_details}  # (a node with a value everywhere records nothing)
    return sorted(name for name in names if all(s in FAILED for t in trajs for s in t.statuses(name)))


def reward_metrics(trajs: list[Trajectory], nodes: dict[str, Any], train: str) -> dict[str, float]:
    """The metrics of scored trajectories, computed from their records alone (so a step scored in several
    calls, an eval batch and a rescored run all follow one rule):

    `rewards/<node>/mean` over kept trajectories where the node has a value (a per-turn node's value: the
    mean over its turns); for function, judge and tool nodes also `/missing` (no value, whatever the reason),
    `/errors` (it raised or returned no number / the request failed), `/parse_failures` (a judge reply or
    tool text that is not a score), `/non_finite` (a value that was inf, NaN or past float32, taken as none);
    for judges `/calls` (requests made: not where a gate skipped it, nor where its template did not render);
    for nodes a gate may leave out `/skipped` (not evaluated), and for those and per-turn nodes `/values` (the
    kept trajectories its mean is over); `reward/mean` over kept trajectories; `reward/dropped` (trajectories
    a `drop_sample` node took out). A per-turn node's counts are of turns, its `/turns/mean` is the mean over
    every turn of the kept trajectories that has a value, `/turns` how many such turns there are."""
    kept = [t for t in trajs if t.dropped is None]
    gated = conditional(nodes, train)
    t_nodes = per_turn_nodes(nodes)
    out: dict[str, float] = {}
    for name, node in nodes.items():
        out[f"rewards/{name}/mean"] = _mean([v for t in kept if (v := t.rewards.get(name)) is not None])
        status = [s for t in trajs for s in t.statuses(name)]
        if name in t_nodes:  # the count first: a step scored in several calls weighs each call's mean by it
            values = [v for t in kept for v in t.turn_rewards.get(name, ()) if v is not None]
            out[f"rewards/{name}/turns"] = float(len(values))
            out[f"rewards/{name}/turns/mean"] = _mean(values)
        if isinstance(node, LEAVES):
            out[f"rewards/{name}/missing"] = float(sum(s in MISSING for s in status))
            out[f"rewards/{name}/non_finite"] = float(status.count("non_finite"))
            out[f"rewards/{name}/errors"] = float(status.count("error"))
            out[f"rewards/{name}/parse_failures"] = float(status.count("parse_failure"))
        if isinstance(node, JudgeNode):
            # every request records a status; a trajectory without turns records none (`{}`): nothing asked
            out[f"rewards/{name}/calls"] = float(sum(d.get("status") not in (None, "skipped") and d.get("sent", True)
                                                     for t in trajs for d in t.node_details(name)))
        if name in gated:
            out[f"rewards/{name}/skipped"] = float(status.count("skipped"))
        if name in gated or name in t_nodes:
            # what its mean is over (a gate may leave it out of some kept trajectories, a per-turn node has no
            # value on one without turns): a step scored in several calls weighs each call's mean by it
            out[f"rewards/{name}/values"] = float(sum(t.rewards.get(name) is not None for t in kept))
    out["reward/mean"] = _mean([t.reward for t in kept])
    out["reward/dropped"] = float(len(trajs) - len(kept))
    return out


def eval_metrics(metrics: dict[str, float], metric_nodes: dict[str, str]) -> dict[str, float]:
    """An evaluation's `eval/*` metrics from `reward_metrics` of its trajectories: `eval/<name>` is the mean
    of its node, `eval/reward` of the trained reward (the same missing-value rule as training)."""
    out = {f"eval/{name}": metrics[f"rewards/{node}/mean"] for name, node in metric_nodes.items()}
    out["eval/reward"] = metrics["reward/mean"]
    out["eval/dropped"] = metrics["reward/dropped"]
    return out
