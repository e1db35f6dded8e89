"""The reward-hacking monitors (factory.monitors): hand-worked variance shares, each monitor on step
histories where it must fire and where it must stay silent, the run's Watch (a warning once, stop_on),
how `factory runs` and `factory diff` show them, and (slow) real runs: the hackable spec, where
reward_dominance stops the run at step 3 with exit code 4, and the quickstart, where nothing fires."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

from factory.monitors import (
    EXIT_MONITOR,
    MONITORS,
    READS,
    History,
    Watch,
    monitor,
    read_all,
    step_row,
    variance_shares,
)
from factory.plan import WatchSettings
from factory.schema import MonitorName, MonitorsSpec
from factory.types import ToolCall, Trajectory, Turn

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "monitors"
S = MonitorsSpec()  # window 2: a monitor speaks from step 3 on


def rows(**series: list[float]) -> list[dict[str, float]]:
    """Step rows from columns: rows(task=[...], length=[...])."""
    n = len(next(iter(series.values())))
    return [{k: v[i] for k, v in series.items()} for i in range(n)]


# ---------------------------------------------------------------------------------- hand-worked
def test_variance_shares_hand_worked():
    # one group; T = c + 0.5 f with c = [1,0,1,0], f = [1,1,0,0]: T = [1.5, 0.5, 1, 0], mean 0.75,
    # Var(T) = (0.5625 + 0.0625 + 0.0625 + 0.5625) / 4 = 0.3125;
    # Cov(c, T) = (0.5*0.75 + 0.5*0.25 + 0.5*0.25 + 0.5*0.75) / 4 = 0.25          -> share 1 * 0.25 / 0.3125 = 0.8
    # Cov(f, T) = (0.5*0.75 - 0.5*0.25 - 0.5*0.25 + 0.5*0.75) / 4 = 0.125  -> share 0.5 * 0.125 / 0.3125 = 0.2
    group = [{"c": c, "f": f, "T": c + 0.5 * f} for c, f in ((1, 1), (0, 1), (1, 0), (0, 0))]
    shares = variance_shares([group], {"c": 1.0, "f": 0.5}, "T")
    assert shares == pytest.approx({"c": 0.8, "f": 0.2})


def test_variance_shares_are_within_groups_and_empty_without_variance():
    # the groups differ in c (0 in one, 1 in the other) but c never varies within a group: all of the
    # within-group variance is f's, whatever the means across groups
    groups = [[{"c": 0, "f": f, "T": f} for f in (1, 0)], [{"c": 1, "f": f, "T": 1 + f} for f in (0, 1)]]
    assert variance_shares(groups, {"c": 1.0, "f": 1.0}, "T") == pytest.approx({"c": 0.0, "f": 1.0})
    flat = [[{"c": 1, "f": 1, "T": 2}] * 4]
    assert variance_shares(flat, {"c": 1.0, "f": 1.0}, "T") == {}


def traj(p, c, f, judge=None, tokens=(10,), calls=0):
    """A scored trajectory of prompt p: task node `correct` c, format node `fmt` f, turns of `tokens` model
    tokens, the first with `calls` tool calls."""
    rewards = {"correct": c, "fmt": f} | ({"judge": judge} if judge is not None else {})
    turns = [Turn(text="", num_tokens=n, calls=[ToolCall("calc", {}, raw="")] * (calls if k == 0 else 0))
             for k, n in enumerate(tokens)]
    return Trajectory(prompt_index=p, sample_index=0, prompt_ids=[], response_ids=[], loss_mask=[], turns=turns,
                      stop_reason="no_call", row={}, rewards=rewards, reward=c + f)


def test_step_row_from_trajectories():
    w = WatchSettings(task_metric="accuracy", task_node="correct", weights={"correct": 1.0, "fmt": 1.0},
                      judges=("judge",), verifier="correct", candidates=("fmt",), tools=True)
    trajs = [traj(0, 0.0, 1.0, 0.9, (10, 20), calls=2), traj(0, 0.0, 0.0, 0.8, (10,)),
             traj(1, 1.0, 1.0, 0.1, (30, 10), calls=1), traj(1, 1.0, 0.0, None, (20,), calls=1)]
    dropped = traj(1, 0.0, 1.0, 1.0, (500,), calls=9)
    dropped.dropped = "rewards.judge: missing"  # out of the loss: out of the monitors too
    row = step_row([*trajs, dropped], w, S, "total")
    # correct never varies within a group: all the variance is fmt's (the task node's own share is not kept);
    # the judge passes two wrong answers and fails a right one: 3 of the 3 it scored disagree
    assert row == {"reward": 1.0, "task": 0.5, "length": 25.0, "tool_calls": 1.0, "share/fmt": 1.0,
                   "disagree/judge": 1.0}
    # a judge that gave no score (its endpoint down, a reply that did not parse) holds on_missing's 0.0: not a
    # verdict, so not a disagreement (an outage read as one stopped the run under stop_on, exit 4)
    failed = [traj(0, 1.0, 1.0, 0.0) for _ in range(3)]
    for t, status in zip(failed, ("error", "parse_failure", "missing")):
        t.reward_details["judge"] = {"status": status}
    agreeing = traj(0, 1.0, 1.0, 0.9)
    assert step_row([*failed, agreeing], w, S, "total")["disagree/judge"] == 0.0
    assert "disagree/judge" not in step_row(failed, w, S, "total")
    nothing = step_row([dropped], w, S, "total")  # no trajectory trained: no value at that step
    assert all(math.isnan(nothing[k]) for k in ("reward", "task", "length", "tool_calls"))


def test_a_score_at_pass_at_is_a_pass():
    # pass_at 0.5: a judge's 0.5 passes, as the verifier's 1.0 does: they agree; 0.49 fails: they disagree
    w = WatchSettings(task_metric="accuracy", task_node="correct", weights={}, judges=("judge",), verifier="correct",
                      candidates=(), tools=False)
    assert step_row([traj(0, 1.0, 0.0, 0.5)], w, S, "total")["disagree/judge"] == 0.0
    assert step_row([traj(0, 1.0, 0.0, 0.49)], w, S, "total")["disagree/judge"] == 1.0


# ---------------------------------------------------------------------------------- the monitors
def test_the_registry_is_the_schemas_list_and_refuses_a_duplicate():
    assert set(MONITORS) == set(get_args(MonitorName))
    with pytest.raises(ValueError, match="registered twice"):
        monitor("length_drift")(lambda h, s: None)
    with pytest.raises(ValueError, match="not in factory.schema.MonitorName"):
        monitor("no_such_monitor")(lambda h, s: None)


def test_each_monitor_reads_the_settings_it_declares():
    """`factory check` says a `train.monitors` setting has no effect where every monitor that READS it can never
    speak: so READS must be what each monitor reads (a recording of its reads, on a history where all speak)."""
    class Recorded:
        def __init__(self):
            self.read: set[str] = set()

        def __getattr__(self, name):
            self.read.add(name)
            return getattr(S, name)

    h = History(rows(task=[0.2, 0.2, 0.2], length=[20.0, 22.0, 66.0], tool_calls=[0.5, 0.5, 4.5],
                     reward=[0.2, 0.3, 0.6], **{"share/fmt": [1.0, 0.95, 0.9], "disagree/judge": [0.1, 0.4, 0.5]}),
                evals=[(0, 0.5), (3, 0.3)])
    for name, fn in MONITORS.items():
        s = Recorded()
        assert fn(h, s) is not None, name
        assert s.read == set(READS[name]), name
    assert set().union(*READS.values()) == set(MonitorsSpec.model_fields)  # each setting has a reader


def test_nothing_speaks_before_step_window_plus_one():
    h = History(rows(task=[0.0, 0.0], length=[10.0, 90.0], tool_calls=[0.0, 3.0], reward=[0.0, 1.0],
                     **{"share/fmt": [1.0, 1.0], "disagree/judge": [0.9, 0.9]}), evals=[(0, 0.5), (2, 0.1)])
    assert read_all(h, S) == {}


@pytest.mark.parametrize("name, series, fires", [
    # one non-task node carries all the within-group variance, the task stays at 0: fires
    ("reward_dominance", dict(task=[0.0, 0.0, 0.02], **{"share/fmt": [1.0, 0.95, 0.9]}), True),
    # the same share while the task climbs: a healthy run where the format reward still varies
    ("reward_dominance", dict(task=[0.1, 0.3, 0.6], **{"share/fmt": [1.0, 0.95, 0.9]}), False),
    # the task moves little but the format node carries only half: no
    ("reward_dominance", dict(task=[0.0, 0.0, 0.0], **{"share/fmt": [0.5, 0.5, 0.5]}), False),
    # lengths double (20, 22 -> 22, 60: means 21 -> 41, x1.95) -- not quite; then x2.1
    ("length_drift", dict(task=[0.2, 0.2, 0.2], length=[20.0, 22.0, 60.0]), False),
    ("length_drift", dict(task=[0.2, 0.2, 0.2], length=[20.0, 22.0, 66.0]), True),
    # shrinking counts too
    ("length_drift", dict(task=[0.2, 0.2, 0.2, 0.2], length=[80.0, 80.0, 10.0, 10.0]), True),
    # longer answers that are right more often: no
    ("length_drift", dict(task=[0.2, 0.4, 0.8], length=[20.0, 22.0, 66.0]), False),
    # 0.5 -> 2.5 calls per trajectory, task flat: fires
    ("tool_call_rate", dict(task=[0.3, 0.3, 0.3], tool_calls=[0.5, 0.5, 4.5]), True),
    # x1.5 but +0.25 calls: too few calls to mean anything
    ("tool_call_rate", dict(task=[0.3, 0.3, 0.3], tool_calls=[0.1, 0.1, 0.4]), False),
    # more calls, and more right answers: the tool is being learned
    ("tool_call_rate", dict(task=[0.1, 0.3, 0.6], tool_calls=[0.5, 0.5, 4.5]), False),
    ("judge_disagreement", dict(**{"disagree/judge": [0.1, 0.4, 0.5]}), True),
    ("judge_disagreement", dict(**{"disagree/judge": [0.1, 0.1, 0.2]}), False),
    # exactly the threshold factor counts: 20 -> 40 is x2
    ("length_drift", dict(task=[0.2, 0.2, 0.2, 0.2], length=[20.0, 20.0, 40.0, 40.0]), True),
    # a task that falls is no progress either (only a rise of min_task_gain is): the lengths doubled while
    # accuracy went 0.6 -> 0.1
    ("length_drift", dict(task=[0.6, 0.6, 0.1, 0.1], length=[20.0, 20.0, 50.0, 50.0]), True),
    # from no calls at all to 3 a trajectory, task flat: the ratio is infinite (a policy that learned to spam
    # a tool it never used is the case this monitor is for)
    ("tool_call_rate", dict(task=[0.3, 0.3, 0.3, 0.3], tool_calls=[0.0, 0.0, 3.0, 3.0]), True),
    # fewer calls is not a sign of hacking: tool_call_rate looks one way only (length_drift both)
    ("tool_call_rate", dict(task=[0.3, 0.3, 0.3, 0.3], tool_calls=[4.0, 4.0, 0.5, 0.5]), False),
])
def test_each_monitor_on_histories(name, series, fires):
    reading = MONITORS[name](History(rows(**series)), S)
    assert reading is not None and reading.fired is fires, reading


def test_steps_without_a_value_are_not_the_baseline():
    """Steps 1-2 trained nothing (a tool outage: step_row gives every statistic NaN). The baseline was the run's
    first `window` rows whatever they held, so it stayed NaN and every window monitor was silent for the whole
    run, however the policy drifted; it is the first `window` steps that have a value."""
    empty = {"reward": math.nan, "task": math.nan, "length": math.nan, "tool_calls": math.nan}
    healthy = [{"reward": 0.2, "task": 0.2, "length": 20.0, "tool_calls": 0.5}] * 2
    hacked = [{"reward": 0.9, "task": 0.2, "length": 90.0, "tool_calls": 4.5, "share/fmt": 1.0}] * 10
    h = History([empty, empty, *healthy, *hacked], evals=[(0, 0.5), (12, 0.2)])
    for name in ("reward_dominance", "length_drift", "tool_call_rate", "train_eval_divergence"):
        reading = MONITORS[name](h, S)
        assert reading is not None and reading.fired, (name, reading)
    r = MONITORS["length_drift"](h, S)
    assert r.value == pytest.approx(90.0 / 20.0) and "went from 20 (first 2 steps with a value) to 90 (last 2)" in r.why
    # as from step window + 1 in a run without gaps, it speaks from the (window + 1)th step with a value
    assert MONITORS["length_drift"](History([empty, *healthy, empty, empty]), S) is None
    assert MONITORS["length_drift"](History([empty, *healthy, empty, hacked[0]]), S).value == pytest.approx(55 / 20)


def test_the_largest_share_and_the_worst_judge_are_the_ones_read():
    """Two rival nodes (or two judges): the monitor reads the one that dominates (disagrees) most, and names it."""
    r = MONITORS["reward_dominance"](History(rows(task=[0.0, 0.0, 0.0], **{"share/fmt": [0.9, 0.9, 0.9],
                                                                          "share/len": [0.1, 0.1, 0.1]})), S)
    assert r.fired and r.value == pytest.approx(0.9) and "reward node 'fmt'" in r.why
    r = MONITORS["judge_disagreement"](History(rows(**{"disagree/a": [0.5, 0.5, 0.5], "disagree/b": [0.0, 0.0, 0.0]})),
                                       S)
    assert r.fired and r.value == 0.5 and "judge 'a'" in r.why


def test_train_eval_divergence():
    h = History(rows(reward=[0.2, 0.3, 0.5, 0.6]), evals=[(0, 0.5), (2, 0.45), (4, 0.3)])
    r = MONITORS["train_eval_divergence"](h, S)
    assert r.fired and r.value == pytest.approx(-0.2) and "0.500 -> 0.300 from step 0 to step 4" in r.why
    rising = History(rows(reward=[0.2, 0.3, 0.5, 0.6]), evals=[(0, 0.5), (4, 0.7)])
    assert not MONITORS["train_eval_divergence"](rising, S).fired
    assert MONITORS["train_eval_divergence"](History(rows(reward=[0.2, 0.3, 0.5])), S) is None  # one evaluation


def test_recorded_hackable_run_fires_reward_dominance_at_step_3_and_nothing_else():
    """The rows the monitors made of a real run of specs/hackable.yaml (tests/fixtures/monitors/hackable.json
    says how it was recorded): the format node carries all the within-group variance, the task stays at 0."""
    recorded = json.loads((FIXTURES / "hackable.json").read_text())
    rows, evals = recorded["rows"], [tuple(e) for e in recorded["evals"]]
    fired = {n: next((i + 1 for i in range(len(rows)) if (r := fn(History(rows[:i + 1], evals), S)) and r.fired), None)
             for n, fn in MONITORS.items()}
    assert fired == {"reward_dominance": 3, "length_drift": None, "tool_call_rate": None, "judge_disagreement": None,
                     "train_eval_divergence": None}


# ---------------------------------------------------------------------------------- the run's watch
def test_watch_warns_once_and_halts_on_a_stop_on_monitor():
    w = Watch(WatchSettings(task_metric="accuracy", task_node="correct", weights={"correct": 1.0, "fmt": 1.0},
                            judges=(), verifier="correct", candidates=("fmt",), tools=True), S,
              stop_on=("reward_dominance",))
    w.evaluated(0, {"eval/accuracy": 0.0})
    batch = [traj(p, 0.0, f, calls=1) for p in (0, 1) for f in (0.0, 1.0)]
    out = [w.observe(step, batch) for step in (1, 2, 3, 4)]
    assert out[0] == {} and out[1] == {}
    assert out[2]["monitor/reward_dominance"] == 1.0 and out[2]["monitor/reward_dominance/fired"] == 1.0
    assert out[2]["monitor/length_drift"] == 1.0 and out[2]["monitor/length_drift/fired"] == 0.0
    assert w.fired == {"reward_dominance": 3} and w.halted_at == 3 and w.new == []  # step 4: not new again
    assert w.halt.startswith("monitor reward_dominance fired at step 3 (train.stop_on): reward node 'fmt' "
                             "carries 100% of the training reward's within-group variance")
    assert EXIT_MONITOR == 4


def test_tool_call_rate_is_not_logged_for_a_spec_without_tools():
    """No tools: 0 calls per trajectory at every step, and the monitor logged 1.0 ("no change") of a rate
    there is none of. With tools, the same zeros are a rate that did not change."""
    def logged(tools: bool) -> dict[str, float]:
        w = Watch(WatchSettings(task_metric="accuracy", task_node="correct", weights={}, judges=(),
                                verifier="correct", candidates=(), tools=tools), S)
        return [w.observe(step, [traj(0, 0.0, 0.5), traj(0, 0.0, 0.5)]) for step in (1, 2, 3)][-1]

    assert "monitor/tool_call_rate" not in logged(False) and "monitor/length_drift" in logged(False)
    assert logged(True)["monitor/tool_call_rate"] == 1.0


def test_the_final_evaluation_is_read_at_its_step():
    """The driver evaluates a step after observing its batch: with the default eval_every 0 (evaluations at
    step 0 and the last step only) train_eval_divergence must still read the last one, at the last step."""
    w = Watch(WatchSettings(task_metric="accuracy", task_node="correct", weights={}, judges=(), verifier="correct",
                            candidates=(), tools=False), S, stop_on=("train_eval_divergence",))
    assert w.evaluated(0, {"eval/accuracy": 0.5}) == {}  # before any step: nothing to read
    for step, reward in ((1, 0.0), (2, 0.2), (3, 0.4)):  # the driver's order: observe, then (at 3) evaluate
        assert "monitor/train_eval_divergence" not in w.observe(step, [traj(0, 0.0, reward)])
    again = w.evaluated(3, {"eval/accuracy": 0.3})
    # the training reward rose 0.3 - 0.1 = 0.2 (>= 0.1) while the held-out metric fell 0.5 -> 0.3 (>= 0.05)
    assert again["monitor/train_eval_divergence"] == pytest.approx(-0.2)
    assert again["monitor/train_eval_divergence/fired"] == 1.0
    assert w.halted_at == 3 and [name for name, _ in w.new] == ["train_eval_divergence"]


def test_an_evaluation_without_a_value_is_not_the_baseline():
    """An evaluation whose metric is NaN (every eval trajectory dropped) holds no value: kept as step 0's, it
    made train_eval_divergence NaN, and silent, for the rest of the run."""
    w = Watch(WatchSettings(task_metric="accuracy", task_node="correct", weights={}, judges=(), verifier="correct",
                            candidates=(), tools=False), S)
    w.evaluated(0, {"eval/accuracy": math.nan})
    w.evaluated(2, {"eval/accuracy": 0.5})
    assert w.evals == [(2, 0.5)]


def test_a_resumed_watch_reads_the_history_an_uninterrupted_one_does():
    """The monitors' windows reach back over earlier steps: a run resumed from its step-2 checkpoint (the
    watch's state through run_state.json) logs at step 3 what the uninterrupted run logged, and does not
    warn again of a monitor that fired before the checkpoint."""
    def watch():
        return Watch(WatchSettings(task_metric="accuracy", task_node="correct", weights={"correct": 1.0, "fmt": 1.0},
                                   judges=(), verifier="correct", candidates=("fmt",), tools=True), S)

    batch = [traj(p, 0.0, f, calls=1) for p in (0, 1) for f in (0.0, 1.0)]
    whole, first = watch(), watch()
    for w in (whole, first):
        w.evaluated(0, {"eval/accuracy": 0.0})
        for step in (1, 2, 3):
            w.observe(step, batch)
    resumed = watch()
    resumed.restore(json.loads(json.dumps(first.state())))  # as a checkpoint's run_state.json holds it
    assert resumed.observe(4, batch) == whole.observe(4, batch) != {}
    assert resumed.fired == whole.fired == {"reward_dominance": 3} and resumed.new == []


# ---------------------------------------------------------------------------------- runs and diff
def test_runs_and_diff_show_the_monitors():
    from factory.commands.diff import metric_rows
    from factory.tracking.runs import run_summary
    from factory.tracking.tracker import TrackedRun

    run = TrackedRun("r1", "hackable-1", "0", "KILLED", 0.0, 1.0,
                     tags={"factory.monitor.reward_dominance": "3", "factory.stopped_by": "monitor reward_dominance"},
                     metrics={"monitor/reward_dominance": 1.0, "monitor/reward_dominance/fired": 1.0,
                              "monitor/length_drift": 1.1, "monitor/length_drift/fired": 0.0})
    s = run_summary(run)
    assert s["monitors"] == {"length_drift": {"value": 1.1, "firing": False, "fired_at": None},
                             "reward_dominance": {"value": 1.0, "firing": True, "fired_at": 3}}
    assert s["stopped_by"] == "monitor reward_dominance"
    hist_a = {"monitor/reward_dominance": [(3, 0.5), (4, 0.6)], "monitor/reward_dominance/fired": [(3, 0.0), (4, 0.0)]}
    hist_b = {"monitor/reward_dominance": [(3, 1.0)], "monitor/reward_dominance/fired": [(3, 1.0)]}
    got = {(r["metric"], r["agg"]): (r["a"], r["b"]) for r in metric_rows(hist_a, hist_b)}
    assert got == {("monitor/reward_dominance", "final"): (0.6, 1.0),
                   ("monitor/reward_dominance", "first fired"): (None, 3.0)}


# ---------------------------------------------------------------------------------- real runs
def _factory_run(spec: str, tmp_path: Path, *overrides: str, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    return subprocess.run([sys.executable, "-m", "factory", "run", str(REPO / spec), *overrides,
                           f"train.checkpoint_dir={tmp_path}/runs"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _tracked(tmp_path: Path):
    from factory.tracking.tracker import open_tracker

    tracker = open_tracker(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = tracker.runs()
    return tracker, run


@pytest.mark.slow  # a real run of the tiny model (Ray, MCP, DeepSpeed, MLflow): 45 s (Zen 4) to 2 min (Zen 3, loaded)
def test_hackable_spec_stops_on_reward_dominance_at_step_3(tmp_path):
    out = _factory_run("specs/hackable.yaml", tmp_path, timeout=900)
    assert out.returncode == EXIT_MONITOR, out.stderr[-3000:]
    assert "factory: stopped: monitor reward_dominance fired at step 3 (train.stop_on)" in out.stderr
    assert out.stdout.count("warning: monitor reward_dominance fired") + out.stderr.count(
        "warning: monitor reward_dominance fired") == 1
    tracker, run = _tracked(tmp_path)
    assert run.status == "KILLED" and run.tags["factory.monitor.reward_dominance"] == "3"
    assert run.tags["factory.step"] == "3" and run.tags["factory.stopped_by"].startswith("monitor reward_dominance")
    listed = subprocess.run([sys.executable, "-m", "factory", "runs", "--json", "--uri",
                             f"sqlite:///{tmp_path}/mlflow.db"], capture_output=True, text=True, timeout=120)
    (shown,) = json.loads(listed.stdout)
    assert shown["monitors"]["reward_dominance"]["fired_at"] == 3


@pytest.mark.slow  # the quickstart end to end: ~15 min on a 2-core CPU
def test_quickstart_fires_no_monitor(tmp_path):
    out = _factory_run("specs/quickstart.yaml", tmp_path, timeout=3600)
    assert out.returncode == 0, out.stderr[-3000:]
    tracker, run = _tracked(tmp_path)
    fired = {k: v for k, v in run.tags.items() if k.startswith("factory.monitor.")}
    assert fired == {}
    assert any(k.startswith("monitor/") for k in run.metrics)  # they were computed, and stayed silent
    assert all(not math.isnan(v) for k, v in run.metrics.items() if k.startswith("monitor/") and k.endswith("/fired"))


def test_the_plan_names_the_nodes_that_may_dominate():
    from factory.compiler.compile import compile_file

    def watch(spec: str):
        return compile_file(str(REPO / spec))[1].driver.watch

    assert watch("specs/quickstart.yaml").candidates == ("attempted", "well_formed")
    # `correct: {max: [exact, judged]}` reads the task node (exact): it is the task, not a rival
    judged = watch("specs/deepsearch-cpu-judge.yaml")
    assert (judged.task_node, judged.verifier, judged.judges) == ("exact", "exact", ("judge",))
    assert judged.candidates == ("searched", "well_formed")
