"""Stopping and resuming real runs of a user's project (Ray + MCP + DeepSpeed + MLflow; the runs are
tests/lifecycle_runs.py's session fixtures), as a user would:

1. a run SIGKILLed at a random moment of its steps leaves processes behind (Ray's agents linger) -- the
   next `factory run` ends them;
2. that next run, given Ctrl-C (SIGINT to its whole process group, as a terminal sends it) after its second
   step, finishes the step in flight, checkpoints it, marks the MLflow run KILLED, exits 130 and leaves no
   process behind;
3. `factory run --resume` picks the killed run (the newest unfinished run of the same spec; the Ctrl-C'd one
   is newer but differs), continues it from its last checkpoint to the end in the same MLflow run, which
   then holds every step's metrics exactly once, and its final weights equal those of run 2, which trained
   the same steps with the same seed uninterrupted;
4. `factory export RUN` of it loads with transformers and generates, greedily, the tokens the run's final
   policy generated in its last evaluation;
and on the way: every socket the runs listen on is on loopback, and a value from `${oc.env:...}` reaches
neither the MLflow store nor the logs.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

from tests.lifecycle_runs import GCS_AUTH, LOOPBACK, SECRET, STEPS, running

def test_sigkill_then_ctrl_c(user_project, killed, stopped):
    from mlflow.tracking import MlflowClient

    tmp, env = user_project.folder, user_project.env
    # 2. run 2 ended what the killed run 1 left behind
    assert stopped["alive_after_start"] == [], f"left by the killed run and still alive: {killed['leftovers']}"
    second, err = stopped["proc"], stopped["err"]
    assert second.returncode == 130, err[-3000:]
    deadline = time.time() + 10
    while running(stopped["seen"].values()) and time.time() < deadline:
        time.sleep(0.2)
    assert running(stopped["seen"].values()) == []  # Ray's processes, the stage actors, the MCP servers: all gone
    assert not list((tmp / f"factory-{os.getuid()}" / "drivers").glob("*.json"))  # no record left
    assert oct((tmp / f"factory-{os.getuid()}").stat().st_mode & 0o777) == "0o700"  # Ray's folder inside: private

    # the step in flight was finished, logged and checkpointed; the run is KILLED
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name("mine").experiment_id])
    killed_runs = [r for r in runs if r.info.status == "KILLED"]
    assert len(killed_runs) == 1, [(r.info.run_id, r.info.status) for r in runs]
    steps = [m.step for m in client.get_metric_history(killed_runs[0].info.run_id, "timing/step_s")]
    last = int((tmp / "runs/second/newest/latest").read_text().strip().removeprefix("step_"))  # its one run
    assert sorted(steps) == list(range(1, last + 1)) and last == STEPS  # each step once, the last one saved

    # the local Ray required a token (a fresh one per run, in the environment of the processes it started)
    assert GCS_AUTH == {"token"}, GCS_AUTH
    # every socket either run listened on was on loopback
    ips = killed["ips"]
    assert ips and ips <= set(LOOPBACK), ips
    # the secret reached neither the store nor the logs (Ray's session logs included)
    assert SECRET not in stopped["out"] + err
    for path in [tmp / "mlflow.db", *(tmp / "mlruns").rglob("*"), *(tmp / f"factory-{os.getuid()}").rglob("*")]:
        if path.is_file() and not path.is_symlink():
            assert SECRET.encode() not in path.read_bytes(), path


def test_a_killed_run_resumes_to_the_weights_of_an_uninterrupted_run(user_project, killed, resumed):
    import torch
    from safetensors.torch import load_file

    from factory.assets import resolve_model

    tmp = user_project.folder
    run, client = resumed["run"], resumed["client"]
    when = f"(run 1 killed at {killed['when']})"
    assert f"resuming run {run.info.run_id}" in resumed["err"], resumed["err"][-2000:]
    assert "\x1b[" not in resumed["err"]  # written to a pipe: Ray's stage lines without terminal colour codes
    assert run.info.status == "FINISHED" and run.data.tags["factory.resumes"] == "1", when
    # its summary: this session's time, and the run's over both sessions (as `factory runs` counts it)
    assert re.search(r"\), \d+\.\d min this session, \d+\.\d min in all\n", resumed["err"]), resumed["err"][-600:]
    # every metric holds each step exactly once, none lost, none logged twice: the steps run 2 logged (it
    # stopped after step STEPS, so its only evaluation was at step 0)
    second = resumed["second"].info.run_id
    # what only the final evaluation logs (run 2 stopped before it): eval/* at step STEPS, and the monitor that
    # compares it with the one at step 0 (factory.monitors: it reads the step's own evaluation)
    final_only = {k for k in run.data.metrics if k.startswith("monitor/train_eval_divergence")}
    # each session logs its own start-up, at the first step it logs (a resumed one's: after the last logged)
    sessions = {k for k in run.data.metrics if k.startswith("timing/startup")}
    assert set(run.data.metrics) - final_only - sessions == set(resumed["second"].data.metrics) - sessions, when
    starts = sorted(m.step for m in client.get_metric_history(run.info.run_id, "timing/startup_s"))
    assert len(starts) == 2 and starts[0] == 0 < starts[1] <= STEPS, (starts, when)
    for key in set(run.data.metrics) - sessions:
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
        expected = sorted(m.step for m in client.get_metric_history(second, key)) + (
            [STEPS] if key.startswith("eval/") or key in final_only else [])
        assert steps == expected, (key, steps, when)
    rewards = [[m.value for m in sorted(client.get_metric_history(r, "reward/mean"), key=lambda m: m.step)]
               for r in (run.info.run_id, second)]
    assert rewards[0] == rewards[1], when
    # the final weights are those of run 2, which trained the same steps uninterrupted (CPU, fixed seed:
    # every source of randomness is restored from the checkpoint or a function of (seed, step))
    final = load_file(Path(run.data.tags["factory.checkpoint_dir"]) / f"step_{STEPS}/hf/model.safetensors")
    reference = load_file(tmp / f"runs/second/newest/step_{STEPS}/hf/model.safetensors")  # run 2's own folder
    initial = load_file(Path(resolve_model("factory:tiny-qwen3-calc")) / "model.safetensors")
    differ = [k for k in reference if not torch.equal(final[k], reference[k])]
    assert differ == [], f"{len(differ)} tensors differ from the uninterrupted run's {when}"
    assert sum(not torch.equal(final[k], initial[k]) for k in final) > len(final) // 2  # it did train


def test_export_generates_the_greedy_tokens_of_the_runs_final_policy(user_project, resumed):
    tmp, env = user_project.folder, user_project.env
    export_matches_last_eval(resumed["run"], resumed["client"], env["MLFLOW_TRACKING_URI"], tmp, STEPS)


def export_matches_last_eval(run, client, uri: str, tmp: Path, steps: int) -> None:
    """`factory export RUN` loads with transformers and generates, greedily, exactly the tokens the run's
    final policy generated in its evaluation at step `steps`."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM

    from factory.commands import cli

    out = tmp / "exported"
    assert cli.main(["export", run.info.run_id, "--out", str(out), "--uri", uri]) == 0
    model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    # the run's last evaluation: greedy, by the rollout engine holding the final weights
    table = pq.read_table(client.download_artifacts(run.info.run_id, f"eval_trajectories/step_{steps:05d}.parquet",
                                                    str(tmp)))
    for row in table.to_pylist():
        mask = row["loss_mask"]
        first_turn = row["response_ids"][: mask.index(0) if 0 in mask else len(mask)]  # the model's own tokens
        got = model.generate(torch.tensor([row["prompt_ids"]]), max_new_tokens=len(first_turn),
                             do_sample=False)[0, len(row["prompt_ids"]):].tolist()
        assert got == first_turn, row["prompt_index"]
