"""Resolving what a spec refers to: python objects by import path, files, models; and hashing them.

Each check returns a short message (or raises `RefError` with one) instead of letting the user's
ImportError or SyntaxError escape: the compiler reports it at the line of the key that named it.
"""
from __future__ import annotations

import errno
import hashlib
import inspect
import json
import os
import re
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jinja2

from factory.spelling import nearest

# The one import resolver and its error live in factory.util: every stage imports with it too.
from factory.util import RefError, did_you_mean, import_object, resolve_file, shown_path  # noqa: F401


def _code_of(obj: Any, ref: str) -> Any:
    """What `obj`, imported as `ref` (module:attr), is hashed by: a function or class itself (its own file,
    wherever `ref` imports it from); a callable object (a module-level `functools.partial`, an instance with
    `__call__`), which inspect cannot place, by the module `ref` names, where it is made and configured (its
    function's or class's project module is among that module's helpers)."""
    obj = inspect.unwrap(obj)
    if inspect.isroutine(obj) or inspect.isclass(obj):
        return obj
    return sys.modules.get(ref.partition(":")[0], obj)


def source_file(obj: Any, ref: str) -> Path | None:
    """The python file that defines `obj`, imported as `ref` (`_code_of`); None for builtins and C extensions."""
    try:
        found = inspect.getsourcefile(_code_of(obj, ref))
    except TypeError:
        return None
    return Path(found) if found and Path(found).is_file() else None


def source_key(obj: Any, src: Path) -> str:
    """How the plan's hashes name `obj`'s source file `src`: by the module it is imported as
    (`factory/rewards/math.py`, `rewards/mine.py`), so that the same code hashes the same from any working
    directory, checkout or virtualenv (`factory diff` and `--resume` compare these keys); a file that is no
    importable module's by its path."""
    module = getattr(inspect.getmodule(inspect.unwrap(obj)), "__name__", None)
    if not module or module == "__main__":
        return shown_path(src)
    parts = module.split(".")
    return "/".join(parts + [src.name] if src.name == "__init__.py" else parts[:-1] + [src.name])


def _installed_roots() -> tuple[Path, ...]:
    """Where code that is no project's own lies: the Python installation (the standard library,
    site-packages) and Factory's own package (its version is recorded with every run)."""
    import sysconfig

    paths = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    own = Path(__file__).resolve().parents[1]  # factory/ (not `import factory`: the compiler is a lower layer)
    return tuple(Path(p).resolve() for p in {*paths, own} if p)


def helper_sources(obj: Any, ref: str) -> dict[str, Path]:
    """The project modules that the module of `obj` (imported as `ref`: `_code_of`) imports, directly or
    through one another (a reward function's helpers in rewards/util.py): source_key -> file. A module counts
    when its file lies outside the Python installation and Factory (`_installed_roots`); what is imported is
    what the module's globals hold (a module, or a function or class from one), so a helper's change changes
    the plan's hashes as the function's own does (`factory diff`, `--resume`)."""
    root = inspect.getmodule(_code_of(obj, ref))
    if root is None:
        return {}
    installed, seen, todo, out = _installed_roots(), {root.__name__}, [root], {}
    while todo:
        for value in list(vars(todo.pop()).values()):
            try:
                name = value.__name__ if inspect.ismodule(value) else getattr(value, "__module__", None)
            except Exception:  # noqa: BLE001 (a lazy proxy's attribute may raise anything)
                continue
            if not isinstance(name, str) or name in seen:
                continue
            seen.add(name)
            module = sys.modules.get(name)
            file = getattr(module, "__file__", None)
            if not file or not file.endswith(".py") or any(Path(file).resolve().is_relative_to(p) for p in installed):
                continue
            out[source_key(module, Path(file))] = Path(file)
            todo.append(module)
    return dict(sorted(out.items()))


def source_hashes(obj: Any, ref: str) -> dict[str, str]:
    """sha256 of the source file of `obj`, imported as `ref` (`_code_of`), and of its project helpers'
    (`helper_sources`), by source_key; {} for a builtin."""
    own = source_file(obj, ref)
    if own is None:
        return {}
    return ({source_key(_code_of(obj, ref), own): sha256_file(own)}
            | {k: sha256_file(f) for k, f in helper_sources(obj, ref).items()})


