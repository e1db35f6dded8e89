"""`factory init NAME`: a new project folder, copied from factory/scaffold/.

The scaffold is a complete, small project (spec, task prompt, chat template, a reward function of its
own beside Factory's built-ins, a local MCP tool server, data) that passes `factory check --connect` and
trains on a CPU from its own folder. Its files are plain files in factory/scaffold/, so they are read,
linted and tested like any other; `PROJECT_NAME` in them becomes the project's name. The spec's JSON
Schema is written next to the spec, so an editor completes and checks it with no setup.
"""
from __future__ import annotations

import os
from pathlib import Path

from factory.schema import NAME, NAME_RULE, SPEC_NAME_BYTES

SCAFFOLD = Path(__file__).resolve().parents[1] / "scaffold"
PLACEHOLDER = "PROJECT_NAME"
SCHEMA_NAME = "spec.schema.json"  # the scaffold's spec.yaml names it on its first line
_RENAMED = {"gitignore": ".gitignore"}  # a dotfile would be left out of the installed package

# What `factory init` prints about each file, in this order.
DESCRIPTIONS = {
    "spec.yaml": "the spec: model, data, tools, rewards, algorithm",
    "prompts/task.jinja": "a data row -> chat messages",
    "prompts/chat.jinja": "the chat template (messages and tool list -> tokens)",
    "rewards/task.py": "your reward function (rewards.task:correct)",
    "tools/letters.py": "a tiny MCP tool server (count_letter)",
    "data/train.jsonl": "training questions and answers",
    "data/eval.jsonl": "held-out questions",
    SCHEMA_NAME: "the spec's JSON Schema, for your editor",
    "README.md": "what is where, and the commands",
    "rewards/__init__.py": "makes rewards/ a package",
    ".gitignore": "keeps mlflow.db and runs/ out of git",
}


class InitError(Exception):
    """The project cannot be created as asked; `str(e)` says why and what to do."""


def project_files(name: str) -> dict[str, str]:
    """Relative path -> text of every file of a new project called `name`."""
    from factory.commands.reference import json_schema_text

    files = {}
    for path in sorted(SCAFFOLD.rglob("*")):
        if path.is_dir() or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(SCAFFOLD).as_posix()
        text = path.read_text(encoding="utf-8")
        if rel.endswith(".yaml"):  # where it is a value (`name: PROJECT_NAME`), a YAML string
            text = text.replace(f": {PLACEHOLDER}", f": {yaml_string(name)}")
        files[_RENAMED.get(rel, rel)] = text.replace(PLACEHOLDER, name)
    files[SCHEMA_NAME] = json_schema_text()
    return files


def yaml_string(name: str) -> str:
    """`name` as a YAML value that reads back as that string: plain where it does (`my-agent`), else quoted.
    Read plain, `2024`, `on`, `null` and `1.0` are an int, a bool, null and a float: a spec that failed
    `factory check` ("name: expected a string") in the project just made. Plain only where both readers take
    it as written: OmegaConf's, which reads specs (`1e5` is a float to it, a string to PyYAML), and PyYAML's
    (`2024-01-01` is a date to it, a string to OmegaConf), as other tools read the file."""
    import json

    import yaml
    from omegaconf import OmegaConf

    plain = yaml.safe_load(name) == name and OmegaConf.create(f"name: {name}").name == name
    return name if plain else json.dumps(name)


def create(target: Path) -> tuple[str, list[str]]:
    """Write a new project into `target` (created if missing); (its name, the files written).
    Refuses to overwrite anything: an existing file is an error that names it; so is one where a folder goes,
    found before anything is written (half a project, which a second init then refused, was left behind)."""
    try:
        name = target.resolve().name
    except (OSError, RuntimeError) as e:  # a link that loops (RuntimeError before Python 3.13)
        raise InitError(f"cannot follow {target}: {getattr(e, 'strerror', None) or e}") from None
    if not NAME.fullmatch(name):  # the name becomes the spec's `name`, held to the same rule
        raise InitError(f"'{name}' is not a usable project name: {NAME_RULE}")
    if len(name) > SPEC_NAME_BYTES:  # (NAME's characters are ASCII: one byte each)
        raise InitError(f"a project's name is at most {SPEC_NAME_BYTES} characters (it is its spec's name, which "
                        f"names its runs' checkpoint folders), this one has {len(name)}")
    files = project_files(name)
    try:
        if target.exists() and not target.is_dir():
            raise InitError(f"{target} exists and is not a folder")
        # every folder a file goes in (the target's own parents too), shallowest first
        for folder in sorted({f for rel in files for f in (target / rel).parents}, key=lambda f: len(f.parts)):
            if os.path.lexists(folder) and not folder.is_dir():
                kind = "a file" if folder.exists() else "a link to nothing"
                raise InitError(f"{folder} is {kind}, where the project needs a folder: move it aside, or choose "
                                "another name")
        clashes = [rel for rel in files if (target / rel).exists()]
        if clashes:
            raise InitError(f"{target} already has {', '.join(clashes)}; factory init never overwrites files: "
                            "choose a new name or an empty folder")
        for rel, text in files.items():
            path = target / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    except OSError as e:  # a parent that is a file, no permission, a read-only or full disk: the user's to fix
        raise InitError(f"cannot write {e.filename or target}: {e.strerror or e}") from e
    return name, list(files)
