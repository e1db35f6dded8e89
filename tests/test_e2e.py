"""The whole graph, for real: `factory run specs/tiny.yaml` through Ray, the calculator MCP server,
DeepSpeed and an MLflow tracking server, then the store is read back as a user would read it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from factory.allocator import mimalloc_missing
from tests.tracked_runs import ENGINE, STEPS

REPO = Path(__file__).resolve().parents[1]
ALLOCATOR = "system" if mimalloc_missing() else "mimalloc"


@pytest.fixture(scope="module")
def tiny_run(tiny_runs):
    """Run A of the shared pair (tests/tracked_runs.py): `factory run specs/tiny.yaml`, tracked over HTTP by a
    real `mlflow server`."""
    return tiny_runs.work_a, tiny_runs.client, tiny_runs.a, tiny_runs.out_a


def test_parameters_changed(tiny_run):
    import torch
    from safetensors.torch import load_file

    from factory.assets import resolve_model

    work, _, run, _ = tiny_run
    folder = Path(run.data.tags["factory.checkpoint_dir"])  # the run's own, under train.checkpoint_dir
    assert folder.parent == work / "runs" / "tiny" and folder.name == f"{run.info.run_name}-{run.info.run_id[:8]}"
    before = load_file(Path(resolve_model("factory:tiny-qwen3-calc")) / "model.safetensors")
    after = load_file(folder / f"step_{STEPS}" / "hf" / "model.safetensors")
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) > len(before) // 2, f"only {len(changed)} of {len(before)} tensors changed"
    assert (folder / "latest").read_text().strip() == f"step_{STEPS}"


def test_two_runs_of_one_spec_at_once_each_export_their_own_weights(tiny_runs, tmp_path):
    """Runs A and B of tests/tracked_runs.py ran at once in one folder (one spec, one checkpoint_dir): each
    kept its own checkpoints, and `factory export RUN` of each generates, greedily, exactly the tokens that
    run's final policy generated in its last evaluation. (Before, the second run's step_2 replaced the
    first's in the shared folder, and both exports gave whichever `latest` named.)"""
    from tests.test_run_lifecycle import export_matches_last_eval

    folders = {tiny_runs.a.data.tags["factory.checkpoint_dir"], tiny_runs.b.data.tags["factory.checkpoint_dir"]}
    assert len(folders) == 2
    for run, name in ((tiny_runs.a, "a"), (tiny_runs.b, "b")):
        export_matches_last_eval(run, tiny_runs.client, tiny_runs.uri, tmp_path / name, STEPS)


def test_every_step_has_its_metrics(tiny_run):
    _, client, run, _ = tiny_run
    for name in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "timing/step_s", "timing/generate_s",
                 "timing/tools_only_s", "timing/reward_s", "timing/update_s", "timing/weight_sync_s",
                 "tools/calculate/calls", "num_turns/mean", "response_length/mean"):
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, name))
        assert steps == list(range(1, STEPS + 1)), name
    eval_steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "eval/accuracy"))
    assert eval_steps == [0, STEPS]
    assert run.data.params["train.steps"] == str(STEPS)
    # the time to first step, logged with the step-0 evaluation, and its phases (which it contains)
    startup = {k: client.get_metric_history(run.info.run_id, k) for k in run.data.metrics if k.startswith("timing/startup")}
    assert {p.step for points in startup.values() for p in points} == {0}
    total = startup.pop("timing/startup_s")[0].value
    phases = {k: v[0].value for k, v in startup.items() if "/stage_" not in k}
    assert set(phases) == {f"timing/startup/{p}_s" for p in ("command", "store", "models", "ray", "stages", "tracking")}
    assert 0 < sum(phases.values()) <= total
    # what the stages chose on their device (tiny.yaml trains in float32: no bf16 anywhere)
    assert {k: v for k, v in run.data.params.items() if k.startswith("resolved.")} == {
        "resolved.rollout.engine": ENGINE, "resolved.rollout.device": "cpu", "resolved.rollout.dtype": "float32",
        "resolved.update.device": "cpu", "resolved.update.dtype": "float32", "resolved.update.autocast": "off",
        "resolved.update.share_prefix": "on", "resolved.update.packing": "auto", "resolved.update.dropout": "off",
        "resolved.update.weight_sync": "full (float32)", "resolved.rollout.weight_sync": "full weights",
        "resolved.rollout.max_model_len": "4096",  # the tiny model's context
        # the update's and the rollout's processes run with the allocator the plan started them with (Linux
        # x86-64: mimalloc)
        "resolved.update.allocator": ALLOCATOR, "resolved.rollout.allocator": ALLOCATOR,
        # vLLM on CPU runs eagerly unless rollout.vllm_compile says otherwise
        **({"resolved.rollout.vllm_compiled": "false"} if ENGINE == "vllm" else {})}
    assert run.data.tags["factory.spec_hash"] and run.data.tags["factory.source_commit"]


