"""Benchmark: the vLLM engine vs the transformers engine on the quickstart's rollouts, in one process.

    python bench/engines.py [--spec specs/quickstart.yaml] [--rounds 3] [--eval 64]

Both engines run inside the real rollout stage (factory.rollout.stage.RolloutStage: the multi-turn agent
loop, the quickstart's chat template and few-shot prompt, real calls to the calculator MCP server), on the
same prompt batches with the same per-request seeds, in the dtype `rollout.dtype: auto` picks on this CPU.
Each round runs one training step's rollout (train.prompts_per_step x rollout.group_size, sampled) with
both engines, alternating which goes first; `--eval N` adds the greedy evaluation of N held-out questions.

Prints a table, then as its last line JSON: `vllm_over_hf` (median model tokens per second of generation
time, vLLM / transformers) and `step_time_ratio` (median rollout wall time of a training step,
transformers / vLLM: above 1 means vLLM's steps are faster), with the CPU and whether AVX2 was emulated
(ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 make an AVX512 machine compute like an AVX2-only one).
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


async def run(spec_path: str, rounds: int, eval_size: int) -> dict:
    from factory.compiler.compile import compile_file
    from factory.data import DataStage
    from factory.device import cpu, resolve_dtype
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
    batches = [data.next_batch(spec.train.prompts_per_step) for _ in range(rounds + 1)]  # +1: warm-up
    stages = {}
    # transformers first: vLLM's CPU worker pins torch's thread count for the rest of the process.
    for name in ("hf", "vllm"):
        stage = RolloutStage(settings.model_copy(update={"rollout": spec.rollout.model_copy(update={"engine": name})}))
        t0 = time.perf_counter()
        info = await stage.setup(Placement(workdir=os.getcwd(), peers={settings.tool_peer: tools} if tools else {}))
        stages[name] = stage
        print(f"{name}: started in {time.perf_counter() - t0:.1f} s ({info['resolved']})", flush=True)

    rows = []

    async def one(name: str, kind: str, batch, group: int, greedy: bool, r: int) -> None:
        t0 = time.perf_counter()
        stage = stages[name]
        part = await (stage.evaluate(batch, step=r) if greedy else stage.generate(batch, step=r))
        trajs, m = stage.merge([part])
        rows.append({"engine": name, "kind": kind, "round": r, "wall_s": time.perf_counter() - t0,
                     "generate_s": m["timing/generate_s"], "tokens": sum(t.num_model_tokens for t in trajs),
                     "tok_s": m["perf/generate_tokens_per_s"], "calls": sum(t.num_tool_calls for t in trajs),
                     "batches": m["rollout/engine_batches"]})
        print(_row(rows[-1]), flush=True)

    print(f"{'engine':6} {'kind':5} {'round':>5} {'wall s':>7} {'gen s':>7} {'tokens':>6} {'tok/s':>7} "
          f"{'calls':>5} {'batches':>7}")
    group = spec.rollout.group_size
    for r, batch in enumerate(batches):
        order = ("hf", "vllm") if r % 2 == 0 else ("vllm", "hf")
        for name in order:
            await one(name, "warm" if r == 0 else "step", batch, group, False, r)
    if eval_size:
        held_out = data.eval_batch()
        for name in ("vllm", "hf"):
            await one(name, "eval", held_out, 1, True, 0)
    for stage in stages.values():
        await stage.close()
    if tools is not None:
        await tools.close()

    def median(name: str, key: str, kind: str = "step") -> float:
        return statistics.median(x[key] for x in rows if x["engine"] == name and x["kind"] == kind)

    device = cpu()
    return {
        "vllm_over_hf": round(median("vllm", "tok_s") / median("hf", "tok_s"), 3),
        "step_time_ratio": round(median("hf", "wall_s") / median("vllm", "wall_s"), 3),
        **({"eval_time_ratio": round(median("hf", "wall_s", "eval") / median("vllm", "wall_s", "eval"), 3)}
           if eval_size else {}),
        "cpu": device.name,
        "avx2_emulated": os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() == "AVX2",
        "dtype": resolve_dtype(settings.compute),
    }


def _row(x: dict) -> str:
    return (f"{x['engine']:6} {x['kind']:5} {x['round']:>5} {x['wall_s']:7.1f} {x['generate_s']:7.1f} "
            f"{x['tokens']:6d} {x['tok_s']:7.1f} {x['calls']:5d} {x['batches']:7.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default=str(ROOT / "specs" / "quickstart.yaml"))
    p.add_argument("--rounds", type=int, default=3, help="measured training-step rollouts per engine")
    p.add_argument("--eval", type=int, default=64, help="held-out questions to evaluate greedily (0 = none)")
    args = p.parse_args()
    os.chdir(Path(args.spec).resolve().parent.parent)  # the project folder: prompts/ resolve as in factory run
    result = asyncio.run(run(args.spec, args.rounds, args.eval))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
