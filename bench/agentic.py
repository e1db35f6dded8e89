"""Benchmark: one agentic step -- multi-turn rollout with a slow tool, then a slow LLM judge -- scheduled
three ways on the same components.

    python bench/agentic.py [--repeats 3] [--prompts 4] [--group-size 8] [--tool-latency 0.4]
                            [--tool-latency-sigma 0.62] [--temperature 0.5] [--judge-latency 0.5]
                            [--judge-capacity 8] [--engine auto|vllm|hf] [--quick]

The same pieces serve every contender: Factory's rollout stage (its engine with the model, the chat
template, its ToolBox talking to a real stdio MCP server whose `calculate` tool answers like a remote API:
each call after its own latency, log-normal around `--tool-latency` with `--tool-latency-sigma`, drawn
from a hash of the call's arguments so that the same call waits the same in every contender) and Factory's
reward stage (`correct`: a python function; `judge`: an LLM-judge node calling a real OpenAI-compatible
HTTP endpoint, served by a process of its own, that answers after `--judge-latency` seconds and serves at
most `--judge-capacity` requests at once, like a judge server's batch limit). The defaults' tool
latencies, median 0.4 s and sigma 0.62 (p95 = 2.77 x the median), are the shape web-search APIs list
(Serper 400 ms p50 / 1.1 s p95, Tavily 0.8 / 2.2 s, in scavio.dev's 2026 table); `--tool-latency-sigma 0`
makes every call take the median. The model is the tiny Qwen3 warmed up on the calculator exchange: it
calls the tool on its own. At the default temperature, 0.5, its calls reach the tool (7 in 8 on the Xeon;
each trajectory calls once, then answers); at `--temperature 1` its turns and turn lengths differ more,
but most of its calls are malformed (an unknown tool name, arguments that are not JSON), which Factory
answers with an error at once, without the tool: the table's "tool ok" column counts the calls the slow
tool itself answered (about 1 in 28 then).

  factory      what `factory run` does in a step: the plan's tools, rollout and reward stages as Ray
               actors (driver.place), the batch carried along the plan's data edges by the driver's own
               code (driver.pipe): the rollout stage's loop (one async task per trajectory; the engine
               batches whatever requests wait; tool calls overlap other trajectories' generation) streams
               each trajectory to the reward stage as soon as it ends (no node reads its group: the plan's
               rollout -> reward edge streams trajectories), so judging overlaps generation;
  sync turns   a synchronous per-turn batch loop (Search-R1's): each turn, generate for every live
               trajectory as one batch, then run all their tool calls at once and wait for the slowest,
               then the next turn; when every trajectory is done, score them all (judge calls concurrent);
  sequential   each turn, generate for every live trajectory as one batch, then each tool call one by
               one; then each trajectory's reward one by one.

The baselines run the same stages in this process (their engine is another instance of Factory's: the
same model, dtype and engine, `--engine`, by default `auto`, Factory's choice for this spec on this
machine). Every request is seeded exactly as Factory's rollout seeds it -- from (spec seed, step, attempt,
prompt, sample, turn) -- so the three contenders build the same trajectories token for token:
the benchmark checks that on every repeat (and stops if any trajectory differs), so the times compare the
same work. The contenders alternate (factory, sync, sequential, factory, ...) `--repeats` times on the
same prompts, after one unmeasured warm-up round each; the step time is rollout + reward until every
trajectory is scored. Medians.

The judge server notes when each request arrives; for each contender's step the table gives its judge floor
(`judge_floor`): the earliest a judge of that capacity and latency could answer the last of the requests
sent at those times. No schedule of the judge beats it, so a step at its floor is bound by when its
trajectories ended, not by how it sends them to the judge.

Prints a table, then as its LAST line JSON: speedup_vs_sequential and speedup_vs_sync_turns (the baseline's
median step time / Factory's), same_trajectories, tool_calls and tool_answered (per trajectory),
factory_judge_floor_s and speedup_vs_sync_turns_at_floor (the synchronous turns' step over Factory's floor).
Targets: >= 3 and >= 1.3.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import heapq
import json
import math
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Annotated

from pydantic import Field

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, installed or not

from bench.common import cpu, cpu_line, judge_targets, median, print_json, table, workload_arguments


# ------------------------------------------------------------------------------------------ the tool
def tool_latency(expression: str, median_s: float, sigma: float) -> float:
    """How long the slow tool takes for `expression`: log-normal around `median_s` (sigma 0: always
    `median_s`), drawn from a hash of the call's arguments, so that every contender -- which makes the same
    calls, token for token -- waits the same for each call, whatever order the calls arrive in."""
    u = (int.from_bytes(hashlib.sha256(expression.encode()).digest()[:8], "big") + 0.5) / 2**64
    return median_s * math.exp(sigma * statistics.NormalDist().inv_cdf(u))


def serve(latency_s: float, sigma: float) -> None:
    """The benchmark's MCP server: the calculator's `calculate` tool (same name, description and argument,
    so the warmed-up model calls it), answering after `tool_latency` seconds like a remote API."""
    import anyio
    from mcp.server.mcpserver import MCPServer

    from factory.examples.calculator import evaluate, format_number

    server = MCPServer("bench-slow-calculator", log_level="WARNING")

    @server.tool(description="Evaluate an arithmetic expression with + - * / // % ** and parentheses, e.g. (3 + 4) * 2.",
                 structured_output=False)
    async def calculate(expression: Annotated[str, Field(description="The arithmetic expression to evaluate.")]) -> str:
        # (module-level Annotated and Field: the SDK evaluates these annotations in this module's globals)
        await anyio.sleep(tool_latency(expression, latency_s, sigma))
        try:
            return format_number(evaluate(expression))
        except ValueError as exc:
            return f"Error: {exc}"

    server.run("stdio")


# ----------------------------------------------------------------------------------------- the judge
def serve_judge(latency_s: float, capacity: int) -> None:
    """An OpenAI-compatible `/v1/chat/completions` endpoint on 127.0.0.1 that answers `score: 1` after a
    fixed latency, serving at most `capacity` requests at a time (the rest queue, as at a real server).
    Prints its port, then serves until killed."""
    slots = threading.Semaphore(capacity)
    arrivals: list[float] = []  # wall-clock times requests came in, until the next GET /arrivals

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            arrivals.append(time.time())
            with slots:
                time.sleep(latency_s)
            body = json.dumps({"choices": [{"message": {"role": "assistant", "content": "score: 1"}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # the arrival times since the last GET (the bench's, between steps)
            body = json.dumps(arrivals[:]).encode()
            arrivals.clear()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    class Server(ThreadingHTTPServer):
        # listen backlog: socketserver's default of 5 reset connections when a whole batch's judge calls
        # arrived at once (httpx ReadError: judge values missing, and a contender doing less work)
        request_queue_size = 256
        daemon_threads = True

    server = Server(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


def judge_arrivals(url: str) -> list[float]:
    """The wall-clock times the judge server received requests since the last call."""
    from urllib.request import urlopen

    with urlopen(url.removesuffix("/v1") + "/arrivals", timeout=10) as r:
        return json.loads(r.read())


def judge_floor(arrivals: list[float], latency_s: float, capacity: int) -> float:
    """When a judge serving `capacity` requests at once, each for `latency_s`, ends the last of requests
    arriving at `arrivals` (seconds), if it never idles while one waits. With requests of one length no
    schedule of the judge ends them sooner: what a step that sends them at those times cannot beat."""
    free = [0.0] * capacity  # when each of the judge's slots is next free
    for t in sorted(arrivals):
        start = max(t, heapq.heappop(free))
        heapq.heappush(free, start + latency_s)
    return max(free)


@contextlib.contextmanager
def judge_server(latency_s: float, capacity: int) -> Iterator[str]:
    """`serve_judge` in a process of its own (so that neither contender's process serves it); yields its
    base URL."""
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve-judge", "--latency",
                             str(latency_s), "--capacity", str(capacity)], stdout=subprocess.PIPE, text=True)
    try:
        yield f"http://127.0.0.1:{int(proc.stdout.readline())}/v1"
    finally:
        proc.kill()
        proc.wait()


# ------------------------------------------------------------------------------------------ the spec
def make_spec(a: argparse.Namespace, judge_url: str, folder: Path):
    from factory.compiler.compile import compile_file

    (folder / "judge.jinja").write_text("Rate the answer to {{ prompt }}:\n{{ completion }}\nReply 'score: <0-1>'.\n")
    (folder / "spec.yaml").write_text(f"""name: agentic-bench
seed: 0
model: {{path: {a.model}}}
data: {{train: {{generator: factory.data:arithmetic, size: 256, args: {{operands: [2, 2], digits: [1, 2]}}}}}}
tools:
  calc: {{command: {sys.executable}, args: [{Path(__file__).resolve()}, --serve, --latency, '{a.tool_latency}', --sigma,
                '{a.tool_latency_sigma}'],
          concurrency: 256, timeout_s: 30}}
rewards:
  correct: {{fn: factory.rewards.math:numeric_match}}
  judge: {{llm_judge: judge.jinja, endpoint: '{judge_url}', concurrency: 256, timeout_s: 120}}
  total: {{sum: {{correct: 1.0, judge: 0.1}}}}
rollout: {{group_size: {a.group_size}, max_turns: {a.max_turns}, max_new_tokens: {a.max_new_tokens},
          max_total_tokens: 1024, temperature: {a.temperature}, dtype: {a.dtype}, engine: {a.engine}}}
train: {{prompts_per_step: {a.prompts}, threads: {a.threads}}}
""")
    spec, plan = compile_file(folder / "spec.yaml")
    return spec, plan


# -------------------------------------------------------------------------------------- contenders
# Factory's step is the driver's: a step's sampling is seeded from (spec seed, step, attempt); the
# benchmark's step is step 0, attempt 0 (it never trains), in every contender.
STEP, ATTEMPT = 0, 0


def step_stages(plan):
    """The plan with only the stages a step's rollout and scoring run on: the data flow's stages between
    its source and its trainer, and every stage they call (the tools)."""
    names = {e.dst for e in plan.flow("data")[:-1]}
    calls = [e for e in plan.edges if e.kind == "call"]
    while extra := {e.dst for e in calls if e.src in names} - names:
        names |= extra
    return dataclasses.replace(plan, stages=tuple(s for s in plan.stages if s.name in names),
                               edges=tuple(e for e in plan.edges if e.src in names and e.dst in names))


def factory_step(groups, plan, batch) -> list:
    """Factory's step as the driver runs it (driver.carry): the batch goes to the rollout stage, which
    streams its parts -- each trajectory as soon as it ends, as the plan's edge says -- to the reward stage
    (driver.pipe)."""
    from factory.runtime.driver import pipe

    into_rollout, into_reward = plan.flow("data")[:2]
    assert into_reward.stream == "trajectory", f"the plan streams {into_reward.stream or 'nothing'}, not trajectories"
    trajs, _ = pipe(groups[into_rollout.dst], into_rollout.method, groups[into_reward.dst], into_reward.method,
                    batch, part=into_reward.stream, progress=lambda done, total: None, step=STEP, attempt=ATTEMPT)
    return trajs


class Lockstep:
    """The baselines' trajectories, advanced turn by turn together (Search-R1's loop). `seed_key` seeds
    each request as Factory's rollout does (factory.rollout.agent.rollout: (seed_key, prompt, sample),
    then the turn), so a trajectory samples the same tokens in either schedule."""

    def __init__(self, engine, chat, toolbox, cfg, prompts: list[tuple[list[dict], dict]], group_size: int,
                 seed_key: tuple[int, ...] | None = None):
        from factory.rollout.agent import sampling_from_spec
        from factory.rollout.engine import request_seed

        self.engine, self.chat, self.toolbox, self.cfg = engine, chat, toolbox, cfg
        self.sampling = sampling_from_spec(cfg)
        schemas = toolbox.schemas() or None
        self.trajs = [self._start(messages, row, p, s, chat.prompt_ids(messages, schemas))
                      for p, (messages, row) in enumerate(prompts) for s in range(group_size)]
        self.seeds = [None if seed_key is None else request_seed(*seed_key, t.prompt_index, t.sample_index)
                      for t in self.trajs]

    @staticmethod
    def _start(messages, row, p, s, prompt_ids):
        from factory.types import Trajectory

        return Trajectory(prompt_index=p, sample_index=s, prompt_ids=prompt_ids, response_ids=[], loss_mask=[],
                          turns=[], stop_reason="max_turns", row=row, messages=messages)

    async def run(self, one_by_one: bool) -> list:
        """Every turn: one generation batch for the live trajectories, then all their tool calls, at once
        (waiting for the slowest) or `one_by_one`; a trajectory leaves when it answers without a call or
        runs out of turns or tokens."""
        from factory.rollout.agent import call_tool
        from factory.rollout.engine import request_seed
        from factory.rollout.parse import NEVER_CLOSED, parse_tool_calls
        from factory.types import ToolResult, Turn

        chat, cfg, engine = self.chat, self.cfg, self.engine
        seeds = {id(t): seed for t, seed in zip(self.trajs, self.seeds)}

        def sampling(t, turn_no):
            seed = seeds[id(t)]
            return self.sampling if seed is None else dataclasses.replace(self.sampling, seed=request_seed(seed, turn_no))

        live = list(self.trajs)
        for turn_no in range(cfg.max_turns):
            gens = await asyncio.gather(*(engine.generate(
                t.prompt_ids + t.response_ids, sampling=sampling(t, turn_no),
                max_new_tokens=min(cfg.max_new_tokens, cfg.max_total_tokens - len(t.response_ids))) for t in live))
            calling = []
            for t, gen in zip(live, gens):
                t.response_ids += gen.ids
                t.loss_mask += [1] * len(gen.ids)
                t.truncated = not gen.finished
                # the turn's text and calls as the agent loop makes them (factory/rollout/agent.py)
                text = chat.reasoning_opened + chat.decode(gen.ids[:-1] if gen.finished else gen.ids)
                calls = parse_tool_calls(text, opened_before=False, cut=not gen.finished)
                if not gen.finished and calls and calls[-1].parse_error == NEVER_CLOSED:
                    calls = calls[:-1]  # a call the token limit cut: dropped
                t.turns.append(Turn(text=text, num_tokens=len(gen.ids), calls=calls))
                if not t.turns[-1].calls:
                    t.stop_reason = "no_call" if gen.finished else "budget"
                elif turn_no < cfg.max_turns - 1:  # (the last turn's calls are recorded, not run)
                    ended_with_eot = gen.finished and gen.ids[-1] == chat.end_of_turn_id
                    shortest = chat.tool_delta_ids([ToolResult(c.name, "") for c in calls], ended_with_eot)
                    if len(t.response_ids) + len(shortest) >= cfg.max_total_tokens:  # not even empty answers fit
                        t.stop_reason, t.truncated = "budget", True
                    else:
                        calling.append((t, gen))
            calls = [c for t, _ in calling for c in t.turns[-1].calls]
            if one_by_one:
                results = [await call_tool(self.toolbox, c) for c in calls]
            else:
                results = list(await asyncio.gather(*(call_tool(self.toolbox, c) for c in calls)))
            live = []
            for t, gen in calling:
                turn = t.turns[-1]
                turn.results, results = results[: len(turn.calls)], results[len(turn.calls):]
                delta = chat.tool_delta_ids(turn.results, gen.finished and gen.ids[-1] == chat.end_of_turn_id)
                if len(t.response_ids) + len(delta) >= cfg.max_total_tokens:
                    t.stop_reason, t.truncated = "budget", True
                    continue
                t.response_ids += delta
                t.loss_mask += [0] * len(delta)
                live.append(t)
            if not live:
                break
        for t in self.trajs:
            t.completion = chat.decode(t.response_ids)
            t.infra_error = any(r.status == "infra_error" for turn in t.turns for r in turn.results)
        return self.trajs


def lockstep(stage, prompts, group_size: int) -> Lockstep:
    return Lockstep(stage.engine, stage.chat, stage.tools, stage.settings.rollout, prompts, group_size,
                    seed_key=(stage.settings.seed, STEP, ATTEMPT))


async def sync_turns_step(stage, reward, prompts, group_size: int) -> list:
    trajs = await lockstep(stage, prompts, group_size).run(one_by_one=False)
    return (await reward.score(trajs))[0]


async def sequential_step(stage, reward, prompts, group_size: int) -> list:
    trajs = await lockstep(stage, prompts, group_size).run(one_by_one=True)
    for t in trajs:  # one trajectory at a time (the graph has no group or batch node)
        await reward.score([t])
    return trajs


# ---------------------------------------------------------------------------------------------- main
def trajectory_record(t) -> tuple:
    """What a trajectory is, token for token: ids, loss mask, each turn's text, calls and tool results."""
    return (t.prompt_index, t.sample_index, t.prompt_ids, t.response_ids, t.loss_mask, t.stop_reason, t.completion,
            t.truncated, t.infra_error, [(u.text, u.num_tokens, [c.raw for c in u.calls],
                                         [(r.tool, r.text, r.status) for r in u.results]) for u in t.turns])


