"""The CUDA check (bin/gpu-check): what a GPU machine must do, as real `factory run`s, in at most 10 minutes.

    python bench/gpu_check.py [--only NAME ...] [--per-run-timeout 170] [--budget 560] [--dry-run]

Checks (each one `factory run` in a throwaway project folder, one GPU shared by the rollout and the update
with `resources.rollout.num_gpus=0.5 resources.update.num_gpus=0.5`):

  tiny_vllm        specs/tiny.yaml on vLLM CUDA, the update on CUDA under bf16 autocast
  quickstart_bf16  three steps of specs/quickstart.yaml, vLLM in bf16, bf16 autocast update (full weights),
                   vLLM asleep during each update (`rollout.vllm_sleep`)
  quickstart_lora  the same with `model.lora.r=16` (adapter-only sync) and TIS
                   (`algorithm.rollout_correction: {kind: tis}`)
  tiny_hf, tiny_lora_hf  (asked for by name) the tiny spec, without and with LoRA + TIS, on transformers'
                   engine on CUDA: a GPU machine without vLLM
  tiny_bf16_zero2_hf, tiny_zero3_hf  (by name) the same with bf16 weights (DeepSpeed's bf16 mode) under
                   ZeRO-2, and with ZeRO-3 (partitioned weights gathered for each sync)

Read back from each run's MLflow store: where each stage ran and in what dtype (resolved.* params),
generation tokens/s, step, update and weight-sync times, and the engine/learner log-prob agreement after a
sync (`rollout/logprob_diff_mean` and `_max` of the steps after the first, whose weights came through a
sync). A check is ok when every stage ran where and how it was asked, the run ended, the log-probs agree
within AGREE_MEAN on average, and (LoRA) the sync carried adapters and TIS weighed the loss.

Prints a line per check, then as its LAST line one JSON object: {"machine", "checks": {name: {...}},
"ok"}. The checks share a budget (--budget, under bin/gpu-check's `timeout 590`): each run gets at most what
is left of it, a check with too little left is not run (`not_run` says so), and a SIGTERM (what `timeout`
sends) ends the script with the line of what finished. `--dry-run` prints the same JSON shape with each
check's command instead of running it (what the tests check on a CPU). Exits 1 when a check failed or
there is no CUDA device.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import pythonpath  # noqa: E402
from factory.runtime.lifecycle import sigterm_restored  # noqa: E402

# bf16 engine vs bf16-autocast learner: different kernels in a coarse dtype. A missed or half-applied sync
# moves log-probs by 0.1 and more (see tests/test_rollout_vllm.py); this bound only has to sit below that.
AGREE_MEAN = 0.05
# seconds kept from a run's share of the budget: reading its MLflow store back, then printing
READ_BACK_S = 20
# a run given less cannot start Ray, the stages and the engine, let alone take a step: not started
MIN_RUN_S = 60
ONE_GPU = ["resources.rollout.num_gpus=0.5", "resources.update.num_gpus=0.5", "tracking.experiment=gpu-check"]


@dataclass(frozen=True)
class Check:
    spec: str
    overrides: tuple[str, ...]
    expect: dict[str, str] = field(default_factory=dict)  # resolved.* params the run must report
    lora: bool = False
    tis: bool = False

    def argv(self) -> list[str]:
        return ["run", self.spec, *self.overrides, *ONE_GPU]


ON_CUDA = {"rollout.device": "cuda", "update.device": "cuda", "update.autocast": "bfloat16"}
QUICKSTART = ("train.steps=3", "train.eval_size=8", "rollout.engine=vllm", "rollout.kv_cache_gb=4",
              "train.bf16_autocast=true")
# The tiny spec on transformers' engine, for a GPU machine without vLLM (upstream vLLM pins its own torch
# build): the rollout on CUDA, the bf16-autocast DeepSpeed update, the sync and the log-prob agreement.
# More prompts and a gentler lr than the tiny spec's: on the H200 its 2 prompts x 4 at lr 1e-3 left every group of
# steps 2-3 with equal rewards, so no row was trained after a sync and the agreement went unmeasured (NaN).
TINY_HF = ("train.steps=4", "train.prompts_per_step=8", "train.lr=2e-4", "rollout.engine=hf",
           "train.bf16_autocast=true", "train.threads=4")
CHECKS: dict[str, Check] = {
    "tiny_vllm": Check("specs/tiny.yaml", ("train.steps=3", "rollout.engine=vllm", "train.bf16_autocast=true",
                                           "train.threads=4", "rollout.kv_cache_gb=2"),
                       {**ON_CUDA, "rollout.engine": "vllm"}),
    # vLLM asleep during each update (rollout.vllm_sleep): the log-prob agreement after a sync shows the weights
    # it woke with are the new ones
    "quickstart_bf16": Check("specs/quickstart.yaml", (*QUICKSTART, "rollout.vllm_sleep=true"),
                             {**ON_CUDA, "rollout.engine": "vllm", "rollout.dtype": "bfloat16",
                              "rollout.vllm_sleep": "True"}),
    # on CUDA `vllm_lora: auto` serves the adapters (vLLM's LoRA kernels), and vLLM compiles (CUDA graphs): the
    # paths no CPU run takes
    "quickstart_lora": Check("specs/quickstart.yaml",
                             (*QUICKSTART, "model.lora.r=16", "algorithm.rollout_correction.kind=tis"),
                             {**ON_CUDA, "rollout.engine": "vllm", "rollout.dtype": "bfloat16",
                              "rollout.weight_sync": "lora served by vLLM", "rollout.vllm_compiled": "True"},
                             lora=True, tis=True),
    "tiny_hf": Check("specs/tiny.yaml", TINY_HF, {**ON_CUDA, "rollout.engine": "hf"}),
    "tiny_lora_hf": Check("specs/tiny.yaml", (*TINY_HF, "model.lora.r=16", "algorithm.rollout_correction.kind=tis"),
                          {**ON_CUDA, "rollout.engine": "hf"}, lora=True, tis=True),
    # DeepSpeed's own bf16 mixed precision (bf16 weights, fp32 master copy in the optimizer) under ZeRO-2,
    # instead of fp32 weights under autocast: the other precision path a GPU user picks.
    "tiny_bf16_zero2_hf": Check("specs/tiny.yaml", (*TINY_HF, "model.dtype=bfloat16", "train.deepspeed.zero_stage=2"),
                                {"rollout.device": "cuda", "update.device": "cuda", "update.dtype": "bfloat16",
                                 "update.autocast": "off", "rollout.engine": "hf"}),
    # ZeRO-3: the parameters are partitioned, so the weight sync has to gather them before sending.
    "tiny_zero3_hf": Check("specs/tiny.yaml", (*TINY_HF, "train.deepspeed.zero_stage=3"),
                           {**ON_CUDA, "rollout.engine": "hf"}),
}
DEFAULT = ["tiny_vllm", "quickstart_bf16", "quickstart_lora"]  # the vLLM ones; the hf ones are asked for by name


def machine() -> dict[str, Any]:
    import torch

    from factory.device import cuda_devices

    gpus = [f"{d.name} ({d.why}, bf16 {'native' if d.fast_bf16 else 'emulated'})" for d in cuda_devices()]
    return {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "gpus": gpus, "vllm": _version("vllm"), "deepspeed": _version("deepspeed"), "peft": _version("peft")}


def _version(package: str) -> str | None:
    if importlib.util.find_spec(package) is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "installed"


def run_check(name: str, check: Check, timeout: int) -> dict[str, Any]:
    """One `factory run` of `check`; what it measured and whether it passed."""
    from mlflow.tracking import MlflowClient

    work = Path(tempfile.mkdtemp(prefix=f"gpu-check-{name}-"))
    for folder in ("specs", "prompts"):
        shutil.copytree(ROOT / folder, work / folder)
    uri = f"sqlite:///{work}/mlflow.db"
    # vLLM's warnings (weights a reload did not load, a prefix cache it could not drop) shown: a run keeps them
    # below ERROR, and a first run on a GPU is where they say what went wrong
    env = {"VLLM_LOGGING_LEVEL": "WARNING", **os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": pythonpath(ROOT)}
    env.pop("RAY_ADDRESS", None)
    t0 = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, "-m", "factory.commands.cli", *check.argv()], cwd=work, env=env,
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # what it printed, to diagnose within the device's few minutes
        tail = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        return {"ok": False, "error": f"timed out after {timeout} s; the end of its output:\n{tail[-3000:]}"}
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        return {"ok": False, "wall_s": round(wall, 1), "error": out.stderr[-3000:]}
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("gpu-check").experiment_id])
    history = {k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)] for k in run.data.metrics}
    resolved = {k.removeprefix("resolved."): v for k, v in run.data.params.items() if k.startswith("resolved.")}
    return judge(check, history, resolved, wall)


def judge(check: Check, history: dict[str, list[tuple[int, float]]], resolved: dict[str, str],
          wall: float) -> dict[str, Any]:
    """The check's result from a run's metric histories (name -> [(step, value)]) and resolved params."""
    last = max((step for values in history.values() for step, _ in values), default=0)

    def after_sync(name: str, pick=statistics.median, timed: bool = False) -> float:
        # step 1 sampled with the initial weights; a time leaves out the last step too (it also evaluates
        # and checkpoints), unless nothing else is left
        values = [v for step, v in history.get(name, []) if step > 1 and not (timed and step == last)]
        if timed and not values:
            values = [v for step, v in history.get(name, []) if step > 1]
        return pick(values) if values else float("nan")

    problems = [f"resolved.{k} is {resolved.get(k)!r}, not {v!r}" for k, v in check.expect.items() if resolved.get(k) != v]
    diff_mean, diff_max = after_sync("rollout/logprob_diff_mean"), after_sync("rollout/logprob_diff_max", max)
    if not diff_mean < AGREE_MEAN:  # NaN (never measured) fails too
        problems.append(f"engine/learner log-probs after a sync differ by {diff_mean:.4g} on average (bound {AGREE_MEAN})")
    if check.lora and not resolved.get("update.weight_sync", "").startswith("adapters"):
        problems.append(f"the sync carried {resolved.get('update.weight_sync')!r}, not the adapters")
    if check.tis and math.isnan(after_sync("actor/tis_weight_mean")):
        problems.append("TIS was asked for but no actor/tis_weight_mean was logged")
    result = {"ok": not problems, "wall_s": round(wall, 1),
              "generate_tokens_per_s": round(after_sync("perf/generate_tokens_per_s", timed=True), 1),
              "step_s": round(after_sync("timing/step_s", timed=True), 3),
              "update_s": round(after_sync("timing/update_s", timed=True), 3),
              "weight_sync_s": round(after_sync("timing/weight_sync_s", timed=True), 3),
              "weight_sync_mb": round(after_sync("perf/weight_sync_mb"), 2),
              "logprob_diff_mean": diff_mean, "logprob_diff_max": diff_max,
              "tis_weight_mean": after_sync("actor/tis_weight_mean"), "resolved": resolved}
    if problems:
        result["error"] = "; ".join(problems)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=sorted(CHECKS), default=DEFAULT, metavar="NAME",
                   help=f"run these checks only (default: {', '.join(DEFAULT)}; without vLLM: tiny_hf tiny_lora_hf)")
    p.add_argument("--per-run-timeout", type=int, default=170, help="seconds per factory run")
    p.add_argument("--budget", type=int, default=560,
                   help="seconds for all the checks (bin/gpu-check's `timeout 590`, less the time to start and print)")
    p.add_argument("--dry-run", action="store_true", help="print each check's command as the JSON line; run nothing")
    return p.parse_args(argv)


class _Stopped(Exception):
    """A SIGTERM: bin/gpu-check's `timeout` ran out."""