# ------------------------------------------------------------------------------------- signatures
def _bind_problem(fn: Callable[..., Any], ref: str, positional: tuple[str, ...], keywords: dict[str, Any],
                  shape: str, row_keywords: bool) -> str | None:
    """Why `fn(*positional, **keywords)` cannot be called, or None. With `row_keywords`, required
    parameters left unbound are taken to be row columns passed by keyword at run time."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # no introspectable signature (a builtin): nothing to check
    # Shown without annotations: `(prompt, completion, answer='')` reads better than the typed form.
    shown = sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
                        return_annotation=sig.empty)
    try:
        bound = sig.bind_partial(*positional, **keywords)
    except TypeError as e:
        unexpected = re.search(r"unexpected keyword argument '([^']+)'", str(e))
        hint = did_you_mean(unexpected.group(1), list(sig.parameters)) if unexpected else ""
        return f"{ref}{shown} cannot be called as {shape}: {e}{hint}"
    for name, param in sig.parameters.items():
        if name in bound.arguments or param.default is not param.empty:
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if row_keywords and param.kind is not param.POSITIONAL_ONLY:
            continue
        return f"{ref}{shown} cannot be called as {shape}: missing a required argument: '{name}'"
    return None


def _one_sample_parameter(fn: Callable[..., Any]) -> str | None:
    """Of the parameters a group call passes the prompts and the completions (the first two positional ones), the
    first annotated `str`: the function evidently scores one sample (numeric_match's `prompt: str`), where a group
    function takes lists. Its annotations decide, never its names (a group reward is declared, not guessed)."""
    import typing

    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:2]
    except (TypeError, ValueError):  # no readable signature (a builtin): nothing to tell
        return None
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 -- an annotation naming what is not importable: read as written
        hints = {}
    return next((p.name for p in params if hints.get(p.name, p.annotation) in (str, "str")), None)


def group_names_warning(fn: Callable[..., Any], ref: str) -> str | None:
    """A warning for a `group: true` function whose first parameters are named `prompt` or `completion`, as one
    sample's are (`ok(prompt, completion, answer, **row)`): called with the group's lists, it would fail every call
    or score nonsense. A warning only: a group function may name its lists so (a group reward is declared)."""
    try:
        names = [p.name for p in inspect.signature(fn).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:2]
    except (TypeError, ValueError):  # no readable signature (a builtin): nothing to tell
        return None
    singular = [f"`{n}`" for n in names if n in ("prompt", "completion")]
    if not singular:
        return None
    return (f"{ref} takes {' and '.join(singular)}, named for one sample, but `group: true` calls it once per group "
            f"as f(prompts, completions, rows), with lists: if it scores one sample, drop `group: true`; if it "
            f"scores a group, name {'them' if len(singular) > 1 else 'it'} "
            f"{' and '.join(n[:-1] + 's`' for n in singular)}")


def reward_problem(fn: Callable[..., Any], ref: str, args: dict[str, Any], group: bool,
                   per_turn: bool = False) -> str | None:
    """A reward function must take `(prompt, completion, **row)`; a group reward `(prompts,
    completions, rows)` (as the reward stage calls them), plus the node's `args` by keyword, and `turns`
    when it declares it; a per-turn one also `turn` and `index` by keyword."""
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):  # its call gives a generator: no score
        kind = "an async generator" if inspect.isasyncgenfunction(fn) else "a generator"
        return f"{ref} is {kind} function (it has `yield`), whose call gives no score: `return` the score"
    if group:
        from factory.reward.graph import takes_turns

        if one := _one_sample_parameter(fn):
            return (f"{ref} scores one sample (its {one}: str), but `group: true` calls it once per group as "
                    "f(prompts, completions, rows), with lists: every call would fail and the node score 0; drop "
                    "`group: true`, or write a group function (docs/rewards.md)")
        turns = {"turns": []} if takes_turns(fn) else {}
        return _bind_problem(fn, ref, ("prompts", "completions", "rows"), {**turns, **args},
                             "f(prompts, completions, rows)", row_keywords=False)
    if per_turn:
        return _bind_problem(fn, ref, ("prompt", "completion"), {"turn": None, "index": 0, **args},
                             "f(prompt, turn_text, turn=..., index=..., **row)", row_keywords=True)
    return _bind_problem(fn, ref, ("prompt", "completion"), args, "f(prompt, completion, **row)",
                         row_keywords=True)


def args_problems(fn: Callable[..., Any], args: dict[str, Any], catch_all_ignores: bool = False) -> dict[str, str]:
    """What is wrong with the `args` a spec gives a function (each by its key), beyond what binding says:
    a value that does not fit its parameter's annotation (`rel_tol: abc` for a float: it failed, or scored
    0, only at run time), and a key that a `**kwargs` catch-all would swallow where it looks like a typo of
    a parameter (`rel_tl`). `catch_all_ignores`: the catch-all is known to drop what it gets (Factory's
    own reward functions: theirs is there for the per-turn keywords), so any key not a parameter is one."""
    import typing

    import pydantic

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no readable signature (a builtin): nothing to check
        return {}
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 -- an annotation that names what is not importable: the keys are still checked
        hints = {}
    named = [n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    catch_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    problems: dict[str, str] = {}
    for key, value in args.items():
        if key not in params:
            hint = did_you_mean(key, named)
            if catch_all and (catch_all_ignores or hint):
                hint = hint or f"; it takes {', '.join(named[2:]) or 'no other'}"
                problems[key] = (f"{_name(fn)} takes no parameter '{key}'{hint} (its **kwargs would take it and "
                                 "ignore it)")
            continue  # without a catch-all, binding says it
        if key in hints:
            try:
                pydantic.TypeAdapter(hints[key]).validate_python(value)
            except pydantic.ValidationError as e:
                # (not the value itself: one read from the environment may be a secret)
                problems[key] = (f"does not fit {_name(fn)}'s {key}: {_annotation(hints[key])} "
                                 f"({e.errors()[0]['msg']})")
            except Exception:  # noqa: BLE001 -- an annotation pydantic cannot build a validator for: unchecked
                pass
    return problems


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))


def _annotation(hint: Any) -> str:
    """`float`, `tuple[int, int]`, `collections.abc.Sequence[str] | None` as written."""
    import typing

    plain = typing.get_origin(hint) is None and getattr(hint, "__name__", None)
    return plain or str(hint).replace("typing.", "").replace("collections.abc.", "")


def generator_problem(fn: Callable[..., Any], ref: str, args: dict[str, Any]) -> str | None:
    """A data generator is called as `fn(n=..., seed=..., **args)`."""
    return _bind_problem(fn, ref, (), {"n": 1, "seed": 0, **args}, "f(n=..., seed=..., **args)",
                         row_keywords=False)


# ------------------------------------------------------------------------------------------ files
def find_file(path: str, base_dir: Path) -> Path | None:
    """A file the spec names: relative to the working directory, then to the spec's folder."""
    p = resolve_file(path, base_dir)
    try:
        return p if stat.S_ISREG(p.stat().st_mode) else None
    except PermissionError:  # in a folder this user may not look into: reading it says so, where "not found" misleads
        return p
    except (OSError, ValueError):
        return None


