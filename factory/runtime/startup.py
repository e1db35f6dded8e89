"""Time to first step: from the command's start to the first rollout request, cut into phases.

A user iterating on a spec waits this long before step 1 begins; `timing/startup_s` records it with the
run (at step 0), `timing/startup/<phase>_s` its phases, and the display prints them in one line. It is
logged as the first rollout request goes out, so a run stopped during its first evaluation has it too. A
resumed session logs its own at the first step it logs (the one after the run's last logged step), so the
metric's history holds one start-up per session.

The clock is wall time (`time.time()`), because the command's start is the process's creation, which the
CLI reads from the OS (`process_started`): Python's own start-up and the imports count, as a user waits
for them too.
"""
from __future__ import annotations

import os
import time

# The phases, in order (each runs from the end of the one before):
#   command   process start -> the driver: Python, imports, loading and compiling the spec
#   store     the tracking store opened and the run replay.run names read from it (where that read is a fresh
#             sqlite store's first, its tables made); the store's own preparing goes on in a thread after
#   models    building built-in models into the cache (first use only)
#   ray       ending what a killed run left behind (its Ray: before the models), and starting (or joining) Ray
#   stages    starting every stage's actors and their setup (engines, tool servers, DeepSpeed)
#   tracking  the MLflow run: params, plan and tool listings logged
#   restore   a resumed run's checkpoint loaded and its weights synced
PHASES = ("command", "store", "models", "ray", "stages", "tracking", "restore")


def process_started() -> float:
    """When this process was created (epoch seconds), or now if the OS does not say."""
    try:
        import psutil  # a dependency of Ray's

        return psutil.Process(os.getpid()).create_time()
    except Exception:  # noqa: BLE001 -- any failure: count from now
        return time.time()


class Startup:
    """Laps of the start-up: `lap(phase)` ends a phase at now; `stage_ready(name)` notes when a stage's
    setup finished (they start together, so those overlap and are not phases)."""

    def __init__(self, started_at: float | None = None, clock=time.time):
        self._clock = clock
        self.t0 = started_at if started_at is not None else clock()
        self._last = self.t0
        self.phases: dict[str, float] = {}
        self.stages: dict[str, float] = {}  # stage -> seconds from the start of the `stages` phase to ready
        self.finished: float | None = None

    def lap(self, phase: str) -> None:
        assert phase in PHASES, phase
        now = self._clock()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now

    def stage_ready(self, name: str, seconds: float) -> None:
        self.stages[name] = seconds

    def finish(self) -> dict[str, float]:
        """The first rollout request is being sent: the start-up is over. Its metrics."""
        self.finished = self._clock()
        return self.metrics()

    @property
    def total_s(self) -> float:
        return (self.finished if self.finished is not None else self._last) - self.t0

    def metrics(self) -> dict[str, float]:
        out = {"timing/startup_s": self.total_s}
        out.update({f"timing/startup/{p}_s": self.phases[p] for p in PHASES if p in self.phases})
        out.update({f"timing/startup/stage_{name}_s": s for name, s in self.stages.items()})
        return out

    def describe(self) -> str:
        """One line: 'start-up 38.4 s to the first rollout request: command 6.1 s, store 0.2 s, ray 4.3 s, stages
        22.0 s (tools 1.2, update 9.8, rollout 18.3 ready), tracking 3.2 s'."""
        parts = []
        for p in PHASES:
            if p not in self.phases:
                continue
            text = f"{p} {self.phases[p]:.1f} s"
            if p == "stages" and self.stages:
                ready = ", ".join(f"{n} {s:.1f}" for n, s in sorted(self.stages.items(), key=lambda kv: kv[1]))
                text += f" ({ready} ready)"
            parts.append(text)
        rest = self.total_s - sum(self.phases.values())
        if rest >= 0.05:
            parts.append(f"other {rest:.1f} s")
        return f"start-up {self.total_s:.1f} s to the first rollout request: " + ", ".join(parts)
