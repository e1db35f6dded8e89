"""No import runs back up a layer: import-linter checks `factory/` against the layers in pyproject.toml
([tool.importlinter]), and README's "Layout" section lists the same layers."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest brings tomli on Python 3.10
    import tomli as tomllib

import pytest

REPO = Path(__file__).resolve().parents[1]


def _layers() -> list[list[str]]:
    """The contract's layers, highest first, each as its modules (`factory.<name>`)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers"]
    return [[f"factory.{m.strip()}" for m in re.split(r"[|:]", layer)] for layer in contract["layers"]]


def test_no_import_runs_back_up_a_layer():
    # In a process of its own: import-linter configures logging with dictConfig, which disables every logger
    # that exists when it runs, so Factory's warnings would vanish from the tests that run after it here.
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists() and sys.version_info < (3, 11):
        pytest.skip("import-linter needs Python 3.11+")
    out = subprocess.run([str(lint), "--config", str(REPO / "pyproject.toml"), "--no-cache", "--no-logo"],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_readme_lists_the_layers_of_the_contract():
    """README's layout table lists the contract's layers from the bottom up, a row holding one layer or
    several consecutive ones; its first column names their modules (`plan.py`, `compiler/`)."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    listed = [{f"factory.{name.strip('/').removesuffix('.py')}" for name in re.findall(r"`([^`]+)`", row)}
              for row in rows]
    layers = list(reversed(_layers()))
    for row in listed:  # each row takes the next layers, bottom up, until it holds exactly its modules
        taken: set[str] = set()
        while layers and taken | set(layers[0]) <= row:
            taken |= set(layers.pop(0))
        assert taken == row, f"README row {sorted(row)} is not the next layers up: {layers[:2]}"
    assert not layers, f"layers missing from README: {layers}"
