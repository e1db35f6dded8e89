"""Session fixtures: three real runs of a user's project (Ray + MCP + DeepSpeed + MLflow), stopped and
resumed as a user would (test_run_lifecycle checks them), and the project's own checks (test_user_project).

The project is a folder outside the repository, as `factory init` makes it: its own `rewards/` package with
a `math.py` of its own (the README's "Your own reward" recipe, verbatim), a prompt and `specs/run.yaml`,
which uses Factory's built-in rewards next to its own. From that folder:

1. run 1 is SIGKILLed at a random moment of its steps;
2. run 2 (its own checkpoint folder, one step more planned) gets Ctrl-C after step STEPS;
3. `factory run --resume` continues run 1 to the end. It starts once run 2 has started Ray (so run 2 is the
   one that ends what run 1 left behind) and runs beside it, as a user resumes one run while another goes
   on: most of a tiny run is start-up that leaves a core idle, so the two cost ~25 s less than one after
   the other (2-core Zen 4).

One set of runs serves both modules: each run costs ~30 s of start-up on 2 cores.
"""
from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, NamedTuple
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
SECRET = "s3cret-7f1d2c"
STEPS = 3
# Secrets go where users put them: a tool server's environment, a tag. The engine is transformers: the vLLM
# path end to end is test_e2e's (tests/tracked_runs.py), and three more vLLM start-ups here cost ~30 s of
# the suite's budget for nothing these runs check.
# One request per `generate` (rollout.batch_size=1): the transformers engine batches the requests waiting
# at a moment, so under load (the suite's other worker) a batch can take another shape than in the
# uninterrupted run, move a logit in its last bits and flip a sampled token: the resumed run's weights
# then differ for a reason that is not the resume's (seen once: a suite run on two xdist workers, AVX2 emulated).
OVERRIDES = [f"train.steps={STEPS}", "train.checkpoint_every=1", "rollout.engine=hf", "rollout.batch_size=1",
             "tools.calc.env={TOKEN: '${oc.env:FACTORY_TEST_SECRET}'}",
             "tracking.tags={owner: '${oc.env:FACTORY_TEST_SECRET}'}"]
# Run 2 (the Ctrl-C'd one) trains the same steps in its own folder, one more planned so that stopping it
# after step STEPS is a stop before the end.
SECOND = ["train.checkpoint_dir=runs/second", f"train.steps={STEPS + 1}"]
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
GCS_AUTH: set[str] = set()  # RAY_AUTH_MODE in the environment of every local Ray's GCS the runs started
OLD_WEIGHT, NEW_WEIGHT = 0.1, 0.6  # the weight of `clean` (or `tried`) in `total`, before and after (test_user_project)

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


class Project(NamedTuple):
    folder: Path  # the project folder, where every run starts
    env: dict[str, str]  # the runs' environment (their MLflow store: a sqlite file in `folder`)
    checked: subprocess.CompletedProcess[str]  # `factory check specs/run.yaml`
    rewards: str  # the README's YAML block for the spec's rewards


@pytest.fixture(scope="session")
def user_project():
    """The project folder (under a short temp root of our own: Ray's session files, and unix sockets, whose
    paths are length-limited, and Factory's driver records live under it, apart from every other Ray on
    this machine), its environment, and what `factory check` said of its spec."""
    tmp = Path(tempfile.mkdtemp(prefix="frl", dir="/tmp"))
    assert not tmp.resolve().is_relative_to(REPO)
    python, rewards = readme_recipe()
    assert f"clean: {OLD_WEIGHT}," in rewards and f"tried: {OLD_WEIGHT}}}" in rewards
    (tmp / "rewards").mkdir()
    (tmp / "rewards" / "__init__.py").write_text("")
    (tmp / "rewards" / "math.py").write_text(python)
    (tmp / "prompts").mkdir()
    (tmp / "prompts" / "question.jinja").write_text("{{ question }}")
    (tmp / "specs").mkdir()
    (tmp / "specs" / "run.yaml").write_text(SPEC.format(rewards=rewards.rstrip()))
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db", "PYTHONPATH": str(REPO),
           "TMPDIR": str(tmp), "FACTORY_TEST_SECRET": SECRET}
    for key in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "FACTORY_DEBUG"):  # a local Ray, with the default auth (a token)
        env.pop(key, None)
    checked = factory("check", "specs/run.yaml", cwd=tmp, env=env)
    assert checked.returncode == 0, checked.stderr
    yield Project(tmp, env, checked, rewards)
    shutil.rmtree(tmp, ignore_errors=True)


