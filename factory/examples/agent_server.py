"""A trained agent as an MCP server: its model and its own tools behind one `ask` tool, so that another
spec can use the agent as a tool (multi-agent training through MCP).

    python -m factory.examples.agent_server SPEC [--model HF_FOLDER] [--set KEY=VALUE ...] [--show-calls]

SPEC is the agent's own spec (a file path, relative to the working directory): its model, chat template,
prompt template (`data.prompt`, rendered from `{question}`), tools and rollout limits. `--model` replaces
the spec's model with a trained checkpoint, e.g. `runs/quickstart/step_8/hf`; `--set` overrides any
other key of the agent's spec, as `factory run` takes them (`--set rollout.engine=hf`). Each `ask(question)` runs
one greedy episode through Factory's own rollout stage (the same engine, chat format, tool pool and agent
loop as training) and answers with the text of the agent's `<answer>` tag, or its last turn when it wrote
none. With `--show-calls` the answer is preceded by the agent's tool calls and their results, one line
each (`calc.calculate({"expression": "2+2"}) -> 4`).

`replay.run` is refused: a recording answers the calls made at the same place of its run, and an `ask` is a
new question (a deterministic tool server's answers can be kept across runs with `cache: true`).

The server answers `initialize` at once and loads the model and starts the agent's tool servers in the
background (a client's start-up timeout never waits on a model load); the first `ask` waits for them, and
a failed load is that call's error. Calls are answered one episode at a time.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError
from mcp.types import INTERNAL_ERROR
from pydantic import Field

from factory.examples import serve
from factory.rewards.math import extract_answer


class Agent:
    """One spec's agent, run in this process on an event loop of its own in a thread: the rollout stage
    (engine + chat format + tools) and the spec's prompt renderer.

    Why a thread: loading the model and generating are long blocking calls; on the MCP server's loop they
    would keep it from answering `initialize` (a client's start-up timeout) and pings. The agent's tool
    servers are MCP sessions bound to the loop that opens them, so they live on the agent's loop too."""

    def __init__(self, spec_path: str, model: str | None = None, show_calls: bool = False,
                 overrides: tuple[str, ...] = ()):
        self.spec_path, self.model, self.show_calls, self.overrides = spec_path, model, show_calls, overrides
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._load: asyncio.Task[None] | None = None  # on the agent's loop

    def compile(self) -> None:
        """Compile the agent's spec (quick: no weights); SpecErrors if it is wrong, UserError for a setting the
        server cannot honour (replay.run)."""
        from factory.compiler.compile import compile_file
        from factory.data.sources import PromptRenderer
        from factory.util import UserError

        overrides = [*self.overrides, *([f"model.path={self.model}"] if self.model else [])]
        self.spec, self.plan = compile_file(self.spec_path, overrides)
        if self.plan.driver.replay.run:
            # A replay answers a call from the row recorded at the same place of the same run (ToolCall.origin:
            # step, prompt, sample, turn); an `ask` is a new question, whose calls were made at no place of
            # any run, so every one would miss. Said, not ignored.
            raise UserError(f"replay.run={self.plan.driver.replay.run}: the agent server answers new questions, "
                            "and a run's recording answers only the calls made at the same place of that run; "
                            "remove replay.run (for answers kept across runs, mark a deterministic tool server "
                            "`cache: true`)")
        self.base_dir = Path(self.plan.base_dir)
        self.renderer = PromptRenderer(self.spec.data, self.base_dir)

    def begin(self) -> None:
        """Start the agent's loop and load the agent on it; returns without waiting for the load."""
        self._loop = asyncio.new_event_loop()
        self._load = self._loop.create_task(self._start())  # (runs once the loop does; a Task, for close to await)
        self._thread = threading.Thread(target=self._loop.run_forever, name="agent", daemon=True)
        self._thread.start()

    async def _start(self) -> None:
        from factory.runtime.local import callees, local_stages

        # The plan's rollout stage (the one that answers held-out prompts, greedily) and its tool servers, in
        # this process: the rollout calls the tools directly
        name = self.plan.flow("eval")[0].dst
        self._lock = asyncio.Lock()  # on the agent's loop
        self._stages = contextlib.AsyncExitStack()  # closed by _close
        self.stage = (await self._stages.enter_async_context(
            local_stages(self.plan, [*callees(self.plan, name), name])))[name]

    async def _episode(self, question: str) -> str:
        from factory.data.sources import to_table

        async with self._lock:  # one episode at a time: the engine batches within a call, not across
            part = await self.stage.evaluate(to_table(self.renderer, [{"question": question}]))  # greedy, one
        return answer_text(part.trajs[0], self.show_calls)

    async def ask(self, question: str) -> str:
        """The agent's answer; the first call waits for the load (a failed load is its error)."""
        assert self._load is not None and self._loop is not None, "begin() first"
        # Both failures are this server's, not the asking model's: a JSON-RPC error, which Factory's ToolBox takes
        # as infra_error (retried, not trained on, not cached) with its reason. Any other exception would reach
        # the client as the model's "Error executing tool ask", its reason kept on the server.
        try:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._loaded(), self._loop))
        except Exception as exc:
            raise MCPError(INTERNAL_ERROR, f"the agent could not be loaded: {exc}") from exc
        try:
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._episode(question), self._loop))
        except Exception as exc:
            raise MCPError(INTERNAL_ERROR, f"the agent's episode failed: {type(exc).__name__}: {exc}") from exc

    async def _loaded(self) -> None:
        # shield: a call that times out while the model loads must not cancel the load
        await asyncio.shield(self._load)

    async def close(self) -> None:
        if self._load is None or self._loop is None or self._thread is None:
            return
        # The shutdown runs on the agent's loop, which it stops last. Stopped from here just after the load's
        # cancellation was sent, the loop ended in the iteration that delivered it: the load never unwound
        # (the tool servers and engine it had started were left open).
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        await asyncio.to_thread(self._thread.join, 30)

    async def _shutdown(self) -> None:
        """On the agent's loop: a load still under way is cancelled and unwinds (at its next await: it closes what
        it had started); a finished load is closed; then the loop stops."""
        self._load.cancel()  # (nothing, once it ended)
        try:
            await self._load
            await self._close()
        # A cancelled load has unwound; one that failed has nothing to close (its calls said why). Neither may
        # escape: asyncio's CancelledError is no Exception, and would end the lifespan in a traceback.
        except (asyncio.CancelledError, Exception):
            pass
        finally:
            self._loop.stop()

    async def _close(self) -> None:
        await self._stages.aclose()


