"""`factory run SPEC --resume [RUN]`: which run and checkpoint it picks, what it refuses (exit 2, before Ray
starts), and the tracker never logging a step twice. The crash test itself (a real run SIGKILLed, resumed,
its final weights equal to an uninterrupted run's) is tests/test_run_lifecycle.py."""
from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from factory.commands import cli
from factory.compiler.compile import compile_file, plan_json
from factory.runtime.resume import Resume, ResumeError, find, spooled_steps
from factory.tracking.mlflow_tracker import DRIVER_TAG
from factory.tracking.mlflow_tracker import MlflowTracker as Tracker
from factory.update.checkpoint import write_manifest, write_run_state

REPO = Path(__file__).resolve().parents[1]
SPEC = str(REPO / "specs" / "tiny.yaml")
GONE = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": 0.0})  # a driver that ended


@pytest.fixture(scope="module")
def uri(tmp_path_factory):
    """One store for the module (creating a sqlite store takes seconds); each test its own experiment."""
    return f"sqlite:///{tmp_path_factory.mktemp('store')}/m.db"


@pytest.fixture
def store(uri, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri, tmp_path / "ckpt"


def compiled(ckpt: Path, *overrides: str):
    return compile_file(SPEC, [f"train.checkpoint_dir={ckpt}", "train.steps=4", *overrides])


def resumed_tracker(uri: str, experiment: str, run_id: str, ckpt: Path, step: int, *, logged: int | None = None,
                    checkpoints: list | None = None, **resume: object) -> Tracker:
    """A tracker that resumed `run_id` after `step` (what factory.runtime.resume.find returns, as far as the tracker
    reads it: logged through `logged`, default `step`), for the tracker's own resume tests."""
    r = SimpleNamespace(run_id=run_id, step=step, logged=step if logged is None else logged, changed=[],
                        checkpoint_dir=ckpt, checkpoint=f"step_{step}", checkpoints=checkpoints or [])
    _, plan = compiled(ckpt)
    tracker = Tracker(uri, experiment)
    tracker.resume(r, plan, {"calc": []}, **resume)
    return tracker


def fake_run(uri: str, ckpt: Path, plan, *, logged: int, checkpoints: tuple[int, ...] = (), status: str = "RUNNING",
             driver: str = GONE, experiment: str = "tiny", tags: dict[str, str] | None = None) -> str:
    """A run as `factory run` leaves it: tags, plan.json, metrics through step `logged`, checkpoints whose
    run_state names it; status RUNNING is what a SIGKILLed driver leaves."""
    from mlflow.tracking import MlflowClient

    t = Tracker(uri, experiment)
    t.start("tiny-x", {}, {"factory.spec_name": "tiny", "factory.spec_hash": plan.hashes["spec"],
                           "factory.checkpoint_dir": str(ckpt), **(tags or {})}, {"plan.json": plan_json(plan)})
    t.log_metrics({"eval/reward": 0.25}, step=0)
    for step in range(1, logged + 1):
        t.log_metrics({"timing/step_s": 1.0, "reward/mean": step / 10}, step=step)
    for step in checkpoints:
        folder = ckpt / f"step_{step}"
        folder.mkdir(parents=True)
        write_run_state(folder, {"step": step, "run_id": t.run_id, "data": {"epoch": 0, "cursor": 2 * step},
                                 "watch": {"seen": step}})
        write_manifest(folder)
        t.log_checkpoint(step, str(folder))
    t.end("FINISHED" if status == "FINISHED" else "FAILED")
    client = MlflowClient(uri)
    client.update_run(t.run_id, status=status)
    client.set_tag(t.run_id, DRIVER_TAG, driver)
    return t.run_id


def test_picks_the_newest_unfinished_run_of_this_spec_and_its_own_checkpoint(store):
    uri, ckpt = store
    spec, plan = compiled(ckpt)
    exp = {"experiment": "picks"}
    older = fake_run(uri, ckpt, plan, logged=2, checkpoints=(2,), status="KILLED", **exp)
    mine = fake_run(uri, ckpt, plan, logged=2, checkpoints=(1,), **exp)  # killed after logging step 2, before saving it
    fake_run(uri, ckpt, plan, logged=2, checkpoints=(), status="FINISHED", **exp)  # finished: nothing to resume
    _, other_plan = compiled(ckpt, "train.lr=0.5")
    fake_run(uri, ckpt, other_plan, logged=1, **exp)  # newest, but another spec

    r = find(plan, None, uri, train=spec.train, **exp)
    # step_2 in the shared folder is the older run's: this run continues from its own step_1
    assert (r.run_id, r.checkpoint, r.step, r.logged) == (mine, "step_1", 1, 2)
    assert r.data == {"epoch": 0, "cursor": 2} and r.before == {"eval/reward": 0.25} and r.changed == []
    assert r.watch == {"seen": 1}  # the monitors' history at that checkpoint (lost, a monitor starts over)
    assert [c["step"] for c in r.checkpoints] == [1]
    assert "at step 2" in r.describe() and "step 2 is computed again, not logged twice" in r.describe()
    # no checkpoint: it starts over, its step-0 evaluation included ("at step 1, from the start" read as both)
    fresh = Resume("r", "n", ckpt, None, 0, 1, None)
    assert fresh.describe() == ("resuming run r (n) from the start (it saved no checkpoint); steps 0-1 are computed "
                                "again, not logged twice")
    assert find(plan, older, uri, train=spec.train, **exp).checkpoint == "step_2"  # named explicitly (id)


def test_a_bare_resume_passes_over_a_newer_eval_or_rescore_run_of_the_spec(store):
    """A `factory eval` (tag factory.kind) or `factory rescore` run (tag factory.rescore_of) carries the spec's
    name and hash; one failed or stopped after the training run was killed was picked, and trained from step 0
    in it, passing over the killed run and its checkpoints."""
    uri, ckpt = store
    spec, plan = compiled(ckpt)
    exp = {"experiment": "not-eval"}
    killed = fake_run(uri, ckpt, plan, logged=2, checkpoints=(2,), status="KILLED", **exp)
    fake_run(uri, ckpt, plan, logged=0, status="FAILED", tags={"factory.kind": "eval"}, **exp)
    fake_run(uri, ckpt, plan, logged=0, status="KILLED", tags={"factory.rescore_of": killed}, **exp)
    r = find(plan, None, uri, train=spec.train, **exp)
    assert (r.run_id, r.checkpoint) == (killed, "step_2")


def test_an_eval_or_rescore_run_named_to_resume_is_refused(store):
    """`factory eval` and `factory rescore` open runs with the spec's name and hash (`factory runs` lists them
    beside the training runs, with the same `tiny-<time>` names): a bare resume passes them over, but one named
    in `--resume` was accepted "from the start (it saved no checkpoint)", and the driver trained steps 1..N in it."""
    uri, ckpt = store
    spec, plan = compiled(ckpt)
    exp = {"experiment": "named-eval"}
    trained = fake_run(uri, ckpt, plan, logged=2, checkpoints=(2,), status="KILLED", **exp)
    evaluated = fake_run(uri, ckpt / "e", plan, logged=0, status="FINISHED", tags={"factory.kind": "eval"}, **exp)
    rescored = fake_run(uri, ckpt / "r", plan, logged=0, status="KILLED", tags={"factory.rescore_of": trained}, **exp)
    for run, kind in ((evaluated, "eval"), (rescored, "rescore")):
        with pytest.raises(ResumeError, match=rf"^run {run} is a `factory {kind}` run: it trained nothing to resume; "
                                              r"resume the training run \(`factory runs` lists it"):
            find(plan, run, uri, train=spec.train, **exp)


def test_a_sessions_start_up_is_logged_once_at_its_first_step(store):
    """A resume killed in its first step left its start-up times at that step; the next resume logged its own
    there too: timing/startup_s held two values at step 3."""
    from mlflow.tracking import MlflowClient

    uri, ckpt = store
    spec, plan = compiled(ckpt)
    run_id = fake_run(uri, ckpt, plan, logged=2, checkpoints=(2,), experiment="startup")
    r = find(plan, run_id, uri, train=spec.train, experiment="startup")
    assert r.startup_step(4) == 3 and r.startup_step(2) is None  # no step left: none to log it at
    MlflowClient(uri).log_metric(run_id, "timing/startup_s", 40.0, step=3)  # that session, killed in step 3
    MlflowClient(uri).set_tag(run_id, DRIVER_TAG, GONE)
    again = find(plan, run_id, uri, train=spec.train, experiment="startup")
    assert again.started == [3] and again.startup_step(4) is None


def test_a_start_up_still_in_the_spool_counts_as_logged(store):
    """The store was down when a session logged: its start-up times (and steps) waited in the spool, and the
    resume read the store alone. A start-up spooled at step 3 was logged there a second time (the spool sends it
    first); a step 3 spooled put this session's start-up at 3, which the tracker then dropped (logged)."""
    from mlflow.tracking import MlflowClient

    from factory.tracking.mlflow_tracker import SPOOL
    from factory.tracking.spool import Spool

    uri, ckpt = store
    spec, plan = compiled(ckpt)
    run_id = fake_run(uri, ckpt, plan, logged=2, checkpoints=(2,), experiment="spooled-startup")
    Spool(ckpt / SPOOL).add("metrics", step=3, values={"timing/startup_s": 40.0})  # killed in step 3, store down
    r = find(plan, run_id, uri, train=spec.train, experiment="spooled-startup")
    assert (r.logged, r.started, r.startup_step(4)) == (2, [3], None)
    t = Tracker(uri, "spooled-startup")
    t.resume(r, plan, {"calc": []})  # sends the spool
    t.end("KILLED")
    MlflowClient(uri).set_tag(run_id, DRIVER_TAG, GONE)
    assert [(m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, "timing/startup_s")] == [(3, 40.0)]
    # its step 3 spooled too: logged, and this session's start-up goes at step 4
    Spool(ckpt / SPOOL).add("metrics", step=3, values={"timing/step_s": 1.0})
    later = find(plan, run_id, uri, train=spec.train, experiment="spooled-startup")
    assert (later.logged, later.startup_step(4)) == (3, 4)
    assert spooled_steps([{"kind": "text"}, {"kind": "metrics", "step": 0, "values": {"eval/reward": 1.0}}],
                         "eval/reward") == [0]


def test_a_changed_source_is_named():
    """"was trained with a different rewards than ...": which file, the user had to find."""
    from factory.runtime.resume import sources_changed

    then = {"myrewards/good.py": "a1", "myrewards/util.py": "b2", "old.py": "c3"}
    now = {"myrewards/good.py": "a9", "myrewards/util.py": "b2", "new.py": "d4"}
    assert sources_changed(then, now) == ["myrewards/good.py", "new.py", "old.py (gone)"]
    assert sources_changed({"/abs/path/good.py": "a1"}, {"good": "a1"}) == []  # re-keyed, same contents
    assert sources_changed("x", "y") == []


def test_refusals_are_exit_2_with_what_to_do(store, capsys):
    uri, ckpt = store
    spec, plan = compiled(ckpt)
    run = fake_run(uri, ckpt, plan, logged=1, checkpoints=(1,))
    base = ["run", SPEC, f"train.checkpoint_dir={ckpt}", "train.steps=4"]

    # another spec: not picked, and refused when named, unless allowed
    assert cli.main([*base, "train.lr=0.5", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "no unfinished run of spec 'tiny' with this spec and overrides" in err and run in err, err
    assert "--allow-spec-change" in err
    assert cli.main([*base, "--resume", run, "train.lr=0.5"]) == 2
    assert ("trained with another spec (train.lr: 0.001 -> 0.5) than this spec and overrides give: resume "
            "with the same") in (err := capsys.readouterr().err), repr(err)  # which key: the user need not hunt for the override
    spec2, plan2 = compiled(ckpt, "train.lr=0.5")
    allowed = find(plan2, run, uri, train=spec2.train, experiment="tiny", allow_spec_change=True)
    assert allowed.changed == ["spec"] and allowed.checkpoint == "step_1"
    # `--resume KEY=VALUE` is an override, not a run name
    assert cli.main([*base, "--resume", "train.lr=0.5"]) == 2
    assert "no unfinished run of spec 'tiny'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):  # without --resume it would mean nothing: refused
        cli.main([*base, "--allow-spec-change"])
    assert "--allow-spec-change goes with --resume" in capsys.readouterr().err

    # a run held by a live driver: one still training it, or another --resume of it still starting (whose run
    # was KILLED: the status says nothing until the run reopens, 30-60 s later; both drivers then logged it)
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient
    from psutil import Process

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        client = MlflowClient(uri)
        client.set_tag(run, DRIVER_TAG, json.dumps({"host": socket.gethostname(), "pid": other.pid,
                                                    "started": Process(other.pid).create_time()}))
        for status in ("RUNNING", "KILLED"):
            client.set_terminated(run, status)
            with pytest.raises(ResumeError, match=f"run {run} is held by a live driver \\(pid {other.pid}\\).*stop "
                                                  "that one first"):
                find(plan, run, uri, train=spec.train, experiment="tiny")
    finally:
        other.kill()
        other.wait()
    # once that driver is gone, a resume takes the run at once: a second one now would be refused
    assert find(plan, run, uri, train=spec.train, experiment="tiny").run_id == run
    assert json.loads(client.get_run(run).data.tags[DRIVER_TAG])["pid"] == Process().pid

    # a run that did all its steps and ended (one that never ended is resumed to end it)
    done = fake_run(uri, ckpt, plan, logged=4, checkpoints=(4,), status="FINISHED")
    with pytest.raises(ResumeError, match="has done all 4 steps"):
        find(plan, done, uri, train=spec.train, experiment="tiny")
    assert cli.main([*base, "--resume", "no-such-run"]) == 2
    assert "no run with id or name 'no-such-run'" in capsys.readouterr().err

    # a run whose checkpoint folder is gone (moved, a disk not mounted): it restarted from step 0 without a word
    gone = fake_run(uri, ckpt / "moved", plan, logged=3, checkpoints=(2,))
    (ckpt / "moved").rename(ckpt / "moved-away")
    assert cli.main([*base, "--resume", gone]) == 2
    assert (f"run {gone} saved a checkpoint at step 2 in {ckpt / 'moved'}, which does not exist: put that folder "
            "back") in capsys.readouterr().err


def test_a_run_with_every_step_done_resumes_only_to_send_what_its_driver_could_not(store):
    """A store down at a run's end left its last records in the spool, and said `--resume` sends them; the
    resume refused the run ("has done all 4 steps: nothing to resume"): they were never sent."""
    from factory.tracking.mlflow_tracker import SPOOL
    from factory.tracking.spool import Spool

    uri, ckpt = store
    spec, plan = compiled(ckpt)
    run = fake_run(uri, ckpt, plan, logged=4, checkpoints=(4,), status="FINISHED")
    with pytest.raises(ResumeError, match="has done all 4 steps"):
        find(plan, run, uri, train=spec.train, experiment="tiny")
    Spool(ckpt / SPOOL).add("tags", tags={"left": "unsent"})
    resume = find(plan, run, uri, train=spec.train, experiment="tiny")
    assert (resume.step, resume.complete, resume.unsent) == (4, True, 1)
    assert resume.describe() == (f"resuming run {run} (tiny-x) to send the 1 tracking records its driver could not: "
                                 f"every step is done (its checkpoint {ckpt / 'step_4'})")


def test_a_run_killed_after_its_last_checkpoint_resumes_to_be_marked_finished_without_ray(store, monkeypatch, capsys):
    """A driver SIGKILLed after its last step's checkpoint, every record sent, before it marked the run ended (its
    end waits for the trace export): `--resume` refused the run ("has done all 4 steps: nothing to resume"), which
    stayed RUNNING for good, and every bare `--resume` of the spec picked it before any older killed run."""
    from mlflow.tracking import MlflowClient

    import factory.runtime.driver as driver

    uri, ckpt = store
    exp = "all-done"
    spec, plan = compiled(ckpt, f"tracking.experiment={exp}")
    run = fake_run(uri, ckpt, plan, logged=4, checkpoints=(4,), status="RUNNING", experiment=exp)
    resume = find(plan, None, uri, train=spec.train, experiment=exp)  # the newest unfinished run: this one
    assert (resume.run_id, resume.step, resume.complete, resume.unsent) == (run, 4, True, 0)
    assert resume.describe() == (f"resuming run {run} (tiny-x) to mark it FINISHED, which its driver could not: "
                                 f"every step is done (its checkpoint {ckpt / 'step_4'})")
    MlflowClient(uri).set_tag(run, DRIVER_TAG, GONE)  # (find claimed it)

    def no_ray(*args, **kwargs):
        raise AssertionError("a resume with no step to run started Ray and the stages")

    monkeypatch.setattr(driver, "placed", no_ray)
    base = ["run", SPEC, f"train.checkpoint_dir={ckpt}", "train.steps=4", f"tracking.experiment={exp}"]
    assert cli.main([*base, "--resume"]) == 0, capsys.readouterr().err
    out = capsys.readouterr()
    assert f"run {run} had done every step: no stage started (nothing to train); it ends FINISHED" in out.err, out.err
    done = MlflowClient(uri).get_run(run)
    assert done.info.status == "FINISHED" and DRIVER_TAG not in done.data.tags
    # no stage ran in that session: it records no environment of its own, which `factory diff` would have read as
    # the run's newest (every `resolved.*` setting of its stages "-", and "resumed where it ran otherwise")
    assert not [k for k in done.data.tags if k.startswith("factory.resumed.")], done.data.tags
    # ended, it is no longer picked; named, it is refused: there is nothing left to do
    assert cli.main([*base, "--resume"]) == 2
    assert "no unfinished run of spec 'tiny'" in capsys.readouterr().err
    with pytest.raises(ResumeError, match=f"run {run} has done all 4 steps .*: nothing to resume"):
        find(plan, run, uri, train=spec.train, experiment=exp)


def test_a_resume_that_only_ends_the_run_still_ends_what_its_killed_driver_left(store, monkeypatch, tmp_path, capsys):
    """The resume above skips placing the stages, and so placed()'s first act, ending what a killed driver left
    (its Ray, engines, tool servers): that driver, SIGKILLed after its last checkpoint, is the very case, and what
    it left outlived the `factory run --resume` (docs/reliability.md: nothing outlives the next `factory run`)."""
    import subprocess
    import sys

    import psutil
    from mlflow.tracking import MlflowClient

    import factory.runtime.driver as driver
    import factory.runtime.lifecycle as lifecycle
    from tests.test_lifecycle import DRIVER, _running

    sessions = tmp_path / "drivers"
    sessions.mkdir()
    monkeypatch.setattr(lifecycle, "sessions_dir", lambda: sessions)
    killed = subprocess.Popen([sys.executable, "-c", DRIVER, str(sessions)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    orphan = int(killed.stdout.readline())
    killed.kill()
    killed.wait()
    try:
        uri, ckpt = store
        exp = "all-done-reap"
        spec, plan = compiled(ckpt, f"tracking.experiment={exp}")
        run = fake_run(uri, ckpt, plan, logged=4, checkpoints=(4,), status="RUNNING", experiment=exp)
        MlflowClient(uri).set_tag(run, DRIVER_TAG, GONE)
        placed = driver.placed
        monkeypatch.setattr(driver, "placed", lambda *a, **k: (_ for _ in ()).throw(AssertionError("placed")))
        base = ["run", SPEC, f"train.checkpoint_dir={ckpt}", "train.steps=4", f"tracking.experiment={exp}"]
        assert cli.main([*base, "--resume"]) == 0, capsys.readouterr().err
        assert not _running(orphan), "the killed driver's process outlived `factory run --resume`"
        assert "ended what a killed run left behind" in capsys.readouterr().err
    finally:
        if _running(orphan):
            psutil.Process(orphan).kill()
    # (the function placed() calls first too: placed itself is still the context manager every run enters)
    assert hasattr(placed(None, None, None), "__enter__")


def test_a_run_a_stop_on_monitor_stopped_is_refused_until_the_monitor_is_taken_out(store):
    """Resumed as it was, a run that `train.stop_on` stopped read the same monitor history, trained one more step
    and stopped again, exit 4 (and said the monitor "fired" at that step, where it had first fired before)."""
    from mlflow.tracking import MlflowClient

    from factory.monitors import HALTED_BY_TAG

    uri, ckpt = store
    spec, plan = compiled(ckpt, "train.stop_on=[length_drift]")
    run = fake_run(uri, ckpt, plan, logged=3, checkpoints=(3,), status="FINISHED", experiment="halted")
    MlflowClient(uri).set_tag(run, "factory.stopped_by", "monitor length_drift fired at step 3 (train.stop_on): why")
    MlflowClient(uri).set_tag(run, HALTED_BY_TAG, "length_drift")
    with pytest.raises(ResumeError, match=rf"^run {run} was stopped by monitor length_drift fired at step 3 "
                                          r"\(train.stop_on\): why\. Resumed, .*take length_drift out of "
                                          r"train.stop_on .*--allow-spec-change$"):
        find(plan, run, uri, train=spec.train, experiment="halted")
    spec, plan = compiled(ckpt)  # taken out
    assert find(plan, run, uri, train=spec.train, experiment="halted", allow_spec_change=True).step == 3


def test_a_checkpoint_of_other_tensors_is_refused_even_with_a_changed_spec_allowed(store, capsys, monkeypatch):
    """LoRA turned on or off, or another rank: the checkpoint cannot load into the learner (DeepSpeed's
    internal error once every stage had started, and the run left FAILED), so --resume says so up front."""
    uri, ckpt = store
    _, full = compiled(ckpt)
    run = fake_run(uri, ckpt, full, logged=1, checkpoints=(1,), experiment="lora")
    spec, lora = compiled(ckpt, "model.lora.r=8")
    with pytest.raises(ResumeError, match=rf"^run {run}'s checkpoint .*step_1 holds full weights, and this spec "
                                          r"trains LoRA adapters \(r 8, target_modules all-linear\) \(model.lora\)"
                                          rf".*`factory export {run} --out DIR`, then model.path=DIR$"):
        find(lora, run, uri, train=spec.train, experiment="lora", allow_spec_change=True)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")  # the store is then not the one `factory export` reads by default
    with pytest.raises(ResumeError, match=rf"`factory export {run} --out DIR --uri {re.escape(uri)}`, then "):
        find(lora, run, uri, train=spec.train, experiment="lora", allow_spec_change=True)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    adapters = fake_run(uri, ckpt / "a", lora, logged=1, checkpoints=(1,), experiment="lora")
    spec16, r16 = compiled(ckpt / "a", "model.lora.r=16")
    with pytest.raises(ResumeError, match=r"holds LoRA adapters \(r 8, .*this spec trains LoRA adapters \(r 16,"):
        find(r16, adapters, uri, train=spec16.train, experiment="lora", allow_spec_change=True)
    # what loads into the same tensors is allowed: another alpha, another learning rate
    spec_a, alpha = compiled(ckpt / "a", "model.lora.r=8", "model.lora.alpha=4", "train.lr=0.5")
    assert find(alpha, adapters, uri, train=spec_a.train, experiment="lora",
                allow_spec_change=True).checkpoint == "step_1"
    # from the command line: exit 2, no traceback
    assert cli.main(["run", SPEC, f"train.checkpoint_dir={ckpt}", "train.steps=4", "model.lora.r=8", "--resume", run,
                     "--allow-spec-change"]) == 2
    assert "holds full weights, and this spec trains LoRA adapters" in capsys.readouterr().err


def test_a_checkpoint_is_not_resumed_under_another_optimizer(store, monkeypatch):
    """`--allow-spec-change train.optimizer.name=adamw` on an SGD run's checkpoint: torch loaded SGD's state into
    AdamW, and the first step failed with KeyError 'betas' after Ray and every stage had started. The optimizer's
    settings may change (the learner applies the spec's after loading); its kind may not."""
    uri, ckpt = store
    _, sgd = compiled(ckpt, "train.optimizer.name=sgd")
    run = fake_run(uri, ckpt, sgd, logged=1, checkpoints=(1,), experiment="optim")
    spec, adamw = compiled(ckpt)
    with pytest.raises(ResumeError, match=rf"^run {run}'s checkpoint .*step_1 holds the state of optimizer 'sgd', and "
                                          r"this spec trains with 'adamw' \(train.optimizer.name\): .*resume with "
                                          r"train.optimizer.name=sgd, or start a new run from its model: `factory "
                                          rf"export {run} --out DIR`, then model.path=DIR$"):
        find(adamw, run, uri, train=spec.train, experiment="optim", allow_spec_change=True)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")  # the store is then not the one `factory export` reads by default
    with pytest.raises(ResumeError, match=rf"`factory export {run} --out DIR --uri {re.escape(uri)}`, then "):
        find(adamw, run, uri, train=spec.train, experiment="optim", allow_spec_change=True)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    spec_d, decay = compiled(ckpt, "train.optimizer.name=sgd", "train.optimizer.weight_decay=0.1",
                             "train.optimizer.grad_clip=0.5")
    assert find(decay, run, uri, train=spec_d.train, experiment="optim",
                allow_spec_change=True).checkpoint == "step_1"


def test_the_checkpoint_is_compared_with_the_plan_that_saved_it(store):
    """A run resumed from its start with LoRA turned on (--allow-spec-change) saves adapters from then on: its
    next resume with that LoRA spec was refused as "holds full weights" (its first plan's), and the full-weight
    spec it suggested passed, then failed in DeepSpeed."""
    from mlflow.tracking import MlflowClient

    uri, ckpt = store
    spec_f, full = compiled(ckpt)
    spec, lora = compiled(ckpt, "model.lora.r=8")
    run = fake_run(uri, ckpt, full, logged=1, checkpoints=(1,), experiment="switched")
    MlflowClient(uri).log_text(run, plan_json(lora), "resumed/step_0/plan.json")  # resumed from the start
    assert find(lora, run, uri, train=spec.train, experiment="switched",
                allow_spec_change=True).checkpoint == "step_1"
    with pytest.raises(ResumeError, match=r"holds LoRA adapters \(r 8, .*this spec trains full weights"):
        find(full, run, uri, train=spec_f.train, experiment="switched", allow_spec_change=True)
    # a resume at step 1 saves from step 2 on: step 1's checkpoint is still the first plan's
    later = fake_run(uri, ckpt / "later", full, logged=1, checkpoints=(1,), experiment="switched")
    MlflowClient(uri).log_text(later, plan_json(lora), "resumed/step_1/plan.json")
    with pytest.raises(ResumeError, match=r"holds full weights, and this spec trains LoRA adapters"):
        find(lora, later, uri, train=spec.train, experiment="switched", allow_spec_change=True)
    # the record of that resume still in the run's spool (the store was down when it was made): read from there
    from factory.tracking.mlflow_tracker import SPOOL
    from factory.tracking.spool import Spool

    spooled = fake_run(uri, ckpt / "spooled", full, logged=1, checkpoints=(1,), experiment="switched")
    # two resumes at step 0 while the store was down: the newer one's plan saved step 1
    Spool(ckpt / "spooled" / SPOOL).add("text", text=plan_json(full), name="resumed/step_0/plan.json")
    Spool(ckpt / "spooled" / SPOOL).add("text", text=plan_json(lora), name="resumed/step_0/plan.json")
    assert find(lora, spooled, uri, train=spec.train, experiment="switched",
                allow_spec_change=True).checkpoint == "step_1"
    # (passing alone, that says nothing: a plan not found is no refusal) the spooled plan is the one compared
    with pytest.raises(ResumeError, match=r"holds LoRA adapters \(r 8, .*this spec trains full weights"):
        find(full, spooled, uri, train=spec_f.train, experiment="switched", allow_spec_change=True)


def test_a_spec_change_is_judged_against_the_spec_the_checkpoint_was_trained_under(store):
    """A run of spec A resumed at step 1 under B (--allow-spec-change), its step_3 trained under B: resumed again
    with A and no flag, it was accepted and not recorded (compared with the run's first plan), and with B refused;
    nor was it found for B without a run named."""
    from mlflow.tracking import MlflowClient

    uri, ckpt = store
    spec_a, a = compiled(ckpt)
    spec_b, b = compiled(ckpt, "train.lr=0.5")
    run = fake_run(uri, ckpt, a, logged=3, checkpoints=(1, 3), experiment="revert")
    MlflowClient(uri).set_tag(run, "factory.resumed_spec_hash", b.hashes["spec"])  # as record_spec_change leaves it
    MlflowClient(uri).log_text(run, plan_json(b), "resumed/step_1/plan.json")
    with pytest.raises(ResumeError, match=rf"^run {run} was trained with another spec \(train.lr: 0.5 -> 0.001\) "
                                          r"than this spec and overrides give \(since a resume that changed it: its "
                                          r"artifact resumed/step_1/spec.yaml\): resume with the same spec"):
        find(a, run, uri, train=spec_a.train, experiment="revert")
    back = find(a, run, uri, train=spec_a.train, experiment="revert", allow_spec_change=True)
    assert (back.checkpoint, back.changed) == ("step_3", ["spec"])  # recorded (record_spec_change) as a change
    assert find(b, run, uri, train=spec_b.train, experiment="revert").changed == []
    # found by the spec it now trains under, not its first
    assert find(b, None, uri, train=spec_b.train, experiment="revert").run_id == run
    with pytest.raises(ResumeError, match=f"no unfinished run of spec 'tiny' with this spec .*{run} "):
        find(a, None, uri, train=spec_a.train, experiment="revert")
    # a checkpoint saved before that resume (step_1: it was killed before step_2's) is still A's
    early = fake_run(uri, ckpt / "early", a, logged=2, checkpoints=(1,), experiment="revert-early")
    MlflowClient(uri).log_text(early, plan_json(b), "resumed/step_1/plan.json")
    assert find(a, early, uri, train=spec_a.train, experiment="revert-early").changed == []
    assert find(b, early, uri, train=spec_b.train, experiment="revert-early", allow_spec_change=True).changed == [
        "spec"]


def test_a_resume_under_the_first_spec_after_an_abandoned_changed_one_is_judged_against_what_trained(store):
    """Run of spec A, checkpoint step_1. Resumed at step 1 under B (--allow-spec-change, recorded as
    resumed/step_1), killed before it saved; resumed at step 1 under A again (no change against step_1: nothing
    was recorded), which trained and saved step_3. The next resume under A took the stale record (B) for step_3's
    plan and refused it, and a bare resume under A did not find the run; B, which trained nothing kept, passed."""
    from mlflow.tracking import MlflowClient

    from factory.runtime.resume import record_spec_change

    uri, ckpt = store
    spec_a, a = compiled(ckpt)
    spec_b, b = compiled(ckpt, "train.lr=0.5")
    exp = {"experiment": "abandoned"}
    run = fake_run(uri, ckpt, a, logged=1, checkpoints=(1,), **exp)

    def session(plan, spec, **allow):
        """A resume as the driver makes it, up to its first step: the run reopened, then (_begin) its spec
        recorded as record_spec_change decides."""
        r = find(plan, run, uri, train=spec.train, **exp, **allow)
        t = Tracker(uri, exp["experiment"])
        t.resume(r, plan, {})
        record_spec_change(t, r, plan)
        return r, t

    r, t = session(b, spec_b, allow_spec_change=True)
    assert (r.checkpoint, r.changed) == ("step_1", ["spec"])
    t.end("FAILED")  # killed before it saved
    MlflowClient(uri).set_tag(run, DRIVER_TAG, GONE)
    r, t = session(a, spec_a)
    assert (r.checkpoint, r.changed) == ("step_1", [])
    for step in (2, 3):
        t.log_metrics({"timing/step_s": 1.0}, step=step)
    _saved(ckpt / "step_3", 3, run)  # steps 2-3 trained under A
    t.log_checkpoint(3, str(ckpt / "step_3"))
    t.end("FAILED")
    MlflowClient(uri).set_tag(run, DRIVER_TAG, GONE)

    r, t = session(a, spec_a)
    assert (r.checkpoint, r.changed) == ("step_3", [])
    assert t.artifacts(run, "resumed") == ["resumed/step_1"]  # nothing to record: no change, no stale record
    t.end("FAILED")
    MlflowClient(uri).set_tag(run, DRIVER_TAG, GONE)
    assert find(a, None, uri, train=spec_a.train, **exp).run_id == run  # found by the spec it trains under
    with pytest.raises(ResumeError, match=r"trained with another spec \(train.lr: 0.001 -> 0.5\)"):
        find(b, run, uri, train=spec_b.train, **exp)


def test_target_modules_that_adapt_the_same_layers_resume_and_others_are_refused(store):
    """`all-linear` and the list of every linear layer's name adapt the same modules of the model, so the
    checkpoint loads: it was refused for the different words. A list that leaves out one layer is refused."""
    uri, ckpt = store
    every = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"  # tiny-qwen3's linear layers
    spec, lora = compiled(ckpt, "model.lora.r=8")
    run = fake_run(uri, ckpt, lora, logged=1, checkpoints=(1,), experiment="targets")
    spec_l, listed = compiled(ckpt, "model.lora.r=8", f"model.lora.target_modules={every}")
    assert find(listed, run, uri, train=spec_l.train, experiment="targets",
                allow_spec_change=True).checkpoint == "step_1"
    spec_s, fewer = compiled(ckpt, "model.lora.r=8", "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]")
    with pytest.raises(ResumeError, match=r"holds LoRA adapters \(r 8, target_modules all-linear\).*this spec "
                                          r"trains LoRA adapters \(r 8, target_modules \['q_proj'"):
        find(fewer, run, uri, train=spec_s.train, experiment="targets", allow_spec_change=True)


def test_a_step_that_waited_in_the_spool_is_sent_by_the_resume(store):
    """A driver killed with a step unsent (the store down): `find` counts it as logged (its start-up goes after
    it), and the tracker, given that, took it for sent and dropped it from the spool: the step was never logged."""
    from mlflow.tracking import MlflowClient

    from factory.tracking.mlflow_tracker import SPOOL
    from factory.tracking.spool import Spool

    uri, ckpt = store
    spec, plan = compiled(ckpt)
    run_id = fake_run(uri, ckpt, plan, logged=2, checkpoints=(2,), experiment="spooled-step")
    Spool(ckpt / SPOOL).add("metrics", step=3, values={"timing/step_s": 1.0, "reward/mean": 0.3})
    r = find(plan, run_id, uri, train=spec.train, experiment="spooled-step")
    t = Tracker(uri, "spooled-step")
    t.resume(r, plan, {"calc": []})
    assert (r.logged, t.logged, t.spool.records) == (3, 3, [])
    t.log_metrics({"timing/step_s": 2.0, "reward/mean": 0.9}, step=3)  # computed again: not logged twice
    t.end("KILLED")
    assert [(m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, "reward/mean")] == [
        (1, 0.1), (2, 0.2), (3, 0.3)]


def test_a_killed_drivers_idle_time_counts_the_steps_that_waited_in_its_spool(store):
    """The store down when the driver was killed: its last work (a resumed session's start-up, logged at the step it
    then did) waited in the spool. The resume read the idle time before sending it, and sent it stamped with that
    moment: the idle time ran from an older step, and `factory runs` under-reported the run's duration."""
    from mlflow.tracking import MlflowClient

    from factory.tracking.mlflow_tracker import SPOOL, idle_since
    from factory.tracking.spool import Spool

    uri, ckpt = store
    spec, plan = compiled(ckpt)
    run_id = fake_run(uri, ckpt, plan, logged=2, checkpoints=(2,), experiment="spooled-idle")
    logged = time.time() + 100  # 100 s after step 2: its record waited in the spool, the store down
    Spool(ckpt / SPOOL).add("metrics", step=3, values={"timing/startup_s": 30.0}, time_ms=int(logged * 1000))
    t = Tracker(uri, "spooled-idle")
    t.resume(find(plan, run_id, uri, train=spec.train, experiment="spooled-idle"), plan, {"calc": []},
             started=logged + 10)
    t.end("KILLED")
    run = MlflowClient(uri).get_run(run_id)
    assert float(run.data.tags["factory.idle_s"]) == pytest.approx(10.0, abs=0.2)
    (startup,) = MlflowClient(uri).get_metric_history(run_id, "timing/startup_s")
    assert (startup.step, startup.timestamp) == (3, int(logged * 1000))
    # a step still waiting (the store failed again as the resume sent it) counts at the time it was logged
    client = SimpleNamespace(get_metric_history=lambda run_id, key: [SimpleNamespace(timestamp=1_000_000)])
    killed = SimpleNamespace(info=SimpleNamespace(run_id="r", start_time=900_000, end_time=None, status="RUNNING"))
    waiting = [{"kind": "metrics", "step": 4, "values": {"timing/step_s": 1.0}, "time_ms": 1_200_000},
               {"kind": "metrics", "step": 4, "values": {"reward/mean": 1.0}, "time_ms": 1_250_000},  # not a step's
               {"kind": "tags", "tags": {}, "time_ms": 1_300_000}]
    assert idle_since(client, killed, now=1_230.0, waiting=waiting) == pytest.approx(30.0)


def _saved(folder: Path, step: int, run_id: str) -> None:
    """What Learner.save_checkpoint leaves, as far as resume reads it (run_state.json + manifest)."""
    folder.mkdir(parents=True)
    write_run_state(folder, {"step": step, "run_id": run_id, "data": {"epoch": 0, "cursor": 2 * step}, "watch": None})
    write_manifest(folder)


def test_a_run_whose_checkpoint_dir_came_from_the_environment_resumes_from_its_own_folder(store, monkeypatch):
    """train.checkpoint_dir from ${oc.env:...} is masked, so no factory.checkpoint_dir tag names the run's folder:
    the resume looked for step_N/ in the root folder, found none (they are in <root>/<run name>-<id8>/) and trained
    the run over from step 0, saying only "it saved no checkpoint". A run saved before each run had a folder of its
    own (its checkpoints in the root) still resumes from there."""
    from mlflow.tracking import MlflowClient

    uri, ckpt = store
    monkeypatch.setenv("FACTORY_TEST_CKPT", str(ckpt))
    spec, plan = compile_file(SPEC, ["train.checkpoint_dir=${oc.env:FACTORY_TEST_CKPT}", "train.steps=4"])
    t = Tracker(uri, "envdir")
    t.start_run(plan, {})
    assert "factory.checkpoint_dir" not in t.client.get_run(t.run_id).data.tags  # the path is not recorded
    _saved(Path(t.checkpoint_dir) / "step_2", 2, t.run_id)
    t.end("FAILED")
    MlflowClient(uri).set_tag(t.run_id, DRIVER_TAG, GONE)
    r = find(plan, t.run_id, uri, train=spec.train, experiment="envdir")
    assert (r.checkpoint_dir, r.checkpoint, r.step) == (Path(t.checkpoint_dir), "step_2", 2), r.describe()

    old = fake_run(uri, ckpt, plan, logged=1, experiment="envdir")  # (fake_run's tag taken off below)
    _saved(ckpt / "step_1", 1, old)
    MlflowClient(uri).delete_tag(old, "factory.checkpoint_dir")
    r = find(plan, old, uri, train=spec.train, experiment="envdir")
    assert (r.checkpoint_dir, r.checkpoint) == (ckpt, "step_1"), r.describe()


def test_a_run_this_process_ended_can_be_resumed_from_another_process(store, monkeypatch):
    """The DRIVER_TAG a run is opened or claimed with was never cleared: a run driven by a process that lives on (a
    notebook kernel's `factory.run(..., stop=ev)`, a service) and ended was refused to `factory run --resume` from
    any other process, "held by a live driver", although nothing drove it. Nor was a claim released when the
    resume failed before the run reopened (Ray did not start, say)."""
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient

    import factory
    import factory.runtime.driver

    uri, ckpt = store
    spec, plan = compiled(ckpt)
    t = Tracker(uri, "kernel")
    t.start_run(plan, {})  # this process is the notebook kernel
    t.log_metrics({"eval/reward": 0.25}, step=0)
    t.log_metrics({"timing/step_s": 1.0}, step=1)
    _saved(Path(t.checkpoint_dir) / "step_1", 1, t.run_id)
    t.log_checkpoint(1, str(Path(t.checkpoint_dir) / "step_1"))
    t.end("KILLED")  # stopped by its `stop` event: the run is over, this process lives on
    # held until the teardown is done (the stages may still hold their devices): the driver releases it after
    assert MlflowClient(uri).get_run(t.run_id).data.tags.get(DRIVER_TAG)
    t.released()
    assert DRIVER_TAG not in MlflowClient(uri).get_run(t.run_id).data.tags

    code = (f"from factory.compiler.compile import compile_file\nfrom factory.runtime.resume import find\n"
            f"spec, plan = compile_file({SPEC!r}, ['train.checkpoint_dir={ckpt}', 'train.steps=4'])\n"
            f"print(find(plan, {t.run_id!r}, {uri!r}, train=spec.train, experiment='kernel').describe())\n")
    other = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert other.returncode == 0 and "at step 2" in other.stdout, other.stderr[-800:]  # the terminal's --resume

    def no_ray(*args, **kwargs):
        raise RuntimeError("Ray did not start")

    monkeypatch.setattr(factory.runtime.driver, "run", no_ray)
    with pytest.raises(RuntimeError, match="Ray did not start"):
        factory.run(plan, resume=t.run_id)  # claimed (find), then failed before the run reopened
    assert DRIVER_TAG not in MlflowClient(uri).get_run(t.run_id).data.tags


def test_a_resumed_tracker_logs_no_step_twice(uri, tmp_path):
    from mlflow.tracking import MlflowClient

    t = Tracker(uri, "e")
    # stopped by a stop_on monitor once, say: resumed with the monitor taken out, it goes on (and `factory runs`
    # showed a FINISHED run "stopped by" it)
    run_id = t.start("r", {}, {"factory.stopped_by": "monitor x fired", "factory.stopped_by_monitor": "x",
                               "factory.monitor.x": "1"}, {})
    for step in (0, 1, 2):
        t.log_metrics({"m": float(step)}, step=step)
    t.log_checkpoint(1, str(tmp_path / "step_1"))
    t.end("FAILED")
    time.sleep(0.5)  # no driver: `factory runs` leaves this out of the run's duration

    # what factory.runtime.resume.find returns, as far as the tracker reads it
    r = SimpleNamespace(run_id=run_id, step=1, logged=2, changed=[], checkpoint_dir=tmp_path / "ckpt",
                        checkpoint="step_1", checkpoints=[{"step": 1, "path": "p", "hf": "h"}])

    spec, plan = compiled(tmp_path / "ckpt")
    resumed = Tracker(uri, "e")
    resumed.resume(r, plan, {"calc": []})
    assert MlflowClient(uri).get_run(run_id).info.status == "RUNNING"
    for step in (2, 3):  # step 2 is computed again after the step-1 checkpoint
        resumed.log_metrics({"m": 10.0 + step}, step=step)
    resumed.log_checkpoint(2, str(tmp_path / "step_2"))
    resumed.end()
    client = MlflowClient(uri)
    assert [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, "m"), key=lambda m: m.step)] == \
        [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0)]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["factory.resumes"] == "1"
    assert run.data.tags["factory.resumed_from_step"] == "1"
    assert "factory.stopped_by" not in run.data.tags and "factory.stopped_by_monitor" not in run.data.tags
    assert run.data.tags["factory.monitor.x"] == "1"  # when it fired stays
    assert 0.4 <= float(run.data.tags["factory.idle_s"]) < 30
    from factory.tracking.runs import run_summary

    s = run_summary(Tracker(uri, "e").run(run_id))
    # (times in ms, one subtraction in float seconds: 1 ms is the precision; the idle tag has 0.1 s)
    assert s["steps"] == 4  # the resumed session's train.steps, whatever the params say (--allow-spec-change)
    assert s["duration_s"] == pytest.approx((run.info.end_time - run.info.start_time) / 1000
                                            - float(run.data.tags["factory.idle_s"]), abs=1e-3)


def test_a_recomputed_steps_traces_are_not_in_the_run_twice(uri, tmp_path):
    """A step logs its tables and traces before its metrics: a driver killed between the two left step 2's traces,
    and the resume that computes step 2 again logged them a second time (its table is replaced: the same name)."""
    import mlflow

    from tests.test_tracking import _traj

    t = Tracker(uri, "traces")
    run_id = t.start("r", {}, {}, {})
    t.log_trajectories([_traj()], 1, traces=1)
    t.log_metrics({"timing/step_s": 1.0}, step=1)
    t.log_trajectories([_traj()], 2, split="eval", traces=1)  # another split's: not this step's to replace
    t.log_trajectories([_traj(), _traj()], 2, traces=2)  # ... killed here, before step 2's metrics
    t.end("FAILED")
    again = resumed_tracker(uri, "traces", run_id, tmp_path / "ckpt", 1)
    again.log_trajectories([_traj(), _traj()], 2, traces=2)  # step 2 computed again
    again.log_metrics({"timing/step_s": 1.0}, step=2)
    again.log_trajectories([_traj()], 3, traces=1)
    again.end()
    found = mlflow.search_traces(locations=[again.experiment_id], run_id=run_id, return_type="list")
    assert sorted((x.info.tags["factory.step"], x.info.tags["factory.split"]) for x in found) == [
        ("1", "train"), ("2", "eval"), ("2", "train"), ("2", "train"), ("3", "train")]


def test_a_checkpointed_step_has_all_its_traces_though_its_driver_is_killed_as_it_saves(uri):
    """Traces went to MLflow's background export queue, flushed only at the run's end, while the step's metrics
    were sent at once: a driver SIGKILLed after a step's metrics lost some of its traces for good (a resume takes
    the step as logged and never traces it again), the store up all along (6 of 8 in a real run). They are in the
    store before the step's checkpoint is written: from it on, no resume computes the step again."""
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient

    code = """import os, sys
from types import SimpleNamespace
from factory.compiler.compile import compile_file
from factory.runtime.driver import _save
from factory.tracking.mlflow_tracker import MlflowTracker
from tests.test_tracking import _traj

class Killed:  # the update stage: the driver is SIGKILLed as it writes the checkpoint (no end, no exit handlers)
    def call(self, method, *args):
        os._exit(9)

_, plan = compile_file(sys.argv[1])
t = MlflowTracker(sys.argv[2], "traces-killed")
print(t.start("r", {}, {}, {}), flush=True)
t.log_trajectories([_traj() for _ in range(8)], 1, traces=8)
t.log_metrics({"timing/step_s": 1.0}, step=1)
_save({plan.flow("data")[-1].dst: Killed()}, plan, t, 1, SimpleNamespace(state=dict), data={})
"""
    child = subprocess.run([sys.executable, "-c", code, SPEC, uri], cwd=REPO, capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == 9, child.stderr[-2000:]
    run_id = child.stdout.split()[-1]
    client = MlflowClient(uri)
    assert [m.step for m in client.get_metric_history(run_id, "timing/step_s")] == [1]
    found = client.search_traces(locations=[client.get_run(run_id).info.experiment_id], run_id=run_id,
                                 max_results=100, include_spans=False)
    assert len(found) == 8


def test_a_checkpoint_committed_after_its_driver_died_is_listed_when_the_run_resumes_from_it(uri, tmp_path):
    """SIGKILL while the update stage writes a checkpoint: the stage outlives its driver by seconds and
    commits it, unlisted. The run resumed from it, and its checkpoints.json listed steps 1 and 3, not 2."""
    from mlflow.tracking import MlflowClient

    t = Tracker(uri, "e")
    run_id = t.start("r", {}, {}, {})
    t.log_checkpoint(1, str(tmp_path / "ckpt" / "step_1"))
    t.end("FAILED")
    resumed = resumed_tracker(uri, "e", run_id, tmp_path / "ckpt", 2, checkpoints=list(t.checkpoints))
    resumed.end()
    client = MlflowClient(uri)
    listed = json.loads(Path(client.download_artifacts(run_id, "checkpoints.json", str(tmp_path))).read_text())
    assert [c["step"] for c in listed] == [1, 2] and client.get_run(run_id).data.tags["factory.checkpoint_step"] == "2"
    # step 3 saved, then found broken (its manifest): resumed from step 2, the list and the tags drop it (the
    # list read [1, 2, 3] and the tags named step 3, passed over, until step 3 was saved again)
    resumed.log_checkpoint(3, str(tmp_path / "ckpt" / "step_3"))
    again = resumed_tracker(uri, "e", run_id, tmp_path / "ckpt", 2, logged=3, checkpoints=list(resumed.checkpoints))
    again.end()
    listed = json.loads(Path(client.download_artifacts(run_id, "checkpoints.json", str(tmp_path))).read_text())
    assert [c["step"] for c in listed] == [1, 2] and client.get_run(run_id).data.tags["factory.checkpoint_step"] == "2"


def test_a_resumed_session_records_what_it_ran_on_and_diff_compares_the_newest(uri, tmp_path, monkeypatch):
    """A run resumed on other code or another machine kept its first session's environment only (versions, commits,
    CPU, GPU, what each stage resolved): `factory diff` said the whole run ran where its first steps did. Each
    resumed session records its own (`factory.resumed.N.*`); diff compares each run's newest session, and says
    what changed between a run's sessions."""
    from factory.commands.diff import RunRecord, compare, environment_changes
    from factory.tracking import mlflow_tracker as mt

    def on(commit, gpu):
        monkeypatch.setattr(mt, "git_commit", lambda path=".": commit)
        monkeypatch.setattr(mt, "gpu_kind", lambda: gpu)

    on("aaaa", "none")
    first = Tracker(uri, "sessions")
    local = {**mt.environment_tags(), mt.RAY_CLUSTER_TAG: "local"}  # what start_run tags a run with
    run_id = first.start("r", {"resolved": {"rollout": {"dtype": "bfloat16"}}}, local, {})
    first.log_metrics({"timing/step_s": 1.0}, step=1)
    first.end("KILLED")
    on("bbbb", "1 x NVIDIA H100 80GB HBM3")
    resumed = resumed_tracker(uri, "sessions", run_id, tmp_path / "ckpt", 1,
                              resolved={"rollout": {"dtype": "float32"}})
    resumed.end()
    fresh = Tracker(uri, "sessions")  # a run made wholly where the resumed one's later steps ran
    fresh_id = fresh.start("f", {"resolved": {"rollout": {"dtype": "float32"}}}, {**local, **mt.environment_tags()},
                           {})
    fresh.end()

    a, b = fresh.run(run_id), fresh.run(fresh_id)
    assert environment_changes(a, b) == []
    report = compare(RunRecord(a, {}, None), RunRecord(b, {}, None), {}, {})
    assert report["environment"] == [] and report["identical"]
    assert report["notes"] == [
        "A was resumed after step 1 where it ran otherwise: factory.git_commit aaaa -> bbbb, factory.gpu none -> "
        "1 x NVIDIA H100 80GB HBM3, factory.source_commit aaaa -> bbbb, resolved.rollout.dtype bfloat16 -> float32"]


def test_a_metric_key_keeps_its_store_name_in_a_resumed_session(uri, tmp_path):
    """Keys MLflow refuses are named as they first come to a tracker, and a resumed session's tracker started
    empty: two keys that meet under one name (`x@1` and `x_1`), first come at different steps, swapped names at the
    resume, and the store's series `x_1` held one key's values before it and the other's after."""
    first = Tracker(uri, "names")
    run_id = first.start("r", {}, {}, {})
    first.log_metrics({"x@1": 1.0}, step=1)  # an eval-only key first
    first.log_metrics({"x_1": 2.0, "x@1": 3.0}, step=2)  # then a training key that is the name it took
    first.end("KILLED")
    resumed = resumed_tracker(uri, "names", run_id, tmp_path / "ckpt", 2)
    resumed.log_metrics({"x_1": 4.0, "x@1": 5.0}, step=3)  # both at once
    resumed.end()
    history = {k: [m.value for m in resumed.client.get_metric_history(run_id, k)]
               for k in resumed.client.get_run(run_id).data.metrics}
    assert history == {"x_1": [1.0, 3.0, 5.0], next(k for k in history if k.startswith("x_1-")): [2.0, 4.0]}


def test_steps_done_are_those_with_a_step_metric_not_a_resumed_sessions_start_up(uri):
    """A resumed session logs its start-up times at the step it does next: the run's `factory.step` tag
    (steps done, what `factory runs` shows) said that step was done before it was (3/4 with 2 done, for a
    resume killed in its first step)."""
    from mlflow.tracking import MlflowClient

    t = Tracker(uri, "e")
    run_id = t.start("r", {}, {}, {})
    t.log_metrics({"eval/reward": 0.5, "timing/startup_s": 9.0}, step=0)
    assert MlflowClient(uri).get_run(run_id).data.tags["factory.step"] == "0"
    t.log_metrics({"timing/step_s": 1.0}, step=1)
    t.log_metrics({"timing/step_s": 1.0}, step=2)
    t.log_metrics({"timing/startup_s": 9.0}, step=3)  # a resumed session's start-up, before its step 3
    assert MlflowClient(uri).get_run(run_id).data.tags["factory.step"] == "2"
    t.end()


def test_a_killed_drivers_idle_time_starts_at_its_newest_step():
    """A SIGKILLed driver leaves no end time: the gap runs from its newest step's metric."""
    from factory.tracking.mlflow_tracker import idle_since

    stamps = {"timing/step_s": [1_000_000, 1_060_000], "timing/startup_s": [990_000]}
    client = SimpleNamespace(get_metric_history=lambda run_id, key: [SimpleNamespace(timestamp=t) for t in stamps[key]])
    killed = SimpleNamespace(info=SimpleNamespace(run_id="r", start_time=900_000, end_time=None, status="RUNNING"))
    assert idle_since(client, killed) == pytest.approx(time.time() - 1_060, abs=1)
    stopped = SimpleNamespace(info=SimpleNamespace(run_id="r", start_time=900_000, end_time=2_000_000, status="KILLED"))
    assert idle_since(client, stopped) == pytest.approx(time.time() - 2_000, abs=1)
    # resumed by a command that started at 2_030 s: its start-up after that is run time, not idle
    assert idle_since(client, stopped, now=2_030.0) == pytest.approx(30.0)


def test_a_resumed_run_killed_again_is_idle_from_its_newest_step_not_its_earlier_end():
    """A run stopped (KILLED, an end time), resumed and SIGKILLed: MLflow keeps the first session's end time
    on the RUNNING run. The idle time counted from it took in the second session's work: a duration of
    -30 s in `factory runs` after the next resume."""
    from factory.tracking.mlflow_tracker import idle_since

    stamps = {"timing/step_s": [1_000_000, 1_300_000], "timing/startup_s": [990_000]}
    client = SimpleNamespace(get_metric_history=lambda run_id, key: [SimpleNamespace(timestamp=t) for t in stamps[key]])
    again = SimpleNamespace(info=SimpleNamespace(run_id="r", start_time=900_000, end_time=1_100_000, status="RUNNING"))
    assert idle_since(client, again) == pytest.approx(time.time() - 1_300, abs=1)


def test_resume_passes_over_a_checkpoint_whose_files_are_not_as_saved(store):
    """A file of the newest checkpoint cut short (a disk that lost its tail): --resume falls back to the
    run's previous checkpoint and says which it passed over and why."""
    uri, ckpt = store
    spec, plan = compiled(ckpt)
    exp = {"experiment": "verified"}
    run = fake_run(uri, ckpt, plan, logged=3, checkpoints=(1, 2), **exp)
    for step in (1, 2):
        (ckpt / f"step_{step}" / "model.safetensors").write_bytes(b"w" * 1000)
        write_manifest(ckpt / f"step_{step}")
    r = find(plan, None, uri, train=spec.train, **exp)
    assert (r.run_id, r.checkpoint) == (run, "step_2") and r.unreadable == []
    with open(ckpt / "step_2" / "model.safetensors", "r+b") as f:
        f.truncate(10)
    r = find(plan, None, uri, train=spec.train, **exp)
    assert (r.checkpoint, r.step, r.data) == ("step_1", 1, {"epoch": 0, "cursor": 2})
    assert r.unreadable == [f"step_2: {ckpt}/step_2/model.safetensors holds 10 bytes, 1000 were saved"]
    assert "passed over step_2" in r.describe()
    # every checkpoint cut short: it starts over, and does not say the run saved none (it did)
    with open(ckpt / "step_1" / "model.safetensors", "r+b") as f:
        f.truncate(10)
    r = find(plan, None, uri, train=spec.train, **exp)
    assert r.checkpoint is None and len(r.unreadable) == 2
    assert "from the start (no checkpoint it saved is usable)" in r.describe()


def test_resume_passes_over_a_checkpoint_whose_run_state_or_manifest_is_damaged(store):
    """A run_state.json cut short failed --resume as an internal error (JSONDecodeError); one deleted left the
    checkpoint passed over without a word; a checkpoint whose manifest was deleted was trusted unchecked, and
    its weights file cut short failed the resume as an internal error once Ray had started."""
    uri, ckpt = store
    spec, plan = compiled(ckpt)
    exp = {"experiment": "damaged"}
    run = fake_run(uri, ckpt, plan, logged=4, checkpoints=(1, 2, 3, 4), **exp)
    state = (ckpt / "step_4" / "run_state.json").read_text()
    (ckpt / "step_4" / "run_state.json").write_text(state[:40])
    (ckpt / "step_3" / "run_state.json").unlink()
    (ckpt / "step_2" / "manifest.json").unlink()
    r = find(plan, None, uri, train=spec.train, **exp)
    assert (r.run_id, r.checkpoint, r.step) == (run, "step_1", 1)
    assert [u.split(":")[0] for u in r.unreadable] == ["step_4", "step_3", "step_2"]
    assert "its run_state.json is unreadable (" in r.unreadable[0] and r.unreadable[1] == "step_3: it has no run_state.json"
    assert r.unreadable[2] == (f"step_2: {ckpt}/step_2/manifest.json is missing, where the run's other checkpoints "
                               "have theirs: its files cannot be checked")
    # a run saved before manifests existed: none has one, each is taken as it is
    import shutil

    shutil.rmtree(ckpt / "step_4")
    for step in (1, 2, 3):
        (ckpt / f"step_{step}" / "manifest.json").unlink(missing_ok=True)
    (ckpt / "step_3" / "run_state.json").write_text(state.replace('"step": 4', '"step": 3').replace('"cursor": 8',
                                                                                                  '"cursor": 6'))
    r = find(plan, None, uri, train=spec.train, **exp)
    assert (r.checkpoint, r.unreadable) == ("step_3", [])


def test_recorded_source_hashes_compare_by_contents_not_by_where_the_source_was_found():
    """Sources were keyed by file path (absolute for an installed Factory) before they were keyed by module
    path: a run started then refused to resume ("rewards changed") with the same code."""
    from factory.runtime.resume import same_sources

    old = {"/venv/lib/python3.11/site-packages/factory/rewards/math.py": "aa", "rewards/mine.py": "bb"}
    assert same_sources(old, {"factory/rewards/math.py": "aa", "rewards/mine.py": "bb"})
    assert not same_sources(old, {"factory/rewards/math.py": "aa", "rewards/mine.py": "cc"})
    assert not same_sources(old, {"factory/rewards/math.py": "aa"})
    assert same_sources("x", "x") and not same_sources("x", "y") and not same_sources(None, {"a": "b"})


def test_a_refused_resume_shows_a_missing_key_and_a_null_alike_as_unset(tmp_path):
    """Turning LoRA on was refused with "model.lora: null -> unset, model.lora.alpha: unset -> null" among
    the changes: two rows of nothing a user set. Missing and null are both unset, as in `factory diff`."""
    from factory.runtime.resume import spec_keys_changed

    _, plain = compiled(tmp_path)
    _, lora = compiled(tmp_path, "model.lora.r=16")
    assert spec_keys_changed(json.loads(plan_json(plain)), lora) == [
        "model.lora.dropout: (unset) -> 0.0", "model.lora.r: (unset) -> 16",
        "model.lora.target_modules: (unset) -> all-linear"]
    assert spec_keys_changed(json.loads(plan_json(lora)), plain)[1] == "model.lora.r: 16 -> (unset)"


def test_a_checkpoint_is_not_resumed_into_a_model_of_other_shapes(tmp_path):
    """`--allow-spec-change model.path=...` to a model of another architecture: the learner failed to load the
    checkpoint with an internal error after Ray and every stage had started. Refused before, with the shapes;
    a model of the same shapes (another copy, a fine-tune) is taken."""
    from types import SimpleNamespace

    from factory.runtime.resume import ResumeError, _refuse_other_model

    def model(folder: str, **config) -> Path:
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "config.json").write_text(json.dumps(
            {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, **config}))
        return tmp_path / folder

    checkpoint = tmp_path / "ckpt" / "step_2"
    model("ckpt/step_2/hf")
    recorded = {"spec": {"model": {"path": "models/first"}}}
    same, other = model("same"), model("other", architectures=["LlamaForCausalLM"], num_hidden_layers=30)
    _refuse_other_model(recorded, SimpleNamespace(spec={"model": {"path": str(same)}}), "r1", checkpoint)
    with pytest.raises(ResumeError, match=r"run r1's checkpoint .*step_2 holds a model of other shapes than model.path "
                                          r".*other \(architectures \['Qwen3ForCausalLM'\] -> \['LlamaForCausalLM'\], "
                                          r"num_hidden_layers 2 -> 30\).*resume with model.path=models/first"):
        _refuse_other_model(recorded, SimpleNamespace(spec={"model": {"path": str(other)}}), "r1", checkpoint)


def test_a_lora_checkpoint_is_not_resumed_into_a_model_of_other_shapes(tmp_path):
    """The same with a LoRA run's checkpoint, which holds adapter/ (naming its base model) and no hf/: nothing
    compared the model, and the learner failed inside DeepSpeed once every stage had started."""
    from types import SimpleNamespace

    from factory.runtime.resume import ResumeError, _refuse_other_model

    def model(folder: str, **config) -> Path:
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "config.json").write_text(json.dumps(
            {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, **config}))
        return tmp_path / folder

    first, same, other = model("first"), model("same"), model("other", hidden_size=128)
    checkpoint = tmp_path / "ckpt" / "step_2"
    (checkpoint / "adapter").mkdir(parents=True)
    named = {"peft_type": "LORA", "r": 8, "base_model_name_or_path": str(first)}
    (checkpoint / "adapter" / "adapter_config.json").write_text(json.dumps(named))
    recorded = {"spec": {"model": {"path": "models/first"}}}  # (not on disk here: the adapters' base is read)
    _refuse_other_model(recorded, SimpleNamespace(spec={"model": {"path": str(same)}}), "r1", checkpoint)
    with pytest.raises(ResumeError, match=r"run r1's checkpoint .*step_2 holds a model of other shapes than model.path "
                                          r".*other \(hidden_size 64 -> 128\)"):
        _refuse_other_model(recorded, SimpleNamespace(spec={"model": {"path": str(other)}}), "r1", checkpoint)
    # adapters naming a base that is not on disk (a relative path, another machine's): the spec's model.path
    (checkpoint / "adapter" / "adapter_config.json").write_text(json.dumps({**named, "base_model_name_or_path": "x"}))
    with pytest.raises(ResumeError, match=r"hidden_size 64 -> 128"):
        _refuse_other_model({"spec": {"model": {"path": str(first)}}},
                            SimpleNamespace(spec={"model": {"path": str(other)}}), "r1", checkpoint)


def test_what_a_resume_reads_from_the_runs_history():
    """The helpers `find` reads the run with, each on a hand-made history: the step this session logs its
    start-up at, the plan that saved a checkpoint, the last logged step, the step-0 evaluation, what changed."""
    from factory.runtime.resume import _plan_saving, changes, logged_step, same_sources, step0_eval

    # logged through step 3 of 4: this session's start-up goes at step 4, the run's last (not dropped)
    assert Resume("r", "n", Path("c"), "step_3", 3, 3, None).startup_step(4) == 4
    # the checkpoint of step 4 was saved under the newest resume before it (at step 2, not 0; step 5 came after)
    resumes = SimpleNamespace(artifacts=lambda run_id, folder: ["resumed/step_0", "resumed/step_2", "resumed/step_5"])
    assert _plan_saving(resumes, "r", 4, {}) == "resumed/step_2/plan.json"
    assert _plan_saving(resumes, "r", 4, {"resumed/step_3/plan.json": "{}"}) == "resumed/step_3/plan.json"  # spooled
    assert _plan_saving(resumes, "r", 0, {}) == "plan.json"
    # only the step-0 evaluation logged: step 0 is logged (a resume must not log it again); nothing at all: -1
    history = {"timing/step_s": [], "eval/reward": [(0, 0.25), (2, 0.75)], "eval/length": [(2, 9.0)]}
    tracker = SimpleNamespace(metric_history=lambda run_id, key: history[key])
    run = SimpleNamespace(run_id="r", metrics={"eval/reward": 0.75, "eval/length": 9.0, "reward/mean": 0.5})
    assert logged_step(tracker, run) == 0
    assert logged_step(SimpleNamespace(metric_history=lambda run_id, key: []), run) == -1
    # the summary's "before": the step-0 values, not the newest evaluation's
    assert step0_eval(tracker, run) == {"eval/reward": 0.25}
    # another reward file's contents is a change that refuses the resume (as another spec is)
    recorded = {"hashes": {"spec": "s", "templates": "t", "rewards": {"r.py": "a"}, "data": "d", "code": {}}}
    plan = SimpleNamespace(hashes={"spec": "s", "templates": "t", "rewards": {"r.py": "b"}, "data": "d", "code": {}},
                           spec={"name": "n"})
    assert changes(plan, recorded, "s") == ["rewards"]
    plan.hashes.update(rewards={"rewards/r.py": "a"}, data="d2")  # re-keyed, same contents: no change
    assert changes(plan, recorded, "s") == ["data"]
    # the spec hash is the record's (the plan that saved the checkpoint); a run without one compares its tag's
    assert changes(plan, {"hashes": {**recorded["hashes"], "spec": "b"}}, "s") == ["spec", "data"]
    assert changes(plan, None, "s") == [] and changes(plan, None, "b") == ["spec"]
    # two files of one content, one of them gone, is a change
    assert not same_sources({"a.py": "h", "b.py": "h"}, {"a.py": "h"})


def test_a_run_of_another_spec_is_refused_even_with_a_changed_spec_allowed(store):
    """--allow-spec-change lets a run continue under a changed spec, not another spec's run take over."""
    from mlflow.tracking import MlflowClient

    uri, ckpt = store
    spec, plan = compiled(ckpt)
    run = fake_run(uri, ckpt, plan, logged=1, checkpoints=(1,), experiment="named")
    MlflowClient(uri).set_tag(run, "factory.spec_name", "other")
    with pytest.raises(ResumeError, match=f"^run {run} is not a run of spec 'tiny' \\(it ran 'other'\\)$"):
        find(plan, run, uri, train=spec.train, experiment="named", allow_spec_change=True)


def test_a_joined_run_recorded_before_the_address_left_the_hash_resumes_with_the_same_spec(store, monkeypatch):
    """Runs that joined a cluster recorded the spec hashed with resources.ray_address in it (before d737a73): the
    same spec at the same address was then not found by a bare --resume, and refused as "trained with another spec"
    with no key named."""
    import dataclasses

    from factory.compiler.refs import sha256_json
    from factory.runtime.resume import changes

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    uri, ckpt = store
    spec, joined = compiled(ckpt, "resources.ray_address=192.0.2.1:6379")
    old = sha256_json(joined.spec)  # the hash such a run recorded, as its tag and in plan.json
    assert old != joined.hashes["spec"]
    before = dataclasses.replace(joined, hashes={**joined.hashes, "spec": old})
    killed = fake_run(uri, ckpt, before, logged=2, checkpoints=(2,), experiment="old")
    assert find(joined, None, uri, train=spec.train, experiment="old").run_id == killed
    assert changes(joined, json.loads(plan_json(before)), old) == []


def test_a_run_resumes_with_its_cluster_at_another_address_and_records_where_it_ran(store, monkeypatch):
    """resources.ray_address was part of the spec hash: `--resume` of a joined run whose cluster came back at
    another address, or on another cluster (what a lost cluster's message offers), was refused as "another version
    of the spec"; from $RAY_ADDRESS it was recorded nowhere (`factory diff` of a local and a joined run: "defined
    identically"). The address says where a run ran, not what it is: no part of the hash, the tag
    factory.ray_cluster of each session (its address masked where it came from the environment)."""
    from factory.commands.diff import RunRecord, compare

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    uri, ckpt = store
    spec, joined = compiled(ckpt, "resources.ray_address=192.0.2.1:6379")
    _, local = compiled(ckpt)
    _, moved = compiled(ckpt, "resources.ray_address=192.0.2.2:6379")
    monkeypatch.setenv("RAY_ADDRESS", "192.0.2.3:6379")
    _, from_env = compiled(ckpt)
    monkeypatch.delenv("RAY_ADDRESS")
    assert joined.hashes == local.hashes == moved.hashes == from_env.hashes
    exp = {"experiment": "moved"}
    killed = fake_run(uri, ckpt, joined, logged=2, checkpoints=(2,), **exp)
    assert find(moved, None, uri, train=spec.train, **exp).run_id == killed
    assert find(local, None, uri, train=spec.train, **exp).run_id == killed

    def tagged(plan) -> str:
        t = Tracker(uri, "where")
        t.start_run(plan, {"calc": []})
        t.end("FINISHED")
        return t.run(t.run_id)

    assert [tagged(p).tags["factory.ray_cluster"] for p in (local, joined, from_env)] == [
        "local", "joined 192.0.2.1:6379", "joined ***"]
    first = tagged(joined)
    resumed = resumed_tracker(uri, "where", first.run_id, ckpt, 1, resolved={})  # (compiled(): a local Ray)
    resumed.end()
    again = resumed.run(first.run_id)
    assert again.tags["factory.resumed.1.factory.ray_cluster"] == "local"
    report = compare(RunRecord(again, {}, None), RunRecord(tagged(local), {}, None), {}, {})
    assert report["environment"] == [] and report["notes"] == [
        "A was resumed after step 1 where it ran otherwise: factory.ray_cluster joined 192.0.2.1:6379 -> local"]
    report = compare(RunRecord(first, {}, None), RunRecord(tagged(from_env), {}, None), {}, {})
    assert report["environment"] == [{"key": "factory.ray_cluster", "a": "joined 192.0.2.1:6379", "b": "joined ***"}]
