"""Some of a plan's stages in this process, without Ray: what `factory rescore` (the scoring stage and its
tool servers) and the agent server (the rollout stage and its tools) run.

The same classes the driver places, constructed with the same slices, set up in the same order (callees
before their callers) and wired the same way (each caller gets its callees by the roles of its call
edges); a callee that must run elsewhere (a judge model on its GPU) is handed in as a Ray actor handle.
A tools stage here records no tool calls: only a run's driver takes them, for its tables.
"""
from __future__ import annotations

import contextlib
import graphlib
import inspect
import os
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

from factory.contract import StageActor, peers_of
from factory.plan import Plan
from factory.runtime.health import StageStartError
from factory.types import Placement
from factory.util import UserError, import_object


def callees(plan: Plan, caller: str) -> list[str]:
    """The stages `caller` calls along the plan's call edges, in the plan's order."""
    called = {e.dst for e in plan.edges if e.kind == "call" and e.src == caller and e.method}
    return [s.name for s in plan.stages if s.name in called]


def runs_inline(plan: Plan, name: str) -> bool:
    """Whether the stage declares that it may serve its callers from inside their process."""
    return import_object(plan.stage(name).cls).CONTRACT.inline


def records_tools(plan: Plan, name: str) -> bool:
    """Whether the stage answers tool calls, and so keeps what a replay could not answer (`take_recording`)."""
    return import_object(plan.stage(name).cls).CONTRACT.records_tools


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


@contextlib.asynccontextmanager
async def local_stages(plan: Plan, names: Iterable[str],
                       remote: Mapping[str, Any] | None = None) -> AsyncIterator[dict[str, StageActor]]:
    """The stages `names` of `plan`, constructed here and set up, callees first, each handed its peers by
    role (the stages here, or `remote`: stage name -> Ray actor handle); yields them by name and closes
    every one on the way out (also those set up before one whose setup failed)."""
    names = list(names)
    remote = dict(remote or {})
    calls = [e for e in plan.edges if e.kind == "call" and e.method]
    order = graphlib.TopologicalSorter({n: {e.dst for e in calls if e.src == n and e.dst in names} for n in names})
    stages: dict[str, StageActor] = {}
    async with contextlib.AsyncExitStack() as stack:
        for name in order.static_order():
            s, cls = plan.stage(name), import_object(plan.stage(name).cls)
            # no driver here takes a tools stage's recording (its `take_recording`): it would only pile up
            # every call's whole result for nobody
            settings = s.settings.model_copy(update={"record": False}) if cls.CONTRACT.records_tools else s.settings
            stage = cls(settings)
            stack.push_async_callback(_maybe_await_close, stage)
            try:
                await _maybe_await(stage.setup(Placement(workdir=os.getcwd(),
                                                         peers=peers_of(calls, name, {**remote, **stages}))))
            except UserError:
                raise  # bad input (exit 2), as the driver passes it on
            except Exception as e:
                # as `factory run` says it (factory.runtime.driver.start_error), exit 3: a tool server that would
                # not start was an internal error of `factory rescore` (exit 1, "rerun with FACTORY_DEBUG=1")
                raise StageStartError(f"stage '{name}' did not start: {type(e).__name__}: {e}") from e
            stages[name] = stage
        yield stages


async def _maybe_await_close(stage: StageActor) -> None:
    await _maybe_await(stage.close())
