import io
import re
from pathlib import Path

from rich.console import Console

from factory.runtime.display import Display, untrained_why
from factory.runtime.driver import RunResult


def _lines(steps):
    out = io.StringIO()
    with Display(3, console=Console(file=out, width=200, log_path=False)) as d:
        for step, m in steps:
            d.step(step, m)
    return out.getvalue()


def test_step_line_shows_reward_accuracy_and_time_split():
    text = _lines([(0, {"eval/accuracy": 0.25, "eval/reward": 0.5, "eval/tool_calls": 0.75}),
                   (1, {"reward/mean": 0.5, "eval/accuracy": 1.0, "num_turns/mean": 2.0, "tools/calls": 30,
                        "tools/infra_errors": 1, "tools/model_errors": 4, "actor/pg_loss": 0.0, "timing/step_s": 70.0,
                        "timing/generate_s": 40.0, "timing/tools_only_s": 0.5, "timing/update_s": 29.0})])
    assert "step    0  eval reward 0.500  eval acc 0.25  tool calls/question 0.75" in text
    # the split is in brackets-free parentheses and must survive rich's markup parsing
    assert "70.0s (generate 40.0s, tools only 0.5s, update 29.0s)" in text
    # the calls the model got wrong (an unknown tool, arguments that do not parse): 32 of 32 read as delegation
    assert "tool calls 30 (model errors 4, infra errors 1)" in text and "eval acc 1.00" in text


def test_step_0_without_held_out_data_says_no_evaluation_was_made():
    text = _lines([(0, {})])  # what the driver's evaluation gives without data.eval
    assert "step    0  no held-out evaluation (no data.eval rows)" in text and "eval reward" not in text


def test_a_step_that_trained_nothing_says_why_and_the_summary_warns():
    """A huge reward's non-finite advantages, or every trajectory dropped, ran whole runs that trained nothing
    with only `loss -` on the step lines."""
    out = io.StringIO()
    with Display(3, console=Console(file=out, width=300, log_path=False)) as d:
        d.step(1, {"actor/trained_rows": 0.0, "actor/skipped_non_finite": 1.0, "reward/mean": 1e307})
        d.step(2, {"actor/trained_rows": 0.0, "actor/dropped": 8.0})
        d.step(3, {"actor/trained_rows": 0.0, "actor/skipped_zero_adv": 8.0, "actor/dropped": 0.0,
                   "rewards/correct/errors": 0.0})
        d.summary(RunResult("abc", {}, {}, None, last_step=3), experiment="e", experiment_id="3",
                  uri="sqlite:///m.db", wall_s=6)
    text = out.getvalue()
    assert "reward 1e+307 " in text  # not 308 digits
    assert "step 1: nothing trained: the update was skipped, its loss or gradient norm not finite" in text
    assert "step 2: nothing trained: every trajectory was dropped (see actor/dropped" in text
    assert any(line.rstrip().endswith("step 3: nothing trained: every row's advantage was 0 (each group's rewards "
                                      "agreed)") for line in text.splitlines())
    out = io.StringIO()
    with Display(1, console=Console(file=out, width=300, log_path=False)) as d:  # a reward that raised every call
        d.step(1, {"actor/trained_rows": 0.0, "actor/skipped_zero_adv": 8.0, "rewards/correct/errors": 8.0,
                   "rewards/format/errors": 0.0})
    assert ("step 1: nothing trained: every row's advantage was 0 (each group's rewards agreed; reward correct "
            "failed on some trajectories (rewards/<node>/errors; the reward stage's warning line says why))"
            ) in out.getvalue()
    assert "warning: none of the 3 steps trained a row" in text
    assert untrained_why({"actor/trained_rows": 0.0, "actor/skipped_zero_adv": 5.0, "actor/dropped": 3.0}) == (
        "every row's advantage was 0 (each group's rewards agreed; 3 trajectories were dropped before "
        "(actor/dropped: infra errors, a reward with no value under drop_sample, the overlong filter), which can "
        "leave a group's others agreeing)")
    out = io.StringIO()
    with Display(1, console=Console(file=out, width=300, log_path=False)) as d:  # the spec's max_model_len: 20
        d.context = 20
        d.step(1, {"actor/trained_rows": 0.0, "actor/dropped": 8.0, "rollout/stop_prompt_too_long": 8.0})
    assert ("step 1: 8 trajectories' prompts fill the rollout's context of 20 tokens: not generated from, scored or "
            "trained on (shorten those rows; the context is the model's, or less where rollout.max_model_len or what "
            "rollout.kv_cache_gb holds sets it)") in out.getvalue()
    out = io.StringIO()  # credit: turn, gamma 0: turn rewards [1] and [1, 0] (means 1, 0.5), turn 0 returns agree
    with Display(1, console=Console(file=out, width=300, log_path=False), turn_credit=True) as d:
        d.step(1, {"actor/trained_rows": 0.0, "actor/skipped_zero_adv": 2.0})
    assert ("step 1: nothing trained: every row's advantage was 0 (each group's turn returns agreed at every turn "
            "position that two or more of its trajectories reached)") in out.getvalue()
    out = io.StringIO()
    with Display(2, console=Console(file=out, width=300, log_path=False)) as d:
        d.step(1, {"actor/trained_rows": 0.0, "actor/skipped_zero_adv": 8.0})
        d.step(2, {"actor/trained_rows": 5.0, "actor/skipped_zero_adv": 3.0})
        d.summary(RunResult("abc", {}, {}, None, last_step=2), experiment="e", experiment_id="3",
                  uri="sqlite:///m.db", wall_s=6)
    assert "step 2: nothing" not in out.getvalue() and "none of the" not in out.getvalue()


