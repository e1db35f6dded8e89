"""The update stage: the DeepSpeed learner in its own actor, timed."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from factory.schema import Spec
from factory.types import Trajectory
from factory.util import enter_workdir, resolve_file, set_threads


class UpdateStage:
    """The update actor: the learner (a DeepSpeed engine) in its own process."""

    def __init__(self, spec: Spec, model_path: str, *, workdir: str | None = None, base_dir: str | None = None):
        self.spec, self.model_path, self.workdir, self.base_dir = spec, model_path, workdir, base_dir

    def setup(self) -> dict[str, Any]:
        """Load the model into DeepSpeed; returns what was resolved on this device (for the run's params)."""
        enter_workdir(self.workdir)
        set_threads(self.spec.train.threads)
        from factory.update import Learner

        template = (resolve_file(self.spec.chat_template, Path(self.base_dir) if self.base_dir else None).read_text()
                    if self.spec.chat_template else None)
        self.learner = Learner(self.spec, self.model_path, chat_template=template)
        self.learner.setup()
        return {"resolved": self.learner.resolved()}

    def step(self, trajs: list[Trajectory]) -> dict[str, float]:
        t0 = time.perf_counter()
        stats = self.learner.step(trajs)
        stats["timing/update_s"] = time.perf_counter() - t0
        return stats

    def state_dict(self) -> dict[str, Any]:
        return self.learner.state_dict()

    def save_checkpoint(self, directory: str, step: int, state: dict[str, Any] | None = None) -> str:
        return self.learner.save_checkpoint(directory, step, state)

    def load_checkpoint(self, directory: str, name: str | None = None) -> int | None:
        return self.learner.load_checkpoint(directory, name)

    def shutdown(self) -> None:
        self.learner.shutdown()
