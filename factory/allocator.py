"""The memory allocator of the computing stages' processes on the CPU: the update's, the rollout's and local
judges' (`train.allocator`).

The float32 update allocates and frees tensors of 100 MB and more many times a step (the logits of the kept
positions, their log-softmax, their gradients). glibc serves every allocation above its mmap threshold (at
most 32 MB) with a fresh mapping and unmaps it when it is freed, so the kernel zeroes and maps every page of
it again at the next use: on the quickstart's batch 0.5-1 million page faults and 0.8-1.5 s of kernel time a
step (docs/performance.md, "The update's page faults"). mimalloc, preloaded into the update's processes and
told never to give memory back (`MIMALLOC_PURGE_DELAY=-1`), reuses those pages: the process holds its peak
between steps, which the next step needs again anyway. Its transparent huge pages are left off: on a kernel
that defragments for them (THP `madvise`), the first step spent 44 s in the kernel. The rollout's processes
get it too (the transformers engine's rollouts ran ~7% faster under it, vLLM's the same), and so do local
judge models' (they generate as the rollout does).

The process must start with the library preloaded (LD_PRELOAD), so the compiler decides it and the driver
starts those stages' actors with that environment (`Stage.env`); the learner, the rollout stage and a local
judge report what their processes run with, read from their own mappings.
"""
from __future__ import annotations

import re
import sys
from functools import cache

from factory.device import DeviceKind

# mimalloc's settings (its MIMALLOC_* environment): keep freed memory for reuse, no transparent huge pages
MIMALLOC_OPTIONS = {"MIMALLOC_PURGE_DELAY": "-1", "MIMALLOC_ALLOW_THP": "0"}


@cache
def mimalloc_library() -> str | None:
    """The path of libmimalloc from the `cmeel-mimalloc` wheel (a Linux dependency of Factory), or None where
    it is not installed."""
    from importlib import metadata

    try:
        dist = metadata.distribution("cmeel-mimalloc")
    except metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if re.search(r"/libmimalloc\.so\.\d+$", str(f)):  # the soname the wheel ships beside its aliases
            path = dist.locate_file(f)
            return str(path) if path.exists() else None
    return None


def mimalloc_missing() -> str | None:
    """Why mimalloc cannot be preloaded here, or None."""
    if not sys.platform.startswith("linux"):
        return f"mimalloc is preloaded only on Linux (this is {sys.platform})"
    if mimalloc_library() is None:
        return "the cmeel-mimalloc package is not installed (pip install cmeel-mimalloc)"
    return None


def allocator_env(setting: str, device: DeviceKind) -> dict[str, str]:
    """The environment a computing stage's processes (the update's, the rollout's, a local judge's) start with for
    `train.allocator` = `setting` on `device`: mimalloc preloaded, or nothing (the system's allocator). `auto`
    takes mimalloc on the CPU where it can (on CUDA the large tensors are the GPU's)."""
    if setting == "system" or (setting == "auto" and (device != "cpu" or mimalloc_missing() is not None)):
        return {}
    library = mimalloc_library()
    assert library is not None, "the compiler refuses allocator: mimalloc where it is missing"
    return {"LD_PRELOAD": library, **MIMALLOC_OPTIONS}


def running_allocator() -> str:
    """The allocator this process runs with: `mimalloc` when its library is mapped, else `system`."""
    try:
        with open("/proc/self/maps") as maps:
            return "mimalloc" if "libmimalloc" in maps.read() else "system"
    except OSError:  # not Linux
        return "system"
