"""Benchmark: Factory's reward stage evaluating independent nodes concurrently vs one node after another.

    python bench/rewards.py [--trajectories 64] [--latency 0.1]

Three independent reward nodes, each taking `--latency` seconds per trajectory (an I/O-bound reward: a
judge or an API behind HTTP), summed into `total`, over `--trajectories` trajectories. Factory: one
RewardStage scores the whole graph; every (node, trajectory) value is a task, so all nodes and all
trajectories overlap. Serial baseline: the same stage scores one node at a time (each node's trajectories
still overlap -- what the stage did before nodes ran concurrently), the times summed. Both are measured
for async reward functions (on the event loop) and for plain blocking ones (in the stage's thread pool).

Each time is the median of 3 `score` calls after an untimed one (the stage's thread pool is then up, as
in every step of a run after the first). Prints a table, then as its last line JSON with `parallel_ratio`
(serial time / Factory time, plain functions: the common case), `parallel_ratio_async`, and the times.
"""
from __future__ import annotations

import argparse
import asyncio
import json
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


async def awaiting(prompt: str, completion: str, delay: float = 0.1, **row: object) -> float:
    """An async reward function that awaits I/O (an httpx call)."""
    await asyncio.sleep(delay)
    return 1.0


def _spec(fn: str, nodes: list[str], delay: float):
    from factory.schema import Spec

    rewards = {n: {"fn": f"bench.rewards:{fn}", "args": {"delay": delay}} for n in nodes}
    return Spec.model_validate({"name": "bench", "model": {"path": "x"},
                                "data": {"train": {"generator": "factory.data:arithmetic"}},
                                "rewards": {**rewards, "total": {"sum": {n: 1.0 for n in nodes}}}})


def _trajectories(n: int):
    from factory.types import Trajectory

    return [Trajectory(prompt_index=i // 8, sample_index=i % 8, prompt_ids=[], response_ids=[], loss_mask=[],
                       turns=[], stop_reason="no_call", row={"answer": "1"},
                       messages=[{"role": "user", "content": f"q{i}"}], completion=f"a{i}") for i in range(n)]


async def _timed_score(spec, n: int, repeats: int = 3) -> float:
    """The median time of `repeats` score calls over n trajectories, after one untimed call: a stage lives
    for a whole run, so a step finds its thread pool already up."""
    from factory.compiler.compile import stage_settings
    from factory.reward import RewardStage

    stage = RewardStage(stage_settings(spec)["reward"])
    await stage.setup()
    times = []
    try:
        await stage.score(_trajectories(n))
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


async def main(args: argparse.Namespace) -> dict[str, float]:
    nodes = ["a", "b", "c"]
    await _timed_score(_spec("awaiting", nodes[:1], 0.0), 4)  # warm-up: imports
    rows = {fn: await measure(fn, nodes, args.trajectories, args.latency) for fn in ("blocking", "awaiting")}
    print(f"{len(nodes)} independent nodes x {args.trajectories} trajectories, {args.latency * 1000:g} ms per call")
    print(f"{'reward functions':<28}{'factory s':>11}{'serial s':>11}{'ratio':>8}{'ideal':>8}")
    for fn, label in (("blocking", "plain (thread pool)"), ("awaiting", "async (event loop)")):
        together, one_by_one = rows[fn]
        print(f"{label:<28}{together:>11.3f}{one_by_one:>11.3f}{one_by_one / together:>8.2f}{len(nodes):>8.2f}")
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
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Factory's concurrent reward nodes vs one node at a time")
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--latency", type=float, default=0.1, help="seconds each reward call takes")
    return parser.parse_args(argv)


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(parse_args()))))
