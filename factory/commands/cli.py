"""The `factory` command: run, check, plan, eval, rescore, runs, diff, ui, export, schema, init; a thin layer
over factory.commands.api (`import factory`), the same program from Python.

Exit codes: 0 success; 2 the spec (or the command line, the data or a run it names) is wrong, with
every problem listed and no traceback; 1 Factory itself failed (a one-line message; FACTORY_DEBUG=1
shows the traceback); 3 a step had too many infrastructure failures; 4 a reward-hacking monitor that
`train.stop_on` names fired; 130 Ctrl-C (or SIGTERM: stopped after the step in flight).
`check` and `plan` import no torch, Ray or DeepSpeed: they answer in about a second.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import traceback
from collections.abc import Callable, Sequence

from factory.compiler.errors import EXIT_INTERNAL_ERROR, EXIT_SPEC_ERROR, SpecErrors
from factory.runtime.health import EXIT_INFRA, InfraFailure
from factory.tracking.tracker import MAX_RUNS, RunLookupError, StoreUnreadable
from factory.util import FAIL_FAST, UserError, nearest, version


def _user_output_to_stderr() -> contextlib.AbstractContextManager[object]:
    """While the spec compiles, the user's code runs (reward, generator and tool modules imported, a
    generator called): what it prints goes to stderr, so stdout holds only the command's own output
    (`factory plan --json | jq` broke on a reward module's print at import)."""
    return contextlib.redirect_stdout(sys.stderr)


def _check(args: argparse.Namespace) -> int:
    from factory.commands import api
    from factory.compiler.render import check_summary

    _replay_override(args)
    with _user_output_to_stderr():
        plan = api.compile_plan(args.spec, args.overrides, connect=args.connect)
        if plan.driver.replay.run:  # the recording a run would replay, read as the run reads it (exit 2 as there)
            from factory.runtime.replay import recorded_tool_calls
            from factory.tracking.tracker import open_tracker

            recorded_tool_calls(open_tracker(plan.driver.tracking.uri, read=True), plan)
    api.say_warnings(plan)
    print(check_summary(plan))
    return 0


def _plan(args: argparse.Namespace) -> int:
    from factory.commands import api
    from factory.compiler.compile import compile_file, plan_json
    from factory.compiler.load import source_of
    from factory.compiler.render import dot_text, explain_text, plan_text

    _replay_override(args)
    with _user_output_to_stderr():
        spec, plan = compile_file(args.spec, args.overrides)  # the spec knows its source: who set what
    api.say_warnings(plan)
    if args.json:
        sys.stdout.write(plan_json(plan))
    elif args.dot:
        sys.stdout.write(dot_text(plan))
    elif args.explain:
        sys.stdout.write(explain_text(plan, spec, source_of(spec).origin) + "\n")
    else:
        sys.stdout.write(plan_text(plan) + "\n")
    return 0


def _replay_override(args: argparse.Namespace) -> None:
    """`--replay RUN` is the override `replay.run=RUN`, which the run's plan records."""
    if args.replay is not None:  # quoted: an override's value is YAML, which reads a prefix such as 31785009 as a number
        args.overrides = [*args.overrides, f"replay.run={json.dumps(args.replay)}"]


def _run(args: argparse.Namespace) -> int:
    from factory.commands import api
    from factory.runtime.startup import process_started

    _replay_override(args)
    plan = api.compile_plan(args.spec, args.overrides)
    api.say_warnings(plan)
    # the time to first step counts from this process's start: the imports and the compile too
    try:
        result = api.run(plan, resume=args.resume, allow_spec_change=args.allow_spec_change,
                         started_at=process_started())
    except KeyboardInterrupt as e:  # a second Ctrl-C or SIGTERM, or one before the steps began: stopped at once
        if args.resume is None and getattr(e, "run_id", None) is None:  # stopped before the run was recorded
            print("factory: stopped during start-up, before the run was recorded: there is nothing to resume; the "
                  "same command starts it again", file=sys.stderr)
            raise
        again = _resume_command(args, getattr(e, "run_id", None))
        print(f"factory: stopped at once, the step in flight unsaved; `{again}` continues the run from its newest "
              "checkpoint (once its steps have begun)", file=sys.stderr)
        raise
    if result.halted:  # a train.stop_on monitor: its own exit code and why
        from factory.monitors import EXIT_MONITOR

        print(f"factory: stopped: {result.halted}", file=sys.stderr)
        return EXIT_MONITOR
    if result.stopped:  # 130: the shell's code for a run ended by Ctrl-C
        done = (f"after step {result.last_step}, logged and checkpointed" if result.checkpoint else
                "before a checkpoint was saved")
        print(f"factory: stopped {done}; `{_resume_command(args, result.run_id)}` continues the run", file=sys.stderr)
        return 130
    return 0


def _resume_command(args: argparse.Namespace, run_id: str | None = None) -> str:
    """`factory run` as this command ran it, resuming: quoted for a shell, with its own run (`run_id`, or the one it
    named) and a spec change it allowed (a bare --resume takes the newest unfinished run of the spec as first
    recorded, not this changed one)."""
    run = run_id or args.resume
    return shlex.join(["factory", "run", args.spec, *args.overrides, "--resume", *([run] if run else []),
                       *(["--allow-spec-change"] if args.allow_spec_change else [])])


def _eval(args: argparse.Namespace) -> int:
    from factory.commands import api
    from factory.runtime.startup import process_started

    _replay_override(args)
    api.evaluate(args.spec, args.model, args.overrides, uri=args.uri, started_at=process_started())
    return 0


def _export(args: argparse.Namespace) -> int:
    from factory.commands.export import main as export_main

    return export_main(args)


def _rescore(args: argparse.Namespace) -> int:
    from factory.commands.rescore import main as rescore_main

    _replay_override(args)
    return rescore_main(args)


def _diff(args: argparse.Namespace) -> int:
    from factory.commands.diff import main as diff_main

    return diff_main(args)


def _runs(args: argparse.Namespace) -> int:
    from factory.tracking.runs import runs_main  # the table of factory.runs()

    return runs_main(args)


def _ui(args: argparse.Namespace) -> int:
    from factory.tracking.runs import ui_main

    return ui_main(args)


def _schema(args: argparse.Namespace) -> int:
    from factory.commands import reference

    if args.write:
        try:
            root = reference.checkout_root()
        except FileNotFoundError as e:
            print(f"factory schema: {e}", file=sys.stderr)
            return EXIT_SPEC_ERROR
        changed = reference.write(root)
        for rel in reference.outputs():
            print(f"{'updated' if rel in changed else 'up to date'}: {rel.as_posix()}")
        return 0
    sys.stdout.write(reference.markdown() if args.markdown else reference.json_schema_text())
    return 0


def _init(args: argparse.Namespace) -> int:
    from pathlib import Path

    from factory.commands.init import DESCRIPTIONS, InitError, create

    if not args.name.strip():  # Path("") is ".": `factory init ""` (an unset $NAME) scaffolded into this folder
        print("factory init: the project's name is empty: give the folder to create (factory init my-agent), or '.' "
              "for this folder", file=sys.stderr)
        return EXIT_SPEC_ERROR
    target = Path(args.name)
    try:
        name, written = create(target)
    except InitError as e:
        print(f"factory init: {e}", file=sys.stderr)
        return EXIT_SPEC_ERROR
    print(f"created {target.as_posix()}/ (Factory project '{name}'):")
    shown = [f for f in DESCRIPTIONS if f in written] + [f for f in written if f not in DESCRIPTIONS]
    for rel in shown:
        print(f"  {rel:20} {DESCRIPTIONS.get(rel, '')}".rstrip())
    cd = f"cd {shlex.quote(target.as_posix())} && " if target.resolve() != Path.cwd().resolve() else ""
    print(f"next:\n  {cd}factory check spec.yaml --connect && factory run spec.yaml train.steps=1")
    return 0


def _steps(text: str) -> set[int]:
    from factory.commands.rescore import parse_steps

    try:
        return parse_steps(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n < 1:  # else MLflow's "Invalid value 0 for parameter 'max_results'", an internal error
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {n}")
    return n


def _runs_limit(text: str) -> int:
    n = _positive(text)
    if n > MAX_RUNS:  # else the store's refusal, an internal error
        raise argparse.ArgumentTypeError(f"at most {MAX_RUNS} (the most runs a store lists at once), got {n}")
    return n


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:  # else the socket module's OverflowError, an "internal error"
        raise argparse.ArgumentTypeError(f"a port is 1-65535, got {port}")
    return port


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="factory",
        description="Train tool-using LLM agents with RL from one YAML spec.",
        epilog="Overrides are OmegaConf dot-lists: `train.lr=3e-6 rollout.group_size=4` (or `--train.lr 3e-6`). "
               "Exit codes: 0 ok, 2 spec error, 1 internal error (FACTORY_DEBUG=1 shows the traceback), "
               "3 infrastructure failures (a step's tools or judge down, a stage that stopped answering), "
               "4 a train.stop_on monitor fired, 130 Ctrl-C or SIGTERM.",
    )
    p.add_argument("--version", action="version", version=f"factory {version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def spec_command(name: str, help_text: str, fn: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        # no abbreviated options: `--res 3` must not become `--resume 3`; a dashed key is an override
        c = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        c.add_argument("spec", metavar="SPEC", help="the spec file (YAML)")
        # default=[]: without one, argparse counts a `*` positional as required ("required: SPEC, KEY=VALUE")
        c.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE",
                       help="dot-list overrides, e.g. train.lr=3e-6 (or --train.lr 3e-6, --train.lr=3e-6)")
        c.set_defaults(func=fn)
        return c

    run = spec_command("run", "train: compile the spec, start Ray and the stages, track the run in MLflow", _run)
    run.add_argument("--resume", nargs="?", const="", default=None, metavar="RUN",
                     help="continue a killed or stopped run from its newest checkpoint, in the same MLflow run: "
                          "RUN (id, id prefix or name), else the newest unfinished run of this spec")
    run.add_argument("--replay", default=None, metavar="RUN",
                     help="answer tool calls from RUN's recorded calls (id, id prefix or name) instead of calling "
                          "the tools (= replay.run=RUN; replay.on_miss=live calls the tools for calls RUN did "
                          "not make)")
    run.add_argument("--allow-spec-change", action="store_true",
                     help="with --resume: continue the run although the spec, overrides, templates, reward code "
                          "or data differ from its own (recorded on the run)")
    check = spec_command("check", "validate and compile the spec without starting Ray or loading weights", _check)
    check.add_argument("--connect", action="store_true",
                       help="also start each tool server, list its tools and check the tools the spec names; "
                            "ask each judge endpoint whether it answers")
    plan = spec_command("plan", "print the resolved spec, the stage graph and the hashes that identify a run", _plan)
    for c in (check, plan):  # as `run --replay` takes it (a user who learned that one tries it here)
        c.add_argument("--replay", default=None, metavar="RUN", help="as `factory run --replay` (= replay.run=RUN)")
    shown = plan.add_mutually_exclusive_group()  # one view at a time: `--json --dot` printed JSON alone
    shown.add_argument("--json", action="store_true", help="print the plan as stable JSON (what MLflow stores)")
    shown.add_argument("--explain", action="store_true",
                       help="print every resolved setting with its documentation and where it was set (file:line "
                            "of the spec or of a spec it extends, an override, or the default)")
    shown.add_argument("--dot", action="store_true",
                       help="print the stage graph in Graphviz dot (render: factory plan SPEC --dot | dot -Tsvg)")

    ev = spec_command("eval", "score a model on the spec's eval split with its reward graph, without training, as an "
                              "MLflow run that `factory diff` compares with a training run", _eval)
    ev.add_argument("--model", default=None, metavar="RUN|DIR|URL",
                    help="a tracked run (its newest checkpoint, logged at its step), a checkpoint folder, a Hugging "
                         "Face folder, a peft adapter folder (LoRA: added beside the spec's model when its model.lora "
                         "fits them, else merged into their base), or an OpenAI-compatible "
                         "server's base URL (http://HOST:PORT/v1; the spec's model gives the tokenizer); default: "
                         "the spec's model")
    ev.add_argument("--uri", default=None, help="MLflow tracking URI where RUN is found (default: the spec's, "
                                                "$MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
    ev.add_argument("--replay", default=None, metavar="RUN",
                    help="answer tool calls from RUN's recorded calls instead of calling the tools, as `run "
                         "--replay` does (= replay.run=RUN)")

    init_help = "create a project folder: a spec, a prompt, a reward function, an MCP tool server and data"
    ini = sub.add_parser("init", help=init_help, description=init_help)
    ini.add_argument("name", metavar="NAME", help="the folder to create (its name names the project; '.' = here)")
    ini.set_defaults(func=_init)

    schema_help = "print the spec's JSON Schema (for editors and validators), or its markdown reference"
    sc = sub.add_parser("schema", help=schema_help, description=schema_help)
    sc.add_argument("--markdown", action="store_true", help="print the reference page (docs/reference/spec.md)")
    sc.add_argument("--write", action="store_true",
                    help="rewrite the committed schema and reference of this source checkout")
    sc.set_defaults(func=_schema)

    e = sub.add_parser("export", help="copy a run's checkpoint out as a Hugging Face folder (transformers, vLLM)",
                       description="copy a run's checkpoint out as a Hugging Face folder: safetensors, tokenizer and "
                                   "the run's chat template; loads with transformers and serves with vLLM")
    e.add_argument("run", metavar="RUN", help="a run (MLflow run id, id prefix of 8+ characters, or name), or a "
                                              "folder: a run's checkpoints, one step's, or train.checkpoint_dir "
                                              "(its newest run's)")
    e.add_argument("--step", type=int, default=None, help="the checkpoint of step N (default: the newest)")
    e.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) folder to write")
    e.add_argument("--adapter", action="store_true",
                   help="a LoRA run: write the adapter folder (peft loads it) instead of merged weights")
    e.add_argument("--uri", default=None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    e.set_defaults(func=_export)

    rs = sub.add_parser("rescore", help="score a finished run's saved trajectories again with a changed reward "
                                        "graph (no new rollouts), as a new MLflow run",
                        description="score a finished run's saved trajectories again with another spec's reward "
                                    "graph, without new rollouts; logs a new MLflow run tagged factory.rescore_of")
    rs.add_argument("run", metavar="RUN", help="the finished run (MLflow run id, id prefix of 8+ characters, or name)")
    rs.add_argument("--spec", required=True, metavar="SPEC", help="the spec whose reward graph scores the run")
    rs.add_argument("--steps", default=None, type=_steps, metavar="STEPS",
                    help="only these steps, e.g. 1,3-5 (default: all saved)")
    rs.add_argument("--uri", default=None, help="MLflow tracking URI (default: the spec's, $MLFLOW_TRACKING_URI "
                                                "or sqlite:///mlflow.db)")
    rs.add_argument("--replay", default=None, metavar="RUN",
                    help="answer the tool reward nodes' calls from RUN's recorded calls (often RUN itself) instead "
                         "of starting the tool servers (= replay.run=RUN; under replay.on_miss=live they start, for "
                         "the calls RUN did not make)")
    rs.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE", help="dot-list overrides of the spec")
    rs.set_defaults(func=_rescore)

    uri_help = "MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)"
    r = sub.add_parser("runs", help="list tracked runs: status, steps, final reward, eval metrics, monitors, duration",
                       description="list tracked runs, newest first: status, steps done, final reward, eval "
                                   "metrics, the reward-hacking monitors that fired, spec name, duration")
    r.add_argument("--experiment", default=None, help="only this MLflow experiment (default: all)")
    r.add_argument("--json", action="store_true", help="print the runs as JSON")
    r.add_argument("--limit", type=_runs_limit, default=100, help="at most this many runs (default: 100)")
    r.add_argument("--uri", default=None, help=uri_help)
    r.set_defaults(func=_runs)

    what = ("compare two tracked runs: what defined them (settings, templates, reward code, data, tool "
            "schemas), their metrics side by side, and trajectories of prompts both saw")
    d = sub.add_parser("diff", help=what, description=what)
    d.add_argument("run_a", metavar="RUN_A", help="run id, id prefix (8+ characters) or run name")
    d.add_argument("run_b", metavar="RUN_B", help="run id, id prefix (8+ characters) or run name")
    d.add_argument("--json", action="store_true", help="print the comparison as JSON (see the README)")
    d.add_argument("--prompt", type=int, default=0, metavar="N",
                   help="show the trajectories of the N-th prompt both runs saw (default: 0)")
    d.add_argument("--uri", default=None, help=uri_help)
    d.set_defaults(func=_diff)

    u = sub.add_parser("ui", help="the MLflow UI of the tracking store on 127.0.0.1 (prints its URL)",
                       description="start the MLflow UI (one worker, no job runners) on the tracking store")
    u.add_argument("--port", type=_port, default=5000, help="port (default: 5000)")
    u.add_argument("--host", default="127.0.0.1", help="interface (default: 127.0.0.1, this machine only)")
    u.add_argument("--uri", default=None, help=uri_help)
    u.set_defaults(func=_ui)
    return p


def dashed_overrides(extra: list[str]) -> tuple[list[str], list[str]]:
    """The arguments argparse left over, with `--KEY VALUE` and `--KEY=VALUE` (what a TRL or HF Trainer
    user types) turned into the dot-list override `KEY=VALUE`; and the dashed keys given no value. A
    command's own options were taken by argparse before: what is left that starts with `--` is a key."""
    out, wrong, i = [], [], 0
    while i < len(extra):
        item = extra[i]
        if item.startswith("--") and len(item) > 2:
            key, eq, value = item[2:].partition("=")
            if eq:
                out.append(f"{key}={value}")
            elif i + 1 < len(extra) and not extra[i + 1].startswith("--"):
                out.append(f"{key}={extra[i + 1]}")
                i += 1
            else:
                wrong.append(item)
        else:
            out.append(item)
        i += 1
    return out, wrong


def _override_flag(extra: list[str]) -> tuple[str, str] | None:
    """(`--set`, `train.steps=3`) where a flag that is no key of the spec comes before an override (Hydra's
    and other tools' `--set`, `--override`, `--cfg-options`); None where there is none."""
    for flag, item in zip(extra, extra[1:]):
        if flag.startswith("--") and "=" not in flag and "=" in item and not item.startswith("-"):
            from factory.schema import Spec  # (only here: `factory --help` imports no pydantic)

            if flag[2:].split(".")[0] not in Spec.model_fields:
                return flag, item
    return None


def _options_of(p: argparse.ArgumentParser, command: str) -> list[str]:
    """The `--` options of one subcommand (`check`: --connect, ...): what a mistyped flag is compared with."""
    subs = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))  # argparse keeps them there
    return [o for o in subs.choices[command]._option_string_actions if o.startswith("--")]


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    # Overrides may come after options (`plan SPEC --json a=1 b=2`); argparse stops the positional
    # list at the first option, so the rest arrive as extras.
    args, extra = p.parse_known_args(argv)
    if hasattr(args, "overrides"):  # `--train.lr 1e-5` and `--train.lr=1e-5` are `train.lr=1e-5` (spec commands)
        if flag := _override_flag(extra):  # `--set train.steps=3`: read as the override `set=train.steps=3`
            first = "RUN" if args.command == "rescore" else "SPEC"
            p.error(f"unrecognized arguments: {flag[0]} (an override is KEY=VALUE by itself, with no {flag[0]} before "
                    f"it: factory {args.command} {first} {flag[1]})")
        extra, wrong = dashed_overrides(extra)
        if wrong:
            near = [m for w in wrong if (m := nearest(w, _options_of(p, args.command)))]
            # `check --train.steps 3 SPEC`: argparse took the 3 for the spec, and the key had "no value"
            words = list(sys.argv[1:] if argv is None else argv)
            at = words.index(wrong[0])
            # (argparse took the word after the key for the spec: the value was given, and a word is left after
            # it; `--train.steps SPEC` alone is a key without its value)
            spec_word = args.run if args.command == "rescore" else args.spec  # (rescore's --spec is an option)
            given = (at + 2 < len(words) and words[at + 1] == spec_word
                     and not words[at + 2].startswith("-"))
            first = "RUN" if args.command == "rescore" else "SPEC"
            p.error(f"unrecognized arguments: {' '.join(wrong)}" + (
                f"; did you mean {', '.join(near)}?" if near else
                f" (overrides go after the {first.lower()}, written KEY=VALUE: factory {args.command} {first} "
                f"{wrong[0][2:]}={words[at + 1]})" if given else
                " (an override takes a value: --KEY VALUE or --KEY=VALUE)"))
    unknown = [x for x in extra if x.startswith("-") or not hasattr(args, "overrides")]
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    if getattr(args, "allow_spec_change", False) and args.resume is None:
        p.error("--allow-spec-change goes with --resume")
    if getattr(args, "resume", None) and "=" in args.resume:  # `--resume a.b=c`: an override, not a RUN
        extra, args.resume = [args.resume, *extra], ""
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        with FAIL_FAST.held():  # (the command's own process: a store that is down said soon)
            return args.func(args)
    except SpecErrors as e:
        print(e.report(), file=sys.stderr)
        return EXIT_SPEC_ERROR
    except StoreUnreadable as e:  # the store itself could not be read: infrastructure
        print(f"factory {args.command}: error: {e}", file=sys.stderr)
        return EXIT_INFRA
    except RunLookupError as e:  # a run named on the command line that cannot be found or compared
        print(f"factory {args.command}: error: {e}", file=sys.stderr)
        return EXIT_SPEC_ERROR
    except UserError as e:  # bad input found while running (data rows); Ray wraps it: show the cause
        print(f"factory: {getattr(e, 'cause', None) or e}", file=sys.stderr)
        return EXIT_SPEC_ERROR
    except InfraFailure as e:  # a step's tools or judge were down, a stage hung (StageTimeout): the cause, exit 3
        print(f"factory: {e}", file=sys.stderr)
        return EXIT_INFRA
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `factory plan | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    except Exception as e:  # anything else is a bug in Factory: one line, the traceback on request
        if os.environ.get("FACTORY_DEBUG"):
            traceback.print_exc()
        else:
            # an error raised in a stage arrives as Ray's RayTaskError, whose text is the remote traceback
            e = e.cause if isinstance(getattr(e, "cause", None), Exception) else e
            print(f"factory: internal error: {type(e).__name__}: {e}\n"
                  "rerun with FACTORY_DEBUG=1 to see the traceback", file=sys.stderr)
        return EXIT_INTERNAL_ERROR


if __name__ == "__main__":
    sys.exit(main())
