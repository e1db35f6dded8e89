"""Pydantic validation errors -> short, fixed messages at dotted paths.

Pydantic reports where validation failed as a `loc` tuple that also names the union member it tried
(`('tools', 'calc', 'StdioServer', 'command')`), and reports every member of a union when a node matches
none. Users think in keys, not classes: this module walks the schema along each `loc` to drop member
tags, keeps only the errors of the member the user evidently meant (the one whose distinctive key is
present: `command`, `url`, `function`; `fn`, `llm_judge`, `tool`, `sum`, ...), and words each error as
"unknown key 'lr_rate'; did you mean 'lr'?" or "expected a number, got 'fast'".
"""
from __future__ import annotations

import copy
import dataclasses
import os
import re
import shlex
import shutil
import types
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from factory.plan import MASK
from factory.util import import_path_meant, nearest  # noqa: F401 -- the compiler's modules take nearest from here

Parts = tuple[str | int, ...]


@dataclass(frozen=True)
class Problem:
    """One translated error. `node` is the path of the union node (a tool server or a reward node) the
    error lies in, if any: the loader drops such a node as a whole when it repairs a spec (for an unknown key, the
    key alone)."""

    parts: Parts
    message: str
    node: Parts | None = None
    kind: str = ""  # pydantic's error type (`missing`, `extra_forbidden`, ...); "" for node-level problems


# -------------------------------------------------------------------------------- schema walking
def _strip(ann: Any) -> Any:
    """Peel `Annotated[...]` and `X | None` down to the type that matters."""
    while True:
        origin = get_origin(ann)
        if origin is Annotated:
            ann = get_args(ann)[0]
            continue
        if origin in (Union, types.UnionType):
            args = [a for a in get_args(ann) if a is not type(None)]
            if len(args) == 1:
                ann = args[0]
                continue
        return ann


def _union_members(ann: Any) -> tuple[type, ...]:
    if get_origin(ann) in (Union, types.UnionType):
        return tuple(a for a in get_args(ann) if a is not type(None))
    return ()


def _is_model(ann: Any) -> bool:
    return isinstance(ann, type) and issubclass(ann, BaseModel)


_VALIDATED = re.compile(r"function-(?:after|before|wrap|plain)\[.*, (\w+)\]")


@dataclass
class _Loc:
    parts: list[str | int]
    model: type[BaseModel] | None  # the model whose field the last part names
    container: Any  # the annotation of what holds the last part (a model, dict, list or tuple type)
    node: Parts | None  # path of the union node passed through
    members: tuple[type, ...]  # that union's members
    tag: str | None  # the member pydantic tried
    tried: str | None = None  # the member of a union of plain types pydantic tried (`list[str]`)
    tried_at: Parts = ()  # that union's path
    models: list[tuple[Parts, type[BaseModel]]] = dataclasses.field(default_factory=list)  # (path, model) passed
    ann: Any = None  # the annotation of the value the last part names (None where the schema has none)


def walk(root: type[BaseModel], loc: tuple[Any, ...]) -> _Loc:
    """Follow a pydantic `loc` through the schema, dropping union-member tags."""
    out = _Loc([], None, None, None, (), None)
    ann: Any = root
    for item in loc:
        ann = _strip(ann)
        members = _union_members(ann)
        if members:
            by_name = {m.__name__: m for m in members if isinstance(m, type)}
            # A member with a model validator is tagged `function-after[_check(), Member]`.
            if isinstance(item, str) and (tagged := _VALIDATED.fullmatch(item)):
                item = tagged[1]
            if item in by_name:
                out.node, out.members, out.tag = tuple(out.parts), members, str(item)
                ann = by_name[item]
                continue
            if isinstance(item, str) and not any(_is_model(m) for m in members):
                # a union of plain types (`list[str] | Literal['all-linear']`): pydantic's tag for the member
                # it tried is no key of the spec
                out.tried, out.tried_at = item, tuple(out.parts)
                ann = next((m for m in members if item.startswith(getattr(get_origin(m), "__name__", "-"))), None)
                continue
        out.container = ann
        out.model = ann if _is_model(ann) else None
        if _is_model(ann):
            out.models.append((tuple(out.parts), ann))
            field = ann.model_fields.get(item) if isinstance(item, str) else None
            ann = field.annotation if field is not None else None
        elif get_origin(ann) is dict:
            ann = get_args(ann)[1]
            out.models.clear()  # past a mapping of names (a reward node, a tool server): no key above fits here
        elif get_origin(ann) in (list, tuple, set):
            args = get_args(ann)
            ann = args[0] if args else None
        else:
            ann = None
        out.parts.append(item)
    out.ann = ann
    return out