def differing(a: list, b: list) -> int:
    """How many trajectories of two contenders differ (0: the same work, token for token)."""
    if len(a) != len(b):
        return max(len(a), len(b))
    return sum(trajectory_record(x) != trajectory_record(y) for x, y in zip(a, b))


async def measure(a: argparse.Namespace, folder: Path) -> dict:
    from factory.runtime.lifecycle import local_ray_on_loopback

    local_ray_on_loopback(None)  # before ray is imported: Factory's local Ray listens on loopback only
    import ray

    from factory.data import DataStage, from_table
    from factory.reward import RewardStage
    from factory.rollout.stage import RolloutStage
    from factory.runtime.driver import place, start_ray, teardown
    from factory.tools.stage import ToolsStage
    from factory.types import Placement

    with judge_server(a.judge_latency, a.judge_capacity) as judge_url:
        _, plan = make_spec(a, judge_url, folder)
        data = DataStage(plan.stage("data").settings)
        data.setup()
        batch = data.next_batch(a.prompts)
        prompts = from_table(batch)
        # Factory: the step's stages as `factory run` places them, on a local Ray of their own
        start_ray(plan.driver.resources)
        groups = {}
        # the baselines: the same stages in this process, the rollout and reward calling the tools stage directly
        tools, rollout = ToolsStage(plan.stage("tools").settings), RolloutStage(plan.stage("rollout").settings)
        reward = RewardStage(plan.stage("reward").settings)
        try:
            groups = place(step_stages(plan))
            await tools.setup(Placement(workdir=str(folder)))
            peers = {rollout.settings.tool_peer: tools}  # the role of both stages' call edges to the tools
            await rollout.setup(Placement(workdir=str(folder), peers=peers))
            await reward.setup(Placement(workdir=str(folder), peers=peers))
            async def factory() -> list:  # the driver's calls block this loop: nothing else runs meanwhile
                return factory_step(groups, plan, batch)

            steps = {"factory": factory,
                     "sync turns": lambda: sync_turns_step(rollout, reward, prompts, a.group_size),
                     "sequential": lambda: sequential_step(rollout, reward, prompts, a.group_size)}
            times: dict[str, list[float]] = {k: [] for k in steps}
            floors: dict[str, list[float]] = {k: [] for k in steps}
            shapes: dict[str, list] = {k: [] for k in steps}
            reference = None
            judge_arrivals(judge_url)  # none yet; from here on, each step's own
            for round_no in range(a.repeats + 1):  # round 0 warms every contender up (first-call costs)
                for name, step in steps.items():
                    t0, wall0 = time.perf_counter(), time.time()
                    trajs = await step()
                    elapsed = time.perf_counter() - t0
                    floor = judge_floor([t - wall0 for t in judge_arrivals(judge_url)], a.judge_latency,
                                        a.judge_capacity)
                    reference = reference or trajs
                    if (n := differing(reference, trajs)):
                        raise SystemExit(f"{name} built {n} of {len(trajs)} trajectories other than factory's: "
                                         "the contenders would not do the same work")
                    if round_no:
                        times[name].append(elapsed)
                        floors[name].append(floor)
                        shapes[name].append(trajs)
        finally:
            await rollout.close()
            await reward.close()
            await tools.close()
            teardown(groups)
            ray.shutdown()
    return {"times": times, "floors": floors, "shapes": shapes, "engine": rollout.engine.name}


