"""The tiny spec on a local 2-node Ray cluster (`ray start --head` + `ray start --address` on this machine,
custom resources node_a / node_b): 2 rollout replicas spread over the nodes, the tool servers pinned to
node_b, DeepSpeed world size 2 (gloo) at ZeRO-2 and ZeRO-3.

Two parts per ZeRO stage: `factory run` itself joins the cluster (RAY_ADDRESS) and what it placed is
checked from its MLflow record; then the driver's own pieces, in this process, carry real batches
through the placed stages and step the 2-rank group and a 1-rank group on the same batches: the ranks
hold identical parameters, and loss and parameters equal the 1-rank run (tolerances: see
tests/test_update_ranks.py, which checks the same in the default suite without a cluster).

Slow (about 3-4 minutes per ZeRO stage on 2 cores): `pytest -m slow tests/test_cluster.py`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.cluster import ray_cluster
from tests.test_update_ranks import ADAM_TOL, LOSS_TOL

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
OVERRIDES = ["resources.rollout.replicas=2", "resources.rollout.num_cpus=1", "resources.rollout.strategy=SPREAD",
             "resources.tools.custom={node_b: 1}", "resources.update.replicas=2", "train.threads=1"]


@pytest.fixture(scope="module")
def cluster():
    with ray_cluster([{"node_a": 1}, {"node_b": 1}]) as address:
        yield address


def _node_b(address: str) -> str:
    code = ("import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
            "print([n['NodeID'] for n in ray.nodes() if n['Alive'] and 'node_b' in n['Resources']][0])")
    out = subprocess.run([sys.executable, "-c", code, address], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "RAY_AUTH_MODE": "disabled"}, check=True)
    return out.stdout.split()[-1]


def _check_placement(placed: dict, node_b: str) -> None:
    assert placed["tools"]["setup"][0]["node"] == node_b  # the stdio server runs once, on node_b
    rollout = placed["rollout"]["setup"]
    assert len(rollout) == 2 and len({r["node"] for r in rollout}) == 2  # SPREAD: one engine per node
    assert all(r["tools"] == ["calculate"] for r in rollout)  # both reach the one tools stage
    ranks = placed["update"]["setup"]
    assert [(r["rank"], r["world_size"]) for r in ranks] == [(0, 2), (1, 2)]


@pytest.mark.parametrize("zero", [2, 3])
def test_factory_run_joins_the_cluster(zero, cluster, tmp_path):
    for folder in ("specs", "prompts"):
        shutil.copytree(REPO / folder, tmp_path / folder)
    env = {**os.environ, "RAY_ADDRESS": cluster, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(REPO),
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    out = subprocess.run([sys.executable, "-m", "factory.cli", "run", "specs/tiny.yaml", *OVERRIDES,
                          f"train.deepspeed.zero_stage={zero}"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=1200, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    placed = json.loads(Path(client.download_artifacts(run.info.run_id, "placement.json", str(tmp_path))).read_text())
    _check_placement(placed, _node_b(cluster))
    calls = client.get_metric_history(run.info.run_id, "tools/calculate/calls")
    assert sum(m.value for m in calls) > 0  # tool calls from the replicas reached node_b's server


@pytest.mark.parametrize("zero", [2, 3])
def test_two_ranks_on_real_batches_equal_one_rank(zero, cluster, monkeypatch):
    import ray

    from factory.compiler.compile import compile_file
    from factory.driver import (
        collect,
        place,
        placement_record,
        setup_group,
        start_group,
        start_ray,
        sync_weights,
        teardown,
    )

    monkeypatch.chdir(REPO)  # the stages read prompts/ from the driver's folder
    _, plan = compile_file(REPO / "specs" / "tiny.yaml", [*OVERRIDES, f"train.deepspeed.zero_stage={zero}"])
    start_ray(dataclasses.replace(plan.driver.resources, ray_address=cluster))
    groups, reference = {}, None
    try:
        groups = place(plan)
        _check_placement(placement_record(groups), _node_b(cluster))
        reference = start_group(dataclasses.replace(plan.stage("update"), replicas=1, resources={}))
        reference.info = ray.get(setup_group(reference, {}))
        for step in range(2):
            trajs, m = collect(groups, plan)  # 2 engine replicas; tool calls served on node_b
            assert len(trajs) == 8 and m["tools/calls"] > 0
            a, b = reference.call("step", trajs), groups["update"].call("step", trajs)
            for key in ("actor/pg_loss", "actor/grad_norm", "actor/tokens"):
                assert b[key] == pytest.approx(a[key], rel=LOSS_TOL, abs=LOSS_TOL), (step, key)
            (ref,) = ray.get(reference.submit("state_dict", True))
            rank0, rank1 = ray.get(groups["update"].submit("state_dict", True))
            for name, p in ref.items():
                assert torch.equal(rank0[name], rank1[name]), f"ranks differ in {name}"
                torch.testing.assert_close(rank0[name], p, rtol=0, atol=ADAM_TOL * (step + 1), msg=name)
            sync_weights(groups, plan)  # rank 0's weights to both engine replicas
    finally:
        if reference is not None:
            teardown({"reference": reference})
        teardown(groups)
        ray.shutdown()
