"""The reward stage: evaluates the spec's reward graph for every trajectory.

One `score(trajs)` call computes each (node, trajectory) value -- each (node, trajectory, turn) value for
a per-turn node -- at most once, on demand, as an asyncio task: the roots (the training node and every node nothing reads) are asked for on every trajectory, and
each node asks for its inputs. So independent nodes and all trajectories run concurrently -- python
functions in threads of their node's own, async functions, judge requests and tool calls on the event loop -- and a
gate asks for its `then` node only where its condition passes. A function, judge or tool without a value
follows its node's `on_missing`; every failure is recorded in the trajectory and counted, and the run
goes on (unless the node says `fail`).
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import inspect
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from factory.contract import Call, Contract, StageActor
from factory.data.sources import messages_from_text, row_template_env
from factory.plan import RewardSettings
from factory.reward.graph import (
    LEAVES,
    MissingReward,
    NonFiniteReward,
    combine,
    gate_passes,
    node_inputs,
    parse_score,
    per_turn_nodes,
    prompt_text,
    reward_metrics,
    roots,
    standardize,
    turn_mean,
)
from factory.reward.lanes import Lane, Processes, awaited
from factory.schema import FLOAT32_MAX, FnNode, GateNode, JudgeNode, NormalizeNode, ToolNode
from factory.types import Placement, ToolCall, Trajectory
from factory.util import enter_workdir, escaped, import_object, is_async, node_id, resolve_file

log = logging.getLogger(__name__)


def _row_filter(node: FnNode, named: tuple[str, ...] | None) -> Callable[[str], bool]:
    """Which row columns a function node's function is passed: those it names (`named`, the compiler's
    `RewardSettings.row_keywords`), or every column for `**row` (None); never `prompt` or `completion`
    (passed positionally) nor a column named like one of the node's `args`, which win."""
    reserved = {"prompt", "completion", *node.args}
    if named is None:
        return lambda column: column not in reserved
    wanted = set(named) - reserved
    return wanted.__contains__


