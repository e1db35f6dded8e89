"""Text views of a Plan: the `factory check` summary, the `factory plan` listing and its Graphviz dot."""
from __future__ import annotations

import dataclasses
import json
import textwrap
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from pydantic import BaseModel

from factory.plan import Edge, Plan, Stage
from factory.schema import TOOL_QUALIFIER


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
    if name in listed:  # only after `--connect`: each as the model is offered it (factory.tools.offered_tools)
        counts = Counter(tool for tools in listed.values() for tool in tools)
        offered = [tool if counts[tool] == 1 else f"{name}{TOOL_QUALIFIER}{tool}" for tool in listed[name]]
        kind += f"; tools: {', '.join(offered) or '(none)'}"
    return f"{name} ({kind})"


def _targets(modules: str | list[str]) -> str:
    return modules if isinstance(modules, str) else ", ".join(modules)


def _replicas(stage: Stage) -> str:
    return f" x{stage.replicas}" if stage.replicas > 1 else ""


def stage_line(plan: Plan) -> str:
    """The stage graph on one line, read from its edges: the training flow, then each call edge (a stage
    that calls another) and the weight sync."""
    flow = plan.flow("data")
    replicas = {s.name: _replicas(s) for s in plan.stages}
    parts = [" -> ".join(n + replicas[n] for n in [flow[0].src, *(e.dst for e in flow)])]
    parts += [f"{e.src} <-> {e.dst}" for e in plan.edges if e.kind == "call" and e.method]
    parts += [f"{e.src} -> {e.dst} (weight sync)" for e in plan.edges if e.kind == "weight_sync"]
    return "; ".join(parts)


def check_summary(plan: Plan) -> str:
    """A few lines saying what `factory run` would do with this spec."""
    s = plan.spec
    data = f"train: {_source(s['data']['train'])}"
    if s["data"].get("eval"):
        data += f"; eval: {_source(s['data']['eval'])}"
    tools = "; ".join(_tool(n, t, plan.tools) for n, t in s["tools"].items()) or "(none)"
    alg = plan.algorithm
    alg_text = (f"{alg.name} (advantage {alg.advantage}, loss {alg.loss}, aggregation {alg.aggregation}"
                + (f", KL {alg.kl_coef:g} ({alg.kl_estimator}, in the {alg.kl_apply})" if alg.kl_coef else "")
                + (f", credit per turn, gamma {alg.gamma:g})" if alg.credit == "turn" else ")"))
    rewards = ", ".join(n for n in plan.reward_order if n != plan.reward_node)
    rewards = f"{rewards} -> {plan.reward_node}" if rewards else plan.reward_node
    gpus = sum(st.resources.get("GPU", 0) * st.replicas for st in plan.stages)
    lines = [
        f"{plan.spec_path}: ok",
        f"  model      {s['model']['path']}" + (f" (LoRA r={lora['r']} on {_targets(lora['target_modules'])})"
                                                  if (lora := s["model"].get("lora")) else ""),
        f"  data       {data}",
        f"  tools      {tools}",
        f"  rewards    {rewards} (trains the policy)",
        f"  algorithm  {alg_text}",
        f"  stages     {stage_line(plan)}" + (f"; {gpus:g} GPUs" if gpus else ""),
        f"  run hash   {plan.hashes['run'][:12]}" + _unhashed_tools(plan),
    ]
    return "\n".join(lines)


def _bundle(stage: Stage) -> str:
    each = ", ".join(f"{k} {v:g}" for k, v in stage.resources.items())
    return f"each replica reserves {each} ({stage.strategy})" if each else "reserves nothing"


def edge_text(e: Edge) -> str:
    """`data.next_batch --batch--> rollout.generate`: the methods the driver (or, for a call edge, the
    source stage) calls."""
    src = f"{e.src}.{e.fetch}" if e.fetch else e.src
    dst = f"{e.dst}.{e.method}" if e.method else e.dst
    kind = "" if e.kind == "data" else f" ({e.kind.replace('_', ' ')})"
    return f"{src} --{e.carries}--> {dst}{kind}" + (f" (each {e.stream} as it completes)" if e.stream else "")


