"""`factory init NAME`: the scaffold is a project that checks, connects and trains from its own folder."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from omegaconf import OmegaConf

from factory.commands import cli, reference
from factory.commands.init import SCAFFOLD, create, project_files
from factory.types import ToolCall, Turn

BIN = Path(sys.executable).parent  # the `factory` script of the environment running the tests


def _shell(command: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """A command line as a user types it, with this environment's `factory` first on PATH."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("FACTORY_DEBUG", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_init_writes_the_project(tmp_path, capsys):
    assert cli.main(["init", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert "factory check spec.yaml --connect && factory run spec.yaml train.steps=1" in out
    demo = tmp_path / "demo"
    written = sorted(p.relative_to(demo).as_posix() for p in demo.rglob("*") if p.is_file())
    assert written == sorted(project_files("demo"))
    spec = (demo / "spec.yaml").read_text()
    assert spec.splitlines()[0] == "# yaml-language-server: $schema=spec.schema.json"
    assert "\nname: demo\n" in spec and "PROJECT_NAME" not in spec
    assert (demo / ".gitignore").is_file()
    assert json.loads((demo / "spec.schema.json").read_text()) == reference.json_schema()
    data = OmegaConf.to_container(OmegaConf.create(spec), resolve=False)
    assert list(jsonschema.Draft7Validator(reference.json_schema()).iter_errors(data)) == []


def test_init_never_overwrites(tmp_path, capsys):
    demo = tmp_path / "demo"
    demo.mkdir()
    (demo / "spec.yaml").write_text("mine\n")
    assert cli.main(["init", str(demo)]) == 2
    err = capsys.readouterr().err
    assert err == (f"factory init: {demo} already has spec.yaml; factory init never overwrites files: "
                   "choose a new name or an empty folder\n")
    assert (demo / "spec.yaml").read_text() == "mine\n"
    assert not (demo / "rewards").exists()


def test_init_prints_a_next_line_the_shell_runs(tmp_path, monkeypatch, capsys):
    """The `next:` line after `factory init "My Projects/demo"` was `cd My Projects/demo && ...`: pasted, cd
    failed (too many arguments)."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["init", "My Projects/demo"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line == "  cd 'My Projects/demo' && factory check spec.yaml --connect && factory run spec.yaml train.steps=1"
    cd = line.split(" && ")[0]
    assert _shell(f"{cd} && pwd", tmp_path, timeout=10).stdout == f"{tmp_path / 'My Projects' / 'demo'}\n"


def test_init_here_and_bad_names(tmp_path, monkeypatch, capsys):
    here = tmp_path / "my-agent"
    here.mkdir()
    monkeypatch.chdir(here)
    assert cli.main(["init", "."]) == 0
    assert "\nname: my-agent\n" in (here / "spec.yaml").read_text()
    assert "next:\n  factory check spec.yaml --connect" in capsys.readouterr().out
    assert cli.main(["init", str(tmp_path / "bad name")]) == 2
    assert "is not a usable project name" in capsys.readouterr().err
    # Path("") is ".": an empty name (an unset $NAME) scaffolded into the current folder
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    assert cli.main(["init", ""]) == 2 and not any(empty.iterdir())
    assert capsys.readouterr().err == ("factory init: the project's name is empty: give the folder to create (factory "
                                       "init my-agent), or '.' for this folder\n")


def test_init_refuses_a_name_its_spec_cannot_hold(tmp_path, capsys):
    """A folder name of 201-255 characters was made into a project whose own spec failed `factory check` (a spec's
    name is at most 200 bytes: it names the checkpoint folders)."""
    import factory

    assert cli.main(["init", str(tmp_path / ("a" * 201))]) == 2
    assert capsys.readouterr().err == ("factory init: a project's name is at most 200 characters (it is its spec's "
                                       "name, which names its runs' checkpoint folders), this one has 201\n")
    assert not (tmp_path / ("a" * 201)).exists()
    create(tmp_path / ("a" * 200))
    assert factory.load(tmp_path / ("a" * 200) / "spec.yaml").name == "a" * 200


@pytest.mark.parametrize("name", ["2024", "on", "null", "1.0", "0x10", "1e5", "7E3", "12e-3"])
def test_init_of_a_name_yaml_reads_as_another_type_writes_it_as_a_string(tmp_path, name):
    """`name: 2024` (or `on`, `null`, `1.0`) is an int, a bool, null or a float: the spec `factory init` had just
    made failed `factory check` with "name: expected a string". `1e5` is a string to PyYAML, a float to the
    OmegaConf loader that reads specs."""
    import factory

    create(tmp_path / name)
    spec = factory.load(tmp_path / name / "spec.yaml")
    assert spec.name == name and spec.tracking.experiment == name
    assert f'\nname: "{name}"\n' in (tmp_path / name / "spec.yaml").read_text()


def test_init_where_it_cannot_write_says_so(tmp_path, capsys):
    """A folder that cannot be made (its parent is a file; /proc) is the user's to fix: exit 2 and why, not
    `factory: internal error: NotADirectoryError` (exit 1, "a bug in Factory")."""
    (tmp_path / "a-file").write_text("x")
    assert cli.main(["init", str(tmp_path / "a-file" / "demo")]) == 2
    assert capsys.readouterr().err == (f"factory init: {tmp_path / 'a-file'} is a file, where the project needs a "
                                       "folder: move it aside, or choose another name\n")
    assert cli.main(["init", "/proc/factory-demo"]) == 2
    assert capsys.readouterr().err.startswith("factory init: cannot write /proc/factory-demo")


def test_init_finds_a_file_where_a_folder_goes_before_it_writes_anything(tmp_path, monkeypatch, capsys):
    """`demo/tools` a file: init wrote half the project before making tools/ failed ("cannot write demo/tools:
    File exists"), and a second init refused the half it had left. A link that loops was an internal error."""
    monkeypatch.chdir(tmp_path)
    Path("demo").mkdir()
    Path("demo/tools").write_text("notes\n")
    Path("dangling").symlink_to(tmp_path / "nowhere" / "place")
    Path("loop").symlink_to("loop")
    for name, said in (("demo", "demo/tools is a file"), ("dangling/demo", "dangling is a link to nothing")):
        assert cli.main(["init", name]) == 2
        assert capsys.readouterr().err == (f"factory init: {said}, where the project needs a folder: move it aside, "
                                           "or choose another name\n")
    assert sorted(p.as_posix() for p in Path("demo").rglob("*")) == ["demo/tools"]
    assert not (tmp_path / "nowhere").exists()
    assert cli.main(["init", "loop/demo"]) == 2
    assert capsys.readouterr().err.startswith("factory init: cannot follow loop/demo: ")


def test_scaffold_reward_reads_the_models_answer():
    spec = importlib.util.spec_from_file_location("scaffold_task", SCAFFOLD / "rewards" / "task.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    correct = module.correct
    assert correct("q", "<answer>3</answer>", answer=3) == 1.0
    assert correct("q", "The answer is <answer> 3 times</answer>", answer=3) == 1.0
    assert correct("q", "<answer>4</answer>", answer=3) == 0.0
    assert correct("q", "3", answer=3) == 0.0  # no tag, no credit
    for minus in "-\u2212\ufe63\uff0d":  # a typeset minus is a sign, not nothing
        said = f"<answer>{minus}3</answer>"
        assert (correct("q", said, answer=3), correct("q", said, answer=-3)) == (0.0, 1.0)
    # With turns, only the model's own text counts: a tool result that says <answer>3</answer> does not.
    turns = [Turn(text='<tool_call>{"name": "count_letter"}</tool_call>', num_tokens=5,
                  calls=[ToolCall(name="count_letter", arguments={}, raw="")])]
    assert correct("q", "<tool_response><answer>3</answer></tool_response>", answer=3, turns=turns) == 0.0


def test_scaffold_tool_server_answers_over_mcp(tmp_path):
    """The project's own MCP server, started as the spec starts it, answers a real call."""
    from factory.schema import StdioServer
    from factory.tools import ToolBox

    create(tmp_path / "demo")
    server = StdioServer(command="python", args=["tools/letters.py"], cwd=".", timeout_s=10)

    async def call() -> list:
        box = ToolBox.from_spec({"letters": server}, base_dir=tmp_path / "demo")
        await box.start()
        try:
            ok = await box.call(ToolCall("count_letter", {"word": "Strawberry", "letter": "r"}, raw=""))
            bad = await box.call(ToolCall("count_letter", {"word": "banana", "letter": "an"}, raw=""))
            return [ok, bad]
        finally:
            await box.close()

    ok, bad = asyncio.run(call())
    assert (ok.status, ok.text) == ("ok", "3")
    assert bad.status == "model_error" and "letter must be one character" in bad.text


def test_init_check_connect_from_the_project_folder(tmp_path):
    out = _shell("factory init demo && cd demo && factory check spec.yaml --connect", tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "spec.yaml: ok" in out.stdout
    assert "letters (stdio: python tools/letters.py; tools: count_letter)" in out.stdout


def test_check_from_the_parent_folder_says_where_to_run(tmp_path):
    """The error a user meets first: python references import from the working directory."""
    out = _shell("factory init demo >/dev/null && factory check demo/spec.yaml", tmp_path, timeout=120)
    assert out.returncode == 2
    assert out.stderr == (
        "demo/spec.yaml:27: rewards.correct.fn: cannot import 'rewards.task:correct': no module named 'rewards' "
        "here; it is in demo/: run factory from that folder\n"
        "1 error in demo/spec.yaml\n")


def test_scaffold_copies_no_caches(tmp_path):
    """Only the scaffold's own files are copied, not caches left by importing its modules."""
    cache = SCAFFOLD / "rewards" / "__pycache__"
    made = not cache.exists()
    cache.mkdir(exist_ok=True)
    try:
        assert not [rel for rel in project_files("x") if "__pycache__" in rel]
    finally:
        if made:
            cache.rmdir()


@pytest.mark.slow
def test_acceptance_init_check_run_one_step(tmp_path):
    """Issue 16's acceptance, exactly as a user types it on a fresh clone."""
    out = _shell("factory init demo && cd demo && factory check spec.yaml --connect && "
                 "factory run spec.yaml train.steps=1", tmp_path, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    demo = tmp_path / "demo"
    assert (demo / "mlflow.db").is_file()
    assert (demo / "runs" / "demo" / "newest" / "latest").read_text().strip() == "step_1"
