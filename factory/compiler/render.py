"""Text views of a Plan for the terminal: the `factory check` summary and the `factory plan` listing."""
from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel

from factory.plan import Plan


def _source(s: dict[str, Any]) -> str:
    if s.get("generator"):
        return f"generator {s['generator']} ({s['size']} rows)"
    return str(s.get("path"))


def _tool(name: str, t: dict[str, Any], listed: dict[str, list[str]]) -> str:
    if "command" in t:
        kind = f"stdio: {' '.join([t['command'], *t.get('args', [])])}"
    elif "url" in t:
        kind = f"http: {t['url']}"
    else:
        kind = f"python: {t.get('function')}"
    if name in listed:  # only after `--connect`
        kind += f"; tools: {', '.join(listed[name]) or '(none)'}"
    return f"{name} ({kind})"


def stage_line(plan: Plan) -> str:
    names = [s.name for s in plan.stages]
    line = " -> ".join(n for n in names if n != "tools" and not n.startswith("judge."))
    if "tools" in names:
        line += "; rollout <-> tools"
    for judge in (n for n in names if n.startswith("judge.")):
        line += f"; reward <-> {judge}"
    return line + "; update -> rollout (weight sync)"


def check_summary(plan: Plan) -> str:
    """A few lines saying what `factory run` would do with this spec."""
    s = plan.spec
    data = f"train: {_source(s['data']['train'])}"
    if s["data"].get("eval"):
        data += f"; eval: {_source(s['data']['eval'])}"
    tools = "; ".join(_tool(n, t, plan.tools) for n, t in s["tools"].items()) or "(none)"
    alg = plan.algorithm
    alg_text = alg.get("name", "?")
    details = [f"{k} {alg[k]}" for k in ("advantage", "loss", "aggregation") if alg.get(k)]
    if details:
        alg_text += f" ({', '.join(details)})"
    rewards = ", ".join(n for n in plan.reward_order if n != plan.reward_node)
    rewards = f"{rewards} -> {plan.reward_node}" if rewards else plan.reward_node
    gpus = sum(st.resources.get("num_gpus", 0) for st in plan.stages)
    lines = [
        f"{plan.spec_path}: ok",
        f"  model      {s['model']['path']}",
        f"  data       {data}",
        f"  tools      {tools}",
        f"  rewards    {rewards} (trains the policy)",
        f"  algorithm  {alg_text}",
        f"  stages     {stage_line(plan)}" + (f"; {gpus:g} GPUs" if gpus else ""),
        f"  run hash   {plan.hashes['run'][:12]}",
    ]
    return "\n".join(lines)


def _hash_entry(h: Any) -> str:
    if not isinstance(h, dict):
        return str(h)
    if "generator" in h:  # a generated data set is defined by its code and arguments, not by a file
        args = "".join(f" {k}={v}" for k, v in sorted(h["args"].items()))
        return (f"{h['generator']} size={h['size']} seed={h['seed']}{args} "
                f"source={h['source_sha256']}")
    return f"{h['path']} {h['sha256']}"


def plan_text(plan: Plan) -> str:
    """The resolved spec, the stage graph and the hashes, for reading."""
    out = ["# resolved spec (values read from the environment are shown as ***)", plan.spec_yaml.rstrip(), "",
           "# stages"]
    for st in plan.stages:
        res = ", ".join(f"{k}={v:g}" for k, v in st.resources.items())
        out.append(f"  {st.name:8} {st.does}")
        out.append(f"  {'':8} in: {', '.join(st.inputs) or '-'}; out: {', '.join(st.outputs) or '-'}; {res}")
    out += ["", "# edges"]
    for e in plan.edges:
        out.append(f"  {e.src} --{e.carries}--> {e.dst}" + (f" ({e.kind.replace('_', ' ')})" if e.kind != "data" else ""))
    out += ["", "# reward graph",
            f"  order: {' -> '.join(plan.reward_order)}; trains on: {plan.reward_node}",
            f"  eval metrics: {', '.join(f'{k}={v}' for k, v in plan.metrics.items()) or '-'}",
            "", "# algorithm"]
    out += [f"  {k}: {json.dumps(v)}" for k, v in sorted(plan.algorithm.items())]
    out += ["", "# hashes"]
    for key, value in sorted(plan.hashes.items()):
        if isinstance(value, dict):
            out.append(f"  {key}:" + ("" if value else " -"))
            for name, h in sorted(value.items()):
                out.append(f"    {name}: {_hash_entry(h)}")
        else:
            out.append(f"  {key}: {value}")
    out.append(f"\n# factory {plan.version}")
    return "\n".join(out)


def _explained(model: BaseModel, shown: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, str, Any]]:
    """(dotted path, docstring, shown value) of every leaf setting, in the schema's order."""
    for name, info in type(model).model_fields.items():
        value, path = getattr(model, name), f"{prefix}{name}"
        doc = " ".join((info.description or "").split())
        if isinstance(value, BaseModel):
            yield from _explained(value, shown.get(name, {}), f"{path}.")
        elif isinstance(value, dict) and value and all(isinstance(v, BaseModel) for v in value.values()):
            for key, node in value.items():  # tools and reward nodes: one block per entry
                yield from _explained(node, shown.get(name, {}).get(key, {}), f"{path}.{key}.")
        else:
            yield path, doc, shown.get(name)


def explain_text(plan: Plan, spec: BaseModel) -> str:
    """Every resolved setting with its documentation (the schema's docstrings) above it."""
    out = []
    for path, doc, value in _explained(spec, plan.spec):
        out += [f"# {line}" for line in textwrap.wrap(doc, 100)]
        out.append(f"{path}: {json.dumps(value, ensure_ascii=False)}")
    return "\n".join(out)
