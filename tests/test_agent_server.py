"""Multi-agent through MCP: a spec's agent served behind one `ask` tool (factory.examples.agent_server),
used over stdio as another agent's tool; the inner agent's own tool calls really happen."""
from __future__ import annotations

import asyncio
import re
import sys
import threading
import time
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
    # an <answer> never closed: the last turn's text, read in linear time (a regex spanning the tag backtracked
    # for minutes over it, in the server's one event loop)
    open_tag = "<answer>" + " " * 20000
    started = time.perf_counter()
    assert answer_text(_traj(Turn(text=open_tag, num_tokens=2))) == "<answer>"
    assert time.perf_counter() - started < 2


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


@pytest.mark.anyio
async def test_a_failed_load_is_an_infra_error_that_says_why():
    # The agent's own calculator cannot start, so its load fails (before any model is read). That is the
    # server's failure, not the asking model's: a plain exception reached the client as the model's
    # "Error executing tool ask" (trained on, never retried, kept by `cache: true`), its reason lost.
    server = StdioServer(command=sys.executable, cwd=str(ROOT), timeout_s=60, retries=0,
                         args=["-m", "factory.examples.agent_server", "specs/tiny.yaml", "--set", "rollout.engine=hf",
                               "--set", "tools.calc.args=[-c, raise SystemExit(1)]"])
    async with ToolBox.from_spec({"agent": server}, base_dir=ROOT) as box:
        result = await box.call(ToolCall("ask", {"question": "What is 12 + 30?"}, raw=""))
    assert (result.status, result.error_kind) == ("infra_error", "transport"), result
    assert "the agent could not be loaded: " in result.text and "did not start" in result.text, result.text


@pytest.mark.anyio
async def test_a_crashed_episode_is_a_server_error_that_says_why(monkeypatch):
    from mcp.shared.exceptions import MCPError
    from mcp.types import INTERNAL_ERROR

    from factory.examples.agent_server import Agent

    async def loaded(self):
        pass

    async def crash(self, question):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(Agent, "_start", loaded)
    monkeypatch.setattr(Agent, "_episode", crash)
    agent = Agent("specs/tiny.yaml")
    agent.begin()
    try:
        with pytest.raises(MCPError, match="the agent's episode failed: .*illegal memory access") as failed:
            await agent.ask("What is 12 + 30?")
    finally:
        await agent.close()
    assert failed.value.code == INTERNAL_ERROR


@pytest.mark.anyio
async def test_a_client_that_leaves_while_the_agent_loads_gets_a_clean_end(monkeypatch):
    # What `factory check specs/multi-agent.yaml --connect` does: handshake, tools/list, gone before the model is
    # loaded. close() cancelled the load and awaited it: asyncio's CancelledError (a BaseException, not
    # concurrent.futures') escaped the lifespan, and the server exited 1 with a traceback.
    from factory.examples.agent_server import Agent

    loading, unwound = threading.Event(), threading.Event()

    async def load_for_ever(self):  # stands for local_stages(...), whose exit closes the servers it started
        try:
            loading.set()
            time.sleep(0.5)  # a blocking part (weights read on the agent's loop): close() comes meanwhile
            await asyncio.sleep(3600)
        finally:
            unwound.set()

    monkeypatch.setattr(Agent, "_start", load_for_ever)
    agent = Agent("specs/tiny.yaml")
    agent.begin()
    assert await asyncio.to_thread(loading.wait, 10)
    await agent.close()
    assert agent._load.cancelled() and not agent._thread.is_alive()
    # The load unwound before the loop stopped: stopped in the iteration that delivered the cancellation, the
    # loop left the load pending for ever, its clean-up never run ("Task was destroyed but it is pending!").
    assert unwound.is_set()


def test_a_wrong_inner_spec_stops_the_server_with_the_compilers_words(monkeypatch, capsys):
    from factory.commands import cli

    monkeypatch.chdir(ROOT)
    args = "tools.agent.args=[-m, factory.examples.agent_server, specs/tiny.yaml, --model, /nonexistent]"
    assert cli.main(["check", "specs/multi-agent.yaml", "--connect", args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specs/multi-agent.yaml:23: tools.agent: server failed to start: "), err
    assert err.endswith("the agent's spec is wrong: <override 1>: model.path: model folder not found: /nonexistent\n"
                        "1 error in specs/multi-agent.yaml\n"), err



def test_the_agent_server_refuses_replay_run_instead_of_ignoring_it(monkeypatch):
    """`--set replay.run=RUN` was compiled and then ignored: the agent called its live tools while its spec said
    they were answered from RUN's recording. A recording answers the calls made at the same place of its run
    (their origin); an `ask` is a new question, so the setting is refused, before anything loads."""
    import argparse

    from factory.examples import agent_server

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(agent_server, "_agent", None)  # _load sets the module's agent: put back after the test
    args = argparse.Namespace(spec="specs/tiny.yaml", model=None, show_calls=False, overrides=["replay.run=old"])
    with pytest.raises(SystemExit, match=r"^agent_server: replay.run=old: the agent server answers new questions, "
                                        r".* remove replay.run \(for answers kept across runs, mark a deterministic "
                                        r"tool server `cache: true`\)$"):
        agent_server._load(args)
    agent_server._load(argparse.Namespace(spec="specs/tiny.yaml", model=None, show_calls=False, overrides=[]))
    assert agent_server._agent.plan.driver.replay.run is None  # without it the agent compiles as before