def required_keys(model: type[BaseModel]) -> list[str]:
    return [name for name, f in model.model_fields.items() if f.is_required()]


def natural_key(model: type[BaseModel]) -> str | None:
    """The key a plain value most likely stands for where `model`, a section, belongs: its one required key
    (`model: NAME` -> `model.path`), or, with none required, its first (`algorithm.name`, `data.train.path`)."""
    required = required_keys(model)
    if len(required) == 1:
        return required[0]
    return next(iter(model.model_fields), None) if not required else None


def _as_key(model: type[BaseModel], value: Any) -> dict[str, Any] | None:
    """`{key: value}` with `model`'s natural key, where that key takes `value`; else None."""
    key = natural_key(model)
    if key is None or value is None or isinstance(value, (dict, list)):
        return None
    try:
        model.model_validate({key: value})
    except ValidationError as e:
        if any(err["loc"][:1] == (key,) for err in e.errors()):
            return None
    return {key: value}


def mapping_meant(value: Any, ann: Any) -> dict[str, Any] | None:
    """The mapping a plain value or a list most likely meant where the schema wants a mapping (`ann`): a
    section's natural key (`{path: factory:tiny-qwen3-calc}`), a sum's weights given as a list of its nodes
    (`{a: 1.0, b: 1.0}`), a mapping of named nodes given as a list of their functions (`{fn: mod:f}` each, named
    by the function, the union's first kind); None where nothing evident."""
    if any(isinstance(v, Secret) for v in _leaves(value)):
        return None  # read from the environment: a mapping holding it would print it
    ann = _strip(ann)
    if _is_model(ann):
        return _as_key(ann, value)
    if get_origin(ann) is not dict or not isinstance(value, list) or not value:
        return None
    if not all(isinstance(v, str) and v for v in value) or len(set(value)) != len(value):
        return None
    inner = _strip(get_args(ann)[1])
    if inner in (float, int):  # a sum's weights
        return {v: inner(1) for v in value}
    if inner is str:  # metrics: {name: node}
        return {v: v for v in value}
    member = next((m for m in (*_union_members(inner), inner) if _is_model(m)), None)
    names = [re.split(r"[:.]", v)[-1] for v in value]  # `mod:fn` -> `fn`
    if member is None or not all(n.isidentifier() for n in names) or len(set(names)) != len(names):
        return None
    entries = {n: _as_key(member, v) for n, v in zip(names, value)}
    return entries if all(entries.values()) else None


_URL = re.compile(r"[a-z][a-z0-9+.-]*://", re.IGNORECASE)
_IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?")


def node_meant(value: Any, members: tuple[type, ...], servers: Collection[str] = ()) -> dict[str, Any] | None:
    """The node a plain string most likely meant where a union of sections goes (a reward node, a tool server):
    a URL the member keyed `url`, `mod:fn` the one keyed `function` (a python tool), `server.tool` of one of the
    spec's `servers` the one keyed `tool`, else an import path the one keyed `fn` (a reward function, written as
    the compiler takes it: `mod:fn`), a command line of a program found the one keyed `command`, split as a shell
    would; None where nothing evident."""
    if not isinstance(value, str) or isinstance(value, Secret) or not value.strip():
        return None  # (read from the environment: a mapping holding it would print it)
    by_key = {natural_key(m): m for m in members if _is_model(m)}
    if _URL.match(value):
        key = "url"
    elif ":" in value and _IMPORT_PATH.fullmatch(value):
        key = "function" if "function" in by_key else "fn"
    elif "tool" in by_key and (parts := value.partition("."))[2] and parts[0] in servers:  # (`server.tool`)
        key = "tool"
    elif "fn" in by_key and "." in value and _IMPORT_PATH.fullmatch(value):  # (a bare word: another node's name?)
        key, value = "fn", import_path_meant(value) or value
    elif "command" in by_key:
        try:
            words = shlex.split(value)
        except ValueError:  # an unclosed quote
            return None
        # a program it can start (`just a string` is no command line; `my.server` a module, or a function?)
        if not words or not (shutil.which(words[0]) or os.sep in words[0]):
            return None
        return {"command": words[0], "args": words[1:]} if len(words) > 1 else {"command": words[0]}
    else:
        return None
    return _as_key(by_key[key], value) if key in by_key else None


