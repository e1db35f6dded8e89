"""`factory export RUN [--step N] [--adapter] --out DIR`: a run's checkpoint as a Hugging Face folder.

Every committed checkpoint already holds one (`step_<N>/hf/`: config, model.safetensors, tokenizer with the
run's chat template, generation config), written at save time from the full weights, gathered from the
ranks' shards under ZeRO-3, so it is the same for every ZeRO stage. Export finds the run's checkpoint,
checks that the folder is whole, and copies it to DIR atomically (a staging folder renamed into place): the
result loads with `AutoModelForCausalLM.from_pretrained(DIR)` and serves with `vllm serve DIR`, and
`tokenizer.apply_chat_template` formats chats as the run did. It is a copy: no torch is imported.

A LoRA run (`model.lora`) checkpoints peft's adapter folder instead (`step_<N>/adapter/`: the adapters,
a config naming the base model's folder, the tokenizer). Export then merges the adapters into the base
model's weights (peft's `merge_and_unload`: torch, and the base model loaded in memory) and writes the
same kind of folder a full run gives; with `--adapter` it copies the adapter folder (no torch), which
`PeftModel.from_pretrained(base, DIR)` loads (and vLLM serves with `--enable-lora`).

RUN is an MLflow run id (the run's tags name its own checkpoint folder, so runs of one spec never export
each other's weights) or a path: a run's checkpoint folder (holding `latest` and `step_<N>/`), one
step's folder, or train.checkpoint_dir (the runs' folders, and `newest`: the run that saved last). A
checkpoint whose files differ from its manifest (factory.update.checkpoint.verify) is refused.
"""
from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

from factory.update.checkpoint import (
    ADAPTER,
    HF,
    LATEST,
    NEWEST,
    complete,
    manifested,
    read_latest,
    readable,
    tag,
    verify,
)
from factory.util import UserError

CHECKPOINT_DIR_TAG = "factory.checkpoint_dir"  # the run's own checkpoint folder, absolute (set by the tracker)
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
    from factory.tracking.tracker import RunLookupError, StoreUnreadable, open_tracker, reading

    try:
        tracker = open_tracker(uri, read=True)
        with reading(tracker.uri):  # (a store that goes down after it answered: exit 3, as one down from the start)
            tags = tracker.run(run).tags
    except StoreUnreadable:  # the store could not be read: infrastructure (exit 3), as it is
        raise
    except RunLookupError as e:  # none by that id, prefix or name, or several: its own words say which
        raise ExportError(f"'{run}' is not a checkpoint folder, and {e}") from None
    if CHECKPOINT_DIR_TAG in tags:
        return Path(tags[CHECKPOINT_DIR_TAG])
    if CHECKPOINT_TAG in tags:
        return Path(tags[CHECKPOINT_TAG]).parent
    raise ExportError(f"run {run} recorded no checkpoint folder (it saved no checkpoint, or its checkpoint_dir came "
                      "from the environment): pass the checkpoint folder instead")


def step_folder(root: Path, step: int | None = None) -> Path:
    """The folder of step N (default: the one `latest` names) under a run's checkpoint directory (under
    train.checkpoint_dir, the one its `newest` names), or a step folder given directly: whichever holds `hf/` or
    (a LoRA run's) `adapter/`, its files as they were saved."""
    if step is None and ((root / HF).is_dir() or (root / ADAPTER).is_dir()):
        folder = root
    else:
        if read_latest(root) is None and (root / NEWEST).is_dir():  # train.checkpoint_dir: its newest run's
            root = (root / NEWEST).resolve()
        name = tag(step) if step is not None else read_latest(root)
        if name is None and (runs := sorted(p.parent.name for p in root.glob(f"*/{LATEST}"))):
            raise ExportError(f"{root} holds the checkpoint folders of runs, not one run's checkpoints: give one of "
                              + ", ".join(runs))
        if name is None:  # (a run stopped before its first checkpoint, or one whose saves all failed)
            what = "is not a folder" if not root.is_dir() else "holds no complete checkpoint (no `latest` marker)"
            raise ExportError(f"{root} {what}: its run saved no checkpoint there (a run saves one at its end, "
                              "and every train.checkpoint_every steps or checkpoint_every_s seconds)")
        if not (root / name).is_dir():
            have = ", ".join(complete(root)) or "none"
            raise ExportError(f"{root} has no checkpoint {name}; complete checkpoints: {have}")
        folder = root / name
    # a step's folder given directly too: a weights file cut short (a disk filled, an interrupted copy) is
    # not a model. One with no manifest was saved before manifests existed, unless the run's other checkpoints
    # (in its folder, the step's parent) have theirs: then its own was lost, and its files cannot be checked
    if (problem := verify(folder, manifested(folder.parent))) is not None:
        raise ExportError(f"{folder} is not as it was saved: {problem}")
    return folder


def hf_folder(folder: Path) -> Path:
    """The whole `hf/` folder of a step's folder (step_folder's)."""
    if (folder / ADAPTER).is_dir() and not (folder / HF).is_dir():
        raise ExportError(f"{folder} is a LoRA checkpoint (adapter/, no hf/): export merges it")
    _whole(folder / HF, REQUIRED, "a whole Hugging Face folder")
    return folder / HF


