"""Stopping and resuming real runs of specs/tiny.yaml (Ray + MCP + DeepSpeed + MLflow), as a user would:

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
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
SECRET = "s3cret-7f1d2c"
STEPS = 3
# Secrets go where users put them: a tool server's environment, a tag. The engine is transformers, which
# `auto` picks for the tiny spec: the vLLM path end to end is test_e2e's (tests/tracked_runs.py), and three
# more vLLM start-ups here cost ~30 s of the suite's budget for nothing this module checks.
OVERRIDES = [f"train.steps={STEPS}", "train.checkpoint_every=1", "rollout.engine=hf",
             "tools.calc.env={TOKEN: '${oc.env:FACTORY_TEST_SECRET}'}",
             "tracking.tags={owner: '${oc.env:FACTORY_TEST_SECRET}'}"]
# Run 2 (the Ctrl-C'd one) trains the same steps in its own folder, one more planned so that stopping it
# after step STEPS is a stop before the end.
SECOND = ["train.checkpoint_dir=runs/second", f"train.steps={STEPS + 1}"]
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
GCS_AUTH: set[str] = set()  # RAY_AUTH_MODE in the environment of every local Ray's GCS the runs started


@pytest.fixture(scope="module")
def work():
    # A short temp root of our own: Ray's session files (and unix sockets, whose paths are length-limited)
    # and Factory's driver records live under it, apart from every other Ray on this machine.
    tmp = Path(tempfile.mkdtemp(prefix="frl", dir="/tmp"))
    for folder in ("specs", "prompts"):
        shutil.copytree(REPO / folder, tmp / folder)
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db", "PYTHONPATH": str(REPO),
           "TMPDIR": str(tmp), "FACTORY_TEST_SECRET": SECRET}
    for key in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):  # a local Ray, with the default auth (a token)
        env.pop(key, None)
    yield tmp, env
    shutil.rmtree(tmp, ignore_errors=True)


def start(work, *extra: str) -> subprocess.Popen:
    tmp, env = work
    # its own session: SIGINT to its process group is what a terminal's Ctrl-C is
    return subprocess.Popen([sys.executable, "-m", "factory.commands.cli", "run", "specs/tiny.yaml", *OVERRIDES, *extra],
                            cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def tree(proc: subprocess.Popen) -> dict[tuple[int, float], psutil.Process]:
    """The driver's descendants, by (pid, start time)."""
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for p in kids:
        try:
            out[(p.pid, p.create_time())] = p
        except psutil.NoSuchProcess:
            pass
    return out


