"""Small helpers shared by every layer: the one import resolver, file lookup, the one jinja environment
factory."""
from __future__ import annotations

import asyncio
import bisect
import contextlib
import difflib
import importlib
import itertools
import json
import math
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from factory.spelling import nearest


class UserError(Exception):
    """Bad input found while running (data rows, ...): the CLI prints the message alone, no traceback,
    and exits with code 2, as for a spec error."""


# While Factory writes a run to an HTTP tracking store (and while a `factory` command runs): fail fast and let the
# run's spool wait, rather than block the run in MLflow's own retries (7 with backoff: minutes per request while a
# server is down). Never set for good: the process may be a user's notebook, whose own MLflow calls keep MLflow's.
MLFLOW_FAIL_FAST = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


class SharedEnviron:
    """Environment variables that several holders in a process (a run's tracker in a thread, a read of the store in
    the caller's) need in force at once: set by the first `hold` (a variable the user set already stays as they set
    it), put back by the last `let_go`, each only while it still holds the value set (one changed since is someone
    else's). Each holder saving and putting back its own copy undid the other's: a read during a run left the run
    without them, and the run's end put them back set for good."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values = values
        self._lock = threading.RLock()  # (re-entered by a holder dropped, and let go, by the garbage collector)
        self._holders = 0
        self._set: list[str] = []  # the variables the first hold set

    def hold(self) -> None:
        with self._lock:
            if self._holders == 0:
                self._set = [name for name in self.values if name not in os.environ]
                for name in self._set:
                    os.environ[name] = self.values[name]
            self._holders += 1

    def let_go(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0:
                for name in self._set:
                    if os.environ.get(name) == self.values[name]:
                        del os.environ[name]
                self._set = []

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self.hold()
        try:
            yield
        finally:
            self.let_go()


FAIL_FAST = SharedEnviron(MLFLOW_FAIL_FAST)  # the process's one holder of MLflow's fail-fast settings


def put_back(saved: dict[str, str | None]) -> None:
    """Each environment variable as `saved` holds it (None: unset)."""
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """`values` in os.environ while the block runs, then each variable put back as it was: MLflow reads its
    settings from the environment only."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        put_back(saved)


class EnvChanges:
    """What some code (a run's start) set in os.environ, recorded as it set it (`recording`), to be put back later
    (`put_back`): each variable only while it still holds the value that code gave it, as one changed since is
    someone else's (the caller's, setting it while a run went on in a thread). Only the variables `watched` names
    are recorded: other threads of the process change others meanwhile (while a run's Ray starts, its tracker sets
    MLflow's and puts them back), which are not that code's to put back."""

    def __init__(self, watched: Callable[[str], bool]) -> None:
        self.watched = watched
        self.made: dict[str, tuple[str | None, str | None]] = {}  # name -> (before, None: unset; the value set)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Every variable the block adds, changes or removes recorded (its first `before` kept)."""
        before = dict(os.environ)
        try:
            yield
        finally:
            for name in filter(self.watched, before.keys() | os.environ.keys()):
                if (now := os.environ.get(name)) != before.get(name):
                    self.made[name] = (self.made[name][0] if name in self.made else before.get(name), now)

    def put_back(self) -> set[str]:
        """The variables recorded as they were before, where they still hold the value set; the names put back."""
        back = {name: was for name, (was, value) in self.made.items() if os.environ.get(name) == value}
        self.made.clear()
        put_back(back)
        return set(back)


