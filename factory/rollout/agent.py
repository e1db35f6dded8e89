"""The multi-turn agent loop: one async task per trajectory.

    generate -> parse tool calls -> call the tools (in parallel) -> append their responses AS TOKENS -> repeat

until the model answers without a call (`no_call`), uses its last turn (`max_turns`) or its tokens
(`budget`), or runs out of time (`timeout`: `rollout.episode_timeout_s`, so one slow tool or a stalled
generation cannot hold a whole step; what was done by then is kept, its loss mask zeroed, and the
trajectory counts as an infrastructure failure). The model's ids are kept as generated (loss mask 1); the ids between turns come from the chat
template (loss mask 0). Every trajectory of a batch runs concurrently, so one trajectory's tool calls
overlap other trajectories' generation, and the engine batches whatever generation requests are waiting.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from factory.rollout.chat import ChatFormat
from factory.rollout.engine import Engine, Sampling, request_seed
from factory.rollout.parse import NEVER_CLOSED, parse_tool_calls
from factory.schema import RolloutSpec
from factory.types import StopReason, ToolCall, ToolResult, Trajectory, Turn
from factory.util import TIMEOUTS, being_cancelled


class Tools(Protocol):
    """What the loop needs from factory.tools.ToolBox."""

    def schemas(self) -> list[dict]: ...

    async def call(self, call: ToolCall, expired: bool = False) -> ToolResult: ...


def sampling_from_spec(cfg: RolloutSpec, *, evaluation: bool = False) -> Sampling:
    """The spec's sampling settings, for training or for evaluation (`eval_temperature`; 0 is greedy)."""
    if evaluation:
        return Sampling(temperature=cfg.eval_temperature or 1.0, top_p=cfg.top_p, top_k=cfg.top_k,
                        greedy=cfg.eval_temperature == 0)
    return Sampling(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)


async def call_tool(toolbox: Tools, call: ToolCall, expired: bool = False) -> ToolResult:
    """Run one parsed call. Malformed calls go to the toolbox too: it answers them (parse_error,
    unknown_tool) with an error the model reads, and counts them in its per-tool metrics. The toolbox
    never raises; if it does anyway (a bug), the call is recorded as an infrastructure error instead of
    ending the whole rollout: a CancelledError too, unless this call was cancelled (the episode's deadline).
    `expired`: the episode's deadline passed before the call was sent; the toolbox records it so, never runs it."""
    try:
        return await (toolbox.call(call, expired=True) if expired else toolbox.call(call))
    except (Exception, asyncio.CancelledError) as e:
        if isinstance(e, asyncio.CancelledError) and being_cancelled():
            raise
        return ToolResult(tool=call.name, text=f"Error: the tool call failed ({type(e).__name__}).",
                          status="infra_error", error_kind="crash")


EXPIRED_WAIT_S = 5.0  # how long an episode past its deadline waits for the tools to record its unsent calls


async def send_expired(toolbox: Tools, calls: list[ToolCall]) -> None:
    """Calls the episode's deadline passed before they were sent (the turn ended at it, or the event loop, busy
    with other episodes, came back to this one after it): cancelled then, none would reach the tools, and the
    recording would hold no row where the trajectory holds `episode_timeout` (a replay of the run, not late there,
    missed them, or called the tools and went on into turns this episode never had). Each is sent marked expired:
    recorded as cut, never run."""
    try:
        await asyncio.wait_for(asyncio.gather(*(call_tool(toolbox, c, expired=True) for c in calls)), EXPIRED_WAIT_S)
    except TIMEOUTS:  # a tools stage that does not answer at once: the episode ends anyway, unrecorded
        pass