def answered(result) -> bool:
    """Whether the tool itself answered a call (its result or its own error), rather than Factory refusing
    it before the server (an unknown tool, arguments that are not JSON or fail the tool's schema)."""
    return result.status == "ok" or result.error_kind == "tool_error"


def describe(trajs: list) -> tuple[float, float, float, float, float]:
    """Mean turns, tool calls, calls the tool answered, model tokens per trajectory, and the spread of turns
    (stdev)."""
    turns = [len(t.turns) for t in trajs]
    return (statistics.fmean(turns), statistics.fmean(t.num_tool_calls for t in trajs),
            statistics.fmean(sum(answered(r) for u in t.turns for r in u.results) for t in trajs),
            statistics.fmean(sum(t.loss_mask) for t in trajs), statistics.pstdev(turns))


def main(a: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(a.threads)
    print(cpu_line())
    print(f"{a.prompts} prompts x {a.group_size} samples, up to {a.max_turns} turns of {a.max_new_tokens} tokens; "
          f"tool latency {a.tool_latency:g} s median, sigma {a.tool_latency_sigma:g}; "
          f"judge latency {a.judge_latency:g} s, capacity {a.judge_capacity}; "
          f"{a.repeats} repeats alternated; model {a.model} in {a.dtype}")
    with tempfile.TemporaryDirectory(prefix="factory-agentic-") as tmp:
        out = asyncio.run(measure(a, Path(tmp)))
    times, floors, engine = out["times"], out["floors"], out["engine"]
    print(f"rollout engine: {engine} (rollout.engine {a.engine}), the same in every contender")
    rows = []
    for name, ts in times.items():
        shape = [describe(trajs) for trajs in out["shapes"][name]]
        rows.append((name, median(ts), min(ts), max(ts), median(floors[name]),
                     *(statistics.fmean(s[i] for s in shape) for i in range(5))))
    print(table(["contender", "median s", "min s", "max s", "judge floor s", "turns", "tool calls", "tool ok",
                 "model tok", "turns sd"], rows, first=14))
    print(f"same trajectories, token for token, in every contender and repeat: yes ({len(out['shapes']['factory'][0])} "
          "per step)")
    calls, ok = rows[0][6], rows[0][7]
    print(f"the slow tool answered {ok:.2f} of {calls:.2f} calls per trajectory; Factory refused the rest at once "
          "(malformed: an unknown tool, arguments not JSON or not the tool's schema)")
    factory, floor = median(times["factory"]), median(floors["factory"])
    if not floor:  # no request reached the judge: nothing bounded the step from there
        raise SystemExit("bench/agentic.py: the judge received no request during Factory's steps")
    print(f"judge floor: the earliest a judge serving {a.judge_capacity} requests at a time for {a.judge_latency:g} s "
          "each could answer the last of a contender's requests, sent when they were (from the step's start). "
          f"Factory's step ended {factory - floor:.3f} s after its floor; a step ending at that floor would be "
          f"{median(times['sync turns']) / floor:.3f}x the synchronous turns': past it, only trajectories that end "
          "sooner make the step shorter")
    out = {"speedup_vs_sequential": round(median(times["sequential"]) / factory, 3),
           "speedup_vs_sync_turns": round(median(times["sync turns"]) / factory, 3),
           "factory_s": round(factory, 3), "sync_turns_s": round(median(times["sync turns"]), 3),
           "sequential_s": round(median(times["sequential"]), 3), "same_trajectories": True,
           # the judge's floor for the times Factory's step sent its requests (judge_floor), and the speedup over
           # the synchronous turns a step ending at that floor would have
           "factory_judge_floor_s": round(floor, 3),
           "speedup_vs_sync_turns_at_floor": round(median(times["sync turns"]) / floor, 3),
           # per trajectory: calls made, and calls the slow tool itself answered (the rest Factory refused at
           # once: the tiny model's malformed calls, most of them at temperature 1)
           "tool_calls": round(calls, 3), "tool_answered": round(ok, 3), "engine": engine}
    targets = {"speedup_vs_sequential": (">=", 3.0), "speedup_vs_sync_turns": (">=", 1.3)}
    return {**out, **judge_targets(out, targets, source="issues #14 and #28"), "cpu": cpu()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="an agentic step: Factory vs sequential vs synchronous turns")
    workload_arguments(parser, "factory:tiny-qwen3-calc")
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--tool-latency", type=float, default=0.4, help="median seconds a tool call takes")
    parser.add_argument("--tool-latency-sigma", type=float, default=0.62, help="spread of tool latencies: sigma of "
                        "their log-normal (p95 = median x exp(1.645 sigma)); 0: every call takes --tool-latency")
    parser.add_argument("--judge-latency", type=float, default=0.5, help="seconds each judge request takes")
    parser.add_argument("--judge-capacity", type=int, default=8, help="judge requests served at once")
    parser.add_argument("--temperature", type=float, default=0.5,
                        help="sampling temperature (rollout.temperature); the tiny model's calls reach the tool "
                             "at 0.5 and are mostly malformed at 1.0")
    # float32 by default: seeded sampling builds the same trajectories in every contender only while the
    # engine's logits do not depend on which requests share a batch. In bf16 they do: on an AVX-512/AMX
    # Xeon (transformers' engine, bf16) the synchronous-turn loop built 1 of 32 trajectories otherwise.
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                        help="the rollout engine's dtype (rollout.dtype) in every contender")
    parser.add_argument("--engine", default="auto", choices=["auto", "vllm", "hf"],
                        help="the rollout engine (rollout.engine) in every contender")
    parser.add_argument("--quick", action="store_true", help="one small repeat (a smoke test, not a measurement)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # internal: be the tool server
    parser.add_argument("--serve-judge", action="store_true", help=argparse.SUPPRESS)  # internal: be the judge
    parser.add_argument("--latency", type=float, default=0.2, help=argparse.SUPPRESS)
    parser.add_argument("--capacity", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--sigma", type=float, default=0.0, help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.quick:
        a.repeats, a.prompts, a.group_size, a.max_new_tokens = 1, 2, 2, 16
        a.tool_latency, a.judge_latency = 0.05, 0.05
    return a


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.serve:
        serve(arguments.latency, arguments.sigma)
    elif arguments.serve_judge:
        serve_judge(arguments.latency, arguments.capacity)
    else:
        print_json(main(arguments))