class RewardStage(StageActor):
    """The reward actor. Its methods are coroutines, so Ray runs it as an async actor with one event loop
    for its life; tool nodes call the tools stage and local judges their model (the plan's call edges out
    of it, handed to it at setup under the roles its slice names).

    API: `await setup(placement)`, then `await score(trajs)` per batch -- a step may be scored in several
    calls: trajectory by trajectory when no node reads beyond its trajectory, group by group (whole groups)
    when a node reads its group, the whole batch at once when the slice says `whole_batch` (the compiler's
    choice, `Edge.stream`) -- and `await close()`."""

    CONTRACT = Contract(calls={"score": Call("one")}, progress=True)

    def __init__(self, settings: RewardSettings, *, threads_per_node: int = 256):
        self.settings = settings
        self.nodes = dict(settings.rewards)
        self.train_node, self.order = settings.train_node, settings.order  # resolved by the compiler
        self.per_turn = per_turn_nodes(self.nodes)  # a pure function of the nodes the slice holds
        self._warned_round: tuple[int, int] | None = None  # (step, attempt) whose failing nodes were logged
        self._said_none: set[str] = set()  # nodes whose function's None (its "no value") was said: once a run
        self._warned: set[str] = set()
        self._lanes = {name: Processes(name, node.processes) if node.processes else Lane(name, threads_per_node)
                       for name, node in self.nodes.items() if isinstance(node, FnNode)}
        self._base_dir = Path(settings.base_dir)
        self._sessions = contextlib.AsyncExitStack()  # the judge sessions setup() opens; close() closes them
        # `progress`: trajectories scored / given since no call was in flight, and node values settled (a
        # slow judge's step shows it works before any trajectory is done)
        self._done = self._total = self._settled = 0

    async def setup(self, placement: Placement | None = None) -> dict[str, Any]:
        # In its own actor, so slow or crashing reward code never stalls rollout.
        placement = placement or Placement()
        enter_workdir(placement.workdir)
        # node -> (function, wants `turns`, which row columns it is passed: takes(column))
        self._fns: dict[str, tuple[Callable[..., Any], bool, Callable[[str], bool]]] = {}
        self._templates: dict[str, Any] = {}  # judge node -> its prompt; tool node -> its argument templates
        self._judge_actors: dict[str, Any] = {}
        env = row_template_env()  # a null column printed into a judge's prompt is refused, as in the model's
        for name, node in self.nodes.items():
            if isinstance(node, FnNode):
                fn = import_object(node.fn)
                self._fns[name] = (functools.partial(fn, **node.args), name in self.settings.takes_turns,
                                   _row_filter(node, self.settings.row_keywords.get(name)))
            elif isinstance(node, ToolNode):
                self._templates[name] = {k: env.from_string(v) for k, v in node.arguments.items()}
            elif isinstance(node, JudgeNode):
                self._templates[name] = env.from_string(resolve_file(node.llm_judge, self._base_dir).read_text())
                if node.local is not None:  # the judge model's stage, which the driver placed
                    self._judge_actors[name] = placement.peers[self.settings.judge_peers[name]]
        from factory.reward.judge import EndpointSession, LocalSession
        from factory.tools.client import ToolsClient

        tools = self.settings.tool_peer
        # (uncounted: a tool node's calls are its values, with their failures in rewards/<node>/*)
        self._toolbox = ToolsClient(placement.peers[tools] if tools else None, counted=False)
        await self._toolbox.start()
        # One session per judge node for the actor's life, shared by concurrent `score` calls (a step's
        # trajectories or groups are scored as they arrive), so a node's `concurrency` bounds all of its
        # requests at once.
        self._judges = {name: await self._sessions.enter_async_context(
                            EndpointSession(node) if node.local is None else LocalSession(node, self._judge_actors[name]))
                        for name, node in self.nodes.items() if isinstance(node, JudgeNode)}
        await self._probe_judges()
        return {"node": node_id(), "order": list(self.order), "train_node": self.train_node}

    async def _probe_judges(self) -> None:
        """A warning now for each judge endpoint that does not answer, as `factory check --connect` says: found
        otherwise only once scoring begins. Not a refusal (a server may come up later), and probed from here, on
        the network the requests will take (a cluster's). An up server answers in milliseconds."""
        from factory.endpoints import judge_unanswered, why_unreachable

        urls = {name: node.endpoint for name, node in self.nodes.items()
                if isinstance(node, JudgeNode) and node.endpoint}
        for (name, url), why in zip(urls.items(), await asyncio.gather(*map(why_unreachable, urls.values()))):
            if why:
                log.warning("reward node %s: %s Until it answers, each of its requests fails and has no value "
                            "(on_missing: %s)", name, judge_unanswered(url, why), self.nodes[name].on_missing)

    async def score(self, trajs: list[Trajectory], *, step: int = 0,
                    attempt: int = 0) -> tuple[list[Trajectory], dict[str, float]]:
        """Fill `rewards`, `reward_details`, `reward` and `dropped` of every trajectory; return them with the
        metrics of this call (`reward_metrics`, plus timings). (`step`, `attempt`: the context every stage
        on the plan's data path receives with its batch; scoring does not depend on them.)"""
        t0 = time.perf_counter()
        if self._done == self._total:  # no call in flight: a new batch's count
            self._done = self._total = 0
        self._total += len(trajs)
        evaluation = _Evaluation(self, trajs)
        try:
            await evaluation.run()
        finally:
            self._done += len(trajs)
        self._warn(evaluation, step, attempt)
        metrics = reward_metrics(trajs, self.nodes, self.train_node)
        metrics.update({f"timing/reward_{name}_s": end - start for name, (start, end) in evaluation.spans.items()})
        metrics["timing/reward_s"] = time.perf_counter() - t0
        return trajs, metrics

    async def progress(self) -> tuple[int, int, int]:
        """(trajectories scored, trajectories given) of the calls in flight, and node values settled so far:
        the driver's deadline takes a change as a heartbeat, and its display shows the first two."""
        return self._done, self._total, self._settled

    def _warn(self, evaluation: _Evaluation, step: int, attempt: int) -> None:
        """One line per node that had no value somewhere, at most once per sampling round: a step is scored
        in many calls (one per trajectory when they are streamed), and `rewards/<node>/missing` and
        `/errors` count every one."""
        if (step, attempt) != self._warned_round:
            self._warned_round, self._warned = (step, attempt), set()
        turns = sum(len(t.turns) for t in evaluation.trajs)
        for name, errors in evaluation.failed.items():
            # A function that returns None says "no value here" on purpose (a per-turn node on a turn without
            # calls): said once a run, where an error or a bad value is said every step it happens.
            chosen = all(e == NONE_RETURNED for e in errors)
            if name in self._warned or (chosen and name in self._said_none):
                continue
            self._warned.add(name)
            if chosen:
                self._said_none.add(name)
            per_turn = name in self.per_turn
            # (escaped: an error may quote a file name that is not UTF-8, or a tool name json.loads read from the
            # model's "\\ud83d": a lone surrogate, which a UTF-8 stream cannot write)
            log.warning("reward node %s: no value for %d of %d %s (first: %s), in a scoring call of step %d; "
                        "rewards/%s/missing counts all of the step's, which are not logged again%s", name,
                        len(errors), turns if per_turn else len(evaluation.trajs),
                        "trajectories' turns" if per_turn else "trajectories", escaped(errors[0]), step, name,
                        " (nor, in later steps, a None of its function's)" if chosen else "")

    async def close(self) -> None:
        try:
            await self._sessions.aclose()
        finally:  # (a judge session that fails to close leaves no worker process behind)
            for lane in self._lanes.values():
                await lane.close()

    async def call(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Function node `name`'s result, within its `timeout_s`: awaited if it is async, else in a thread of
        the node's own, or in one of its worker processes (factory.reward.lanes: a hung function holds up its
        own node only). Whatever it raises is an Exception, the node's failure (SystemExit from a checker that
        wraps a command line, say, which would end the stage's event loop)."""
        limit, call = self.nodes[name].timeout_s, functools.partial(fn, *args, **kwargs)
        if is_async(fn):
            return await awaited(call, limit)
        started = time.monotonic()
        value = await self._lanes[name].run(call, limit)
        if inspect.isawaitable(value):  # an async function behind a plain decorator: its coroutine, made at once
            # (one timeout_s, all told)
            left = None if limit is None else max(0.0, limit - (time.monotonic() - started))
            return await awaited(lambda: value, left, said=limit)
        return value


