"""`factory export RUN [--step N] --out DIR`: a run's checkpoint as a Hugging Face folder.

Every committed checkpoint already holds one (`step_<N>/hf/`: config, model.safetensors, tokenizer with the
run's chat template, generation config), written at save time from the full weights, gathered from the
ranks' shards under ZeRO-3, so it is the same for every ZeRO stage. Export finds the run's checkpoint,
checks that the folder is whole, and copies it to DIR atomically (a staging folder renamed into place): the
result loads with `AutoModelForCausalLM.from_pretrained(DIR)` and serves with `vllm serve DIR`, and
`tokenizer.apply_chat_template` formats chats as the run did. No torch is imported: it is a copy.

RUN is an MLflow run id (the run's tags name its checkpoint folder) or a path: a checkpoint directory
(`train.checkpoint_dir`, holding `latest` and `step_<N>/`) or one step's folder.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from factory.update.checkpoint import HF, complete, read_latest, tag
from factory.util import UserError

CHECKPOINT_DIR_TAG = "factory.checkpoint_dir"  # the run's train.checkpoint_dir, absolute (set by the driver)
CHECKPOINT_TAG = "factory.checkpoint"  # the newest checkpoint's folder (set as each one is committed)
# What a Hugging Face folder must hold to load and serve (tokenizer.json or the slow tokenizer's files).
REQUIRED = ("config.json", "tokenizer_config.json")


class ExportError(UserError):
    """The run or step has no checkpoint to export, or DIR is in the way; the message says which."""


def checkpoint_dir(run: str, uri: str | None = None) -> Path:
    """The checkpoint directory of RUN: a path as given, else the folder an MLflow run's tags name."""
    path = Path(run).expanduser()
    if path.is_dir():
        return path
    from factory.tracking.tracker import RunLookupError, open_tracker

    tracker = open_tracker(uri)
    try:
        tags = tracker.run(run).tags
    except RunLookupError:
        raise ExportError(f"'{run}' is neither a checkpoint folder nor an MLflow run id in {tracker.uri}") from None
    if CHECKPOINT_DIR_TAG in tags:
        return Path(tags[CHECKPOINT_DIR_TAG])
    if CHECKPOINT_TAG in tags:
        return Path(tags[CHECKPOINT_TAG]).parent
    raise ExportError(f"run {run} recorded no checkpoint folder (it saved no checkpoint, or its checkpoint_dir came "
                      "from the environment): pass the checkpoint folder instead")


def hf_folder(root: Path, step: int | None = None) -> Path:
    """The `hf/` folder of step N (default: the one `latest` names) under a checkpoint directory, or of a
    step folder given directly."""
    if (root / HF).is_dir() and step is None:
        return root / HF
    name = tag(step) if step is not None else read_latest(root)
    if name is None:
        raise ExportError(f"{root} holds no complete checkpoint (no `latest` marker)")
    folder = root / name / HF
    if not folder.is_dir():
        have = ", ".join(complete(root)) or "none"
        raise ExportError(f"{root} has no checkpoint {name}; complete checkpoints: {have}")
    missing = [f for f in REQUIRED if not (folder / f).is_file()]
    if missing or not any(folder.glob("*.safetensors")):
        raise ExportError(f"{folder} is not a whole Hugging Face folder (missing {', '.join(missing) or 'weights'})")
    return folder


def export(run: str, out: str | os.PathLike, step: int | None = None, uri: str | None = None) -> Path:
    """Copy the run's checkpoint (step N, default the newest) to `out` as a Hugging Face folder."""
    source = hf_folder(checkpoint_dir(run, uri), step)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not empty: choose a new folder (nothing is overwritten)")
    staging = out.with_name(f".{out.name}.exporting")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging)
    if out.exists():
        out.rmdir()  # the empty folder the user made
    os.replace(staging, out)
    return source


def main(args) -> int:
    source = export(args.run, args.out, args.step, args.uri)
    print(f"exported {source} -> {args.out}\n"
          f"  transformers: AutoModelForCausalLM.from_pretrained({str(args.out)!r})\n"
          f"  vLLM:         vllm serve {args.out}")
    return 0