def test_summary_names_the_run_and_the_ui_command():
    out = io.StringIO()
    d = Display(1, console=Console(file=out, width=200))
    # RunResult.checkpoint is absolute; under the working directory it is shown as the spec's runs/ path reads
    d.summary(RunResult("abc", {"eval/accuracy": 0.3}, {"eval/accuracy": 1.0}, str(Path.cwd() / "runs/x/step_8"),
                        after_step=8, last_step=8),
              experiment="e", experiment_id="3", uri="sqlite:///elsewhere.db", wall_s=600)
    text = out.getvalue()
    assert "Factory run finished" in text and "step 8" in text
    assert "MLflow run abc" in text and "factory ui --uri sqlite:///elsewhere.db" in text
    assert "0.300" in text and "1.000" in text and "final model (HF folder): runs/x/step_8/hf\n" in text
    out = io.StringIO()  # elsewhere: absolute
    Display(1, console=Console(file=out, width=200)).summary(
        RunResult("abc", {}, {}, "/elsewhere/x/step_8"), experiment="e", experiment_id="3", uri="sqlite:///m.db",
        wall_s=6)
    assert "final model (HF folder): /elsewhere/x/step_8/hf\n" in out.getvalue()
    assert "no held-out evaluation was made (data.eval is not set" in out.getvalue() and "metric" not in out.getvalue()


def test_a_stopped_runs_summary_shows_no_final_evaluation_it_did_not_make():
    """Stopped after step 2 with no evaluation since step 0's: the table showed step 0's values as "final"."""
    out = io.StringIO()
    Display(4, console=Console(file=out, width=200)).summary(
        RunResult("abc", {"eval/reward": 0.2}, {"eval/reward": 0.2}, "runs/x/step_2", stopped=True, last_step=2),
        experiment="e", experiment_id="3", uri="sqlite:///elsewhere.db", wall_s=60)
    text = out.getvalue()
    assert "Factory run stopped after step 2" in text and "┃ final" not in text and text.count("0.200") == 1
    assert "no evaluation after step 0: the run stopped before its next" in text


def test_in_a_log_file_each_line_a_user_greps_is_one_line(capsys, monkeypatch):
    """`factory run spec.yaml > out.log 2>&1`: rich wrapped at 80 columns when not a terminal, splitting
    "MLflow run ... in experiment" from its "(store), 0.7 min" and a step line from its loss and times."""
    monkeypatch.delenv("COLUMNS", raising=False)
    long = "/a/checkpoint/folder/nested/deep/enough/to/pass/eighty/columns/on/its/own"
    with Display(1) as d:  # the default console: stderr, which capsys makes a file
        d.step(1, {"reward/mean": 0.5, "num_turns/mean": 1.0, "tools/calls": 3, "actor/pg_loss": 0.01,
                   "actor/grad_norm": 0.25, "actor/trained_rows": 4, "timing/step_s": 3.0, "timing/generate_s": 1.0,
                   "timing/reward_s": 0.5})
        d.summary(RunResult("0123456789abcdef0123456789abcdef", {}, {}, f"{long}/step_1"), experiment="tiny",
                  experiment_id="3", uri="sqlite:///a/store/whose/path/is/long/mlflow.db", wall_s=42)
    lines = capsys.readouterr().err.splitlines()
    assert any(line.endswith("rows 4  grad 0.250  3.0s (generate 1.0s, reward 0.5s)") and "step    1  reward" in line
               for line in lines), lines
    assert ("MLflow run 0123456789abcdef0123456789abcdef in experiment 'tiny' "
            "(sqlite:///a/store/whose/path/is/long/mlflow.db), 0.7 min") in lines
    assert f"final model (HF folder): {long}/step_1/hf" in lines
    with Display(1) as d:  # a resumed run's: this session's time and the whole run's
        d.summary(RunResult("abc", {}, {}, None), experiment="tiny", experiment_id="3", uri="sqlite:///m.db",
                  wall_s=42, run_s=720)
    assert "MLflow run abc in experiment 'tiny' (sqlite:///m.db), 0.7 min this session, 12.0 min in all" in \
        capsys.readouterr().err.splitlines()
    assert "see it: factory ui --uri sqlite:///a/store/whose/path/is/long/mlflow.db   (the MLflow UI of this " \
           "store; `factory runs` lists its runs)" in lines


