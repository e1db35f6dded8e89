"""Benchmark: full-weight training vs LoRA on the quickstart, side by side in one run.

    python bench/lora.py [--r 16] [--steps 4] [--eval-size 8] [--repeats 2] [--quick]

Runs `factory run specs/quickstart.yaml` on each side `--repeats` times, alternating which side goes first,
as users run it (Ray actors, the calculator MCP server,
vLLM where installed, DeepSpeed, MLflow), in a throwaway copy of the repository's specs and prompts: once
as shipped (all 135M weights) and once with `model.lora.r=R` (adapters on every linear layer), everything
else equal -- the same prompts, samples per prompt, micro-batches and steps. Read back from each run's
MLflow store, over the steady steps (not the first, not the last, which also evaluates and checkpoints):

  update s       timing/update_s, mean: the update stage's whole step (old log-probs, forward/backward,
                 optimizer)
  update RSS GB  perf/update_max_rss_gb, the update stage's peak resident memory (its process's maxrss at
                 the last step: weights, gradients, optimizer state, activations)
  sync MB        perf/weight_sync_mb: what one weight sync carried to the rollout (full weights in the
                 engine's dtype, or the adapters)
  sync s         timing/weight_sync_s, mean
  step s         the median time between consecutive steps' records (the whole loop)

Each figure is the median over a side's runs. Each run also says what it did (resolved.update.weight_sync, resolved.rollout.weight_sync), printed under
the table. Prints a table, then as its LAST line JSON with the four ratios LoRA / full and the targets:
sync_bytes <= 0.05, update_rss <= 0.6, step_time <= 0.8; update_time is reported beside them.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, installed or not

from bench.common import cpu, cpu_line, factory_run, judge_targets, median, print_json, table

TARGETS = {"sync_bytes": ("<=", 0.05), "update_rss": ("<=", 0.6), "step_time": ("<=", 0.8)}


def overrides(a: argparse.Namespace, lora: bool) -> list[str]:
    out = [f"train.steps={a.steps}", f"train.eval_size={a.eval_size}", "train.checkpoint_dir=ckpt"]
    if a.quick:  # the tiny model on the same task: a smoke test of the wiring, not a measurement
        out += ["model.path=factory:tiny-qwen3-calc", "chat_template=null", "data.prompt=prompts/arith.jinja",
                "rollout.group_size=2", "rollout.max_new_tokens=16", "train.prompts_per_step=2", "train.micro_batch=4"]
    if lora:
        out.append(f"model.lora.r={a.r}")
    return out


def summary(run) -> dict[str, float]:
    steps = run.steady_steps
    last = max(run.metrics)
    return {"update_s": run.mean("timing/update_s", steps), "rss_gb": run.metrics[last]["perf/update_max_rss_gb"],
            "sync_mb": run.mean("perf/weight_sync_mb", steps), "sync_s": run.mean("timing/weight_sync_s", steps),
            "step_s": median(run.periods)}


def main(a: argparse.Namespace) -> dict:
    from factory.assets import resolve_model

    resolve_model("factory:tiny-qwen3-calc" if a.quick else "factory:smollm2-135m-instruct")  # outside any timing
    print(cpu_line())
    print(f"specs/quickstart.yaml, {a.steps} steps per run, evaluation on {a.eval_size} questions; LoRA r={a.r} on "
          "every linear layer" + (" (--quick: tiny model)" if a.quick else ""))
    runs: dict[str, list[dict[str, float]]] = {}
    chose = {}
    sides = (("full", False), (f"lora r={a.r}", True))
    with tempfile.TemporaryDirectory(prefix="factory-bench-lora-") as tmp:
        for repeat in range(a.repeats):  # alternating which goes first: a VM's drift falls on both sides
            for label, lora in sides if repeat % 2 == 0 else sides[::-1]:
                folder = Path(tmp) / f"{'lora' if lora else 'full'}-{repeat}"
                for name in ("specs", "prompts"):
                    shutil.copytree(ROOT / name, folder / name)
                (folder / "spec.yaml").write_text((ROOT / "specs/quickstart.yaml").read_text())
                run = factory_run(folder, overrides(a, lora))
                runs.setdefault(label, []).append(summary(run))
                p = run.params
                chose[label] = {k: p.get(f"resolved.{k}", "?") for k in ("update.weight_sync", "rollout.weight_sync",
                                                                            "rollout.engine", "update.autocast")}
    results = {label: {k: median([r[k] for r in rs]) for k in rs[0]} for label, rs in runs.items()}  # per key
    full, lora = results["full"], results[f"lora r={a.r}"]
    rows = [(label, r["update_s"], r["rss_gb"], r["sync_mb"], r["sync_s"], r["step_s"]) for label, r in results.items()]
    rows.append(("lora / full", *(lora[k] / full[k] if full[k] else float("nan")
                                  for k in ("update_s", "rss_gb", "sync_mb", "sync_s", "step_s"))))
    print(table(["", "update s", "update RSS GB", "sync MB", "sync s", "step s"], rows, first=14, width=14))
    for label, c in chose.items():
        print(f"{label}: " + ", ".join(f"{k} {v}" for k, v in c.items()))
    ratios = {"sync_bytes": lora["sync_mb"] / full["sync_mb"], "update_rss": lora["rss_gb"] / full["rss_gb"],
              "step_time": lora["step_s"] / full["step_s"], "update_time": lora["update_s"] / full["update_s"]}
    ratios = {k: round(v, 4) for k, v in ratios.items()}
    return {**ratios, **judge_targets(ratios, TARGETS, source="issue #25"), "r": a.r, "steps": a.steps,
            "repeats": a.repeats,
            "full": {k: round(v, 3) for k, v in full.items()}, "lora": {k: round(v, 3) for k, v in lora.items()},
            "quick": a.quick, "cpu": cpu()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="full-weight vs LoRA training on the quickstart, side by side")
    parser.add_argument("--r", type=int, default=16, help="LoRA rank")
    parser.add_argument("--steps", type=int, default=4, help="steps per run (the first and last are not timed)")
    parser.add_argument("--eval-size", type=int, default=8, help="held-out questions at step 0 and the end")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs a side, alternating which goes first; each figure is the median over them")
    parser.add_argument("--quick", action="store_true", help="the tiny model, 3 steps, one run a side (a smoke test)")
    a = parser.parse_args(argv)
    if a.quick:
        a.steps, a.repeats = 3, 1
    if a.steps < 3:
        parser.error("--steps must be at least 3 (the first and last steps are not timed)")
    return a


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    print_json(main(parse_args()))