def store_problem(uri: str) -> str | None:
    """Why MLflow would refuse `uri` as the tracking store, or None. A path (`mlflow.db`, `./mlruns`) is
    MLflow's file store, which MLflow 3 refuses unless MLFLOW_ALLOW_FILE_STORE is set: the run failed
    after Ray had started, and `factory runs --uri mlflow.db` with an internal error."""
    scheme = uri.partition("://")[0] if "://" in uri else uri if uri in ("databricks", "databricks-uc", "uc") else ""
    if scheme not in ("", "file"):
        return _scheme_problem(uri, scheme)
    if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("true", "1"):
        return None
    path = uri.removeprefix("file://").removeprefix("file:")  # (file:./mlruns is a file URI too)
    db = path if path.endswith(".db") else f"{path.rstrip('/') or '.'}/mlflow.db"
    return (f"'{uri}' is a path, which MLflow reads as its file store and refuses: a tracking store is a URI, "
            f"sqlite:///{db} (a file here), http://HOST:PORT (a server) or a database URL")


# The schemes MLflow's own tracking stores read (a database's may name its driver: postgresql+psycopg2); a
# plugin adds its own under the entry point group below.
_STORE_SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks", "databricks-uc", "uc")


_DEFAULT_DRIVERS = {"postgresql": "psycopg2", "mysql": "MySQLdb", "mssql": "pyodbc"}  # SQLAlchemy's defaults
# SQLAlchemy's name of a driver (the URL's `+name`) -> the module it imports, and the package that holds it
_DRIVER_MODULES = {"psycopg2": "psycopg2", "psycopg": "psycopg", "pg8000": "pg8000", "asyncpg": "asyncpg",
                   "pymysql": "pymysql", "mysqldb": "MySQLdb", "mysqlconnector": "mysql.connector",
                   "mariadbconnector": "mariadb", "pyodbc": "pyodbc", "pymssql": "pymssql", "pysqlite": "sqlite3"}
_DRIVER_PACKAGES = {"psycopg2": "psycopg2-binary", "MySQLdb": "mysqlclient", "psycopg": "'psycopg[binary]'",
                    "mysql.connector": "mysql-connector-python"}


def _scheme_problem(uri: str, scheme: str) -> str | None:
    """`factory runs --uri foo://bar` met MLflow's model-registry error, an internal error (exit 1)."""
    import importlib.metadata
    import importlib.util

    plugins = {e.name for e in importlib.metadata.entry_points(group="mlflow.tracking_store")}
    base, _, driver = scheme.partition("+")
    if scheme in plugins:
        return None
    if base in _STORE_SCHEMES:
        # SQLAlchemy's driver for a database URL is a module of its own: missing, MLflow's first query
        # failed with ModuleNotFoundError, an internal error (exit 1)
        module = _DRIVER_MODULES.get(driver) if driver else _DEFAULT_DRIVERS.get(base)
        if module is None:  # a driver we do not know the module of: SQLAlchemy's to judge
            return None
        try:
            if importlib.util.find_spec(module) is not None:
                return None
        except ModuleNotFoundError:  # a dotted module whose package is missing (mysql.connector)
            pass
        return (f"'{uri}' needs the database driver module '{module}', which is not installed: install it in "
                f"Factory's environment (uv pip install {_DRIVER_PACKAGES.get(module, module)}), or name an "
                f"installed one in the URL ({base}+DRIVER://)")
    return (f"'{uri}': MLflow has no tracking store for '{scheme}://' URIs: a tracking store is sqlite:///FILE, "
            "http://HOST:PORT (a server), or a database URL (postgresql://, mysql://, mssql://)")


def missing_store(uri: str) -> str | None:
    """Why a command that reads runs (runs, diff, export, rescore, eval of a run) finds none at `uri`: a
    sqlite store whose file is not there (MLflow would create an empty one, and the command say that no run
    has that id, leaving a stray mlflow.db behind), else None."""
    if not uri.startswith("sqlite:///") or uri.startswith("sqlite:///:memory:"):
        return None
    path = Path(uri.removeprefix("sqlite:///").partition("?")[0])
    if path.exists():
        return None
    return (f"no tracking store at {uri} (no file {path} here): runs are in the store `factory run` used (its "
            "tracking.uri, else $MLFLOW_TRACKING_URI, else mlflow.db where it ran); pass it (--uri; uri= from Python), or run "
            "from that folder")