def template_problem(path: Path, chat_template: bool = False) -> str | None:
    """A jinja syntax error in a template file, as `file:line: message` (text_problem)."""
    from factory.util import template_env

    # Hugging Face chat templates may use loop controls and the `generation` tag (transformers adds
    # both): the chat environment has both.
    env = template_env("chat" if chat_template else "prompt")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        return f"cannot read {shown_path(path)}: {e.strerror or e}"
    except UnicodeDecodeError as e:
        return f"cannot read {shown_path(path)}: {e}"
    return text_problem(env, text, shown_path(path))


def text_problem(env: jinja2.Environment, text: str, name: str | None = None) -> str | None:
    """Why `env` cannot render the template `text` (the file `name`, or text of the spec's own): a syntax error,
    compiled, not only parsed, so that an unknown filter or test (`{{ x | nosuch }}`, which jinja finds when it
    compiles) is found here, not when the run's stage first loads the template; or another template it names."""
    import jinja2
    import jinja2.meta

    try:
        env.from_string(text)  # TemplateAssertionError is a TemplateSyntaxError
        named = list(jinja2.meta.find_referenced_templates(env.parse(text)))
    except jinja2.TemplateSyntaxError as e:
        where = f"in {name}:{e.lineno}" if name else f"at line {e.lineno}"
        return f"template syntax error {where}: {e.message}"
    if named:  # a template is read alone (and hashed alone): another one it names is not found when it renders
        which = ", ".join(repr(n) if n else "one named by a variable" for n in named)
        return (f"{name or 'the template'} names another template ({which}) by include, import or extends: a "
                f"template is read alone, without the files it names; write that template's text into this one")
    return None


# ----------------------------------------------------------------------------------------- models
def _known_assets() -> dict[str, str] | None:
    try:
        from factory.assets import KNOWN_ASSETS
    except ImportError:
        return None
    return KNOWN_ASSETS


NAME_MAX = 255  # bytes of one file or folder name (Linux, macOS): the file systems Factory runs on


def name_problem(path: str, home: bool = True) -> str | None:
    """Why the OS cannot look `path` up as a file name here, or None: a part longer than its file system allows
    (an inline text where a file is named), or with `home` (a path read with `~` as the home folder)
    `~user/...` for a user this machine does not have (`~models/x` meant as `~/models/x`). pathlib raises for
    both where it answers False for a name that is merely not there."""
    # the file system says so only where the folders above the long part are there (runs/ before a first run)
    longest = max((len(os.fsencode(part)) for part in Path(path).parts), default=0)
    if longest > NAME_MAX:
        return f"not a file name here: a part of it is {longest} bytes, more than a file name can be ({NAME_MAX})"
    try:
        (Path(path).expanduser() if home else Path(path)).exists()
    except RuntimeError:  # expanduser: no such user
        user = path[1:].partition("/")[0]
        return (f"not a file name here: ~{user} is the home folder of a user {user!r}, whom this machine does not "
                "have (your own is ~/)")
    except OSError as e:  # ENAMETOOLONG; another error (EACCES) is the lookup's to say, which names the file
        return f"not a file name here: {e.strerror or e}" if e.errno == errno.ENAMETOOLONG else None
    return None


