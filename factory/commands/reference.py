"""The spec's reference, generated from factory/schema.py and never written by hand.

Two outputs, both committed so that an editor and a reader on GitHub see them without running anything:
- the JSON Schema (`schema/factory-spec.schema.json`): YAML editors complete and check a spec whose first
  line is `# yaml-language-server: $schema=<path to it>`;
- the markdown reference (`docs/reference/spec.md`): every key with its type, default and docstring.

`factory schema` prints the first, `factory schema --markdown` the second, `factory schema --write`
rewrites both files of a source checkout (tests/test_reference.py fails while they are stale). Names
that live in registries rather than in the schema (algorithm presets, advantages, losses, built-in
models) are added here, so the editor offers them too.
"""
from __future__ import annotations

import inspect
import json
import re
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema

from factory.schema import Spec

SCHEMA_FILE = Path("schema/factory-spec.schema.json")  # relative to the repository root
REFERENCE_FILE = Path("docs/reference/spec.md")
DRAFT = "http://json-schema.org/draft-07/schema#"  # the draft every YAML language server understands
REFRESH = "factory schema --write"


def paragraphs(doc: str | None) -> str:
    """A docstring as text: lines of a paragraph joined, paragraphs kept apart."""
    return "\n\n".join(" ".join(p.split()) for p in re.split(r"\n\s*\n", (doc or "").strip()) if p.strip())


# -------------------------------------------------------------------------------------- JSON Schema
class _Generator(GenerateJsonSchema):
    def field_title_should_be_set(self, schema: Any) -> bool:
        return False  # "Entropy Coef" says less than the key itself; the description is the documentation


def _registry_names() -> dict[str, tuple[str, list[str]]]:
    """Dotted path -> (what, allowed values) for string keys whose values come from a registry."""
    from factory.assets import KNOWN_ASSETS, PREFIX
    from factory.presets import NAMES, PRESETS

    return {
        "algorithm.name": ("enum", sorted(PRESETS)),
        "algorithm.advantage": ("enum", NAMES["advantage"]),
        "algorithm.loss": ("enum", NAMES["policy loss"]),
        "algorithm.aggregation": ("enum", NAMES["aggregation"]),
        "model.path": ("examples", [PREFIX + n for n in sorted(KNOWN_ASSETS)]),
    }


def _node(schema: dict[str, Any], defs: dict[str, Any], dotted: str) -> dict[str, Any]:
    """The property schema at a dotted path, following `$ref`s; the string branch of an `X | None`."""
    node: dict[str, Any] = schema
    for key in dotted.split("."):
        if "$ref" in node:
            node = defs[node["$ref"].rsplit("/", 1)[1]]
        try:
            node = node["properties"][key]
        except KeyError:
            raise KeyError(f"factory/commands/reference.py names `{dotted}`, which the spec no longer has: "
                           "update _registry_names()") from None
    for branch in node.get("anyOf", []):
        if branch.get("type") == "string":
            return branch
    return node


def _draft7(node: Any) -> Any:
    """pydantic writes draft 2020-12; tuples become draft-07's `items: [...]`, `$defs` `definitions`, and
    a `$ref` with siblings an `allOf` of one (draft-07 tools ignore what stands beside a `$ref`)."""
    if isinstance(node, dict):
        out = {k: _draft7(v) for k, v in node.items()}
        if "prefixItems" in out:
            out["items"] = out.pop("prefixItems")
        if isinstance(out.get("$ref"), str):
            ref = out.pop("$ref").replace("#/$defs/", "#/definitions/")
            if out:  # draft-07 ignores the siblings of a `$ref`: keep the description and default beside it
                out["allOf"] = [{"$ref": ref}]
            else:
                out["$ref"] = ref
        return out
    if isinstance(node, list):
        return [_draft7(v) for v in node]
    return node


def _describe(node: Any) -> None:
    """Docstrings as one-line paragraphs, also as `markdownDescription` (VS Code renders its backticks)."""
    if isinstance(node, dict):
        if isinstance(node.get("description"), str):
            node["description"] = paragraphs(node["description"])
            node["markdownDescription"] = node["description"]
        for value in node.values():
            _describe(value)
    elif isinstance(node, list):
        for value in node:
            _describe(value)


