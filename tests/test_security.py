"""Security basics: every template is rendered in a jinja sandbox, values from `${oc.env:...}` stay out of
what a run records, and nothing the model writes reaches a shell.

(That every server a run starts listens on 127.0.0.1 only, and that no env-derived value reaches the MLflow
store or the logs of a real run, is checked on real runs in tests/test_run_lifecycle.py.)
"""
from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from factory.compiler.compile import compile_file, plan_json
from factory.data import DataError, DataStage
from factory.plan import DataSettings
from factory.schema import DataSource, DataSpec, PythonTool, StdioServer
from factory.tools import ToolBox
from factory.types import ToolCall

REPO = Path(__file__).resolve().parents[1]
ESCAPE = "{{ ''.__class__.__mro__[1].__subclasses__() }}"  # the classic sandbox escape: reach `object`


def _factory_sources() -> list[tuple[Path, ast.AST]]:
    return [(p, ast.parse(p.read_text())) for p in sorted((REPO / "factory").rglob("*.py"))]


def test_every_jinja_environment_factory_makes_is_a_sandbox():
    """Templates come from users and tokenizers (chat templates ship inside model folders): no module may
    build an unsandboxed environment, and the ones it builds refuse the escape."""
    from factory.rollout.chat import compile_template
    from factory.util import template_env

    made = []
    for path, tree in _factory_sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name in ("Environment", "Template", "SandboxedEnvironment", "NativeEnvironment"):
                    made.append(f"{path.relative_to(REPO)}:{node.lineno} {name}")
    assert made == []  # only ImmutableSandboxedEnvironment, built in factory/util.py and factory/rollout/chat.py
    assert isinstance(template_env(), ImmutableSandboxedEnvironment)
    assert isinstance(compile_template("{{ x }}").environment, ImmutableSandboxedEnvironment)
    for template in (template_env().from_string(ESCAPE), compile_template(ESCAPE)):
        with pytest.raises(SecurityError):
            template.render()


def test_a_prompt_template_cannot_escape_and_the_row_is_named(tmp_path):
    (tmp_path / "evil.jinja").write_text(ESCAPE)
    (tmp_path / "rows.jsonl").write_text('{"question": "q"}\n')
    stage = DataStage(DataSettings(data=DataSpec(train=DataSource(path="rows.jsonl"), prompt="evil.jinja"), seed=0,
                                   eval_size=None, required_columns={}, base_dir=str(tmp_path)))
    with pytest.raises(DataError, match=r"^rows.jsonl:1: .*unsafe"):
        stage.setup()


def test_a_chat_template_cannot_escape():
    from factory.rollout.chat import ChatFormat

    tokenizer = SimpleNamespace(special_tokens_map={}, chat_template=None)  # rendering fails before tokenizing
    with pytest.raises(SecurityError):
        ChatFormat(tokenizer, "{% for m in messages %}" + ESCAPE + "{% endfor %}")


def test_env_values_are_masked_in_everything_a_run_records(project, monkeypatch):
    """The plan (params, plan.json, spec.yaml, tags and run name all come from it) shows `***` for every
    value read from the environment, and for defaults built from one (`checkpoint_dir: runs/${name}`)."""
    monkeypatch.setenv("FACTORY_T_NAME", "name-s3cret")
    monkeypatch.setenv("FACTORY_T_TOKEN", "tok-s3cret")
    path = project.spec("""\
        name: ${oc.env:FACTORY_T_NAME}
        model: {path: "factory:tiny-qwen3"}
        data: {train: {generator: factory.data:arithmetic, size: 8}}
        tools:
          calc: {command: python, args: [-m, factory.examples.calculator], env: {TOKEN: "${oc.env:FACTORY_T_TOKEN}"}}
        rewards:
          correct: {fn: "factory.rewards.math:exact_match"}
        tracking: {tags: {owner: "${oc.env:FACTORY_T_TOKEN}", team: rl}}
        """)
    spec, plan = compile_file(path)
    assert spec.name == "name-s3cret" and spec.train.checkpoint_dir == "runs/name-s3cret"  # the run gets them
    shown = plan_json(plan) + plan.spec_yaml
    assert "s3cret" not in shown
    assert plan.spec["name"] == plan.spec["train"]["checkpoint_dir"] == "***"
    assert plan.spec["tracking"]["tags"] == {"owner": "***", "team": "rl"}
    assert plan.spec["tools"]["calc"]["env"] == {"TOKEN": "***"}


def test_env_values_under_dotted_keys_and_copied_by_relative_interpolations_are_masked(project, monkeypatch):
    """A tag `team.token`, a generator's argument `max.operand`, a value copied through `${.KEY}` or
    `${oc.select:...}`: each `***` (the dotted paths of old never found a key holding a '.', and only absolute
    `${a.b}` copies were followed)."""
    monkeypatch.setenv("FACTORY_T_TOKEN", "tok-s3cret")
    monkeypatch.setenv("FACTORY_T_MAX", "917")
    project.file("gen.py", "def g(n, seed, **kw):\n    return [{'question': '1+1', 'answer': '2'}] * n\n")
    path = project.spec("""\
        name: demo
        model: {path: "factory:tiny-qwen3"}
        data: {train: {generator: gen:g, size: 8, args: {"max.operand": "${oc.env:FACTORY_T_MAX}"}}}
        tools:
          calc: {command: python, args: [-m, factory.examples.calculator],
                 env: {TOKEN: "${oc.env:FACTORY_T_TOKEN}", AUTH: "Bearer ${.TOKEN}"}}
        rewards:
          correct: {fn: "factory.rewards.math:exact_match"}
        tracking: {tags: {"team.token": "${oc.env:FACTORY_T_TOKEN}", owner: "${oc.select:tools.calc.env.TOKEN}"}}
        """)
    spec, plan = compile_file(path)
    assert spec.tools["calc"].env["AUTH"] == "Bearer tok-s3cret"  # the run gets them
    shown = plan_json(plan) + plan.spec_yaml
    assert "s3cret" not in shown and "917" not in shown
    assert plan.spec["tracking"]["tags"] == {"team.token": "***", "owner": "***"}
    assert plan.spec["tools"]["calc"]["env"] == {"TOKEN": "***", "AUTH": "***"}
    assert plan.spec["data"]["train"]["args"] == {"max.operand": "***"}


