"""The `factory` command: subcommands, exit codes (0 ok, 2 spec error, 1 internal error), outputs."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from factory.commands import cli
from tests.test_compiler_support import BASE, make_project

REPO = Path(__file__).resolve().parents[1]
SPECS = sorted((REPO / "specs").glob("*.yaml"))


@pytest.fixture
def project(tmp_path, monkeypatch):
    return make_project(tmp_path, monkeypatch)


def _factory(*args: str, cwd: Path, **env_vars: str) -> subprocess.CompletedProcess[str]:
    """`factory ARGS` in a fresh process, as a user runs it (the source tree importable, not installed)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), **env_vars}
    env.pop("FACTORY_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "factory.commands.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def test_help_lists_the_subcommands():
    out = _factory("--help", cwd=REPO)
    assert out.returncode == 0
    for command in ("run", "check", "plan", "diff"):
        assert f"\n    {command} " in out.stdout


def test_spec_errors_exit_2_without_traceback(project):
    project.module("cli_rw")
    path = project.spec(BASE.replace("{mod}", "cli_rw") + "train: {lr_rate: 1.0e-5}\nchat_template: nowhere.jinja\n")
    out = _factory("check", path, "rollout.group_size=0", cwd=project.root)
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr == (
        "spec.yaml:9: train.lr_rate: unknown key 'lr_rate'; did you mean 'lr'?\n"
        "spec.yaml:10: chat_template: template file not found: nowhere.jinja\n"
        "<override 1>: rollout.group_size: must be >= 1, got 0\n"
        "3 errors in spec.yaml\n")
    assert "Traceback" not in out.stderr


def test_a_set_flag_before_an_override_says_overrides_stand_alone(project, capsys):
    """`--set train.steps=3` (Hydra's and other tools' way) was the override `set=train.steps=3`: "unknown key
    'set'", with the spec's top-level keys listed."""
    project.module("cli_set")
    path = project.spec(BASE.replace("{mod}", "cli_set"))
    with pytest.raises(SystemExit) as e:
        cli.main(["check", path, "--set", "train.steps=3"])
    assert e.value.code == 2 and capsys.readouterr().err.endswith(
        "error: unrecognized arguments: --set (an override is KEY=VALUE by itself, with no --set before it: factory "
        "check SPEC train.steps=3)\n")
    assert cli.main(["check", path, "--name", "a=b"]) == 0  # a key of the spec whose value holds '='


def test_check_prints_a_summary_and_exits_0(project, capsys):
    project.module("cli_ok")
    path = project.spec(BASE.replace("{mod}", "cli_ok"))
    assert cli.main(["check", path]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "spec.yaml: ok"
    assert "  rewards    correct, fmt -> total (trains the policy)" in out
    assert "  algorithm  grpo (advantage grpo, loss ppo_clip, aggregation seq_mean_token_mean)\n" in out
    assert cli.main(["check", path, "model.lora.r=8"]) == 0
    assert "  model      factory:tiny-qwen3 (LoRA r=8 on all-linear)\n" in capsys.readouterr().out
    assert cli.main(["check", path, "algorithm.name=reinforce_pp", "algorithm.kl.coef=0.01"]) == 0
    assert "  algorithm  reinforce_pp (advantage reinforce_pp, loss ppo_clip, aggregation token_mean, KL 0.01 (k1, " \
           "in the reward))\n" in capsys.readouterr().out


def test_plan_json_shows_overrides_and_is_stable(project, capsys):
    project.module("cli_plan")
    path = project.spec(BASE.replace("{mod}", "cli_plan"))
    assert cli.main(["plan", path, "train.lr=3e-6", "--json"]) == 0
    first = capsys.readouterr().out
    assert json.loads(first)["spec"]["train"]["lr"] == 3e-6
    assert cli.main(["plan", path, "--json", "train.lr=3e-6"]) == 0  # options and overrides in any order
    assert capsys.readouterr().out == first
    assert cli.main(["plan", path, "train.lr_rate=3e-6", "--json"]) == 2
    assert capsys.readouterr().err == ("<override 1>: train.lr_rate: unknown key 'lr_rate'; did you mean 'lr'?\n"
                                       "1 error in spec.yaml\n")


def test_what_user_code_prints_while_the_spec_compiles_goes_to_stderr(project, capsys):
    """A reward module that prints when imported (and a generator that prints when called) must not
    break `factory plan --json | jq` or `--dot | dot`: stdout holds the command's own output only."""
    from tests.test_compiler_support import REWARDS

    project.module("cli_loud", "print('loading my rewards')\n" + REWARDS
                   + "\ndef rows(n, seed):\n    print('generating', n)\n    return [{'question': 'q', 'answer': '1'}] * n\n")
    path = project.spec(BASE.replace("{mod}", "cli_loud").replace("factory.data:arithmetic", "cli_loud:rows"))
    assert cli.main(["plan", path, "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["spec"]["name"] == "demo"
    assert "loading my rewards\n" in out.err and "generating 8\n" in out.err
    assert cli.main(["plan", path, "--dot"]) == 0
    assert capsys.readouterr().out.startswith("digraph")
    assert cli.main(["check", path]) == 0
    assert capsys.readouterr().out.startswith("spec.yaml: ok")


def test_plan_json_is_identical_across_processes(project):
    # Two processes with different hash seeds: nothing in the plan may depend on set or dict hashing.
    project.module("cli_bytes")
    path = project.spec(BASE.replace("{mod}", "cli_bytes") + "tools:\n  b: {command: python}\n  a: {command: python}\n")
    first = _factory("plan", path, "--json", cwd=project.root, PYTHONHASHSEED="1")
    second = _factory("plan", path, "--json", cwd=project.root, PYTHONHASHSEED="2")
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout


def test_plan_text_lists_stages_edges_and_hashes(project, capsys):
    project.module("cli_text")
    assert cli.main(["plan", project.spec(BASE.replace("{mod}", "cli_text"))]) == 0
    out = capsys.readouterr().out
    for line in ("# stages", "  update.state_dict --weights--> rollout.load_weights (weight sync)", "# hashes",
                 "    cli_text.py: "):
        assert line in out
    assert cli.main(["plan", "spec.yaml", "train.lr=3e-6", "--explain"]) == 0
    explained = capsys.readouterr().out
    assert "# Learning rate.\ntrain.lr: 3e-06  # <override 1>\n" in explained
    assert '# Only these of the server\'s tools' not in explained  # no tools in this spec
    assert 'rewards.correct.fn: "cli_text:exact"' in explained
    # what the preset decides is shown as decided, not as the field's null default
    assert cli.main(["plan", "spec.yaml", "algorithm.name=dapo", "--explain"]) == 0
    explained = capsys.readouterr().out
    for line in ('algorithm.clip: [0.2, 0.28]  # preset dapo', 'algorithm.dynamic_sampling: true  # preset dapo',
                 'algorithm.kl.apply: "loss"  # default', 'algorithm.dual_clip_c: null  # default'):
        assert f"\n{line}\n" in explained, line


def test_internal_errors_exit_1_with_one_line(project, capsys, monkeypatch):
    import factory.commands.api

    def broken(*args, **kwargs):
        raise RuntimeError("the compiler fell over")

    monkeypatch.setattr(factory.commands.api, "compile_file", broken)
    monkeypatch.delenv("FACTORY_DEBUG", raising=False)
    assert cli.main(["check", "any.yaml"]) == 1
    assert capsys.readouterr().err == ("factory: internal error: RuntimeError: the compiler fell over\n"
                                       "rerun with FACTORY_DEBUG=1 to see the traceback\n")
    monkeypatch.setenv("FACTORY_DEBUG", "1")
    assert cli.main(["check", "any.yaml"]) == 1
    assert "Traceback" in capsys.readouterr().err


def test_unknown_option_is_a_usage_error():
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "x.yaml", "--jsn"])
    assert e.value.code == 2


def test_check_connect_lists_tools_and_checks_allowed_tools(project, capsys):
    project.module("cli_conn")
    base = BASE.replace("{mod}", "cli_conn") + "tools:\n  calc: {command: python, args: [-m, factory.examples.calculator]}\n"
    path = project.spec(base)
    assert cli.main(["check", path, "--connect", "tools.calc.allowed_tools=[calculat]"]) == 2
    assert capsys.readouterr().err == (
        "<override 1>: tools.calc.allowed_tools.0: server 'calc' has no tool 'calculat'; did you mean 'calculate'?\n"
        "1 error in spec.yaml\n")
    assert cli.main(["check", path, "--connect", "tools.calc.allowed_tools=[calculate]"]) == 0
    assert "calc (stdio: python -m factory.examples.calculator; tools: calculate)" in capsys.readouterr().out


def test_two_servers_with_one_tool_name_are_a_warning_and_a_qualifier_in_a_name_an_error(project, capsys):
    """The model was offered calc__calculate and calc2__calculate without a word, and check listed the plain
    names; a server named with `__` passed check and stopped `factory run` with exit 3 once Ray was up."""
    project.module("cli_dup")
    calc = "{command: python, args: [-m, factory.examples.calculator]}"
    path = project.spec(BASE.replace("{mod}", "cli_dup") + f"tools:\n  calc: {calc}\n  calc2: {calc}\n")
    assert cli.main(["check", path, "--connect"]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("spec.yaml:10: tools.calc: warning: 2 servers offer a tool 'calculate' (calc, "
                                   "calc2): the model is offered calc__calculate, calc2__calculate instead")
    assert "tools: calc__calculate); calc2 (stdio: python -m factory.examples.calculator; tools: calc2__calculate)" \
        in captured.out
    assert cli.main(["check", path, "--connect", "tools.calc2.allowed_tools=[]"]) == 0
    said = capsys.readouterr().err
    assert "2 servers offer" not in said and "tools.calc2.allowed_tools: warning: an empty list" in said
    assert cli.main(["check", path, "tools.my__calc=" + calc]) == 2
    assert capsys.readouterr().err.startswith("<override 1>: tools.my__calc: a tool server name must not contain '__'")


def test_an_override_nested_past_pythons_limit_is_a_spec_error(project, capsys):
    # it was "internal error: RecursionError", exit 1
    project.module("cli_deep")
    path = project.spec(BASE.replace("{mod}", "cli_deep"))
    assert cli.main(["check", path, "seed=" + "[" * 5000 + "]" * 5000]) == 2
    assert capsys.readouterr().err == ("<override 1>: seed: values nested far more than 32 mappings or lists deep: "
                                       "no spec needs that many; flatten them\n1 error in spec.yaml\n")


def test_check_connect_reports_a_server_that_does_not_start(project, capsys):
    project.module("cli_dead")
    path = project.spec(BASE.replace("{mod}", "cli_dead") + "tools:\n  dead: {command: python, args: [-c, 'pass']}\n")
    assert cli.main(["check", path, "--connect"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spec.yaml:10: tools.dead: server failed to start: ")
    # the SDK says only "Connection closed": that the process ended, silent, is ours to say
    assert err.endswith("; the server's process ended before the MCP handshake and wrote nothing to stderr (is the "
                        "command an MCP server speaking on stdio?)\n1 error in spec.yaml\n"), err


def test_check_connect_gives_a_server_its_own_start_timeout(project, capsys, monkeypatch):
    """`start_timeout_s` is raised for a server that downloads itself or loads an index first: `check --connect`
    cut every start at its own 60 s whatever the server was given, and said "did not start within 60 s" (exit 2)
    of a server the run would wait for. Scaled down: 1.5 s for 60 s, a server that takes 3 s of its 30."""
    import factory.compiler.connect as connect

    monkeypatch.setattr(connect, "LIST_TIMEOUT_S", 1.5)
    project.module("cli_slow")
    project.file("slow_server.py", "import runpy, time\ntime.sleep(3)  # loads an index first\n"
                                   "runpy.run_module('factory.examples.calculator', run_name='__main__')\n")
    path = project.spec(BASE.replace("{mod}", "cli_slow")
                        + "tools:\n  calc: {command: python, args: [slow_server.py], start_timeout_s: 30}\n")
    assert cli.main(["check", path, "--connect"]) == 0, capsys.readouterr().err


def test_check_says_its_run_hash_leaves_out_the_tool_schemas_until_connected(project, capsys):
    """`check` and `check --connect` printed two run hashes for one spec, and the run's was the second."""
    project.module("cli_hash")
    path = project.spec(BASE.replace("{mod}", "cli_hash") + "tools:\n  calc: {command: python, args: [-m, "
                        "factory.examples.calculator]}\n")
    assert cli.main(["check", path]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "run hash" in x)
    assert line.endswith(" (tool schemas not included: `check --connect` and a run start the servers and hash them)")
    assert cli.main(["check", path, "--connect"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "run hash" in x)
    assert re.fullmatch(r"  run hash   [0-9a-f]{12}", line), line


def test_check_says_which_of_command_and_cwd_is_missing(project, capsys):
    """Both were the OS's "[Errno 2] No such file or directory: 'pyhton'", which named neither; and without
    --connect only warnings, then `factory run` failed at the tools stage's start (exit 3) after Ray came up."""
    project.module("cli_launch")
    base = BASE.replace("{mod}", "cli_launch")
    cases = {"{command: pyhton, args: [-m, factory.examples.calculator]}":
             "command: command not found on PATH: pyhton; did you mean 'python'?",
             "{command: ./no/server.sh}":
             "command: no such program: ./no/server.sh (a relative path is from the spec's folder)",
             "{command: python, args: [-m, factory.examples.calculator], cwd: nowhere}":
             "cwd: not a folder here: nowhere (a relative cwd is from the spec's folder); the server would not start"}
    for server, said in cases.items():
        path = project.spec(base + f"tools:\n  calc: {server}\n")
        for connect in ([], ["--connect"]):
            assert cli.main(["check", path, *connect]) == 2
            err = capsys.readouterr().err
            assert err.endswith(f"spec.yaml:10: tools.calc.{said}\n1 error in spec.yaml\n"), err
    # a run joining a cluster may start the server on another node: a warning there
    assert cli.main(["check", path, "resources.ray_address=10.0.0.1:6379"]) == 0
    assert "spec.yaml:10: tools.calc.cwd: warning: not a folder here: nowhere" in capsys.readouterr().err
    # set by an override: said there, not at the file's server line
    path = project.spec(base + "tools:\n  calc: {command: python, args: [-m, factory.examples.calculator]}\n")
    assert cli.main(["check", path, "--connect", "tools.calc.command=pyhton"]) == 2
    assert "<override 1>: tools.calc.command: command not found on PATH: pyhton" in capsys.readouterr().err


def test_check_connect_says_an_http_server_could_not_be_reached(project, capsys):
    """Factory does not start an HTTP server: it said "failed to start", without the URL."""
    import socket

    project.module("cli_http")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = project.spec(BASE.replace("{mod}", "cli_http") + f"tools:\n  web: {{url: 'http://127.0.0.1:{port}/mcp'}}\n")
    assert cli.main(["check", path, "--connect"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"spec.yaml:10: tools.web: server at http://127.0.0.1:{port}/mcp could not be reached: "), err


def test_check_connect_says_an_http_server_refused_the_token(project, capsys, monkeypatch):
    """A token refused was said "could not be reached: MCPError: Server returned an error response": no status, and
    the server had been reached."""
    from tests.servers import free_port, http_server

    project.module("cli_http_token")
    port = free_port()
    monkeypatch.setenv("CLI_TOKEN", "Bearer wrong")
    url = f"http://127.0.0.1:{port}/mcp"
    path = project.spec(BASE.replace("{mod}", "cli_http_token")
                        + f"tools:\n  web: {{url: '{url}', headers_from_env: {{Authorization: CLI_TOKEN}}}}\n")
    argv = [sys.executable, str(REPO / "tests/tool_servers/faulty.py"), "--http", str(port), "--token", "Bearer right"]
    with http_server(argv, port, cwd=REPO):
        assert cli.main(["check", path, "--connect"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"spec.yaml:10: tools.web: server at {url} was reached, but refused: it answered HTTP 401 "
                          "Unauthorized: check the header(s) headers_from_env sets ($CLI_TOKEN)\n"), err


def test_check_connect_says_why_a_server_died(project, capsys):
    """The server's last line of stderr, not just the SDK's "Connection closed"."""
    project.module("cli_typo")
    path = project.spec(BASE.replace("{mod}", "cli_typo")
                        + "tools:\n  calc: {command: python, args: [-m, factory.examples.calculater]}\n")
    assert cli.main(["check", path, "--connect"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spec.yaml:10: tools.calc: server failed to start: ")
    assert err.endswith("; the server's last words: "
                        f"{sys.executable}: No module named factory.examples.calculater\n1 error in spec.yaml\n")


def test_check_connect_says_where_a_python_server_failed(project, capsys):
    """A mistake in the user's own server was said by its last line alone (`SyntaxError: expected ':'`), without
    the file and line Python printed above it; a log that wraps its lines gave a fragment (`teral_error`)."""
    project.module("cli_broken")
    project.file("tools/broken.py", "import sys\n\ndef count(word: str) -> int\n    return len(word)\n")
    project.file("tools/raises.py", "import json\n\nPLAN = json.loads('{')\n")
    for name, said in (("broken", "tools/broken.py:3: SyntaxError: expected ':'"),
                       ("raises", "tools/raises.py:3: json.decoder.JSONDecodeError: Expecting property name enclosed "
                                  "in double quotes: line 1 column 2 (char 1)")):
        path = project.spec(BASE.replace("{mod}", "cli_broken") + f"tools:\n  {name}: {{command: python, args: "
                            f"[tools/{name}.py]}}\n", f"{name}.yaml")
        assert cli.main(["check", path, "--connect"]) == 2
        err = capsys.readouterr().err
        assert err.endswith(f"; the server's last words: {said}\n1 error in {name}.yaml\n"), err


def test_a_servers_last_words_are_its_error_not_a_fragment_of_it():
    from factory.compiler.connect import last_words

    wrapped = """\
                             │ ❱ 410 │   │   return self.validat │
                             ╰───────────────────────────────────╯
                             ValidationError: 1 validation error
                             for ListToolsResult
                             tools.0.inputSchema.type
                               Input should be 'object'
                             [type=literal_error,
                             input_value='string', input_type=str]"""
    assert last_words(wrapped.splitlines()) == (
        "ValidationError: 1 validation error for ListToolsResult tools.0.inputSchema.type Input should be 'object' "
        "[type=literal_error, input_value='string', input_type=str]")
    assert last_words(["starting", "", "warming up", "listening on stdio", "killed: out of memory"]) == (
        "warming up / listening on stdio / killed: out of memory")
    # An anyio server (the MCP SDK's stdio_server, FastMCP) dying in its task group: an ExceptionGroup, each line in
    # a box's margin (`|`, `+-`), was said by the box's last three lines, with no file:line of the server's own code
    lib = "/venv/lib/python3.11/site-packages/anyio"
    group = f"""\
  + Exception Group Traceback (most recent call last):
  |   File "/srv/eg_server.py", line 12, in <module>
  |     anyio.run(main)
  |   File "{lib}/_core/_eventloop.py", line 83, in run
  |     return async_backend.run(func, args, {{}}, backend_options)
  |            ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  |   File "/srv/eg_server.py", line 5, in main
  |     async with anyio.create_task_group() as tg:
  |   File "{lib}/_backends/_asyncio.py", line 871, in __aexit__
  |     raise BaseExceptionGroup(
  | ExceptionGroup: unhandled errors in a TaskGroup (1 sub-exception)
  +-+---------------- 1 ----------------
    | Traceback (most recent call last):
    |   File "{lib}/_core/_tasks.py", line 327, in _run_coro
    |     retval = await self._coro
    |              ^^^^^^^^^^^^^^^^
    |   File "/srv/eg_server.py", line 10, in boom
    |     raise ValueError("the index file is missing")
    | ValueError: the index file is missing
    +------------------------------------"""
    assert last_words(group.splitlines()) == "/srv/eg_server.py:10: ValueError: the index file is missing"


def test_check_connect_asks_each_judge_endpoint_whether_it_is_there(project, capsys):
    """An unreachable judge checked ok without a word: a run with it scored no trajectory (under drop_sample,
    dropped all)."""
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    project.module("cli_judge")
    project.file("judge.jinja", "Rate {{ completion }}. Reply 'Score: <0-1>'.\n")
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)  # answers 501 to GET: a server is there
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        spec = BASE.replace("{mod}", "cli_judge") + "  judge: {llm_judge: judge.jinja, endpoint: URL}\n"
        down = project.spec(spec.replace("URL", f"http://127.0.0.1:{closed}/v1"), "down.yaml")
        assert cli.main(["check", down, "--connect"]) == 0  # a warning: the server may answer only where the run runs
        err = capsys.readouterr().err
        assert err.startswith(f"down.yaml:9: rewards.judge.endpoint: warning: no answer from http://127.0.0.1:{closed}"
                              "/v1 within 10 s (ConnectError") and err.endswith("A run would score nothing with it\n")
        up = project.spec(spec.replace("URL", f"http://127.0.0.1:{server.server_address[1]}/v1"), "up.yaml")
        assert cli.main(["check", up, "--connect"]) == 0
        assert "warning" not in capsys.readouterr().err
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("spec", SPECS, ids=[p.name for p in SPECS])
def test_every_shipped_spec_checks_and_connects(spec, monkeypatch, capsys):
    """Every spec in specs/ compiles, and every tool server it names starts and offers the tools it names."""
    from factory.device import cuda_devices

    monkeypatch.chdir(REPO)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    gpus = "num_gpus" in spec.read_text()
    if gpus and not cuda_devices():
        # A GPU spec on a machine without CUDA fails at check, located; on a GPU cluster it checks.
        assert cli.main(["check", str(spec.relative_to(REPO))]) == 2
        assert "num_gpus: " in capsys.readouterr().err
        monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    code = cli.main(["check", str(spec.relative_to(REPO)), "--connect"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "warning: command not found" not in err
    if "\ntools:" in spec.read_text():  # each server's line lists the tools it offered
        assert "; tools: " in out, out


def test_check_does_not_import_torch_ray_or_deepspeed():
    code = ("import sys; from factory.commands.cli import main; rc = main(['check', 'specs/quickstart.yaml']); "
            "print(sorted(m for m in ('torch', 'ray', 'deepspeed') if m in sys.modules)); sys.exit(rc)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "[]"


def test_plan_dot_draws_stages_replicas_and_edges(project, capsys, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")  # a cluster's GPUs: this machine has none
    project.module("cli_dot")
    path = project.spec(BASE.replace("{mod}", "cli_dot") + (
        "tools:\n  calc: {command: python}\n"
        "resources: {rollout: {replicas: 2}, update: {replicas: 4, num_gpus: 1}}\n"
        "train: {deepspeed: {zero_stage: 3}}\n"))
    assert cli.main(["plan", path, "--dot"]) == 0
    assert capsys.readouterr().out == """\
digraph "demo" {
  rankdir=LR;
  node [shape=box, style=rounded, fontname="Helvetica"];
  edge [fontname="Helvetica", fontsize=10];
  "data" [label="data\\nDataStage"];
  "rollout" [label="rollout\\nRolloutStage x 2 replicas"];
  "tools" [label="tools\\nToolsStage"];
  "reward" [label="reward\\nRewardStage"];
  "update" [label="update\\nUpdateStage x 4 replicas\\neach: GPU 1"];
  "data" -> "rollout" [label="batch"];
  "data" -> "rollout" [label="eval_batch", style=dashed];
  "rollout" -> "tools" [label="tool_calls", style=dotted];
  "tools" -> "rollout" [label="tool_results", style=dotted];
  "rollout" -> "reward" [label="trajectories"];
  "reward" -> "update" [label="scored_trajectories"];
  "update" -> "rollout" [label="weights (weight sync)", style=bold];
}
"""


def test_a_tracking_store_given_as_a_path_is_refused_before_anything_starts(project, capsys, monkeypatch):
    """MLflow reads a path as its file store and refuses it: `tracking.uri: mlflow.db` failed once Ray had
    started, and `factory runs --uri mlflow.db` with an internal error (exit 1)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    project.module("cli_uri")
    path = project.spec(BASE.replace("{mod}", "cli_uri"))
    fix = ("is a path, which MLflow reads as its file store and refuses: a tracking store is a URI, "
           "sqlite:///mlflow.db (a file here), http://HOST:PORT (a server) or a database URL")
    assert cli.main(["check", path, "tracking.uri=mlflow.db"]) == 2
    assert capsys.readouterr().err == f"<override 1>: tracking.uri: 'mlflow.db' {fix}\n1 error in spec.yaml\n"
    assert cli.main(["runs", "--uri", "mlflow.db"]) == 2
    assert capsys.readouterr().err == f"factory: 'mlflow.db' {fix}\n"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "mlflow.db")
    assert cli.main(["check", path]) == 2
    assert "tracking.uri: unset, so $MLFLOW_TRACKING_URI: 'mlflow.db' is a path" in capsys.readouterr().err


def test_commands_that_read_runs_leave_no_store_behind_and_refuse_a_scheme_mlflow_lacks(project, capsys,
                                                                                          monkeypatch):
    """In a folder without mlflow.db, `factory diff A B` (export, eval --model RUN, rescore) made an empty
    store there and said no run had that id; `factory runs --uri foo://bar` met MLflow's model-registry
    error (exit 1), and a tracking server that is down an internal error too (now exit 3, the store's words).
    A sqlite file that exists is read as before."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    missing = "no tracking store at sqlite:///mlflow.db (no file mlflow.db here): runs are in the store"
    assert cli.main(["diff", "a", "b"]) == 2
    assert capsys.readouterr().err.startswith(f"factory diff: error: {missing}")
    assert cli.main(["export", "a", "--out", "x"]) == 2
    assert capsys.readouterr().err.startswith(f"factory: 'a' is not a checkpoint folder, and {missing}")
    assert cli.main(["runs"]) == 0
    assert capsys.readouterr().out.startswith(f"no runs: {missing}")
    assert not (project.root / "mlflow.db").exists()
    assert cli.main(["runs", "--uri", "foo://bar"]) == 2
    assert capsys.readouterr().err == ("factory: 'foo://bar': MLflow has no tracking store for 'foo://' URIs: a "
                                       "tracking store is sqlite:///FILE, http://HOST:PORT (a server), or a "
                                       "database URL (postgresql://, mysql://, mssql://)\n")
    import importlib.util

    from factory.util import store_problem

    if importlib.util.find_spec("pg8000") is None:  # not one of Factory's dependencies
        assert cli.main(["runs", "--uri", "postgresql+pg8000://u@h/db"]) == 2  # was ModuleNotFoundError, exit 1
        assert capsys.readouterr().err == (
            "factory: 'postgresql+pg8000://u@h/db' needs the database driver module 'pg8000', which is not "
            "installed: install it in Factory's environment (uv pip install pg8000), or name an installed one in "
            "the URL (postgresql+DRIVER://)\n")
    if importlib.util.find_spec("mysql") is None:  # a dotted module whose package is missing
        assert "uv pip install mysql-connector-python" in store_problem("mysql+mysqlconnector://u@h/db")
    # the driver's module is not always its name; one Factory does not know is SQLAlchemy's to judge
    assert store_problem("sqlite+pysqlite:///x.db") is None and store_problem("mysql+newdriver://u@h/db") is None
    from tests.servers import free_port

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the test's time; the message is the same
    dead = f"http://127.0.0.1:{free_port()}"
    for command in (["runs"], ["diff", "abcdef12", "abcdef13"], ["export", "abcdef12", "--out", "o"]):
        assert cli.main([*command, "--uri", dead]) == 3  # a server that is down: infrastructure, not internal
        assert capsys.readouterr().err.startswith(f"factory {command[0]}: error: the tracking store {dead} could "
                                                  "not be read (MlflowException: ")
    from mlflow.tracking import MlflowClient

    MlflowClient("sqlite:///mlflow.db").search_experiments()  # an existing store, with no run
    assert cli.main(["runs"]) == 0
    assert capsys.readouterr().out.startswith("no runs in sqlite:///mlflow.db")
    assert cli.main(["diff", "a", "b"]) == 2
    assert "no run with id or name 'a' in sqlite:///mlflow.db" in capsys.readouterr().err


def test_a_store_that_goes_down_while_diff_reads_it_is_exit_3_naming_it(project, capsys, monkeypatch):
    """`factory diff A B` asked the store once (open_tracker) and then read both runs, their histories and their
    tables: a store that went down after that first answer was an internal error (exit 1); it is exit 3 and the
    store's words, as a store down from the start (rescore's reads do the same)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from factory.tracking.mlflow_tracker import MlflowTracker

    uri = f"sqlite:///{project.root / 'mlflow.db'}"  # (absolute: MLflow keeps one engine per URI in a process)
    MlflowClient(uri).search_experiments()  # a store that answers the probe

    def down(self, ref):  # MLflow's words for a REST call to a server that is gone
        raise MlflowException("API request to http://127.0.0.1:5000/api/2.0/mlflow/runs/search failed with "
                              "exception HTTPConnectionPool(host='127.0.0.1', port=5000): Max retries exceeded")

    monkeypatch.setattr(MlflowTracker, "run", down)
    rc, err = cli.main(["diff", "a", "b", "--uri", uri]), capsys.readouterr().err
    assert rc == 3, err
    assert (f"factory diff: error: the tracking store {uri} could not be read (MlflowException: " in err
            and "internal error" not in err), err


def test_a_store_that_goes_down_while_runs_or_export_reads_it_is_exit_3_naming_it(project, capsys, monkeypatch):
    """As diff's: `factory runs` and `factory export RUN` asked the store once (open_tracker) and then listed or
    read the runs: a store gone after that answer was an internal error (exit 1)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from factory.tracking.mlflow_tracker import MlflowTracker

    uri = f"sqlite:///{project.root / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()  # a store that answers the probe

    def down(self, *args, **kwargs):
        raise MlflowException("API request to http://127.0.0.1:5000/api/2.0/mlflow/runs/search failed with "
                              "exception HTTPConnectionPool(host='127.0.0.1', port=5000): Max retries exceeded")

    monkeypatch.setattr(MlflowTracker, "runs", down)
    monkeypatch.setattr(MlflowTracker, "run", down)
    for command in (["runs", "--uri", uri], ["export", "a1b2c3d4", "--out", str(project.root / "out"), "--uri", uri]):
        rc, err = cli.main(command), capsys.readouterr().err
        assert rc == 3, (command, err)
        assert (f"factory {command[0]}: error: the tracking store {uri} could not be read (MlflowException: " in err
                and "internal error" not in err), err


def test_runs_with_a_uri_whose_store_is_not_there_exits_2(tmp_path, capsys, monkeypatch):
    """`factory runs --uri sqlite:///typo.db` exited 0 (`--json` printed []), where factory.runs(uri=...) raised
    RunLookupError and `factory diff --uri` exited 2. A store named that is not there is the user's to fix; the
    default's, not made yet, is "no runs"."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path}/typo.db"
    for json_flag in ([], ["--json"]):
        assert cli.main(["runs", "--uri", uri, *json_flag]) == 2
        out = capsys.readouterr()
        assert out.out == "" and out.err.startswith(f"factory runs: error: no tracking store at {uri} (no file ")
    assert cli.main(["runs"]) == 0
    assert capsys.readouterr().out.startswith("no runs: no tracking store at sqlite:///mlflow.db")
    assert cli.main(["runs", "--json"]) == 0 and capsys.readouterr().out == "[]\n"
    assert list(tmp_path.iterdir()) == []


def test_ui_where_the_store_is_not_refuses_and_makes_none(tmp_path, capsys, monkeypatch):
    """`factory ui` in a folder without mlflow.db (or --uri naming a sqlite file that is not there) served an
    empty UI and left a new empty store behind, where `factory runs` and `diff` said there was none."""
    from factory.tracking import runs

    def started(*a, **k):
        raise AssertionError("a server was started")

    monkeypatch.setattr(runs, "server_command", started)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    typo = f"sqlite:///{tmp_path}/typo.db"
    for uri, argv in (("sqlite:///mlflow.db", []), (typo, ["--uri", typo])):
        assert cli.main(["ui", *argv]) == 2
        assert capsys.readouterr().err.startswith(f"factory ui: error: no tracking store at {uri} (no file ")
    assert list(tmp_path.iterdir()) == []


def test_a_resume_where_the_store_is_not_leaves_no_store_behind(project, capsys, monkeypatch):
    """`factory run SPEC --resume [RUN]` from a folder without the run's mlflow.db made an empty store there
    and said no run had that id (or that the spec had no unfinished run: start it without --resume)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    project.module("cli_resume")
    path = project.spec(BASE.replace("{mod}", "cli_resume"))
    missing = "no tracking store at sqlite:///mlflow.db (no file mlflow.db here): runs are in the store"
    for resume in (["--resume"], ["--resume", "abcdef12"]):
        assert cli.main(["run", path, *resume]) == 2
        assert missing in capsys.readouterr().err
    assert not (project.root / "mlflow.db").exists()


def test_command_line_mistakes_exit_2_saying_what_is_missing(capsys):
    """argparse counted the optional overrides as required ("required: SPEC, KEY=VALUE"); `ui --port 99999`
    met the socket module's OverflowError and `runs --limit 0` MLflow's: internal errors, exit 1."""
    for argv, said in ((["check"], "factory check: error: the following arguments are required: SPEC\n"),
                       (["ui", "--port", "99999"],
                        "factory ui: error: argument --port: a port is 1-65535, got 99999\n"),
                       (["ui", "--port", "http"], "factory ui: error: argument --port: not a port number: 'http'\n"),
                       (["runs", "--limit", "0"], "factory runs: error: argument --limit: must be 1 or more, got 0\n")):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
        assert capsys.readouterr().err.endswith(said)


def test_a_runs_limit_above_what_the_store_lists_is_a_command_line_error(capsys):
    """MLflow lists at most 50000 runs a search: `runs --limit 60000` was its MlflowException, an internal error."""
    from mlflow.store.tracking import SEARCH_MAX_RESULTS_THRESHOLD

    from factory.commands import api
    from factory.tracking.tracker import MAX_RUNS

    assert MAX_RUNS == SEARCH_MAX_RESULTS_THRESHOLD
    with pytest.raises(SystemExit) as e:
        cli.main(["runs", "--limit", "60000"])
    assert e.value.code == 2
    assert capsys.readouterr().err.endswith(
        "factory runs: error: argument --limit: at most 50000 (the most runs a store lists at once), got 60000\n")
    with pytest.raises(ValueError, match="^limit: at most 50000 runs, got 60000$"):
        api.runs(limit=60000)


def test_a_dashed_override_before_the_run_of_rescore_says_where_overrides_go(capsys):
    """`rescore --rollout.group_size 4 RUN --spec S`: argparse took the 4 for the run; the hint compared the word
    after the key with the --spec option instead of the run, and said "an override takes a value"."""
    with pytest.raises(SystemExit) as e:
        cli.main(["rescore", "--rollout.group_size", "4", "abc12345", "--spec", "s.yaml"])
    assert e.value.code == 2
    assert capsys.readouterr().err.endswith(
        "factory: error: unrecognized arguments: --rollout.group_size (overrides go after the run, written "
        "KEY=VALUE: factory rescore RUN rollout.group_size=4)\n")


def test_ui_host_may_be_an_ipv6_address_and_a_typo_is_the_users_error(capsys, monkeypatch, tmp_path):
    """`factory ui --host ::1` (an IPv6 address) or a mistyped host met socket.gaierror in the check that the port
    is free: "internal error" (exit 1, a bug in Factory)."""
    import socket

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    (tmp_path / "mlflow.db").touch()  # a store that is there (one that is not is refused first)
    with socket.socket(socket.AF_INET6) as taken:
        taken.bind(("::1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["ui", "--host", "::1", "--port", str(port)]) == 2
        assert capsys.readouterr().err == f"factory ui: error: port {port} on ::1 is in use; pick another with --port\n"
    assert cli.main(["ui", "--host", "nosuchhost.invalid", "--port", str(port)]) == 2
    assert re.fullmatch(r"factory ui: error: --host nosuchhost.invalid: no such host or address \(.+\)\n",
                        capsys.readouterr().err)


def test_eval_of_a_server_that_does_not_answer_exits_2_before_ray_starts(project, capsys, monkeypatch):
    """`factory eval --model http://...` of a server that is down started Ray and the stages, and the
    engine's requests retried it for minutes."""
    from tests.servers import free_port

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    project.module("cli_ep")
    path = project.spec(BASE.replace("{mod}", "cli_ep").replace(
        "size: 8}\n", "size: 8}\n  eval: {generator: factory.data:arithmetic, size: 2}\n"))
    url = f"http://127.0.0.1:{free_port()}/v1"
    assert cli.main(["eval", path, "--model", url]) == 2
    assert capsys.readouterr().err == (
        f"factory: model {url}: no answer within 10 s (ConnectError: All connection attempts failed): is the "
        "server up, and the URL its OpenAI-compatible base (ending in /v1)?\n")
    assert not (project.root / "mlflow.db").exists()


def test_eval_takes_replay_as_run_and_rescore_do(project, capsys, monkeypatch):
    """docs/tools.md says `factory eval` replays as `run` does; `--replay` was `run`'s and `rescore`'s only."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{project.root}/mlflow.db")
    project.module("cli_rp")
    path = project.spec(BASE.replace("{mod}", "cli_rp").replace(
        "size: 8}\n", "size: 8}\n  eval: {generator: factory.data:arithmetic, size: 2}\n"))
    assert cli.main(["eval", path, "--replay", "nosuchrun"]) == 2  # looked up as replay.run, before Ray starts
    assert "no run with id or name 'nosuchrun'" in capsys.readouterr().err
    # check and plan take it too: it was an override `replay=nosuchrun` ("replay: expected a mapping")
    assert cli.main(["plan", path, "--replay", "nosuchrun", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["spec"]["replay"]["run"] == "nosuchrun"
    # and check reads the recording as the run would (a run that recorded nothing passed check, then the run exited 2)
    assert cli.main(["check", path, "--replay", "nosuchrun"]) == 2
    assert "no run with id or name 'nosuchrun'" in capsys.readouterr().err
    # a run id's prefix as `factory runs` prints it, all digits or digits and one e, is a run, not a number
    for prefix in ("31785009", "12345e67"):
        assert cli.main(["plan", path, "--replay", prefix, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["spec"]["replay"]["run"] == prefix


LISTING = """
import factory.tracking.runs as runs
from factory.commands import cli
row = dict(run_id="x" * 32, name="n", spec="s", kind="train", status="FINISHED", driver_alive=None, steps_done=1,
           steps=1, final_reward=None, eval={}, start_time=None, duration_s=None, monitors={})
runs.list_runs = lambda *a, **k: [row] * 5000  # a table longer than a pipe holds
raise SystemExit(cli.main(["runs"]))
"""


def test_a_reader_that_leaves_early_is_exit_code_0():
    """`factory runs | head`, `factory diff A B | head`: rich answers a closed pipe with SystemExit(1), so
    the command exited 1 (an error) where its reader only had enough."""
    read, write = os.pipe()
    os.close(read)  # the reader has left (`head -1` once it has its line) before the table is written
    proc = subprocess.run([sys.executable, "-c", LISTING], stdout=write, stderr=subprocess.PIPE, text=True, timeout=60)
    os.close(write)
    assert proc.returncode == 0, proc.stderr


def test_the_runs_table_keeps_each_runs_name(monkeypatch, capsys):
    """Beside a run whose driver is gone ("RUNNING (driver gone: --resume)") and five eval metrics, the name
    column (the one that may wrap) was squeezed to nothing in a 200-column listing."""
    import factory.tracking.runs as runs

    row = dict(run_id="0123456789abcdef" * 2, name="tiny-20261203-193414", spec="tiny", kind="train", status="RUNNING",
               driver_alive=False, steps_done=2, steps=4, final_reward=0.0, start_time=1.0, duration_s=None, monitors={},
               eval={f"eval/{k}": 0.0 for k in ("accuracy", "dropped", "num_turns", "reward", "tool_calls")})
    monkeypatch.setattr(runs, "list_runs", lambda *a, **k: [row])
    monkeypatch.setenv("COLUMNS", "80")  # exported by some shells and CI: not what a pipe's width is
    assert cli.main(["runs"]) == 0
    out = capsys.readouterr().out
    assert "tiny-20261203-193414" in out
    # piped (as capsys is), the table is as wide as its columns need: the last one was cut at 200 columns
    assert time.strftime("%Y-%m-%d %H:%M", time.localtime(1.0)) in out and "…" not in out, out


def test_the_runs_table_shows_names_with_brackets_as_they_are(monkeypatch, capsys):
    """Names went to rich as markup: `grid[lr=1e-5]` was listed as `grid` (not the name `factory diff` takes),
    and a name holding `[/judge]` made the listing an internal error."""
    import factory.tracking.runs as runs

    rows = [dict(run_id=f"{i}123456789abcdef" * 2, name=f"{spec}-20261207-101010", spec=spec, kind="train",
                 status="FINISHED", driver_alive=None, steps_done=2, steps=2, final_reward=0.5, start_time=1.0,
                 duration_s=60.0, monitors={}, eval={"eval/pass[1]": 0.5})
            for i, spec in enumerate(("grid[lr=1e-5]", "abl[/judge]"))]
    monkeypatch.setattr(runs, "list_runs", lambda *a, **k: rows)
    assert cli.main(["runs"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("grid[lr=1e-5]-20261207-101010", "abl[/judge]-20261207-101010",
                                        "eval/pass[1]")), out


def test_a_killed_rescore_or_eval_is_not_offered_a_resume(monkeypatch, capsys):
    """A rescore or eval killed outright stays RUNNING with its dead driver's tag: the table said "(driver gone:
    --resume)", which `factory run --resume` then refuses (it trained nothing to resume)."""
    import factory.tracking.runs as runs

    rows = [dict(run_id=f"{i}123456789abcdef" * 2, name=f"tiny-{kind}", spec="tiny", kind=kind, status="RUNNING",
                 driver_alive=False, steps_done=None, steps=2, final_reward=None, start_time=1.0, duration_s=None,
                 monitors={}, eval={}) for i, kind in enumerate(("train", "rescore", "eval"))]
    monkeypatch.setattr(runs, "list_runs", lambda *a, **k: rows)
    assert cli.main(["runs"]) == 0
    out = capsys.readouterr().out
    assert out.count("RUNNING (driver gone: --resume)") == 1 and out.count("RUNNING (driver gone)") == 2, out


def test_a_run_stopped_at_once_says_how_to_continue_it(monkeypatch, capsys):
    """A second Ctrl-C ended `factory run` with exit code 130 and not a word: the step in flight is lost, and
    the user is not told that --resume continues the run."""
    from factory.commands import api

    def interrupted(*args, **kwargs):
        e = KeyboardInterrupt()
        e.run_id = "ab12cd34"  # the run was recorded (driver.opened_run names it)
        raise e

    monkeypatch.setattr(api, "run", interrupted)
    spec = str(Path(__file__).resolve().parents[1] / "specs" / "tiny.yaml")
    assert cli.main(["run", spec, "train.steps=3"]) == 130
    assert f"`factory run {spec} train.steps=3 --resume ab12cd34` continues the run" in capsys.readouterr().err
    # stopped while Ray or the stages started: no run to resume, and it is not offered
    monkeypatch.setattr(api, "run", lambda *args, **kwargs: (_ for _ in ()).throw(KeyboardInterrupt))
    assert cli.main(["run", spec, "train.steps=3"]) == 130
    assert capsys.readouterr().err == ("factory: stopped during start-up, before the run was recorded: there is "
                                       "nothing to resume; the same command starts it again\n")
    monkeypatch.setattr(api, "run", interrupted)
    # a resume of a named run under a changed spec: the same again (a bare --resume would not find it), quoted
    assert cli.main(["run", spec, "train.steps=4", "--resume", "tiny-x", "--allow-spec-change",
                     "tracking.tags={a: b c}"]) == 130
    assert (f"`factory run {spec} train.steps=4 'tracking.tags={{a: b c}}' --resume ab12cd34 --allow-spec-change` "
            "continues the run") in capsys.readouterr().err
    # the first Ctrl-C: a stop after the step, exit 130, said with the command that continues it (it said nothing)
    from factory.runtime.driver import RunResult

    stopped = RunResult("ab12cd34", {}, {}, "/runs/tiny/step_2", stopped=True, last_step=2)
    monkeypatch.setattr(api, "run", lambda *args, **kwargs: stopped)
    assert cli.main(["run", spec, "train.steps=3"]) == 130
    assert capsys.readouterr().err == (f"factory: stopped after step 2, logged and checkpointed; `factory run {spec} "
                                       "train.steps=3 --resume ab12cd34` continues the run\n")
