"""MLflow tracking: one MLflow run per `factory run`.

params = the flattened resolved spec; artifacts = plan.json, spec.yaml and per-step trajectory tables
(parquet); tags = spec/run hashes and the git commit; metrics as named in DESIGN.md.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from factory.types import Trajectory

DEFAULT_URI = "sqlite:///mlflow.db"
# MLflow refuses param values above this many characters.
_MAX_PARAM = 6000


def tracking_uri(spec_uri: str | None) -> str:
    """The spec's URI, else $MLFLOW_TRACKING_URI, else a sqlite store in the working directory."""
    return spec_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI


def flatten(d: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """`{"a": {"b": 1}}` -> ("a.b", "1"); lists stay whole (as JSON) so a param is one setting."""
    if isinstance(d, dict):
        for k in sorted(d):
            yield from flatten(d[k], f"{prefix}{k}.")
    else:
        value = d if isinstance(d, str) else json.dumps(d, sort_keys=True)
        yield prefix[:-1], value[:_MAX_PARAM]


def git_commit(path: str | Path = ".") -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def trajectory_records(trajs: list[Trajectory], step: int, tokenizer: Any | None = None) -> list[dict[str, Any]]:
    """Flat rows for the trajectory table: text, rewards, every tool call with its outcome, and the token
    ids with their loss mask (so the mask can be audited offline)."""
    rows = []
    for t in trajs:
        calls = [{"turn": i, "name": c.name, "arguments": json.dumps(c.arguments, sort_keys=True),
                  "parse_error": c.parse_error, "status": r.status, "error_kind": r.error_kind,
                  "latency_s": r.latency_s, "tool": r.tool, "result": r.text[:2000]}
                 for i, turn in enumerate(t.turns) for c, r in zip(turn.calls, turn.results)]
        rows.append({
            "step": step, "prompt_index": t.prompt_index, "sample_index": t.sample_index,
            "prompt": json.dumps(t.messages, ensure_ascii=False), "completion": t.completion,
            "reward": t.reward, "rewards": json.dumps(t.rewards, sort_keys=True),
            "num_turns": len(t.turns), "tool_calls": calls, "stop_reason": t.stop_reason,
            "infra_error": t.infra_error, "prompt_ids": t.prompt_ids, "response_ids": t.response_ids,
            "loss_mask": t.loss_mask,
        })
    return rows


class Tracker:
    """Wraps the MLflow fluent API for the driver. Only the driver process talks to MLflow."""

    def __init__(self, uri: str, experiment: str):
        self.uri, self.experiment = uri, experiment
        self.run_id: str | None = None

    def start(self, run_name: str, params: dict[str, Any], tags: dict[str, str], artifacts: dict[str, str]) -> str:
        import mlflow

        mlflow.set_tracking_uri(self.uri)
        mlflow.set_experiment(self.experiment)
        run = mlflow.start_run(run_name=run_name, tags=tags)
        self.run_id = run.info.run_id
        items = dict(flatten(params))
        keys = list(items)
        for i in range(0, len(keys), 100):  # MLflow caps one batch at 100 params
            mlflow.log_params({k: items[k] for k in keys[i:i + 100]})
        for name, text in artifacts.items():
            mlflow.log_text(text, name)
        return self.run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        import mlflow

        mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)

    def log_trajectories(self, trajs: list[Trajectory], step: int, name: str = "trajectories") -> None:
        import mlflow

        if not trajs:
            return
        table = pa.Table.from_pylist(trajectory_records(trajs, step))
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"step_{step:05d}.parquet"
            pq.write_table(table, path, compression="zstd")
            mlflow.log_artifact(str(path), artifact_path=name)

    def log_text(self, text: str, name: str) -> None:
        import mlflow

        mlflow.log_text(text, name)

    def end(self, status: str = "FINISHED") -> None:
        import mlflow

        if self.run_id is not None:
            mlflow.end_run(status=status)
