"""The rollout stage: the generation engine, the chat format and the tool pool in one actor.

A plain class (the constructor has no side effects; `setup()` does the heavy work), so tests can use it
in-process; the driver wraps it with `ray.remote`.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from factory.device import stage_device
from factory.schema import Spec
from factory.types import ToolCall, ToolResult, Trajectory
from factory.util import enter_workdir, set_threads


class BusyClock:
    """Splits rollout wall time into generate / tools-only / idle by counting what is in flight.

    Generation and tool calls of different trajectories overlap; time with a generation in flight counts
    as generate, time with only tool calls in flight counts as tools, so the parts add up to wall time.
    """

    def __init__(self) -> None:
        self.inflight = {"generate": 0, "tools": 0}
        self.total = {"generate": 0.0, "tools": 0.0, "idle": 0.0}
        self._last = time.perf_counter()

    def _tick(self) -> None:
        now = time.perf_counter()
        kind = "generate" if self.inflight["generate"] else "tools" if self.inflight["tools"] else "idle"
        self.total[kind] += now - self._last
        self._last = now

    def enter(self, kind: str) -> None:
        self._tick()
        self.inflight[kind] += 1

    def exit(self, kind: str) -> None:
        self._tick()
        self.inflight[kind] -= 1

    def read(self) -> dict[str, float]:
        self._tick()
        return dict(self.total)


class _Timed:
    """Wraps the engine and the toolbox so every call is seen by the BusyClock."""

    def __init__(self, inner: Any, clock: BusyClock, kind: str):
        self._inner, self._clock, self._kind = inner, clock, kind

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        self._clock.enter(self._kind)
        try:
            return await self._inner.generate(*args, **kwargs)
        finally:
            self._clock.exit(self._kind)

    async def call(self, call: ToolCall) -> ToolResult:
        self._clock.enter(self._kind)
        try:
            return await self._inner.call(call)
        finally:
            self._clock.exit(self._kind)


def rollout_dtype(spec: Spec) -> str:
    """The rollout engine's weight dtype (see RolloutSpec.dtype): `auto` asks the rollout's device."""
    from factory.device import auto_dtype, stage_device

    if spec.rollout.dtype != "auto":
        return spec.rollout.dtype
    return auto_dtype(stage_device(spec.resources.rollout.num_gpus), want_bf16=spec.train.bf16_autocast,
                      weights=spec.model.dtype)


class RolloutStage:
    """The rollout actor: the generation engine, the chat format and the tool pool, all living in this
    actor's event loop (Ray runs async actor methods on one loop, which the MCP sessions need)."""

    def __init__(self, spec: Spec, model_path: str, *, base_dir: str | None = None, workdir: str | None = None):
        self.spec, self.model_path, self.base_dir, self.workdir = spec, model_path, base_dir, workdir
        self._done, self._total = 0, 0  # trajectories of the generate call in progress

    async def setup(self) -> dict[str, Any]:
        enter_workdir(self.workdir)
        set_threads(self.spec.train.threads)
        from transformers import AutoTokenizer

        from factory.rollout.chat import ChatFormat
        from factory.rollout.engine import make_engine
        from factory.tools import ToolBox
        from factory.util import resolve_file

        base = Path(self.base_dir) if self.base_dir else None
        tokenizer = AutoTokenizer.from_pretrained(self.spec.model.tokenizer or self.model_path)
        template = (resolve_file(self.spec.chat_template, base).read_text() if self.spec.chat_template else None)
        self.chat = ChatFormat(tokenizer, template)
        self.tokenizer = tokenizer
        device, dtype = stage_device(self.spec.resources.rollout.num_gpus), rollout_dtype(self.spec)
        self.engine = make_engine(self.spec.rollout, self.model_path, device=device, dtype=dtype, seed=self.spec.seed,
                                  stop_token_ids=self.chat.stop_token_ids, threads=self.spec.train.threads)
        self.toolbox = ToolBox.from_spec(self.spec.tools, base_dir=base)
        await self.toolbox.start()
        resolved = {"engine": self.engine.name, "device": device, "dtype": dtype}
        if self.engine.fallback_reason:
            resolved["engine_fallback"] = self.engine.fallback_reason
        return {"tools": [s["function"]["name"] for s in self.toolbox.schemas()], "resolved": resolved}

    async def generate(self, batch: pa.Table, *, group_size: int, greedy: bool = False, step: int = 0,
                       attempt: int = 0) -> tuple[list[Trajectory], dict[str, float]]:
        """Trajectories for a batch of prompts. Sampled requests are seeded from (seed, step, attempt,
        prompt, sample, turn), so a resumed run samples what the uninterrupted run would have."""
        from factory.data import from_table
        from factory.rollout.agent import rollout
        from factory.rollout.engine import Sampling

        r = self.spec.rollout
        sampling = Sampling(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, greedy=greedy)
        clock = BusyClock()
        batches_before = self.engine.batches_run
        t0 = time.perf_counter()
        self.toolbox.metrics(reset=True)
        prompts = from_table(batch)
        self._done, self._total = 0, len(prompts) * group_size
        trajs = await rollout(_Timed(self.engine, clock, "generate"), self.chat, _Timed(self.toolbox, clock, "tools"),
                              prompts, group_size=group_size, cfg=r, sampling=sampling, on_done=self._count,
                              seed_key=(self.spec.seed, step, attempt))
        wall = time.perf_counter() - t0
        busy = clock.read()
        metrics = {
            # tools_only: time with tool calls in flight and no generation (tool time hidden behind
            # generation is not in it: that is the point of overlapping them)
            "timing/rollout_s": wall, "timing/generate_s": busy["generate"], "timing/tools_only_s": busy["tools"],
            "response_length/mean": statistics.fmean(t.num_model_tokens for t in trajs),
            "num_turns/mean": statistics.fmean(len(t.turns) for t in trajs),
            "tool_calls/mean": statistics.fmean(t.num_tool_calls for t in trajs),
            "rollout/infra_error_trajectories": float(sum(t.infra_error for t in trajs)),
            "rollout/truncated": float(sum(t.truncated for t in trajs)),
            "rollout/engine_batches": float(self.engine.batches_run - batches_before),
            "perf/generate_tokens_per_s": sum(t.num_model_tokens for t in trajs) / max(busy["generate"], 1e-9),
            **{f"rollout/stop_{k}": float(sum(t.stop_reason == k for t in trajs)) for k in ("no_call", "max_turns", "budget")},
            **self.toolbox.metrics(reset=True),
        }
        return trajs, metrics

    def _count(self, _: Trajectory) -> None:
        self._done += 1

    async def progress(self) -> tuple[int, int]:
        """(trajectories done, trajectories asked) of the current `generate` call. Ray runs an async
        actor's calls on one event loop, so the driver can poll this while `generate` awaits."""
        return self._done, self._total

    async def tool_listing(self) -> dict[str, list[dict[str, Any]]]:
        """server -> [{name, offered_as, description, inputSchema}] of the tools offered to the model, as the
        started servers list them (what the run's tool-schema hash is computed from)."""
        return self.toolbox.tool_listing()

    def load_weights(self, state_dict: dict[str, Any]) -> float:
        t0 = time.perf_counter()
        self.engine.load_weights(state_dict)
        return time.perf_counter() - t0

    async def close(self) -> None:
        await self.toolbox.close()
