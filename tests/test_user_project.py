"""A user's project outside the repository, as `factory init` will make it: its own `rewards/` package with
a `math.py` of its own (the README's "Your own reward" recipe, verbatim), a prompt and specs. It is checked
and trained for one step with `factory run` from that folder, using Factory's built-in rewards next to its
own; then `factory rescore` scores the finished run again with one weight changed."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OLD_WEIGHT, NEW_WEIGHT = 0.1, 0.6  # the weight of `clean` (or `tried`) in `total`, before and after

SPEC = """\
name: mine
seed: 0
model: {{path: "factory:tiny-qwen3-calc"}}
data:
  train: {{generator: factory.data:arithmetic, size: 16, args: {{operands: [2, 2], digits: [1, 2]}}}}
  eval: {{generator: factory.data:arithmetic, size: 4, args: {{operands: [2, 2], digits: [1, 2]}}}}
  prompt: prompts/question.jinja
tools:
  calc: {{command: python, args: [-m, factory.examples.calculator], timeout_s: 5}}
{rewards}
rollout: {{group_size: 4, max_turns: 2, max_new_tokens: 32, max_total_tokens: 128}}
train: {{steps: 1, prompts_per_step: 2, micro_batch: 4, lr: 1.0e-3, threads: 1, bf16_autocast: false}}
tracking: {{experiment: mine}}
resources: {{object_store_gb: 0.5}}
"""


def readme_recipe() -> tuple[str, str]:
    """The python and YAML blocks of the README's "Your own reward" section."""
    section = (REPO / "README.md").read_text().split("## Your own reward", 1)[1].split("\n## ", 1)[0]
    (python,) = re.findall(r"```python[^\n]*\n(.*?)```", section, re.DOTALL)
    (yaml,) = re.findall(r"```yaml[^\n]*\n(.*?)```", section, re.DOTALL)
    return python, yaml


