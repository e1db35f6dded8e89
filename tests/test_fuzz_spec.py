"""Fuzzing the spec front end: a corpus of broken specs made from the shipped ones (deleted keys, swapped
types, unknown keys, bad YAML, bad references) always gives exit code 2 and `file:line` on every error,
never a traceback or exit 1.

Hypothesis draws the mutations (derandomized, so CI sees the same corpus every time and a failure
reproduces; FACTORY_FUZZ_EXAMPLES raises the count for a longer local run). Every mutant is checked
through `factory check` in-process: ~25 ms each.
"""
from __future__ import annotations

import copy
import os
import re
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from factory.commands import cli
from factory.compiler.errors import SpecErrors
from factory.compiler.load import load_spec
from factory.compiler.translate import _strip

REPO = Path(__file__).resolve().parents[1]
SPECS = ["specs/tiny.yaml", "specs/calculator.yaml", "specs/quickstart.yaml"]
EXAMPLES = int(os.environ.get("FACTORY_FUZZ_EXAMPLES", "150"))  # ~10 s in all on a 2-core AMD EPYC Zen 4
# An error line: `FILE:LINE: ...` or `<override N>: ...`; snippet lines under it start with spaces.
LOCATED = re.compile(r"^(?:(?P<file>.+?):(?P<line>\d+)|<override \d+>): ")

Path_ = tuple[Any, ...]


# ------------------------------------------------------------------------------------------ corpus
def _raw(spec: str) -> dict[str, Any]:
    return yaml.safe_load((REPO / spec).read_text())


def _get(data: Any, path: Path_) -> Any:
    for p in path:
        data = data[p]
    return data


