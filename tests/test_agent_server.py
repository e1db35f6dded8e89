"""Multi-agent through MCP: a spec's agent served behind one `ask` tool (factory.examples.agent_server),
used over stdio as another agent's tool; the inner agent's own tool calls really happen."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from factory.examples.agent_server import answer_text
from factory.schema import StdioServer
from factory.tools import ToolBox
from factory.types import ToolCall, ToolResult, Trajectory, Turn

ROOT = Path(__file__).resolve().parents[1]


def _traj(*turns):
    return Trajectory(prompt_index=0, sample_index=0, prompt_ids=[], response_ids=[], loss_mask=[], turns=list(turns),
                      stop_reason="no_call", row={})


def test_answer_is_the_last_answer_tag_with_calls_listed_first():
    call = Turn(text='<tool_call>{"name": "calculate"}</tool_call>', num_tokens=5,
                calls=[ToolCall("calculate", {"expression": "2+2"}, raw="")],
                results=[ToolResult(tool="calculate", text="4\n")])
    traj = _traj(call, Turn(text="So <answer> 4 </answer>", num_tokens=5))
    assert answer_text(traj) == "4"
    assert answer_text(traj, show_calls=True) == 'calculate({"expression": "2+2"}) -> 4\n4'
    assert answer_text(_traj(Turn(text=" no tag ", num_tokens=2))) == "no tag"  # no tag: the last turn's text


@pytest.mark.anyio
async def test_the_inner_agent_calls_its_own_tools_behind_ask():
    # The inner agent is specs/tiny.yaml: the tiny Qwen3 warmed up to call the calculator server. On the
    # transformers engine: the vLLM engine's start-up (tens of seconds on 2 cores) proves nothing more here,
    # and the end-to-end runs (tests/test_e2e.py) run the rollout stage on vLLM.
    server = StdioServer(command="python", args=["-m", "factory.examples.agent_server", "specs/tiny.yaml",
                                                 "--set", "rollout.engine=hf", "--show-calls"],
                         cwd=str(ROOT), timeout_s=120)
    async with ToolBox.from_spec({"agent": server}, base_dir=ROOT) as box:
        assert [s["function"]["name"] for s in box.schemas()] == ["ask"]
        result = await box.call(ToolCall("ask", {"question": "What is 12 + 30?"}, raw=""))
    assert result.status == "ok", result.text
    # A line per inner call, answered by the real calculator server (a number, or its error message).
    assert re.match(r'calculate\(\{"expression": ".*"\}\) -> \S', result.text), result.text


def test_a_wrong_inner_spec_stops_the_server_with_the_compilers_words(monkeypatch, capsys):
    from factory.commands import cli

    monkeypatch.chdir(ROOT)
    args = "tools.agent.args=[-m, factory.examples.agent_server, specs/tiny.yaml, --model, /nonexistent]"
    assert cli.main(["check", "specs/multi-agent.yaml", "--connect", args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specs/multi-agent.yaml:23: tools.agent: server failed to start: "), err
    assert err.endswith("the agent's spec is wrong: <override 1>: model.path: model folder not found: /nonexistent\n"
                        "1 error in specs/multi-agent.yaml\n"), err


def test_the_agent_server_replays_a_recorded_run_and_fails_an_episode_at_a_miss(monkeypatch):
    """`--set replay.run=RUN` was compiled and then ignored: the agent called its live tools while its spec said
    they were answered from RUN's recording."""
    import argparse
    import asyncio
    from types import SimpleNamespace

    from mcp.server.mcpserver.exceptions import ToolError

    import factory.tracking.tracker as tracker_module
    from factory.examples import agent_server
    from factory.tracking.tracker import RunLookupError

    row = {"origin": "", "server": "calc", "tool": "calculate", "arguments": '{"expression":"2+2"}', "text": "4",
           "status": "ok", "error_kind": None, "latency_s": 0.1, "source": "live"}

    class Store:
        def run(self, ref: str):
            if ref != "old":
                raise RunLookupError(f"no run with id or name '{ref}'")
            return SimpleNamespace(run_id="old-id", name="old", tags={})

        def tool_calls(self, run_id: str):
            return [row]

    monkeypatch.setattr(tracker_module, "open_tracker", lambda uri=None, experiment=None, read=False: Store())
    monkeypatch.chdir(ROOT)
    agent = agent_server.Agent("specs/tiny.yaml", overrides=("replay.run=old",))
    agent.compile()
    assert agent.plan.stage("tools").settings.replay.rows == [row]

    # an episode whose calls the recording lacked is the ask's error under on_miss: fail; under live, its answer
    class Rollout:
        async def evaluate(self, table):
            return SimpleNamespace(trajs=[_traj(Turn(text="<answer>5</answer>", num_tokens=3))])

    class Tools:
        async def take_recording(self):
            return {"rows": [], "misses": ['calculate({"expression":"2+3"}) at eval/0/0/0/0/0/0']}

    async def episode(a):
        a.stage, a._recorders, a._lock = Rollout(), [Tools()], asyncio.Lock()
        return await a._episode("What is 2 + 3?")

    with pytest.raises(ToolError, match=r'^the recording of run old has no answer for 1 tool calls of this episode, '
                                        r'the first calculate\(\{"expression":"2\+3"\}\)'):
        asyncio.run(episode(agent))
    live = agent_server.Agent("specs/tiny.yaml", overrides=("replay.run=old", "replay.on_miss=live"))
    live.compile()
    assert asyncio.run(episode(live)) == "5"

    # a run that is not there stops the server before it answers, naming it
    monkeypatch.setattr(agent_server, "_agent", None)  # _load sets the module's agent: put back after the test
    args = argparse.Namespace(spec="specs/tiny.yaml", model=None, show_calls=False, overrides=["replay.run=nosuch"])
    with pytest.raises(SystemExit, match=r"^agent_server: replay.run=nosuch: no run with id or name 'nosuch'$"):
        agent_server._load(args)