def flow(data: dict[str, Any]) -> str:
    """`data` as one line of YAML, each string unquoted where YAML reads it back the same
    (`{path: factory:tiny-qwen3-calc}`, which PyYAML's own dump quotes)."""
    def plain(value: Any) -> str:
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k}: {plain(v)}" for k, v in value.items()) + "}"
        if isinstance(value, list):
            return "[" + ", ".join(map(plain, value)) + "]"
        return value if isinstance(value, str) else yaml.safe_dump(value).removesuffix("...\n").strip()

    text = plain(data)
    try:
        if yaml.safe_load(text) == data:
            return text
    except yaml.YAMLError:
        pass
    return yaml.safe_dump(data, default_flow_style=True, width=2**16, sort_keys=False).strip()


def kind_keys(ann: Any) -> tuple[str, ...]:
    """The key that makes a mapping each member of a union of models (its first required field)."""
    return tuple(required_keys(m)[0] for m in _union_members(_strip(ann)) if _is_model(m) and required_keys(m))


def names_an_entry(root: type[BaseModel], parts: Parts) -> bool:
    """Whether `parts` ends at a key of a mapping of names in the schema (a reward node, one of a sum's
    weights, a tool server, a generator's argument), not at a model's field. Unions are read member by
    member."""
    anns: list[Any] = [root]
    for i, item in enumerate(parts):
        nxt: list[Any] = []
        for ann in anns:
            ann = _strip(ann)
            for member in _union_members(ann) or (ann,):
                member = _strip(member)
                if _is_model(member) and item in member.model_fields:
                    nxt.append(member.model_fields[item].annotation)
                elif get_origin(member) is dict:
                    if i == len(parts) - 1:
                        return True
                    nxt.append(get_args(member)[1])
        anns = nxt
    return False


# ------------------------------------------------------------------------------------- messages
def show(value: Any) -> str:
    """A value as the user wrote it in YAML, short."""
    if isinstance(value, Secret):
        return MASK
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, str):
        return f"'{value[:40]}...'" if len(value) > 40 else f"'{value}'"
    return str(value)


