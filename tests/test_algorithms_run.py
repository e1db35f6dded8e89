"""Every algorithm preset, selected in the spec, runs a real update step of the tiny end-to-end spec.

The stages run in-process (no Ray) on trajectories from one real rollout of specs/tiny.yaml (the warmed-up
tiny Qwen3 calling the calculator MCP server), so each preset costs one DeepSpeed step, not a whole run.
`factory run` through Ray with each preset is the slow-marked test below.
"""
from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from factory.presets import PRESETS

REPO = Path(__file__).resolve().parents[1]


def _plan(*overrides: str):
    from factory.compiler.compile import compile_file

    return compile_file(REPO / "specs" / "tiny.yaml", list(overrides))[1]


@pytest.fixture(scope="module")
def scored():
    import torch

    from factory.data import DataStage
    from factory.reward import RewardStage
    from factory.rollout.stage import RolloutStage
    from factory.tools.stage import ToolsStage
    from factory.types import Placement

    torch.set_num_threads(1)
    old = os.getcwd()
    os.chdir(REPO)  # the spec's prompts/ resolve from the repository root
    try:
        # The transformers engine: vLLM in this process would leave its own torch.distributed group behind,
        # which DeepSpeed would then adopt without the launcher environment it asserts (LOCAL_RANK).
        plan = _plan("rollout.temperature=1.2", "rollout.engine=hf")
        data = DataStage(plan.stage("data").settings)
        data.setup()
        tools, rollout = ToolsStage(plan.stage("tools").settings), RolloutStage(plan.stage("rollout").settings)
        reward = RewardStage(plan.stage("reward").settings)

        async def go():
            await tools.setup()
            await rollout.setup(Placement(peers={rollout.settings.tool_peer: tools}))
            await reward.setup()
            try:
                trajs, _ = RolloutStage.merge([await rollout.generate(data.next_batch(2))])
                return await reward.score(trajs)
            finally:
                await rollout.close()
                await reward.close()
                await tools.close()

        trajs, _ = asyncio.run(go())
    finally:
        os.chdir(old)
    # Make sure every group has spread, so every advantage estimator has something to push on.
    for t in trajs:
        t.reward += 0.1 * t.sample_index
    return trajs


# In the default suite, one preset of each loss family (token-level ratio, sequence-level ratio, clipped
# weight, KL in the reward); the rest, whose losses differ from these only in the normaliser or the baseline
# (each tested in test_update / test_algorithms), are slow: ~4 s each of the suite's budget (#23).
DEFAULT_PRESETS = ("grpo", "gspo", "cispo", "reinforce_pp")


@pytest.mark.parametrize("name", [n if n in DEFAULT_PRESETS else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(PRESETS)])
def test_preset_runs_an_update_step(name, scored):
    import torch

    from factory.update import Learner

    torch.set_num_threads(1)
    overrides = [f"algorithm.name={name}"]
    if PRESETS[name].get("kl_apply") == "reward":
        overrides.append("algorithm.kl.coef=0.01")  # REINFORCE++ puts KL in the reward: exercise it
    learner = Learner(_plan(*overrides).stage("update").settings)
    learner.setup()
    try:
        before = {k: v.clone() for k, v in learner.state_dict().items()}
        stats = learner.step([_copy(t) for t in scored])
        after = learner.state_dict()
    finally:
        learner.shutdown()
    assert all(math.isfinite(v) for v in stats.values() if isinstance(v, float)), stats
    assert stats["actor/grad_norm"] > 0
    assert any(not torch.equal(before[k], after[k]) for k in before), f"{name}: no parameter changed"


def _copy(t):
    import copy

    return copy.deepcopy(t)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_factory_run_with_each_preset(name, tmp_path):
    import shutil

    for folder in ("specs", "prompts"):
        shutil.copytree(REPO / folder, tmp_path / folder)
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "factory.commands.cli", "run", "specs/tiny.yaml", "train.steps=1",
                          f"algorithm.name={name}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
