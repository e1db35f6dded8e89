"""Every wait of the driver on a stage has an end. A stage that never answers -- a hung tool server it
waits on without a timeout, a deadlock in an engine, a GPU that stopped -- would otherwise hold the run
forever with nothing said.

The deadline of a call comes from how long calls of its kind (stage and method) took before: at most
`FACTOR` times the longest one so far, at least `FLOOR_S`; the first call of a kind (start-up, the first
step, which may compile kernels) gets `train.stage_timeout_s`, which also caps every later deadline. A call
that reports progress (the rollout's trajectories done, a stream's groups) resets its clock whenever it
makes some: a heartbeat. Past the deadline the run fails with StageTimeout, naming the stage, the method,
the step and what it had done.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from factory.runtime.health import RESUME_SAID, InfraFailure

FACTOR = 5.0  # a call may take this many times the longest call of its kind so far ...
FLOOR_S = 120.0  # ... but never less than this (steps vary: eval steps, longer answers, a busy machine)
POLL_S = 0.5  # how often a wait looks at the stage's progress


class StageTimeout(InfraFailure):
    """A stage did not answer within its deadline: the message says which, doing what, for how long. An
    infrastructure failure (`factory run` exits 3 with the message), not a bug of Factory's."""


@dataclass
class Deadlines:
    limit_s: float = 1800.0  # train.stage_timeout_s: the first call of a kind, and the cap of every deadline
    longest: dict[str, float] = field(default_factory=dict)  # kind -> the longest call of it so far (s)
    again: str = RESUME_SAID  # how the work is taken up after a stage hung (an evaluation's: run it again)

    def budget(self, kind: str) -> float:
        seen = self.longest.get(kind)
        return self.limit_s if seen is None else min(self.limit_s, max(FLOOR_S, FACTOR * seen))

    def took(self, kind: str, seconds: float) -> None:
        self.longest[kind] = max(self.longest.get(kind, 0.0), seconds)

    def get(self, refs: list[Any], kind: str, doing: str = "",
            progress: Callable[[], Any] | None = None, since: float | None = None) -> list[Any]:
        """`ray.get(refs)` within the deadline of `kind` ("stage.method"). `progress()`, when given, is
        polled every POLL_S; a change of its value is a heartbeat (the clock starts again) and its last
        value goes in the message. `since` (time.monotonic()): when the call was made, where that was before
        this wait (an update run behind the next rollout): the clock and the call's recorded length start
        there, not at the wait (whose length, ~0 for an update done meanwhile, set a 120 s deadline that the
        next full wait on a longer update then broke)."""
        start = last_beat = time.monotonic() if since is None else since
        budget, beat, pending = self.budget(kind), None, list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S, fetch_local=False)
            if ready:
                ray.get(ready)  # a replica that raised fails the call at once, not once the others are done
            if not pending:
                break
            if progress is not None:
                now = progress()
                if now != beat:
                    beat, last_beat = now, time.monotonic()
            if time.monotonic() - last_beat > budget:
                self.fail(kind, doing, time.monotonic() - start, budget, beat)
        answers = ray.get(list(refs))
        self.took(kind, time.monotonic() - start)
        return answers

    def fail(self, kind: str, doing: str, waited: float, budget: float, beat: Any = None) -> None:
        stage, _, method = kind.partition(".")
        seen = self.longest.get(kind)
        why = (f"{FACTOR:g} x its longest call so far, {seen:.1f} s" if seen is not None and budget < self.limit_s
               else "train.stage_timeout_s")
        state = f"; its last progress: {beat}" if beat is not None else ""
        # what stalls a scoring call: not the engine (a CPU-bound function stops the stage's own clocks)
        causes = ("a reward function that holds the CPU without letting go of Python's lock -- a runaway regular "
                  "expression, a loop in C code -- stops the stage's clocks, so its node's timeout_s cannot fire: "
                  "give its node `processes: 1` or more, where a call past timeout_s ends its process"
                  if method == "score" else "a hung tool server, a stalled engine")
        raise StageTimeout(f"stage '{stage}' did not answer {method}{f' ({doing})' if doing else ''} within "
                           f"{budget:.0f} s ({why}); waited {waited:.0f} s{state}. The run stops: look at that "
                           f"stage's log above ({causes}); {self.again}")
