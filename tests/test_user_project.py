"""A user's project outside the repository, as `factory init` will make it: its own `rewards/` package with
a `math.py` of its own (the README's "Your own reward" recipe, verbatim), a prompt and a spec. It is checked
and trained with `factory run` from that folder, using Factory's built-in rewards next to its own (the runs
are tests/lifecycle_runs.py's: the run read here is the one killed and resumed to its end); then
`factory rescore` scores the finished run again with one weight changed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.lifecycle_runs import NEW_WEIGHT, OLD_WEIGHT, SPEC, STEPS, factory


@pytest.fixture(scope="module")
def user_run(user_project, resumed):
    project, env, checked, rewards = user_project
    return project, env, resumed["client"], resumed["run"], checked, rewards


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
    assert new_id in out.stdout and new.data.tags["factory.rescored_steps"] == ", ".join(map(str, range(STEPS + 1)))
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
    # Evaluations (the first and the last) are rescored too, under the same rule.
    for step in (0, STEPS):
        moved = _metric(client, new_id, "eval/reward", step) - _metric(client, old_id, "eval/reward", step)
        assert moved == pytest.approx((NEW_WEIGHT - OLD_WEIGHT) * _eval_mean(client, old_id, node, step, tmp_path),
                                      abs=1e-9)
        assert _metric(client, new_id, "eval/accuracy", step) == _metric(client, old_id, "eval/accuracy", step)


def test_rescore_refuses_steps_that_were_not_saved(user_run):
    project, env, _, run, _, _ = user_run
    out = factory("rescore", run.info.run_id, "--spec", "specs/run.yaml", "--steps", f"1,{STEPS + 2}-{STEPS + 3}",
                  cwd=project, env=env)
    assert out.returncode == 2
    assert out.stderr == f"factory: run {run.info.run_id} saved no trajectories at steps {STEPS + 2}, {STEPS + 3}\n"
