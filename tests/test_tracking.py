import pyarrow.parquet as pq

from factory.rollout.stage import BusyClock
from factory.tracking import Tracker, flatten, trajectory_records
from factory.types import ToolCall, ToolResult, Trajectory, Turn


def _traj():
    turn = Turn(text="<tool_call>..", num_tokens=3, calls=[ToolCall("calculate", {"expression": "1+2"}, raw="")],
                results=[ToolResult("calculate", "3", latency_s=0.1)])
    return Trajectory(prompt_index=0, sample_index=1, prompt_ids=[1, 2], response_ids=[5, 6, 7, 8],
                      loss_mask=[1, 1, 0, 1], turns=[turn, Turn(text="<answer>3</answer>", num_tokens=1)],
                      stop_reason="no_call", row={"answer": "3"}, completion="c", reward=1.0)


def test_flatten_is_sorted_and_keeps_lists_whole():
    assert list(flatten({"b": {"y": [1, 2], "x": "s"}, "a": 1})) == [("a", "1"), ("b.x", "s"), ("b.y", "[1, 2]")]


def test_trajectory_records_hold_tool_calls_and_mask():
    (rec,) = trajectory_records([_traj()], step=3)
    assert rec["tool_calls"][0]["name"] == "calculate" and rec["tool_calls"][0]["result"] == "3"
    assert rec["loss_mask"] == [1, 1, 0, 1] and rec["num_turns"] == 2 and rec["step"] == 3


def test_mlflow_run_roundtrip(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/m.db"
    t = Tracker(uri, "exp")
    run_id = t.start("r", {"train": {"lr": 1e-5}}, {"factory.spec_hash": "abc"}, {"plan.json": "{}"})
    t.log_metrics({"reward/mean": 0.5}, step=1)
    t.log_trajectories([_traj()], step=1)
    t.end()
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.data.params["train.lr"] == "1e-05" and run.data.tags["factory.spec_hash"] == "abc"
    assert client.get_metric_history(run_id, "reward/mean")[0].value == 0.5
    local = client.download_artifacts(run_id, "trajectories/step_00001.parquet", str(tmp_path))
    assert pq.read_table(local).to_pylist()[0]["tool_calls"][0]["name"] == "calculate"


def test_busy_clock_splits_wall_time(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("factory.rollout.stage.time.perf_counter", lambda: now[0])
    c = BusyClock()
    c.enter("tools"); now[0] = 1.0          # 1 s tools only
    c.enter("generate"); now[0] = 3.0       # 2 s generate (tools overlapping)
    c.exit("tools"); c.exit("generate"); now[0] = 3.5  # 0.5 s idle
    assert c.read() == {"generate": 2.0, "tools": 1.0, "idle": 0.5}


def test_plan_differences_name_the_changed_settings():
    from factory.diff import plan_differences

    a = {"spec": {"train": {"lr": 1e-5, "steps": 10}}, "hashes": {"rewards": {"rewards/math.py": "aa"}, "run": "1"}}
    b = {"spec": {"train": {"lr": 3e-6, "steps": 10}}, "hashes": {"rewards": {"rewards/math.py": "bb"}, "run": "2"}}
    assert plan_differences(a, b) == [("hashes.rewards.rewards/math.py", "aa", "bb"),
                                      ("spec.train.lr", "1e-05", "3e-06")]
