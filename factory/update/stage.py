"""The update stage: the DeepSpeed learner in its own actor, one actor per rank, timed."""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

from factory.contract import Call, Contract, StageActor
from factory.plan import UpdateSettings
from factory.types import Placement, Trajectory
from factory.util import enter_workdir, node_id, resolve_file, set_threads


class UpdateStage(StageActor):
    """The update actor: one rank of the learner (a DeepSpeed engine).

    Worker group: the `replicas` of this stage are the ranks of one torch.distributed world (data
    parallel, ZeRO 1-3; gloo on CPU, nccl on CUDA). The driver asks rank 0 for a rendezvous `address`,
    then sets every rank up with it; every method reaches every rank alike (each rank receives the whole
    batch and trains on its shard) and rank 0's answer is the group's."""

    # every call reaches every rank: each rank trains on its shard and all take part in the collectives
    CONTRACT = Contract(calls={"step": Call("all"), "state_dict": Call("all"), "use_sync_dtype": Call("all")},
                        world=True, checkpoint=True)

    def __init__(self, settings: UpdateSettings):
        self.settings = settings
        self.learner: Any = None

    def address(self) -> tuple[str, int]:
        """Where rank 0 meets the others: this node's address and a port free on it now."""
        import socket

        import ray

        addr = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
            s.bind((addr, 0))
            return addr, s.getsockname()[1]

    def setup(self, placement: Placement | None = None) -> dict[str, Any]:
        placement = placement or Placement()
        enter_workdir(placement.workdir)
        set_threads(self.settings.train.threads)
        if placement.world_size > 1:
            # What a launcher (torchrun, `deepspeed`) would set. Ray gives each rank its own GPUs
            # (CUDA_VISIBLE_DEVICES), so within its process every rank is local rank 0.
            os.environ.update(MASTER_ADDR=placement.master_addr, MASTER_PORT=str(placement.master_port),
                              RANK=str(placement.rank), LOCAL_RANK="0", WORLD_SIZE=str(placement.world_size))
        from factory.update import Learner

        s = self.settings  # the chat template's text goes into saved hf/ folders
        template = resolve_file(s.chat_template, Path(s.base_dir)).read_text() if s.chat_template else None
        self.learner = Learner(s, chat_template=template)
        self.learner.setup()
        return {"node": node_id(), "rank": self.learner.rank, "world_size": self.learner.world,
                "algorithm": dataclasses.asdict(self.learner.alg), "resolved": self.learner.resolved()}

    def step(self, trajs: list[Trajectory]) -> dict[str, float]:
        t0 = time.perf_counter()
        stats = self.learner.step(trajs)
        stats["timing/update_s"] = time.perf_counter() - t0
        return stats

    def use_sync_dtype(self, dtype: str) -> dict[str, str]:
        """Weight syncs in `dtype`, what the rollout engine holds (factory.runtime.driver.agree_sync_dtypes); every
        rank (each casts its part under ZeRO-3). Returns what the learner now resolves."""
        return self.learner.use_sync_dtype(dtype)

    def state_dict(self, every_rank: bool = False) -> dict[str, Any] | None:
        """What a weight sync sends, on rank 0 (every rank takes part in gathering it under ZeRO-3): the
        weights in the rollout engine's dtype, or the LoRA adapters. Not copied where the learner can avoid
        it: Ray serialises the answer before this actor runs its next call."""
        from factory.types import Weights

        out = self.learner.state_dict(every_rank, copy=False)
        return Weights(out) if isinstance(out, dict) else out  # full weights cross Ray as arrays: see Weights

    def save_checkpoint(self, directory: str, step: int, state: dict[str, Any] | None = None) -> str:
        """The learner's checkpoint in the run's own folder `directory`, then `newest` beside it points
        there (factory.update.checkpoint.point_newest)."""
        from factory.update import checkpoint

        saved = self.learner.save_checkpoint(directory, step, state)
        if self.learner.rank == 0:
            checkpoint.point_newest(directory)
        return saved

    def load_checkpoint(self, directory: str, name: str | None = None) -> int | None:
        return self.learner.load_checkpoint(directory, name)

    def close(self) -> None:
        """Release the DeepSpeed engine and the process group (nothing to release before setup)."""
        if self.learner is not None:
            learner, self.learner = self.learner, None
            learner.shutdown()
