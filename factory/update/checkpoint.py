"""Checkpoint layout, the `latest` marker, and the RNG state a resumed run needs.

Layout of a checkpoint directory (`train.checkpoint_dir`):

    <dir>/
      latest                      text "step_<N>": the newest COMPLETE checkpoint
      step_<N>/                   DeepSpeed engine.save_checkpoint(tag="step_<N>"): model, optimizer
                                  (ZeRO-partitioned when ZeRO >= 1), and client state {step, rng}
        mp_rank_00_model_states.pt, *optim_states.pt, ...   (DeepSpeed's own files)
        hf/                       Hugging Face folder: config, model.safetensors, tokenizer;
                                  `AutoModelForCausalLM.from_pretrained(<dir>/step_<N>/hf)` loads it
      step_<M>/ ...

`latest` is written last, atomically (write + rename), so a run killed while saving resumes from the
previous complete checkpoint, never from a half-written one.
"""
from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch

LATEST = "latest"


def tag(step: int) -> str:
    return f"step_{step}"


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
    tmp.write_text(name + "\n")
    os.replace(tmp, path)  # atomic on POSIX: readers see the old marker or the new one


def rng_state() -> dict[str, Any]:
    """Every RNG the update stage draws from (torch CPU/CUDA, python's random); tensors and plain
    python values only, so DeepSpeed's torch.load reads it back."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