async def run_trajectory(engine: Engine, chat: ChatFormat, toolbox: Tools, *, messages: list[dict[str, Any]],
                         row: dict[str, Any], prompt_index: int, sample_index: int, cfg: RolloutSpec,
                         sampling: Sampling, seed: int | None = None, origin: str = "",
                         context: int | None = None) -> Trajectory:
    """One episode: the model's turns and the tool responses between them, as ids with a loss mask and
    the sampler's log-prob of every model token. With `seed`, turn k samples with its own seed derived
    from (seed, k). `origin` names the episode in the run (Trajectory.origin): call k of turn t is
    `<origin>/<t>/<k>` (ToolCall.origin, what a replay finds its recorded answer by). `context`: the model's context in
    tokens (None: not known), which the prompt and the response must fit together: a prompt that leaves
    no room is not generated from (stop reason `prompt_too_long`; the reward stage drops it), a turn is cut
    where the context ends, and tool results that would not fit end the episode (an engine given more either
    refuses it or, as transformers does, computes attention over all of it: a 250k-character row filled the
    machine's memory)."""
    prompt_ids = chat.prompt_ids(messages, toolbox.schemas() or None)
    response: list[int] = []
    mask: list[int] = []
    logprobs: list[float] | None = []  # None once a turn came without them: not recorded (0.0s read as certain)
    turns: list[Turn] = []
    stop: StopReason = "max_turns"
    deadline = time.monotonic() + cfg.episode_timeout_s if cfg.episode_timeout_s else None

    async def in_time(work: Any) -> Any:  # TimeoutError past the episode's deadline (the work is cancelled)
        try:
            return await (work if deadline is None else asyncio.wait_for(work, max(deadline - time.monotonic(), 0.0)))
        except TIMEOUTS as e:  # (asyncio's own class before Python 3.11)
            raise TimeoutError from e

    finished = True  # whether the last model turn ended by itself (not cut by a token limit or the clock)
    if context is not None and len(prompt_ids) >= context:
        stop = "prompt_too_long"
    for turn_no in range(0 if stop == "prompt_too_long" else cfg.max_turns):
        limit = min(cfg.max_new_tokens, cfg.max_total_tokens - len(response))
        if context is not None:
            limit = min(limit, context - len(prompt_ids) - len(response))
            if limit < 1:  # the context is full: the model cannot answer the last tool results
                stop = "budget"
                break
        started = time.time()
        turn_sampling = sampling if seed is None or sampling.greedy else replace(sampling, seed=request_seed(seed, turn_no))
        try:
            gen = await in_time(engine.generate(prompt_ids + response, max_new_tokens=limit, sampling=turn_sampling))
        except TimeoutError:
            stop, finished = "timeout", False
            break
        finished = gen.finished
        generated = time.time()
        response += gen.ids
        mask += [1] * len(gen.ids)
        if logprobs is not None:  # an engine that gave none for a turn leaves the trajectory's unrecorded
            logprobs = logprobs + gen.logprobs if len(gen.logprobs) == len(gen.ids) else None
        # The stop token is not part of what the model said; parse and log the text before it. A template that
        # opens the reasoning block in the generation prompt (R1's) left it unopened in the turn's text: a turn cut
        # while thinking would read as an answer, so the text says where the reasoning began.
        text = chat.reasoning_opened + chat.decode(gen.ids[:-1] if gen.finished else gen.ids)
        parsed = parse_tool_calls(text, opened_before=False, cut=not gen.finished)
        if not gen.finished and parsed and parsed[-1].parse_error == NEVER_CLOSED:
            # the token limit cut the turn inside its last call: answered as a malformed call, it would blame the
            # model for the limit's cut; it is dropped, and with no call left the turn is a cut one (budget)
            parsed = parsed[:-1]
        calls = [replace(c, origin=f"{origin}/{turn_no}/{k}") if origin else c for k, c in enumerate(parsed)]
        turn = Turn(text=text, num_tokens=len(gen.ids), calls=calls, started_at=started,
                    generated_at=generated, ended_at=generated)
        turns.append(turn)
        if not turn.calls:
            stop = "no_call" if gen.finished else "budget"
            break
        if turn_no == cfg.max_turns - 1:
            break  # nothing would read the responses: the calls are recorded, not run
        ended_with_eot = gen.finished and gen.ids[-1] == chat.end_of_turn_id
        room = min(cfg.max_total_tokens, context - len(prompt_ids) if context is not None else cfg.max_total_tokens)
        # Not even the shortest answers (empty ones) would fit: the budget ends the episode whatever the calls say,
        # so they are recorded, not run (a result nobody reads must not mark the trajectory an infra_error)
        shortest = chat.tool_delta_ids([ToolResult(tool=c.name, text="") for c in turn.calls], ended_with_eot)
        if len(response) + len(shortest) >= room:
            stop = "budget"
            break
        try:
            if deadline is not None and time.monotonic() >= deadline:
                await send_expired(toolbox, turn.calls)
                raise TimeoutError
            turn.results = list(await in_time(asyncio.gather(*(call_tool(toolbox, c) for c in turn.calls))))
            if any(r.error_kind == "episode_timeout" for r in turn.results):
                # A replay's answer (a live call cut by the deadline is cancelled, never answered): the recorded
                # episode's deadline cut this turn, so this one ends here as it did, or it would go on to turns
                # the recording never saw
                raise TimeoutError
        except TimeoutError:
            turn.results = [ToolResult(tool=c.name, text="Error: the episode ran out of time.", status="infra_error",
                                       error_kind="episode_timeout") for c in turn.calls]
            turn.ended_at = time.time()
            stop = "timeout"
            break
        turn.ended_at = time.time()
        delta = chat.tool_delta_ids(turn.results, turn_ended_with_eos=ended_with_eot)
        if len(response) + len(delta) >= room:  # no room left for the model to answer (the budget or the context)
            stop = "budget"
            break
        response += delta
        mask += [0] * len(delta)
        logprobs = logprobs + [0.0] * len(delta) if logprobs is not None else None
    if stop == "timeout":  # never trained on: dropped with drop_infra_errors, else kept in its group, masked
        mask = [0] * len(mask)
    return Trajectory(
        prompt_index=prompt_index, sample_index=sample_index, prompt_ids=prompt_ids, response_ids=response,
        loss_mask=mask, sampler_logprobs=logprobs or [], turns=turns, stop_reason=stop, row=row, messages=messages,
        completion=chat.decode(response),
        infra_error=stop == "timeout" or any(r.status == "infra_error" for t in turns for r in t.results),
        # cut by a token limit (or the clock) in a model turn, or by the budget between turns (a tool's answer
        # left no room to reply): either way the model never gave its last word (DAPO's overlong filter's case)
        truncated=not finished or stop == "budget", origin=origin,
    )


