"""`train.max_infra_error_rate`: a step whose trajectories failed from infrastructure (a tool server down, a
judge that answered nothing) stops the run with exit code 3 and the cause, before its update. The failures
here are real: a judge endpoint nobody listens on, a tool server killed whose restarts fail; the driver's
check reads the trajectories they leave. (A real run that stops this way: tests/test_chaos.py, slow.)"""
from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from factory.compiler.compile import stage_settings
from factory.reward import RewardStage
from factory.runtime.health import EXIT_INFRA, InfraFailure, check_infra
from factory.schema import StdioServer
from factory.tools import ToolBox
from factory.types import ToolCall, Trajectory, Turn
from tests.servers import free_port
from tests.test_reward_judge import _score
from tests.test_reward_stage import make_spec, traj

ROOT = Path(__file__).resolve().parents[1]


def test_a_step_whose_judge_is_down_stops_naming_it(tmp_path):
    (tmp_path / "judge.jinja").write_text("{{ completion }}")
    url = f"http://127.0.0.1:{free_port()}/v1"
    spec = make_spec({"judge": {"llm_judge": "judge.jinja", "endpoint": url, "retries": 0}})
    trajs, _ = _score(spec, [traj(str(i), i) for i in range(4)], tmp_path)
    with pytest.raises(InfraFailure, match=r"step 2: 4 of 4 trajectories failed from infrastructure \(100%, above "
                                           rf"train.max_infra_error_rate 0.5\): judge judge: {url}/chat/completions: "
                                           "ConnectError"):
        check_infra(trajs, 0.5, step=2)
    assert check_infra(trajs, 1.0, step=2) == 1.0  # 1 = never stop


@pytest.mark.anyio
async def test_a_step_whose_tool_server_was_killed_and_does_not_come_back_stops_naming_it(tmp_path):
    """The server starts once; killed, its restarts exit at once (a marker says it ran): every later call is
    an infrastructure error (crash, failed start, then the open circuit)."""
    marker = tmp_path / "started"
    once = (f"import os, runpy, sys\nif os.path.exists({str(marker)!r}): sys.exit(1)\nopen({str(marker)!r}, 'w').close()\n"
            f"sys.argv = ['faulty.py']\nrunpy.run_path({str(ROOT / 'tests/tool_servers/faulty.py')!r}, run_name='__main__')")
    server = StdioServer(command=sys.executable, args=["-c", once], timeout_s=2.0, retries=1)
    async with ToolBox.from_spec({"faulty": server}) as box:
        ok = await box.call(ToolCall(name="pid", arguments={}, raw=""))
        os.kill(int(ok.text), signal.SIGKILL)
        results = [await box.call(ToolCall(name="echo", arguments={"text": str(i)}, raw="")) for i in range(4)]
    assert all(r.status == "infra_error" for r in results), results
    trajs = [Trajectory(prompt_index=i, sample_index=0, prompt_ids=[1], response_ids=[2], loss_mask=[1],
                        turns=[Turn(text="call", num_tokens=1, calls=[ToolCall(name="echo", arguments={}, raw="")],
                                    results=[r])], stop_reason="no_call", row={}) for i, r in enumerate(results)]
    trajs.append(Trajectory(prompt_index=9, sample_index=0, prompt_ids=[1], response_ids=[2], loss_mask=[1],
                            turns=[], stop_reason="no_call", row={}))  # made no call: fine
    with pytest.raises(InfraFailure, match=r"step 1: 4 of 5 trajectories failed from infrastructure \(80%.*"
                                           r"tool echo: "):
        check_infra(trajs, 0.5, step=1)
    assert check_infra(trajs, 0.8, step=1) == 0.8  # at the limit, not above it: the step trains


def test_the_cli_exits_3_with_the_cause(monkeypatch, capsys):
    from factory.commands import cli
    from factory.runtime import driver

    def down(plan, resume=None, **_):
        raise InfraFailure("step 1: 8 of 8 trajectories failed from infrastructure: judge j: ConnectError (8)")

    monkeypatch.setattr(driver, "run", down)
    assert cli.main(["run", str(ROOT / "specs/tiny.yaml")]) == EXIT_INFRA == 3
    assert capsys.readouterr().err.strip().endswith("judge j: ConnectError (8)")


