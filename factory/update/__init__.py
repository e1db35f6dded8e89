"""The update stage: advantages, policy loss and optimizer steps on a DeepSpeed engine; checkpoints.

`Learner` is what the update actor drives (factory.update.stage.UpdateStage); the modules below it are
pure pieces: `batch` (trajectories -> tensors and the update plan), `logprobs` (response log-probs),
`engine` (DeepSpeed config, process group, precision), `checkpoint` (layout and the `latest` marker).
"""
from factory.update.learner import Learner

__all__ = ["Learner"]
