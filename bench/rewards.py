"""Benchmark: Factory's reward stage evaluating independent nodes concurrently vs one node after another,
and a CPU-bound reward function in threads vs in worker processes (`processes`).

    python bench/rewards.py [--trajectories 64] [--latency 0.1] [--work 0.05]

Three independent reward nodes, each taking `--latency` seconds per trajectory (an I/O-bound reward: a
judge or an API behind HTTP), summed into `total`, over `--trajectories` trajectories. Factory: one
RewardStage scores the whole graph; every (node, trajectory) value is a task, so all nodes and all
trajectories overlap. Serial baseline: the same stage scores one node at a time (each node's trajectories
still overlap -- what the stage did before nodes ran concurrently), the times summed. Both are measured
for async reward functions (on the event loop) and for plain blocking ones (in the stage's thread pool).

CPU-bound: one node whose function computes in pure Python for about `--work` seconds a call (holding the
GIL, as sympy's simplification or a checker written in Python does), over the same trajectories, first in
the node's threads (the default), then with `processes:` one per core: the same calls, the same values.

Each time is the median of 3 `score` calls after an untimed one (the stage's threads or processes are then
up, as in every step of a run after the first; the processes' first call, which starts them, is reported
apart). Prints a table, then as its last line JSON with `parallel_ratio` (serial time / Factory time, plain
functions: the common case), `parallel_ratio_async`, `processes_ratio` (threads' time / processes' time on
the CPU-bound function; at most the core count), and the times.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, installed or not


def blocking(prompt: str, completion: str, delay: float = 0.1, **row: object) -> float:
    """A plain reward function that waits on I/O (a `requests` call, a subprocess)."""
    time.sleep(delay)
    return 1.0


def crunching(prompt: str, completion: str, loops: int = 100_000, **row: object) -> float:
    """A CPU-bound plain reward function: pure Python, holding the GIL all along."""
    total = 0
    for i in range(loops):
        total = (total + i * i) % 1_000_003
    return 1.0 + 0.0 * total


async def awaiting(prompt: str, completion: str, delay: float = 0.1, **row: object) -> float:
    """An async reward function that awaits I/O (an httpx call)."""
    await asyncio.sleep(delay)
    return 1.0


def _spec(fn: str, nodes: list[str], delay: float, *, processes: int = 0, args: dict | None = None):
    from factory.schema import Spec

    rewards = {n: {"fn": f"bench.rewards:{fn}", "args": args or {"delay": delay}, "processes": processes}
               for n in nodes}
    return Spec.model_validate({"name": "bench", "model": {"path": "x"},
                                "data": {"train": {"generator": "factory.data:arithmetic"}},
                                "rewards": {**rewards, "total": {"sum": {n: 1.0 for n in nodes}}}})


def _trajectories(n: int):
    from factory.types import Trajectory

    return [Trajectory(prompt_index=i // 8, sample_index=i % 8, prompt_ids=[], response_ids=[], loss_mask=[],
                       turns=[], stop_reason="no_call", row={"answer": "1"},
                       messages=[{"role": "user", "content": f"q{i}"}], completion=f"a{i}") for i in range(n)]


async def _timed_score(spec, n: int, repeats: int = 3, first: list[float] | None = None) -> float:
    """The median time of `repeats` score calls over n trajectories, after one untimed call (its time
    appended to `first`): a stage lives for a whole run, so a step finds its threads or processes up."""
    from factory.compiler.compile import stage_settings
    from factory.reward import RewardStage

    stage = RewardStage(stage_settings(spec)["reward"])
    await stage.setup()
    times = []
    try:
        started = time.perf_counter()
        await stage.score(_trajectories(n))
        if first is not None:
            first.append(time.perf_counter() - started)
        for _ in range(repeats):
            started = time.perf_counter()
            trajs, _ = await stage.score(_trajectories(n))
            times.append(time.perf_counter() - started)
            bad = [t for t in trajs if t.reward != len(spec.rewards) - 1]
            if bad:
                raise SystemExit(f"benchmark rewards failed: {bad[0].reward_details}")
    finally:
        await stage.close()
    return statistics.median(times)


async def measure(fn: str, nodes: list[str], n: int, delay: float) -> tuple[float, float]:
    """(Factory: the whole graph at once, serial: one node after another) in seconds."""
    together = await _timed_score(_spec(fn, nodes, delay), n)
    one_by_one = 0.0
    for node in nodes:
        one_by_one += await _timed_score(_spec(fn, [node], delay), n)
    return together, one_by_one


def _loops_for(seconds: float) -> int:
    """How many of `crunching`'s loops take about `seconds` here."""
    started = time.perf_counter()
    crunching("", "", loops=200_000)
    return max(1000, int(200_000 * seconds / (time.perf_counter() - started)))