def test_a_stage_that_stopped_answering_exits_3_with_its_message_not_as_an_internal_error(monkeypatch, capsys):
    from factory.commands import cli
    from factory.runtime import driver
    from factory.runtime.deadlines import Deadlines

    def hung(plan, resume=None, **_):
        Deadlines(limit_s=1.0).fail("rollout.generate", "step 6", 181.0, 181.0, "0 trajectories done")

    monkeypatch.setattr(driver, "run", hung)
    assert cli.main(["run", str(ROOT / "specs/tiny.yaml")]) == EXIT_INFRA
    err = capsys.readouterr().err
    assert "internal error" not in err and err.startswith("factory: stage 'rollout' did not answer generate (step 6)")
    assert "`factory run SPEC --resume` continues the run" in err


def test_an_evaluation_says_how_many_trajectories_met_an_infrastructure_failure(monkeypatch):
    """An evaluation whose every trajectory met an open circuit reported eval/reward and eval/accuracy as the
    model's, without a word: it has no update to stop, so it counts them (eval/infra_errors) and warns."""
    from types import SimpleNamespace

    from factory.compiler.compile import compile_file
    from factory.runtime import driver
    from factory.types import ToolResult

    _, plan = compile_file(ROOT / "specs" / "tiny.yaml")
    down = ToolResult(tool="calculate", text="Error: the tool is unavailable", status="infra_error",
                      error_kind="circuit_open")
    trajs = [traj("a", 0), traj("b", 1, turns=[Turn(text="<tool_call>", num_tokens=3, results=[down])])]
    m = {"rewards/correct/mean": 0.0, "reward/mean": 0.2, "reward/dropped": 0.0, "num_turns/mean": 1.5,
         "tool_calls/mean": 0.5}
    monkeypatch.setattr(driver, "carry", lambda *args, **kwargs: (trajs, m))
    said: list[str] = []
    out, _ = driver.evaluate({}, plan, SimpleNamespace(warning=said.append), step=3)
    assert out["eval/infra_errors"] == 1.0 and out["eval/reward"] == 0.2
    assert said == ["step 3 evaluation: 1 of 2 trajectories met an infrastructure failure (first: tool calculate: "
                    "circuit_open): its eval metrics score them as they ended, a reward node without a value as its "
                    "on_missing says (0, or left out under drop_sample); eval/infra_errors counts them"]
    trajs.pop()
    assert driver.evaluate({}, plan, SimpleNamespace(warning=said.append), step=4)[0]["eval/infra_errors"] == 0.0
    assert len(said) == 1


def test_a_checkpoint_the_disk_could_not_hold_is_said_as_such(tmp_path):
    """A full disk during a save was "internal error: RuntimeError: [enforce fail at inline_container.cc:672]
    . unexpected pos 39309248 vs 39309140": neither the disk nor the folder named."""
    from types import SimpleNamespace

    from factory.runtime import driver
    from factory.runtime.health import CheckpointWriteError, write_problem

    full = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 39309248 vs 39309140")
    assert write_problem(full, str(tmp_path)).startswith(f"no space left on the device of {tmp_path} (")
    assert write_problem(OSError(30, "Read-only file system"), "/ro") == "/ro is on a read-only file system"
    assert write_problem(ValueError("a bug of ours"), str(tmp_path)) is None

    class Trainer:
        def call(self, method, *args):
            if method == "state":
                return {}
            raise full

    plan = SimpleNamespace(flow=lambda kind: [SimpleNamespace(src="data", dst="update")])
    tracker = SimpleNamespace(run_id="r", checkpoint_dir=str(tmp_path), flush_traces=lambda: None)
    watch = SimpleNamespace(state=lambda: {})
    with pytest.raises(CheckpointWriteError, match=r"^could not save step 4's checkpoint: no space left on the "
                                                   r"device of .*; the checkpoints before it are whole: make room, "
                                                   r"then `factory run SPEC --resume` continues from the newest one$"):
        driver._save({"data": Trainer(), "update": Trainer()}, plan, tracker, 4, watch)


