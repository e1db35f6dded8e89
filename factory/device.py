"""What the hardware does fast, asked without importing torch (so `factory check` stays torch-free).

Every `auto` dtype or autocast choice in every stage goes through `resolve_dtype` here: bf16
only where the device computes it natively, float32 everywhere else. The reason is speed, not accuracy:
on a CPU without AVX512-bf16 or AMX, oneDNN emulates bf16 and a matmul runs 30-60x slower than in
float32 (measured: 1.2 vs 70.8 GFLOP/s on an AVX2-only AMD EPYC; 2.3 vs 90 on an AVX512 EPYC with
AVX2 emulated), which turned a 42 s evaluation into minutes of silence.

- CPU: the `avx512_bf16` / `amx_bf16` flags of /proc/cpuinfo, and oneDNN's own cap
  `ONEDNN_MAX_CPU_ISA`, else its older name `DNNL_MAX_CPU_ISA` (set below AVX512_CORE_BF16, oneDNN will
  not use those instructions even where the CPU has them; `ONEDNN_MAX_CPU_ISA=AVX2` is how we emulate an
  AVX2-only machine). torch's `torch.ops.mkldnn._is_mkldnn_bf16_supported()` agrees where the flags decide
  (bf16 instructions: both yes; no AVX512: both no), not in between: it says whether oneDNN computes bf16 at
  all, and on AVX512 without bf16 (or capped at AVX512_CORE) oneDNN emulates it, slowly (measured 8.4 vs 20.8
  GFLOP/s in float32), where it says yes and this says no.
- `FACTORY_FAKE_CPU=avx2|avx512_bf16|amx_bf16` fakes the CPU's answer (tests, docs and CI on the other
  kind of machine); see `fake_cpu`.
- CUDA: the driver library (libcuda) through ctypes: device count and compute capability; bf16 is
  native from capability 8.0 (Ampere). `CUDA_VISIBLE_DEVICES` is honoured by the driver itself.
"""
from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from factory.plan import Compute

DeviceKind = Literal["cpu", "cuda"]

# How much slower an emulated bf16 matmul is than float32 on a CPU without bf16 instructions, for
# warnings (one thread, SmolLM2's MLP shapes; see the module docstring).
BF16_SLOWDOWN = "30-60x"

# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) that still include native bf16 instructions.
_BF16_ISAS = {"ALL", "DEFAULT", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
              "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2"}


@dataclass(frozen=True)
class Device:
    """One kind of device as a stage will see it."""

    kind: DeviceKind
    name: str  # "AMD EPYC", "NVIDIA H100 80GB HBM3"
    fast_bf16: bool
    why: str  # what the answer rests on, for messages and params

    def describe(self) -> str:
        return f"{self.kind} ({self.name}): bf16 {'native' if self.fast_bf16 else 'emulated'}, {self.why}"


# ------------------------------------------------------------------------------------------------ CPU
def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def isa_cap(environ: Mapping[str, str]) -> tuple[str, str | None]:
    """oneDNN's ISA cap in `environ`, as (the variable, its value; None: no cap): ONEDNN_MAX_CPU_ISA, else its
    older name DNNL_MAX_CPU_ISA, which oneDNN still reads (an empty one counts as unset, as oneDNN's does)."""
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        if environ.get(name):
            return name, environ[name]
    return "ONEDNN_MAX_CPU_ISA", None


def cpu_from(cpuinfo: str, onednn_max_isa: str | None, cap_name: str = "ONEDNN_MAX_CPU_ISA") -> Device:
    """The CPU described by a /proc/cpuinfo text and oneDNN's ISA cap, read from `cap_name` (pure: tests feed
    it by hand)."""
    flags: set[str] = set()
    name = "unknown CPU"
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "flags" and not flags:
            flags = set(value.split())
        elif key == "model name" and name == "unknown CPU":
            name = value.strip()
    native = sorted(flags & {"avx512_bf16", "amx_bf16"})
    if not native:
        return Device("cpu", name, False, "no avx512_bf16/amx_bf16 in /proc/cpuinfo")
    cap = (onednn_max_isa or "").strip().upper()
    if cap and cap not in _BF16_ISAS:
        return Device("cpu", name, False, f"{cap_name}={cap} hides {'/'.join(native)}")
    return Device("cpu", name, True, "/".join(native))


# FACTORY_FAKE_CPU: the one switch that makes this machine's CPU answer as the other kind, so the test suite,
# the docs and a run can be checked for both kinds on either machine (CI runs on whoever submits). It fakes
# Factory's answer only: oneDNN still computes with what the CPU has (add ONEDNN_MAX_CPU_ISA=AVX2
# ATEN_CPU_CAPABILITY=avx2 to emulate an AVX2-only CPU's kernels as well).
FAKE_CPU = "FACTORY_FAKE_CPU"
FAKE_CPU_KINDS = {"avx2": (), "avx512_bf16": ("avx512_bf16",), "amx_bf16": ("avx512_bf16", "amx_bf16")}