async def main(args: argparse.Namespace) -> dict[str, float]:
    from bench.common import cpu_line

    print(cpu_line())
    nodes = ["a", "b", "c"]
    await _timed_score(_spec("awaiting", nodes[:1], 0.0), 4)  # warm-up: imports
    rows = {fn: await measure(fn, nodes, args.trajectories, args.latency) for fn in ("blocking", "awaiting")}
    cores = os.cpu_count() or 1
    crunch = {"loops": _loops_for(args.work)}
    in_threads = await _timed_score(_spec("crunching", ["a"], 0.0, args=crunch), args.trajectories)
    started: list[float] = []
    in_processes = await _timed_score(_spec("crunching", ["a"], 0.0, args=crunch, processes=cores),
                                      args.trajectories, first=started)
    print(f"{len(nodes)} independent nodes x {args.trajectories} trajectories, {args.latency * 1000:g} ms per call")
    print(f"{'reward functions':<28}{'factory s':>11}{'serial s':>11}{'ratio':>8}{'ideal':>8}")
    for fn, label in (("blocking", "plain (thread pool)"), ("awaiting", "async (event loop)")):
        together, one_by_one = rows[fn]
        print(f"{label:<28}{together:>11.3f}{one_by_one:>11.3f}{one_by_one / together:>8.2f}{len(nodes):>8.2f}")
    print(f"\n1 CPU-bound node x {args.trajectories} trajectories, pure Python: {crunch['loops']} loops a call "
          f"({in_threads / args.trajectories * 1000:.0f} ms a call, one at a time, in threads)")
    print(f"{'where it runs':<28}{'s':>11}{'ratio':>8}{'ideal':>8}")
    print(f"{'threads (the default)':<28}{in_threads:>11.3f}{1.0:>8.2f}{1.0:>8.2f}")
    print(f"{f'processes: {cores}':<28}{in_processes:>11.3f}{in_threads / in_processes:>8.2f}{cores:>8.2f}"
          f"   (their first call, which starts them: {started[0]:.2f} s)")
    return {
        "parallel_ratio": round(rows["blocking"][1] / rows["blocking"][0], 2),
        "parallel_ratio_async": round(rows["awaiting"][1] / rows["awaiting"][0], 2),
        "factory_s": round(rows["blocking"][0], 3),
        "serial_s": round(rows["blocking"][1], 3),
        "factory_async_s": round(rows["awaiting"][0], 3),
        "serial_async_s": round(rows["awaiting"][1], 3),
        "nodes": len(nodes),
        "trajectories": args.trajectories,
        "latency_s": args.latency,
        "processes_ratio": round(in_threads / in_processes, 2),
        "threads_cpu_bound_s": round(in_threads, 3),
        "processes_cpu_bound_s": round(in_processes, 3),
        "processes": cores,
        "processes_first_call_s": round(started[0], 3),
        "work_s": args.work,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Factory's concurrent reward nodes vs one node at a time")
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--latency", type=float, default=0.1, help="seconds each reward call takes")
    parser.add_argument("--work", type=float, default=0.05,
                        help="seconds of pure Python each call of the CPU-bound reward function computes")
    return parser.parse_args(argv)


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(parse_args()))))
