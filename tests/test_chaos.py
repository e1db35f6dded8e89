"""Real runs under real faults (slow: each starts Ray, the stages and a tiny model; see the times below).

- The chaos run (bench/chaos.py, 20 steps): the tracking server stopped at step 2 and started again at
  step 4, the calculator MCP server SIGKILLed at three random steps, a judge endpoint answering 500 and 429
  to 30% of its requests, a rollout replica SIGKILLed: the run fails cleanly and `--resume` completes it;
  every step's metrics and table are in the store exactly once and the final weights are finite.
- A run whose judge endpoint is down stops at step 1 with exit code 3, naming the judge, and leaves no
  process behind.
- A run whose reward function returns inf and whose judge replies NaN ends with every parameter finite.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from tests.servers import free_port
from tests.tracked_runs import ENGINE

REPO = Path(__file__).resolve().parents[1]


def short_tmp() -> str:
    """A TMPDIR for a run: Ray's unix sockets go ~70 characters below `$TMPDIR/factory-<uid>/`, and a socket
    path may hold 107 bytes, so pytest's tmp_path is too long for it."""
    return tempfile.mkdtemp(prefix="fch", dir="/tmp")


@pytest.mark.slow  # a 20-step run, a failure and a resume: 2.5 min measured on 2 cores (AMD EPYC, Zen 5)
def test_the_chaos_run(tmp_path):
    sys.path.insert(0, str(REPO))
    from bench.chaos import main

    counts = main(["--steps", "20", "--seed", "0", "--workdir", str(tmp_path / "chaos")])
    assert counts["status"] == "FINISHED" and counts["steps_logged_once"] and counts["tables_logged_once"], counts
    assert counts["weights_finite"] and counts["judge"]["500"] and counts["judge"]["429"], counts
    assert counts["resumes"] >= 1 and counts["exit_codes"][-1] == 0, counts


@pytest.mark.slow  # a run that stops after its step-0 evaluation and one step: ~1 min on 2 cores
def test_a_run_whose_judge_endpoint_is_down_stops_with_exit_3_naming_it(tmp_path):
    for name in ("specs", "prompts"):
        shutil.copytree(REPO / name, tmp_path / name)
    (tmp_path / "prompts" / "j.jinja").write_text("{{ completion }}")
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db", "PYTHONPATH": str(REPO),
           "TMPDIR": short_tmp()}
    for key in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        env.pop(key, None)
    dead = f"http://127.0.0.1:{free_port()}/v1"
    proc = subprocess.Popen([sys.executable, "-m", "factory.commands.cli", "run", "specs/tiny.yaml", "train.steps=3",
                             f"rollout.engine={ENGINE}", f"rewards.judged={{llm_judge: prompts/j.jinja, endpoint: '{dead}', "
                             "retries: 0}", "rewards.total.sum.judged=1.0"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: set = set()
    while proc.poll() is None:
        try:
            seen |= {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
        try:
            proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
    err = proc.stderr.read()
    assert proc.returncode == 3, err[-3000:]
    assert "step 1: 8 of 8 trajectories failed from infrastructure" in err
    assert f"judge judged: {dead}/chat/completions: ConnectError" in err
    assert f"reward node judged: no answer from {dead} within 10 s" in err  # said at the start
    _, alive = psutil.wait_procs([psutil.Process(p) for p in seen if psutil.pid_exists(p)], timeout=20)
    assert alive == [], alive  # the teardown ran: Ray, the stage actors, the MCP servers are gone


@pytest.mark.slow  # a 3-step run: ~1 min on 2 cores
def test_a_run_whose_reward_returns_inf_and_whose_judge_replies_nan_keeps_every_weight_finite(tmp_path):
    import random

    import torch
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    sys.path.insert(0, str(REPO))
    from bench.chaos import Judge, wild_rewards

    for name in ("specs", "prompts"):
        shutil.copytree(REPO / name, tmp_path / name)
    judge = Judge(random.Random(0), p500=0.0, p429=0.0, pnan=0.5)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(REPO), "TMPDIR": short_tmp()}
    for key in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        env.pop(key, None)
    out = subprocess.run([sys.executable, "-m", "factory.commands.cli", "run", "specs/tiny.yaml", "train.steps=3",
                          *wild_rewards(tmp_path, judge.url)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=900)
    judge.server.shutdown()
    assert out.returncode == 0, out.stderr[-3000:]
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    total = {k: sum(m.value for m in client.get_metric_history(run.info.run_id, k))
             for k in ("rewards/wild/non_finite", "rewards/judged/non_finite", "reward/mean")}
    assert total["rewards/wild/non_finite"] > 0 and total["rewards/judged/non_finite"] > 0, total
    weights = load_file(Path(run.data.tags["factory.checkpoint_dir"]) / "step_3" / "hf" / "model.safetensors")
    assert all(bool(torch.isfinite(v).all()) for v in weights.values())
