"""The benchmarks' own logic: their baselines must do the same work as Factory, or a speed-up means
nothing. The benchmarks themselves run (--quick) in the slow tests."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.agentic import Lockstep
from bench.common import table
from factory.rollout.agent import rollout, sampling_from_spec
from factory.rollout.chat import ChatFormat
from factory.schema import RolloutSpec
from tests.test_rollout_agent import PROMPT, FakeToolBox, ScriptedEngine, call, tokenizer  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]


def _record(t):
    return (t.prompt_index, t.sample_index, t.prompt_ids, t.response_ids, t.loss_mask, t.stop_reason, t.completion,
            t.truncated, t.infra_error, [(u.text, u.num_tokens, [c.raw for c in u.calls],
                                         [(r.tool, r.text, r.status) for r in u.results]) for u in t.turns])


@pytest.mark.parametrize("one_by_one", [False, True])
@pytest.mark.parametrize("script", [
    [(call("add", a=2, b=3), True), (call("mul", a=5, b=4) + call("add", a=1, b=1), True), ("<answer>20</answer>", True)],
    [(call("add", a=2, b=3), True), ("<answer>5, I think, or maybe 20</answer>", False)],  # cut by the budget
    [(call("flaky", a=1, b=1), True), (call("add", a=1, b=1), True), (call("add", a=2, b=2), True)],  # max_turns
])
def test_lockstep_baselines_build_the_agent_loops_trajectories(tokenizer, script, one_by_one):  # noqa: F811
    """bench/agentic.py's sequential and synchronous-turn loops produce, turn by turn and token by token,
    the trajectories of Factory's own agent loop (only the schedule differs)."""
    chat = ChatFormat(tokenizer)
    cfg = RolloutSpec(max_turns=3, max_new_tokens=64 if script[-1][1] else 8, max_total_tokens=512)
    prompts = [(PROMPT, {"answer": "20"}), (PROMPT[1:], {"answer": "20"})]
    ours = asyncio.run(rollout(ScriptedEngine(chat, script), chat, FakeToolBox(), prompts, group_size=2, cfg=cfg,
                               sampling=sampling_from_spec(cfg)))
    theirs = asyncio.run(Lockstep(ScriptedEngine(chat, script), chat, FakeToolBox(), cfg, prompts, 2).run(one_by_one))
    assert [_record(t) for t in theirs] == [_record(t) for t in ours]


def test_table_keeps_a_header_as_wide_as_its_column_apart_from_the_next():
    lines = table(["", "update", "weight sync", "other"], [("1x", 8.6, 2.2, 0.3)], first=4, width=11).splitlines()
    assert lines[0].split() == ["update", "weight", "sync", "other"]  # not "updateweight"
    assert lines[1].split() == ["1x", "8.600", "2.200", "0.300"]


@pytest.mark.slow
@pytest.mark.parametrize("bench, keys", [
    ("agentic.py", {"speedup_vs_sequential", "speedup_vs_sync_turns"}),
    ("breakdown.py", {"overhead_fraction", "scaling_2x", "update_flops_over_matmul", "weight_sync_fraction"}),
    ("lora.py", {"sync_bytes", "update_rss", "step_time", "update_time"}),
    ("packing.py", {"packed_over_padded", "packed_over_padded_uniform"}),
    ("vs_trl.py", {"factory_over_trl", "factory_over_trl_tools"}),
])
def test_benchmark_runs_and_ends_with_its_json_line(bench, keys, tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / bench), "--quick"], capture_output=True, text=True,
                         timeout=1800, cwd=tmp_path, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert keys <= set(last) and all(last[k] > 0 for k in keys), last