# Names users bring from TRL (GRPOConfig and its TrainingArguments) and Axolotl configs -> Factory's key
# and whose name it is. A spec that uses one gets "did you mean" with Factory's full key, wherever the name
# stands; docs/specs.md shows the same table (tests/test_conventions.py keeps the two equal).
PEER_NAMES: dict[str, tuple[str, str]] = {
    "num_generations": ("rollout.group_size", "TRL"),
    "beta": ("algorithm.kl.coef", "TRL"),
    "epsilon": ("algorithm.clip", "TRL"),
    "epsilon_high": ("algorithm.clip", "TRL"),
    "num_iterations": ("algorithm.epochs", "TRL"),
    "loss_type": ("algorithm.name", "TRL"),
    "scale_rewards": ("algorithm.advantage", "TRL"),
    "mask_truncated_completions": ("algorithm.overlong.filter", "TRL"),
    "reward_weights": ("rewards", "TRL"),
    "reward_funcs": ("rewards", "TRL"),
    "max_completion_length": ("rollout.max_new_tokens", "TRL"),
    "use_vllm": ("rollout.engine", "TRL"),
    "learning_rate": ("train.lr", "TRL and Axolotl"),
    "max_steps": ("train.steps", "TRL and Axolotl"),
    "per_device_train_batch_size": ("train.micro_batch", "TRL"),
    "micro_batch_size": ("train.micro_batch", "Axolotl"),
    "gradient_accumulation_steps": ("train.prompts_per_step", "TRL and Axolotl"),
    "warmup_steps": ("train.warmup_steps", "TRL and Axolotl"),
    "weight_decay": ("train.optimizer.weight_decay", "TRL and Axolotl"),
    "max_grad_norm": ("train.optimizer.grad_clip", "TRL and Axolotl"),
    "adam_beta1": ("train.optimizer.betas", "TRL and Axolotl"),
    "adam_beta2": ("train.optimizer.betas", "TRL and Axolotl"),
    "optim": ("train.optimizer.name", "TRL"),
    "optimizer": ("train.optimizer.name", "Axolotl"),
    "gradient_checkpointing": ("train.gradient_checkpointing", "TRL and Axolotl"),
    "save_steps": ("train.checkpoint_every", "TRL and Axolotl"),
    "eval_steps": ("train.eval_every", "TRL and Axolotl"),
    "output_dir": ("train.checkpoint_dir", "TRL and Axolotl"),
    "model_name_or_path": ("model.path", "TRL"),
    "base_model": ("model.path", "Axolotl"),
    "lora_r": ("model.lora.r", "Axolotl"),
    "lora_alpha": ("model.lora.alpha", "Axolotl"),
    "lora_dropout": ("model.lora.dropout", "Axolotl"),
    "lora_target_modules": ("model.lora.target_modules", "Axolotl"),
    "datasets": ("data.train", "Axolotl"),
    "val_set_size": ("data.eval", "Axolotl"),
    "wandb_project": ("tracking.experiment", "Axolotl"),
    "run_name": ("name", "TRL"),
}


def nested_key(key: str, model: Any) -> str | None:
    """`section.key` for a key written flat (`kl_coef`) that is a key of one of `model`'s sections (`kl: {coef}`),
    else None."""
    for name, info in model.model_fields.items():
        rest = key.removeprefix(f"{name}_")
        if rest == key:
            continue
        for kind in (info.annotation, *get_args(info.annotation)):
            if isinstance(kind, type) and issubclass(kind, BaseModel) and rest in kind.model_fields:
                return f"{name}.{rest}"
    return None


def unknown_key(key: str, valid: list[str]) -> str:
    if key in PEER_NAMES:
        ours, whose = PEER_NAMES[key]
        return f"unknown key '{key}'; did you mean '{ours}'? ('{key}' is the {whose} name)"
    near = nearest(key, valid)
    if near:
        return f"unknown key '{key}'; did you mean '{near}'?"
    return f"unknown key '{key}'; expected one of: {', '.join(valid)}"


