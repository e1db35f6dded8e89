"""The data-prep stage: a seeded, epoch-shuffled stream of training batches and a fixed eval batch."""
from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import pyarrow as pa

from factory.contract import Call, Contract, StageActor
from factory.data.sources import (
    EVAL_SEED_OFFSET,
    DataError,
    PromptRenderer,
    check_rows,
    held_out,
    read_source,
    to_table,
)
from factory.plan import DataSettings
from factory.types import Placement
from factory.util import enter_workdir, node_id

log = logging.getLogger(__name__)


class DataStage(StageActor):
    """The data-prep stage: an endless, seeded, epoch-shuffled stream of training batches and a fixed eval
    batch. Holds everything in memory: RL prompt sets are small next to the model."""

    CONTRACT = Contract(calls={"next_batch": Call("one"), "eval_batch": Call("one")}, state=True)

    def __init__(self, settings: DataSettings):
        self._spec, self._seed, self._eval_size = settings.data, settings.seed, settings.eval_size
        self._base_dir = Path(settings.base_dir)
        self._required = dict(settings.required_columns)  # column -> who needs it, checked on every row
        self._valued = settings.valued_columns  # of those, a reward function's parameters: not null either
        self._rows: list[dict[str, Any]] = []
        self._order: list[int] = []
        self._epoch = 0
        self._cursor = 0

    def setup(self, placement: Placement | None = None) -> dict[str, Any]:
        enter_workdir((placement or Placement()).workdir)
        self._renderer = PromptRenderer(self._spec, self._base_dir)
        # Every row is checked here, before any training step: a bad row 3,000 rows in would otherwise stop
        # the run when an epoch first reaches it.
        self._rows, origins = read_source(self._spec.train, seed=self._seed, base_dir=self._base_dir)
        if not self._rows:
            raise DataError("data.train produced no rows")
        check_rows(self._rows, origins, self._renderer, self._required, valued=self._valued)
        self._eval, dropped = [], 0
        if self._spec.eval:
            self._eval, origins = read_source(self._spec.eval, seed=self._seed + EVAL_SEED_OFFSET,
                                              base_dir=self._base_dir)
            # Held out against the whole split, not only eval_size's first rows: which rows train does not
            # depend on how many are evaluated (a `factory eval` of the run may evaluate them all).
            kept = held_out(self._rows, self._eval, self._renderer)
            if self._eval_size is not None:
                self._eval, origins = self._eval[: self._eval_size], origins[: self._eval_size]
            check_rows(self._eval, origins, self._renderer, self._required, valued=self._valued)
            if not kept:
                raise DataError(f"data.train: each of its {len(self._rows)} rows has a prompt that data.eval also "
                                f"has, and eval prompts are held out of training: no training rows are left")
            dropped = len(self._rows) - len(kept)
            if dropped:
                log.warning("%d training rows dropped: their prompt is in the eval split (data.eval is held out "
                            "of training)", dropped)
            self._rows = kept
        self._reshuffle()
        return {"node": node_id(), "train_rows": len(self._rows), "eval_rows": len(self._eval),
                "train_rows_dropped": dropped}

    def _reshuffle(self) -> None:
        self._order = list(range(len(self._rows)))
        if self._spec.shuffle:
            random.Random(self._seed * 7919 + self._epoch).shuffle(self._order)
        self._cursor = 0

    def next_batch(self, n: int) -> pa.Table:
        rows = []
        while len(rows) < n:
            if self._cursor >= len(self._order):
                self._epoch += 1
                self._reshuffle()
            rows.append(self._rows[self._order[self._cursor]])
            self._cursor += 1
        return to_table(self._renderer, rows)

    def eval_batch(self) -> pa.Table | None:
        return to_table(self._renderer, self._eval) if self._eval else None

    def state(self) -> dict[str, int]:
        """Position in the stream, saved with checkpoints so a resumed run sees the same data."""
        return {"epoch": self._epoch, "cursor": self._cursor}

    def restore(self, state: dict[str, int]) -> None:
        self._epoch = state["epoch"]
        self._reshuffle()
        self._cursor = state["cursor"]
