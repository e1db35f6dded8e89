"""Checkpoint layout, how a checkpoint is committed atomically, which ones are kept, and the RNG state a
resumed run needs.

Each run has a folder of its own under `train.checkpoint_dir`, named after the run and its MLflow id
(`run_folder`), so runs of one spec, at once or one after another, never replace or prune each other's
checkpoints; `<checkpoint_dir>/newest` links to the folder of the run that saved last (`point_newest`).
Layout of a run's folder:

    <dir>/
      latest                      text "step_<N>": the newest COMPLETE checkpoint
      step_<N>/                   DeepSpeed engine.save_checkpoint: model, optimizer (ZeRO-partitioned when
                                  ZeRO >= 1), and client state {step, rng}
        mp_rank_00_model_states.pt, *optim_states.pt, ...   (DeepSpeed's own files)
        run_state.json            what the driver needs to continue: data position, MLflow run id, ...
        manifest.json             every other file's size and sha256, written last: `verify` checks them
        hf/                       Hugging Face folder: config, model.safetensors, tokenizer with the run's
                                  chat template; `AutoModelForCausalLM.from_pretrained(<dir>/step_<N>/hf)`
        adapter/                  instead of hf/ in a LoRA run (model.lora): peft's adapter folder
                                  (adapter_config.json naming the base model's folder, adapter_model.safetensors)
                                  and the tokenizer; the DeepSpeed files hold the adapters and their optimizer
                                  state only (the frozen weights are the model folder's)
      step_<M>/ ...
      .incomplete-step_<K>/       a save in progress, or one that failed or was interrupted (removed when the
                                  next save starts)

A save writes everything into `.incomplete-step_<N>/`, writes the manifest, fsyncs every file and folder
in it, renames that folder to `step_<N>/` (one atomic rename on POSIX), fsyncs the parent, then rewrites
`latest` (write + fsync + rename). A run killed at any moment leaves `latest` naming a complete
checkpoint: the previous one until the rename, the new one after it; and a power cut cannot leave a
committed name over files the disk never received. What the disk lost anyway (a bad sector, a copy cut
short) `verify` finds, and `--resume` falls back to the run's previous checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

from factory.util import fsync_path

LATEST = "latest"
HF = "hf"  # the Hugging Face folder inside each checkpoint
ADAPTER = "adapter"  # a LoRA run's checkpoint holds peft's adapter folder instead (with the tokenizer)
RUN_STATE = "run_state.json"
MANIFEST = "manifest.json"
INCOMPLETE = ".incomplete-"
_STEP = re.compile(r"^step_(\d+)$")


def tag(step: int) -> str:
    return f"step_{step}"


def staging(directory: str | os.PathLike, name: str) -> str:
    """The tag a save writes under before it is committed (`.incomplete-step_<N>`)."""
    return INCOMPLETE + name


def read_latest(directory: str | os.PathLike) -> str | None:
    """The tag named by `<dir>/latest`, or None when there is no checkpoint (yet)."""
    path = Path(directory) / LATEST
    if not path.is_file():
        return None
    name = path.read_text().strip()
    return name or None


def write_latest(directory: str | os.PathLike, name: str) -> None:
    path = Path(directory) / LATEST
    tmp = path.with_name(f".{LATEST}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic on POSIX: readers see the old marker or the new one


def clear_staging(directory: str | os.PathLike, name: str) -> Path:
    """An empty `.incomplete-<name>/`, the only staging folder left: whatever earlier saves that failed or were
    interrupted left, at any step, is removed first. A save that failed on a full disk left GBs there, and the
    resumed run's next save (another step) kept them and could fill the disk again; nothing reads them (a
    resume reads committed `step_<N>/` folders only, `complete`)."""
    _sweep_staging(directory)
    path = Path(directory) / staging(directory, name)
    path.mkdir(parents=True)
    return path


def _sweep_staging(directory: str | os.PathLike) -> list[str]:
    """Remove every `.incomplete-*` of `directory`; returns their names."""
    directory = Path(directory)
    names = [e.name for e in directory.iterdir() if e.name.startswith(INCOMPLETE)] if directory.is_dir() else []
    for name in names:
        shutil.rmtree(directory / name, ignore_errors=True)
    return names


def readable(folder: str | os.PathLike) -> None:
    """Every file under `folder` with the mode a new file gets here (0644 under the usual umask 022):
    transformers writes model.safetensors through a private temporary file, 0600, which another user or a
    serving container could not read."""
    umask = os.umask(0)
    os.umask(umask)
    for path in Path(folder).rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~umask)


def run_folder(root: str | os.PathLike, run_name: str, run_id: str) -> Path:
    """A run's own checkpoint folder under `train.checkpoint_dir`: its name and id prefix, unique even for
    two runs of one spec started in the same second."""
    return Path(root) / f"{run_name}-{run_id[:8]}"


NEWEST = "newest"  # beside the runs' folders: a link to the folder of the run that saved a checkpoint last


def point_newest(run_dir: str | os.PathLike) -> None:
    """`<checkpoint_dir>/newest` -> this run's folder (replaced atomically): a stable path to the last
    saved model of a spec (`runs/quickstart/newest/step_5/hf`), which no run's checkpoints depend on."""
    run_dir = Path(run_dir)
    link, tmp = run_dir.parent / NEWEST, run_dir.parent / f".{NEWEST}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(run_dir.name, target_is_directory=True)
    os.replace(tmp, link)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: str | os.PathLike) -> None:
    """`manifest.json`: each file of the checkpoint (relative path) with its size and sha256."""
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def verify(folder: str | os.PathLike, manifested: bool = False) -> str | None:
    """Why a committed checkpoint cannot be trusted (a file missing, cut short or changed since it was
    saved), or None when every file matches its manifest. One saved before manifests existed (2026-12-01)
    has none, and is taken as it is; but where the run's other checkpoints have one (`manifested`), its own
    was lost since (taken as it was, a weights file cut short failed the resume as an internal error)."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not folder.is_dir():
        return f"{folder} is missing"
    if not path.is_file():
        return (f"{path} is missing, where the run's other checkpoints have theirs: its files cannot be checked"
                if manifested else None)
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return f"{path}: unreadable ({e})"
    for rel, want in manifest.items():
        f = folder / rel
        if not f.is_file():
            return f"{f} is missing"
        size = f.stat().st_size
        if size != want["size"]:
            return f"{f} holds {size} bytes, {want['size']} were saved"
        if _sha256(f) != want["sha256"]:
            return f"{f} differs from what was saved (sha256)"
    return None


def fsync_tree(folder: str | os.PathLike) -> None:
    """Every file and folder under `folder` (and itself) on disk, before a rename makes it visible."""
    folder = Path(folder)
    for path in sorted(folder.rglob("*"), key=lambda p: -len(p.parts)):  # files before their folders
        if path.is_file() or path.is_dir():
            fsync_path(path)
    fsync_path(folder)


def commit(directory: str | os.PathLike, name: str, keep: int | None = None) -> Path:
    """Make the staged checkpoint `name` the newest: rename `.incomplete-<name>/` to `<name>/` (replacing an
    older checkpoint of the same step, which a resumed run may write again), point `latest` at it, then
    keep only the newest `keep` checkpoints. Returns the checkpoint's folder."""
    directory = Path(directory)
    final = directory / name
    staged = directory / staging(directory, name)
    write_manifest(staged)
    fsync_tree(staged)  # the files reach the disk before the name that says they are complete
    if final.exists():  # move it aside first: rename cannot replace a non-empty folder
        old = directory / staging(directory, name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        if read_latest(directory) == name:
            # `latest` must never name a missing folder: a crash right here would otherwise leave none
            previous = [n for n in complete(directory) if n != name]
            if previous:
                write_latest(directory, previous[-1])
        os.replace(directory / staging(directory, name), final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(directory / staging(directory, name), final)
    fsync_path(directory)  # the rename durable: a power cut after it must not bring the old name back
    write_latest(directory, name)
    prune(directory, keep)
    return final


def manifested(directory: str | os.PathLike, names: list[str] | None = None) -> bool:
    """Whether a run's checkpoints (`names` in `directory`, default its `complete` ones) keep manifests: then one
    without its own lost it (`verify`'s `manifested`); a run saved before manifests existed has none."""
    names = complete(directory) if names is None else names
    return any((Path(directory) / name / MANIFEST).is_file() for name in names)


def complete(directory: str | os.PathLike) -> list[str]:
    """The committed checkpoints of a directory, oldest first."""
    found = []
    for entry in Path(directory).iterdir() if Path(directory).is_dir() else []:
        m = _STEP.match(entry.name)
        if m and entry.is_dir():
            found.append((int(m.group(1)), entry.name))
    return [name for _, name in sorted(found)]


def prune(directory: str | os.PathLike, keep: int | None) -> list[str]:
    """Delete all but the newest `keep` checkpoints (the one `latest` names is always kept) and whatever
    interrupted saves left behind; returns the names deleted."""
    directory = Path(directory)
    latest = read_latest(directory)
    names = complete(directory)
    doomed = [n for n in names[: max(len(names) - keep, 0)] if n != latest] if keep else []
    for name in doomed:
        shutil.rmtree(directory / name, ignore_errors=True)
    return doomed + _sweep_staging(directory)


def write_run_state(folder: str | os.PathLike, state: dict[str, Any]) -> None:
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / RUN_STATE).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")


def read_run_state(folder: str | os.PathLike) -> dict[str, Any]:
    path = Path(folder) / RUN_STATE
    return json.loads(path.read_text()) if path.is_file() else {}


def rng_state() -> dict[str, Any]:
    """Every RNG the update stage draws from (torch CPU/CUDA, python's random); tensors and plain
    python values only, so DeepSpeed's torch.load reads it back."""
    import torch  # (here: `factory export` reads this module's layout and copies, with no torch)

    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
