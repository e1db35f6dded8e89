"""Benchmark: the update with sequence packing vs right-padded micro-batches, side by side in one process.

    python bench/packing.py [--prompts 4] [--repeats 2] [--model factory:smollm2-135m-instruct] [--quick]

The learner (a real DeepSpeed engine, as the update stage runs it) takes one training step on the same
trajectories with `train.packing: off` and `on`, alternated `--repeats` times (each layout's engine takes one
unmeasured step first); everything else is the spec's default (share_prefix on, micro-batches of 8, bf16 autocast where the CPU has it). Two batches:

  deepsearch  DeepSearch-shaped (specs/deepsearch-cpu.yaml): a ~250-token few-shot block every prompt
              shares, a question of 10-40 tokens, 8 samples per prompt whose responses (model turns and
              search results) run from 64 to 384 tokens: lengths within a group vary 2x and more, and the
              update's micro-batches, sorted by (prompt length, total length), are mostly one group each
  uniform     the same with every response 300 tokens long: no padding, what packing costs when it
              saves nothing

Reports each batch's padding fraction (actor/padding_frac: the share of the padded layout that is
padding) and the median update time (timing/update_step_s) of each layout. The LAST line is JSON:
packed_over_padded (deepsearch; target <= 0.8) and packed_over_padded_uniform.
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, installed or not

from bench.common import cpu, cpu_line, judge_targets, median, print_json, table


def trajectories(prompts: int, group: int, uniform: bool, vocab: int, seed: int = 0) -> list:
    from factory.types import Trajectory

    rng = random.Random(seed)
    fewshot = [rng.randrange(100, vocab) for _ in range(250)]
    out = []
    for p in range(prompts):
        question = [rng.randrange(100, vocab) for _ in range(rng.randint(10, 40))]
        for s in range(group):
            n = 300 if uniform else rng.randint(64, 384)
            # two search results (tool tokens, mask 0) between model turns, as a 3-turn episode has
            mask = [0 if n // 3 <= j < n // 3 + n // 6 or 2 * n // 3 <= j < 2 * n // 3 + n // 8 else 1 for j in range(n)]
            out.append(Trajectory(prompt_index=p, sample_index=s, prompt_ids=fewshot + question,
                                  response_ids=[rng.randrange(100, vocab) for _ in range(n)], loss_mask=mask,
                                  turns=[], stop_reason="no_call", row={}, reward=float(rng.random() < 0.5)))
    return out


def main(a: argparse.Namespace) -> dict:
    import torch

    from factory.assets import resolve_model
    from factory.compiler.compile import stage_settings
    from factory.schema import Spec
    from factory.update import Learner

    path = resolve_model(a.model)
    print(cpu_line())
    print(f"model {a.model}; {a.prompts} prompts x 8 samples, micro-batch 8, {a.repeats} repeats per layout")
    vocab = min(int(__import__("json").loads((Path(path) / "config.json").read_text())["vocab_size"]), 49000)
    batches = {"deepsearch": trajectories(a.prompts, 8, False, vocab), "uniform": trajectories(a.prompts, 8, True, vocab)}
    times: dict[tuple[str, str], list[float]] = {}
    padding: dict[str, float] = {}
    for _ in range(a.repeats):
        for packing in ("off", "on"):
            spec = Spec.model_validate({
                "name": "bench-packing", "model": {"path": path}, "data": {"train": {"generator": "x:y"}},
                "rewards": {"r": {"fn": "x:y"}}, "rollout": {"max_total_tokens": 1024},
                "train": {"micro_batch": 8, "lr": 1e-6, "threads": a.threads, "packing": packing}})
            learner = Learner(stage_settings(spec)["update"])
            learner.setup()
            try:
                learner.step(batches["deepsearch"])  # unmeasured: a fresh engine's first step is slower
                for name, trajs in batches.items():
                    stats = learner.step(trajs)
                    times.setdefault((name, packing), []).append(stats["timing/update_step_s"])
                    padding[name] = stats["actor/padding_frac"]
                    assert stats["actor/packed_frac"] == (1.0 if packing == "on" else 0.0)
            finally:
                learner.shutdown()
            torch.set_num_threads(a.threads)
    rows, ratios = [], {}
    for name in batches:
        off, on = median(times[(name, "off")]), median(times[(name, "on")])
        ratios[name] = on / off
        rows.append((name, padding[name], off, on, on / off))
    print(table(["batch", "padding frac", "padded s", "packed s", "packed/padded"], rows, first=12, width=14))
    out = {"packed_over_padded": round(ratios["deepsearch"], 3),
           "packed_over_padded_uniform": round(ratios["uniform"], 3), "padding_frac": round(padding["deepsearch"], 3)}
    return {**out, **judge_targets(out, {"packed_over_padded": ("<=", 0.8)}, source="issue #25"), "cpu": cpu()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    import os

    parser = argparse.ArgumentParser(description="the update with sequence packing vs padded micro-batches")
    parser.add_argument("--model", default="factory:smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--quick", action="store_true", help="the tiny model, 1 repeat (a smoke test)")
    a = parser.parse_args(argv)
    if a.quick:
        a.model, a.prompts, a.repeats = "factory:tiny-qwen3", 2, 1
    return a


if __name__ == "__main__":
    print_json(main(parse_args()))
