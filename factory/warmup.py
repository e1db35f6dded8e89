"""`factory:tiny-qwen3-calc`: the tiny random Qwen3, taught the calculator exchange by a few seconds of
supervised warm-up, so end-to-end tests see real tool calls from the first RL step.

A random 10M-parameter model never emits `<tool_call>` by chance, and CI must exercise the whole loop
(parse -> MCP call -> tool tokens -> mask -> reward -> update) on a model small enough for 2 CPU cores.
The warm-up data is rendered with the same ChatFormat and tool schema the rollout uses, so the prompts
the model learns from are byte-identical to the ones it will see.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

from factory.types import ToolResult


def calculator_schema() -> list[dict]:
    """The tool list for the chat template, read from the calculator server's own tool definition."""
    from factory.examples.calculator import server
    from factory.util import run_sync

    tools = run_sync(server.list_tools())  # (the asset may be built from async code: a stage's setup)
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema}} for t in tools]


def warmup_sequences(tokenizer, n: int, seed: int, tools: list[dict] | None = None) -> list[tuple[list[int], list[int]]]:
    """(ids, loss mask) pairs of whole calculator exchanges: call, tool response, answer. `tools` is the
    tool list the prompts show (default: the calculator server's); its first tool must take `expression`."""
    from factory.data import arithmetic
    from factory.examples.calculator import evaluate, format_number
    from factory.rollout.chat import ChatFormat

    chat = ChatFormat(tokenizer, tools=True)
    tools = tools or calculator_schema()
    eot = [chat.end_of_turn_id]
    out = []
    for row in arithmetic(n, seed=seed, operands=(2, 2), digits=(1, 2)):
        prompt = chat.prompt_ids([{"role": "user", "content": row["question"]}], tools)
        call = {"name": tools[0]["function"]["name"], "arguments": {"expression": row["expression"]}}
        turn1 = chat.encode(f"<tool_call>\n{json.dumps(call)}\n</tool_call>") + eot
        result = format_number(evaluate(row["expression"]))
        delta = chat.tool_delta_ids([ToolResult(tool=call["name"], text=result)], turn_ended_with_eos=True)
        turn2 = chat.encode(f"<answer>{result}</answer>") + eot
        ids = prompt + turn1 + delta + turn2
        mask = [0] * len(prompt) + [1] * len(turn1) + [0] * len(delta) + [1] * len(turn2)
        out.append((ids, mask))
    return out


def build_tiny_qwen3_calc(out: Path, base: str, steps: int = 80, batch: int = 8, lr: float = 3e-3,
                          seed: int = 0, tools: list[dict] | None = None) -> None:
    """Warm up `base` (the tiny-qwen3 folder) on prompts listing `tools` (default: the calculator
    server's) and save the result to `out` (~30 s on 2 cores)."""
    import torch

    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # a one-off build: use the machine, whatever the caller set
    try:
        _train(out, base, steps, batch, lr, seed, tools)
    finally:
        torch.set_num_threads(threads)


def _train(out: Path, base: str, steps: int, batch: int, lr: float, seed: int, tools: list[dict] | None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    data = warmup_sequences(tokenizer, 256, seed=seed, tools=tools)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    model.train()
    for _ in range(steps):
        chunk = rng.sample(data, batch)
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.tensor([s + [pad] * (width - len(s)) for s, _ in chunk])  # [B, T]
        mask = torch.tensor([m + [0] * (width - len(m)) for _, m in chunk])  # [B, T]
        lengths = torch.tensor([[len(s)] for s, _ in chunk])
        hidden = model.model(input_ids=ids, attention_mask=(torch.arange(width) < lengths).long()).last_hidden_state
        # Logits only where a model token is predicted: the 152k-word head over every prompt position
        # would cost ~2 GB per batch and most of the time.
        targets = mask[:, 1:].bool()  # [B, T-1]
        logits = model.lm_head(hidden[:, :-1][targets])  # [K, V]
        loss = torch.nn.functional.cross_entropy(logits.float(), ids[:, 1:][targets])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "factory_warmup.json").write_text(json.dumps({"base": "tiny-qwen3", "steps": steps, "batch": batch,
                                                         "lr": lr, "final_loss": loss.item()}))
