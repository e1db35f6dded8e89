"""The CUDA check (bin/gpu-check): specs/tiny.yaml with the rollout on CUDA through the transformers and
the vLLM engine, and the update on CUDA under bf16 autocast; prints tokens/s and step times.

    python bench/gpu_check.py [--steps 3] [--per-run-timeout 250]

Each engine is one real `factory run` (Ray, the calculator MCP server, DeepSpeed, MLflow) in a throwaway
project folder, with `resources.rollout.num_gpus=0.5 resources.update.num_gpus=0.5` so that one GPU
holds both stages. The numbers are read back from the run's MLflow store: the median over the steps after
the first (the first pays CUDA graph capture and kernel warm-up). Exits 1 when a stage did not run where
it was asked to (rollout on cuda, update on cuda with bf16 autocast) or a run failed.

Prints a table, then as its last line JSON with each engine's numbers and `vllm_over_hf` (generation
tokens/s) when both ran.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def machine() -> dict:
    import torch

    from factory.device import cuda_devices

    gpus = [f"{d.name} ({d.why}, bf16 {'native' if d.fast_bf16 else 'emulated'})" for d in cuda_devices()]
    return {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "gpus": gpus, "vllm": _version("vllm"), "deepspeed": _version("deepspeed")}


def _version(package: str) -> str | None:
    if importlib.util.find_spec(package) is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "installed"


def run_tiny(engine: str, steps: int, timeout: int) -> dict:
    """One `factory run specs/tiny.yaml` on CUDA; its metrics and resolved choices from MLflow."""
    from mlflow.tracking import MlflowClient

    work = Path(tempfile.mkdtemp(prefix=f"gpu-check-{engine}-"))
    for folder in ("specs", "prompts"):
        shutil.copytree(ROOT / folder, work / folder)
    uri = f"sqlite:///{work}/mlflow.db"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    argv = [sys.executable, "-m", "factory.commands.cli", "run", "specs/tiny.yaml", f"train.steps={steps}",
            f"rollout.engine={engine}", "resources.rollout.num_gpus=0.5", "resources.update.num_gpus=0.5",
            "train.bf16_autocast=true", "train.threads=4", "rollout.kv_cache_gb=2", "tracking.experiment=gpu-check"]
    t0 = time.perf_counter()
    try:
        out = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"engine": engine, "ok": False, "error": f"timed out after {timeout} s"}
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        return {"engine": engine, "ok": False, "error": out.stderr[-3000:]}
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("gpu-check").experiment_id])

    def median(name: str) -> float:
        values = [m.value for m in client.get_metric_history(run.info.run_id, name) if m.step > 1]
        values = values or [m.value for m in client.get_metric_history(run.info.run_id, name)]
        return statistics.median(values) if values else float("nan")

    resolved = {k.removeprefix("resolved."): v for k, v in run.data.params.items() if k.startswith("resolved.")}
    on_cuda = (resolved.get("rollout.device") == "cuda" and resolved.get("update.device") == "cuda"
               and resolved.get("update.autocast") == "bfloat16" and resolved.get("rollout.engine") == engine)
    return {"engine": engine, "ok": on_cuda, "wall_s": round(wall, 1),
            "generate_tokens_per_s": round(median("perf/generate_tokens_per_s"), 1),
            "step_s": round(median("timing/step_s"), 3), "generate_s": round(median("timing/generate_s"), 3),
            "update_s": round(median("timing/update_s"), 3), "weight_sync_s": round(median("timing/weight_sync_s"), 3),
            "update_tokens_per_s": round(median("perf/update_tokens_per_s"), 1), "resolved": resolved,
            **({} if on_cuda else {"error": "a stage did not run on CUDA as asked (see resolved)"})}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--per-run-timeout", type=int, default=250)
    args = p.parse_args()
    info = machine()
    print(json.dumps(info, indent=1))
    if not info["cuda_available"]:
        print("no CUDA device visible: this check needs an NVIDIA GPU", file=sys.stderr)
        return 1
    engines = ["hf"] + (["vllm"] if info["vllm"] else [])
    if not info["vllm"]:
        print("vllm is not installed (pip install vllm): the vLLM row is skipped", file=sys.stderr)
    results = []
    print(f"{'engine':6} {'ok':3} {'wall s':>7} {'gen tok/s':>9} {'step s':>7} {'gen s':>7} {'update s':>8} "
          f"{'sync s':>7} {'upd tok/s':>9}  resolved")
    for engine in engines:
        r = run_tiny(engine, args.steps, args.per_run_timeout)
        results.append(r)
        if "wall_s" in r:
            print(f"{engine:6} {'yes' if r['ok'] else 'NO':3} {r['wall_s']:7.1f} {r['generate_tokens_per_s']:9.1f} "
                  f"{r['step_s']:7.3f} {r['generate_s']:7.3f} {r['update_s']:8.3f} {r['weight_sync_s']:7.3f} "
                  f"{r['update_tokens_per_s']:9.1f}  {r['resolved']}", flush=True)
        if not r["ok"]:
            print(f"{engine}: {r['error']}", file=sys.stderr, flush=True)
    summary: dict = {"gpus": info["gpus"], "runs": {r["engine"]: {k: v for k, v in r.items() if k != "engine"}
                                                   for r in results}}
    ok = {r["engine"]: r for r in results if r["ok"]}
    if "hf" in ok and "vllm" in ok:
        summary["vllm_over_hf"] = round(ok["vllm"]["generate_tokens_per_s"] / ok["hf"]["generate_tokens_per_s"], 3)
    print(json.dumps(summary))
    return 0 if len(ok) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