def usable(value: float) -> bool:
    """A reward value the update can use: finite as the float32 it becomes there (1e308 is finite here, and
    inf in the advantages, which skipped every update)."""
    return math.isfinite(value) and abs(value) <= FLOAT32_MAX


@dataclass
class _Outcome:
    """A leaf's result for one trajectory before its `on_missing` applies."""

    value: float | None
    status: str = "ok"  # ok | missing | error | parse_failure | non_finite
    detail: dict[str, Any] = field(default_factory=dict)  # reply, error


def _outcome(value: Any) -> _Outcome:
    """What a reward function returned, as an outcome."""
    if value is None:
        return _Outcome(None, "missing", {"error": NONE_RETURNED})
    try:  # a number of any kind (numpy's, a 0-d tensor, a bool), but not a string float() would parse
        if isinstance(value, (str, bytes)):
            raise TypeError
        number = float(value)
    except OverflowError:  # an int past any float (10**400): not finite, as inf is (it escaped a group's call)
        # (its bits, not str(): Python refuses to write an int of over 4,300 digits as text)
        bits = value.bit_length() if isinstance(value, int) else None
        said = f"an integer of {bits:,} bits" if bits else f"{type(value).__name__} too large for a float"
        return _Outcome(None, "non_finite", {"error": f"the value is not finite: {said}"})
    except (TypeError, ValueError):
        return _Outcome(None, "error", {"error": f"returned {str(value)[:40]!r}, not a number"})
    except Exception as e:  # a value whose float() raises of its own (a lazily evaluated score): its failure
        return _failed(e)
    return _Outcome(number)