def _stop(signum: int, frame: Any) -> None:
    # `timeout` signals this process, then its whole group: the second must not cut the line being printed
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise _Stopped  # (subprocess.run kills the run in flight as this passes through it)


def main(argv: list[str] | None = None, clock: Callable[[], float] = time.monotonic) -> int:
    start = clock()
    args = parse_args(argv)
    if args.dry_run:
        checks = {n: {"command": ["factory", *CHECKS[n].argv()], "expect": CHECKS[n].expect} for n in args.only}
        print(json.dumps({"machine": None, "checks": checks, "ok": None, "dry_run": True}))
        return 0
    with sigterm_restored():  # (main is called in-process by the tests)
        signal.signal(signal.SIGTERM, _stop)  # killed without the JSON line, the checks that finished were lost
        return _run_checks(args, start, clock)


def _run_checks(args: argparse.Namespace, start: float, clock: Callable[[], float]) -> int:
    results: dict[str, dict[str, Any]] = {}
    info: dict[str, Any] | None = None
    try:
        info = machine()
        if not info["cuda_available"]:
            print("no CUDA device visible: this check needs an NVIDIA GPU", file=sys.stderr)
            print(json.dumps({"machine": info, "checks": {}, "ok": False}))
            return 1
        for name in args.only:
            left = args.budget - (clock() - start) - READ_BACK_S
            if left < MIN_RUN_S:
                results[name] = {"ok": False, "not_run": f"{left + READ_BACK_S:.0f} s of the {args.budget} s "
                                                         f"budget were left (a run needs {MIN_RUN_S} s)"}
                print(f"{name:16} not run: {results[name]['not_run']}", flush=True)
                continue
            results[name] = {"ok": False, "error": "stopped (SIGTERM) while it ran"}  # until it returns
            r = results[name] = run_check(name, CHECKS[name], int(min(args.per_run_timeout, left)))
            shown = {k: r[k] for k in ("wall_s", "generate_tokens_per_s", "step_s", "update_s", "weight_sync_s",
                                       "logprob_diff_mean") if k in r}
            print(f"{name:16} {'ok' if r['ok'] else 'FAILED'} {shown}", flush=True)
            if not r["ok"]:
                print(f"{name}: {r['error']}", file=sys.stderr, flush=True)
    except _Stopped:
        for name in args.only:
            results.setdefault(name, {"ok": False, "not_run": "stopped (SIGTERM) before it ran"})
    ok = all(r["ok"] for r in results.values())
    print(json.dumps({"machine": info, "checks": results, "ok": ok}, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
