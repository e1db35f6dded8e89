import io

from rich.console import Console

from factory.display import Display


def _lines(steps):
    out = io.StringIO()
    with Display(3, console=Console(file=out, width=200, log_path=False)) as d:
        for step, m in steps:
            d.step(step, m)
    return out.getvalue()


def test_step_line_shows_reward_accuracy_and_time_split():
    text = _lines([(0, {"eval/accuracy": 0.25, "eval/reward": 0.5, "eval/tool_calls": 0.75}),
                   (1, {"reward/mean": 0.5, "eval/accuracy": 1.0, "num_turns/mean": 2.0, "tools/calls": 30,
                        "tools/infra_errors": 1, "actor/pg_loss": 0.0, "timing/step_s": 70.0,
                        "timing/generate_s": 40.0, "timing/tools_s": 0.5, "timing/update_s": 29.0})])
    assert "step    0  eval reward 0.500  eval acc 0.25  tool calls/question 0.75" in text
    # the split is in brackets-free parentheses and must survive rich's markup parsing
    assert "70.0s (generate 40.0s, tools 0.5s, update 29.0s)" in text
    assert "tool calls 30 (infra errors 1)" in text and "eval acc 1.00" in text


def test_summary_names_the_run_and_the_ui_command():
    out = io.StringIO()
    d = Display(1, console=Console(file=out, width=200))
    d.summary(run_id="abc", experiment="e", uri="sqlite:///mlflow.db", before={"eval/accuracy": 0.3},
              after={"eval/accuracy": 1.0}, wall_s=600, checkpoint="runs/x/step_8/hf")
    text = out.getvalue()
    assert "MLflow run abc" in text and "mlflow ui --backend-store-uri sqlite:///mlflow.db" in text
    assert "0.300" in text and "1.000" in text and "runs/x/step_8/hf" in text
