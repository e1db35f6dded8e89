"""Factory: train tool-using LLM agents with RL from one YAML spec.

From Python (docs/python.md), the same program as the `factory` command:

    import factory
    plan = factory.compile("specs/tiny.yaml", ["train.steps=2"])
    result = factory.run(plan, on_step=lambda step, metrics: print(step, metrics.get("reward/mean")))

`load`, `compile`, `run`, `diff`, `runs` and `evaluate` live in factory.commands.api; they are imported on
first use, so that `import factory.schema` (every stage process does) stays light.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from factory.commands.api import compile_plan as compile
    from factory.commands.api import diff, evaluate, run, runs
    from factory.commands.api import load_spec as load
    from factory.compiler.errors import SpecErrors
    from factory.runtime.health import InfraFailure
    from factory.runtime.resume import ResumeError
    from factory.tracking.tracker import RunLookupError
    from factory.util import UserError

__all__ = ["load", "compile", "run", "diff", "runs", "evaluate", "SpecErrors", "RunLookupError", "ResumeError",
           "UserError", "InfraFailure", "__version__"]

_API = {"load": "load_spec", "compile": "compile_plan", "run": "run", "diff": "diff", "runs": "runs",
        "evaluate": "evaluate"}


def __getattr__(name: str) -> Any:
    if name in _API:
        from factory.commands import api

        return getattr(api, _API[name])
    if name == "SpecErrors":
        from factory.compiler.errors import SpecErrors

        return SpecErrors
    if name == "ResumeError":
        from factory.runtime.resume import ResumeError

        return ResumeError
    if name == "RunLookupError":
        from factory.tracking.tracker import RunLookupError

        return RunLookupError
    if name == "InfraFailure":
        from factory.runtime.health import InfraFailure

        return InfraFailure
    if name == "UserError":
        from factory.util import UserError

        return UserError
    if name == "__version__":
        from factory.util import version

        return version()
    raise AttributeError(f"module 'factory' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