def start(user_project, *extra: str, out: Any = subprocess.PIPE) -> subprocess.Popen:
    """`factory run specs/run.yaml OVERRIDES EXTRA` from the project folder; its output to pipes, or to `out`
    (a file) for a run nobody reads until it ends (a full pipe would stall it)."""
    tmp, env = user_project.folder, user_project.env
    # its own session: SIGINT to its process group is what a terminal's Ctrl-C is
    return subprocess.Popen([sys.executable, "-m", "factory.commands.cli", "run", "specs/run.yaml", *OVERRIDES, *extra],
                            cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT if out is not subprocess.PIPE
                            else subprocess.PIPE, text=True, start_new_session=True)


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
    `runs/<spec>/<run name>-<id>/`: `runs/mine/*/step_2`)."""
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
                # (an empty environment is a process read while it execs, not one started without the
                # setting: that one would still hold PATH and the rest; seen once, as 'unset')
                if "gcs_server" in p.name() and (environ := p.environ()):
                    GCS_AUTH.add(environ.get("RAY_AUTH_MODE", "unset"))
            except psutil.Error:
                pass
        time.sleep(0.5)


@pytest.fixture(scope="session")
def killed(user_project):
    """Run 1, SIGKILLed at a random moment after the metrics of a random step k < STEPS are logged: while
    its checkpoint of step k is being written, or after, in step k+1."""
    tmp = user_project.folder
    k, delay = random.randint(1, STEPS - 1), random.uniform(0.0, 1.5)
    proc, seen, ips = start(user_project), {}, set()
    # a step's metrics are logged before its checkpoint is staged (.incomplete-step_k) and committed
    wait_for(tmp, (f"runs/mine/*/.incomplete-step_{k}", f"runs/mine/*/step_{k}"), proc, 300, seen, ips)
    # On a fast CPU step k+1 can end within the delay (a tiny step takes well under a second on a Zen 5):
    # kill no later than its checkpoint's staging, so run 1 always leaves a step to resume.
    end = time.monotonic() + delay
    after = (f"runs/mine/*/.incomplete-step_{k + 1}", f"runs/mine/*/step_{k + 1}")
    while time.monotonic() < end and not found(tmp, *after):
        time.sleep(0.01)
    assert proc.poll() is None, f"run 1 ended before the kill (step {k} + {delay:.2f} s)"
    saved = found(tmp, f"runs/mine/*/step_{k}")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    when = f"step {k} logged + {delay:.2f} s, {'after' if saved else 'before'} its checkpoint was committed"
    return {"seen": seen, "ips": ips, "leftovers": running(seen.values()), "when": when}


@pytest.fixture(scope="session")
def stopped(user_project, killed):
    """Run 2: it ends what run 1 left behind, then gets Ctrl-C after its checkpoint of step STEPS - 1.
    Run 3 (`factory run SPEC OVERRIDES --resume`, which continues run 1) starts once run 2's driver
    record is written (run 2 has ended run 1's leftovers and started Ray) and runs beside it; both have
    ended when this returns, so that nothing of run 3 is alive while run 2's leftovers are counted."""
    tmp = user_project.folder
    proc, seen = start(user_project, *SECOND), {}
    wait_for(tmp, (f"factory-{os.getuid()}/drivers/{proc.pid}.json",), proc, 300, seen, killed["ips"])
    third_out = tempfile.TemporaryFile("w+")
    third = start(user_project, "--resume", out=third_out)
    try:
        wait_for(tmp, (f"runs/second/*/step_{STEPS - 1}",), proc, 300, seen, killed["ips"])
        alive_after_start = running(killed["seen"].values())
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=180)
        third.wait(timeout=600)
    except BaseException:
        for p in (proc, third):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        raise
    finally:
        third_out.seek(0)
        third_err = third_out.read()  # its stdout and stderr, interleaved
        third_out.close()
    return {"proc": proc, "out": out, "err": err, "seen": seen, "alive_after_start": alive_after_start,
            "third": third, "third_err": third_err}


@pytest.fixture(scope="session")
def resumed(user_project, killed, stopped):
    """Run 3, which `stopped` ran beside run 2: what it did to run 1's MLflow run."""
    env, proc, err = user_project.env, stopped["third"], stopped["third_err"]
    assert proc.returncode == 0, f"run 1 killed at {killed['when']}:\n{err[-3000:]}"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name("mine").experiment_id])
    (run,) = [r for r in runs if r.data.tags.get("factory.resumes")]
    (second,) = [r for r in runs if r.info.status == "KILLED"]
    return {"run": run, "second": second, "client": client, "err": err}
