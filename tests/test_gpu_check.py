"""bin/gpu-check's CPU-runnable part: its arguments, its dry run, how a run's metrics are judged, and the
JSON line it ends with (the GPU runs themselves need a GPU: docs/engines.md says where they stand)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_check
from bench.gpu_check import Check, judge, parse_args

ROOT = Path(__file__).resolve().parents[1]
CUDA = {"rollout.device": "cuda", "update.device": "cuda", "update.autocast": "bfloat16", "rollout.engine": "vllm",
        "rollout.dtype": "bfloat16", "update.weight_sync": "adapters (bfloat16)"}


def test_arguments():
    a = parse_args([])
    assert a.only == ["tiny_vllm", "quickstart_bf16", "quickstart_lora"] and not a.dry_run
    assert parse_args(["--only", "quickstart_lora", "--dry-run"]).only == ["quickstart_lora"]
    assert parse_args(["--only", "tiny_hf", "tiny_lora_hf"]).only == ["tiny_hf", "tiny_lora_hf"]
    with pytest.raises(SystemExit):
        parse_args(["--only", "no_such_check"])


def test_dry_run_prints_each_checks_command_as_the_json_line():
    out = subprocess.run(["bash", str(ROOT / "bin/gpu-check"), "--dry-run"], capture_output=True, text=True,
                         timeout=120, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(line) == {"machine", "checks", "ok", "dry_run"} and set(line["checks"]) == set(gpu_check.DEFAULT)
    lora = line["checks"]["quickstart_lora"]["command"]
    assert lora[:3] == ["factory", "run", "specs/quickstart.yaml"]
    assert {"model.lora.r=16", "algorithm.rollout_correction.kind=tis", "resources.rollout.num_gpus=0.5"} <= set(lora)


def test_judge_passes_a_good_run_and_names_what_failed():
    check = Check("s", (), {"rollout.device": "cuda"}, lora=True, tis=True)
    good = {"rollout/logprob_diff_mean": [(1, 0.3), (2, 0.01)], "rollout/logprob_diff_max": [(2, 0.2)],
            "actor/tis_weight_mean": [(2, 0.99)], "timing/step_s": [(1, 9.0), (2, 3.0)]}
    r = judge(check, good, CUDA, 12.0)
    assert r["ok"] and r["logprob_diff_mean"] == 0.01 and r["step_s"] == 3.0  # step 1 (before a sync) left out
    # a time leaves out the last step too (it also evaluates and checkpoints) when a step is left
    r = judge(check, {**good, "timing/step_s": [(1, 9.0), (2, 3.0), (3, 7.0)]}, CUDA, 12.0)
    assert r["step_s"] == 3.0
    bad = judge(check, {"rollout/logprob_diff_mean": [(2, 0.2)]},
                {**CUDA, "rollout.device": "cpu", "update.weight_sync": "full (bfloat16)"}, 1.0)
    assert not bad["ok"]
    for part in ("resolved.rollout.device is 'cpu', not 'cuda'", "differ by 0.2 on average",
                 "the sync carried 'full (bfloat16)'", "no actor/tis_weight_mean"):
        assert part in bad["error"]


def test_without_cuda_it_says_so_and_still_ends_with_its_json_line(capsys, monkeypatch):
    monkeypatch.setattr(gpu_check, "machine", lambda: {"cuda_available": False, "gpus": []})
    assert gpu_check.main(["--only", "tiny_vllm"]) == 1
    out = capsys.readouterr()
    assert "needs an NVIDIA GPU" in out.err
    assert json.loads(out.out.strip().splitlines()[-1]) == {"machine": {"cuda_available": False, "gpus": []},
                                                            "checks": {}, "ok": False}


def test_each_run_gets_what_is_left_of_the_budget_and_the_rest_are_not_run(capsys, monkeypatch):
    """Each run had its 170 s whatever was left: 4 checks (docs/engines.md's command without vLLM) could take 680 s,
    and bin/gpu-check's `timeout 590` killed the script before its JSON line. A run now gets at most what is left of
    the budget (less the time to read it back), and a check with too little left is not run, said in the line."""
    now = [0.0]
    given = {}

    def run_check(name, check, timeout):
        given[name] = timeout
        now[0] += {"tiny_hf": 170, "tiny_lora_hf": 170}.get(name, timeout)  # the third runs into its timeout
        return {"ok": True, "wall_s": 1.0}

    monkeypatch.setattr(gpu_check, "machine", lambda: {"cuda_available": True})
    monkeypatch.setattr(gpu_check, "run_check", run_check)
    names = ["tiny_hf", "tiny_lora_hf", "tiny_bf16_zero2_hf", "tiny_zero3_hf"]
    assert (gpu_check.READ_BACK_S, gpu_check.MIN_RUN_S) == (20, 60)
    assert gpu_check.main(["--only", *names, "--budget", "500"], clock=lambda: now[0]) == 1
    assert given == {"tiny_hf": 170, "tiny_lora_hf": 170, "tiny_bf16_zero2_hf": 500 - 340 - 20}
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["ok"] is False and line["checks"]["tiny_bf16_zero2_hf"]["ok"] is True
    assert line["checks"]["tiny_zero3_hf"] == {  # 480 s gone
        "ok": False, "not_run": "20 s of the 500 s budget were left (a run needs 60 s)"}
    # the default budget is bin/gpu-check's limit less the time to start and print
    limit = int(re.search(r"timeout (\d+)", (ROOT / "bin/gpu-check").read_text()).group(1))
    assert parse_args([]).budget + gpu_check.READ_BACK_S <= limit


def test_stopped_by_sigterm_it_prints_the_json_line_of_what_finished():
    """`timeout` sends SIGTERM: the script died without its line, and the checks that had finished were lost.
    (The exit status is `timeout`'s own, 124.)"""
    code = ("import sys, time; from bench import gpu_check as g; g.machine = lambda: {'cuda_available': True}; "
            "g.run_check = lambda name, check, timeout: "
            "(time.sleep(0.2 if name == 'tiny_hf' else 60), {'ok': True})[1]; "
            "sys.exit(g.main(['--only', 'tiny_hf', 'tiny_lora_hf', 'tiny_zero3_hf']))")
    out = subprocess.run(["timeout", "4", sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["checks"] == {"tiny_hf": {"ok": True},
                              "tiny_lora_hf": {"ok": False, "error": "stopped (SIGTERM) while it ran"},
                              "tiny_zero3_hf": {"ok": False, "not_run": "stopped (SIGTERM) before it ran"}}
    assert line["ok"] is False
