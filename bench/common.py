"""What the step-time benchmarks share: the CPU they ran on, `factory run` in a throwaway project with its
per-step numbers read back from MLflow, medians and plain tables.

Every benchmark prints a table and, as its LAST line, one JSON object of ratios measured side by side in
the same run (the machines are shared and noisy: never compare numbers from different runs).
"""
from __future__ import annotations

import argparse

import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# The variables that make an AVX512/AMX machine compute like an AVX2-only one (no fast bf16 kernels).
AVX2_EMULATION = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def cpu() -> dict[str, Any]:
    """The CPU the numbers come from: model, cores, the vector flags that decide bf16 speed, whether bf16
    is native for Factory (factory.device) and whether AVX2 is being emulated on a bigger machine
    (AVX2_EMULATION in the environment)."""
    from factory.device import cpu as device_cpu

    info: dict[str, str] = {}  # the first core's /proc/cpuinfo lines
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    emulated = all(os.environ.get(k) == v for k, v in AVX2_EMULATION.items())
    # lscpu's model name alone ("AMD EPYC") is the same on a Zen 3, 4 and 5: family and model tell them apart
    return {"model": info.get("model name", "unknown"), "family": info.get("cpu family"), "model_id": info.get("model"),
            "stepping": info.get("stepping"), "virtual": "hypervisor" in flags, "cores": os.cpu_count(),
            "flags": [f for f in wanted if f in flags], "bf16_native": device_cpu().fast_bf16,
            "avx2_emulated": emulated, "faked": os.environ.get("FACTORY_FAKE_CPU"), **_run()}


def _run() -> dict[str, Any]:
    """When and at which commit the numbers were taken (a dirty tree says so)."""
    import datetime
    import subprocess

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "--short=10", "HEAD") or None
    dirty = bool(git("status", "--porcelain", "--untracked-files=no")) if commit else None
    return {"commit": commit, "dirty": dirty, "utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")}


def cpu_line() -> str:
    c = cpu()
    name = f"{c['model']} (family {c['family']} model {c['model_id']})" if c["family"] else c["model"]
    kind = f"AVX2 emulated on {name}" if c["avx2_emulated"] else name
    return (f"CPU: {kind}, {c['cores']} cores, flags {' '.join(c['flags']) or '-'}, "
            f"bf16 {'native' if c['bf16_native'] else 'emulated'}{' (faked: FACTORY_FAKE_CPU)' if c['faked'] else ''}"
            f"; at {c['commit'] or '?'}{'+dirty' if c['dirty'] else ''}, {c['utc']}")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pythonpath(*first: Path | str) -> str:
    """PYTHONPATH for a child `factory` process: `first` (the checkout, a project) ahead of the caller's own
    PYTHONPATH, which is kept: packages installed with `pip --target` must stay importable there."""
    return os.pathsep.join([*map(str, first), *filter(None, [os.environ.get("PYTHONPATH")])])


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, first: int = 28, width: int = 12) -> str:
    """A plain fixed-width table: the first column left-aligned, numbers right-aligned, cells a space apart
    (so that a header as wide as its column does not run into the next)."""
    def cell(v: Any, w: int, left: bool) -> str:
        text = f"{v:.3f}" if isinstance(v, float) else str(v)
        return text.ljust(w) if left else text.rjust(w)

    def line(r: Sequence[Any]) -> str:
        return " ".join(cell(v, first if i == 0 else width, i == 0) for i, v in enumerate(r)).rstrip()

    lines = [line(headers)] + [line(r) for r in rows]
    return "\n".join(lines)


