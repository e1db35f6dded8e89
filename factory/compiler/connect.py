"""`factory check --connect`: start every tool server, list its tools, shut it down; and ask every judge
endpoint whether it is there.

Each server is started on its own (all of them concurrently), so a server that fails is reported at its
own line; `allowed_tools` is lifted while listing so that the compiler can say which named tool is
missing, with a suggestion, instead of the server refusing to start.
"""
from __future__ import annotations

import asyncio
import re
import sysconfig
from typing import Any

from factory.compiler.errors import SpecError
from factory.compiler.load import SpecSource
from factory.endpoints import judge_unanswered, why_unreachable
from factory.schema import HttpServer, JudgeNode, Spec, StdioServer
from factory.util import run_sync, shown_path

# Starting a server includes its handshake; tools already have their own start timeout, this bounds the
# whole listing so that `check` always returns: at least LIST_TIMEOUT_S, and a server's own start_timeout_s
# with START_MARGIN_S to spare (its process launched and its own timeout said, before this one cuts it short).
LIST_TIMEOUT_S = 60.0
START_MARGIN_S = 10.0


def _list_timeout_s(server: Any) -> float:
    """How long `check --connect` gives `server` to start and list its tools: as long as a run waits, and more."""
    own = server.start_timeout_s if isinstance(server, (StdioServer, HttpServer)) else 0.0  # a python tool: none
    return max(LIST_TIMEOUT_S, own + START_MARGIN_S)


async def _list_one(name: str, server: Any, source: SpecSource) -> list[dict[str, Any]]:
    from factory.tools import ToolBox

    box = ToolBox.from_spec({name: server.model_copy(update={"allowed_tools": None})}, base_dir=source.base_dir)
    try:
        await asyncio.wait_for(box.start(), _list_timeout_s(server))
        return box.tool_listing()[name]
    finally:
        await box.close()


async def _list_all(spec: Spec, source: SpecSource) -> tuple[dict[str, list[dict[str, Any]]], list[SpecError]]:
    from factory.tools.connection import REFUSED, UNREACHED, launch_problem, stdio_parameters

    listing: dict[str, list[dict[str, Any]]] = {}
    errors: list[SpecError] = []
    names = []
    for name, server in spec.tools.items():
        # said at the field at fault (an override's, when one set it), not started
        problem = launch_problem(stdio_parameters(server, source.base_dir)) if isinstance(server, StdioServer) else None
        if problem is not None:
            errors.append(source.error(f"tools.{name}.{problem[0]}", f"server cannot start: {problem[1]}"))
        else:
            names.append(name)
    results = await asyncio.gather(*(_list_one(n, spec.tools[n], source) for n in names), return_exceptions=True)
    for name, result in zip(names, results):
        if isinstance(result, asyncio.TimeoutError):
            bound = _list_timeout_s(spec.tools[name])
            errors.append(source.error(f"tools.{name}", f"server did not start within {bound:.0f} s"))
        elif isinstance(result, Exception):
            lines = str(result).splitlines() or [type(result).__name__]
            # ToolStartError says "NAME: tool server 'NAME' failed to start: WHY" (an HTTP server's "at URL could
            # not be reached: WHY", or "at URL was reached, but refused: WHY"); the location says NAME.
            http = isinstance(spec.tools[name], HttpServer)
            happened = (REFUSED if f" {REFUSED}: " in lines[0] else UNREACHED) if http else "failed to start"
            text = lines[0].rpartition(f"{happened}: ")[2]
            # "Connection closed" says little; the last line the server printed usually says why.
            said = [line for line in lines[1:] if not line.startswith("--- server stderr")]
            if words := last_words(said):
                text += f"; the server's last words: {words}"
            what = f"server at {spec.tools[name].url} {happened}" if http else "server failed to start"
            errors.append(source.error(f"tools.{name}", f"{what}: {text}"))
        elif isinstance(result, BaseException):
            raise result  # KeyboardInterrupt and friends are not spec errors
        else:
            listing[name] = result
    return listing, errors


# A Python exception's line (`NameError: ...`, `json.decoder.JSONDecodeError: ...`), and a traceback's frame.
_RAISED = re.compile(r"(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception)(?::|$)")
_FRAME = re.compile(r'\s*File "([^"]+)", line (\d+)')
# An exception group's traceback (Python 3.11's, for anyio's task groups: FastMCP, the MCP SDK's stdio servers) is
# drawn in a box: its rules (`+-+---- 1 ----`, `+------`) and the margin (`| `, `+ `) of every other line.
_BOX_RULE = re.compile(r"\+-[-+.\d\s]*")
_BOX_MARGIN = re.compile(r"\A[|+]\s?")
_WORDS_CHARS = 300


def last_words(lines: list[str]) -> str:
    """What a dying server's last lines of stderr say went wrong, on one line ('' for none). A Python error: its
    last exception line (in an exception group, its last sub-exception's) and the lines after it (a log that
    wraps a long message), after the traceback's last frame in the server's own code as `path:N` (else its last
    frame). Otherwise its last three lines."""
    said = [line.strip() for line in lines if line.strip()]
    if any(line.startswith("+ Exception Group Traceback") for line in said):
        said = [_BOX_MARGIN.sub("", line).strip() for line in said if not _BOX_RULE.fullmatch(line)]
        said = [line for line in said if line]
    raised = next((i for i in range(len(said) - 1, -1, -1) if _RAISED.match(said[i])), None)
    if raised is None:
        return " / ".join(said[-3:])[-_WORDS_CHARS:]
    words = " ".join(said[raised:])[:_WORDS_CHARS]
    frames = [(m[1], m[2]) for line in said[:raised] if (m := _FRAME.match(line))]
    own = [(path, n) for path, n in frames if not _library(path)] or frames
    return f"{shown_path(own[-1][0])}:{own[-1][1]}: {words}" if own else words


def _library(path: str) -> bool:
    """Whether a traceback's file is Python's or an installed package's, not the server's own code."""
    return (path.startswith("<") or "site-packages" in path or "dist-packages" in path
            or path.startswith(sysconfig.get_paths()["stdlib"]))


def list_all(spec: Spec, source: SpecSource) -> tuple[dict[str, list[dict[str, Any]]], list[SpecError]]:
    """server -> [{name, description, inputSchema, ...}] of every server, and an error per server that
    failed to start. Runs its own event loop: call it outside one."""
    return run_sync(_list_all(spec, source))


def unreachable(url: str) -> str | None:
    """`why_unreachable`, from a notebook's running event loop too (factory.evaluate checks its --model)."""
    return run_sync(why_unreachable(url))


def probe_judges(spec: Spec, source: SpecSource) -> list[SpecError]:
    """A warning for each judge endpoint that does not answer: with it down, every judged trajectory would
    have no value (under `on_missing: drop_sample`, every one dropped). A warning, not an error, as the
    server is not Factory's to start and may answer only where the run runs (a cluster's network). Runs
    its own event loop."""
    judges = {name: node.endpoint for name, node in spec.rewards.items()
              if isinstance(node, JudgeNode) and node.endpoint}

    async def probe_all() -> list[str | None]:
        return list(await asyncio.gather(*(why_unreachable(url) for url in judges.values())))

    return [source.error(f"rewards.{name}.endpoint", f"{judge_unanswered(url, why)} A run would score nothing with it",
                         level="warning")
            for (name, url), why in zip(judges.items(), run_sync(probe_all()) if judges else []) if why]