async def rollout(engine: Engine, chat: ChatFormat, toolbox: Tools, prompts: list[tuple[list[dict], dict]], *,
                  group_size: int, cfg: RolloutSpec, sampling: Sampling,
                  on_done: Callable[[Trajectory], None] | None = None,
                  seed_key: tuple[int, ...] | None = None, first_index: int = 0, origin: str = "",
                  context: int | None = None) -> list[Trajectory]:
    """`group_size` trajectories per prompt, all at once; ordered by (prompt_index, sample_index).
    `on_done` is called as each trajectory finishes (the stage counts them for its progress report).
    `seed_key` (e.g. (spec seed, step)) seeds every request from (seed_key, prompt, sample, turn) rather
    than from a generator whose draws would depend on how requests happened to be batched. Prompts are
    numbered from `first_index` (a rollout replica's part of a step starts there). `origin` ("train/3/0")
    prefixes each episode's `<prompt>/<sample>` in its calls' origins. `context`: see run_trajectory."""

    async def one(messages: list[dict[str, Any]], row: dict[str, Any], p: int, s: int) -> Trajectory:
        seed = None if seed_key is None else request_seed(*seed_key, p, s)
        t = await run_trajectory(engine, chat, toolbox, messages=messages, row=row, prompt_index=p, sample_index=s,
                                 cfg=cfg, sampling=sampling, seed=seed, origin=f"{origin}/{p}/{s}" if origin else "",
                                 context=context)
        if on_done is not None:
            on_done(t)
        return t

    tasks = [asyncio.ensure_future(one(messages, row, p, s))
             for p, (messages, row) in enumerate(prompts, start=first_index) for s in range(group_size)]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        # one failed (or the rollout was cancelled): the others end before this raises. gather leaves them
        # running on a failure, generating and calling tools for a rollout its caller has given up on.
        # (Not asyncio.TaskGroup: Python 3.10 is supported.)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