def json_schema() -> dict[str, Any]:
    """The spec's JSON Schema (draft-07): field docstrings as descriptions, defaults, enums, and
    `additionalProperties: false` wherever the spec refuses unknown keys."""
    raw = Spec.model_json_schema(schema_generator=_Generator)
    defs = raw.pop("$defs", {})
    for dotted, (kind, values) in _registry_names().items():
        node = _node(raw, defs, dotted)
        node[kind] = list(values)
    _describe(raw)
    _describe(defs)
    schema = {
        "$schema": DRAFT,
        "title": "Factory spec",
        "description": "A Factory spec: one YAML file that defines an RL training run "
                       "(generated from factory/schema.py; see docs/reference/spec.md).",
        **{k: v for k, v in raw.items() if k not in ("title", "description")},
        "definitions": defs,
    }
    schema = _draft7(schema)
    # `extends` is read by the loader, not a setting (factory.compiler.load)
    schema["properties"] = {"extends": {
        "description": "A spec (or a list of specs, merged in order) this one is merged over, relative to this "
                       "file's folder: a mapping merges key by key, any other value replaces the base's.",
        "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}, **schema["properties"]}
    # A spec that extends another is an overlay: it may leave any required key to its base, name a node by the
    # keys it changes (`rewards.correct: {processes: 2}`), and remove an entry of a named mapping with null.
    # So it is checked against a partial copy of the schema; any other spec against the whole one.
    definitions = schema.pop("definitions")
    top = {k: schema.pop(k) for k in ("type", "properties", "additionalProperties", "required")}
    definitions = {**definitions, "Spec": top,
                   **{PARTIAL + name: _partial(d) for name, d in {**definitions, "Spec": top}.items()}}
    return {**schema, "if": {"required": ["extends"]}, "then": {"$ref": f"#/definitions/{PARTIAL}Spec"},
            "else": {"$ref": "#/definitions/Spec"}, "definitions": definitions}


PARTIAL = "Partial"


def _partial(node: Any) -> Any:
    """`node` as an overlay may write it: no key required, references to the partial definitions, and each
    entry of a mapping by name (`additionalProperties`) may be null (the entry removed)."""
    if isinstance(node, list):
        return [_partial(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _partial(v) for k, v in node.items() if k != "required"}
    if isinstance(out.get("$ref"), str):
        out["$ref"] = out["$ref"].replace("#/definitions/", f"#/definitions/{PARTIAL}")
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = {"anyOf": [out["additionalProperties"], {"type": "null"}]}
    return out


def json_schema_text() -> str:
    return json.dumps(json_schema(), indent=2, ensure_ascii=False) + "\n"


# ------------------------------------------------------------------------------------------ markdown
def _strip_optional(ann: Any) -> tuple[Any, list[Any]]:
    """(the type without `None` and `Annotated`, the constraints found on the way)."""
    metadata: list[Any] = []
    while True:
        origin = get_origin(ann)
        if origin is Annotated:
            ann, *more = get_args(ann)
            metadata += more
        elif origin in (Union, types.UnionType) and type(None) in get_args(ann):
            rest = [a for a in get_args(ann) if a is not type(None)]
            ann = rest[0] if len(rest) == 1 else Union[tuple(rest)]  # noqa: UP007 (built at run time)
        else:
            return ann, metadata


def _is_model(ann: Any) -> bool:
    return isinstance(ann, type) and issubclass(ann, BaseModel)


def _members(ann: Any) -> tuple[type[BaseModel], ...]:
    """The models of a union of models (tools, reward nodes); () for anything else."""
    ann, _ = _strip_optional(ann)
    if get_origin(ann) in (Union, types.UnionType) and all(_is_model(a) for a in get_args(ann)):
        return get_args(ann)
    return (ann,) if _is_model(ann) else ()


_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean", Any: "any"}


def _type_text(ann: Any, link: dict[type, str]) -> str:
    ann, _ = _strip_optional(ann)
    origin, args = get_origin(ann), get_args(ann)
    if ann in _SCALARS:
        return _SCALARS[ann]
    if _is_model(ann):
        return f"[{link[ann]}](#{anchor(link[ann])})" if ann in link else ann.__name__
    if origin is Literal:
        return " | ".join(f"`{_yaml(a)}`" for a in args)
    if origin is list:
        return f"list of {_type_text(args[0], link)}"
    if origin is tuple:
        return "[" + ", ".join(_type_text(a, link) for a in args) + "]"
    if origin is dict:
        return f"map of {_type_text(args[0], link)} to {_type_text(args[1], link)}"
    if origin in (Union, types.UnionType):
        return " or ".join(_type_text(a, link) for a in args)
    return getattr(ann, "__name__", str(ann))


def _bounds(metadata: list[Any]) -> str:
    text = []
    for m in metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if isinstance(m, getattr(annotated_types, attr.capitalize())):
                text.append(f"{sign} {getattr(m, attr)}")
    return ", ".join(text)


def _default_text(info: Any) -> str:
    if info.is_required():
        return "**required**"
    default = info.get_default(call_default_factory=True)
    if default is None:
        return "unset"
    if isinstance(default, BaseModel):
        return "see below"
    return f"`{_yaml(default)}`"


def _yaml(value: Any) -> str:
    """A value as a user writes it in a spec: YAML flow style, so a regex keeps single backslashes."""
    if isinstance(value, tuple):
        value = list(value)
    text = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True, width=1000).strip()
    return text.removesuffix("\n...").strip()


def anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def _cell(text: str) -> str:
    """Text for a table cell: one line, `|` escaped, and `<tag>` outside code spans shown, not parsed as HTML."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))


def _sections(model: type[BaseModel], path: str) -> Iterator[tuple[str, type[BaseModel], str]]:
    """(section title, model, its intro) for `model` at `path` and every model below it, depth first in
    the schema's order. Maps of union models (tools, reward nodes) give one section per member."""
    yield path, model, ""
    for name, info in model.model_fields.items():
        sub = f"{path}.{name}" if path else name
        ann, _ = _strip_optional(info.annotation)
        if _is_model(ann):
            yield from _sections(ann, sub)
        elif get_origin(ann) is dict and (members := _members(get_args(ann)[1])):
            for member in members:
                key = _distinctive_key(member, members)
                title = f"{sub}.NAME ({key})" if len(members) > 1 else f"{sub}.NAME"
                intro = paragraphs(member.__doc__) if member.__doc__ and member.__doc__ != BaseModel.__doc__ else ""
                for t, m, i in _sections(member, title):
                    yield t, m, (intro if m is member else i)


def _distinctive_key(member: type[BaseModel], members: tuple[type[BaseModel], ...]) -> str:
    """The first required key that tells this member from the others (`command`, `url`, `fn`, `sum`...)."""
    others = {n for m in members if m is not member for n in m.model_fields}
    for name, info in member.model_fields.items():
        if info.is_required() and name not in others:
            return name
    return member.__name__


def _table(model: type[BaseModel], link: dict[type, str]) -> list[str]:
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    own = set(vars(model).get("__annotations__", {}))  # a tool server's own keys before the shared ones
    fields = sorted(model.model_fields.items(), key=lambda item: item[0] not in own)
    for name, info in fields:
        _, metadata = _strip_optional(info.annotation)
        metadata += info.metadata
        kind = _type_text(info.annotation, link)
        if bounds := _bounds(metadata):
            kind += f", {bounds}"
        rows.append(f"| `{name}` | {_cell(kind)} | {_cell(_default_text(info))} | "
                    f"{_cell(paragraphs(info.description))} |")
    if model.model_config.get("extra") == "allow":
        rows.append("| *other keys* | any | | passed through unchanged |")
    return rows


def _registries() -> list[str]:
    from factory.assets import KNOWN_ASSETS, PREFIX
    from factory.presets import NAMES, PRESETS

    out = ["## Names from registries", "",
           "Values that the schema takes as strings and `factory check` looks up by name.", "",
           "### `algorithm.name`: presets", "",
           "| preset | advantage | loss | aggregation | clip (low, high) | other settings |",
           "|---|---|---|---|---|---|"]
    shown = {"advantage", "loss", "aggregation", "clip_low", "clip_high"}
    for name in sorted(PRESETS):
        p = PRESETS[name]
        other = ", ".join(f"`{k}: {_yaml(v)}`" for k, v in sorted(p.items())
                          if k not in shown and v not in (None, False))
        out.append(f"| `{name}` | `{p['advantage']}` | `{p['loss']}` | `{p['aggregation']}` | "
                   f"{p['clip_low']:g}, {p['clip_high']:g} | {other} |")
    out += ["", "### Registered functions", "", "| kind | names |", "|---|---|"]
    out += [f"| {kind} | {', '.join(f'`{n}`' for n in names)} |" for kind, names in NAMES.items()]
    out += ["", "### `model.path`: built-in models", "", "| path | what it is |", "|---|---|"]
    out += [f"| `{PREFIX}{name}` | {_cell(text)} |" for name, text in sorted(KNOWN_ASSETS.items())]
    out += ["", "### Built-in reward functions", "",
            "For `rewards.NAME.fn`; extra parameters are set with the node's `args`.", "",
            "| fn | args | returns |", "|---|---|---|"]
    for ref, fn in builtin_rewards():
        params = inspect.signature(fn).parameters.values()
        extra = [f"`{p.name}={p.default!r}`" for p in params if p.default is not p.empty
                 and p.name not in ("answer", "turns") and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        out.append(f"| `{ref}` | {', '.join(extra)} | {_cell(paragraphs(fn.__doc__).split(chr(10))[0])} |")
    return out


def builtin_rewards() -> list[tuple[str, Any]]:
    """(import path, function) of every reward function in `factory.rewards`: public functions whose
    first parameters are `prompt, completion` (helpers such as `extract_answer` are not rewards)."""
    import importlib
    import pkgutil

    import factory.rewards

    found = []
    for info in sorted(pkgutil.iter_modules(factory.rewards.__path__), key=lambda i: i.name):
        module = importlib.import_module(f"factory.rewards.{info.name}")
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if name.startswith("_") or fn.__module__ != module.__name__:
                continue
            if list(inspect.signature(fn).parameters)[:2] == ["prompt", "completion"]:
                found.append((f"{module.__name__}:{name}", fn))
    return found


def markdown() -> str:
    """The spec reference page: one table per section of the spec, in the schema's order."""
    titles: dict[type[BaseModel], list[str]] = {}
    intros: dict[type[BaseModel], str] = {}
    for title, model, intro in _sections(Spec, ""):  # a model used at several keys gets one section
        titles.setdefault(model, []).append(title or "top level")
        intros.setdefault(model, intro)
    link = {model: ", ".join(names) for model, names in titles.items()}
    out = [
        "# Spec reference",
        "",
        "<!-- Generated from factory/schema.py by `factory schema --markdown`; do not edit by hand:",
        f"     run `{REFRESH}` after changing the schema. -->",
        "",
        "Every key a spec accepts, with its type, its default and what it does. The text of each row is the",
        "docstring of that field in `factory/schema.py`. A key that is not listed here is an error",
        "(`factory check` names the nearest valid key), except under `train.deepspeed`, whose other keys are",
        "passed to DeepSpeed.",
        "",
        "`factory plan SPEC --explain` prints the same documentation next to every value a spec resolves",
        "to. Editors that speak the YAML language server protocol complete and check a spec whose first line",
        "points at the JSON Schema (`factory schema` prints it; the repository ships it as",
        f"`{SCHEMA_FILE.as_posix()}`):",
        "",
        '```yaml skip="the first line of a spec, shown alone"',
        f"# yaml-language-server: $schema=../{SCHEMA_FILE.as_posix()}",
        "```",
        "",
        "Sections: " + " · ".join(f"[{t}](#{anchor(t)})" for t in link.values()),
        "",
    ]
    for model, title in link.items():
        out += [f"## {title}", ""]
        if intros[model]:
            out += [intros[model], ""]
        out += [*_table(model, link), ""]
    out += _registries()
    return "\n".join(out).rstrip() + "\n"


# ------------------------------------------------------------------------------------------ writing
def checkout_root() -> Path:
    """The source checkout that holds this package (where the generated files are committed)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file() or not (root / "specs").is_dir():
        raise FileNotFoundError(f"`{REFRESH}` updates a source checkout; {root} is not one "
                                "(write to a file of your own: `factory schema > spec.schema.json`)")
    return root


def outputs() -> dict[Path, str]:
    """Each generated file (relative to the checkout) and its current text."""
    return {SCHEMA_FILE: json_schema_text(), REFERENCE_FILE: markdown()}


def write(root: Path) -> list[Path]:
    """Rewrite the generated files under `root`; the ones whose text changed."""
    changed = []
    for rel, text in outputs().items():
        path = root / rel
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            changed.append(rel)
    return changed