def test_the_run_placed_and_ran_its_plan(tiny_run):
    """What the run placed, and what each stage reported running at setup (the reward order, the training
    node, the resolved algorithm, the tools), is its plan.json -- and plan.json is what `factory plan
    --json` prints for the same spec, with the started tool servers' schemas hashed in."""
    work, client, run, out = tiny_run

    def artifact(name: str) -> str:
        return Path(client.download_artifacts(run.info.run_id, name, str(work))).read_text()

    printed = subprocess.run([sys.executable, "-m", "factory.commands.cli", "plan", "specs/tiny.yaml", f"train.steps={STEPS}",
                              f"rollout.engine={ENGINE}", "--json"], cwd=work, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120, check=True)
    plan, placed = json.loads(artifact("plan.json")), json.loads(artifact("placement.json"))
    compiled = json.loads(printed.stdout)
    assert plan["tools"] == {"calc": ["calculate"]} and plan["hashes"]["tools"]["calc"]
    for key in ("hashes", "tools"):  # what only the started servers can say
        plan.pop(key), compiled.pop(key)
    assert plan == compiled
    stages = {s["name"]: s for s in plan["stages"]}
    assert sorted(placed) == sorted(stages) == ["data", "reward", "rollout", "tools", "update"]
    for name, stage in stages.items():
        p = placed[name]
        assert (p["cls"], p["replicas"], p["resources"], p["strategy"]) == (
            stage["cls"], stage["replicas"], stage["resources"], stage["strategy"])
        assert len(p["setup"]) == stage["replicas"]
    (reward,) = placed["reward"]["setup"]
    assert [reward["order"], reward["train_node"]] == [stages["reward"]["settings"]["order"], "total"]
    (update,) = placed["update"]["setup"]
    assert update["algorithm"] == stages["update"]["settings"]["algorithm"] and update["world_size"] == 1
    assert placed["rollout"]["setup"][0]["tools"] == placed["tools"]["setup"][0]["tools"] == ["calculate"]


def _trajectories(tiny_run):
    work, client, run, _ = tiny_run
    rows = []
    for step in range(1, STEPS + 1):
        path = client.download_artifacts(run.info.run_id, f"trajectories/step_{step:05d}.parquet", str(work))
        rows += pq.read_table(path).to_pylist()
    return rows


def test_step_split_and_token_rate_are_honest(tiny_run):
    """timing/overhead_s is what the named parts (weight sync included) leave of the step, and
    perf/tokens_per_s counts the model's own tokens only (mask 1), not tool results or template text."""
    from factory.runtime.driver import STEP_PARTS

    _, client, run, _ = tiny_run
    m = {step: {} for step in range(1, STEPS + 1)}
    for key in ("timing/step_s", "timing/overhead_s", "perf/tokens_per_s", *(f"timing/{p}_s" for p in STEP_PARTS)):
        for point in client.get_metric_history(run.info.run_id, key):
            m[point.step][key] = point.value
    rows = _trajectories(tiny_run)
    assert len(rows) == STEPS * 8  # tiny.yaml: 2 prompts x 4 samples a step, all logged
    for step, values in m.items():
        parts = sum(values[f"timing/{p}_s"] for p in STEP_PARTS)
        assert values["timing/overhead_s"] == pytest.approx(values["timing/step_s"] - parts, abs=1e-6)
        assert values["timing/weight_sync_s"] > 0 and values["timing/overhead_s"] > -0.05, values
        generated = sum(sum(r["loss_mask"]) for r in rows[(step - 1) * 8: step * 8])
        assert values["perf/tokens_per_s"] * values["timing/step_s"] == pytest.approx(generated)


def test_trajectory_artifact_holds_the_tool_calls(tiny_run):
    rows = _trajectories(tiny_run)
    calls = [c for r in rows for c in r["tool_calls"]]
    assert calls, "the warmed-up tiny model made no tool call"
    ok = [c for c in calls if c["status"] == "ok"]
    assert ok and all(c["name"] == "calculate" and c["result"] for c in ok)


def test_the_sampler_logprobs_are_recorded_and_agree_with_the_learner(tiny_run):
    """Every model token carries the engine's log-prob (tool tokens 0), and the learner, on the same
    weights in float32, computed the same numbers (see tests/test_rollout_vllm.py for the bound)."""
    _, client, run, _ = tiny_run
    for r in _trajectories(tiny_run):
        lps, mask = r["sampler_logprobs"], r["loss_mask"]
        assert len(lps) == len(mask)
        assert all(lp == 0.0 for lp, m in zip(lps, mask) if not m) and all(lp <= 0.0 for lp in lps)
        assert any(lp < 0.0 for lp, m in zip(lps, mask) if m)
    for name in ("rollout/logprob_diff_mean", "rollout/logprob_diff_max"):
        history = client.get_metric_history(run.info.run_id, name)
        assert sorted(m.step for m in history) == list(range(1, STEPS + 1)) and max(m.value for m in history) < 1e-3


def test_loss_mask_is_zero_exactly_on_tool_and_template_tokens(tiny_run):
    """Re-render each recorded tool response with the chat template: the mask-0 runs of the response must be
    exactly those ids, and every other token must be the model's (mask 1)."""
    from transformers import AutoTokenizer

    from factory.assets import resolve_model
    from factory.rollout.chat import ChatFormat
    from factory.types import ToolResult

    chat = ChatFormat(AutoTokenizer.from_pretrained(resolve_model("factory:tiny-qwen3-calc")))
    checked = 0
    for r in _trajectories(tiny_run):
        ids, mask = r["response_ids"], r["loss_mask"]
        assert len(ids) == len(mask) and mask[0] == 1
        runs, i = [], 0  # the maximal runs of mask 0, as (start, end)
        while i < len(mask):
            if mask[i] == 0:
                j = i
                while j < len(mask) and mask[j] == 0:
                    j += 1
                runs.append((i, j))
                i = j
            else:
                i += 1
        by_turn: dict[int, list[ToolResult]] = {}
        for c in r["tool_calls"]:
            by_turn.setdefault(c["turn"], []).append(ToolResult(tool=c["tool"], text=c["result"]))
        answered = [t for t in sorted(by_turn) if t < r["num_turns"] - 1]
        assert len(runs) == len(answered)
        for (start, end), turn in zip(runs, answered):
            ended_with_eot = ids[start - 1] == chat.end_of_turn_id
            assert ids[start:end] == chat.tool_delta_ids(by_turn[turn], turn_ended_with_eos=ended_with_eot)
            checked += 1
    assert checked > 0, "no trajectory had a tool response to check"