_EXPECTED = {
    "int": "an integer", "float": "a number", "bool": "true or false", "string": "a string",
    "dict": "a mapping", "model": "a mapping", "model_attributes": "a mapping", "list": "a list",
    "tuple": "a list", "set": "a list", "iterable": "a list",
}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def message(err: dict[str, Any], where: _Loc) -> str:
    """The fixed text for one pydantic error."""
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    if kind == "extra_forbidden":
        valid = list(where.model.model_fields) if where.model is not None else []
        if len(where.parts) == 1:  # the top level: `extends` is read (and removed) before the spec is validated
            valid.append("extends")
        key = str(where.parts[-1])
        if where.model is not None and (dotted := nested_key(key, where.model)):  # `kl_coef` as `factory plan`
            return f"unknown key '{key}'; did you mean '{dotted}'?"              # lists it: `kl.coef`
        if key not in PEER_NAMES and not nearest(key, valid):
            # a key of a section above, written one level too deep (`data.train.answer_key`)
            for path, model in reversed(where.models[:-1]):
                if key in model.model_fields:
                    where, up = ".".join(map(str, path)) or "the spec", ".".join(map(str, (*path, key)))
                    return f"unknown key '{key}' here; '{key}' is a key of {where}: move it up ({up})"
        return unknown_key(key, valid)
    if kind == "missing":
        if get_origin(where.container) is tuple:  # a short list for a fixed-size tuple such as `clip`
            return f"expected a list of {len(get_args(where.container))} items"
        return "missing required key"
    for prefix, expected in _EXPECTED.items():
        if kind in (f"{prefix}_type", f"{prefix}_parsing", f"{prefix}_from_float"):
            # `tools: null` to drop a base spec's servers: null removes an entry, not a whole mapping
            hint = ("; to drop what a base spec (extends) sets here, null each of its entries ({NAME: null}); an "
                    "empty mapping is {}") if value is None and prefix == "dict" else ""
            if expected == "a mapping" and where.parts and (meant := mapping_meant(value, where.ann)):
                hint = f"; write `{where.parts[-1]}: {flow(meant)}`"  # `model: NAME` for `model: {path: NAME}`
            return f"expected {expected}, got {show(value)}{hint}"
    if kind == "finite_number":  # inf and nan, refused (Section's allow_inf_nan)
        return f"expected a finite number, got {show(value)}"
    if kind == "literal_error":
        return f"expected {ctx['expected']}, got {show(value)}"
    if kind in _BOUNDS:
        bound = next(v for k, v in ctx.items() if k in ("gt", "ge", "lt", "le"))
        if isinstance(bound, float) and bound.is_integer():  # a float field's `gt=0` reads "> 0", not "> 0.0"
            bound = int(bound)
        return f"must be {_BOUNDS[kind]} {bound}, got {show(value)}"
    if kind == "too_short" and get_origin(where.container) is not tuple and not ctx.get("actual_length"):
        n = ctx.get("min_length", 1)  # an empty `sum: {}` or `min: []`, which scored every trajectory 0
        return f"is empty: expected at least {n} item{'s' if n != 1 else ''}"
    if kind == "string_too_short":  # (pydantic's "String should have at least 1 character")
        n = ctx.get("min_length", 1)
        return (f"is empty: expected at least {n} character{'s' if n != 1 else ''}" if not value else
                f"expected at least {n} characters, got {_length(value)}")
    if kind == "string_too_long":
        return f"expected at most {ctx['max_length']} characters, got {_length(value)}"
    if kind == "too_long" and get_origin(where.container) is tuple:
        return f"expected a list of {len(get_args(where.container))} items"
    text = err["msg"].removeprefix("Value error, ")
    return text[:1].lower() + text[1:]


# ------------------------------------------------------------------------------------ translation
def _problem(err: dict[str, Any], where: _Loc, node: Parts | None = None) -> Problem:
    """A fixed-size list that is too short is wrong as a whole, not missing its last item."""
    if err["type"] == "missing" and get_origin(where.container) is tuple:
        return Problem(tuple(where.parts[:-1]), message(err, where), node, "too_short")
    return Problem(tuple(where.parts), message(err, where), node, err["type"])


def value_at(data: Any, parts: Parts | str) -> Any:
    """The value at a path of nested dicts and lists (a dotted string or its parts); None when absent."""
    if isinstance(parts, str):
        parts = tuple(parts.split("."))
    for p in parts:
        if isinstance(data, dict) and p in data or isinstance(data, list) and isinstance(p, int) and p < len(data):
            data = data[p]
        else:
            return None
    return data


def replaced(data: Any, paths: Iterable[Parts], value: Any) -> Any:
    """A copy of `data` with the value at each of `paths` replaced by `value` (paths that do not exist are
    skipped; a key read as a number from YAML is a string in a model's dump)."""
    return transformed(data, paths, lambda _: value)


def transformed(data: Any, paths: Iterable[Parts], fn: Callable[[Any], Any]) -> Any:
    """`replaced`, the value at each of `paths` replaced by `fn(value)`."""
    out = copy.deepcopy(data)
    for path in paths:
        target: Any = out
        for i, key in enumerate(path):
            if isinstance(target, dict) and (key in target or str(key) in target):
                key = key if key in target else str(key)
            elif not (isinstance(target, list) and isinstance(key, int) and 0 <= key < len(target)):
                break
            if i == len(path) - 1:
                target[key] = fn(target[key])
            else:
                target = target[key]
    return out


