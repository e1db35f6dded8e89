"""A run's tracking records on local disk until the tracking store has them.

Every record the driver makes (a step's metrics, a trajectory table, a tag, a small text artifact) is first
appended to `journal.jsonl` in the run's own folder (tables are copied beside it), then sent, in order;
`sent` holds the number of the last record the store acknowledged. While the store cannot be reached the
records wait here and the run goes on; the next record, or the end of the run, sends what waits first. A
driver killed with records unsent leaves them here, and `--resume` sends them before anything new.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from factory.util import fsync_path

JOURNAL, SENT, FILES = "journal.jsonl", "sent", "files"


class Spool:
    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.sent = _read_sent(self.folder / SENT)
        self.records: list[dict[str, Any]] = []  # not yet sent, oldest first
        journal = self.folder / JOURNAL
        self.last = self.sent  # numbers go on from the last record ever sent
        if journal.is_file():
            _cut_torn_line(journal)
            for line in journal.read_text().splitlines():
                try:
                    record = json.loads(line)
                except ValueError:  # the line a kill cut short: it was never acknowledged to anyone
                    continue
                self.last = max(self.last, record["seq"])
                if record["seq"] > self.sent:
                    self.records.append(record)

    def add(self, kind: str, file: str | os.PathLike | None = None, **fields: Any) -> dict[str, Any]:
        """Append a record (with a copy of `file`, whose name is kept) to the journal, on disk at once."""
        self.last += 1
        record = {"seq": self.last, "kind": kind, **fields}
        if file is not None:
            keep = self.folder / FILES / str(self.last) / Path(file).name
            keep.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(file, keep)
            fsync_path(keep)  # on disk before the journal names it: a power cut must not leave a named, empty table
            fsync_path(keep.parent)
            record["file"] = str(keep.relative_to(self.folder))
        journal = self.folder / JOURNAL
        before = journal.stat().st_size if journal.exists() else 0
        try:
            with open(journal, "a") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            # (a full disk: the line may have landed before its flush failed; the caller sends the record
            # itself, so a later driver must not find it here and send it again)
            with contextlib.suppress(OSError):
                os.truncate(journal, before)
            raise
        self.records.append(record)
        return record

    def path(self, record: dict[str, Any]) -> Path:
        return self.folder / record["file"]

    def done(self, record: dict[str, Any]) -> None:
        """The store has `record`: never send it again."""
        self.records.remove(record)
        # every record up to `sent` is done: the oldest still waiting bounds it
        self.sent = self.records[0]["seq"] - 1 if self.records else max(self.sent, record["seq"])
        try:
            tmp = self.folder / f".{SENT}.tmp"
            tmp.write_text(str(self.sent))
            fsync_path(tmp)
            os.replace(tmp, self.folder / SENT)
        except OSError:  # a full or read-only disk: sent all the same; a later driver may send it again (a step's
            pass  # metrics it holds already are not: Tracker.open_spool), which is better than stopping the run
        if "file" in record:
            shutil.rmtree(self.path(record).parent, ignore_errors=True)
        if not self.records:  # all sent: start the journal afresh (it only ever holds what waits)
            with contextlib.suppress(OSError):  # (a read-only disk: its records are sent, as above)
                (self.folder / JOURNAL).unlink(missing_ok=True)


def _read_sent(path: Path) -> int:
    """The number of the last record the store acknowledged; 0 when none was, or when the file is not a number
    (written before its data reached the disk): the records are sent again, and the tracker's resume skips
    what the store already has (a step's metrics are not logged twice)."""
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return 0


def _cut_torn_line(journal: Path) -> None:
    """Drop a last line a kill or a full disk cut short (no newline: never acknowledged to anyone). Left in place,
    the next record was appended to it and the two read as one unreadable line: that record was lost."""
    data = journal.read_bytes()
    whole = data.rfind(b"\n") + 1
    if whole < len(data):
        with open(journal, "r+b") as f:
            f.truncate(whole)
            os.fsync(f.fileno())