def dot_text(plan: Plan) -> str:
    """The stage graph in Graphviz dot: one box per stage (its class and replicas), one arrow per edge
    labelled with what it carries; eval edges dashed, tool calls dotted, the weight sync bold."""
    q = json.dumps  # a JSON string is a valid dot string (and \n a line break in a label)
    out = [f"digraph {q(plan.spec.get('name', 'plan'))} {{", "  rankdir=LR;",
           '  node [shape=box, style=rounded, fontname="Helvetica"];', '  edge [fontname="Helvetica", fontsize=10];']
    for st in plan.stages:
        label = [st.name, st.cls.rpartition(":")[2] + (f" x {st.replicas} replicas" if st.replicas > 1 else "")]
        if st.resources:
            label.append("each: " + ", ".join(f"{k} {v:g}" for k, v in st.resources.items()))
        out.append(f"  {q(st.name)} [label={q(chr(10).join(label))}];")
    style = {"data": "", "eval": ", style=dashed", "call": ", style=dotted", "weight_sync": ", style=bold"}
    for e in plan.edges:
        label = e.carries + (" (weight sync)" if e.kind == "weight_sync" else "")
        out.append(f"  {q(e.src)} -> {q(e.dst)} [label={q(label)}{style[e.kind]}];")
    out.append("}")
    return "\n".join(out) + "\n"


def _hash_entry(h: Any) -> str:
    if not isinstance(h, dict):
        return str(h)
    if "generator" in h:  # a generated data set is defined by its code and arguments, not by a file
        args = "".join(f" {k}={v}" for k, v in sorted(h["args"].items()))
        return (f"{h['generator']} size={h['size']} seed={h['seed']}{args} "
                f"source={h['source_sha256']}")
    return f"{h['path']} {h['sha256']}"


def _unhashed_tools(plan: Plan) -> str:
    """What a hash left out: the tool servers' schemas are known once the servers are started, so the run
    hash of `check` and `plan` differs from `check --connect`'s and the run's (which hash them)."""
    if not plan.spec.get("tools") or plan.hashes.get("tools"):
        return ""
    replay = plan.spec.get("replay") or {}
    if replay.get("run") and replay.get("on_miss") == "fail":  # no server is started: the recording's are offered
        return " (tool schemas not included: a run replaying them hashes those its recording lists)"
    return " (tool schemas not included: `check --connect` and a run start the servers and hash them)"


def plan_text(plan: Plan) -> str:
    """The resolved spec, the stage graph and the hashes, for reading."""
    out = ["# resolved spec (values read from the environment are shown as ***)", plan.spec_yaml.rstrip(), "",
           "# stages"]
    for st in plan.stages:
        out.append(f"  {st.name:8} {st.does}")
        out.append(f"  {'':8} {st.cls}{_replicas(st)}; {_bundle(st)}")
        out.append(f"  {'':8} in: {', '.join(st.inputs) or '-'}; out: {', '.join(st.outputs) or '-'}")
        if st.env:
            out.append(f"  {'':8} starts with: {' '.join(f'{k}={v}' for k, v in st.env.items())}")
    out += ["", "# edges (the methods the driver calls; a call edge's source calls it itself)"]
    out += [f"  {edge_text(e)}" for e in plan.edges]
    out += ["", "# reward graph",
            f"  order: {' -> '.join(plan.reward_order)}; trains on: {plan.reward_node}",
            f"  eval metrics: {', '.join(f'{k}={v}' for k, v in plan.metrics.items()) or '-'}",
            "", "# algorithm"]
    out += [f"  {k}: {json.dumps(v)}" for k, v in sorted(dataclasses.asdict(plan.algorithm).items())]
    out += ["", "# hashes"]
    for key, value in sorted(plan.hashes.items()):
        if isinstance(value, dict):
            out.append(f"  {key}:" + ("" if value else " -" + (_unhashed_tools(plan) if key == "tools" else "")))
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


def explain_text(plan: Plan, spec: BaseModel, origin: Callable[[str], str] | None = None) -> str:
    """Every resolved setting with its documentation (the schema's docstrings) above it and, given
    `origin` (factory.compiler.load.SpecSource.origin), where its value was set: the file and line (a
    base spec's, with `extends`), the override, or `default`."""
    from factory.compiler.translate import value_at

    out = []
    shown = plan.filled_spec
    for path, doc, value in _explained(spec, shown):
        out += [f"# {line}" for line in textwrap.wrap(doc, 100)]
        where = origin(path) if origin is not None else None
        if where == "default" and path.startswith("algorithm.") and value != value_at(plan.spec, path):
            where = f"preset {plan.algorithm.name}"  # a value the preset chose, not the field's default
        out.append(f"{path}: {json.dumps(value, ensure_ascii=False)}" + (f"  # {where}" if where else ""))
    return "\n".join(out)

