"""Benchmark: Factory's concurrent tool execution vs a one-call-at-a-time baseline, in one process.

    python bench/tools.py [--trajectories 64] [--turns 3] [--latency 0.2]

Both runs talk to the same real stdio MCP server (this file run with `--serve`), whose `lookup`
tool takes `--latency` seconds. Factory: every trajectory is an asyncio task that calls the tool once
per turn through the ToolBox, so the calls of all trajectories overlap, bounded by the server's
`concurrency`. Baseline: the same calls through the same ToolBox, awaited one after another.

Prints a table, then as its last line JSON with `overlap` (Factory's tool wall time per turn / one
call's latency; 1.0 is perfect overlap) and `speedup_vs_serial` (baseline time / Factory time).
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


def serve(latency_s: float) -> None:
    """The benchmark's tool server: `lookup(key)` answers after `latency_s` seconds, like a slow API."""
    import anyio
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("bench-slow-tool", log_level="WARNING")

    @server.tool(structured_output=False)
    async def lookup(key: str) -> str:
        """Look a key up (slowly)."""
        await anyio.sleep(latency_s)
        return f"value-of-{key}"

    server.run("stdio")


async def trajectory(box, index: int, turns: int) -> list:
    """One fake trajectory: a tool call per turn, each turn waiting for the previous one's result."""
    from factory.types import ToolCall

    results = []
    for turn in range(turns):
        call = ToolCall(name="lookup", arguments={"key": f"{index}.{turn}"}, raw="")
        results.extend(await box.call_many([call]))
    return results


async def run_factory(box, trajectories: int, turns: int) -> tuple[float, list]:
    started = time.perf_counter()
    per_trajectory = await asyncio.gather(*(trajectory(box, i, turns) for i in range(trajectories)))
    return time.perf_counter() - started, [r for rs in per_trajectory for r in rs]


async def run_serial(box, trajectories: int, turns: int) -> tuple[float, list]:
    """The baseline: the same calls, turn by turn, trajectory by trajectory, one at a time."""
    from factory.types import ToolCall

    started = time.perf_counter()
    results = []
    for turn in range(turns):
        for index in range(trajectories):
            results.append(await box.call(ToolCall(name="lookup", arguments={"key": f"{index}.{turn}"}, raw="")))
    return time.perf_counter() - started, results


def check(results: list, trajectories: int, turns: int) -> None:
    bad = [r for r in results if r.status != "ok"]
    if len(results) != trajectories * turns or bad:
        raise SystemExit(f"benchmark calls failed: {len(results)} results, first failure: {bad[:1]}")


async def main(args: argparse.Namespace) -> dict[str, float]:
    from factory.schema import StdioServer
    from factory.tools import ToolBox

    spec = StdioServer(
        command=sys.executable,
        args=[str(Path(__file__).resolve()), "--serve", "--latency", str(args.latency)],
        concurrency=args.concurrency,
        timeout_s=30,
    )
    async with ToolBox.from_spec({"bench": spec}) as box:
        factory_s, factory_results = await run_factory(box, args.trajectories, args.turns)
        check(factory_results, args.trajectories, args.turns)
        serial_s, serial_results = await run_serial(box, args.trajectories, args.turns)
        check(serial_results, args.trajectories, args.turns)

    one_call_s = statistics.median(r.latency_s for r in serial_results)
    per_turn_s = factory_s / args.turns
    rows = [
        ("factory (concurrent)", factory_s, per_turn_s, [r.latency_s for r in factory_results]),
        ("serial baseline", serial_s, serial_s / args.turns, [r.latency_s for r in serial_results]),
    ]
    calls = args.trajectories * args.turns
    print(f"{args.trajectories} trajectories x {args.turns} turns = {calls} calls; tool latency {args.latency:g} s; "
          f"server concurrency {args.concurrency}")
    print(f"{'mode':<22}{'wall s':>10}{'per turn s':>12}{'call p50 s':>12}{'call p95 s':>12}")
    for name, wall, turn, latencies in rows:
        q = statistics.quantiles(latencies, n=20, method="inclusive")
        print(f"{name:<22}{wall:>10.3f}{turn:>12.3f}{statistics.median(latencies):>12.3f}{q[18]:>12.3f}")
    return {
        "overlap": round(per_turn_s / one_call_s, 3),
        "speedup_vs_serial": round(serial_s / factory_s, 2),
        "factory_s": round(factory_s, 3),
        "serial_s": round(serial_s, 3),
        "one_call_s": round(one_call_s, 4),
        "trajectories": args.trajectories,
        "turns": args.turns,
        "latency_s": args.latency,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Factory tool execution vs one call at a time")
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--latency", type=float, default=0.2, help="seconds each tool call takes on the server")
    parser.add_argument("--concurrency", type=int, default=64, help="the server's `concurrency` in the spec")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # internal: be the tool server
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.serve:
        serve(arguments.latency)
    else:
        print(json.dumps(asyncio.run(main(arguments))))