def is_hub_id(path: str) -> bool:
    """Whether a model path names a Hugging Face hub repository (`org/name` or `name`) rather than a local
    folder or a built-in `factory:` asset."""
    if path.startswith(("factory:", ".", "/", "~")) or path.count("/") > 1 or name_problem(path):
        return False
    return not Path(path).expanduser().exists()


def hub_snapshot(repo_id: str, required_file: str = "config.json") -> Path | None:
    """The folder of a hub model in the local Hugging Face cache (huggingface_hub's own lookup: $HF_HOME,
    $HF_HUB_CACHE; never the network, whatever $HF_HUB_OFFLINE says), holding `required_file`; None when
    it is not there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None
    return folder if not required_file or (folder / required_file).is_file() else None


def hub_cache() -> str:
    """The local Hugging Face cache this process reads ($HF_HUB_CACHE, else $HF_HOME/hub)."""
    from huggingface_hub import constants

    return shown_path(constants.HF_HUB_CACHE)


def json_object(file: Path) -> dict[str, Any]:
    """A JSON file that must hold an object (a model's config.json, its tokenizer_config.json); ValueError
    with the reason as the user should read it, naming the file."""
    shown = shown_path(file)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{shown} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {shown}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{shown} must hold a JSON object, got {type(data).__name__}")
    return data


# A model's weights as transformers loads them: one file, shards, or a shards' index.
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model*.bin.index.json")


def has_weights(folder: Path) -> bool:
    return any(next(folder.glob(pattern), None) is not None for pattern in WEIGHT_FILES)


def model_problem(path: str, required_file: str = "config.json", weights: bool = True) -> tuple[str | None, str | None]:
    """(error, warning) for a model path: a `factory:NAME` asset must be known, a local folder must hold
    `required_file` (JSON that parses, for a .json file) and, with `weights`, the weights; anything else is
    taken as a hub id that must already be in the local cache (with its weights)."""
    if path.startswith("factory:"):
        name = path.removeprefix("factory:")
        known = _known_assets()
        if known is None or name in known:
            return None, None
        close = nearest(name, sorted(known))  # (the one ranking every "did you mean" uses: factory/spelling.py)
        hint = f"did you mean 'factory:{close}'? " if close else ""
        return f"unknown built-in model '{path}'; {hint}known: {', '.join('factory:' + k for k in sorted(known))}", None
    if problem := name_problem(path):
        return problem, None
    local = Path(path).expanduser()
    if local.is_dir():
        if required_file and not (local / required_file).is_file():
            return f"model folder has no {required_file}: {path}", None
        if required_file.endswith(".json"):  # what transformers reads first: it must parse
            try:
                json_object(local / required_file)
            except ValueError as e:
                return str(e), None
        if weights and not has_weights(local):  # else `factory run` fails only when the update stage loads it
            return (f"model folder has no weights (*.safetensors or pytorch_model*.bin files): {path}; copy the "
                    "model's weight files into it, or give the folder that holds them"), None
        return None, None
    if local.is_file():  # `model.path: models/x/config.json`, say
        holds = f"{required_file} and the weights" if weights else required_file or "the tokenizer files"
        fix = (f"did you mean its folder, {shown_path(local.parent)}?" if (local.parent / "config.json").is_file()
               else f"give the folder that holds {holds}")
        return f"model folder expected, got a file: {path}; {fix}", None
    if not is_hub_id(path):
        return f"model folder not found: {path}", None
    cached = hub_snapshot(path, required_file)
    if cached is not None and weights and not has_weights(cached):
        return (f"the local Hugging Face cache ({hub_cache()}) holds '{path}' without its weights "
                f"(*.safetensors or pytorch_model*.bin files): fill it with `hf download {path}`"), None
    if cached is not None:
        return None, None
    return (f"'{path}' is not a local folder, and as a Hugging Face hub id it is not in the local Hugging Face "
            f"cache ({hub_cache()}): fill the cache with `hf download {path}` (where the hub can be reached; "
            "copy the cache folder over to a machine that cannot reach it), or point HF_HOME at a cache that "
            "holds it"), None


# ----------------------------------------------------------------------------------------- hashes
def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):  # data files may be large: stream them
            digest.update(chunk)
    return digest.hexdigest()


def canonical_json(obj: Any) -> str:
    """The one JSON text of a value: sorted keys, no spaces, unicode kept."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()
