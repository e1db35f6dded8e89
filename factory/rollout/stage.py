"""The rollout stage: the generation engine and the chat format in one actor, calling the tools stage.

A plain class (the constructor has no side effects; `setup()` does the heavy work), so tests can use it
in-process; the driver wraps it with `ray.remote`, once per replica.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import statistics
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from factory.allocator import running_allocator
from factory.assets import context_tokens
from factory.contract import Call, Contract, StageActor
from factory.device import resolve_dtype
from factory.plan import RolloutSettings, StreamPart
from factory.tools.metrics import ToolMetrics
from factory.types import Placement, ToolCall, ToolResult, Trajectory
from factory.util import enter_workdir, node_id, set_threads

log = logging.getLogger(__name__)


def shortest(*limits: int | None) -> int | None:
    """The smallest of the limits given (None: no limit)."""
    return min((n for n in limits if n is not None), default=None)


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

    async def call(self, call: ToolCall, expired: bool = False) -> ToolResult:
        self._clock.enter(self._kind)
        try:
            return await (self._inner.call(call, expired=True) if expired else self._inner.call(call))
        finally:
            self._clock.exit(self._kind)


@dataclass
class RolloutPart:
    """One replica's answer to a batch: its trajectories and what it measured, merged over replicas by
    `RolloutStage.merge` (each field says how)."""

    trajs: list[Trajectory]
    busy: dict[str, float]  # generate / tools / idle split of this replica's wall time
    wall_s: float
    engine_batches: int
    tools: ToolMetrics  # this replica's tool calls (added up over replicas)


class RolloutStage(StageActor):
    """The rollout actor: one generation engine and the chat format, calling the tools stage for tool
    calls. The engine lives in this actor's event loop (Ray runs async actor methods on one loop).

    Worker group: `replicas` of these share a step. `generate` and `evaluate` take a batch that the driver
    cuts with `split` (contiguous prompts, one part per replica) and answer parts that `merge` joins; each
    has a streamed form (`generate_parts`, `evaluate_parts`) that yields each trajectory as it ends, or each
    prompt's group once its last sample ends, as the stream edge says (`Edge.stream`), then the answer.
    `load_weights`, `load_adapters` (and close) reach every replica."""

    CONTRACT = Contract(calls={"generate": Call("split", stream="generate_parts"),
                               "evaluate": Call("split", stream="evaluate_parts"),
                               "load_weights": Call("all"), "load_adapters": Call("all")}, progress=True)

    def __init__(self, settings: RolloutSettings):
        self.settings = settings
        self.engine: Any = None  # made in setup
        self.dtype = "float32"  # the engine's, resolved in setup
        self.sleeps = False  # vLLM sleeps after each training rollout (rollout.vllm_sleep), decided in setup
        self._done, self._total = 0, 0  # trajectories of the generate call in progress
        # tool-server events (restarts, circuit opens, cache hits) heard outside a training rollout: between
        # batches, or in an evaluation, whose tool metrics are not logged; the next training rollout's carry them
        self._carried = ToolMetrics()

    async def setup(self, placement: Placement | None = None) -> dict[str, Any]:
        placement = placement or Placement()
        s = self.settings
        enter_workdir(placement.workdir)
        set_threads(s.threads)
        from transformers import AutoTokenizer

        from factory.assets import resolve_model
        from factory.rollout.chat import ChatFormat
        from factory.rollout.engine import gpu_share, make_engine, model_eos
        from factory.tools.client import ToolsClient
        from factory.util import resolve_file

        model_path = resolve_model(s.model.path)
        tokenizer = AutoTokenizer.from_pretrained(resolve_model(s.model.tokenizer or model_path))
        template = (resolve_file(s.chat_template, Path(s.base_dir)).read_text() if s.chat_template else None)
        self.tools = ToolsClient(placement.peers[s.tool_peer] if s.tool_peer else None)
        await self.tools.start()
        # by the tools the servers list, which the prompts are rendered with (none: `tools=None`, for which
        # apply_chat_template picks a tokenizer's `default` template, not `tool_use`), not by the spec's servers
        self.chat = ChatFormat(tokenizer, template, s.chat_template_kwargs, tools=bool(self.tools.schemas()))
        if problem := self.chat.end_of_turn_problem():
            log.warning("rollout: %s", problem)
        self.tokenizer = tokenizer
        device, dtype = s.compute.device, resolve_dtype(s.compute)
        self.dtype = dtype
        if s.endpoint:  # a served model (factory eval --model URL): nothing is loaded here
            from factory.rollout.engine_endpoint import EndpointEngine

            # the local engines' stop set (the chat's and the model's eos): with the chat's alone a turn that
            # ended at the model's eos got a second stop token, and the eos stayed in the text the reward reads
            stops = sorted({*self.chat.stop_token_ids, *model_eos(model_path)})
            self.engine = EndpointEngine(s.endpoint, tokenizer, stops, self.chat.end_of_turn_id)
        else:
            self.engine = make_engine(s.rollout, model_path, device=device, dtype=dtype, seed=s.seed,
                                      stop_token_ids=self.chat.stop_token_ids, threads=s.threads,
                                      gpus=max(1, int(s.num_gpus)), gpu_share=gpu_share(s.num_gpus), lora=s.model.lora,
                                      run_tokens=s.run_tokens)
        # the spec's limit, else the model's context; or vLLM's where shorter (a served model's is the server's to
        # enforce). The spec's may exceed the config's where the compiler let it (rope scaling,
        # VLLM_ALLOW_LONG_MAX_MODEL_LEN): the engine runs that long, so the rollout does too
        model_context = context_tokens(model_path)
        self.context = None if s.endpoint else shortest(s.rollout.max_model_len or model_context,
                                                        self.engine.max_model_len)
        if s.rollout.max_model_len is None and self.context is not None and self.context < (model_context or 0):
            log.warning("rollout: sequences of at most %d tokens, vLLM's limit here (what rollout.kv_cache_gb=%g holds, "
                        "or a limit of the model's own config; its context is %d): raise kv_cache_gb for longer "
                        "ones, or set rollout.max_model_len",
                        self.context, s.rollout.kv_cache_gb, model_context)
        resolved = {"engine": self.engine.name, "device": device, "dtype": dtype,
                    "weight_sync": self.engine.weight_sync, "allocator": running_allocator()}
        if self.context is not None:  # (a served model's is the server's)
            resolved["max_model_len"] = self.context
        if self.engine.name == "vllm":
            resolved["vllm_compiled"] = self.engine.compiled
        # (vLLM only: `engine: auto` may have taken transformers, which the run's start says)
        self.sleeps = s.rollout.vllm_sleep and self.engine.name == "vllm"
        if self.sleeps:
            resolved["vllm_sleep"] = True
        if self.engine.fallback_reason:
            resolved["engine_fallback"] = self.engine.fallback_reason
        if self.engine.choice_reason:  # `auto` weighed vLLM's start-up against its saving
            resolved["engine_reason"] = self.engine.choice_reason
        return {"node": node_id(), "tools": [t["function"]["name"] for t in self.tools.schemas()], "resolved": resolved}

    async def generate(self, batch: pa.Table, first_index: int = 0, *, step: int = 0, attempt: int = 0) -> RolloutPart:
        """`group_size` trajectories per prompt of `batch`, whose prompts are numbered from `first_index`
        (its place in the step's batch). Sampled requests are seeded from (seed, step, attempt, prompt,
        sample, turn), so a resumed run samples what the uninterrupted run would have, and the samples do
        not depend on how many replicas share the batch."""
        return await _last(self.generate_parts(batch, first_index, step=step, attempt=attempt))

    async def evaluate(self, batch: pa.Table, first_index: int = 0, *, step: int = 0) -> RolloutPart:
        """One trajectory per held-out prompt: greedy, or sampled at `rollout.eval_temperature`."""
        return await _last(self.evaluate_parts(batch, first_index, step=step))

    async def generate_parts(self, batch: pa.Table, first_index: int = 0, *, step: int = 0, attempt: int = 0,
                             part: StreamPart = "group") -> AsyncIterator[int | list[Trajectory] | RolloutPart]:
        """`generate`, streamed (factory.contract.Call.stream): first the number of parts that follow, then
        each part as soon as it is done, in the order they finish -- with `part="trajectory"` each
        trajectory as it ends (a list of one), with "group" each prompt's group once its last sample ends --
        and last the RolloutPart `generate` answers."""
        async for item in self._run(batch, first_index, self.settings.rollout.group_size, part, evaluation=False,
                                    seed_key=(self.settings.seed, step, attempt), origin=f"train/{step}/{attempt}"):
            yield item

    async def evaluate_parts(self, batch: pa.Table, first_index: int = 0, *, step: int = 0,
                             part: StreamPart = "group") -> AsyncIterator[int | list[Trajectory] | RolloutPart]:
        """`evaluate`, streamed as `generate_parts` streams `generate`."""
        # seeded apart from training's (seed, step, attempt) keys, where evaluation samples
        async for item in self._run(batch, first_index, 1, part, evaluation=True, seed_key=(self.settings.seed, step, -1),
                                    origin=f"eval/{step}/0"):
            yield item

    async def _run(self, batch: pa.Table, first_index: int, group_size: int, part: StreamPart, *, evaluation: bool,
                   seed_key: tuple[int, ...], origin: str) -> AsyncIterator[int | list[Trajectory] | RolloutPart]:
        from factory.data import from_table
        from factory.rollout.agent import rollout, sampling_from_spec

        clock = BusyClock()
        batches_before = self.engine.batches_run
        t0 = time.perf_counter()
        self._carry(await self.tools.take_metrics())  # start this batch's count; server events are kept
        prompts = from_table(batch)
        self._done, self._total = 0, len(prompts) * group_size
        finished: asyncio.Queue[Trajectory | None] = asyncio.Queue()
        task = asyncio.ensure_future(rollout(
            _Timed(self.engine, clock, "generate"), self.chat, _Timed(self.tools, clock, "tools"), prompts,
            group_size=group_size, cfg=self.settings.rollout, sampling=sampling_from_spec(self.settings.rollout, evaluation=evaluation),
            on_done=finished.put_nowait, seed_key=seed_key, first_index=first_index, origin=origin,
            context=self.context))
        task.add_done_callback(lambda _: finished.put_nowait(None))  # ended (or failed): wake the reader
        # one group or trajectory at a time (`size` of them per part), announced first: the driver never
        # reads the parts (they stay in Ray's object store), so it learns here when the answer comes
        size = group_size if part == "group" else 1
        try:
            yield len(prompts) * group_size // size
            groups: dict[int, list[Trajectory]] = defaultdict(list)
            while (t := await finished.get()) is not None:
                self._done += 1
                groups[t.prompt_index].append(t)
                if len(groups[t.prompt_index]) == size:
                    yield sorted(groups.pop(t.prompt_index), key=lambda t: t.sample_index)
            trajs = task.result()  # raises what the rollout raised
        finally:  # a consumer that stops early (or a failure) leaves nothing running
            task.cancel()
        if not evaluation and self.sleeps:  # the update comes next: its GPU gets vLLM's memory until the weight sync
            await self.engine.sleep()
        metrics = await self.tools.take_metrics()
        if evaluation:  # its events go with the next training rollout's
            self._carry(metrics)
        else:
            metrics.add(self._carried)
            self._carried = ToolMetrics()
        yield RolloutPart(trajs, clock.read(), time.perf_counter() - t0, self.engine.batches_run - batches_before,
                          metrics)

    def _carry(self, taken: ToolMetrics) -> None:
        """Keep the server's health events of `taken` (restarts, circuit opens: not its calls, nor the cache's
        hits and misses, which count a rollout's calls as `tools/*` does) for the next training rollout's
        metrics."""
        for server, events in taken.take_server_events().items():
            for event, count in events.items():
                if event in ("restarts", "circuit_opens"):
                    self._carried.server_event(server, event, count)

    async def progress(self) -> tuple[int, int, int]:
        """(trajectories done, trajectories asked) of the current `generate` call, and the engine's forward
        steps so far: a batch of long first turns ends no trajectory for minutes on a busy CPU, but each of
        its decoding steps shows that the engine works. Ray runs an async actor's calls on one event loop,
        so the driver can poll this while `generate` awaits."""
        return self._done, self._total, self.engine.forward_steps

    @staticmethod
    def split(batch: pa.Table, replicas: int) -> list[tuple[pa.Table, int]]:
        """(part, number of its first prompt) for each replica that gets prompts, in order."""
        n = batch.num_rows
        bounds = [n * i // replicas for i in range(replicas + 1)]
        return [(batch.slice(lo, hi - lo), lo) for lo, hi in itertools.pairwise(bounds) if hi > lo]

    @staticmethod
    def merge(parts: list[RolloutPart]) -> tuple[list[Trajectory], dict[str, float]]:
        """All replicas' trajectories in prompt order, and the step's rollout metrics: counts add up,
        means are over all trajectories, and the time split is the slowest replica's (the step waits
        for it)."""
        trajs = [t for p in parts for t in p.trajs]
        slowest = max(parts, key=lambda p: p.wall_s)
        tools = ToolMetrics()
        for p in parts:
            tools.add(p.tools)
        return trajs, {
            # tools_only: time with tool calls in flight and no generation (tool time hidden behind
            # generation is not in it: that is the point of overlapping them)
            "timing/rollout_s": slowest.wall_s, "timing/generate_s": slowest.busy["generate"],
            "timing/tools_only_s": slowest.busy["tools"],
            "response_length/mean": statistics.fmean(t.num_model_tokens for t in trajs),
            "num_turns/mean": statistics.fmean(len(t.turns) for t in trajs),
            "tool_calls/mean": statistics.fmean(t.num_tool_calls for t in trajs),
            "rollout/infra_error_trajectories": float(sum(t.infra_error for t in trajs)),
            "rollout/truncated": float(sum(t.truncated for t in trajs)),
            "rollout/engine_batches": float(sum(p.engine_batches for p in parts)),
            # replicas generate side by side: their rates add up
            "perf/generate_tokens_per_s": sum(sum(t.num_model_tokens for t in p.trajs) / max(p.busy["generate"], 1e-9)
                                              for p in parts),
            **{f"rollout/stop_{k}": float(sum(t.stop_reason == k for t in trajs))
               for k in ("no_call", "max_turns", "budget", "timeout", "prompt_too_long")},
            **tools.snapshot(),
        }

    def load_weights(self, state_dict: dict[str, Any]) -> float:
        t0 = time.perf_counter()
        self.engine.load_weights(state_dict)
        return time.perf_counter() - t0

    def load_adapters(self, folder: str) -> float:
        """A LoRA checkpoint's adapters (a peft folder) into the engine as the run's weight syncs brought them: in
        the engine's dtype, which the learner casts to before it sends, with the spec's scale (`factory eval`
        of a LoRA run, which then samples as the run's own evaluation did)."""
        from concurrent.futures import ThreadPoolExecutor

        import torch

        from factory.lora import read_adapters, scale

        # The cast is a parallel torch op: on this (the actor's event-loop) thread it would start a second
        # OpenMP team that lives as long as the actor, and libgomp then throttles the engine's team's
        # spin-wait: the transformers engine generated ~25% slower ever after (docs/performance.md, "One
        # thread for torch"). A thread that ends takes its team with it.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="read-adapters") as reader:
            adapters = reader.submit(read_adapters, Path(folder), scale(self.settings.model.lora),
                                     dtype=getattr(torch, self.dtype)).result()
        return self.load_weights(adapters)

    async def close(self) -> None:
        """The engine's close (an endpoint's HTTP client); the tool servers belong to the tools stage."""
        if self.engine is not None:
            await self.engine.close()


async def _last(items: AsyncIterator[Any]) -> Any:
    """The last item of a stream (a streamed method's answer)."""
    async for item in items:
        last = item
    return last
