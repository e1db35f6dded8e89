"""Small, real components that ship with Factory: the quickstart's MCP calculator server and the
DeepSearch example's offline search server."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def serve(server: Any, doc: str, argv: list[str] | None = None,
          before: Callable[[argparse.Namespace], Any] | None = None,
          options: Callable[[argparse.ArgumentParser], Any] | None = None) -> None:
    """Command line of an example MCP server: stdio by default, `--http --port N` for streamable HTTP
    on 127.0.0.1. `options` adds the server's own flags to the parser; `before` runs once with the parsed
    arguments before serving (configuration, warm-up so that the first call is fast)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--http", action="store_true", help="serve streamable HTTP instead of stdio")
    parser.add_argument("--port", type=int, default=8000)
    if options is not None:
        options(parser)
    args = parser.parse_args(argv)
    if before is not None:
        before(args)
    if args.http:
        server.run("streamable-http", host="127.0.0.1", port=args.port)
    else:
        server.run("stdio")
