"""The Plan: a compiled spec, as plain data.

The compiler (factory.compiler) builds it; the driver executes it; MLflow stores it with every run and
`factory diff` compares two of them. It lives at the bottom of the package (it imports nothing of
Factory's) so every stage can read its slice without importing the compiler.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Stage:
    """One stage of the run: what it consumes and produces, and what Ray reserves for it."""

    name: str
    does: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    resources: dict[str, float]


@dataclass(frozen=True)
class Edge:
    """`src` hands `carries` to `dst`; `weight_sync` is the update -> rollout edge that closes the loop."""

    src: str
    dst: str
    carries: str
    kind: str = "data"  # data | call | weight_sync


@dataclass(frozen=True)
class Plan:
    """A compiled spec. Plain data: `plan_json` serialises all of it except `spec_yaml` (the same as
    `spec`) and `warnings` (diagnostics that depend on the machine, such as the HF cache)."""

    spec: dict[str, Any]  # the resolved spec, keys sorted, env-derived values masked as "***"
    spec_yaml: str  # the same as YAML (what MLflow stores as spec.yaml)
    spec_path: str  # the spec file as given
    base_dir: str  # the spec file's folder (absolute): relative file references fall back to it
    stages: tuple[Stage, ...]
    edges: tuple[Edge, ...]
    reward_order: tuple[str, ...]  # reward nodes, inputs before the nodes that read them
    reward_node: str  # the node whose value trains the policy
    metrics: dict[str, str]  # eval metric name -> reward node
    algorithm: dict[str, Any]  # the resolved algorithm (preset filled in)
    hashes: dict[str, Any]  # spec, templates, rewards, data, code, tools, run
    version: str  # factory's version
    tools: dict[str, list[str]] = field(default_factory=dict)  # server -> offered tools (when connected)
    warnings: tuple[str, ...] = field(default=(), compare=False)  # shown by `factory check`, not hashed