def test_a_lora_runs_export_hint_names_its_store_as_the_ui_hint_does(tmp_path, monkeypatch):
    """`merged model: factory export RUN --out DIR` left out the --uri that the "see it:" line beside it gives for a
    store other than the default: pasted, it looked in ./mlflow.db and did not find the run."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "step_4" / "adapter").mkdir(parents=True)

    def summary(uri: str) -> str:
        out = io.StringIO()
        Display(1, console=Console(file=out, width=300)).summary(
            RunResult("abc", {}, {}, str(tmp_path / "step_4")), experiment="e", experiment_id="3", uri=uri, wall_s=6)
        return out.getvalue()

    assert "merged model: factory export abc --out DIR --uri sqlite:///elsewhere.db\n" in summary(
        "sqlite:///elsewhere.db")
    assert "merged model: factory export abc --out DIR --uri http://127.0.0.1:5000/\n" in summary(
        "http://127.0.0.1:5000/")
    assert "merged model: factory export abc --out DIR\n" in summary("sqlite:///mlflow.db")  # the default store
    # a store path with a space, quoted for the shell (pasted, it was two arguments)
    assert "merged model: factory export abc --out DIR --uri 'sqlite:////tmp/my runs/m.db'\n" in summary(
        "sqlite:////tmp/my runs/m.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///elsewhere.db")  # what export reads without --uri
    assert "merged model: factory export abc --out DIR\n" in summary("sqlite:///elsewhere.db")


def test_summary_links_a_tracking_server_run():
    out = io.StringIO()
    Display(1, console=Console(file=out, width=200)).summary(
        RunResult("abc", {}, {}, None), experiment="e", experiment_id="3", uri="http://127.0.0.1:5000/", wall_s=60)
    assert "see it: http://127.0.0.1:5000/#/experiments/3/runs/abc" in out.getvalue()


def test_long_phase_prints_plain_progress_lines_in_a_log_file():
    """Not a terminal: no bar, a line every log_every_s seconds of the phase, none for a quick phase."""
    out, now = io.StringIO(), [0.0]
    d = Display(2, console=Console(file=out, width=200, log_path=False), log_every_s=30, clock=lambda: now[0])
    with d:
        for t, done in ((0, 0), (10, 5), (31, 20), (45, 30), (62, 60)):
            now[0] = float(t)
            d.progress("step 0 evaluation", done, 64)
        d.done()
        d.progress("step 1 rollout", 3, 32)  # a new phase starts its own clock
        d.done()
    lines = [line for line in out.getvalue().splitlines() if "trajectories" in line]
    assert [line.split("] ")[-1].strip() if "] " in line else line.strip() for line in lines] == [
        "step 0 evaluation: 20/64 trajectories (31 s)", "step 0 evaluation: 60/64 trajectories (62 s)"]


def test_long_phase_shows_a_live_bar_on_a_terminal():
    out = io.StringIO()
    d = Display(2, console=Console(file=out, width=120, force_terminal=True, log_path=False))
    with d:
        d.progress("step 0 evaluation", 17, 64)
        d._progress.refresh()
        d.done()
    assert "step 0 evaluation" in out.getvalue() and "17/64" in out.getvalue()


def test_the_eta_is_shown_when_a_step_takes_a_minute():
    """rich's speed, and so the ETA, came from the last 30 s of updates: with steps of 30 s or more that held one
    step at most, and the bar read `eta -:--:--` for every real model's run."""
    now = [1000.0]
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, get_time=lambda: now[0], log_path=False)
    with Display(10, console=console) as display:
        for step in (1, 2, 3):
            now[0] += 60.0
            display.step(step, {"timing/step_s": 60.0, "reward/mean": 0.5})
        assert display._progress.tasks[0].time_remaining == 420  # 7 steps of 60 s left
        display._progress.refresh()
    assert "0:07:00" in out.getvalue()