def _shell_calls(tree: ast.AST) -> list[int]:
    """Lines that start a shell: os.system/os.popen, asyncio's *_shell, subprocess with shell=True."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if name in ("system", "popen", "create_subprocess_shell", "getoutput", "getstatusoutput", "spawnlp"):
            lines.append(node.lineno)
        for kw in node.keywords:
            if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                lines.append(node.lineno)
    return lines


def test_no_shell_anywhere_in_factory():
    """Tool servers are started as argv lists (the MCP SDK's stdio client execs them, no shell), arguments
    travel as JSON-RPC; nothing in factory/ (the example servers included) starts a shell."""
    found = [f"{p.relative_to(REPO)}:{line}" for p, tree in _factory_sources() for line in _shell_calls(tree)]
    assert found == []


def shell_probe(text: str) -> str:
    """Echo the text.

    Args:
        text: anything
    """
    return text


PAYLOADS = ["1+1; touch {marker}", "$(touch {marker})", "`touch {marker}`", "1 | touch {marker}",
            "__import__('os').system('touch {marker}')"]


def test_tool_arguments_never_reach_a_shell(tmp_path):
    marker = tmp_path / "PWNED"
    texts = [p.format(marker=marker) for p in PAYLOADS]
    calc = StdioServer(command="python", args=["-m", "factory.examples.calculator"], timeout_s=10)

    async def go():
        async with ToolBox.from_spec({"calc": calc, "probe": PythonTool(function=f"{__name__}:shell_probe")}) as box:
            return await box.call_many([ToolCall(name, {key: t}, raw="") for t in texts
                                        for name, key in (("calculate", "expression"), ("probe", "text"))])

    results = asyncio.run(go())
    for text, refused, echoed in zip(texts, results[::2], results[1::2]):
        assert (refused.status, refused.error_kind) == ("model_error", "tool_error"), refused
        assert echoed.text == text  # a python tool gets the string as a string
    assert not marker.exists()


def test_a_world_of_ranks_meets_on_rank_0s_address_alone():
    """torch's own TCPStore server (what env:// makes) listens on every interface; the update stage's
    world meets on a store served on rank 0's address alone: loopback on a local Ray."""
    import threading

    import psutil

    from factory.update.engine import rendezvous_store
    from tests.servers import free_port

    port = free_port()
    stores = {}

    def rank(r: int) -> None:
        stores[r] = rendezvous_store("127.0.0.1", port, r, 2, timeout_s=20)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    stores[0].set("hello", "world")
    assert stores[1].get("hello") == b"world"  # the two ranks met
    listening = {c.laddr.ip for c in psutil.Process().net_connections("inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    assert listening == {"127.0.0.1"}


def test_a_local_worlds_collectives_listen_on_loopback_too():
    """gloo's pairs were kept on loopback, but NCCL's bootstrap listens on the machine's first interface that is
    not loopback unless told: a local run's CUDA update ranks listened on the machine's network."""
    from factory.update.engine import loopback_sockets

    assert loopback_sockets("127.0.0.1") == loopback_sockets("::1") == {"GLOO_SOCKET_IFNAME": "lo",
                                                                         "NCCL_SOCKET_IFNAME": "lo"}
    assert loopback_sockets("10.0.0.7") == {}  # a cluster's nodes meet on their own address


def test_the_per_user_folder_is_private_and_a_foreign_one_is_refused(tmp_path, monkeypatch):
    """Ray's session files and the driver records go in `factory-<uid>` in the temp folder: a name anyone
    can predict. Made 0700; one made by another user, or writable by others, is refused."""
    import os
    import stat

    from factory.runtime.lifecycle import UnsafeFolder, private_dir, sessions_dir

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    folder = private_dir()
    assert folder == tmp_path / f"factory-{os.getuid()}" and stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert sessions_dir() == folder / "drivers"
    folder.chmod(0o755)  # ours but readable (an older Factory made it so): closed again
    assert stat.S_IMODE(private_dir().stat().st_mode) == 0o700
    folder.chmod(0o777)  # writable by anyone: someone may have planted files already
    with pytest.raises(UnsafeFolder, match="Remove it, or set TMPDIR"):
        private_dir()
    folder.chmod(0o700)
    os.chown(folder, 12345, -1) if os.getuid() == 0 else pytest.skip("chown needs root")
    with pytest.raises(UnsafeFolder, match="owned by uid 12345"):
        private_dir()
    folder.rmdir()
    folder.symlink_to(tmp_path)  # a link to a folder of the attacker's choosing
    with pytest.raises(UnsafeFolder, match="a link"):
        private_dir()
