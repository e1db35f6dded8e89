"""The update stage: the DeepSpeed learner in its own actor, timed."""
from __future__ import annotations

import time
from typing import Any

from factory.schema import Spec
from factory.types import Trajectory
from factory.util import enter_workdir, set_threads


class UpdateStage:
    """The update actor: the learner (a DeepSpeed engine) in its own process."""

    def __init__(self, spec: Spec, model_path: str, *, workdir: str | None = None):
        self.spec, self.model_path, self.workdir = spec, model_path, workdir

    def setup(self) -> dict[str, Any]:
        """Load the model into DeepSpeed; returns what was resolved on this device (for the run's params)."""
        enter_workdir(self.workdir)
        set_threads(self.spec.train.threads)
        from factory.update import Learner

        self.learner = Learner(self.spec, self.model_path)
        self.learner.setup()
        return {"resolved": self.learner.resolved()}

    def step(self, trajs: list[Trajectory]) -> dict[str, float]:
        t0 = time.perf_counter()
        stats = self.learner.step(trajs)
        stats["timing/update_s"] = time.perf_counter() - t0
        return stats

    def state_dict(self) -> dict[str, Any]:
        return self.learner.state_dict()

    def save_checkpoint(self, directory: str, step: int) -> str:
        return self.learner.save_checkpoint(directory, step)

    def load_checkpoint(self, directory: str) -> int | None:
        return self.learner.load_checkpoint(directory)

    def shutdown(self) -> None:
        self.learner.shutdown()
