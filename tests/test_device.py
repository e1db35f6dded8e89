"""The device probe and every `auto` dtype choice made from it, with the probe faked both ways."""
from __future__ import annotations

import os

import pytest

from factory import device
from factory.compiler.compile import compile_file, stage_settings
from factory.compiler.errors import SpecErrors
from factory.device import Device, auto_dtype, cpu_from
from factory.schema import Spec
from tests.test_compiler_support import base_spec as _base
from tests.test_compiler_support import report

ZEN4 = "model name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n"
SAPPHIRE = "model name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
AVX2_ONLY = "model name\t: AMD EPYC 7B12\nflags\t\t: fpu sse2 avx avx2 fma\n"

FAST = Device("cpu", "fake fast", True, "amx_bf16")
SLOW = Device("cpu", "fake slow", False, "no avx512_bf16/amx_bf16 in /proc/cpuinfo")


def test_cpu_flags_and_the_onednn_cap():
    assert cpu_from(ZEN4, None) == Device("cpu", "AMD EPYC", True, "avx512_bf16")
    assert cpu_from(SAPPHIRE, "").fast_bf16 and cpu_from(SAPPHIRE, "").why == "amx_bf16/avx512_bf16"
    assert cpu_from(AVX2_ONLY, None) == Device("cpu", "AMD EPYC 7B12", False, "no avx512_bf16/amx_bf16 in /proc/cpuinfo")
    # How we emulate an AVX2-only machine: oneDNN then never uses the bf16 instructions the CPU has.
    assert cpu_from(ZEN4, "AVX2") == Device("cpu", "AMD EPYC", False, "ONEDNN_MAX_CPU_ISA=AVX2 hides avx512_bf16")
    assert cpu_from(ZEN4, "avx512_core_amx").fast_bf16
    assert not cpu_from("", None).fast_bf16  # no /proc/cpuinfo: assume the slow case


def test_the_older_name_of_the_onednn_cap_is_read_too(monkeypatch):
    """oneDNN reads its cap as ONEDNN_MAX_CPU_ISA, else as the older DNNL_MAX_CPU_ISA: with the older one set,
    oneDNN emulated bf16 while `auto` still chose it."""
    monkeypatch.setattr(device, "_cpuinfo", lambda: ZEN4)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX2")
    assert device.real_cpu() == Device("cpu", "AMD EPYC", False, "DNNL_MAX_CPU_ISA=AVX2 hides avx512_bf16")
    # the newer name first, as oneDNN reads them (an empty one is not set)
    assert device.isa_cap({"ONEDNN_MAX_CPU_ISA": "ALL", "DNNL_MAX_CPU_ISA": "AVX2"}) == ("ONEDNN_MAX_CPU_ISA", "ALL")
    assert device.isa_cap({"ONEDNN_MAX_CPU_ISA": "", "DNNL_MAX_CPU_ISA": "AVX2"}) == ("DNNL_MAX_CPU_ISA", "AVX2")
    assert device.isa_cap({}) == ("ONEDNN_MAX_CPU_ISA", None)


# oneDNN's ISA caps below AVX512_CORE: under them oneDNN has no AVX512 to emulate bf16 with
_BELOW_AVX512 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2"}


def test_probe_agrees_with_torch_where_the_cpu_flags_decide():
    """torch's `_is_mkldnn_bf16_supported()` says whether oneDNN computes bf16 at all: natively, or emulated on
    AVX512 (an AVX512 CPU without bf16, or one capped at AVX512_CORE: measured 8.4 vs 20.8 GFLOP/s in float32).
    Factory's probe says whether natively. Both say yes with bf16 instructions, both no without AVX512; in
    between torch says yes and Factory, rightly, no: not compared."""
    torch = pytest.importorskip("torch")
    said = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if device.real_cpu().fast_bf16:
        assert said
        return
    flags = next((line.split(":", 1)[1].split() for line in device._cpuinfo().splitlines()
                  if line.startswith("flags")), [])
    _, cap = device.isa_cap(os.environ)
    if (cap or "").upper() in _BELOW_AVX512 or not {"avx512bw", "avx512vl", "avx512dq"} <= set(flags):
        assert not said


