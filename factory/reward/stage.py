"""The reward stage: evaluates the spec's reward graph for every trajectory, in parallel.

Nodes are evaluated in topological order; within a node, all trajectories (or groups) run concurrently
in a thread pool (python functions, judge HTTP calls) or on the event loop (async functions, tool calls).
A node that raises for one trajectory gives None there and counts an error; the run goes on.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from factory.reward.graph import combine, prompt_text, topological_order, training_node
from factory.schema import FnNode, JudgeNode, Spec, ToolNode
from factory.types import ToolCall, Trajectory
from factory.util import enter_workdir, import_path, resolve_file, template_env

log = logging.getLogger(__name__)


class RewardStage:
    """The reward actor: scores trajectories. Its methods are coroutines, so Ray runs it as an async
    actor with one event loop for its life: tool servers for tool nodes start once and stay up."""

    def __init__(self, spec: Spec, *, base_dir: str | Path | None = None, workdir: str | None = None,
                 max_workers: int = 16):
        self._spec, self._workdir, self._max_workers = spec, workdir, max_workers
        self._base_dir = Path(base_dir) if base_dir else None
        self.order = topological_order(spec.rewards)
        self.train_node = training_node(spec)

    def setup(self) -> None:
        # In its own actor, so slow or crashing reward code never stalls rollout.
        enter_workdir(self._workdir)
        self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix="reward")
        self._toolbox_started = False
        self._fns: dict[str, Callable[..., Any]] = {}
        self._judges: dict[str, Any] = {}
        env = template_env()
        for name, node in self._spec.rewards.items():
            if isinstance(node, FnNode):
                self._fns[name] = functools.partial(import_path(node.fn), **node.args)
            elif isinstance(node, JudgeNode):
                self._judges[name] = env.from_string(resolve_file(node.llm_judge, self._base_dir).read_text())
        self._toolbox = None
        if any(isinstance(n, ToolNode) for n in self._spec.rewards.values()):
            from factory.tools import ToolBox

            self._toolbox = ToolBox.from_spec(self._spec.tools, base_dir=self._base_dir)

    async def score(self, trajs: list[Trajectory]) -> tuple[list[Trajectory], dict[str, float]]:
        """Fill `rewards` and `reward` of every trajectory; return them with the stage's metrics."""
        t0 = time.perf_counter()
        if self._toolbox is not None and not self._toolbox_started:
            await self._toolbox.start()
            self._toolbox_started = True
        metrics: dict[str, float] = {}
        for name in self.order:
            node = self._spec.rewards[name]
            t_node = time.perf_counter()
            values, errors = await self._eval_node(name, node, trajs)
            for traj, v in zip(trajs, values):
                traj.rewards[name] = v
            present = [v for v in values if v is not None]
            metrics[f"rewards/{name}/mean"] = sum(present) / len(present) if present else float("nan")
            metrics[f"rewards/{name}/errors"] = float(errors)
            metrics[f"timing/reward_{name}_s"] = time.perf_counter() - t_node
        for traj in trajs:
            value = traj.rewards.get(self.train_node)
            traj.reward = 0.0 if value is None or math.isnan(value) else float(value)
        metrics["reward/mean"] = sum(t.reward for t in trajs) / max(1, len(trajs))
        metrics["timing/reward_s"] = time.perf_counter() - t0
        return trajs, metrics

    async def _eval_node(self, name: str, node: Any, trajs: list[Trajectory]) -> tuple[list[float | None], int]:
        if not isinstance(node, (FnNode, JudgeNode, ToolNode)):
            return [combine(node, t.rewards) for t in trajs], 0
        if isinstance(node, FnNode) and node.group:
            groups: dict[int, list[int]] = {}
            for i, t in enumerate(trajs):
                groups.setdefault(t.prompt_index, []).append(i)
            calls = [self._call(name, self._group_call, name, [trajs[i] for i in idx]) for idx in groups.values()]
            results = await asyncio.gather(*calls)
            values: list[float | None] = [None] * len(trajs)
            errors = 0
            for idx, (vals, err) in zip(groups.values(), results):
                errors += err
                for i, v in zip(idx, vals if vals is not None else [None] * len(idx)):
                    values[i] = v
            return values, errors
        fn = {FnNode: self._fn_call, JudgeNode: self._judge_call, ToolNode: self._tool_call}[type(node)]
        results = await asyncio.gather(*(self._call(name, fn, name, t) for t in trajs))
        return [v for v, _ in results], sum(e for _, e in results)

    async def _call(self, name: str, fn: Callable[..., Any], *args: Any) -> tuple[Any, int]:
        """Run one reward evaluation; a failure is logged and counted, never raised."""
        try:
            return await fn(*args), 0
        except Exception as e:  # a user's reward function may raise anything
            log.warning("reward node %s failed: %s: %s", name, type(e).__name__, e)
            return None, 1

    async def _run_sync(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    async def _fn_call(self, name: str, t: Trajectory) -> float | None:
        value = await self._run_sync(self._fns[name], prompt_text(t.messages), t.completion, **t.row)
        return None if value is None else float(value)

    async def _group_call(self, name: str, group: list[Trajectory]) -> list[float | None]:
        values = await self._run_sync(self._fns[name], [prompt_text(t.messages) for t in group],
                                      [t.completion for t in group], [t.row for t in group])
        if len(values) != len(group):
            raise ValueError(f"group reward returned {len(values)} values for {len(group)} completions")
        return [None if v is None else float(v) for v in values]

    async def _judge_call(self, name: str, t: Trajectory) -> float | None:
        node: JudgeNode = self._spec.rewards[name]  # type: ignore[assignment]
        prompt = self._judges[name].render(prompt=prompt_text(t.messages), completion=t.completion, **t.row)
        text = await self._run_sync(_openai_chat, node.endpoint, node.model, prompt)
        found = re.search(node.parse, text)
        return float(found.group(1)) if found else None

    async def _tool_call(self, name: str, t: Trajectory) -> float | None:
        node: ToolNode = self._spec.rewards[name]  # type: ignore[assignment]
        env = template_env()
        ctx = {"prompt": prompt_text(t.messages), "completion": t.completion, **t.row}
        args = {k: env.from_string(v).render(**ctx) for k, v in node.arguments.items()}
        from factory.tools.toolbox import qualified_name

        server, _, tool = node.tool.partition(".")
        # `server.tool` names one tool of an MCP server; a bare name is a python tool (named by its key)
        name = qualified_name(server, tool) if tool else server
        result = await self._toolbox.call(ToolCall(name=name, arguments=args, raw=""))
        if result.status != "ok":
            raise RuntimeError(f"tool {node.tool}: {result.error_kind}: {result.text[:200]}")
        return float(result.text.strip())

    async def close(self) -> None:
        if self._toolbox is not None and self._toolbox_started:
            await self._toolbox.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _openai_chat(endpoint: str, model: str | None, prompt: str, timeout_s: float = 60.0) -> str:
    """One chat completion from an OpenAI-compatible server (vLLM, SGLang, a hosted API)."""
    import os

    import requests

    headers = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"} if "OPENAI_API_KEY" in os.environ else {}
    resp = requests.post(endpoint.rstrip("/") + "/chat/completions", timeout=timeout_s, headers=headers,
                         json={"model": model or "default", "temperature": 0.0,
                               "messages": [{"role": "user", "content": prompt}]})
    resp.raise_for_status()
    return resp.json()["choices"][0]["message"]["content"]