def listening(procs) -> set[str]:
    out = set()
    for p in procs:
        try:
            out |= {c.laddr.ip for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def running(procs) -> list[str]:
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{p.name()}[{p.pid}]")
        except psutil.NoSuchProcess:
            pass
    return alive


def found(root: Path, *patterns: str) -> bool:
    """Whether any path under `root` matches one of the glob `patterns` (a run's checkpoint folder is
    `runs/<spec>/<run name>-<id>/`: `runs/tiny/*/step_2`)."""
    return any(next(root.glob(p), None) is not None for p in patterns)


def wait_for(root: Path, patterns: tuple[str, ...], proc: subprocess.Popen, timeout_s: float, seen: dict,
             ips: set) -> None:
    """Until a path matching one of `patterns` exists under `root`, recording the driver's process tree and
    listening addresses."""
    deadline = time.time() + timeout_s
    while not found(root, *patterns):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, f"{patterns} did not appear"
        procs = tree(proc)
        seen.update(procs)
        ips |= listening(procs.values())
        for p in procs.values():  # the local Ray's auth, as its GCS's environment says
            try:
                if "gcs_server" in p.name():
                    GCS_AUTH.add(p.environ().get("RAY_AUTH_MODE", "unset"))
            except psutil.Error:
                pass
        time.sleep(0.5)


@pytest.fixture(scope="module")
def killed(work):
    """Run 1, SIGKILLed at a random moment after the metrics of a random step k < STEPS are logged: while
    its checkpoint of step k is being written, or after, in step k+1."""
    tmp, _ = work
    k, delay = random.randint(1, STEPS - 1), random.uniform(0.0, 1.5)
    proc, seen, ips = start(work), {}, set()
    # a step's metrics are logged before its checkpoint is staged (.incomplete-step_k) and committed
    wait_for(tmp, (f"runs/tiny/*/.incomplete-step_{k}", f"runs/tiny/*/step_{k}"), proc, 300, seen, ips)
    # On a fast CPU step k+1 can end within the delay (a tiny step takes well under a second on a Zen 5):
    # kill no later than its checkpoint's staging, so run 1 always leaves a step to resume.
    end = time.monotonic() + delay
    after = (f"runs/tiny/*/.incomplete-step_{k + 1}", f"runs/tiny/*/step_{k + 1}")
    while time.monotonic() < end and not found(tmp, *after):
        time.sleep(0.01)
    assert proc.poll() is None, f"run 1 ended before the kill (step {k} + {delay:.2f} s)"
    saved = found(tmp, f"runs/tiny/*/step_{k}")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    when = f"step {k} logged + {delay:.2f} s, {'after' if saved else 'before'} its checkpoint was committed"
    return {"seen": seen, "ips": ips, "leftovers": running(seen.values()), "when": when}


@pytest.fixture(scope="module")
def stopped(work, killed):
    """Run 2: it ends what run 1 left behind, then gets Ctrl-C after its checkpoint of step STEPS - 1."""
    tmp, _ = work
    proc, seen = start(work, *SECOND), {}
    wait_for(tmp, (f"runs/second/*/step_{STEPS - 1}",), proc, 300, seen, killed["ips"])
    alive_after_start = running(killed["seen"].values())
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return {"proc": proc, "out": out, "err": err, "seen": seen, "alive_after_start": alive_after_start}


def test_sigkill_then_ctrl_c(work, killed, stopped):
    from mlflow.tracking import MlflowClient

    tmp, env = work
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
    runs = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
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


@pytest.fixture(scope="module")
def resumed(work, killed, stopped):
    """Run 3: `factory run SPEC OVERRIDES --resume`, which continues run 1."""
    _, env = work
    proc = start(work, "--resume")
    try:
        _, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0, f"run 1 killed at {killed['when']}:\n{err[-3000:]}"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    (run,) = [r for r in runs if r.data.tags.get("factory.resumes")]
    (second,) = [r for r in runs if r.info.status == "KILLED"]
    return {"run": run, "second": second, "client": client, "err": err}


def test_a_killed_run_resumes_to_the_weights_of_an_uninterrupted_run(work, killed, resumed):
    import torch
    from safetensors.torch import load_file

    from factory.assets import resolve_model

    tmp, _ = work
    run, client = resumed["run"], resumed["client"]
    when = f"(run 1 killed at {killed['when']})"
    assert f"resuming run {run.info.run_id}" in resumed["err"], resumed["err"][-2000:]
    assert run.info.status == "FINISHED" and run.data.tags["factory.resumes"] == "1", when
    # every metric holds each step exactly once, none lost, none logged twice: the steps run 2 logged (it
    # stopped after step STEPS, so its only evaluation was at step 0)
    second = resumed["second"].info.run_id
    # what only the final evaluation logs (run 2 stopped before it): eval/* at step STEPS, and the monitor that
    # compares it with the one at step 0 (factory.monitors: it reads the step's own evaluation)
    final_only = {k for k in run.data.metrics if k.startswith("monitor/train_eval_divergence")}
    assert set(run.data.metrics) - final_only == set(resumed["second"].data.metrics), when
    for key in run.data.metrics:
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


def test_export_generates_the_greedy_tokens_of_the_runs_final_policy(work, resumed):
    tmp, env = work
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