def factory(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The `factory` command as a user runs it: installed, from the project folder."""
    return subprocess.run([sys.executable, "-m", "factory.commands.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def user_run(tmp_path_factory):
    project = tmp_path_factory.mktemp("user-project")
    assert not project.resolve().is_relative_to(REPO)
    python, rewards = readme_recipe()
    assert f"clean: {OLD_WEIGHT}," in rewards and f"tried: {OLD_WEIGHT}}}" in rewards
    (project / "rewards").mkdir()
    (project / "rewards" / "__init__.py").write_text("")
    (project / "rewards" / "math.py").write_text(python)
    (project / "prompts").mkdir()
    (project / "prompts" / "question.jinja").write_text("{{ question }}")
    (project / "specs").mkdir()
    (project / "specs" / "run.yaml").write_text(SPEC.format(rewards=rewards.rstrip()))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH", "FACTORY_DEBUG")}
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{project}/mlflow.db"
    checked = factory("check", "specs/run.yaml", cwd=project, env=env)
    assert checked.returncode == 0, checked.stderr
    ran = factory("run", "specs/run.yaml", cwd=project, env=env)
    assert ran.returncode == 0, ran.stderr[-4000:]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    (run,) = client.search_runs([client.get_experiment_by_name("mine").experiment_id])
    return project, env, client, run, checked, rewards


def _metric(client, run_id: str, key: str, step: int) -> float:
    (value,) = [m.value for m in client.get_metric_history(run_id, key) if m.step == step]
    return value


def test_user_project_checks_and_runs_with_its_own_and_builtin_rewards(user_run):
    project, _, client, run, checked, _ = user_run
    assert "  rewards    mine, clean, tried -> total (trains the policy)" in checked.stdout
    # its own rewards.math and Factory's factory.rewards.math were both imported and scored every trajectory
    hashed = client.download_artifacts(run.info.run_id, "plan.json", str(project))
    assert '"rewards/math.py"' in Path(hashed).read_text()  # the project's file, hashed as part of the run
    for node in ("mine", "clean", "tried"):
        assert _metric(client, run.info.run_id, f"rewards/{node}/errors", 1) == 0.0, node
    assert run.data.tags["mlflow.runName"].startswith("mine") and run.info.status == "FINISHED"


def _eval_mean(client, run_id: str, node: str, step: int, folder: Path) -> float:
    """The mean of a node over a run's saved evaluation at `step` (every trajectory: on_missing is zero)."""
    import json

    import pyarrow.parquet as pq

    path = client.download_artifacts(run_id, f"eval_trajectories/step_{step:05d}.parquet", str(folder))
    values = [json.loads(r)[node] for r in pq.read_table(path).column("rewards").to_pylist()]
    return sum(values) / len(values)


def test_rescore_moves_the_reward_by_exactly_the_changed_weight(user_run, tmp_path):
    project, env, client, run, _, rewards = user_run
    old_id = run.info.run_id
    # Change the weight of a node that is not 0 everywhere, or the test would prove nothing. One of the two
    # is not: a trajectory without tool calls has no failed call (clean = 1), one with calls tried (tried = 1).
    node = "clean" if _metric(client, old_id, "rewards/clean/mean", 1) > 0 else "tried"
    mean = _metric(client, old_id, f"rewards/{node}/mean", 1)
    assert mean > 0
    changed = rewards.rstrip().replace(f"{node}: {OLD_WEIGHT}", f"{node}: {NEW_WEIGHT}")
    assert changed.count(str(NEW_WEIGHT)) == 1  # one weight, nothing else, changed
    (project / "specs" / "rescore.yaml").write_text(SPEC.format(rewards=changed))
    out = factory("rescore", old_id, "--spec", "specs/rescore.yaml", cwd=project, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    (new,) = client.search_runs([run.info.experiment_id], f"tags.`factory.rescore_of` = '{old_id}'")
    new_id = new.info.run_id
    assert new_id in out.stdout and new.data.tags["factory.rescored_steps"] == "0, 1"
    # tagged as `factory run` tags a run: `factory runs` reads its plan hash, `factory diff` what it ran on
    hashes = json.loads(Path(client.download_artifacts(new_id, "plan.json", str(tmp_path))).read_text())["hashes"]
    tags = new.data.tags
    assert tags["factory.plan_hash"] == hashes["run"] and tags["factory.spec_hash"] == hashes["spec"]
    assert tags["factory.cpu"] == run.data.tags["factory.cpu"] and "factory.version.torch" in tags
    # total = mine + w_clean clean + w_tried tried: the mean moves by (0.6 - 0.1) x mean(node) and every
    # node's own mean stays put.
    moved = _metric(client, new_id, "reward/mean", 1) - _metric(client, old_id, "reward/mean", 1)
    assert moved == pytest.approx((NEW_WEIGHT - OLD_WEIGHT) * mean, abs=1e-9)
    for name in ("mine", "clean", "tried"):
        key = f"rewards/{name}/mean"
        assert _metric(client, new_id, key, 1) == pytest.approx(_metric(client, old_id, key, 1), abs=1e-12), key
    # Evaluations (steps 0 and 1) are rescored too, under the same rule.
    for step in (0, 1):
        moved = _metric(client, new_id, "eval/reward", step) - _metric(client, old_id, "eval/reward", step)
        assert moved == pytest.approx((NEW_WEIGHT - OLD_WEIGHT) * _eval_mean(client, old_id, node, step, tmp_path),
                                      abs=1e-9)
        assert _metric(client, new_id, "eval/accuracy", step) == _metric(client, old_id, "eval/accuracy", step)


def test_rescore_refuses_steps_that_were_not_saved(user_run):
    project, env, _, run, _, _ = user_run
    out = factory("rescore", run.info.run_id, "--spec", "specs/run.yaml", "--steps", "1,5-6", cwd=project, env=env)
    assert out.returncode == 2
    assert out.stderr == f"factory: run {run.info.run_id} saved no trajectories at steps 5, 6\n"
