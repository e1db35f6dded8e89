"""Loading a spec: YAML -> OmegaConf (interpolation, `${oc.env:VAR}`, dot-list overrides) -> pydantic.

OmegaConf forgets where a value came from, so the raw YAML is also composed with PyYAML to map every
dotted path to its line; overrides are located as `<override N>`. Every problem is collected (YAML
syntax, unresolvable interpolations, unknown keys, wrong types) and raised together as `SpecErrors`.

When validation fails, the loader also *repairs* a copy of the spec (drops the offending keys so their
defaults apply, drops broken reward/tool nodes, but of a node with an unknown key only that key) so that the
compiler can still report reference errors (missing templates, bad imports, cycles) in the same run: one spec
with five mistakes shows all five.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf, grammar_parser
from omegaconf.errors import GrammarParseError, OmegaConfBaseException, UnsupportedInterpolationType
from pydantic import BaseModel, ValidationError

from factory.compiler.errors import SpecError, SpecErrors
from factory.compiler.refs import name_problem
from factory.compiler.translate import (
    Parts,
    Problem,
    kind_keys,
    names_an_entry,
    nearest,
    replaced,
    show,
    translate,
    value_at,
)
from factory.schema import RewardNode, Spec, ToolSpec
from factory.util import shown_path

_REPAIR_ROUNDS = 6  # each round drops one level of broken keys; the schema is 4 levels deep
Keys = tuple[str | int, ...]  # a value's place in the spec, key by key: a key may hold a '.' (a tag `team.token`)


def dotted(parts: Iterable[str | int]) -> str:
    return ".".join(str(p) for p in parts)


def _ancestors(path: str) -> Iterable[str]:
    """`a.b.c`, `a.b`, `a`."""
    while path:
        yield path
        path = path.rpartition(".")[0]


@dataclass(frozen=True)
class SpecSource:
    """Where a spec came from: its text, the line of every dotted path, the overrides, and which values
    were read from the environment (those are masked in printed plans)."""

    file: str  # the spec file as the user named it (shown in messages)
    base_dir: Path  # the spec file's folder (absolute): relative file references fall back to it
    text: str
    # dotted path -> (line, column) of its key; "" -> where the top-level mapping starts
    lines: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    overrides: tuple[str, ...] = ()
    override_paths: Mapping[str, int] = field(default_factory=dict)  # dotted path -> override number
    env_paths: frozenset[Keys] = frozenset()  # where a value came from ${oc.env:...} (`env_paths`)
    files: Mapping[str, str] = field(default_factory=dict)  # dotted path -> the base spec (`extends`) that set it
    folders: Mapping[str, Path] = field(default_factory=dict)  # dotted path -> that base spec's folder (absolute)

    def folder_of(self, path: str) -> Path | None:
        """The folder of the base spec (`extends`) that set the value at `path`, where a relative file it
        names starts; None when this file or an override set it."""
        if any(p in self.override_paths for p in _ancestors(path)):
            return None
        return self.folders.get(path)

    def locate(self, path: str) -> tuple[str, int | None, int]:
        """(file, line, column) for a dotted path: the override that set it or any of its parents, else
        the nearest key in the file (a missing key is located at its parent)."""
        for p in _ancestors(path):
            if p in self.override_paths:
                return f"<override {self.override_paths[p]}>", None, 0
        below = [n for p, n in self.override_paths.items() if p.startswith(path + ".")] if path else []
        # a node or section only overrides wrote (rewards.b.fn=...), or a value of the file's that an
        # override made a mapping (`train.steps.x=3` over `steps: 2`): nothing of it below in the file
        if below and not any(p.startswith(path + ".") for p in self.lines):
            return f"<override {min(below)}>", None, 0
        for p in _ancestors(path):
            if p in self.lines:
                return (self.files.get(p, self.file), *self.lines[p])
        if "" in self.lines:  # a missing top-level key: the line where the spec's mapping starts
            return (self.file, *self.lines[""])
        return self.file, None, 0

    def origin(self, path: str) -> str:
        """Which file (and line) or override set a value: `specs/base.yaml:12`, `<override 2>`, or
        `default` when no file named it (the schema's default)."""
        for p in _ancestors(path):
            if p in self.override_paths:
                return f"<override {self.override_paths[p]}>"
        # a mapping merged from several places (a base's sum and this spec's, an override of one weight):
        # each place once, the value's own line first, then each other file's first line and the overrides
        found: dict[str, str] = {}  # file (or override) -> where
        if path in self.lines:  # a key the file wrote (a parent's line is no origin of a default below it)
            found[self.files.get(path, self.file)] = f"{self.files.get(path, self.file)}:{self.lines[path][0]}"
        for p in self.lines:
            if p.startswith(path + "."):
                file = self.files.get(p, self.file)
                found.setdefault(file, f"{file}:{self.lines[p][0]}")
        for p, n in self.override_paths.items():
            if p.startswith(path + "."):
                found.setdefault(f"<override {n}>", f"<override {n}>")
        return ", ".join(found.values()) or "default"

    def error(self, path: str, message: str, level: str = "error") -> SpecError:
        for p in self.override_paths:  # a section's error about a field an override set (`gamma`): there
            if path and p.startswith(path + ".") and f"`{p[len(path) + 1:]}`" in message:
                path = p
                break
        file, line, column = self.locate(path)
        if file.startswith("<override") and (message.startswith("expected a string, got a")
                                             or message.startswith("expected a string, got") and path in self.override_paths):
            # `parse='score: ('`: the shell's quotes are gone, and YAML reads `a: b` as a mapping, `31785009` (a
            # run id's prefix) as a number
            key = (self.overrides[self.override_paths[path] - 1].partition("=")[0].strip()  # `team\\.x` as written
                   if path in self.override_paths else path)
            message += f"; an override's value is read as YAML: quote it inside, {key}=\"'...'\""
        return SpecError(file, line, path, message, level=level, column=column)  # type: ignore[arg-type]


@dataclass
class Loaded:
    """The loader's full result. `spec` is None only when the spec could not be repaired;
    `broken` names reward/tool nodes dropped by the repair (the compiler stays quiet about them)."""

    spec: Spec | None
    source: SpecSource
    errors: list[SpecError]
    broken: dict[str, set[str]] = field(default_factory=lambda: {"rewards": set(), "tools": set()})


# ------------------------------------------------------------------------------------------ YAML
class _ShapeTrouble(Exception):
    """A YAML tree OmegaConf cannot take without an internal error: an alias inside the mapping or list it names
    (`a: &x {b: *x}`), aliases that expand past any spec, values nested past any spec (MAX_SPEC_DEPTH)."""

    def __init__(self, path: str, line: int, message: str = "this alias (*name) names a mapping or list that holds "
                 "it, so the value would contain itself; copy the values instead"):
        super().__init__(path, line)
        self.path, self.line, self.message = path, line, message


MAX_SPEC_VALUES = 200_000  # aliases of aliases (a "billion laughs") expand past any spec a person writes
# Mappings and lists inside one another: the schema's deepest key is 5 levels down
# (train.deepspeed.zero_optimization.offload_optimizer.device), and a generator's or reward's args add a few.
# OmegaConf recurses ~10 frames a level, so Python's 1000 frames ran out near 75 levels ("internal error:
# RecursionError", exit 1); 32 leaves room for any real spec and for a caller's own deep stack (a notebook, a test).
MAX_SPEC_DEPTH = 32
_FAR_TOO_DEEP = (f"values nested far more than {MAX_SPEC_DEPTH} mappings or lists deep: no spec needs that many; "
                 "flatten them")


def _line_map(node: yaml.Node | None, prefix: str = "",
              out: dict[str, tuple[int, int]] | None = None, within: tuple[int, ...] = ()
              ) -> dict[str, tuple[int, int]]:
    """Dotted path -> (line, column) of its key, for every mapping key and list item of the YAML. `within`:
    the mappings and lists that hold `node`."""
    out = {} if out is None else out
    line = out.get(prefix, (node.start_mark.line + 1, 0))[0] if node is not None else 0
    if len(out) > MAX_SPEC_VALUES:
        raise _ShapeTrouble(prefix, line, f"the spec's aliases expand to more than {MAX_SPEC_VALUES:,} values; "
                                          "copy the values instead of nesting aliases")
    if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
        if id(node) in within:
            raise _ShapeTrouble(prefix, line)
        if len(within) == MAX_SPEC_DEPTH:
            raise _ShapeTrouble(prefix, line, f"values nested more than {MAX_SPEC_DEPTH} mappings or lists deep: no "
                                              "spec needs that many; flatten them")
        within = (*within, id(node))
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            path = f"{prefix}.{key.value}" if prefix else str(key.value)
            out.setdefault(path, (key.start_mark.line + 1, key.start_mark.column + 1))
            _line_map(value, path, out, within)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            path = f"{prefix}.{i}" if prefix else str(i)
            out.setdefault(path, (item.start_mark.line + 1, item.start_mark.column + 1))
            _line_map(item, path, out, within)
    return out


def _malformed(node: yaml.Node, at: Keys = ()) -> Iterable[tuple[Keys, yaml.ScalarNode, str]]:
    """Each value whose `${...}` OmegaConf's grammar refuses (`${name`), with where and why. OmegaConf.create
    refuses a whole spec at the first one, which hid every other mistake of the spec."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            yield from _malformed(value, (*at, key.value))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _malformed(item, (*at, i))
    elif isinstance(node, yaml.ScalarNode) and "${" in node.value:
        try:
            grammar_parser.parse(node.value)
        except GrammarParseError as e:
            yield at, node, _omega_message(e)


_NOT_NAMES = ("tag:yaml.org,2002:null", "tag:yaml.org,2002:bool")  # what YAML 1.1 reads `~`, `on`, `yes` as


def _not_names(node: yaml.Node, at: Keys = ()) -> Iterable[tuple[Keys, yaml.ScalarNode]]:
    """Each mapping key that YAML 1.1 reads as null or a boolean (`~:`, `null:`, `on:`, `yes:`), not as a name:
    OmegaConf refused a null one as "incompatible key type 'NoneType'" at the spec's first line, and pydantic a
    boolean one as "expected a string, got true" at a path of its own (`tracking.tags.1.[key]`)."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag in _NOT_NAMES:
                yield (*at, key.value), key
            yield from _not_names(value, (*at, key.value))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _not_names(item, (*at, i))


def _blanked(text: str, nodes: Iterable[yaml.ScalarNode], keys: Iterable[yaml.ScalarNode] = ()) -> str:
    """`text` with the values of `nodes` made '' and `keys` quoted, read as text, for OmegaConf to read the rest:
    each written over its own scalar in the text (anchors, tags, comments and every other value kept), padded with
    the line breaks it spanned, so that every line stays where it was: OmegaConf's own errors (a duplicate key) point
    at the user's lines."""
    scalars = {t.end_mark.index: t for t in yaml.scan(text, Loader=yaml.SafeLoader) if isinstance(t, yaml.ScalarToken)}
    # (a node an alias uses is met at each use: written over once)
    edits = {n.end_mark.index: (n, "''") for n in nodes}
    edits |= {k.end_mark.index: (k, "'" + k.value.replace("'", "''") + "'") for k in keys}
    for at, (node, new) in sorted(edits.items(), key=lambda edit: edit[0], reverse=True):
        # the scalar itself (the node's own marks take in its anchor and tag); an empty key (`? `, `!!null :`)
        # has none: what its node spans is written over
        token = scalars.get(at, node)
        start, end = token.start_mark.index, token.end_mark.index
        if start == end:  # (`? `'s empty key is marked right after the `?`, which wants a space after it)
            new = f" {new}"
        text = text[:start] + new + "\n" * text.count("\n", start, end) + text[end:]
    return text


def _yaml_problem(e: yaml.YAMLError, at: int | None = None) -> str:
    """What YAML found wrong, with what it was reading when it did: "but found another document" alone
    does not say that a spec is one document, and "found unexpected end of stream" alone does not say that
    a quote opened 30 lines up was never closed. `at`: the 0-based line the error is shown at (None: an
    override, which has no lines)."""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    if "'\\t'" in problem:  # PyYAML refuses a tab anywhere outside quotes (YAML 1.2 takes one before a comment)
        problem += "; YAML indents with spaces, not tabs (a tab before a comment too): replace the tab with spaces"
    context, mark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if not context or isinstance(e, yaml.constructor.ConstructorError):  # "while constructing a mapping"
        return problem
    if not context.startswith("while "):  # "expected a single document in the stream"
        return f"{context}, {problem}"
    if at is None:
        return f"{problem} ({context})"
    if mark is not None and mark.line != at:
        return f"{problem} ({context} that starts at line {mark.line + 1})"
    return problem  # "while scanning for the next token", on the line shown: nothing more to say


def _yaml_error(e: yaml.YAMLError, file: str, text: str) -> SpecError:
    """A YAML syntax error at its line, with the line and a caret under the column."""
    mark = getattr(e, "problem_mark", None)
    at_end = mark is not None and mark.index >= len(text.rstrip())
    if at_end and getattr(e, "context_mark", None) is not None:
        mark = e.context_mark  # type: ignore[attr-defined]  # the end of the file is no place to fix
    if mark is None and isinstance(getattr(e, "position", None), int):  # a character YAML refuses (NUL)
        pos: int = e.position  # type: ignore[attr-defined]
        mark = yaml.Mark("", pos, text.count("\n", 0, pos), pos - (text.rfind("\n", 0, pos) + 1), None, None)
    if mark is None:
        return SpecError(file, None, "", f"yaml syntax error: {_yaml_problem(e)}")
    lines = text.splitlines()
    code = lines[mark.line] if mark.line < len(lines) else ""
    num = str(mark.line + 1)
    snippet = f"  {num} | {code}\n  {' ' * len(num)} | {' ' * mark.column}^"
    return SpecError(file, mark.line + 1, "", f"yaml syntax error: {_yaml_problem(e, None if at_end else mark.line)}",
                     snippet=snippet)


def _omega_message(e: OmegaConfBaseException) -> str:
    """OmegaConf's message without its `full_key:`/`object_type=` trailer, in our lower-case style."""
    text = str(e).splitlines()[0]
    if isinstance(e.__cause__, KeyError) or "KeyError raised while resolving" in text:
        text = text.split(": ", 1)[-1].strip('"')
    if text.startswith("Missing mandatory value"):
        return "missing value (???)"
    text = text[:1].lower() + text[1:]
    return text + _omega_fix(e, text)


# The resolvers OmegaConf registers itself (a spec cannot register one).
_RESOLVERS = ("oc.env", "oc.select", "oc.decode", "oc.create", "oc.dict.keys", "oc.dict.values")


def _omega_fix(e: OmegaConfBaseException, text: str) -> str:
    """What to do about an interpolation OmegaConf cannot resolve, where its words alone do not say."""
    if isinstance(e, GrammarParseError) or isinstance(e.__cause__, GrammarParseError):  # `${name`
        return ("; an interpolation is `${key}` or `${resolver:args}`, closed by `}`; a literal `${` is written "
                "`\\${`")
    if isinstance(e, UnsupportedInterpolationType) and (name := re.search(r"type (\S+)", text)):  # `${nope:x}`
        known = [r for r in _RESOLVERS if OmegaConf.has_resolver(r)]
        near = nearest(name[1], known)
        return (f"; did you mean '{near}'?" if near else
                f"; `${{...}}` names another value of the spec (`${{name}}`) or a resolver: {', '.join(known)}")
    if var := re.fullmatch(r"environment variable '(.+)' not found", text):  # `${oc.env:TOKEN}`, unset
        return f"; set it, or give a default after a comma: ${{oc.env:{var[1]},DEFAULT}}"
    return ""


# ------------------------------------------------------------------------------ env-derived values
# What `${oc.env:...}` gives in the probe copy of a spec (`env_paths`): plain letters, so that any resolver
# or interpolation that carries the environment's value on (`Bearer ${.API_KEY}`, `${oc.select:...}`,
# `${oc.decode:...}`) carries the mark on too.
ENV_MARK = "FACTORYENVMARK7c41d9"
_ENV_PROBE = "factory_env_probe"
_ENV_CALL = re.compile(r"\$\{(\s*)oc\.env(\s*):")


def _probing(data: Any) -> Any:
    """`data` with every `${oc.env:...}` made `${factory_env_probe:...}`."""
    if isinstance(data, dict):
        return {k: _probing(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_probing(v) for v in data]
    return _ENV_CALL.sub(rf"${{\1{_ENV_PROBE}\2:", data) if isinstance(data, str) else data


def _env_mark(*_: Any) -> str:
    return ENV_MARK


def _marked(node: DictConfig | ListConfig, at: Keys) -> Iterable[Keys]:
    keys: Iterable[str | int] = node if isinstance(node, DictConfig) else range(len(node))
    for key in keys:
        try:
            value = node[key]  # type: ignore[index]
        except OmegaConfBaseException:
            # unresolvable in the probe: either reported already (an unset variable) or resolved only from the
            # environment's own text (`${oc.decode:${oc.env:N}}` of a mapping): masked, never shown by mistake
            yield (*at, key)
            continue
        if isinstance(value, (DictConfig, ListConfig)):
            yield from _marked(value, (*at, key))
        elif isinstance(value, str) and ENV_MARK in value:
            yield (*at, key)


def env_paths(cfg: DictConfig) -> frozenset[Keys]:
    """The places whose value came from `${oc.env:...}`, directly or through any interpolation of such a
    value (absolute `${a.b}`, relative `${.a}` and `${..a}`, `${oc.select:...}`, nested): a copy of the config
    is resolved with every `${oc.env:...}` giving ENV_MARK, and every value that holds it is one. Matching the
    interpolations' text instead missed the relative ones and every resolver."""
    if not OmegaConf.has_resolver(_ENV_PROBE):  # registered when first needed: importing Factory changes nothing
        try:
            OmegaConf.register_resolver(_ENV_PROBE, _env_mark, annotation_validation="off")  # OmegaConf 2.4's name
        except TypeError:  # 2.3: register_resolver is the legacy API, without that keyword
            OmegaConf.register_new_resolver(_ENV_PROBE, _env_mark)
    probe = OmegaConf.create(_probing(OmegaConf.to_container(cfg, resolve=False)))
    return frozenset(_marked(probe, ()))


# ------------------------------------------------------------------------------------ OmegaConf
def _apply_overrides(cfg: DictConfig, overrides: tuple[str, ...], errors: list[SpecError]
                     ) -> tuple[DictConfig, dict[str, int]]:
    paths: dict[str, int] = {}
    for n, item in enumerate(overrides, 1):
        key, eq, _ = item.partition("=")
        if not eq or not key.strip():
            # `factory check a.yaml b.yaml`: a second spec, read as an override
            second = (" (a spec file? one spec at a time: overrides after it are KEY=VALUE)"
                      if not eq and item.endswith((".yaml", ".yml")) else "")
            errors.append(SpecError(f"<override {n}>", None, "", f"expected KEY=VALUE, got '{item}'{second}"))
            continue
        if "" in key.strip().split("."):  # `.train.steps=3`, `train..steps=3`: OmegaConf makes a key ''
            errors.append(SpecError(f"<override {n}>", None, "", "expected KEY=VALUE with a dotted key such as "
                                    f"train.lr, got '{item}': a part between dots is empty"))
            continue
        if key.strip().split(".")[0] == "extends":  # read from the file before overrides apply; validated, it
            # was "unknown key 'extends'; did you mean 'extends'?"
            errors.append(SpecError(f"<override {n}>", None, "extends", "`extends` is read from the spec file "
                                    "only: write it in the file, or make a spec that extends this one"))
            continue
        if shape := _override_shape(key.strip(), item.partition("=")[2]):
            errors.append(SpecError(f"<override {n}>", None, *shape))
            continue
        if indexed := _list_index(cfg, key.strip()):
            errors.append(SpecError(f"<override {n}>", None, key.strip(), indexed))
            continue
        try:
            if _is_null(item.partition("=")[2]) and names_an_entry(Spec, tuple(key.strip().split("."))):
                # `rewards.total.sum.fmt=null`: that weight goes (see _fit_base); a misspelt one removed
                # nothing, in silence
                if not _drop(cfg, key.strip()):
                    parent, _, name = key.strip().rpartition(".")
                    node = OmegaConf.select(cfg, parent, throw_on_resolution_failure=False)
                    names = [str(k) for k in node] if isinstance(node, DictConfig) else []
                    near = nearest(name, names)
                    hint = f"; did you mean '{near}'?" if near else f"; it has: {', '.join(names) or 'nothing'}"
                    errors.append(SpecError(f"<override {n}>", None, key.strip(),
                                            f"nothing to remove: {parent} has no '{name}'{hint}"))
                    continue
            else:
                given = OmegaConf.from_dotlist([f"{key.strip()}={item.partition('=')[2]}"])  # `train.steps =3` too
                # not resolved here: `${name}` names a key of the spec, resolved once the override is merged into it
                value = OmegaConf.select(given, key.strip(), throw_on_resolution_failure=False)
                if isinstance(value, DictConfig) and not value and isinstance(
                        OmegaConf.select(cfg, key.strip(), throw_on_resolution_failure=False), DictConfig):
                    # `tools={}`: empties it (merged, an empty mapping changed nothing, in silence)
                    OmegaConf.update(cfg, key.strip(), {}, merge=False)
                    paths[_override_path(key.strip())] = n
                    continue
                if two_kinds := _swap_kind(cfg, given, key.strip()):
                    errors.append(SpecError(f"<override {n}>", None, key.strip(), two_kinds))
                    continue
                cfg = OmegaConf.merge(cfg, given)
        except (OmegaConfBaseException, yaml.YAMLError, ValueError, TypeError) as e:
            # TypeError: OmegaConf refuses to merge a list onto a mapping (`rewards.total.sum=[1]`)
            msg = (_omega_message(e) if isinstance(e, OmegaConfBaseException)
                   else f"yaml syntax error: {_yaml_problem(e)}; the value after '=' is read as YAML: quote it "
                        f"inside ({key.strip()}=\"'...'\") to give it as text" if isinstance(e, yaml.YAMLError)
                   else str(e).splitlines()[0])
            if msg.startswith("Cannot merge incompatible container types"):  # (OmegaConf's words)
                was = OmegaConf.select(cfg, key.strip(), throw_on_resolution_failure=False)
                kind = ("a mapping" if isinstance(was, DictConfig) else "a list" if isinstance(was, ListConfig)
                        else "a value")
                msg = (f"{kind} in the spec, which an override cannot replace with "
                       f"{'a list' if kind != 'a list' else 'a mapping'}: set what is inside it "
                       f"({key.strip()}.KEY=VALUE), or write the change in the spec")
            errors.append(SpecError(f"<override {n}>", None, key.strip(), msg))
            continue
        paths[_override_path(key.strip())] = n
    return cfg, paths


def _override_path(key: str) -> str:
    """The dotted path an override's KEY sets, as OmegaConf reads the key: `tracking.tags.team\\.x` sets the tag
    `team.x`, at `tracking.tags.team.x` (dotted as the spec file's lines are), where its errors are located."""
    try:
        node: Any = OmegaConf.to_container(OmegaConf.from_dotlist([f"{key}=0"]))
    except OmegaConfBaseException:
        return key
    parts = []
    while isinstance(node, dict) and len(node) == 1:
        ((name, node),) = node.items()
        parts.append(name)
    return dotted(parts)


def _override_shape(key: str, value: str) -> tuple[str, str] | None:
    """(where, why) an override is refused as a spec file would be (_line_map): nested past MAX_SPEC_DEPTH, by
    its dotted key and its value together, or its value an alias of what holds it, or aliases that expand past any
    spec. OmegaConf recursed past Python's limit on such a one ("internal error: RecursionError")."""
    parts = key.split(".")
    if len(parts) > MAX_SPEC_DEPTH:  # each part of the key is a mapping the value sits in
        return (".".join(parts[:MAX_SPEC_DEPTH]), f"values nested more than {MAX_SPEC_DEPTH} mappings or lists "
                "deep: no spec needs that many; flatten them")
    try:
        node = yaml.compose(value, Loader=yaml.SafeLoader)
        _line_map(node, key, within=(0,) * len(parts))  # (the key's mappings: no node has id 0)
    except yaml.YAMLError:
        return None  # said as OmegaConf reads the value
    except RecursionError:  # PyYAML recurses a few frames a level, as in _compose
        return key, _FAR_TOO_DEEP
    except _ShapeTrouble as e:
        return e.path, e.message
    return None


def _list_index(cfg: DictConfig, key: str) -> str | None:
    """Why an override cannot set `key`, a list's element by index (`tools.calc.args.1`, `args[1]`); None for
    any other key. OmegaConf reads the index as a mapping's key: merged over the list it was refused as "a value
    in the spec, which an override cannot replace with a list", and `name[0]` over a string made it a mapping,
    reported at the spec file's line."""
    parts = key.replace("[", ".").replace("]", "").split(".")
    for i in range(1, len(parts)):
        above = ".".join(parts[:i])
        if isinstance(OmegaConf.select(cfg, above, throw_on_resolution_failure=False), ListConfig):
            return f"an override cannot set a list's element by index: give the whole list ({above}=[...])"
    if "[" in key:
        above = key.partition("[")[0]
        return (f"an override cannot set a list's element by index, and {above} is no list here: set it whole "
                f"({above}=...)")
    return None


def _resolve(node: Any, path: str, source: SpecSource, errors: list[SpecError]) -> Any:
    """Resolve interpolations leaf by leaf so that every bad one is reported, not just the first."""
    if isinstance(node, DictConfig):
        out = {}
        for key in node:  # iterating a DictConfig gives its keys without resolving values
            p = f"{path}.{key}" if path else str(key)
            try:
                value = node[key]
            except OmegaConfBaseException as e:
                errors.append(source.error(p, _omega_message(e)))
                continue
            out[key] = _resolve(value, p, source, errors)
        return out
    if isinstance(node, ListConfig):
        out_list = []
        for i in range(len(node)):
            p = f"{path}.{i}" if path else str(i)
            try:
                value = node[i]
            except OmegaConfBaseException as e:
                errors.append(source.error(p, _omega_message(e)))
                value = None
            out_list.append(_resolve(value, p, source, errors))
        return out_list
    return node


def _file_text(path: Path) -> str:
    """A spec file's text; `ValueError` with why it cannot be read, as the user should see it."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(e.strerror or str(e)) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:  # a Latin-1 comment, or not a text file at all
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"not UTF-8 (byte 0x{data[e.start]:02x} at line {line}); a spec is YAML saved as "
                         "UTF-8") from None


def _compose(file: str, text: str, base_dir: Path, chain: tuple[Path, ...] = ()
             ) -> tuple[DictConfig, dict[str, tuple[int, int]], dict[str, str], dict[str, Path],
                        list[tuple[Keys, SpecError]]]:
    """One spec text as a DictConfig (interpolations unresolved), with the line of every dotted path and,
    for paths a base file set, that file and its folder; and each malformed `${...}` (this file's and its
    bases'), with its error: its value is '' in the DictConfig, and left out once resolved (`read_text`).
    `extends: BASE` (or a list of bases, merged in order) names specs, relative to this one's folder, that this
    one is merged over: a mapping merges key by key, any other value (a list too) replaces the base's. Errors
    that leave nothing to merge are raised."""
    too_deep = SpecError(file, None, "", _FAR_TOO_DEEP)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        raise SpecErrors([_yaml_error(e, file, text)], file) from None
    except RecursionError:  # PyYAML recurses a few frames a level: `[[[...` thousands deep (_line_map sees less)
        raise SpecErrors([too_deep], file) from None
    if root is None:
        raise SpecErrors([SpecError(file, 1, "", "the spec is empty")], file)
    if not isinstance(root, yaml.MappingNode):  # OmegaConf asserts on a bare scalar
        raise SpecErrors([SpecError(file, root.start_mark.line + 1, "",
                                    "the spec must be a mapping of keys to values")], file)
    try:
        # (the spec's own line last: an empty key's dotted path is "" too)
        lines = {**_line_map(root), "": (root.start_mark.line + 1, root.start_mark.column + 1)}
    except _ShapeTrouble as e:  # OmegaConf would recurse without end, or past Python's limit (an internal error)
        raise SpecErrors([SpecError(file, e.line, e.path, e.message)], file) from None
    # A key YAML reads as null or a boolean is read as its text (quoted), reported, and left out with its value as
    # a malformed `${...}` is, so that the spec's other mistakes are reported with it
    odd = {dotted(keys): (keys, key) for keys, key in _not_names(root)}  # (an alias's keys are met once a use)
    malformed = [(keys, SpecError(file, key.start_mark.line + 1, path, f"YAML reads the key `{key.value}` as "
                                  f"{show(yaml.safe_load(key.value))}, not as a name: quote it ('{key.value}'), or "
                                  f"write the key meant" if key.value else "YAML reads an empty key as null, not as a "
                                  "name: write the key meant", column=key.start_mark.column + 1))
                 for path, (keys, key) in odd.items()]
    found = list(_malformed(root))
    malformed += [(keys, SpecError(file, lines[dotted(keys)][0], dotted(keys), message, column=lines[dotted(keys)][1]))
                  for keys, _, message in found]
    try:
        # OmegaConf's own YAML reading: `1e-5` is a float, duplicates refused
        cfg = OmegaConf.create(_blanked(text, [node for _, node, _ in found], [key for _, key in odd.values()])
                               if found or odd else text)
    except yaml.YAMLError as e:  # (a duplicate key) with the keys and values left out, found before it
        raise SpecErrors([*(error for _, error in malformed), _yaml_error(e, file, text)], file) from None
    except OmegaConfBaseException as e:  # a malformed ${...} is refused when the config is created
        key = getattr(e, "full_key", "") or ""
        raise SpecErrors([SpecError(file, lines.get(key, lines[""])[0], key, _omega_message(e))], file) from None
    except RecursionError:  # past MAX_SPEC_DEPTH it is refused above: here only under a caller's very deep stack
        raise SpecErrors([too_deep], file) from None
    if not isinstance(cfg, DictConfig):
        raise SpecErrors([SpecError(file, 1, "", "the spec must be a mapping of keys to values")], file)
    if "extends" not in cfg:
        return cfg, lines, {}, {}, malformed
    names = OmegaConf.to_container(cfg, resolve=False)["extends"]  # as written: never interpolated
    del cfg["extends"]
    at = lines.get("extends", lines[""])[0]
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise SpecErrors([SpecError(file, at, "extends", "expected a spec file or a list of them")], file)
    merged, merged_lines, files, folders = OmegaConf.create({}), {}, {}, {}
    for name in names:
        if problem := name_problem(name):
            raise SpecErrors([SpecError(file, at, "extends", problem)], file)
        base = (base_dir / Path(name).expanduser()).resolve()
        shown = shown_path(base)
        if base in chain:
            cycle = " -> ".join(shown_path(c) for c in (*chain, base))
            raise SpecErrors([SpecError(file, at, "extends", f"specs extend each other in a cycle: {cycle}")], file)
        try:
            base_text = _file_text(base)
        except ValueError as e:
            raise SpecErrors([SpecError(file, at, "extends", f"cannot read the base spec {shown}: {e}")],
                             file) from None
        b_cfg, b_lines, b_files, b_folders, b_malformed = _compose(shown, base_text, base.parent, (*chain, base))
        malformed += b_malformed
        merged = OmegaConf.merge(merged, b_cfg)
        merged_lines.update(b_lines)
        files.update({p: b_files.get(p, shown) for p in b_lines})
        folders.update({p: b_folders.get(p, base.parent) for p in b_lines})
    for p in _fit_base(merged, cfg):  # what this file replaces or removes whole: its lines in the bases go too
        for q in [q for q in merged_lines if q == p or q.startswith(p + ".")]:
            merged_lines.pop(q)
            files.pop(q, None)
            folders.pop(q, None)
    try:
        cfg = OmegaConf.merge(merged, cfg)
    except OmegaConfBaseException as e:
        raise SpecErrors([SpecError(file, at, "extends", _omega_message(e))], file) from None
    # This file's values replace the bases'; what a replaced list or scalar held in a base is gone.
    own = {p for p in lines if p}
    replaced = [p for p in own if not isinstance(OmegaConf.select(cfg, p, throw_on_resolution_failure=False),
                                                 DictConfig)]
    for p in list(merged_lines):
        if any(p.startswith(r + ".") for r in replaced):
            merged_lines.pop(p)
            files.pop(p, None)
            folders.pop(p, None)
    for p in (*own, ""):
        files.pop(p, None)
        folders.pop(p, None)
    merged_lines.update(lines)
    merged_lines.pop("extends", None)
    return cfg, merged_lines, files, folders, malformed


# The keys that make a reward node one kind or another (fn, llm_judge, tool, sum, ...), and a data source.
_NODE_KINDS = kind_keys(RewardNode)
_SOURCE_KINDS = ("path", "generator")
_SERVER_KINDS = kind_keys(ToolSpec)  # command, url, function


def _fit_base(base: DictConfig, own: DictConfig) -> list[str]:
    """Ready the merged bases for a spec that `extends` them, where merging key by key would not do what
    the spec says; returns the dotted paths removed from `base`:
    - a reward node, tool server or data source the spec gives another kind replaces the base's whole (a `sum` node
      made an `fn` one; a generator's source made a file's: its `size` and `args` go too);
    - a key of a mapping of names (a reward node, a sum's weight, a tool server, a metric, a generator's
      argument) that the spec sets to null is removed, from the base and the spec (JSON Merge Patch's
      rule; a model's field set to null stays null)."""
    mine = OmegaConf.to_container(own, resolve=False)
    theirs = OmegaConf.to_container(base, resolve=False)
    removed = _kind_swaps(theirs, mine)
    for path in _nulls(mine):
        if value_at(theirs, path) is not None and names_an_entry(Spec, tuple(path.split("."))):
            removed.append(path)
            _drop(own, path)
    for path in removed:
        _drop(base, path)
    return removed


def _kind_swaps(theirs: dict[str, Any], mine: dict[str, Any]) -> list[str]:
    """The reward nodes, tool servers and data sources that `mine` gives another kind than `theirs` (a `sum`
    node made an `fn` one, a `command` server a `url` one, a generator's source made a file's): each replaces
    the other whole, its old keys gone."""
    def kind(value: Any, keys: tuple[str, ...]) -> str | None:
        return next((k for k in keys if k in value), None) if isinstance(value, dict) else None

    rewards = mine.get("rewards")
    swaps = [(f"rewards.{n}", _NODE_KINDS) for n in (rewards if isinstance(rewards, dict) else {})]
    tools = mine.get("tools")
    swaps += [(f"tools.{n}", _SERVER_KINDS) for n in (tools if isinstance(tools, dict) else {})]
    swaps += [(f"data.{split}", _SOURCE_KINDS) for split in ("train", "eval")]
    return [path for path, keys in swaps
            if kind(a := value_at(theirs, path), keys) and kind(b := value_at(mine, path), keys)
            and kind(a, keys) != kind(b, keys)]


def _swap_kind(cfg: DictConfig, given: DictConfig, key: str) -> str | None:
    """An override that gives a whole reward node or data source another kind (`rewards.total={fn: ...}`
    over a sum, `data.train={generator: ...}` over a file) replaces it, as `extends` does (_fit_base); merged
    key by key it held both and was refused. Returns why an override of one key of another kind
    (`tools.calc.url=...` over a command, `rewards.b.gate=...` over an fn) is refused: merged, the node held both,
    refused at the spec file's line, which held no mistake, with no way out said."""
    theirs, mine = OmegaConf.to_container(cfg, resolve=False), OmegaConf.to_container(given, resolve=False)
    for path in _kind_swaps(theirs, mine):
        if key == path:
            _drop(cfg, key)
        elif key.startswith(path + "."):
            kinds = (*_NODE_KINDS, *_SERVER_KINDS, *_SOURCE_KINDS)
            old = next(k for k in kinds if k in value_at(theirs, path))
            new = next(k for k in kinds if k in value_at(mine, path))
            return (f"{path} has `{old}` already, and `{new}` would make it hold two kinds: to change its kind, "
                    f"replace it whole: '{path}={{{new}: ...}}'")
    return None


def _is_null(text: str) -> bool:
    try:
        return text.strip() != "" and yaml.safe_load(text) is None
    except yaml.YAMLError:
        return False


def _nulls(data: Any, prefix: str = "") -> Iterable[str]:
    for key, value in data.items() if isinstance(data, dict) else ():
        if value is None:
            yield f"{prefix}{key}"
        else:
            yield from _nulls(value, f"{prefix}{key}.")


def _drop(cfg: DictConfig, path: str) -> bool:
    """Remove the key at `path`; False when there was none."""
    parent, _, key = path.rpartition(".")
    node = OmegaConf.select(cfg, parent, throw_on_resolution_failure=False) if parent else cfg
    if isinstance(node, DictConfig) and key in node:
        del node[key]
        return True
    return False


def read_config(path: str | os.PathLike, overrides: Iterable[str] = ()) -> tuple[dict, SpecSource, list[SpecError]]:
    """The spec file (merged over the specs it `extends`) and overrides as one resolved plain dict. Errors
    that leave nothing to validate (unreadable file, YAML syntax) are raised; the rest are returned."""
    file = str(path)
    try:
        text = _file_text(Path(path))
    except ValueError as e:
        # `factory.load("name: x")`: a string without a line break is a path (YAML text has one)
        hint = ("; YAML text is a string with a line break (or pass a dict)"
                if isinstance(path, str) and ": " in path and not os.path.exists(path) else "")
        raise SpecErrors([SpecError(file, None, "", f"cannot read the spec: {e}{hint}")], file) from None
    return read_text(text, file, Path(path).resolve().parent, overrides, chain=(Path(path).resolve(),))


SpecInput = str | os.PathLike | Mapping  # a spec file's path, a spec's YAML text, or the spec as a dict


def override_list(overrides: Iterable[str] | None) -> tuple[str, ...]:
    """The dot-list overrides as a tuple (None: none); TypeError for a Python mistake, said as such."""
    if overrides is None:  # (a notebook's "no overrides")
        return ()
    if isinstance(overrides, (str, bytes)):  # iterated, one string gave an "override" per character
        raise TypeError(f"overrides: a list of 'KEY=VALUE' strings, got one string: [{overrides!r}]?")
    if isinstance(overrides, Mapping):  # iterated, a dict gave its keys alone: "expected KEY=VALUE, got 'train.steps'"
        raise TypeError(f"overrides: a list of 'KEY=VALUE' strings, got a dict: "
                        f"{[f'{k}={v}' for k, v in overrides.items()]!r}?")
    overrides = tuple(overrides)
    odd = next((o for o in overrides if not isinstance(o, str)), None)
    if odd is not None:  # (an AttributeError deep in the parsing: 'tuple' object has no attribute 'partition')
        raise TypeError(f"overrides: a list of 'KEY=VALUE' strings, got {odd!r} ({type(odd).__name__})")
    return overrides


def read_spec(spec: SpecInput, overrides: Iterable[str] = ()) -> tuple[dict, SpecSource, list[SpecError]]:
    """`read_config` of a path, a YAML text (a string with a line break: named `<spec>` in messages) or a
    dict (`<dict>`, its errors located by dotted path alone); a text's or dict's relative references and
    `extends` start from the working directory."""
    overrides = override_list(overrides)
    if not isinstance(spec, (str, os.PathLike, Mapping)):
        raise TypeError(f"a spec is a path, a YAML text or a dict, got {type(spec).__name__}")
    if isinstance(spec, Mapping):
        try:
            text = yaml.safe_dump(_plain_dict(spec), sort_keys=False, allow_unicode=True)
        except yaml.YAMLError as e:
            raise SpecErrors([SpecError("<dict>", None, "", f"not plain data: {e}")], "<dict>") from None
        except RecursionError:  # both recurse a level at a time; less deep, _compose refuses it past MAX_SPEC_DEPTH
            raise SpecErrors([SpecError("<dict>", None, "", _FAR_TOO_DEEP)], "<dict>") from None
        return read_text(text, "<dict>", Path.cwd(), overrides, located=False)
    if isinstance(spec, str) and "\n" in spec:
        return read_text(spec, "<spec>", Path.cwd(), overrides)
    return read_config(spec, overrides)


def _plain_dict(data: Any) -> Any:
    """A mapping (an OmegaConf config too) as plain dicts and lists, paths as strings."""
    if isinstance(data, Mapping):
        return {str(k): _plain_dict(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_plain_dict(v) for v in data]
    return str(data) if isinstance(data, os.PathLike) else data


def read_text(text: str, file: str, base_dir: Path, overrides: Iterable[str] = (), *, chain: tuple[Path, ...] = (),
              located: bool = True) -> tuple[dict, SpecSource, list[SpecError]]:
    """`read_config` of a spec given as text: `file` names it in messages, `base_dir` is the folder its
    relative references (and `extends`) start from; `located=False` for a text nobody wrote (a spec
    given as a dict): its errors name the dotted path without a line."""
    overrides = tuple(overrides)
    cfg, lines, files, folders, malformed = _compose(file, text, base_dir, chain)
    errors = [error if located else dataclasses.replace(error, line=None) for _, error in malformed]
    cfg, override_paths = _apply_overrides(cfg, overrides, errors)
    source = SpecSource(file, base_dir, text, lines if located else {}, overrides, override_paths,
                        env_paths(cfg), files if located else {}, folders)  # type: ignore[arg-type]
    data = _resolve(cfg, "", source, errors)
    # reported: left out as a value that failed to resolve is (a list's item None, keeping the others' places)
    items = [keys for keys, _ in malformed if isinstance(keys[-1], int)]
    if items:  # (one copy for them all; none on a spec without such mistakes)
        data = replaced(data, items, None)
    for keys, _ in malformed:
        if not isinstance(keys[-1], int):
            _delete(data, keys)
    return data, source, errors


# --------------------------------------------------------------------------------------- pydantic
def _problem_errors(problems: list[Problem], source: SpecSource) -> list[SpecError]:
    return [source.error(dotted(p.parts), p.message) for p in problems]


def _delete(data: dict, parts: Parts) -> bool:
    """Remove one path from nested dicts/lists; False when there is nothing to remove."""
    parent: Any = data
    for p in parts[:-1]:
        try:
            parent = parent[p]
        except (KeyError, IndexError, TypeError):
            return False
    try:
        del parent[parts[-1]]
    except (KeyError, IndexError, TypeError):
        return False
    return True


def _repair(data: dict, problems: list[Problem], broken: dict[str, set[str]]) -> Spec | None:
    """Drop what failed until the rest validates, so the compiler can check it; None if that cannot be
    done without losing a required top-level key."""
    for _ in range(_REPAIR_ROUNDS):
        for p in problems:
            target = p.node if p.node is not None else p.parts
            missing = p.kind == "missing" and p.node is None
            if missing:  # nothing to drop at the path itself: drop its parent, whose default may do
                target = p.parts[:-1]
            if not target:
                return None
            if p.kind == "extra_forbidden":
                target = p.parts  # an unknown key alone: the rest of its node is still checked by the compiler
            elif target[0] in broken and len(target) >= 2:
                target = target[:2]  # a broken reward/tool node is dropped whole
                broken[str(target[0])].add(str(target[1]))
            if not _delete(data, target) and missing:
                return None
        try:
            return _with_default_interpolations(Spec.model_validate(data), data)
        except ValidationError as e:
            problems = translate(Spec, e.errors(), data)
        except OmegaConfBaseException:
            return None  # a default interpolates a value that was dropped: nothing sound to compile
    return None


def _default_templates(model: BaseModel, prefix: Parts = ()) -> list[tuple[Parts, str]]:
    """Fields left at a default that interpolates other values (`checkpoint_dir: runs/${name}`)."""
    out: list[tuple[Parts, str]] = []
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            out += _default_templates(value, prefix + (name,))
        elif isinstance(value, dict):
            for k, v in value.items():
                if isinstance(v, BaseModel):
                    out += _default_templates(v, prefix + (name, k))
        elif isinstance(value, str) and "${" in value and name not in model.model_fields_set:
            out.append((prefix + (name,), value))
    return out


def _escaped(data: Any) -> Any:
    """`data` (resolved values) as OmegaConf reads back the same text: `${` (an env var's `pa${ss`, a literal
    the spec escaped as `\\${...}`) escaped, and the backslashes before one doubled."""
    if isinstance(data, dict):
        return {k: _escaped(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_escaped(v) for v in data]
    return re.sub(r"(\\*)\$\{", lambda m: m[1] * 2 + "\\${", data) if isinstance(data, str) else data


def _default_values(spec: Spec, data: dict) -> dict[Parts, Any]:
    """Each interpolating default of `spec` resolved against `data`, the user's resolved values. These are
    escaped first: resolved already, a value holding `${` was interpolated a second time."""
    templates = _default_templates(spec)
    if not templates:
        return {}
    data = _escaped(data)
    for parts, template in templates:
        target = data
        for p in parts[:-1]:
            target = target.setdefault(p, {})
        target[parts[-1]] = template
    cfg = OmegaConf.create(data)
    out = {}
    for parts, _ in templates:
        node: Any = cfg
        for p in parts:
            node = node[p]
        out[parts] = node
    return out


def _with_default_interpolations(spec: Spec, data: dict) -> Spec:
    """Resolve interpolating defaults against the user's values, so the plan shows what will be used."""
    values = _default_values(spec, data)
    if not values:
        return spec
    data = copy.deepcopy(data)
    for parts, value in values.items():
        target = data
        for p in parts[:-1]:
            target = target.setdefault(p, {})
        target[parts[-1]] = value
    return Spec.model_validate(data)


def load_all(spec: SpecInput, overrides: Iterable[str] = ()) -> Loaded:
    """Load and validate (a path, YAML text or dict: `read_spec`), collecting every error; on failure also
    return a repaired spec (see module doc). Raises `SpecErrors` only when nothing can be validated
    (unreadable file, YAML syntax)."""
    data, source, errors = read_spec(spec, overrides)
    loaded = Loaded(None, source, errors)
    try:
        spec = Spec.model_validate(data)
    except ValidationError as e:
        problems = translate(Spec, e.errors(), data, source.env_paths)
        # A value whose interpolation failed was left out of `data`; it is already reported, so a
        # "missing required key" for it (or "a node needs one of the keys" for its node) only repeats it.
        failed = [err.path for err in errors]

        def repeats(p: Problem) -> bool:
            path = dotted(p.parts)
            if p.parts and isinstance(p.parts[-1], int) and path in failed:  # a list's item: None, its place kept
                return True
            return p.kind in ("missing", "") and any(f == path or f.startswith(path + ".") for f in failed)

        shown = [p for p in problems if not repeats(p)]
        loaded.errors += _problem_errors(shown, source)
        loaded.spec = _repair(copy.deepcopy(data), problems, loaded.broken)
        return loaded
    try:
        loaded.spec = _with_default_interpolations(spec, data)
    except (OmegaConfBaseException, ValidationError) as e:
        loaded.errors.append(source.error("", f"cannot resolve a default: {str(e).splitlines()[0]}"))
        return loaded
    # A default that interpolates an env-derived value (`checkpoint_dir: runs/${name}` with a name from
    # ${oc.env:...}) is env-derived too: mask it wherever the spec is shown.
    derived = {parts for parts, value in _default_values(spec, replaced(data, source.env_paths, ENV_MARK)).items()
               if isinstance(value, str) and ENV_MARK in value}
    if derived:
        loaded.source = dataclasses.replace(source, env_paths=source.env_paths | derived)
    return loaded


def remember(spec: Spec, source: SpecSource) -> Spec:
    """`spec`, knowing where it was read (`source_of`)."""
    spec._source = source
    return spec


def _mark_changed_as_set(value: Any) -> None:
    """Every model in `value` (through dicts, lists and tuples) with each field left unset that no longer holds its
    default marked set. A dict or list left at its default is each model's own copy, which a caller may change in
    place (`spec.tracking.tags["team"] = "nlp"`) without making it "set", so `model_dump(exclude_unset=True)` would
    drop the change. Only changed fields are marked: validators read `model_fields_set`. Changes `value`: a copy."""
    if isinstance(value, BaseModel):
        for name, info in type(value).model_fields.items():
            current = getattr(value, name)
            _mark_changed_as_set(current)
            if name not in value.model_fields_set and current != info.get_default(call_default_factory=True):
                value.model_fields_set.add(name)
    elif isinstance(value, Mapping):
        for item in value.values():
            _mark_changed_as_set(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _mark_changed_as_set(item)


def checked_again(spec: Spec, source: SpecSource) -> Spec:
    """`spec` validated again (knowing `source`), as loading validated it: a Spec is frozen, but its dicts and lists
    are not, and what a caller put in them (`spec.rewards["x"] = {...}`) went to the compiler unchecked (an
    internal AttributeError). Raises `SpecErrors`, as loading does."""
    marked = spec.model_copy(deep=True)  # (marked below; the caller's Spec is left as it is)
    _mark_changed_as_set(marked)
    data = marked.model_dump(exclude_unset=True, warnings=False)  # (what was set, so that defaults stay unset)
    try:
        again = Spec.model_validate(data)
    except ValidationError as e:
        raise SpecErrors(_problem_errors(translate(Spec, e.errors(), data), source), source.file) from None
    return remember(again, source)


def source_of(spec: Spec) -> SpecSource | None:
    """Where a loaded spec was read (file, lines, overrides); None for a spec built in code."""
    return spec._source


def load(path: SpecInput, overrides: Iterable[str] = ()) -> tuple[Spec, SpecSource]:
    """The validated spec (knowing its source: `source_of`) and where it came from; raises `SpecErrors`
    listing every problem."""
    loaded = load_all(path, overrides)
    if loaded.errors or loaded.spec is None:
        raise SpecErrors(loaded.errors, loaded.source.file)
    return remember(loaded.spec, loaded.source), loaded.source


def load_spec(path: SpecInput, overrides: Iterable[str] = ()) -> Spec:
    """The validated spec; raises `SpecErrors` listing every problem."""
    return load(path, overrides)[0]
