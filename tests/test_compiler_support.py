"""Helpers (no tests) for the spec and CLI tests: write inline specs and python modules into a
temporary folder that is the working directory, as a user's project would be."""
from __future__ import annotations

import importlib
import textwrap
from pathlib import Path

import pytest

from factory.compiler.errors import SpecErrors

# A small valid spec; tests replace or append keys. Its reward module is written by `project()`.
BASE = """\
name: demo
model: {path: "factory:tiny-qwen3"}
data:
  train: {generator: factory.data:arithmetic, size: 8}
rewards:
  correct: {fn: "{mod}:exact"}
  fmt: {fn: "{mod}:fmt"}
  total: {sum: {correct: 1.0, fmt: 0.1}}
"""

# A config.json for a model folder a test writes (its weights never read): one transformers knows and builds on
# the meta device, as `factory check` does, in milliseconds
MODEL_CONFIG = ('{"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, '
                '"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256}')

REWARDS = """\
def exact(prompt, completion, answer="", **row):
    return float(answer in completion)


def fmt(prompt, completion, **row):
    return 1.0


def needs_three(a, b, c, /):
    return 0.0


def group_ok(prompts, completions, rows):
    return [0.0] * len(completions)
"""


class Project:
    """A temporary project folder (the working directory) holding spec files and python modules."""

    def __init__(self, root: Path):
        self.root = root

    def module(self, name: str, source: str = REWARDS) -> str:
        (self.root / f"{name}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()  # the folder's listing is cached by the import system
        return name

    def file(self, name: str, text: str = "") -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    def spec(self, text: str, name: str = "spec.yaml") -> str:
        self.file(name, textwrap.dedent(text))
        return name


def make_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Project:
    """A `Project` in `tmp_path`, made the working directory for the test."""
    monkeypatch.chdir(tmp_path)
    return Project(tmp_path)


def report(exc: pytest.ExceptionInfo[SpecErrors]) -> str:
    return exc.value.report()


def base_spec(project, mod: str) -> str:
    """BASE with its reward module `mod` written into the project."""
    project.module(mod)
    return BASE.replace("{mod}", mod)