def test_the_cpu_can_be_faked_to_either_kind(monkeypatch):
    """FACTORY_FAKE_CPU is the one switch that runs the suite, the docs or a run as on the other kind of CPU."""
    zen = Device("cpu", "AMD EPYC", True, "avx512_bf16")
    assert device.fake_cpu(zen, "avx2") == Device("cpu", "AMD EPYC", False, "FACTORY_FAKE_CPU=avx2: no avx512_bf16/amx_bf16")
    assert device.fake_cpu(SLOW, "avx512_bf16") == Device("cpu", "fake slow", True, "FACTORY_FAKE_CPU=avx512_bf16: avx512_bf16")
    assert device.fake_cpu(SLOW, "amx_bf16").fast_bf16
    with pytest.raises(ValueError, match=r"FACTORY_FAKE_CPU='avx3': expected one of avx2, avx512_bf16, amx_bf16 \(or unset\)"):
        device.fake_cpu(zen, "avx3")
    for kind, fast in (("avx2", False), ("AVX512_BF16", True)):
        monkeypatch.setenv("FACTORY_FAKE_CPU", kind)
        device.cpu.cache_clear()
        try:
            assert device.probe("cpu").fast_bf16 is fast and device.probe("cpu").name == device.real_cpu().name
            assert auto_dtype("cpu", want_bf16=True) == ("bfloat16" if fast else "float32")
        finally:
            device.cpu.cache_clear()


@pytest.fixture
def fake(monkeypatch):
    """fake(Device) makes every stage's probe answer with it (the CPU and CUDA both)."""
    def set_(d: Device) -> None:
        monkeypatch.setattr(device, "probe", lambda kind: Device(kind, d.name, d.fast_bf16, d.why))
    return set_


def _spec(**sections) -> Spec:
    base = {"name": "t", "model": {"path": "m"}, "data": {"train": {"generator": "g:f"}},
            "rewards": {"r": {"fn": "m:f"}}}
    return Spec.model_validate({**base, **sections})


@pytest.mark.parametrize("probe,want", [(FAST, "bfloat16"), (SLOW, "float32")])
def test_no_auto_setting_picks_bf16_where_it_is_slow(fake, probe, want):
    from factory.device import resolve_dtype
    from factory.update.engine import autocast_dtype

    fake(probe)
    torch = pytest.importorskip("torch")

    def rollout_dtype(settings):
        return resolve_dtype(settings.compute)

    def rollout(**sections):
        return stage_settings(_spec(**sections))["rollout"]

    def update(**sections):
        return stage_settings(_spec(**sections))["update"]

    # rollout.dtype auto, under bf16 autocast or bf16 weights
    assert rollout_dtype(rollout(train={"bf16_autocast": True})) == want
    assert rollout_dtype(rollout(model={"path": "m", "dtype": "bfloat16"}, train={"bf16_autocast": False})) == want
    assert rollout_dtype(rollout(train={"bf16_autocast": False})) == "float32"
    # the update's autocast
    assert autocast_dtype(update(train={"bf16_autocast": True})) == (torch.bfloat16 if probe.fast_bf16 else None)
    assert autocast_dtype(update(train={"bf16_autocast": False})) is None
    # an explicit choice is the user's
    assert rollout_dtype(rollout(rollout={"dtype": "bfloat16"})) == "bfloat16"
    # a local judge's auto: bf16 where native, through the same rule
    judged = stage_settings(_spec(rewards={"j": {"llm_judge": "j.jinja", "local": {"path": "m"}}}))["judge.j"]
    assert resolve_dtype(judged.compute) == want
    assert resolve_dtype(judged.compute.model_copy(update={"dtype": "float32"})) == "float32"


def test_auto_dtype_on_cuda(fake):
    fake(FAST)
    assert auto_dtype("cuda", want_bf16=True) == "bfloat16"
    assert auto_dtype("cuda", want_bf16=False, weights="float16") == "float16"
    assert auto_dtype("cpu", want_bf16=False, weights="float16") == "float32"  # no fast fp16 matmuls on CPUs
    fake(Device("cuda", "Tesla T4", False, "compute capability 7.5"))
    assert auto_dtype("cuda", want_bf16=True) == "float32"


def test_check_warns_about_explicit_bf16_on_a_slow_cpu(project, fake):
    base = _base(project, "dev_warn")
    path = project.spec(base + "rollout: {dtype: bfloat16}\n")
    fake(SLOW)
    _, plan = compile_file(path)
    assert plan.warnings == ((
        "spec.yaml:9: rollout.dtype: warning: bfloat16 on this CPU (fake slow; no avx512_bf16/amx_bf16 in "
        "/proc/cpuinfo) is emulated by oneDNN: matmuls run about 30-60x slower than in float32; use float32, or "
        "`auto` where the setting has it"),)
    fake(FAST)
    assert compile_file(path)[1].warnings == ()
    fake(SLOW)
    weights = compile_file(project.spec(base.replace("{path: \"factory:tiny-qwen3\"}",
                                                     "{path: \"factory:tiny-qwen3\", dtype: bfloat16}"), "w.yaml"))[1]
    assert [w.split(": warning")[0] for w in weights.warnings] == ["w.yaml:2: model.dtype"]
    assert compile_file(project.spec(base, "auto.yaml"))[1].warnings == ()  # auto never warns: it falls back