# ------------------------------------------------------------------------------------- async
def run_sync(coro: Any) -> Any:
    """`asyncio.run(coro)`, also from a thread whose event loop is running (a notebook's cell, a stage's
    async setup), where asyncio.run refuses: then in a thread of its own."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


# What asyncio.wait_for raises past its deadline: TimeoutError from Python 3.11 on, a class of its own before.
TIMEOUTS = (TimeoutError, asyncio.TimeoutError)


def being_cancelled() -> bool:
    """Whether the running task is being cancelled: a CancelledError it catches then ends a call that was
    cancelled (a timeout, an episode's deadline), else the called code raised it of its own (a library that
    cancelled an inner task it awaited), which is that code's failure. Before Python 3.11 (no
    Task.cancelling) every CancelledError is taken as a cancellation."""
    cancelling = getattr(asyncio.current_task(), "cancelling", None)
    return cancelling is None or cancelling() > 0


class AllStuck(Exception):
    """Every place of a `Places` is held by work that its caller stopped waiting for and that has not ended."""


class Places:
    """At most `size` pieces of work at once, for work Python cannot stop (a function in a thread): one whose
    caller stopped waiting (past its timeout, or cancelled) keeps its place until it ends, counted in `stuck`,
    so what comes next never runs beside it past `size`. Once every place is stuck, `take` raises AllStuck at
    once: a wait for a place would be a wait for a function that may never return. For one event loop."""

    def __init__(self, size: int):
        self.size = size
        self.running = self.stuck = 0
        # takers waiting for a place, in the order they first came (ticket, future): one woken whose place a
        # newcomer took first (take looks before it queues) waits again in its own turn, not behind later ones
        self._waiting: list[tuple[int, asyncio.Future]] = []
        self._tickets = itertools.count()

    async def take(self) -> None:
        """A place, once one is free (cancelling the wait takes none); AllStuck when every place is stuck."""
        ticket = None
        while True:
            if self.stuck >= self.size:
                raise AllStuck(f"all {self.size} places are held by work past its caller's wait")
            if self.running < self.size:
                self.running += 1
                return
            ticket = next(self._tickets) if ticket is None else ticket
            waiter = asyncio.get_running_loop().create_future()
            bisect.insort(self._waiting, (ticket, waiter), key=lambda entry: entry[0])
            try:
                await waiter  # woken, then looks again
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():  # woken, then cancelled: it takes none, the next may
                    self._wake_one()
                raise
            finally:
                self._waiting.remove((ticket, waiter))

    def abandon(self) -> None:
        """The work in a taken place runs on though its caller stopped waiting: stuck until it ends."""
        self.stuck += 1
        # every waiter, each of which may now find every place stuck
        for _, waiter in self._waiting:
            if not waiter.done():
                waiter.set_result(None)

    def leave(self, stuck: bool = False) -> None:
        """The work in a taken place ended (`stuck`: it had been abandoned); its place is free again."""
        self.running -= 1
        if stuck:
            self.stuck -= 1
        # one place is free: one waiter, the longest waiting (waking all made each place left cost every waiter a
        # look, quadratic in those queued)
        self._wake_one()

    def _wake_one(self) -> None:
        waiter = next((w for _, w in self._waiting if not w.done()), None)
        if waiter is not None:
            waiter.set_result(None)


# What stdio MCP servers are commonly started with: the "did you mean" of a server command that is not found.
LAUNCHERS = ("python", "python3", "uv", "uvx", "npx", "node", "docker", "bash", "sh", "deno", "bunx")


def did_you_mean(name: str, names: Iterable[str]) -> str:
    """"; did you mean 'x'?" for the name a typo most likely meant, else ""."""
    near = nearest(name, names)
    return f"; did you mean '{near}'?" if near else ""


# ------------------------------------------------------------------------------------- import paths
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class RefError(UserError, ValueError):
    """A `module:attr` reference that does not resolve; `str(e)` is the message shown to the user (the
    compiler shows it at the line of the key that named it)."""


def version() -> str:
    """Factory's version (the installed distribution's), or "unknown" in a source tree never pip-installed."""
    import importlib.metadata

    try:
        return importlib.metadata.version("factory-rl")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def escaped(text: str | None) -> str | None:
    """`text` with each lone surrogate as its `\\uXXXX` escape: what UTF-8 (an Arrow string, a tokenizer's input,
    sqlite) can hold. A python tool's os.fsdecode of a file name that is not UTF-8 holds one, and json.loads reads
    a model's `"\\ud83d"` (half an emoji's escape) as one. Other text is left as it is."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def fmt_number(v: float | None, spec: str = ".3f") -> str:
    """A metric in a line or table: '-' when there is none (or NaN); `spec`, except a value of 1e6 or more
    in size, with 4 significant digits (a runaway reward's 1e308 filled a terminal line with digits)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, ".4g" if abs(v) >= 1e6 else spec)


def stdout_console(piped_width: int | None = None, file: Any = None, fit: Any = None) -> Any:
    """A rich Console for a command's output on stdout (`file`), `piped_width` columns wide when it is not
    a terminal (a log or a pipe: room for wide tables), or as wide as `fit` (a renderable) needs when that is
    wider, so a piped table keeps every column ($COLUMNS is not asked: a shell or CI that exports 80 would
    squeeze the table to nothing). A reader that leaves early
    (`factory runs | head`) raises BrokenPipeError, which the command line ends with exit code 0: rich's own
    answer is SystemExit(1)."""
    from rich.console import Console
    from rich.measure import Measurement

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError

    console = _Console(file=file)
    if piped_width is not None and not console.is_terminal:
        if fit is not None:
            wide = _Console(file=file, width=10_000)
            piped_width = max(piped_width, Measurement.get(wide, wide.options, fit).maximum)
        console = _Console(file=file, width=piped_width)
    return console


def shown_path(path: str | os.PathLike) -> str:
    """A path relative to the working directory when it lies below it (stable across checkouts)."""
    p = Path(path).resolve()
    try:
        return p.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return p.as_posix()


@contextlib.contextmanager
def importable(folder: str) -> Iterator[None]:
    """`folder` on sys.path while importing, or while user code runs in this process and may import more
    (a generator called by the compiler); left as it was after: a stage process has already made its
    working directory importable for good, factory.util.enter_workdir."""
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        yield
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)


class NoModuleError(RefError):
    """The module itself is not there (not a module that failed while importing)."""


def close_modules(name: str) -> list[str]:
    """Importable modules one typo away from the dotted `name`, in one of its parts: `rewards.tsk` ->
    `rewards.task`, `factory.reward.format` -> `factory.rewards.format` (`factory.reward` is a package
    too, so the import fails only at `format`). A top-level part is matched against the working
    directory's modules and `factory`, not all of site-packages."""
    import importlib.util
    import pkgutil

    parts, found = name.split("."), []
    for i, part in enumerate(parts):
        try:
            siblings = ([m.name for m in pkgutil.iter_modules(importlib.import_module(".".join(parts[:i])).__path__)]
                        if i else [m.name for m in pkgutil.iter_modules([os.getcwd()])] + ["factory"])
        except (ImportError, AttributeError):  # a parent that is missing, or a module that is not a package
            break
        for alt in difflib.get_close_matches(part, siblings, n=3, cutoff=0.75):
            candidate = ".".join([*parts[:i], alt, *parts[i + 1:]])
            with contextlib.suppress(Exception):  # finding a candidate imports its parents: they may raise
                if alt != part and importlib.util.find_spec(candidate) is not None:
                    found.append(candidate)
    return found


