"""`factory schema`: the JSON Schema and the reference page generated from factory/schema.py, the committed
copies kept current, and every shipped spec declared against the schema and valid under it."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
from omegaconf import OmegaConf
from pydantic import BaseModel

from factory.commands import cli, reference
from factory.presets import PRESETS
from factory.schema import Spec

REPO = Path(__file__).resolve().parents[1]
SPECS = sorted((REPO / "specs").glob("*.yaml"))
MODELINE = f"# yaml-language-server: $schema=../{reference.SCHEMA_FILE.as_posix()}"
REFRESH = f".venv/bin/{reference.REFRESH}"


def _validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(reference.json_schema())


def _spec_data(path: Path) -> dict:
    """A spec as Factory reads its YAML (OmegaConf: `1e-5` is a number), interpolations left as written."""
    return OmegaConf.to_container(OmegaConf.create(path.read_text(encoding="utf-8")), resolve=False)


def _errors(data: dict) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in _validator().iter_errors(data)]


@pytest.mark.parametrize("rel", list(reference.outputs()), ids=lambda p: p.name)
def test_committed_file_is_current(rel):
    committed = REPO / rel
    assert committed.is_file(), f"{rel} is missing: run `{REFRESH}` and commit it"
    assert committed.read_text(encoding="utf-8") == reference.outputs()[rel], (
        f"{rel} is stale (factory/schema.py or a registry changed): run `{REFRESH}` and commit the result")


def test_schema_is_a_valid_draft7_schema():
    jsonschema.Draft7Validator.check_schema(reference.json_schema())


def test_every_field_is_documented():
    """Field docstrings are the documentation: a field without one would be a blank row in the reference."""
    missing = []

    def walk(model: type[BaseModel], seen: set) -> None:
        if model in seen:
            return
        seen.add(model)
        for name, info in model.model_fields.items():
            if not (info.description or "").strip():
                missing.append(f"{model.__name__}.{name}")
        for sub in _models_below(model):
            walk(sub, seen)

    walk(Spec, set())
    assert not missing, f"fields without a docstring in factory/schema.py: {', '.join(missing)}"


def _models_below(model: type[BaseModel]) -> list[type[BaseModel]]:
    out = []

    def collect(ann):
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.append(ann)
        for arg in getattr(ann, "__args__", ()) or ():
            collect(arg)
        for meta in getattr(ann, "__metadata__", ()) or ():
            collect(meta)
        origin = getattr(ann, "__origin__", None)
        if origin is not None and origin is not ann:
            collect(origin)

    for info in model.model_fields.values():
        collect(info.annotation)
    return out


@pytest.mark.parametrize("spec", SPECS, ids=lambda p: p.name)
def test_shipped_spec_declares_the_schema(spec):
    first = spec.read_text(encoding="utf-8").splitlines()[0]
    assert first == MODELINE, f"{spec.name}: the first line must be `{MODELINE}` (editor completion and checks)"
    target = (spec.parent / MODELINE.partition("$schema=")[2]).resolve()
    assert target == (REPO / reference.SCHEMA_FILE).resolve()


@pytest.mark.parametrize("spec", SPECS, ids=lambda p: p.name)
def test_schema_validates_shipped_spec(spec):
    assert _errors(_spec_data(spec)) == []


def test_schema_rejects_a_misspelt_key():
    data = _spec_data(REPO / "specs" / "quickstart.yaml")
    typo = copy.deepcopy(data)
    typo["train"]["lr_rate"] = typo["train"].pop("lr")
    assert _errors(typo) == ["train: Additional properties are not allowed ('lr_rate' was unexpected)"]

    typo = copy.deepcopy(data)
    typo["tools"]["calc"]["timeout"] = 5  # a tool server is one of three shapes: each refuses the key
    assert [e.split(":")[0] for e in _errors(typo)] == ["tools.calc"]

    typo = copy.deepcopy(data)
    typo["rewards"]["correct"]["fn_"] = typo["rewards"]["correct"].pop("fn")
    assert [e.split(":")[0] for e in _errors(typo)] == ["rewards.correct"]


def test_schema_takes_a_spec_that_extends_another_as_an_overlay():
    """A spec with `extends` leaves required keys to its base, names a node by the keys it changes and removes
    entries with null, as the loader takes it (each was refused: an editor underlined a valid spec); its
    misspelt keys are still refused."""
    overlay = {"extends": "quickstart.yaml", "model": {"lora": {"r": 8}},
               "rewards": {"correct": {"processes": 2}, "well_formed": None, "total": {"sum": {"well_formed": None}}},
               "tools": {"calc": {"timeout_s": 10}}, "metrics": {"accuracy": None}}
    assert _errors(overlay) == []
    assert _errors({**overlay, "train": {"lr_rate": 1}}) == [
        "train: Additional properties are not allowed ('lr_rate' was unexpected)"]
    assert [e.split(":")[0] for e in _errors({**overlay, "rewards": {"correct": {"fn_": "x"}}})] == ["rewards.correct"]
    assert _errors({"name": "x"})  # without `extends`, the required keys are required


def test_schema_knows_registry_names_and_docstrings():
    schema = reference.json_schema()
    algorithm = schema["definitions"]["AlgorithmSpec"]["properties"]
    assert algorithm["name"]["enum"] == sorted(PRESETS)
    data = _spec_data(REPO / "specs" / "quickstart.yaml")
    data["algorithm"]["name"] = "grpoo"
    assert len(_errors(data)) == 1
    # Docstrings become one-line descriptions, also as markdown for editors that render it.
    lr = schema["definitions"]["TrainSpec"]["properties"]["lr"]
    assert lr == {"default": 1e-6, "description": "Learning rate.", "markdownDescription": "Learning rate.",
                  "type": "number", "exclusiveMinimum": 0}
    assert schema["definitions"]["KLSpec"]["properties"]["estimator"]["enum"] == ["k1", "k2", "k3"]


def test_reference_page_lists_every_key():
    page = reference.markdown()
    assert "| `lr` | number, > 0 | `1.0e-06` | Learning rate. |" in page
    assert "| `group_size` | integer, >= 1 | `8` | Samples per prompt (the G of GRPO). |" in page
    # A `|` in a docstring or a type (`a | b`) is escaped: every row has as many cells as its table's header.
    bars, previous = 0, ""
    for line in page.splitlines():
        if line.startswith("|"):
            count = line.replace("\\|", "").count("|")
            bars = count if not previous.startswith("|") else bars
            assert count == bars, line
        previous = line
    for model in [Spec, *_models_below(Spec)]:
        for name in model.model_fields:
            assert f"| `{name}` |" in page, name


def test_reference_lists_the_builtin_reward_functions():
    refs = [ref for ref, _ in reference.builtin_rewards()]
    assert {"factory.rewards.math:numeric_match", "factory.rewards.format:tool_call_ok"} <= set(refs)
    assert not [ref for ref in refs if ref.endswith(":extract_answer")]  # a helper, not a reward
    page = reference.markdown()
    assert ("| `factory.rewards.math:numeric_match` | `rel_tol=1e-09`, `abs_tol=0.0` | 1.0 when the first number in "
            "the &lt;answer>") \
        in page  # `<answer>` outside code would be an HTML tag to a markdown renderer: escaped
    assert "| `factory.rewards.format:tool_call_ok` | `tools=None` |" in page  # a keyword-only arg too
    for ref in refs:
        assert f"| `{ref}` |" in page


def test_cli_prints_schema_and_reference(capsys):
    assert cli.main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out) == reference.json_schema()
    assert cli.main(["schema", "--markdown"]) == 0
    assert capsys.readouterr().out == reference.markdown()


def test_write_refreshes_stale_files(tmp_path):
    (tmp_path / reference.SCHEMA_FILE).parent.mkdir(parents=True)
    (tmp_path / reference.SCHEMA_FILE).write_text("{}\n")
    assert reference.write(tmp_path) == [reference.SCHEMA_FILE, reference.REFERENCE_FILE]
    assert reference.write(tmp_path) == []
    assert (tmp_path / reference.REFERENCE_FILE).read_text() == reference.markdown()