NONE_RETURNED = "returned None"


def _failed(e: BaseException) -> _Outcome:
    return _Outcome(None, "error", {"error": f"{type(e).__name__}: {e}"[:500]})


class _Evaluation:
    """One `score` call: every (node, trajectory) value as a task, created on first demand and shared by
    all readers (the per-step cache), and what happened to each."""

    def __init__(self, stage: RewardStage, trajs: list[Trajectory]):
        self.s, self.trajs = stage, trajs
        self.tasks: dict[tuple[Any, ...], asyncio.Future] = {}
        self.details: dict[tuple[str, int], dict[str, Any]] = {}
        self.dropped: dict[int, str] = {}
        self.spans: dict[str, tuple[float, float]] = {}  # leaf node -> (first start, last end)
        self.failed: dict[str, list[str]] = {}  # node -> why each of its missing values is missing
        self.groups: dict[int, list[int]] = {}
        for i, t in enumerate(trajs):
            self.groups.setdefault(t.prompt_index, []).append(i)
            if t.stop_reason == "prompt_too_long":  # never generated from (its prompt fills the context): no
                # scoring (a judge would be sent the whole prompt), out of the loss and the means
                self.dropped[i] = "its prompt fills the model's context: nothing was generated"
        # fixed before any node runs, so what reads it (a normalize's population) cannot depend on which of
        # this call's drops happened to land first
        self.scored = tuple(i for i in range(len(trajs)) if i not in self.dropped)

    async def run(self) -> None:
        scored = self.scored
        try:
            await asyncio.gather(*(self.value(n, i) if n not in self.s.per_turn else self.turn_value(n, i, k)
                                   for n in roots(self.s.nodes, self.s.train_node)
                                   for i in scored
                                   for k in ([None] if n not in self.s.per_turn else range(len(self.trajs[i].turns)))))
        finally:  # after a `fail`, nothing may keep running
            pending = [t for t in self.tasks.values() if not t.done()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        self._record()

    # -------------------------------------------------------------------------------------- values
    def _memo(self, key: tuple[Any, ...], make: Callable[[], Awaitable[Any]]) -> asyncio.Future:
        if key not in self.tasks:
            self.tasks[key] = asyncio.ensure_future(make())
        return self.tasks[key]

    def value(self, name: str, i: int) -> asyncio.Future:
        """Node `name`'s value on trajectory i (float, or None: dropped)."""
        return self._memo((name, i), lambda: self._compute(name, i))

    def turn_value(self, name: str, i: int, k: int) -> asyncio.Future:
        """Per-turn node `name`'s value at turn k of trajectory i (float, or None: dropped)."""
        return self._memo((name, i, k), lambda: self._compute_turn(name, i, k))

    def at(self, name: str, i: int, k: int) -> asyncio.Future:
        """Node `name`'s value where turn k of trajectory i reads it: its own at that turn for a per-turn
        node, the trajectory's for a trajectory-level one (the same at every turn)."""
        return self.turn_value(name, i, k) if name in self.s.per_turn else self.value(name, i)

    async def _compute_turn(self, name: str, i: int, k: int) -> float | None:
        node = self.s.nodes[name]
        if isinstance(node, LEAVES):  # a function, judge or tool node with `per: turn`
            return self._settle(name, i, await self._leaf(name, node, i, k), k)
        if isinstance(node, GateNode):  # per turn: the condition decides turn by turn
            condition = await self.at(node.gate, i, k)
            if condition is None:
                return None
            return await self.at(node.then, i, k) if gate_passes(node, condition) else node.otherwise
        return self._combined(name, node, i, list(await asyncio.gather(*(self.at(n, i, k) for n in node_inputs(node)))), k)

    def _combined(self, name: str, node: Any, i: int, values: list[float | None], k: int | None = None) -> float | None:
        if any(v is None for v in values):
            return None
        value = combine(node, values)
        if not usable(value):  # finite inputs, so the weights or the sizes overflow: the spec's to fix
            t = self.trajs[i]
            raise NonFiniteReward(f"reward node '{name}' is {value!r} for trajectory {t.prompt_index}."
                                  f"{t.sample_index}{_turn(k)} from finite inputs {dict(zip(node_inputs(node), values))}: "
                                  "its weights or its inputs' sizes overflow a float32")
        return value

    async def _compute(self, name: str, i: int) -> float | None:
        node = self.s.nodes[name]
        if isinstance(node, LEAVES):
            return self._settle(name, i, await self._leaf(name, node, i))
        if isinstance(node, GateNode):
            condition = await self.value(node.gate, i)
            if condition is None:
                return None
            return await self.value(node.then, i) if gate_passes(node, condition) else node.otherwise
        if isinstance(node, NormalizeNode):
            # Over the members scored (one never generated from is not, nor read by the mean and spread), fixed
            # when scoring began: `self.dropped` grows as drop_sample nodes finish, so a population read from it
            # would differ between members that asked before and after a slow node's drop. A member whose input
            # has no value is left out by `standardize`; one dropped by another node still counts.
            members = self.groups[self.trajs[i].prompt_index] if node.over == "group" else range(len(self.trajs))
            scope = tuple(j for j in members if j in self.scored)
            return (await self._memo((name, scope), lambda: self._normalized(node, scope)))[i]
        return self._combined(name, node, i, list(await asyncio.gather(*(self.value(n, i) for n in node_inputs(node)))))

    async def _normalized(self, node: NormalizeNode, scope: tuple[int, ...]) -> dict[int, float | None]:
        values = await asyncio.gather(*(self.value(node.normalize, j) for j in scope))
        return dict(zip(scope, standardize(list(values))))

    def _settle(self, name: str, i: int, out: _Outcome, k: int | None = None) -> float | None:
        """Record a leaf's outcome (at turn k for a per-turn node) and apply its `on_missing`. A value from outside that is not finite (a
        function's inf or NaN, a judge's `{"score": NaN}`, a tool's "inf") is no value: one such number
        would reach the advantages, then every weight."""
        self.s._settled += 1
        if out.value is not None and not usable(out.value):
            out = _Outcome(None, "non_finite", {**out.detail, "error": f"the value is not finite: {out.value!r}"
                                                + ("" if not math.isfinite(out.value) else
                                                   " in float32, the dtype the update computes advantages in")})
        if out.status != "ok" or out.detail:
            self.details[(name, i) if k is None else (name, i, k)] = {"status": out.status, **out.detail}
        if out.value is not None:
            return out.value
        node = self.s.nodes[name]
        reason = out.status + (f": {out.detail['error']}" if "error" in out.detail else "")
        if node.on_missing == "zero":
            return 0.0
        if node.on_missing == "drop_sample":
            self.dropped.setdefault(i, f"rewards.{name}{_turn(k)}: {reason}")
            return None
        t = self.trajs[i]
        raise MissingReward(f"reward node '{name}' has no value for trajectory {t.prompt_index}.{t.sample_index}"
                            f"{_turn(k)} and its on_missing is 'fail': {reason}")

    # ---------------------------------------------------------------------------------------- leaves
    async def _leaf(self, name: str, node: Any, i: int, k: int | None = None) -> _Outcome:
        start = time.perf_counter()
        try:
            if isinstance(node, FnNode) and k is not None:
                return await self._fn(name, i, k)
            if isinstance(node, FnNode):
                if node.group:
                    pid = self.trajs[i].prompt_index
                    return (await self._memo((name, "group", pid), lambda: self._group_fn(name, pid)))[i]
                return await self._fn(name, i)
            if isinstance(node, JudgeNode):
                return await self._judge(name, node, i, k)
            return await self._tool(name, node, i, k)
        finally:
            first, _ = self.spans.get(name, (start, start))
            self.spans[name] = (min(first, start), time.perf_counter())

    async def _fn(self, name: str, i: int, k: int | None = None) -> _Outcome:
        """A function node's outcome on trajectory i; at its turn k for a per-turn node, called with that
        turn's text as the completion and the turn itself (ours win over row columns of the same name)."""
        fn, wants_turns, takes = self.s._fns[name]
        t = self.trajs[i]
        row = {k: v for k, v in t.row.items() if takes(k)}
        # A copy of its own (`turns.pop()` is a natural way to read the earlier turns): the trajectory's turns are
        # every other node's input and the record the step saves. (About 20 µs a turn; a function call costs more.)
        turns = copy.deepcopy(t.turns) if wants_turns else None
        kwargs = {**row, "turns": turns} if wants_turns else row
        completion = t.completion
        if k is not None:
            turn = turns[k] if turns is not None else copy.deepcopy(t.turns[k])
            kwargs, completion = {**kwargs, "turn": turn, "index": k}, t.turns[k].text
        try:
            return _outcome(await self.s.call(name, fn, prompt_text(t.messages), completion, **kwargs))
        except Exception as e:  # a user's reward function may raise anything
            return _failed(e)

    async def _group_fn(self, name: str, pid: int) -> dict[int, _Outcome]:
        fn, wants_turns, _ = self.s._fns[name]
        # the members scored, as a normalize's population: one never generated from has no completion to rank
        members = [i for i in self.groups[pid] if i in self.scored]
        group = [self.trajs[i] for i in members]
        # (copies of their own, as a trajectory's function gets: each member's turns and row are other nodes' too)
        kwargs = {"turns": copy.deepcopy([t.turns for t in group])} if wants_turns else {}
        try:
            values = await self.s.call(name, fn, [prompt_text(t.messages) for t in group],
                                       [t.completion for t in group], [dict(t.row) for t in group], **kwargs)
            if len(values) != len(group):
                raise ValueError(f"group reward returned {len(values)} values for {len(group)} completions")
            return {i: _outcome(v) for i, v in zip(members, values)}  # (iterating them may raise too)
        except Exception as e:
            return {i: _failed(e) for i in members}

    def _context(self, i: int, k: int | None) -> dict[str, Any]:
        """What a judge's template and a tool's arguments are rendered with: the row, `prompt`, `completion`
        and `turns`; at turn k of a per-turn node, `completion` is that turn's text, with `turn` and `index`."""
        t = self.trajs[i]
        ctx = {**t.row, "prompt": prompt_text(t.messages), "completion": t.completion, "turns": t.turns}
        if k is not None:
            ctx.update(completion=t.turns[k].text, turn=t.turns[k], index=k)
        return ctx

    async def _judge(self, name: str, node: JudgeNode, i: int, k: int | None = None) -> _Outcome:
        try:
            messages = messages_from_text(self.s._templates[name].render(self._context(i, k)))
        except Exception as e:  # a template that reads a column the row lacks, or renders a broken message list
            # (`sent: false`: no request was made, which `rewards/<node>/calls` does not count)
            return _Outcome(None, "error", {"error": f"judge template: {type(e).__name__}: {e}", "sent": False})
        try:
            reply = await self.s._judges[name].reply(messages)
        except Exception as e:
            return _failed(e)
        try:
            return _Outcome(parse_score(reply, node), "ok", {"reply": reply})
        except Exception as e:  # ValueError says why; anything else a reply can provoke is a parse failure too
            why = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {str(e)[:200]}"
            return _Outcome(None, "parse_failure", {"reply": reply, "error": why})

    async def _tool(self, name: str, node: ToolNode, i: int, k: int | None = None) -> _Outcome:
        from factory.tools.recording import reward_origin
        from factory.tools.toolbox import qualified_name

        ctx = self._context(i, k)
        server, _, tool = node.tool.partition(".")
        try:
            arguments = {k: template.render(ctx) for k, template in self.s._templates[name].items()}
        except Exception as e:  # a template that reads a column the row lacks
            return _Outcome(None, "error", {"error": f"tool arguments: {type(e).__name__}: {e}"})
        # `server.tool` names one tool of an MCP server; a bare name is a python tool (named by its key). Named
        # by its trajectory's place in the run, the node and the turn, as a rollout's call is by its episode's:
        # what a replay answers it by, whichever steps are scored and in whatever order (a rescore's)
        call = ToolCall(name=qualified_name(server, tool) if tool else server, raw="", arguments=arguments,
                        origin=reward_origin(self.trajs[i].origin, name, k))
        try:
            result = await self.s._toolbox.call(call)
        except Exception as e:
            return _failed(e)
        if result.status != "ok":
            detail = {"error": f"tool {node.tool}: {result.error_kind}: {result.text[:200]}"}
            if result.status == "infra_error":  # its server failed, not the tool: train.max_infra_error_rate counts it
                detail["infra"] = f"tool {node.tool}: {result.error_kind}"
            return _Outcome(None, "error", detail)
        try:
            return _Outcome(float(result.text.strip()))
        except ValueError:
            return _Outcome(None, "parse_failure",
                            {"reply": result.text[:500], "error": "the tool's text is not a number"})

    # ---------------------------------------------------------------------------------------- record
    def _record(self) -> None:
        for i, t in enumerate(self.trajs):
            t.rewards, t.reward_details, t.turn_rewards, t.turn_reward = {}, {}, {}, []
            for name in self.s.order:
                if name in self.s.per_turn:
                    self._record_turns(name, i, t)
                    continue
                task = self.tasks.get((name, i))
                if task is None:  # a gate did not ask for it here
                    t.rewards[name] = None
                    t.reward_details[name] = {"status": "skipped"}
                    continue
                t.rewards[name] = task.result()
                if (name, i) in self.details:
                    t.reward_details[name] = self.details[(name, i)]
            t.dropped = self.dropped.get(i)
            value = t.rewards[self.s.train_node]
            t.reward = 0.0 if value is None else float(value)
            if self.s.train_node in self.s.per_turn:
                t.turn_reward = [0.0 if v is None else float(v) for v in t.turn_rewards[self.s.train_node]]
        for (name, *_), d in self.details.items():
            if d["status"] != "ok":
                self.failed.setdefault(name, []).append(d.get("error", d["status"]))

    def _record_turns(self, name: str, i: int, t: Trajectory) -> None:
        """A per-turn node's values on trajectory i, turn by turn (None where a gate did not ask for it), its
        trajectory value (the mean over its turns) and, when some turn has something to say, the details of
        every turn."""
        values, details = [], []
        for k in range(len(t.turns)):
            task = self.tasks.get((name, i, k))
            values.append(None if task is None else task.result())
            details.append({"status": "skipped"} if task is None else self.details.get((name, i, k), {}))
        t.turn_rewards[name] = values
        t.rewards[name] = turn_mean(values)
        if any(details):
            first = next(d for d in details if d)
            t.reward_details[name] = {"status": first.get("status", "ok"), "turns": details,
                                      **({"error": first["error"]} if "error" in first else {})}


def _turn(k: int | None) -> str:
    """Where a message about a per-turn value says which turn."""
    return "" if k is None else f" (turn {k})"