def import_path_meant(ref: str) -> str | None:
    """What a file path or an all-dots name most likely meant: `rewards/task.py:correct` and
    `rewards.task.correct` -> `rewards.task:correct` (None when nothing sensible is near)."""
    if ":" not in ref and ref.endswith(".py"):
        return None  # a file, no function named
    module, _, attr = ref.rpartition(":") if ":" in ref else ref.rpartition(".")
    module = module.removesuffix(".py").replace("/", ".").strip(".")
    guess = f"{module}:{attr}"
    return guess if module and attr and _IMPORT_PATH.match(guess) else None


def _module_functions(name: str) -> list[str] | None:
    """The public functions a module `name` defines, when `name` is an importable module's (None otherwise)."""
    import importlib
    import inspect

    if not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", name):
        return None
    try:
        module = importlib.import_module(name)
    except Exception:  # not a module (a module's attribute written with dots), or one that fails: said elsewhere
        return None
    return [n for n, f in vars(module).items() if inspect.isfunction(f) and f.__module__ == name and not n.startswith("_")]


def _raised_at(exc: BaseException) -> str:
    """` (rewards/task.py:3)`: the line of the project's code where an import failed -- the deepest frame
    in the working directory, else the deepest that is not the import machinery's; '' when none."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    here = str(Path.cwd().resolve()) + os.sep
    mine = [f for f in frames if str(Path(f.filename).resolve()).startswith(here)]
    frame = (mine or frames or [None])[-1]
    return f" ({shown_path(frame.filename)}:{frame.lineno})" if frame is not None else ""


def _import_module(module_name: str, ref: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            attr = ref.partition(":")[2]
            near = "".join(f"; did you mean '{m}:{attr}'?" for m in close_modules(module_name)[:1])
            raise NoModuleError(f"cannot import '{ref}': no module named '{e.name}'{near}") from None
        raise RefError(f"cannot import '{ref}': importing '{module_name}' failed: {e}{_raised_at(e)}") from None
    except SyntaxError as e:
        where = f"{shown_path(e.filename)}:{e.lineno}" if e.filename else module_name
        raise RefError(f"cannot import '{ref}': syntax error in {where}: {e.msg}") from None
    except Exception as e:  # the user's module may raise anything while it is imported
        raise RefError(f"cannot import '{ref}': importing '{module_name}' raised {type(e).__name__}: {e}"
                       f"{_raised_at(e)}") from None
    except SystemExit as e:  # a script's `sys.exit()` at import: left alone, `factory check` would exit with its code
        raise RefError(f"cannot import '{ref}': '{module_name}' called sys.exit({e.code!r}) while being imported"
                       ) from None


def import_object(ref: str) -> Any:
    """`module:attr` -> the object it names, which must be callable (a reward function, a data generator,
    a python tool, a stage class). The one import resolver: the compiler, every stage and the driver use
    it, with one rule. The module is imported as `python -m` would from the working directory, so a
    project's own `rewards/` package works without installing it (a module beside a spec in another
    folder is not: the compiler's error says where it is). Every way this can fail is a `RefError`
    saying what."""
    if not _IMPORT_PATH.match(ref):
        if (functions := _module_functions(ref)) is not None:  # `factory.rewards.math`: a module, no function
            raise RefError(f"'{ref}' is a module: name a function in it, '{ref}:FUNCTION'"
                           + (f" (it defines {', '.join(functions[:8])}{', ...' if len(functions) > 8 else ''})"
                              if functions else ""))
        guess = import_path_meant(ref)
        raise RefError(f"expected an import path 'module:function', got '{ref}'"
                       + (f"; did you mean '{guess}'?" if guess else ""))
    module_name, _, attr = ref.partition(":")
    if module_name == "__main__":  # here the script or notebook; in a stage's process, Ray's own worker
        raise RefError(f"cannot import '{ref}': '__main__' is the running script or notebook, which the stages' "
                       "processes do not run: put the function in a module and name that (rewards/mine.py: "
                       f"'rewards.mine:{attr}')")
    with importable(os.getcwd()):
        module = _import_module(module_name, ref)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            raise RefError(f"cannot import '{ref}': '{module_name}' has no attribute '{part}'"
                           f"{did_you_mean(part, names)}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RefError(f"'{ref}' is not callable")
    return obj


def is_async(fn: Any) -> bool:
    """Whether calling `fn` makes a coroutine, as far as can be told before calling it: an async function, or an
    object whose `__call__` is one (which `inspect.iscoroutinefunction` does not look at). An async function
    behind a plain decorator is not seen here: its caller awaits what it returns."""
    import inspect

    return inspect.iscoroutinefunction(fn) or (not isinstance(fn, type)  # (calling a class makes an instance)
                                               and inspect.iscoroutinefunction(getattr(fn, "__call__", None)))


def as_function(fn: Any) -> Any:
    """`fn` as a function that transformers' `get_json_schema` can describe: that reads the type hints of
    functions only, and took an object with `__call__` or a functools.partial for "not a module, class,
    method, or function". Such a one becomes a stand-in with its signature (`inspect.signature`: an
    object's `__call__`'s less self; a partial's function's less what it binds, keywords too: the model
    is not to set them) and the type hints and docstring of the function that runs (a `__call__` without
    a docstring: its class's). The stand-in is only read, never called."""
    import functools
    import inspect
    import typing

    if inspect.isroutine(fn) or isinstance(fn, type):
        return fn
    inner, bound = fn, set()
    while isinstance(inner, functools.partial):
        inner, bound = inner.func, bound | set(inner.keywords)
    runs = inner if inspect.isroutine(inner) else type(inner).__call__
    signature = inspect.signature(fn)
    signature = signature.replace(parameters=[p for p in signature.parameters.values() if p.name not in bound])
    hints = typing.get_type_hints(runs)

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        raise TypeError("a stand-in read for its schema only: call the tool itself")

    stand_in.__signature__ = signature  # type: ignore[attr-defined]
    stand_in.__annotations__ = {k: v for k, v in hints.items() if k in signature.parameters or k == "return"}
    stand_in.__doc__ = inspect.getdoc(runs) or (None if runs is inner else inspect.getdoc(type(inner)))
    stand_in.__name__ = runs.__qualname__
    return stand_in


def resolve_file(path: str | os.PathLike, base_dir: Path | None = None) -> Path:
    """A file named in the spec: relative to the working directory first, then to the spec's folder; `~` is the
    user's home, as in model.path, extends and train.checkpoint_dir. `~user/` for a user this machine lacks stays
    as written (pathlib raises): not found, which `factory check` says at its key (refs.name_problem)."""
    try:
        p = Path(path).expanduser()
    except RuntimeError:
        p = Path(path)
    if p.is_absolute() or _exists(p) or base_dir is None:
        return p
    alt = Path(base_dir) / p
    return alt if _exists(alt) else p


def _exists(path: Path) -> bool:
    """Whether something is at `path`; not when it lies in a folder this user may not look into (where Python
    3.11 raises PermissionError): the path is then returned as written, and reading it says why."""
    try:
        return path.exists()
    except OSError:
        return False


# ----------------------------------------------------------------------------------------- templates
# jinja's own tojson returns Markup and HTML-escapes '<', which would change the rendered text
# (transformers registers a plain json.dumps for the same reason). A prompt's `tojson(indent)` takes
# jinja's argument order; a chat template's takes transformers' (ensure_ascii first), as HF renders it.
def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, default=_undefined_or_not_json)


