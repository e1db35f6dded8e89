"""The agent loop with real parts: factory.tools.ToolBox (an in-process python tool) behind a scripted
engine, and the real HFEngine on tiny-qwen3."""
import asyncio

import pytest
import torch
from transformers import AutoTokenizer

from factory.assets import resolve_model
from factory.rollout.agent import rollout, run_trajectory
from factory.rollout.chat import ChatFormat
from factory.rollout.engine import Sampling
from factory.rollout.engine_hf import HFEngine
from factory.schema import PythonTool, RolloutSpec
from factory.tools import ToolBox
from tests.test_rollout_agent import ScriptedEngine, call

GREEDY = Sampling(greedy=True)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


@pytest.fixture(scope="module")
def model_path():
    torch.set_num_threads(1)
    return resolve_model("factory:tiny-qwen3")


@pytest.fixture(scope="module")
def chat(model_path):
    return ChatFormat(AutoTokenizer.from_pretrained(model_path))


def test_malformed_calls_through_the_real_toolbox(chat):
    bad_json = '<tool_call>{"name": "add", "arguments": {"a": 2,,}}</tool_call>'
    turn1 = "\n".join([call("add", a=2, b=3), bad_json, call("divide", a=1, b=2), call("add", a="x", b=1)])
    engine = ScriptedEngine(chat, [(turn1, True), ("5", True)])
    cfg = RolloutSpec(max_turns=3, max_new_tokens=256, max_total_tokens=2048)

    async def go():
        async with ToolBox.from_spec({"add": PythonTool(function="tests.test_rollout_integration:add")}) as box:
            traj = await run_trajectory(engine, chat, box, messages=[{"role": "user", "content": "2+3?"}], row={},
                                        prompt_index=0, sample_index=0, cfg=cfg, sampling=GREEDY)
            return traj, box.metrics()

    traj, metrics = asyncio.run(go())
    results = traj.turns[0].results
    assert [(r.status, r.error_kind) for r in results] == [
        ("ok", None), ("model_error", "parse_error"), ("model_error", "unknown_tool"), ("model_error", "bad_arguments")]
    assert results[0].text == "5" and traj.stop_reason == "no_call" and not traj.infra_error
    assert all(r.text in traj.completion for r in results)  # every error is shown to the model
    assert '"name": "add"' in chat.decode(traj.prompt_ids)  # the toolbox's schema reached the template
    assert (metrics["tools/calls"], metrics["tools/model_errors"], metrics["tools/add/errors"]) == (4, 3, 2)


def test_rollout_on_the_real_engine(model_path, chat):
    engine = HFEngine(model_path, batch_size=8, seed=0, stop_token_ids=chat.stop_token_ids)

    class NoTools:
        def schemas(self):
            return []

        async def call(self, c):
            raise AssertionError("a random model should not produce a well-formed call")

    prompts = [([{"role": "user", "content": q}], {"answer": a}) for q, a in (("2+3?", "5"), ("Say hi", "hi"))]
    cfg = RolloutSpec(max_turns=2, max_new_tokens=6, max_total_tokens=64)
    trajs = asyncio.run(rollout(engine, chat, NoTools(), prompts, group_size=2, cfg=cfg, sampling=Sampling()))
    assert engine.batches_run == 1  # the four first turns were generated together
    assert [(t.prompt_index, t.sample_index) for t in trajs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for t in trajs:
        assert t.prompt_ids == chat.prompt_ids(t.messages, None)
        assert len(t.response_ids) == len(t.loss_mask) == t.turns[0].num_tokens <= 6
        assert t.loss_mask == [1] * len(t.response_ids) and t.completion == chat.decode(t.response_ids)
        assert t.stop_reason in ("budget", "no_call") and t.truncated == (t.stop_reason == "budget")