@dataclass
class FactoryRun:
    """One `factory run`: its per-step metrics and the wall time of each steady step."""

    metrics: dict[int, dict[str, float]]  # step -> every metric logged at that step
    periods: list[float]  # seconds between consecutive steps' metric records (see factory_run)
    wall_s: float  # the whole command, start-up included
    store: str = ""  # the MLflow tracking URI
    run_id: str = ""
    stderr: str = field(repr=False, default="")
    params: dict[str, str] = field(default_factory=dict)  # the run's MLflow params (the spec, `resolved.*`)
    period_of: dict[int, float] = field(default_factory=dict)  # the same by step (a step with no record before it: none)

    def mean(self, key: str, steps: Sequence[int] | None = None) -> float:
        steps = steps or self.steady_steps
        values = [self.metrics[s][key] for s in steps if key in self.metrics.get(s, {})]
        return statistics.fmean(values) if values else float("nan")

    @property
    def steady_steps(self) -> list[int]:
        """Steps whose period is measured: not the first (its start is not a step end) and not the last
        (it also runs the final evaluation and checkpoint)."""
        steps = sorted(s for s in self.metrics if s > 0)
        return steps[1:-1]


def write_project(folder: Path, spec: str, files: dict[str, str] | None = None) -> Path:
    """A project folder holding `spec.yaml` and any extra files; returns the spec's path."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (files or {}).items():
        (folder / name).write_text(text)
    path = folder / "spec.yaml"
    path.write_text(spec)
    return path


def factory_run(project: Path, overrides: Sequence[str] = (), *, timeout_s: float = 1800) -> FactoryRun:
    """`factory run spec.yaml` as a user runs it (its own process, its own local Ray, a sqlite MLflow store
    in the project), then its metrics read back from MLflow.

    A step's period is the time between the MLflow records of two consecutive steps: everything the loop
    does per step (data, rollout, tools, reward, update, weight sync, logging) and nothing of start-up.
    """
    store = f"sqlite:///{project}/mlflow.db"
    env = {**os.environ, "MLFLOW_TRACKING_URI": store, "PYTHONPATH": pythonpath(ROOT, project)}
    env.pop("RAY_ADDRESS", None)  # a local Ray of its own, never a cluster the caller happens to point at
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "factory.commands.cli", "run", "spec.yaml", *overrides], cwd=project,
                         env=env, capture_output=True, text=True, timeout=timeout_s,
                         check=False)
    wall = time.perf_counter() - started
    if out.returncode != 0:
        raise SystemExit(f"factory run failed in {project} (exit {out.returncode}):\n{out.stderr[-3000:]}")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              order_by=["attributes.start_time DESC"], max_results=1)
    run = runs[0]
    metrics: dict[int, dict[str, float]] = {}
    stamps: dict[int, int] = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            metrics.setdefault(m.step, {})[key] = m.value
            if key == "timing/step_s":
                stamps[m.step] = m.timestamp
    result = FactoryRun(metrics, [], wall, store, run.info.run_id, out.stderr, dict(run.data.params))
    result.period_of = {s: (stamps[s] - stamps[s - 1]) / 1000 for s in result.steady_steps if s - 1 in stamps}
    result.periods = list(result.period_of.values())
    return result


def workload_arguments(parser: "argparse.ArgumentParser", model: str) -> None:
    """The options every step benchmark shares: what is sampled, how much of it, how often, on how many
    threads."""
    parser.add_argument("--model", default=model, help="a Factory model name or HF folder")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (P)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)


def judge_targets(out: dict[str, Any], targets: dict[str, tuple[str, float]], *, source: str) -> dict[str, Any]:
    """Print whether each of `out`'s ratios meets its target (`{"key": ("<=", 0.5)}`), one line each, and
    return the JSON's `targets` and `met` for them (a ratio that was not measured is met: null)."""
    print(f"\ntargets ({source}):")
    met: dict[str, bool | None] = {}
    for key, (op, target) in targets.items():
        value = out.get(key)
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            met[key] = None
        else:
            met[key] = value <= target if op == "<=" else value >= target
        verdict = {None: "not measured", True: "met", False: "NOT met"}[met[key]]
        print(f"  {key} {'-' if met[key] is None else value} (target {op} {target}): {verdict}")
    return {"targets": {key: f"{op} {target}" for key, (op, target) in targets.items()}, "met": met}


def print_json(ratios: dict[str, Any]) -> None:
    """The benchmark's last line: valid JSON, a ratio that was not measured (NaN, inf) as null."""
    def plain(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return [plain(x) for x in v] if isinstance(v, (list, tuple)) else v

    print(json.dumps(plain(ratios), allow_nan=False), flush=True)