def answer_text(traj: Any, show_calls: bool = False) -> str:
    """What the agent answered: its last `<answer>` (outside tool responses), else its last turn's text;
    with `show_calls`, its tool calls first, one line each."""
    lines = []
    if show_calls:
        for turn in traj.turns:
            for call, result in zip(turn.calls, turn.results):
                args = json.dumps(call.arguments, ensure_ascii=False) if call.arguments is not None else call.raw
                lines.append(f"{result.tool}({args}) -> {' '.join(result.text.split())[:200]}")
    # (the rewards' reading of an answer: linear in the text, where a regex spanning the tag backtracked for
    # minutes over an <answer> never closed)
    said = extract_answer("", traj.turns)
    final = said if said is not None else (traj.turns[-1].text.strip() if traj.turns else "")
    lines.append(final)
    return "\n".join(lines)


_agent: Agent | None = None


@contextlib.asynccontextmanager
async def _lifespan(_server: Any) -> AsyncIterator[None]:
    if _agent is not None:
        _agent.begin()  # loads in the background, on the agent's own loop
    try:
        yield
    finally:
        if _agent is not None:
            await _agent.close()


# WARNING: INFO logs a line per request to stderr, which costs time under many concurrent calls.
server = MCPServer("factory-agent", log_level="WARNING", lifespan=_lifespan)


@server.tool(
    description="Ask an agent that can use its own tools; it answers in a short phrase.",
    structured_output=False,
)
async def ask(question: Annotated[str, Field(description="The question for the agent.")]) -> str:
    """The agent's answer."""
    if _agent is None:
        raise ToolError("the agent is not loaded")
    return await _agent.ask(question)


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", help="the agent's spec file")
    parser.add_argument("--model", default=None, help="a trained model folder in place of the spec's model")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="an override of the agent's spec, as `factory run` takes them (repeatable)")
    parser.add_argument("--show-calls", action="store_true", help="list the agent's tool calls before its answer")


def _load(args: argparse.Namespace) -> None:
    from factory.compiler.errors import SpecErrors
    from factory.util import UserError

    global _agent
    _agent = Agent(args.spec, args.model, args.show_calls, tuple(args.overrides))  # loaded by the lifespan, in the background
    try:  # a wrong agent spec stops the server before it answers: the compiler's message is its last words
        _agent.compile()
    except SpecErrors as e:
        raise SystemExit(f"agent_server: {e.report()}\nagent_server: the agent's spec is wrong: {e.errors[0]}") from None
    except UserError as e:  # a setting the agent server cannot honour (replay.run)
        raise SystemExit(f"agent_server: {e}") from None


def main(argv: list[str] | None = None) -> None:
    serve(server, __doc__, argv, before=_load, options=_options)


if __name__ == "__main__":
    main()