def _keys(data: Any, prefix: Path_ = ()) -> list[Path_]:
    """Every mapping key and list item path in the raw YAML data."""
    out: list[Path_] = []
    if isinstance(data, dict):
        for k, v in data.items():
            out.append(prefix + (k,))
            out += _keys(v, prefix + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out.append(prefix + (i,))
            out += _keys(v, prefix + (i,))
    return out


def _typed_fields(model: BaseModel, prefix: Path_ = ()) -> list[tuple[Path_, Any, BaseModel]]:
    """(path, annotation, owning model) of every schema field of a validated spec, nested sections and
    the tool/reward nodes included: the places where the schema fixes a type."""
    out = []
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        out.append((prefix + (name,), _strip(info.annotation), model))
        if isinstance(value, BaseModel):
            out += _typed_fields(value, prefix + (name,))
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(item, BaseModel):
                    out += _typed_fields(item, prefix + (name, key))
    return out


def _wrong_value(ann: Any, choice: int) -> Any | None:
    """A value no field of type `ann` accepts (None when the type accepts anything)."""
    origin = typing.get_origin(ann)
    if ann is typing.Any or ann is object:
        return None
    if ann is bool:
        return ["maybe", 7, [True]][choice % 3]
    if ann in (int, float):
        return ["fast", [1, 2], {"a": 1}][choice % 3]
    if ann is str:
        return [12, [1], {"a": 1}][choice % 3]
    if origin is typing.Literal:
        return ["no-such-choice", [1], {"a": 1}][choice % 3]
    if origin in (list, tuple):
        return ["scalar", {"a": 1}, 5][choice % 3]
    if origin is dict:
        return [[1, 2], "scalar", 5][choice % 3]
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [[1, 2], "scalar", 5][choice % 3]
    if typing.get_origin(ann) in (typing.Union, __import__("types").UnionType):
        return [[1, {"a": 1}], 3.5, True][choice % 3] if str not in typing.get_args(ann) else [[1], {"a": 1}][choice % 2]
    return None


def _delete(data: dict, path: Path_) -> None:
    parent = _get(data, path[:-1])
    del parent[path[-1]]


def _set(data: dict, path: Path_, value: Any) -> None:
    parent = data
    for p in path[:-1]:
        if isinstance(parent, dict):
            parent = parent.setdefault(p, {})
        else:
            parent = parent[p]
    parent[path[-1]] = value


def _sections(spec_obj: BaseModel) -> list[Path_]:
    """Paths of schema models (where an unknown key must be refused), not free-form mappings."""
    out: list[Path_] = [()]
    for path, ann, _ in _typed_fields(spec_obj):
        value = spec_obj
        for p in path:
            value = getattr(value, p) if isinstance(value, BaseModel) else value[p]
        if isinstance(value, BaseModel):
            out.append(path)
        elif isinstance(value, dict) and value and all(isinstance(v, BaseModel) for v in value.values()):
            out += [path + (k,) for k in value]
    return out


# Each mutation returns (new text, must it fail?). `r` is a drawn integer that picks targets and values.
def m_delete(text: str, data: dict, spec_obj: Spec_, r: int) -> tuple[str, bool]:
    paths = _keys(data)
    path = paths[r % len(paths)]
    _delete(data, path)
    must = path in {("name",), ("model",), ("model", "path"), ("data",), ("data", "train"), ("rewards",)} or (
        len(path) == 3 and path[0] == "rewards" and path[2] in ("fn", "sum", "product", "min", "max")) or (
        len(path) == 3 and path[0] == "tools" and path[2] == "command")
    return _dump(data), must


def m_swap_type(text: str, data: dict, spec_obj: Spec_, r: int) -> tuple[str, bool]:
    fields = [(p, a) for p, a, _ in _typed_fields(spec_obj) if _wrong_value(a, 0) is not None]
    path, ann = fields[r % len(fields)]
    _set(data, path, _wrong_value(ann, r // len(fields)))
    return _dump(data), True


def m_unknown_key(text: str, data: dict, spec_obj: Spec_, r: int) -> tuple[str, bool]:
    sections = _sections(spec_obj)
    path = sections[r % len(sections)]
    target = _get(data, path) if path else data
    if not isinstance(target, dict):
        _set(data, path, {})
        target = _get(data, path)
    existing = [k for k in target if isinstance(k, str) and len(k) > 3]
    if existing and r % 2:  # a near-miss typo of a real key, e.g. `group_siz`
        key = existing[r % len(existing)]
        target[key[:-1] + ("x" if key[-1] != "x" else "y")] = target.pop(key)
    else:
        target[f"zz_unknown_{r % 97}"] = 1
    return _dump(data), True


BAD_YAML = [
    ("{", "an unclosed flow mapping"), ("[a, b", "an unclosed flow list"), ("\tkey: 1", "a tab indent"),
    ("key: 'unterminated", "an unterminated quote"), ("- item\nkey: 1", "a list item among keys"),
    ("name: twice", "a duplicate key"), ("key: ${unclosed", "an unclosed interpolation"),
    ("key: [1, 2]]", "a stray bracket"), ("@at: 1", "a reserved indicator"),
]


def m_bad_yaml(text: str, data: dict, spec_obj: Spec_, r: int) -> tuple[str, bool]:
    lines = text.splitlines()
    snippet, _ = BAD_YAML[r % len(BAD_YAML)]
    at = (r // len(BAD_YAML)) % (len(lines) + 1)
    return "\n".join(lines[:at] + [snippet] + lines[at:]) + "\n", True


def _references(data: dict) -> list[tuple[Path_, str]]:
    out: list[tuple[Path_, str]] = [(("model", "path"), "factory:no-such-model"), (("model", "path"), "./no/such/dir"),
                                    (("reward",), "no_such_node"), (("metrics", "zz"), "no_such_node"),
                                    (("chat_template",), "prompts/no-such.jinja"),
                                    (("data", "prompt"), "prompts/no-such.jinja"),
                                    (("data", "train"), {"path": "no-such.jsonl"}),
                                    (("data", "train"), {"generator": "factory.data:no_such"}),
                                    (("data", "train"), {"generator": "no_such_module:fn"}),
                                    (("rewards", "zz"), {"tool": "no_such_server.tool"}),
                                    (("name",), "${no_such_key}"), (("seed",), "${oc.env:FACTORY_FUZZ_UNSET_VAR}")]
    for node, value in data.get("rewards", {}).items():
        if isinstance(value, dict) and "fn" in value:
            out += [(("rewards", node, "fn"), "rewards.math:no_such_fn"), (("rewards", node, "fn"), "no_such_mod:f"),
                    (("rewards", node, "fn"), "not an import path")]
        if isinstance(value, dict) and "sum" in value:
            out.append((("rewards", node, "sum", "no_such_node"), 1.0))
        if isinstance(value, dict) and "product" in value:
            out.append((("rewards", node, "product"), ["no_such_node"]))
    return out


def m_bad_reference(text: str, data: dict, spec_obj: Spec_, r: int) -> tuple[str, bool]:
    refs = _references(data)
    path, value = refs[r % len(refs)]
    _set(data, path, copy.deepcopy(value))
    return _dump(data), True


ODD_VALUES = [None, "", -1, 0, 1e309, "${name}", "???", True, [], {}, "x" * 5000, "\u0000", "${oc.env:HOME}"]


def m_odd_value(text: str, data: dict, spec_obj: Spec_, r: int) -> tuple[str, bool]:
    """Null, empty, negative, infinite, OmegaConf's `???`, self-references... anywhere: may even pass."""
    paths = _keys(data)
    path = paths[r % len(paths)]
    _set(data, path, copy.deepcopy(ODD_VALUES[(r // len(paths)) % len(ODD_VALUES)]))
    return _dump(data), False


ODD_KEYS: list[Any] = [1, None, True, 2.5, "", "a.b", "${name}", "\u00e9t\u00e9"]


def m_odd_key(text: str, data: dict, spec_obj: Spec_, r: int) -> tuple[str, bool]:
    """A key that is not a plain name (an integer, null, a dotted or interpolated string) in a section."""
    sections = _sections(spec_obj)
    path = sections[r % len(sections)]
    target = _get(data, path) if path else data
    if not isinstance(target, dict):
        return _dump(data), False
    target[ODD_KEYS[(r // len(sections)) % len(ODD_KEYS)]] = 1
    return _dump(data), True


WHOLE = ["", "[]\n", "just a string\n", "---\na: 1\n---\nb: 2\n", "name: x\n" * 2, "*undefined_alias\n",
         "? [a, b]\n: 1\n", "null\n", "42\n"]


def m_whole(text: str, data: dict, spec_obj: Spec_, r: int) -> tuple[str, bool]:
    return WHOLE[r % len(WHOLE)], True


Spec_ = Any
MUTATIONS = [m_delete, m_swap_type, m_unknown_key, m_bad_yaml, m_bad_reference, m_odd_value, m_odd_key, m_whole]
TEXT_LEVEL = (m_bad_yaml, m_whole)
# Command-line overrides drawn next to the file mutations: bad ones must be located as `<override N>`.
OVERRIDES = ["train.lr=abc", "rewards.total.sum=[1]", "a..b=1", "=", "novalue", "train.steps=-3",
             "rollout=[1]", "train.lr_rate=1", "rewards.total={sum: {nope: 1}}", "model.path=factory:nope",
             "train.steps=4", "seed=${oc.env:FACTORY_FUZZ_UNSET_VAR}", "data.train.size='${train.steps}'",
             "tools.zz={command: python}", "train.deepspeed.zero_stagee=1"]


def _dump(data: dict) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)


_VALID = {}


def _valid(spec: str) -> Any:
    if spec not in _VALID:
        _VALID[spec] = load_spec(REPO / spec)
    return _VALID[spec]


def mutate(spec: str, steps: list[tuple[int, int]]) -> tuple[str, bool, list[str]]:
    """The mutant's text, whether it must be refused, and what was done (for the failure message)."""
    text = (REPO / spec).read_text()
    must, done, text_broken = False, [], False
    for kind, r in steps:
        fn = MUTATIONS[kind % len(MUTATIONS)]
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError:
            data = None
        if (text_broken or not isinstance(data, dict)) and fn not in TEXT_LEVEL:
            continue  # an earlier mutation broke the text: re-dumping it might repair it (PyYAML keeps duplicates)
        text_broken = text_broken or fn in TEXT_LEVEL
        if fn not in TEXT_LEVEL:
            try:
                obj = load_spec_from_text(text)
            except SpecErrors:
                obj = None
            if obj is None:  # the spec no longer validates: type-directed mutations have nothing to walk
                obj = _valid(spec)
        else:
            obj = None
        try:
            text, m = fn(text, data, obj, r)
        except (KeyError, IndexError, TypeError):
            continue  # the target vanished with an earlier mutation (the mutator's limit, not Factory's)
        must = must or m
        done.append(f"{fn.__name__}({r})")
    return text, must, done


def load_spec_from_text(text: str) -> Any:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=True) as f:
        f.write(text)
        f.flush()
        return load_spec(f.name)


# -------------------------------------------------------------------------------------------- test
def check(path: Path, capsys: pytest.CaptureFixture[str], overrides: list[str] = ()) -> tuple[int, str]:
    code = cli.main(["check", str(path), *overrides])
    return code, capsys.readouterr().err


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the shipped specs' reward modules and prompts resolve from here


@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(spec=st.sampled_from(SPECS),
       steps=st.lists(st.tuples(st.integers(0, len(MUTATIONS) - 1), st.integers(0, 10_000)), min_size=1, max_size=3),
       overrides=st.lists(st.sampled_from(OVERRIDES), max_size=2))
def test_broken_specs_exit_2_with_file_and_line(spec, steps, overrides, tmp_path_factory, capsys, in_repo):
    text, must_fail, done = mutate(spec, steps)
    path = tmp_path_factory.getbasetemp() / "fuzz" / Path(spec).name
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    code, err = check(path, capsys, overrides)
    where = f"mutations {done} and overrides {overrides} of {spec}:\n{text}\n--- stderr ---\n{err}"
    assert code in (0, 2), where
    if must_fail:
        assert code == 2, where
    if code == 2:
        lines = err.splitlines()
        assert lines[-1].endswith(f"in {path}") and "internal error" not in err, where
        errors = [ln for ln in lines[:-1] if not ln.startswith(" ") and ": warning: " not in ln]
        assert errors, where
        for ln in errors:
            m = LOCATED.match(ln)
            assert m and (m["file"] is None or m["file"] == str(path)), f"unlocated: {ln!r}\n{where}"