def fake_cpu(real: Device, kind: str) -> Device:
    """`real` answering as a CPU of `kind` (a FAKE_CPU_KINDS key) would."""
    if kind not in FAKE_CPU_KINDS:
        raise ValueError(f"{FAKE_CPU}={kind!r}: expected one of {', '.join(FAKE_CPU_KINDS)} (or unset)")
    native = FAKE_CPU_KINDS[kind]
    return Device("cpu", real.name, bool(native), f"{FAKE_CPU}={kind}: " +
                  ("/".join(native) if native else "no avx512_bf16/amx_bf16"))


def real_cpu() -> Device:
    """This machine's CPU as oneDNN will use it, whatever $FACTORY_FAKE_CPU says."""
    name, cap = isa_cap(os.environ)
    return cpu_from(_cpuinfo(), cap, name)


@functools.cache
def cpu() -> Device:
    """The CPU every choice is made for: this machine's, or the kind $FACTORY_FAKE_CPU names."""
    kind = os.environ.get(FAKE_CPU, "").strip().lower()
    return fake_cpu(real_cpu(), kind) if kind else real_cpu()


# ----------------------------------------------------------------------------------------------- CUDA
def _libcuda() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return lib if lib.cuInit(0) == 0 else None


@functools.cache
def cuda_devices() -> tuple[Device, ...]:
    """The CUDA devices this process may use (empty without an NVIDIA driver or visible device)."""
    lib = _libcuda()
    if lib is None:
        return ()
    count = ctypes.c_int(0)
    if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return ()
    out = []
    for i in range(count.value):
        dev, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
        name = ctypes.create_string_buffer(128)
        if lib.cuDeviceGet(ctypes.byref(dev), i) != 0:
            continue
        lib.cuDeviceGetName(name, len(name), dev)
        # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75, _MINOR = 76
        lib.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)
        lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)
        cc = f"compute capability {major.value}.{minor.value}"
        out.append(Device("cuda", name.value.decode(errors="replace") or f"cuda:{i}", major.value >= 8, cc))
    return tuple(out)


# --------------------------------------------------------------------------------------------- memory
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory.max")  # v1, v2 ("max")


def system_memory() -> int:
    """This machine's memory in bytes as a local Ray sizes its node (ray._common.utils.get_system_memory, which
    `import ray`, a second and more, would reach): the physical memory, or a container's cgroup limit if lower."""
    import psutil

    total = psutil.virtual_memory().total
    for limit in _CGROUP_LIMITS:
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        return min(total, int(text)) if text.isdigit() else total
    return total


# ------------------------------------------------------------------------------------------ choosing
def stage_device(num_gpus: float) -> DeviceKind:
    """Where a stage computes: CUDA when it reserved a GPU (Ray then makes one visible to it), else CPU.
    A stage without a GPU reservation sees no CUDA device under Ray, whatever the machine has (Ray 2.60 needs
    telling: factory.runtime.driver._STAGE_ENV)."""
    return "cuda" if num_gpus > 0 else "cpu"


def probe(kind: DeviceKind) -> Device:
    """The device a stage of this kind computes on. The one seam tests fake (both ways)."""
    if kind == "cuda":
        devices = cuda_devices()
        return devices[0] if devices else Device("cuda", "none", False, "no CUDA device visible")
    return cpu()


def fast_bf16(kind: DeviceKind) -> bool:
    return probe(kind).fast_bf16


def auto_dtype(kind: DeviceKind, *, want_bf16: bool, weights: str = "float32") -> str:
    """The weights' dtype an `auto` setting picks on `kind`: bfloat16 when bf16 is wanted (bf16 autocast
    or bf16 weights) and the device does it natively; float16 weights only on CUDA; else float32."""
    if (want_bf16 or weights == "bfloat16") and fast_bf16(kind):
        return "bfloat16"
    if weights == "float16" and kind == "cuda":
        return "float16"
    return "float32"


def resolve_dtype(compute: Compute) -> str:
    """The dtype a stage computes in: its setting, or for `auto` what `auto_dtype` picks on its device. The
    one rule every stage's `auto` goes through (the rollout's engine, a local judge's, the update's
    autocast), asked on the stage's own machine."""
    if compute.dtype != "auto":
        return compute.dtype
    return auto_dtype(compute.device, want_bf16=compute.want_bf16, weights=compute.weights)


def half_precision_warning(kind: DeviceKind, dtype: str) -> str | None:
    """The warning for an EXPLICIT bfloat16/float16 setting on a device that emulates it; None if fine.
    (CPUs have no fast float16 matmuls outside AMX-FP16 server parts, so float16 always warns on CPU; GPUs
    before Ampere have float16 but not bfloat16.)"""
    if kind == "cuda":
        if dtype != "bfloat16" or not cuda_devices():  # none here: the reservation's own error says it
            return None
        device = probe(kind)
        if device.fast_bf16:
            return None
        return (f"bfloat16 on this GPU ({device.name}; {device.why}) is not native (it is from compute capability "
                "8.0, Ampere, on): vLLM refuses it and torch emulates it slowly; use float16 or float32, or `auto` "
                "where the setting has it")
    if dtype not in ("bfloat16", "float16"):
        return None
    device = probe(kind)
    if dtype == "bfloat16" and device.fast_bf16:
        return None
    return (f"{dtype} on this CPU ({device.name}; {device.why}) is emulated by oneDNN: matmuls run "
            f"about {BF16_SLOWDOWN} slower than in float32; use float32, or `auto` where the setting has it")
