"""The CPU update's allocator (factory/allocator.py, `train.allocator`): what the plan starts the update's
processes with, that such a process really reuses the memory it frees (the page faults the update saves),
and that asking for mimalloc where it cannot be preloaded is a spec error."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from factory import allocator
from factory.allocator import allocator_env, mimalloc_missing
from factory.compiler.compile import compile_file
from factory.compiler.errors import SpecErrors

REPO = Path(__file__).resolve().parents[1]
needs_mimalloc = pytest.mark.skipif(mimalloc_missing() is not None, reason=str(mimalloc_missing()))

# Allocates and frees a 128 MB tensor four times, 50 ms apart and other tensors in between (mimalloc's default
# purge delay is 10 ms: with it the second round faulted 2/3 of its pages again), and prints each round's minor
# page faults, the process's resident memory after them, and its allocator. (With mimalloc's transparent huge
# pages allowed the first round faults ~100 times, 2 MB each: the test asserts they are off too.)
ROUNDS = """
import json, resource, time
import torch
from factory.allocator import running_allocator
rounds = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(32 * 2**20)  # 128 MB, above any mmap threshold of glibc's
    del x
    rounds.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    time.sleep(0.05)
    for mb in (40, 20, 8):  # other sizes in between, as a step has: they set mimalloc's purging going
        y = torch.ones(mb * 2**18)
        del y
        time.sleep(0.02)
rss_mb = int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
print(json.dumps({"faults": rounds, "rss_mb": rss_mb, "allocator": running_allocator()}))
"""


def _rounds(env: dict[str, str]) -> dict:
    plain = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("MIMALLOC_")}
    out = subprocess.run([sys.executable, "-c", ROUNDS], env={**plain, **env, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_mimalloc
def test_a_process_started_with_the_env_reuses_what_it_frees():
    """glibc maps each 128 MB tensor afresh (~32k page faults a round, every round); under the plan's
    mimalloc environment the later rounds reuse the first one's pages -- and the heap does not grow."""
    system = _rounds({})
    mimalloc = _rounds(allocator_env("auto", "cpu"))
    assert system["allocator"] == "system" and mimalloc["allocator"] == "mimalloc"
    pages = 128 * 2**20 // 4096
    assert all(f > pages * 0.9 for f in system["faults"]), system
    assert mimalloc["faults"][0] > pages * 0.9 and all(f < pages * 0.05 for f in mimalloc["faults"][1:]), mimalloc
    assert mimalloc["rss_mb"] < system["rss_mb"] + 128 + 64, (mimalloc, system)  # one tensor's pages kept, not four


def test_the_computing_stages_start_with_the_allocator_the_spec_resolves_to(monkeypatch):
    def update_env(*overrides: str) -> dict[str, str]:
        _, plan = compile_file(str(REPO / "specs" / "tiny.yaml"), list(overrides))
        assert plan.stage("rollout").env == plan.stage("update").env  # both compute on the CPU here
        return plan.stage("update").env

    # a local judge's model computes on the CPU too: its stage starts as the others do
    _, plan = compile_file(str(REPO / "specs" / "deepsearch-cpu-judge.yaml"))
    judges = [s for s in plan.stages if s.name.startswith("judge.")]
    assert judges and all(s.env == plan.stage("update").env for s in judges)
    assert judges[0].env or mimalloc_missing() is not None  # (not two empty environments alike)

    assert update_env("train.allocator=system") == {}
    if mimalloc_missing() is None:
        env = update_env()
        assert Path(env["LD_PRELOAD"]).name.startswith("libmimalloc.so") and Path(env["LD_PRELOAD"]).is_file()
        assert env["MIMALLOC_PURGE_DELAY"] == "-1"
    # on CUDA the large tensors are the GPU's: auto leaves the system's allocator
    assert allocator_env("auto", "cuda") == {} and allocator_env("system", "cpu") == {}
    # where mimalloc cannot be preloaded, auto quietly keeps the system's, and asking for it by name is an error
    monkeypatch.setattr(allocator, "mimalloc_missing", lambda: "the cmeel-mimalloc package is not installed")
    assert update_env() == {}
    with pytest.raises(SpecErrors) as e:
        update_env("train.allocator=mimalloc")
    assert "train.allocator" in str(e.value) and "not installed" in str(e.value) and "allocator: auto" in str(e.value)