def test_startup_line_and_metrics_add_up_to_the_time_to_first_request():
    """timing/startup_s runs from the command's start to the first rollout request; its phases (and the
    'other' left between them) add up to it, and each stage's ready time is shown inside `stages`."""
    from factory.runtime.startup import Startup

    now = [100.0]
    s = Startup(started_at=90.0, clock=lambda: now[0])
    s.lap("command")  # 10 s: imports and compile
    now[0] = 101.0
    s.lap("store")  # the tracking store opened, a replayed run read
    now[0] = 104.5
    s.lap("ray")
    s.stage_ready("tools", 1.0)
    s.stage_ready("rollout", 20.0)
    now[0] = 125.0
    s.lap("stages")
    now[0] = 127.0
    s.lap("tracking")
    now[0] = 127.5  # the data stage's first batch, before the request
    m = s.finish()
    assert m["timing/startup_s"] == 37.5
    assert {k: v for k, v in m.items() if k != "timing/startup_s"} == {
        "timing/startup/command_s": 10.0, "timing/startup/store_s": 1.0, "timing/startup/ray_s": 3.5,
        "timing/startup/stages_s": 20.5, "timing/startup/tracking_s": 2.0, "timing/startup/stage_tools_s": 1.0,
        "timing/startup/stage_rollout_s": 20.0}
    assert s.describe() == ("start-up 37.5 s to the first rollout request: command 10.0 s, store 1.0 s, ray 3.5 s, "
                            "stages 20.5 s (tools 1.0, rollout 20.0 ready), tracking 2.0 s, other 0.5 s")


def test_the_summary_of_a_run_with_its_own_store_ignores_a_refused_environment_store(monkeypatch):
    """A spec's tracking.uri beside $MLFLOW_TRACKING_URI=./mlruns (a path MLflow refuses, never read by that
    run): the summary validated the variable to choose its `factory ui` hint, and a run that trained every
    step ended with exit 2 there."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "./mlruns")
    out = io.StringIO()
    with Display(1, console=Console(file=out, width=300, log_path=False)) as d:
        d.summary(RunResult("abc", {}, {}, None, last_step=1), experiment="e", experiment_id="3",
                  uri="sqlite:///x.db", wall_s=6)
    assert "see it: factory ui --uri sqlite:///x.db" in out.getvalue()


def test_a_status_line_is_printed_as_written_on_a_terminal_too():
    # a monitor's reason or a path with brackets: read as markup, `[/x]` made rich raise MarkupError
    out = io.StringIO()
    with Display(2, console=Console(file=out, width=200, force_terminal=True, log_path=False)) as d:
        d.status("warning: monitor tool_call_rate fired at step 3: [/calls] rose [bold]2x[/bold]")
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())  # the terminal's colours out
    assert "[/calls] rose [bold]2x[/bold]" in plain


def test_the_summary_prints_the_experiment_store_and_checkpoint_as_written(tmp_path):
    """User text read as rich markup: an experiment named `lr[/2] sweep` raised MarkupError at the summary of a
    run that had trained every step, `[ablation] grpo` printed as ` grpo`, `runs[v2]/step_1` as `runs/step_1`."""
    def summary(experiment, uri, checkpoint):
        out = io.StringIO()
        Display(1, console=Console(file=out, width=300, log_path=False)).summary(
            RunResult("abc", {}, {}, checkpoint, last_step=1), experiment=experiment, experiment_id="3", uri=uri,
            wall_s=6)
        return out.getvalue()

    text = summary("lr[/2] sweep", "sqlite:///m[/x].db", str(tmp_path / "runs[v2]" / "step_1"))
    assert "experiment 'lr[/2] sweep' (sqlite:///m[/x].db)" in text
    assert f"final model (HF folder): {tmp_path}/runs[v2]/step_1/hf\n" in text
    assert "see it: factory ui --uri 'sqlite:///m[/x].db'" in text
    (tmp_path / "runs[v2]" / "step_1" / "adapter").mkdir(parents=True)
    text = summary("[ablation] grpo", "http://mlflow[/a]:5000", str(tmp_path / "runs[v2]" / "step_1"))
    assert "experiment '[ablation] grpo' (http://mlflow[/a]:5000)" in text
    assert f"final adapters (peft folder): {tmp_path}/runs[v2]/step_1/adapter;" in text
    assert "see it: http://mlflow[/a]:5000/#/experiments/3/runs/abc" in text
