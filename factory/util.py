"""Small helpers shared by stages: import-path resolution, file lookup, the jinja environment."""
from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class UserError(Exception):
    """Bad input found while running (data rows, ...): the CLI prints the message alone, no traceback,
    and exits with code 2, as for a spec error."""


def import_path(spec: str) -> Callable[..., Any]:
    """`package.module:attr` -> the attribute. The working directory is importable, so a user's
    `rewards/` folder next to the spec works without installing it."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"'{spec}' is not an import path of the form module:function")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    module = importlib.import_module(module_name)
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def resolve_file(path: str | os.PathLike, base_dir: Path | None = None) -> Path:
    """A file named in the spec: relative to the working directory first, then to the spec's folder."""
    p = Path(path)
    if p.is_absolute() or p.exists() or base_dir is None:
        return p
    alt = Path(base_dir) / p
    return alt if alt.exists() else p


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    # jinja's own tojson returns Markup and HTML-escapes '<', which would change the rendered prompt
    # (transformers registers a plain json.dumps for the same reason).
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def template_env() -> jinja2.Environment:
    """The sandboxed jinja environment for every user template (prompts, judges, chat templates)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False,
                                        undefined=jinja2.StrictUndefined)
    env.filters["tojson"] = _tojson
    return env


def enter_workdir(workdir: str | None) -> None:
    """Make a stage process look like the driver: same working directory, and that directory importable
    (user modules such as a project's `rewards/` import from it)."""
    if workdir:
        if not os.path.isdir(workdir):
            import socket

            raise FileNotFoundError(f"the project folder {workdir} is not on this node ({socket.gethostname()}): a "
                                    "run on several machines needs it at the same path on each (a shared "
                                    "filesystem; see docs/scale.md)")
        os.chdir(workdir)
        if workdir not in sys.path:
            sys.path.insert(0, workdir)


def set_threads(threads: int | None) -> None:
    """An explicit torch thread count for a computing stage (None = all cores): oversubscription on
    small CPU boxes made steps 10-30x slower."""
    import torch

    torch.set_num_threads(threads or os.cpu_count() or 1)


def node_id() -> str | None:
    """The Ray node this process runs on (None outside Ray): stages report it so a run records where
    each replica was placed."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