def test_a_stage_exception_ray_could_not_pickle_is_said_by_its_own_text():
    """vLLM's pydantic errors cannot be pickled: Ray put in a stand-in ("Exception ... isn't serializable:
    cannot pickle 'ArgsKwargs'"), and that was the run's one line; the cause was 40 lines further up."""
    import threading

    import ray

    from factory.runtime.driver import start_error

    tb = ("Traceback (most recent call last):\n  File \"stage.py\", line 9, in setup\n    engine = make()\n"
          "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
          "  Value error, User-specified max_model_len (100000000) is greater than the derived max_model_len\n")
    lock = threading.Lock()  # cannot be pickled
    unpicklable = ValueError("held", lock)
    err = ray.exceptions.RayTaskError("setup", tb, unpicklable, proctitle="t", pid=1, ip="127.0.0.1")
    assert type(err.cause) is ray.exceptions.RayError  # Ray's stand-in
    assert str(start_error("rollout", err)) == (
        "stage 'rollout' did not start: pydantic_core._pydantic_core.ValidationError: 1 validation error for "
        "ModelConfig Value error, User-specified max_model_len (100000000) is greater than the derived max_model_len")


def test_a_tool_reward_node_whose_server_is_down_counts():
    """A reward node that calls a tool whose server is down: its calls failed from infrastructure as surely as
    a rollout's, and the step would train on `on_missing`'s zeros."""
    from factory.types import ToolResult
    from tests.test_reward_stage import FNS

    class DownTools:
        """The tools stage with its server down, answering every call as ToolBox does then."""

        def schemas(self):
            return []

        def call(self, call):
            return ToolResult(call.name, "Error: the tool is unavailable", status="infra_error",
                              error_kind="circuit_open")

    spec = make_spec({"graded": {"tool": "grade", "arguments": {"text": "{{ completion }}"}}},
                     tools={"grade": {"function": f"{FNS}:length_score"}})
    settings = stage_settings(spec)["reward"]
    trajs, _ = _score(spec, [traj("x", i) for i in range(4)], ".", peers={settings.tool_peer: DownTools()})
    assert trajs[0].reward_details["graded"]["error"].startswith("tool grade: circuit_open")
    with pytest.raises(InfraFailure, match=r"step 1: 4 of 4 trajectories failed from infrastructure \(100%.*"
                                           r"\): tool grade: circuit_open \(4\)\."):
        check_infra(trajs, 0.5, step=1)


def test_a_per_turn_judge_that_fails_after_the_first_turn_counts(tmp_path):
    """A per-turn judge answered turn 0 and failed (after its retries) on turn 1: the node's summary says turn 0's
    "ok", yet the trajectory met a judge that answered nothing."""
    from factory.reward.judge import JudgeError

    class DownAfterTurn0:
        async def reply(self, messages):
            if "second" in str(messages):
                raise JudgeError("ConnectError: all connection attempts failed")
            return "Score: 1"

    (tmp_path / "judge.jinja").write_text("{{ completion }}")
    spec = make_spec({"j": {"llm_judge": "judge.jinja", "endpoint": "http://127.0.0.1:9/v1", "per": "turn"}})
    stage = RewardStage(stage_settings(spec, tmp_path)["reward"])
    turns = [Turn(text="first", num_tokens=1), Turn(text="second", num_tokens=1)]

    async def go():
        await stage.setup()
        stage._judges["j"] = DownAfterTurn0()
        try:
            return await stage.score([traj("first second", i, turns=turns) for i in range(4)])
        finally:
            await stage.close()

    trajs, _ = asyncio.run(go())
    assert trajs[0].reward_details["j"]["status"] == "ok"  # the first turn's
    with pytest.raises(InfraFailure, match=r"4 of 4 trajectories failed from infrastructure .*: judge j: ConnectError"):
        check_infra(trajs, 0.5, step=1)
