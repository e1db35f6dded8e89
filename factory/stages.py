"""Stage classes that the driver places on Ray as actors.

Each is a plain class (constructors have no side effects; `setup()` does the heavy work), so tests can
use them in-process; the driver wraps them with `ray.remote`.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from factory.spec.schema import Spec
from factory.types import ToolCall, ToolResult, Trajectory


def enter_workdir(workdir: str | None, threads: int | None) -> None:
    """Make a stage process look like the driver: same working directory (user modules such as
    `rewards.*` import from it) and an explicit torch thread count (oversubscription on small CPU boxes
    made steps 10-30x slower)."""
    if workdir:
        os.chdir(workdir)
        if workdir not in sys.path:
            sys.path.insert(0, workdir)
    import torch

    torch.set_num_threads(threads or os.cpu_count() or 1)


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
    """The rollout engine's weight dtype (see RolloutSpec.dtype)."""
    if spec.rollout.dtype != "auto":
        return spec.rollout.dtype
    return "bfloat16" if spec.train.bf16_autocast else spec.model.dtype


class RolloutStage:
    """The rollout actor: the generation engine, the chat format and the tool pool, all living in this
    actor's event loop (Ray runs async actor methods on one loop, which the MCP sessions need)."""

    def __init__(self, spec: Spec, model_path: str, *, base_dir: str | None = None, workdir: str | None = None):
        self.spec, self.model_path, self.base_dir, self.workdir = spec, model_path, base_dir, workdir

    async def setup(self) -> dict[str, Any]:
        enter_workdir(self.workdir, self.spec.train.threads)
        from transformers import AutoTokenizer

        from factory.rollout.chat import ChatFormat
        from factory.rollout.engine import HFEngine
        from factory.tools import ToolBox
        from factory.util import resolve_file

        base = Path(self.base_dir) if self.base_dir else None
        tokenizer = AutoTokenizer.from_pretrained(self.spec.model.tokenizer or self.model_path)
        template = (resolve_file(self.spec.chat_template, base).read_text() if self.spec.chat_template else None)
        self.chat = ChatFormat(tokenizer, template)
        self.tokenizer = tokenizer
        if self.spec.rollout.engine != "hf":
            raise ValueError(f"rollout.engine '{self.spec.rollout.engine}' is not available in this build; use hf")
        self.engine = HFEngine(self.model_path, dtype=rollout_dtype(self.spec), batch_size=self.spec.rollout.batch_size,
                               seed=self.spec.seed, bf16_autocast=rollout_dtype(self.spec) == "float32" and self.spec.train.bf16_autocast,
                               stop_token_ids=self.chat.stop_token_ids)
        self.toolbox = ToolBox.from_spec(self.spec.tools, base_dir=base)
        await self.toolbox.start()
        return {"tools": [s["function"]["name"] for s in self.toolbox.schemas()]}

    async def generate(self, batch: pa.Table, *, group_size: int, greedy: bool = False) -> tuple[list[Trajectory], dict[str, float]]:
        from factory.data import from_table
        from factory.rollout.agent import rollout
        from factory.rollout.engine import Sampling

        r = self.spec.rollout
        sampling = Sampling(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, greedy=greedy)
        clock = BusyClock()
        batches_before = self.engine.batches_run
        t0 = time.perf_counter()
        self.toolbox.metrics(reset=True)
        trajs = await rollout(_Timed(self.engine, clock, "generate"), self.chat, _Timed(self.toolbox, clock, "tools"),
                              from_table(batch), group_size=group_size, cfg=r, sampling=sampling)
        wall = time.perf_counter() - t0
        busy = clock.read()
        metrics = {
            "timing/rollout_s": wall, "timing/generate_s": busy["generate"], "timing/tools_s": busy["tools"],
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

    def load_weights(self, state_dict: dict[str, Any]) -> float:
        t0 = time.perf_counter()
        self.engine.load_state_dict(state_dict)
        return time.perf_counter() - t0

    async def close(self) -> None:
        await self.toolbox.close()


class RewardActor:
    """The reward stage in its own process, so slow or crashing reward code never stalls rollout."""

    def __init__(self, spec: Spec, *, base_dir: str | None = None, workdir: str | None = None):
        self.spec, self.base_dir, self.workdir = spec, base_dir, workdir

    def setup(self) -> None:
        enter_workdir(self.workdir, 1)
        from factory.reward import RewardStage

        self.stage = RewardStage(self.spec, base_dir=Path(self.base_dir) if self.base_dir else None)
        self.stage.setup()

    def score(self, trajs: list[Trajectory]) -> tuple[list[Trajectory], dict[str, float]]:
        return self.stage.score(trajs)

    def close(self) -> None:
        self.stage.close()


class UpdateActor:
    """The learner (a DeepSpeed engine) in its own process."""

    def __init__(self, spec: Spec, model_path: str, *, workdir: str | None = None):
        self.spec, self.model_path, self.workdir = spec, model_path, workdir

    def setup(self) -> None:
        enter_workdir(self.workdir, self.spec.train.threads)
        from factory.update import Learner

        self.learner = Learner(self.spec, self.model_path)
        self.learner.setup()

    def step(self, trajs: list[Trajectory]) -> dict[str, float]:
        t0 = time.perf_counter()
        stats = self.learner.step(trajs)
        stats["timing/update_s"] = time.perf_counter() - t0
        return stats

    def state_dict(self) -> dict[str, Any]:
        return self.learner.state_dict()

    def save_checkpoint(self, directory: str, step: int) -> str:
        return self.learner.save_checkpoint(directory, step)

    def load_checkpoint(self, directory: str) -> int | None:
        return self.learner.load_checkpoint(directory)

    def shutdown(self) -> None:
        self.learner.shutdown()
