"""Conventions users bring: `extends:`, `--key value` overrides, `factory --version`, Hugging Face hub ids
through the local cache, and TRL / Axolotl names answered with Factory's keys. Spec errors keep exit code
2 and FILE:LINE, never a traceback."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from factory.commands import cli
from factory.compiler.compile import compile_file
from factory.compiler.errors import SpecErrors
from factory.compiler.translate import PEER_NAMES
from factory.schema import Spec
from tests.test_compiler_support import base_spec

REPO = Path(__file__).resolve().parents[1]


def _errors(*args, **kwargs) -> str:
    with pytest.raises(SpecErrors) as e:
        compile_file(*args, **kwargs)
    return e.value.report()


def _factory(*args: str, cwd: Path, **env_vars: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), **env_vars}
    env.pop("FACTORY_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "factory.commands.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------------------------------- extends
def test_extends_merges_the_overlay_over_its_base(project):
    project.file("base/base.yaml", base_spec(project, "ext_ok") + "train: {steps: 4, lr: 1.0e-4}\n"
                                   "algorithm: {clip: [0.2, 0.28], mini_batches: 2}\n")
    path = project.spec("extends: base/base.yaml\nname: over\ntrain: {steps: 9}\nalgorithm: {clip: [0.1, 0.1]}\n")
    spec, plan = compile_file(path, ["seed=5"])
    assert (spec.name, spec.seed, spec.train.steps, spec.train.lr) == ("over", 5, 9, 1e-4)  # train merged key by key
    assert spec.algorithm.clip == (0.1, 0.1)  # a list replaces the base's
    assert "extends" not in plan.spec
    # a node named near a base's, which nothing reads: a misspelt replacement (the base's node still trains)
    typo = project.spec("extends: base/base.yaml\nname: t\nrewards:\n  corect: {fn: ext_ok:exact}\n", "t.yaml")
    assert [str(w) for w in compile_file(typo)[1].warnings] == [
        "t.yaml:4: rewards.corect: warning: a new node, which nothing reads (it is logged only), beside the base "
        "spec's 'correct' (base/base.yaml), which it does not replace: to replace that node, name it 'correct'"]
    new = project.spec("extends: base/base.yaml\nname: n\nrewards:\n  brevity: {fn: ext_ok:fmt}\n", "n.yaml")
    assert compile_file(new)[1].warnings == ()


def test_extends_replaces_a_node_or_source_of_another_kind_and_null_removes_an_entry(project, capsys):
    """Merged key by key, a base's `sum` weights stayed in a sum the spec wrote out whole (and `--explain`
    named only the spec's line), a file source over a generator's kept its `size` (an error), and no key
    could be removed."""
    project.file("data/train.jsonl", '{"question": "1+1?", "answer": "2"}\n')
    project.file("base.yaml", base_spec(project, "ext_kinds") + "rollout: {episode_timeout_s: 120}\n")
    path = project.spec("extends: base.yaml\nname: over\n"
                        "data: {train: {path: data/train.jsonl}}\n"      # a file's source over a generator's
                        "rewards:\n  fmt: {min: [correct]}\n"           # an fn node made a min node
                        "  total: {sum: {correct: 1.0, fmt: null}}\n"    # null: the base's weight goes
                        "rollout: {episode_timeout_s: null}\n")          # a field's null is its value
    spec, _ = compile_file(path)
    assert spec.data.train.path == "data/train.jsonl" and spec.data.train.generator is None
    assert spec.rewards["fmt"].min == ["correct"] and spec.rewards["total"].sum == {"correct": 1.0}
    assert spec.rollout.episode_timeout_s is None
    # an override's null removes an entry too; --explain names every place a merged mapping came from
    assert cli.main(["plan", path, "--explain", "rewards.total.sum.correct=null", "rewards.total.sum.fmt=2"]) == 0
    lines = {line.split(":")[0]: line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")}
    assert lines["rewards.total.sum"] == 'rewards.total.sum: {"fmt": 2.0}  # spec.yaml:6, <override 1>, <override 2>'
    merged = project.spec("extends: base.yaml\nname: m\nrewards:\n  total: {sum: {fmt: 0.5}}\n", "m.yaml")
    assert cli.main(["plan", merged, "--explain"]) == 0
    lines = {line.split(":")[0]: line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")}
    assert lines["rewards.total.sum"] == 'rewards.total.sum: {"correct": 1.0, "fmt": 0.5}  # m.yaml:4, base.yaml:8'
    # without a base, a null weight is still a mistake to report
    alone = project.spec(base_spec(project, "ext_alone").replace("fmt: 0.1}", "fmt: null}"), "alone.yaml")
    assert ("rewards.total.sum.fmt: null removes an entry that a base spec (extends) sets, and no base sets "
            "rewards.total.sum.fmt") in _errors(alone)


def test_plan_explain_says_which_file_set_each_value(project, capsys):
    project.file("base.yaml", base_spec(project, "ext_explain") + "train: {steps: 4, lr: 1.0e-4}\n")
    path = project.spec("extends: base.yaml\nname: over\ntrain:\n  steps: 9\n")
    assert cli.main(["plan", path, "--explain", "--seed", "3"]) == 0
    lines = {line.split(":")[0]: line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")}
    assert lines["name"] == 'name: "over"  # spec.yaml:2'
    assert lines["train.steps"] == "train.steps: 9  # spec.yaml:4"
    assert lines["train.lr"] == "train.lr: 0.0001  # base.yaml:9"
    assert lines["model.path"] == 'model.path: "factory:tiny-qwen3"  # base.yaml:2'
    assert lines["seed"] == "seed: 3  # <override 1>"
    assert lines["train.eval_every"] == "train.eval_every: 0  # default"


def test_errors_name_the_file_and_line_that_hold_the_value(project):
    project.file("base.yaml", base_spec(project, "ext_err") + "train: {stepz: 4}\n")
    path = project.spec("extends: base.yaml\nname: over\nrollout: {group_size: 0}\n")
    out = _factory("check", path, cwd=project.root)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr == ("base.yaml:9: train.stepz: unknown key 'stepz'; did you mean 'steps'?\n"
                          "spec.yaml:3: rollout.group_size: must be >= 1, got 0\n"
                          "2 errors in spec.yaml\n")


def test_a_project_extending_a_shipped_spec_finds_its_templates(project):
    """Factory's specs name `prompts/...` from the repository root (specs/ beside prompts/): extended from a
    project folder, the quickstart failed at its chat template, found neither here nor beside the base."""
    _, plan = compile_file(project.spec(f"extends: {REPO / 'specs' / 'quickstart.yaml'}\nname: mine\n"))
    template, prompt = plan.spec["chat_template"], plan.spec["data"]["prompt"]  # relative to the spec's folder
    assert (project.root / template).resolve() == REPO / "prompts" / "chatml_tools_compact.jinja"
    assert (project.root / prompt).resolve() == REPO / "prompts" / "arith_fewshot.jinja"


def test_a_spec_that_only_extends_another_compiles_to_the_same_plan(project, monkeypatch):
    """specs/ beside prompts/, the files named from the working directory (Factory's own layout): a spec that
    is only `extends: tiny.yaml` names, hashes and diffs its files as tiny.yaml does (its prompt was
    rewritten `../prompts/arith.jinja`: `factory diff` called two runs of the same work different)."""
    import shutil

    shutil.copytree(REPO / "prompts", project.root / "prompts")
    project.file("specs/tiny.yaml", (REPO / "specs" / "tiny.yaml").read_text())
    project.file("specs/same.yaml", "extends: tiny.yaml\n")
    monkeypatch.chdir(project.root)
    _, base = compile_file("specs/tiny.yaml")
    _, same = compile_file("specs/same.yaml")
    assert same.spec["data"]["prompt"] == base.spec["data"]["prompt"] == "prompts/arith.jinja"
    assert same.hashes == base.hashes


def test_a_base_that_is_missing_or_extends_in_a_cycle_is_an_error_at_its_line(project):
    assert _errors(project.spec("name: x\nextends: nowhere.yaml\n")) == (
        "spec.yaml:2: extends: cannot read the base spec nowhere.yaml: No such file or directory\n1 error in spec.yaml")
    project.spec("extends: b.yaml\nname: a\n", "a.yaml")
    project.spec("extends: [a.yaml]\nname: b\n", "b.yaml")
    assert _errors("a.yaml") == ("b.yaml:1: extends: specs extend each other in a cycle: a.yaml -> b.yaml -> a.yaml\n"
                                 "1 error in b.yaml")
    assert _errors(project.spec("extends: {a: 1}\nname: c\n", "c.yaml")) == (
        "c.yaml:1: extends: expected a spec file or a list of them\n1 error in c.yaml")
    # a misspelt `extends` was offered 'seed': the key is read before validation, so it was no candidate
    assert "d.yaml:1: extend: unknown key 'extend'; did you mean 'extends'?" in _errors(
        project.spec("extend: a.yaml\nname: d\n", "d.yaml"))
    # given as an override it was "unknown key 'extends'; did you mean 'extends'?"
    assert _errors(project.spec(base_spec(project, "ext"), "e.yaml"), ["extends=a.yaml"]) == (
        "<override 1>: extends: `extends` is read from the spec file only: write it in the file, or make a spec "
        "that extends this one\n1 error in e.yaml")


# --------------------------------------------------------------------------------- the command line
def test_dashed_overrides_are_dot_list_overrides(project, capsys):
    path = project.spec(base_spec(project, "dash"))
    assert cli.main(["plan", path, "--json", "--train.steps", "7", "--train.lr=3e-4", "rollout.group_size=2",
                     "--rewards.total.sum.fmt", "-1"]) == 0  # a negative value after a dashed key
    spec = capsys.readouterr().out
    assert '"steps": 7' in spec and '"lr": 0.0003' in spec and '"group_size": 2' in spec and '"fmt": -1' in spec
    # a space before '=' (a quoted shell word) made the key "steps ", blamed on the spec file's train section
    assert cli.main(["plan", path, "--json", "train.steps =5"]) == 0 and '"steps": 5' in capsys.readouterr().out
    assert cli.dashed_overrides(["--a.b", "1", "--c=2", "d=3", "--e"]) == (["a.b=1", "c=2", "d=3"], ["--e"])
    out = _factory("check", path, "--train.steps", cwd=project.root)
    assert out.returncode == 2 and out.stderr.endswith(
        "error: unrecognized arguments: --train.steps (an override takes a value: --KEY VALUE or --KEY=VALUE)\n")
    # before the spec, argparse took the value for the spec and the key had "no value", though it had one
    with pytest.raises(SystemExit) as e:
        cli.main(["check", "--train.steps", "3", path])
    assert e.value.code == 2 and capsys.readouterr().err.endswith(
        "error: unrecognized arguments: --train.steps (overrides go after the spec, written KEY=VALUE: factory check "
        "SPEC train.steps=3)\n")
    with pytest.raises(SystemExit):  # before the spec without its value: no value, not the spec as the value
        cli.main(["check", "--train.steps", path])
    assert capsys.readouterr().err.endswith(
        "error: unrecognized arguments: --train.steps (an override takes a value: --KEY VALUE or --KEY=VALUE)\n")
    # a mistyped option of the command is one, not an override without its value
    with pytest.raises(SystemExit):
        cli.main(["check", path, "--conect"])
    assert capsys.readouterr().err.endswith("error: unrecognized arguments: --conect; did you mean --connect?\n")


def test_version():
    out = _factory("--version", cwd=REPO)
    assert out.returncode == 0 and re.fullmatch(r"factory \S+\n", out.stdout)


# ------------------------------------------------------------------------------------------ hub ids
def _hub_cache(root: Path, repo_id: str, weights: bool = True) -> Path:
    """A Hugging Face cache holding one model as huggingface_hub lays it out: refs/main names the commit
    whose snapshot folder holds the files."""
    repo = root / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / "0123456789abcdef"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"model_type": "qwen3", "num_attention_heads": 4}')
    if weights:
        (snapshot / "model.safetensors").write_bytes(b"")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123456789abcdef")
    return snapshot


def test_a_hub_id_is_resolved_through_the_local_cache(project):
    """huggingface_hub reads HF_HOME when it is imported: each case is a fresh `factory` process."""
    snapshot = _hub_cache(project.root / "hf", "acme/tiny-chat")
    path = project.spec(base_spec(project, "hub").replace('"factory:tiny-qwen3"', "acme/tiny-chat"))
    env = {"HF_HOME": str(project.root / "hf"), "HF_HUB_OFFLINE": "1"}
    out = _factory("plan", path, "--json", cwd=project.root, **env)
    assert out.returncode == 0, out.stderr
    assert f'"path": "{snapshot}"' in out.stdout  # the stages load the cached folder: no lookup, no network
    assert '"path": "acme/tiny-chat"' in out.stdout  # the spec (and its hash) keeps the hub id
    out = _factory("check", path, "model.path=acme/missing", cwd=project.root, **env)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr == (
        "<override 1>: model.path: 'acme/missing' is not a local folder, and as a Hugging Face hub id it is not in "
        "the local Hugging Face cache (hf/hub): fill the cache with `hf download acme/missing` (where the hub can "
        "be reached; copy the cache folder over to a machine that cannot reach it), or point HF_HOME at a cache "
        "that holds it\n1 error in spec.yaml\n")
    _hub_cache(project.root / "hf", "acme/config-only", weights=False)  # `hf download acme/config-only config.json`
    out = _factory("check", path, "model.path=acme/config-only", cwd=project.root, **env)
    assert out.returncode == 2 and out.stderr == (
        "<override 1>: model.path: the local Hugging Face cache (hf/hub) holds 'acme/config-only' without its weights "
        "(*.safetensors or pytorch_model*.bin files): fill it with `hf download acme/config-only`\n"
        "1 error in spec.yaml\n")


# ---------------------------------------------------------------------------------- TRL and Axolotl
def test_trl_and_axolotl_names_get_factorys_key(project):
    path = project.spec(base_spec(project, "rw_trl_names") + "beta: 0.04\nalgorithm: {epsilon: 0.2}\n"
                                                    "train: {learning_rate: 1.0e-5}\n")
    assert _errors(path, ["num_generations=4", "per_device_train_batch_size=2"]) == (
        "spec.yaml:9: beta: unknown key 'beta'; did you mean 'algorithm.kl.coef'? ('beta' is the TRL name)\n"
        "spec.yaml:10: algorithm.epsilon: unknown key 'epsilon'; did you mean 'algorithm.clip'? ('epsilon' is the "
        "TRL name)\n"
        "spec.yaml:11: train.learning_rate: unknown key 'learning_rate'; did you mean 'train.lr'? ('learning_rate' "
        "is the TRL and Axolotl name)\n"
        "<override 1>: num_generations: unknown key 'num_generations'; did you mean 'rollout.group_size'? "
        "('num_generations' is the TRL name)\n"
        "<override 2>: per_device_train_batch_size: unknown key 'per_device_train_batch_size'; did you mean "
        "'train.micro_batch'? ('per_device_train_batch_size' is the TRL name)\n"
        "5 errors in spec.yaml")


def _has(model: type, dotted: str) -> bool:
    from typing import get_args

    from pydantic import BaseModel

    for part in dotted.split("."):
        if model is None:  # the path goes on below a field that holds no model (`train.lr.x`): no such key
            return False
        field = model.model_fields.get(part)
        if field is None:
            return False
        ann = field.annotation
        model = next((a for a in (ann, *get_args(ann)) if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return True


def test_every_peer_name_maps_to_a_real_key_and_the_docs_show_the_table():
    assert _has(Spec, "train.lr") and not _has(Spec, "train.lr.x") and not _has(Spec, "train.nothing")
    assert all(_has(Spec, ours) for ours, _ in PEER_NAMES.values())
    page = (REPO / "docs" / "specs.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| ([\w ]+) \| `([\w.]+)` \|$", page, re.M)
    assert {k: (v, w) for k, w, v in rows} == PEER_NAMES