def test_check_warns_about_explicit_bf16_on_a_gpu_before_ampere(project, monkeypatch):
    """A T4 or V100 (compute capability 7.x) has no bf16: vLLM refuses an explicit bfloat16 there (`auto` picks
    float32), and nothing said so before the run."""
    t4 = Device("cuda", "Tesla T4", False, "compute capability 7.5")
    monkeypatch.setattr(device, "cuda_devices", lambda: (t4,))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    base = _base(project, "dev_t4") + "resources:\n  rollout: {num_gpus: 1}\n"
    assert [str(w) for w in compile_file(project.spec(base + "rollout: {dtype: bfloat16}\n"))[1].warnings] == [
        "spec.yaml:11: rollout.dtype: warning: bfloat16 on this GPU (Tesla T4; compute capability 7.5) is not "
        "native (it is from compute capability 8.0, Ampere, on): vLLM refuses it and torch emulates it slowly; use "
        "float16 or float32, or `auto` where the setting has it"]
    assert compile_file(project.spec(base + "rollout: {dtype: float16}\n", "f16.yaml"))[1].warnings == ()
    assert compile_file(project.spec(base, "auto.yaml"))[1].warnings == ()
    monkeypatch.setattr(device, "cuda_devices", lambda: (Device("cuda", "A100", True, "compute capability 8.0"),))
    assert compile_file(project.spec(base + "rollout: {dtype: bfloat16}\n", "a100.yaml"))[1].warnings == ()


def test_gpus_asked_on_a_machine_without_cuda_fail_at_check(project, monkeypatch):
    monkeypatch.setattr(device, "cuda_devices", lambda: ())
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    base = _base(project, "dev_gpu")
    path = project.spec(base + "resources:\n  rollout: {num_gpus: 1}\n")
    with pytest.raises(SpecErrors) as e:
        compile_file(path)
    assert report(e) == (
        "spec.yaml:10: resources.rollout.num_gpus: 1 GPU reserved but this machine has no CUDA device (no NVIDIA "
        "driver); set resources.rollout.num_gpus=0 to run this stage on the CPU, or join a Ray cluster that has "
        "GPUs (resources.ray_address or $RAY_ADDRESS)\n1 error in spec.yaml")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # the cluster's machines are not this one
    compile_file(path)
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setattr(device, "cuda_devices", lambda: (Device("cuda", "A100", True, "compute capability 8.0"),))
    compile_file(path)
    with pytest.raises(SpecErrors, match="2 GPUs reserved but this machine has only 1 CUDA device;"):
        compile_file(project.spec(base + "resources:\n  update: {num_gpus: 2}\n", "two.yaml"))


@pytest.mark.parametrize("probe,want", [(FAST, "bfloat16"), (SLOW, "float32")])
def test_the_rollout_stage_reports_the_dtype_it_chose(fake, probe, want):
    import asyncio

    from factory.allocator import running_allocator
    from factory.rollout.stage import RolloutStage

    fake(probe)
    spec = _spec(model={"path": "factory:tiny-qwen3"}, train={"bf16_autocast": True, "threads": 1},
                 rollout={"engine": "hf"})
    stage = RolloutStage(stage_settings(spec)["rollout"])
    info = asyncio.run(stage.setup())
    assert info["resolved"] == {"engine": "hf", "device": "cpu", "dtype": want, "weight_sync": "full weights",
                                "max_model_len": 4096, "allocator": running_allocator()}  # (this process's)
    assert str(next(stage.engine.model.parameters()).dtype) == f"torch.{want}"
    asyncio.run(stage.close())


def test_system_memory_is_the_figure_a_local_ray_sizes_its_node_by():
    """factory check refuses an object store above it (ray.init refused one at the run's start): it must be
    Ray's own figure, the cgroup limit where a container has a lower one, without importing Ray in check."""
    from ray._common.utils import get_system_memory

    assert device.system_memory() == get_system_memory()