class Secret(str):
    """A value read from the environment (`${oc.env:...}`: a token, a private URL) as an error shows it:
    `***`, as plans do; its length is kept, for a message about the length."""

    length: int

    def __new__(cls, length: int) -> Secret:
        secret = super().__new__(cls, MASK)
        secret.length = length
        return secret


def _length(value: str) -> int:
    """The characters of `value`, of the value a Secret hides too (not its mask's 3)."""
    return value.length if isinstance(value, Secret) else len(value)


def each_leaf(value: Any, fn: Callable[[Any], Any]) -> Any:
    """`value` with each of its leaves (through dicts and lists) `fn(leaf)`, its shape kept; a null is nothing
    read from the environment and stays null. How plans mask a value (compile.mask) and errors hide one."""
    if isinstance(value, dict):
        return {k: each_leaf(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [each_leaf(v, fn) for v in value]
    return None if value is None else fn(value)


def hidden(value: Any) -> Any:
    """`value` with each of its leaves a `Secret` (its shape kept: "got a list" still says what it is); a null
    or an empty string is nothing read, kept as it is (an unset `${oc.env:EXP,""}` "is empty", not 3 characters)."""
    return each_leaf(value, lambda leaf: leaf if leaf == "" else Secret(len(str(leaf))))


def touches(parts: Parts, paths: Iterable[Parts]) -> bool:
    """Whether the value at `parts` is, or is in, or holds one of `paths` (keys compared as text)."""
    at = tuple(map(str, parts))
    return any(at[:len(p)] == p or p[:len(at)] == at for p in (tuple(map(str, p)) for p in paths))


def _leaves(value: Any) -> Iterable[Any]:
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v)
    elif value is not None and not isinstance(value, bool) and str(value):
        yield value


def scrub(message: str, value: Any, shortest: int = 1) -> str:
    """`message` with each leaf of `value` (read from the environment) of `shortest` characters or more written
    `***`, whole (not inside a longer word: a value `1` leaves `>= 10` alone) or cut as messages cut it (its first
    40 characters, or its first line's, then "...")."""
    for leaf in sorted({str(v) for v in _leaves(value)}, key=len, reverse=True):
        if len(leaf) < shortest:
            continue
        first = leaf.splitlines()[0][:40]
        for text in (leaf, f"{leaf[:40]}...", *([f"{first}..."] if first.strip() else [])):
            message = re.sub(rf"(?<!\w){re.escape(text)}(?!\w)", MASK, message)
    return message


def _without_value(err: dict[str, Any]) -> dict[str, Any]:
    """A pydantic error whose value was read from the environment, with that value hidden: `show` writes it
    `***`, and a validator's own words (`'{name}' is not a usable name`) lose it too."""
    value = err.get("input")
    return {**err, "input": hidden(value), "msg": scrub(err["msg"], value)}


def _node_problems(node: Parts, members: tuple[type, ...], errs: list[tuple[dict, _Loc]],
                   data: dict) -> list[Problem]:
    """Errors inside one union node: keep those of the member the user meant, else say what makes a node."""
    raw = value_at(data, node)
    distinctive = {m: required_keys(m) for m in members if _is_model(m)}
    all_distinctive = [k for keys in distinctive.values() for k in keys[:1]]
    if not isinstance(raw, dict):
        servers = data.get("tools") if isinstance(data, dict) and isinstance(data.get("tools"), dict) else {}
        meant = node_meant(raw, members, servers)
        hint = f"; write `{node[-1]}: {flow(meant)}`" if node and meant else ""
        return [Problem(node, f"expected a mapping with one of the keys: {', '.join(all_distinctive)}, "
                              f"got {show(raw)}{hint}", node)]
    present = [m for m, keys in distinctive.items() if keys and keys[0] in raw]
    if len(present) == 1:
        tag = present[0].__name__
        return [_problem(e, w, node) for e, w in errs if w.tag == tag]
    if len(present) > 1:
        found = ", ".join(distinctive[m][0] for m in present)
        return [Problem(node, f"expected exactly one of the keys: {', '.join(all_distinctive)}; found {found}",
                        node)]
    fields = list(dict.fromkeys(k for m in distinctive for k in m.model_fields))
    typos = [Problem(node + (k,), unknown_key(k, fields), node) for k in raw
             if k not in fields and nearest(k, fields)]
    said = f"expected one of the keys: {', '.join(all_distinctive)}"
    names = value_at(data, node[:-1])  # the node's siblings: `tools`' servers, `rewards`' nodes
    if raw and isinstance(names, dict) and (near := nearest(str(node[-1]), [k for k in names if k != node[-1]])):
        # `tools.calcx.timeout_s=3` misspells a name: it makes a new entry of that setting alone, which
        # asked for a command, url or function as if one were meant
        said += f"; or did you mean '{near}'?"
    return typos or [Problem(node, said, node)]


def _null_entry(root: type[BaseModel], problem: Problem, data: dict) -> Problem:
    """A null entry of a mapping of names (`rewards: {nothere: null}`) that no base spec (`extends`) has: null
    removes a base's entry, and where there is none to remove, "expected a number, got null" said nothing of
    that."""
    parent = value_at(data, problem.parts[:-1]) if problem.parts else None
    name = problem.parts[-1] if problem.parts else None
    if not (isinstance(parent, dict) and name in parent and parent[name] is None
            and names_an_entry(root, problem.parts)):
        return problem
    others = [str(k) for k, v in parent.items() if v is not None]
    near = nearest(str(name), others)
    hint = f"; did you mean '{near}'?" if near else ""
    where = ".".join(str(p) for p in problem.parts[:-1])
    return Problem(problem.parts, f"null removes an entry that a base spec (extends) sets, and no base sets "
                                  f"{where}.{name}{hint}", problem.node, problem.kind)


def _one_of(parts: Parts, problems: list[tuple[str, Problem]], value: Any) -> list[Problem]:
    """The errors of a union of plain types at one key, as the user meant it: a list's own errors where the
    value is a list, else one "expected a list or 'all-linear', got ..." for the whole union."""
    if isinstance(value, list):
        inside = [p for member, p in problems if member.startswith("list")]
        if inside:
            return inside
    wanted = [re.fullmatch(r"expected (.+), got .+", p.message) for _, p in problems]
    if not all(wanted):
        return [p for _, p in problems]
    first = problems[0][1]
    said = [m[1] for m in wanted if m]
    hint = ""
    if isinstance(value, str) and value:
        near = nearest(value, [w.strip("'") for w in said if w.startswith("'")])
        if near:  # `all_linear`
            hint = f"; did you mean '{near}'?"
        elif "a list" in said:  # `target_modules: q_proj` (or `q_proj, v_proj`): YAML reads one string
            hint = f"; a list is written in brackets: [{value}]"
    return [Problem(parts, f"expected {' or '.join(said)}, got {show(value)}{hint}", first.node, first.kind)]


def translate(root: type[BaseModel], errors: list[dict[str, Any]], data: dict,
              secret: Collection[Parts] = ()) -> list[Problem]:
    """All pydantic errors of one validation as problems at dotted paths (in the errors' order). `secret`: the
    paths whose values were read from the environment (`env_paths`): no message shows them (`***`)."""
    if secret:
        data = transformed(data, secret, hidden)
    plain: list[Problem] = []
    by_node: dict[Parts, list[tuple[dict, _Loc]]] = {}
    members: dict[Parts, tuple[type, ...]] = {}
    tried: dict[Parts, list[tuple[str, Problem]]] = {}
    for err in errors:
        where = walk(root, tuple(err["loc"]))
        if secret and touches(where.parts, secret):
            err = _without_value(err)
        if where.node is None and where.tried is not None:
            tried.setdefault(where.tried_at, []).append((where.tried, _problem(err, where)))
        elif where.node is None:
            plain.append(_problem(err, where))
        else:
            by_node.setdefault(where.node, []).append((err, where))
            members[where.node] = where.members
    out = list(plain)
    for parts, problems in tried.items():
        out += _one_of(parts, problems, value_at(data, parts))
    for node, errs in by_node.items():
        out += _node_problems(node, members[node], errs, data)
    return list(dict.fromkeys(_null_entry(root, p, data) for p in out))
