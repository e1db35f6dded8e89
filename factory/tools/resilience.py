"""Retry backoff and the circuit breaker: how a server's failures are paced.

Both are small and clock-injectable so tests can drive them without sleeping.
"""
from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Resilience:
    """Knobs the spec does not expose (yet); the defaults suit local servers that start in ~1 s."""

    backoff_base_s: float = 0.1
    """First retry waits about this long; each further retry doubles it."""
    backoff_max_s: float = 2.0
    """No retry waits longer than this."""
    breaker_threshold: int = 3
    """Consecutive server failures (crash, lost connection, failed start) that open the circuit."""
    breaker_cooldown_s: float = 5.0
    """How long an open circuit answers every call with `circuit_open` before one probe call goes through."""
    hung_after: int = 3
    """Calls in a row that a server left unanswered past their timeout, each with no answer to any call while it
    waited, after which it is taken as hung (alive, its pipes open, answering nothing: a deadlock) and restarted.
    A server busy with other calls (one that serves one call at a time) is not: it answers some."""


def backoff_delay(attempt: int, base_s: float, max_s: float, rng: Callable[[], float] = random.random) -> float:
    """Seconds to wait before retry number `attempt` (0-based): exponential, capped, with half jitter.

    The jitter keeps many trajectories whose calls failed together (a server crash) from retrying in
    lockstep; half of the delay stays fixed so a retry never comes back immediately.
    """
    delay = min(max_s, base_s * (2**attempt))
    return delay * (0.5 + 0.5 * rng())


BreakerState = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    """Stops calls to a server that keeps failing, then lets one probe through after a cooldown.

    Only server-level failures count (a crash, a lost connection, a start that failed), each once:
    a crash that fails twenty in-flight calls is one failure. A timeout does not count: the server
    is alive, that one call was slow. Any completed call (even a tool error) closes the circuit.
    """

    def __init__(self, threshold: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._failures = 0
        self._opened_at: float | None = None
        self._probing = False

    @property
    def state(self) -> BreakerState:
        if self._opened_at is None:
            return "closed"
        if self._probing or self._clock() - self._opened_at >= self.cooldown_s:
            return "half_open"
        return "open"

    def allow(self) -> bool:
        """May a call go to the server now? In half-open, only the first caller (the probe) may."""
        state = self.state
        if state == "closed":
            return True
        if state == "half_open" and not self._probing:
            self._probing = True
            return True
        return False

    def record_success(self) -> None:
        self._failures = 0
        self._opened_at = None
        self._probing = False

    def record_failure(self) -> bool:
        """Count one server failure; True when this failure opened (or re-opened) the circuit."""
        self._failures += 1
        if self._probing or (self._opened_at is None and self._failures >= self.threshold):
            self._opened_at = self._clock()
            self._probing = False
            return True
        return False

    def release_probe(self) -> None:
        """The probe ended without telling whether the server works (e.g. it timed out): allow another."""
        self._probing = False
