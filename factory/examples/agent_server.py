"""A trained agent as an MCP server: its model and its own tools behind one `ask` tool, so that another
spec can use the agent as a tool (multi-agent training through MCP).

    python -m factory.examples.agent_server SPEC [--model HF_FOLDER] [--show-calls]

SPEC is the agent's own spec (a file path, relative to the working directory): its model, chat template,
prompt template (`data.prompt`, rendered from `{question}`), tools and rollout limits. `--model` replaces
the spec's model with a trained checkpoint, e.g. `runs/quickstart/step_8/hf`. Each `ask(question)` runs
one greedy episode through Factory's own rollout stage (the same engine, chat format, tool pool and agent
loop as training) and answers with the text of the agent's `<answer>` tag, or its last turn when it wrote
none. With `--show-calls` the answer is preceded by the agent's tool calls and their results, one line
each (`calc.calculate({"expression": "2+2"}) -> 4`).

The model is loaded and the agent's tool servers are started before the server answers its first request
(give the outer spec's entry a start-up allowance accordingly); calls are answered one episode at a time.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

from factory.examples import serve

_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL | re.IGNORECASE)


class Agent:
    """One spec's agent, run in this process: the rollout stage (engine + chat format + tools) and the
    spec's prompt renderer."""

    def __init__(self, spec_path: str, model: str | None = None, show_calls: bool = False):
        self.spec_path, self.model, self.show_calls = spec_path, model, show_calls
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        from factory.assets import resolve_model
        from factory.compiler.compile import compile_file
        from factory.data.sources import PromptRenderer
        from factory.rollout.stage import RolloutStage

        overrides = [f"model.path={self.model}"] if self.model else []
        spec, plan = compile_file(self.spec_path, overrides)
        self.spec = spec
        self.renderer = PromptRenderer(spec.data, Path(plan.base_dir))
        self.stage = RolloutStage(spec, resolve_model(spec.model.path), base_dir=str(plan.base_dir),
                                  workdir=os.getcwd())
        await self.stage.setup()

    async def ask(self, question: str) -> str:
        from factory.data.sources import to_table

        async with self._lock:  # one episode at a time: the engine batches within a call, not across
            trajs, _ = await self.stage.generate(to_table(self.renderer, [{"question": question}]), group_size=1,
                                                 greedy=True)
        return answer_text(trajs[0], self.show_calls)

    async def close(self) -> None:
        await self.stage.close()


def answer_text(traj: Any, show_calls: bool = False) -> str:
    """What the agent answered: its last `<answer>` (outside tool responses), else its last turn's text;
    with `show_calls`, its tool calls first, one line each."""
    lines = []
    if show_calls:
        for turn in traj.turns:
            for call, result in zip(turn.calls, turn.results):
                args = json.dumps(call.arguments, ensure_ascii=False) if call.arguments is not None else call.raw
                lines.append(f"{result.tool}({args}) -> {' '.join(result.text.split())[:200]}")
    said = [m.group(1).strip() for t in traj.turns for m in _ANSWER.finditer(t.text)]
    final = said[-1] if said else (traj.turns[-1].text.strip() if traj.turns else "")
    lines.append(final)
    return "\n".join(lines)


_agent: Agent | None = None


@contextlib.asynccontextmanager
async def _lifespan(_server: Any) -> AsyncIterator[None]:
    # The agent's tool servers are MCP sessions bound to the event loop that opens them: they start here,
    # on the server's own loop, before the first request is read.
    if _agent is not None:
        await _agent.start()
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
    parser.add_argument("--show-calls", action="store_true", help="list the agent's tool calls before its answer")


def _load(args: argparse.Namespace) -> None:
    global _agent
    _agent = Agent(args.spec, args.model, args.show_calls)  # started by the lifespan, on the server's loop


def main(argv: list[str] | None = None) -> None:
    serve(server, __doc__, argv, before=_load, options=_options)


if __name__ == "__main__":
    main()
