"""`factory diff RUN_A RUN_B`: how two tracked runs differ.

Reads each MLflow run's plan.json artifact and compares what defines a run (the resolved spec, the
hashes of templates, reward sources, data and tool schemas), then the final metrics side by side.
"""
from __future__ import annotations

import json
import math
from typing import Any

from factory.tracking import flatten, tracking_uri


def plan_differences(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(key, value in A, value in B) for every spec setting or hash that differs, sorted by key."""
    fa = dict(flatten({"spec": a.get("spec", {}), "hashes": a.get("hashes", {})}))
    fb = dict(flatten({"spec": b.get("spec", {}), "hashes": b.get("hashes", {})}))
    return [(k, fa.get(k, "<unset>"), fb.get(k, "<unset>"))
            for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k) and k != "hashes.run"]


def metric_differences(a: dict[str, float], b: dict[str, float]) -> list[tuple[str, float | None, float | None]]:
    keys = sorted(k for k in set(a) | set(b) if not k.startswith("timing/"))
    return [(k, a.get(k), b.get(k)) for k in keys]


def _load(client: Any, run_id: str) -> tuple[Any, dict[str, Any]]:
    run = client.get_run(run_id)
    try:
        with open(client.download_artifacts(run_id, "plan.json"), encoding="utf-8") as f:
            plan = json.load(f)
    except Exception:  # a run not made by factory has no plan: compare params only
        plan = {"spec": run.data.params}
    return run, plan


def main(args: Any) -> int:
    from mlflow.tracking import MlflowClient
    from rich.console import Console
    from rich.table import Table

    console = Console()
    client = MlflowClient(tracking_uri(getattr(args, "uri", None)))
    run_a, plan_a = _load(client, args.run_a)
    run_b, plan_b = _load(client, args.run_b)
    diffs = plan_differences(plan_a, plan_b)
    table = Table(title=f"what differs: A={args.run_a[:8]} B={args.run_b[:8]}")
    for col in ("setting", "A", "B"):
        table.add_column(col, overflow="fold")
    for key, va, vb in diffs:
        table.add_row(key, va, vb)
    console.print(table if diffs else "the two runs were defined identically (same spec and hashes)")
    metrics = Table(title="final metrics")
    for col in ("metric", "A", "B"):
        metrics.add_column(col)
    fmt = lambda v: "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4g}"
    for key, va, vb in metric_differences(run_a.data.metrics, run_b.data.metrics):
        metrics.add_row(key, fmt(va), fmt(vb))
    console.print(metrics)
    return 0