def _whole(folder: Path, required: tuple[str, ...], what: str) -> None:
    if not folder.is_dir():
        raise ExportError(f"{folder.parent} holds neither hf/ nor adapter/: not a checkpoint")
    missing = [f for f in required if not (folder / f).is_file()]
    if missing or not any(folder.glob("*.safetensors")):
        raise ExportError(f"{folder} is not {what} (missing {', '.join(missing) or 'weights'})")


def export(run: str, out: str | os.PathLike, step: int | None = None, uri: str | None = None,
           adapter: bool = False) -> Path:
    """Write the run's checkpoint (step N, default the newest) to `out`: a Hugging Face folder (a LoRA run's
    adapters merged into the base weights), or with `adapter` a LoRA run's peft adapter folder."""
    folder = step_folder(checkpoint_dir(run, uri), step)
    out = Path(out).resolve()  # (`--out .` has no name to make the staging folder's name of)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not empty: choose a new folder (nothing is overwritten)")
    lora = (folder / ADAPTER).is_dir()
    if adapter and not lora:
        raise ExportError(f"{folder} holds full weights (the run trained no LoRA adapters): export it without --adapter")
    source = folder / ADAPTER if lora else hf_folder(folder)
    if lora:
        _whole(source, ("adapter_config.json", "tokenizer_config.json"), "a whole adapter folder")
    staging = out.with_name(f".{out.name}.exporting")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        if lora and not adapter:
            merge_adapters(source, staging)
        else:
            shutil.copytree(source, staging)
        readable(staging)  # one saved before readable() was: its model.safetensors 0600, as transformers writes it
        if out.exists():  # the empty folder the user made, perhaps their working directory: filled, not replaced
            for item in staging.iterdir():
                os.replace(item, out / item.name)
            staging.rmdir()
        else:
            os.replace(staging, out)
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)  # a part copy is GBs, on a disk that may be full
        if not isinstance(e, OSError):
            raise
        if not folder.is_dir():  # (the run's train.keep_checkpoints deleted it as a newer one was committed)
            raise ExportError(f"{folder}: the checkpoint was removed while it was copied (pruned by its run?): "
                              "export again") from e
        raise ExportError(f"cannot write {out}: {_failure(e)}") from e
    return source


def _failure(e: OSError) -> str:
    """Why a copy failed, in the system's words: shutil.copytree gathers each file's error as text, and says
    the first here."""
    if isinstance(e, shutil.Error) and e.args and isinstance(e.args[0], list) and e.args[0]:
        return e.args[0][0][2]
    return f"{e.strerror} ({e.filename})" if e.strerror and e.filename else str(e)


def merge_adapters(adapter: Path, out: Path) -> None:
    """The base model named by the adapter's config with the adapters merged in (W + scale B @ A, in float32
    as the learner trained), saved with the adapter folder's tokenizer and chat template."""
    import torch
    from peft import PeftConfig, PeftModel
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_path = PeftConfig.from_pretrained(str(adapter)).base_model_name_or_path
    if not base_path or not Path(base_path).is_dir():
        raise ExportError(f"{adapter}: the base model {base_path!r} it adapts is not on disk here; "
                          "export --adapter copies the adapters alone")
    try:  # its own failure, not the out folder's (an OSError): a cache folder cut short, or one that is empty
        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise ExportError(f"{adapter}: its base model {base_path} cannot be loaded: {e}") from e
    try:  # the adapters' own failure: a weights file that is not safetensors, adapters of a model of other shapes
        merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:
        # (peft's size mismatch is a line per tensor: its heading and the first say what)
        cause = " ".join(line.strip() for line in str(e).strip().splitlines()[:2]).rstrip(".")
        raise ExportError(f"{adapter}: its adapters cannot be merged into the base model {base_path}: {cause}. They "
                          "were saved damaged, or trained on another model than that one: export another step "
                          "(--step N), or --adapter to copy the adapters as they are") from e
    merged.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(adapter)).save_pretrained(out)


def adapter_usage(out: Path) -> str:
    """How to load an exported adapter folder, with the base model its adapter_config.json names: the folder
    the learner loaded (a `factory:` asset or a hub id as its folder on disk), which from_pretrained takes as
    it is; the spec's `model.path` may not be (`factory:tiny-qwen3`)."""
    import json

    base = json.loads((out / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base:
        return (f"  peft: {out / 'adapter_config.json'} names no base model: load the model the run trained "
                f"(its model.path), then PeftModel.from_pretrained(model, {str(out)!r})")
    load = f"PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({base!r}), {str(out)!r})"
    if not Path(base).is_dir():  # the training machine's folder (its model cache), or a hub id
        return (f"  peft: {load}\n  ({base} is where the run's learner found its base model, not a folder here: "
                "give the same model's folder or hub id in its place)")
    return f"  peft: {load}"


def main(args) -> int:
    source = export(args.run, args.out, args.step, args.uri, adapter=args.adapter)
    if args.adapter:
        print(f"exported {source} -> {args.out}\n{adapter_usage(Path(args.out))}")
        return 0
    merged = " (LoRA adapters merged into the base weights)" if source.name == ADAPTER else ""
    print(f"exported {source} -> {args.out}{merged}\n"
          f"  transformers: AutoModelForCausalLM.from_pretrained({str(args.out)!r})\n"
          f"  vLLM:         vllm serve {shlex.quote(str(args.out))}")  # (pasted into a shell: `--out "my model"`)
    return 0
