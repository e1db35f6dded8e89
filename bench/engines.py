"""Benchmark: the vLLM engine vs the transformers engine on the quickstart's rollouts, each in a process of its own.

    python bench/engines.py [--spec specs/quickstart.yaml] [--rounds 3] [--eval 64]

Both engines run inside the real rollout stage (factory.rollout.stage.RolloutStage: the multi-turn agent
loop, the quickstart's chat template and few-shot prompt, real calls to the calculator MCP server), on the
same prompt batches with the same per-request seeds, in the dtype `rollout.dtype: auto` picks on this CPU.
Each engine runs in a process of its own, as in a run's rollout actor, one after the other: transformers,
then vLLM. (In one process the two engines' threads each had an OpenMP team of their own, and libgomp, once
its teams' threads outnumber the cores, wakes every idle worker from sleep at every operation: this bench's
quickstart steps on transformers took 25.5 s there against 22.6 s alone, float32 on the AMX Xeon;
docs/performance.md, "One thread for torch", and docs/engines.md.)
Each process starts its engine (timed: the start-up that `engine: auto` weighs), runs one warm-up step's
rollout, then `--rounds` training steps' rollouts (train.prompts_per_step x rollout.group_size, sampled);
`--eval N` adds the greedy evaluation of N held-out questions.

Prints a table, then as its last line JSON: `vllm_over_hf` (median model tokens per second of generation
time, vLLM / transformers), `step_time_ratio` (median rollout wall time of a training step, transformers /
vLLM: above 1 means vLLM's steps are faster), both start-ups, and `saved_s_per_token_param` (the generation
time vLLM saves per sampled token per model parameter: `engine: auto`'s SAVED_S_PER_TOKEN_PARAM), with the
CPU and whether AVX2 was emulated (ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 make an AVX512 machine
compute like an AVX2-only one).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, installed or not

HEADER = (f"{'engine':6} {'kind':5} {'round':>5} {'wall s':>7} {'gen s':>7} {'tokens':>6} {'tok/s':>7} "
          f"{'calls':>5} {'batches':>7}")


async def run_engine(name: str, spec_path: str, rounds: int, eval_size: int) -> dict:
    """One engine in this process: its start-up, a warm-up step, `rounds` steps and the evaluation."""
    from factory.assets import resolve_model
    from factory.compiler.compile import compile_file
    from factory.data import DataStage
    from factory.rollout.engine import model_params
    from factory.rollout.stage import RolloutStage
    from factory.tools.stage import ToolsStage
    from factory.types import Placement

    spec, plan = compile_file(spec_path)
    data = DataStage(plan.stage("data").settings.model_copy(update={"eval_size": eval_size or None}))
    data.setup()
    tools = ToolsStage(plan.stage("tools").settings) if spec.tools else None
    if tools is not None:
        await tools.setup(Placement(workdir=os.getcwd()))
    settings = plan.stage("rollout").settings
    stage = RolloutStage(settings.model_copy(update={"rollout": spec.rollout.model_copy(update={"engine": name})}))
    t0 = time.perf_counter()
    info = await stage.setup(Placement(workdir=os.getcwd(), peers={settings.tool_peer: tools} if tools else {}))
    started = time.perf_counter() - t0
    print(f"{name}: started in {started:.1f} s ({info['resolved']})", flush=True)
    rows = []

    async def one(kind: str, batch, greedy: bool, r: int) -> None:
        t0 = time.perf_counter()
        part = await (stage.evaluate(batch, step=r) if greedy else stage.generate(batch, step=r))
        trajs, m = stage.merge([part])
        rows.append({"engine": name, "kind": kind, "round": r, "wall_s": time.perf_counter() - t0,
                     "generate_s": m["timing/generate_s"], "tokens": sum(t.num_model_tokens for t in trajs),
                     "tok_s": m["perf/generate_tokens_per_s"], "calls": sum(t.num_tool_calls for t in trajs),
                     "batches": m["rollout/engine_batches"]})
        print(_row(rows[-1]), flush=True)

    try:
        for r in range(rounds + 1):  # the same batches in both processes: the data stage's seeded order
            await one("warm" if r == 0 else "step", data.next_batch(spec.train.prompts_per_step), False, r)
        if eval_size:
            await one("eval", data.eval_batch(), True, 0)
    finally:
        await stage.close()
        if tools is not None:
            await tools.close()
    return {"started_s": started, "rows": rows, "params": model_params(resolve_model(settings.model.path)),
            "dtype": info["resolved"].get("dtype")}


def _row(x: dict) -> str:
    return (f"{x['engine']:6} {x['kind']:5} {x['round']:>5} {x['wall_s']:7.1f} {x['generate_s']:7.1f} "
            f"{x['tokens']:6d} {x['tok_s']:7.1f} {x['calls']:5d} {x['batches']:7.0f}")


def in_own_process(name: str, args: argparse.Namespace) -> dict:
    """`run_engine(name)` in a child process (its lines shown as they come), started with the environment
    `factory run` starts the spec's rollout stage with (its memory allocator, `train.allocator`); its answer is
    its last line."""
    from factory.compiler.compile import compile_file

    cmd = [sys.executable, __file__, "--spec", args.spec, "--rounds", str(args.rounds), "--eval", str(args.eval),
           "--engine-worker", name]
    env = compile_file(args.spec, [f"rollout.engine={name}"])[1].stage("rollout").env
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, **env}) as proc:
        last = ""
        for line in proc.stdout:
            if last:
                print(last, end="", flush=True)
            last = line
    if proc.returncode != 0:
        raise SystemExit(f"the {name} engine's process failed (exit {proc.returncode}): see its output above")
    return json.loads(last)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default=str(ROOT / "specs" / "quickstart.yaml"))
    p.add_argument("--rounds", type=int, default=3, help="measured training-step rollouts per engine")
    p.add_argument("--eval", type=int, default=64, help="held-out questions to evaluate greedily (0 = none)")
    p.add_argument("--engine-worker", choices=("hf", "vllm"), help=argparse.SUPPRESS)  # internal: one engine
    args = p.parse_args()
    args.spec = str(Path(args.spec).resolve())
    os.chdir(Path(args.spec).parent.parent)  # the project folder: prompts/ resolve as in factory run
    if args.engine_worker:
        print(json.dumps(asyncio.run(run_engine(args.engine_worker, args.spec, args.rounds, args.eval))))
        return
    from bench.common import cpu, cpu_line

    print(cpu_line())
    print(HEADER, flush=True)
    runs = {name: in_own_process(name, args) for name in ("hf", "vllm")}
    rows = [row for run in runs.values() for row in run["rows"]]

    def median(name: str, key: str, kind: str = "step") -> float:
        return statistics.median(x[key] for x in rows if x["engine"] == name and x["kind"] == kind)

    hf_rate, vllm_rate = median("hf", "tok_s"), median("vllm", "tok_s")
    params = runs["hf"]["params"]
    print(json.dumps({
        "vllm_over_hf": round(vllm_rate / hf_rate, 3),
        "step_time_ratio": round(median("hf", "wall_s") / median("vllm", "wall_s"), 3),
        **({"eval_time_ratio": round(median("hf", "wall_s", "eval") / median("vllm", "wall_s", "eval"), 3)}
           if args.eval else {}),
        "started_s": {name: round(run["started_s"], 1) for name, run in runs.items()},
        "saved_s_per_token_param": float(f"{(1 / hf_rate - 1 / vllm_rate) / params:.3g}"),
        "params": params, "dtype": runs["hf"]["dtype"], "cpu": cpu(),
    }))


if __name__ == "__main__":
    main()