def _undefined_or_not_json(value: Any) -> Any:
    """A prompt's undefined name (a column the row lacks, or misspelt) raises its own UndefinedError, which names
    it, as `{{ name }}` does; json.dumps would say only "Object of type StrictUndefined is not JSON serializable"."""
    if isinstance(value, jinja2.Undefined):
        value._fail_with_undefined_error()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _chat_tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
                 sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers' AssistantTracker marks the assistant's text with it
    (for return_assistant_tokens_mask; TRL's assistant-only loss, NeMo's Llama 3.1 tool templates) and otherwise
    renders the body as is. Factory never asks for that mask, so the block is its body, and such a template
    renders as apply_chat_template renders it rather than failing on an unknown tag."""
    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Any) -> str:
        return caller()


def template_env(kind: Literal["prompt", "chat"] = "prompt") -> jinja2.Environment:
    """The one sandboxed jinja environment factory, for every template a spec names.

    prompt: the user's templates (data.prompt, data.system_prompt, judge prompts, tool-node arguments):
    a column the row lacks is an error (StrictUndefined), not an empty string. chat: a Hugging Face chat
    template, compiled as transformers does so the output is byte-identical to
    `tokenizer.apply_chat_template` (loop controls, `{% generation %}` blocks, `raise_exception`,
    `strftime_now`, undefined is empty)."""
    if kind == "chat":
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols, _Generation])
        env.filters["tojson"] = _chat_tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        return env
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False,
                                        undefined=jinja2.StrictUndefined)
    env.filters["tojson"] = _tojson
    return env


def enter_workdir(workdir: str | None) -> None:
    """Make a stage process look like the driver: same working directory, and that directory importable
    (user modules such as a project's `rewards/` import from it)."""
    if workdir:
        if not os.path.isdir(workdir):
            import socket

            raise FileNotFoundError(f"the project folder {workdir} is not on this node ({socket.gethostname()}): a "
                                    "run on several machines needs it at the same path on each (a shared "
                                    "filesystem; see docs/scale.md)")
        os.chdir(workdir)
        if workdir not in sys.path:
            sys.path.insert(0, workdir)


def set_threads(threads: int | None) -> None:
    """An explicit torch thread count for a computing stage (None = all cores): oversubscription on
    small CPU boxes made steps 10-30x slower."""
    import torch

    torch.set_num_threads(threads or os.cpu_count() or 1)


def node_id() -> str | None:
    """The Ray node this process runs on (None outside Ray): stages report it so a run records where
    each replica was placed."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def key_may_go_to(url: str) -> bool:
    """Whether an API key may be sent to `url`: over TLS, or to this machine's loopback."""
    import ipaddress
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme == "https":
        return True
    host = parts.hostname or ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def fsync_path(path: str | os.PathLike) -> None:
    """A file's data, or a folder's entries (a rename or a new file in it), on disk: a power cut after this cannot
    bring back what was there before."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# The Hermes / Qwen tool-call markers (factory.rollout.parse reads the calls): here because a call's JSON may
# quote a reasoning marker, and reasoning is cut before the calls are read.
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_JSON_DECODER = json.JSONDecoder()
_JSON_SPACE = re.compile(r"[ \t\n\r]*")
_TOOL_CALL_CLOSING = re.compile(r"[ \t\n\r]*" + re.escape(TOOL_CALL_CLOSE))
_JSON_WINDOW = 4096  # characters of a call's JSON read at first (see call_json_end)


def call_json_end(text: str, start: int, *, cut: bool = False) -> int | None:
    """Where the JSON object after the `<tool_call>` marker at `start` ends; None when none reads there. `cut`: the
    token limit cut the text, so where the object reads up to a string that the text ends in, the end of the text
    (a call cut inside an argument: any marker after the string's opening quote is quoted in it, not a call of its
    own or a call's end); a finished text that ends inside a string is the model's unclosed quote, so None."""
    body = _JSON_SPACE.match(text, start + len(TOOL_CALL_OPEN)).end()
    if not text.startswith("{", body):  # no call's object
        return None
    # Read in a window that grows only while the text may go on past it: a failed read counts the lines
    # before where it failed, so read in the whole text each broken call cost time up to where it stands.
    window = _JSON_WINDOW
    while True:
        chunk = text[body:body + window]
        try:
            return body + _JSON_DECODER.raw_decode(chunk)[1]
        except RecursionError:
            return None
        except json.JSONDecodeError as e:
            # the decoder seeks a string's closing quote to the end of what it reads (which may end in a `\u12`)
            in_string = e.msg.startswith("Unterminated string") or (
                e.msg.startswith("Invalid \\uXXXX escape") and e.pos + 5 > len(chunk))
            if body + window >= len(text):
                return len(text) if in_string and cut else None
            if not (in_string or e.pos >= len(chunk) - 8):  # (cut short by the window: `fals|e`, `12|3`)
                return None
            window *= 4
        except ValueError:  # an integer past int()'s digit limit (a plain ValueError): the call's parse says so
            return None


def tool_call_end(text: str, start: int, *, or_text_end: bool = False, cut: bool = False) -> int | None:
    """Where the tool-call block ends whose `<tool_call>` marker begins at `start`, when the JSON object after
    the marker reads and a closing marker follows it (any marker inside the JSON's strings is the call's);
    None otherwise. `or_text_end`: also the end of the text when only whitespace follows the JSON, or, where the
    token limit `cut` the text, it ends inside one of its strings (a turn that stopped before its closing marker)."""
    value_end = call_json_end(text, start, cut=cut)
    if value_end is None:
        return None
    if m := _TOOL_CALL_CLOSING.match(text, value_end):
        return m.end()
    return len(text) if or_text_end and _JSON_SPACE.match(text, value_end).end() == len(text) else None


def _reasoning_spans(text: str, cut: bool = False) -> Iterator[tuple[int, int]]:
    """Each reasoning block, in order: (start, end) from a `<think>` that no call quotes to past its `</think>`
    (or to the end of the text). A call block that reads (see `without_reasoning`) is stepped over whole."""
    # Each marker's next position is searched for again only once the scan has passed it (not at every step).
    think, call = text.find(THINK_OPEN), text.find(TOOL_CALL_OPEN)
    while think >= 0:
        if 0 <= call < think:
            pos = tool_call_end(text, call, or_text_end=True, cut=cut)
            if pos is None:  # prose, or a call that does not read: the `<think>` may still be reasoning
                call = text.find(TOOL_CALL_OPEN, call + len(TOOL_CALL_OPEN))
                continue
        else:
            stop = text.find(THINK_CLOSE, think + len(THINK_OPEN))
            pos = len(text) if stop < 0 else stop + len(THINK_CLOSE)
            yield think, pos
        if think < pos:
            think = text.find(THINK_OPEN, pos)
        if 0 <= call < pos:
            call = text.find(TOOL_CALL_OPEN, pos)


def without_reasoning(text: str, *, opened_before: bool = True, cut: bool = False) -> str:
    """`text` without the model's reasoning (Qwen3, R1 and QwQ write it in <think>...</think>): every closed
    block, a block left open (a turn cut while thinking) to the end, and, where the template opened the block
    in the generation prompt (R1's), all before a leading `</think>`. A call or an answer drafted while
    thinking is not one the model made. A `<think>` quoted in a tool call's JSON (a search for the word) opens
    nothing: a call block whose JSON object reads to its closing marker (or to the end of the text) is kept
    whole, whatever markers came before it. A `</think>` inside a call drafted while thinking still ends the
    reasoning there, as the token does for the model.
    `opened_before=False`: the text says itself where its reasoning began (the agent loop starts each turn's
    text with the `<think>` its prompt opened), so a leading `</think>` (one in a call's argument) drops
    nothing before it. `cut`: the token limit cut the text (see `call_json_end`): a call it ends inside a string of
    is kept whole."""
    close = text.find(THINK_CLOSE)
    if opened_before and close >= 0 and not 0 <= next(_reasoning_spans(text, cut), (-1, -1))[0] < close:
        text = text[close + len(THINK_CLOSE):]
    kept, pos = [], 0
    for start, end in _reasoning_spans(text, cut):
        kept.append(text[pos:start])
        pos = end
    kept.append(text[pos:])
    return "".join(kept)
