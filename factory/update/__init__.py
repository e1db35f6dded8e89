"""The update stage: advantages, policy loss and optimizer steps on a DeepSpeed engine; checkpoints.

`Learner` is what the update actor drives (factory.update.stage.UpdateStage); the modules below it are
pure pieces: `batch` (trajectories -> tensors and the update plan), `logprobs` (response log-probs),
`engine` (DeepSpeed config, process group, precision), `checkpoint` (layout and the `latest` marker).

`Learner` is imported on first use (PEP 562): the compiler imports the stage's actor class to check its
contract, and that must not cost a torch import.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from factory.update.learner import Learner

__all__ = ["Learner"]


def __getattr__(name: str) -> Any:
    if name == "Learner":
        from factory.update.learner import Learner

        return Learner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
