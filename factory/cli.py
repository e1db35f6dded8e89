"""The `factory` command: run, check, plan, diff, export, schema, init.

Exit codes: 0 success; 2 the spec (or the command line, or the data it names) is wrong, with every
problem listed and no traceback; 1 Factory itself failed (a one-line message; FACTORY_DEBUG=1 shows the traceback).
`check` and `plan` import no torch, Ray or DeepSpeed: they answer in about a second.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable, Sequence

from factory.compiler.errors import EXIT_INTERNAL_ERROR, EXIT_SPEC_ERROR, SpecErrors
from factory.util import UserError


def _check(args: argparse.Namespace) -> int:
    from factory.compiler.compile import compile_file
    from factory.compiler.render import check_summary

    _, plan = compile_file(args.spec, args.overrides, connect=args.connect)
    for warning in plan.warnings:
        print(warning, file=sys.stderr)
    print(check_summary(plan))
    return 0


def _plan(args: argparse.Namespace) -> int:
    from factory.compiler.compile import compile_file, plan_json
    from factory.compiler.render import explain_text, plan_text

    spec, plan = compile_file(args.spec, args.overrides)
    for warning in plan.warnings:
        print(warning, file=sys.stderr)
    if args.json:
        sys.stdout.write(plan_json(plan))
    else:
        sys.stdout.write((explain_text(plan, spec) if args.explain else plan_text(plan)) + "\n")
    return 0


def _run(args: argparse.Namespace) -> int:
    from factory.compiler.compile import compile_file

    spec, plan = compile_file(args.spec, args.overrides)
    for warning in plan.warnings:
        print(warning, file=sys.stderr)
    if not (spec.resources.ray_address or os.environ.get("RAY_ADDRESS")):
        # A local Ray of our own listens on loopback only. Ray would bind its gRPC servers to every
        # interface and advertise the machine's address; this flag (read when ray is imported, so set it
        # before the driver imports ray) makes it take 127.0.0.1 as the node address and bind that alone.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from factory.driver import run

    run(plan, spec)
    return 0


def _export(args: argparse.Namespace) -> int:
    from factory.export import main as export_main

    return export_main(args)


def _diff(args: argparse.Namespace) -> int:
    from factory.diff import main as diff_main

    return int(diff_main(args) or 0)


def _schema(args: argparse.Namespace) -> int:
    from factory import reference

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

    from factory.project import DESCRIPTIONS, InitError, create

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
    cd = f"cd {target.as_posix()} && " if target.resolve() != Path.cwd().resolve() else ""
    print(f"next:\n  {cd}factory check spec.yaml --connect && factory run spec.yaml train.steps=1")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="factory",
        description="Train tool-using LLM agents with RL from one YAML spec.",
        epilog="Overrides are OmegaConf dot-lists: `train.lr=3e-6 rollout.group_size=4`. "
               "Exit codes: 0 ok, 2 spec error, 1 internal error (FACTORY_DEBUG=1 shows the traceback).",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def spec_command(name: str, help_text: str, fn: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help_text, description=help_text)
        c.add_argument("spec", metavar="SPEC", help="the spec file (YAML)")
        c.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dot-list overrides, e.g. train.lr=3e-6")
        c.set_defaults(func=fn)
        return c

    spec_command("run", "train: compile the spec, start Ray and the stages, track the run in MLflow", _run)
    check = spec_command("check", "validate and compile the spec without starting Ray or loading weights", _check)
    check.add_argument("--connect", action="store_true",
                       help="also start each tool server, list its tools and check the tools the spec names")
    plan = spec_command("plan", "print the resolved spec, the stage graph and the hashes that identify a run", _plan)
    plan.add_argument("--json", action="store_true", help="print the plan as stable JSON (what MLflow stores)")
    plan.add_argument("--explain", action="store_true", help="print every resolved setting with its documentation")

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
    e.add_argument("run", metavar="RUN", help="MLflow run id, or a checkpoint folder (train.checkpoint_dir)")
    e.add_argument("--step", type=int, default=None, help="the checkpoint of step N (default: the newest)")
    e.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) folder to write")
    e.add_argument("--uri", default=None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    e.set_defaults(func=_export)

    d = sub.add_parser("diff", help="compare two tracked runs: settings, hashes and final metrics",
                       description="compare two tracked runs: settings, hashes and final metrics")
    d.add_argument("run_a", metavar="RUN_A", help="MLflow run id")
    d.add_argument("run_b", metavar="RUN_B", help="MLflow run id")
    d.add_argument("--uri", default=None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    d.set_defaults(func=_diff)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    # Overrides may come after options (`plan SPEC --json a=1 b=2`); argparse stops the positional
    # list at the first option, so the rest arrive as extras.
    args, extra = p.parse_known_args(argv)
    unknown = [x for x in extra if x.startswith("-") or not hasattr(args, "overrides")]
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        return args.func(args)
    except SpecErrors as e:
        print(e.report(), file=sys.stderr)
        return EXIT_SPEC_ERROR
    except UserError as e:  # bad input found while running (data rows); Ray wraps it: show the cause
        print(f"factory: {getattr(e, 'cause', None) or e}", file=sys.stderr)
        return EXIT_SPEC_ERROR
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `factory plan | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    except Exception as e:  # anything else is a bug in Factory: one line, the traceback on request
        if os.environ.get("FACTORY_DEBUG"):
            traceback.print_exc()
        else:
            print(f"factory: internal error: {type(e).__name__}: {e}\n"
                  "rerun with FACTORY_DEBUG=1 to see the traceback", file=sys.stderr)
        return EXIT_INTERNAL_ERROR


if __name__ == "__main__":
    sys.exit(main())
