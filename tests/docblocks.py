"""The docs harness: every fenced block of a documentation page is executed, so the docs cannot drift.

A page runs top to bottom, like a reader following it, in a fresh working folder of its own that holds
copies of the repository's specs/, prompts/ and schema/ and a link to the third-party tool servers that
bin/setup installs (.factory/tool-venvs), so the docs' relative paths work as in a checkout, with
this environment's `factory` first on PATH (as after `source .venv/bin/activate`) and no
MLFLOW_TRACKING_URI (runs go to ./mlflow.db of that folder). The info string after the language holds
the harness's instructions, which GitHub does not show: ```` ```bash run-overrides="train.steps=1" ````.

By language:
- `bash`, `sh`: the block runs as one bash script (`set -euo pipefail`) and must exit 0.
    `run-overrides="k=v ..."`: appended to every `factory run` in the block. This is the ONE place where
      the harness runs something other than what the reader sees: long runs are cut short (fewer steps,
      fewer eval rows) so that the docs run in CI in seconds. The page's command itself is unchanged.
    `serve=URL`: a server that runs until stopped: the harness starts it, waits until URL answers (an
      HTTP status below 500), then stops it. `background=URL`: the same, but it keeps running for the
      rest of the page (later blocks talk to it) and is stopped when the page ends.
    `skip="why"`: not run (only `bash -n` checks it); the reason is required (a GPU, a cluster...).
    `slow="why"`: run only by the slow tests (`pytest -m slow`); the default suite checks its syntax as
      for `skip`. For a training run that CI cannot afford twice; the reason says which test covers it.
- `console`: each `$ command` line runs (bash); the lines after it, up to the next `$` line, are its
    expected output (stdout and stderr together). `...` alone on a line matches any number of lines;
    `...` inside a line matches any text. Exit codes are not checked: the output shows the error.
    `run-overrides` and `slow` work as for `bash`.
- `yaml`: `same-as=FILE` fails unless the block holds what the repository's FILE holds (comments aside);
    `file=PATH` writes the block there (later blocks use it); `base=SPEC` checks the block's
    top-level sections in place of SPEC's with `factory check` (with `file=PATH` too, that spec is
    written to PATH); a block that is a whole spec (it has `name`, `model`, `data` and `rewards`) is
    checked with `factory check` as it is, unless it is marked `broken` (a page showing mistakes; its
    console block then shows the errors). A spec file that a later block runs `factory check` on is
    checked there only (with that block's flags, such as --connect).
- `python`: `file=PATH` writes the block there; otherwise it runs with this environment's python in the
    working folder and must exit 0. `slow` works as for `bash` (the default suite compiles it).
- `json`: must parse (a `.jsonl` file: line by line); `file=PATH` writes it.
- any language: `file=PATH` writes the block; `skip="why"` leaves it alone; `needs=MODULE`: skipped where
    MODULE is not installed (`needs=vllm`: Python 3.10, `FACTORY_NO_VLLM=1`).
A block the harness would not execute is an error: every command and snippet in the docs runs.
A block ends where GitHub ends it, at a line of nothing but its fence; a fence with text after it is an error.
Relative links and images of a page must exist.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LINKED = ("specs", "prompts", "schema")  # what a page's working folder has of the repository (copied)
_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>.*)$")
_LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")


class DocError(AssertionError):
    """A block failed; the message names the page and line."""


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    attrs: dict[str, str]
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO).as_posix()}:{self.line}"


@dataclass
class Page:
    path: Path
    blocks: list[Block] = field(default_factory=list)
    links: list[tuple[int, str]] = field(default_factory=list)


def _checked_later(page: Page) -> None:
    """A spec written by a yaml block that a later block runs `factory check` on is checked there (with
    the page's own flags, often --connect): checking it twice would only cost time."""
    for k, block in enumerate(page.blocks):
        name = block.attrs.get("file")
        if block.lang in ("yaml", "yml") and name:
            later = "\n".join(b.text for b in page.blocks[k + 1:] if b.lang in ("console", "bash", "sh"))
            if re.search(rf"factory check {re.escape(name)}(\s|$)", later):
                block.attrs["checked-later"] = ""


def _closing(path: Path, lines: list[str], i: int, fence: str) -> int:
    """The index of the line that closes the block opened at `i` with `fence` (len(lines) if none does).

    As CommonMark (GitHub) has it: a line of nothing but the fence's character, at least as many of it. A
    shorter fence is the block's text (a page showing a block inside a longer fence); one with text after
    it is too, on GitHub, so the block would run on over the headings below it: such a line is refused."""
    for j in range(i + 1, len(lines)):
        m = _FENCE.match(lines[j])
        if m and m.group("fence")[0] == fence[0] and len(m.group("fence")) >= len(fence):
            if m.group("info").strip():
                raise DocError(f"{path.relative_to(REPO).as_posix()}:{j + 1}: a fence with text after it closes "
                               f"no block on GitHub (the block of line {i + 1} runs on): put the text on a line "
                               "of its own")
            return j
    return len(lines)


def parse(path: Path) -> Page:
    page = Page(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            page.links += [(i + 1, t.group("target")) for t in _LINK.finditer(lines[i])]
            i += 1
            continue
        fence, indent = m.group("fence"), len(m.group("indent"))
        lang, _, rest = m.group("info").strip().partition(" ")
        attrs = {}
        for token in shlex.split(rest):
            key, sep, value = token.partition("=")
            attrs[key] = value if sep else ""
        j = _closing(path, lines, i, fence)
        body = [line[indent:] if line[:indent].strip() == "" else line for line in lines[i + 1:j]]
        page.blocks.append(Block(path, i + 1, lang.lower(), attrs, "\n".join(body) + "\n"))
        i = j + 1
    _checked_later(page)
    return page


# ------------------------------------------------------------------------------------------ running
_FORK: Path | None = None  # the fork server's folder (tests/docfork.py), while `fork_server` runs


def environment(fork: bool = True) -> dict[str, str]:
    """The blocks' environment; with the fork server running (and `fork`), its `factory` first on PATH."""
    # COLUMNS: rich wraps at 80 columns when it writes to a pipe; a wide page reads better and matches better
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "COLUMNS": "160"}
    # PYTEST_CURRENT_TEST: pytest's, changed per test (a user has none; the fork server compares environments)
    for var in ("FACTORY_DEBUG", "MLFLOW_TRACKING_URI", "RAY_ADDRESS", "FACTORY_DOCS_FORK", "PYTEST_CURRENT_TEST"):
        env.pop(var, None)
    if _FORK is not None and fork:
        env["PATH"] = f"{_FORK}{os.pathsep}{env['PATH']}"
        env["FACTORY_DOCS_FORK"] = str(_FORK / "socket")
    return env


@contextlib.contextmanager
def fork_server() -> Iterator[None]:
    """The blocks' `factory` commands through tests/docfork.py (one import of the compiler for all of them,
    ~0.6 s less per command); servers (`serve=`, `background=`) start as they are, to be stopped by their
    process group."""
    global _FORK
    from tests import docfork

    folder = Path(tempfile.mkdtemp(prefix="factory-docs-fork-"))
    docfork.write_shim(str(folder), sys.executable, str(BIN / "factory"))
    _FORK = folder
    server = subprocess.Popen([sys.executable, docfork.__file__, str(folder / "socket")], env=environment(),
                              cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (folder / "socket").exists():
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the docs fork server did not start (exit {server.poll()})")
            time.sleep(0.05)
        yield
    finally:
        _FORK = None
        os.killpg(server.pid, 9)  # the server and any command still running from it
        server.wait()
        shutil.rmtree(folder, ignore_errors=True)


def workdir(tmp: Path) -> Path:
    """A page's working folder with copies (not links: a page may write files there) of LINKED."""
    for name in LINKED:
        shutil.copytree(REPO / name, tmp / name, ignore=shutil.ignore_patterns("__pycache__"))
    if (REPO / ".factory" / "tool-venvs").is_dir():  # third-party MCP servers (bin/install-tool-servers)
        (tmp / ".factory").mkdir()
        (tmp / ".factory" / "tool-venvs").symlink_to(REPO / ".factory" / "tool-venvs", target_is_directory=True)
    return tmp


def _bash(script: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", script], cwd=cwd, env=environment(), capture_output=True, text=True,
                          timeout=timeout, check=False)


def _comment_start(line: str) -> int:
    """Where a shell comment starts in `line`, len(line) if none: bash's rule, a `#` outside quotes that
    begins a word (shlex's `comments=True` also cuts `a=b#c`, which bash reads as one word)."""
    quote, k = "", 0
    while k < len(line):
        c = line[k]
        if quote:
            if c == quote:
                quote = ""
            elif c == "\\" and quote == '"':
                k += 1
        elif c == "\\":
            k += 1
        elif c in "'\"":
            quote = c
        elif c == "#" and (k == 0 or line[k - 1] in " \t;&|()"):
            return k
        k += 1
    return len(line)


def _with_overrides(script: str, overrides: str) -> str:
    """`factory run SPEC ...` -> `factory run SPEC ... OVERRIDES`, at the end of each such command (before a
    comment after it: in the comment, they would be no part of the command)."""
    out = []
    for line in script.splitlines():
        cut = _comment_start(line)
        parts = re.split(r"(&&|\|\||;|\|)", line[:cut])
        for k, part in enumerate(parts):
            if re.search(r"(^|\s)factory run\s", part):
                body = part.rstrip()
                parts[k] = f"{body} {overrides}" + part[len(body):]
        out.append("".join(parts) + line[cut:])
    return "\n".join(out)


def _fail(block: Block, what: str, out: subprocess.CompletedProcess[str] | None = None) -> DocError:
    text = f"{block.where}: {what}"
    if out is not None:
        text += f"\n--- exit {out.returncode}\n--- stdout\n{out.stdout[-4000:]}\n--- stderr\n{out.stderr[-4000:]}"
    return DocError(text)


def _syntax(block: Block, script: str, cwd: Path) -> None:
    out = _bash(f"bash -n <<'__FACTORY_DOC__'\n{script}__FACTORY_DOC__\n", cwd, 30)
    if out.returncode:
        raise _fail(block, "shell syntax error", out)


def run_bash(block: Block, cwd: Path, timeout: float) -> subprocess.Popen[str] | None:
    if "skip" in block.attrs:
        return _syntax(block, block.text, cwd)
    script = block.text
    if "run-overrides" in block.attrs:
        script = _with_overrides(script, block.attrs["run-overrides"])
    if "serve" in block.attrs or "background" in block.attrs:
        return _serve(block, script, cwd, timeout)
    out = _bash("set -euo pipefail\n" + script, cwd, timeout)
    if out.returncode:
        raise _fail(block, "the commands failed", out)


def _answers(url: str) -> bool:
    """Whether an HTTP server answers at `url` (any status below 500: an MCP endpoint refuses a GET)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status < 500
    except urllib.error.HTTPError as e:
        return e.code < 500
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _serve(block: Block, script: str, cwd: Path, timeout: float) -> subprocess.Popen[str] | None:
    """Start a server, wait until its URL answers; stop it (`serve`) or hand it back (`background`)."""
    url = block.attrs.get("serve") or block.attrs["background"]
    log = (cwd / f".server-{block.line}.log").open("w")
    with log:  # the server writes to its own copy of the file descriptor
        proc = subprocess.Popen(["bash", "-c", script], cwd=cwd, env=environment(fork=False), stdout=log,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise _fail(block, f"the server exited ({proc.returncode}) before {url} answered:\n"
                                   f"{(cwd / log.name).read_text()[-4000:]}")
            if _answers(url):
                if "background" in block.attrs:
                    return proc
                break
            time.sleep(0.5)
        else:
            raise _fail(block, f"{url} did not answer within {timeout:.0f} s")
    except BaseException:
        stop(proc)
        raise
    stop(proc)
    return None


def stop(proc: subprocess.Popen[str]) -> None:
    """Stop a server the harness started, and anything it started (its own session)."""
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def _matches(expected: list[str], actual: list[str]) -> bool:
    """`...` alone matches any run of lines; `...` within a line matches any text."""
    if not expected:
        return not actual
    head, rest = expected[0], expected[1:]
    if head.strip() == "...":
        return any(_matches(rest, actual[k:]) for k in range(len(actual) + 1))
    if not actual:
        return False
    pattern = ".*".join(re.escape(p) for p in head.split("..."))
    return re.fullmatch(pattern, actual[0]) is not None and _matches(rest, actual[1:])


def run_console(block: Block, cwd: Path, timeout: float) -> None:
    commands: list[tuple[str, list[str]]] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:], []))
        elif commands:
            commands[-1][1].append(line.rstrip())
        elif line.strip():
            raise _fail(block, f"a console block starts with `$ command`, not {line!r}")
    for command, expected in commands:
        if "run-overrides" in block.attrs:
            command = _with_overrides(command, block.attrs["run-overrides"])
        # stderr into stdout, in the order printed, as a terminal shows them
        out = subprocess.run(["bash", "-c", command], cwd=cwd, env=environment(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=timeout, check=False)
        actual = [x.rstrip() for x in out.stdout.rstrip("\n").splitlines()]
        while expected and not expected[-1]:
            expected.pop()
        if not _matches(expected, actual):
            raise _fail(block, f"`$ {command}` printed something else than the page shows:\n--- page\n"
                               + "\n".join(expected) + "\n--- actual\n" + "\n".join(actual))


def _is_spec(data: object) -> bool:
    return isinstance(data, dict) and {"name", "model", "data", "rewards"} <= set(data)


def check_spec(block: Block, spec: Path, cwd: Path) -> None:
    out = _bash(f"factory check {shlex.quote(spec.relative_to(cwd).as_posix())}", cwd, 120)
    if out.returncode:
        raise _fail(block, f"`factory check` refuses this spec ({spec.name})", out)


def run_yaml(block: Block, cwd: Path) -> None:
    try:
        data = yaml.safe_load(block.text)
    except yaml.YAMLError as e:
        if "broken" not in block.attrs:
            raise _fail(block, f"not YAML: {e}") from None
        data = None  # a page showing a YAML mistake
    if "same-as" in block.attrs:  # a shipped spec shown in full: it must say what the file says
        if data != yaml.safe_load((REPO / block.attrs["same-as"]).read_text(encoding="utf-8")):
            raise _fail(block, f"this block is not {block.attrs['same-as']} (their keys or values differ)")
    if "file" in block.attrs and "base" not in block.attrs:
        target = cwd / block.attrs["file"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block.text, encoding="utf-8")
        if _is_spec(data) and not {"broken", "checked-later"} & set(block.attrs):
            check_spec(block, target, cwd)
        return
    if "base" in block.attrs:
        base = yaml.safe_load((cwd / block.attrs["base"]).read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise _fail(block, "a block with base= holds top-level spec sections")
        merged = {**base, **data}
    elif _is_spec(data):
        merged = data
    else:
        raise _fail(block, "a yaml block needs base=SPEC (checked as SPEC with these sections), file=PATH, "
                           "skip=\"why\", or to be a whole spec")
    target = cwd / block.attrs.get("file", f".doc-{block.line}.yaml")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(yaml.safe_dump(merged, sort_keys=False), encoding="utf-8")
    if "checked-later" not in block.attrs:
        check_spec(block, target, cwd)


def run_python(block: Block, cwd: Path, timeout: float) -> None:
    if "file" in block.attrs:
        target = cwd / block.attrs["file"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block.text, encoding="utf-8")
        return
    out = subprocess.run([sys.executable, "-c", block.text], cwd=cwd, env=environment(), capture_output=True,
                         text=True, timeout=timeout, check=False)
    if out.returncode:
        raise _fail(block, "the python block failed", out)


def run_block(block: Block, cwd: Path, timeout: float = 600, slow: bool = False) -> subprocess.Popen[str] | None:
    """Run one block; a server started with `background=` is returned (the caller stops it). A block
    marked `slow` runs only when `slow` is true; otherwise its shell syntax is checked."""
    if (module := block.attrs.get("needs")) and importlib.util.find_spec(module) is None:
        block.attrs["skip"] = f"{module} is not installed here"
    for attr in ("skip", "slow"):
        if attr in block.attrs and not block.attrs[attr].strip():
            raise _fail(block, f'{attr} needs a reason: {attr}="why this block cannot run here"')
    if "slow" in block.attrs and not slow:
        if block.lang == "console":
            commands = [line[2:] for line in block.text.splitlines() if line.startswith("$ ")]
            return _syntax(block, "".join(f"{c}\n" for c in commands), cwd)
        if block.lang in ("bash", "sh", "shell"):
            return _syntax(block, block.text, cwd)
        if block.lang == "python" and "file" not in block.attrs:
            try:
                compile(block.text, block.where, "exec")
            except SyntaxError as e:
                raise _fail(block, f"python syntax error: {e}") from None
            return None
        raise _fail(block, "slow is for bash, console and python blocks (commands, scripts)")
    if block.lang in ("bash", "sh", "shell"):
        return run_bash(block, cwd, timeout)
    if "skip" in block.attrs:
        return None
    if block.lang == "console":
        return run_console(block, cwd, timeout)
    if block.lang in ("yaml", "yml"):
        return run_yaml(block, cwd)
    if block.lang == "python":
        return run_python(block, cwd, timeout)
    if block.lang == "json":
        try:
            json.loads(block.text) if "file" not in block.attrs or not block.attrs["file"].endswith(".jsonl") \
                else [json.loads(line) for line in block.text.splitlines() if line.strip()]
        except ValueError as e:
            raise _fail(block, f"not JSON: {e}") from None
    if "file" in block.attrs:
        target = cwd / block.attrs["file"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block.text, encoding="utf-8")
        return None
    raise _fail(block, f"the harness does not run a `{block.lang or 'plain'}` block: give it file=PATH, "
                       'skip="why", or write it as console/bash/yaml/python')


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings."""
    from factory.commands.reference import anchor

    found, lines, i = set(), path.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        if m := _FENCE.match(lines[i]):
            i = _closing(path, lines, i, m.group("fence"))
        elif lines[i].startswith("#"):
            found.add(anchor(lines[i].lstrip("#").strip()))
        i += 1
    return found


def check_links(page: Page) -> list[str]:
    """Relative links and images that point nowhere, and #anchors that no heading makes."""
    broken = []
    for line, target in page.links:
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.path.parent / file).resolve() if file else page.path
        where = f"{page.path.relative_to(REPO).as_posix()}:{line}"
        if not path.exists():
            broken.append(f"{where}: broken link {target}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{where}: no heading makes the anchor #{anchor} in {file or 'this page'}")
    return broken
