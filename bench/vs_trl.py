"""Benchmark: step time of Factory vs TRL's GRPOTrainer (trl 1.16, the test extra) on the same work, on CPU.

    python bench/vs_trl.py [--repeats 3] [--steps 6] [--model factory:tiny-qwen3-calc] [--bf16] [--only tools] [--quick]

Two comparisons, each with the contenders alternated (Factory, TRL, Factory, TRL, ...) `--repeats` times:
  no tools   one assistant turn per completion;
  with tool  up to two assistant turns with a `calculate` tool between them (TRL's `tools=` loop with
             `max_tool_calling_iterations=1`; Factory's agent loop with `max_turns: 2`).

What is the same on both sides (and how):
  model      the same HF folder, loaded in float32 (`--bf16`: bf16 autocast on both sides)
  prompts    the same rows (arithmetic questions, a `prompt` messages column), the same reward function
  sizes      prompts per step P, group size G (TRL: num_generations), completion budget C (TRL:
             max_completion_length = Factory max_total_tokens; Factory max_new_tokens = C per turn, TRL's
             generate always asks for C), one optimizer step per step over micro-batches of M sequences
             (TRL: per_device_train_batch_size M x gradient_accumulation P*G/M, one generation per step)
  algorithm  GRPO, no KL (beta 0), no reference model, one update per batch (no old-log-prob pass on
             either side), the same learning rate
  tool       the same python function; Factory calls it as a `function:` tool (in-process), TRL as `tools=`
  threads    torch threads = --threads in every process (Factory's stages run one after another)
Factory is run as users run it: `factory run spec.yaml` (Ray actors, its stages, MLflow logging); TRL as
its docs show it: `GRPOTrainer(...).train()` in one process, no logging backend.

Step time = wall time between the ends of consecutive steps (Factory: MLflow records; TRL: a callback's
on_step_end), skipping the first step and the last (it also saves the final checkpoint). Medians over all
steady steps of all repeats. Tokens sampled per step are printed for both sides (same distribution: the
same model and prompts); a gap there would explain a gap in time, so the table shows it.

Prints a table, then as its LAST line JSON: factory_over_trl (median Factory step / median TRL step,
no tools) and factory_over_trl_tools (the same with the tool). Target: <= 0.5 for both.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, installed or not

from bench.common import cpu, cpu_line, factory_run, median, print_json, table, workload_arguments, write_project


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % ** and parentheses, e.g. (3 + 4) * 2.

    Args:
        expression: The arithmetic expression to evaluate.
    """
    from factory.examples.calculator import evaluate, format_number

    try:
        return format_number(evaluate(expression))
    except ValueError as exc:
        return f"Error: {exc}"


def prompt_rows(n: int, seed: int) -> list[dict]:
    """Arithmetic questions as chat prompts with their answers (both sides read these rows)."""
    from factory.data import arithmetic

    return [{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]}
            for r in arithmetic(n, seed=seed, operands=(2, 2), digits=(1, 2))]


BENCH_MODEL = "bench:tiny-qwen3-calc-pytool"


def model_folder(name: str) -> str:
    """The model's HF folder. `bench:tiny-qwen3-calc-pytool` (the default) is factory:tiny-qwen3 warmed up
    on the calculator exchange exactly as factory:tiny-qwen3-calc is, but with this file's `calculate`
    in the prompts' tool list (the schema both TRL and Factory derive from the function): a 10M model
    only writes well-formed calls for the tool list it learned. Built once into the Factory cache."""
    from factory.assets import cache_dir, resolve_model

    if name != BENCH_MODEL:
        return resolve_model(name)
    out = cache_dir() / "bench" / "tiny-qwen3-calc-pytool-v1"
    if not (out / "model.safetensors").exists():
        import shutil

        from factory.tools.servers import function_schema
        from factory.warmup import build_tiny_qwen3_calc

        tmp = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        build_tiny_qwen3_calc(tmp, resolve_model("factory:tiny-qwen3"), tools=[function_schema(calculate, "calculate")])
        tmp.rename(out)
    return str(out)


# ------------------------------------------------------------------------------------------- Factory
def factory_spec(a: argparse.Namespace, model_path: str, tools: bool) -> str:
    tool_block = "tools:\n  calculate: {function: bench.vs_trl:calculate, timeout_s: 10}\n" if tools else ""
    return f"""name: vs-trl
seed: 0
model: {{path: {model_path}}}
data: {{train: {{path: prompts.jsonl}}}}
{tool_block}rewards:
  correct: {{fn: factory.rewards.math:numeric_match}}
algorithm: {{name: grpo, clip: [0.2, 0.2]}}
rollout: {{group_size: {a.group_size}, max_turns: {2 if tools else 1}, max_new_tokens: {a.completion_tokens},
          max_total_tokens: {a.completion_tokens}, temperature: {a.temperature}}}
train: {{steps: {a.steps}, prompts_per_step: {a.prompts}, micro_batch: {a.micro_batch}, lr: 1.0e-6,
        threads: {a.threads}, bf16_autocast: {str(a.bf16).lower()}, checkpoint_dir: ckpt}}
tracking: {{experiment: vs-trl}}
resources: {{object_store_gb: 0.5}}
"""


def run_factory(a: argparse.Namespace, model_path: str, tools: bool, folder: Path) -> dict:
    rows = prompt_rows(256, seed=a.repeat_seed)
    write_project(folder, factory_spec(a, model_path, tools),
                  {"prompts.jsonl": "".join(json.dumps(r) + "\n" for r in rows)})
    run = factory_run(folder)
    n = a.prompts * a.group_size
    return {"periods": run.periods,
            "sampled_tokens": run.mean("response_length/mean") * n,
            "tool_calls": run.mean("tool_calls/mean") * n}


# ----------------------------------------------------------------------------------------------- TRL
def trl_worker(config: dict) -> dict:
    """One TRL run in this process (called as `vs_trl.py --trl-worker CONFIG`): GRPOTrainer as its docs
    show it; step ends timed by a callback."""
    import torch

    torch.set_num_threads(config["threads"])
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from factory.rewards.math import numeric_match

    def correct(prompts, completions, answer, **_):
        # conversational completions are message lists; grade their text as Factory does its completion
        texts = [c if isinstance(c, str) else "".join(str(m.get("content", "")) for m in c) for c in completions]
        return [numeric_match("", t, a) for t, a in zip(texts, answer)]

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []
            self.logs: list[dict] = []

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            self.logs.append(dict(logs or {}))

    p, g, m = config["prompts"], config["group_size"], config["micro_batch"]
    args = GRPOConfig(
        output_dir=config["output_dir"], report_to=[], use_cpu=True, seed=0, data_seed=config["repeat_seed"],
        max_steps=config["steps"], learning_rate=1e-6, lr_scheduler_type="constant", warmup_steps=0,
        per_device_train_batch_size=m, gradient_accumulation_steps=p * g // m, num_generations=g,
        max_completion_length=config["completion_tokens"], temperature=config["temperature"], top_p=1.0, top_k=0,
        beta=0.0, epsilon=0.2, loss_type="grpo", bf16=config["bf16"], logging_steps=1, save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0,
        max_tool_calling_iterations=1 if config["tools"] else None,
    )
    model = AutoModelForCausalLM.from_pretrained(config["model"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(config["model"])
    rows = prompt_rows(256, seed=config["repeat_seed"])
    if config["tools"]:
        # TRL finds its tool-call parser and training template by the chat template's exact text. This
        # tokenizer ships another revision of the Qwen3 template; TRL's own revision renders these prompts
        # to the same ids (checked here), so TRL gets its own text and the prompts stay the same.
        from trl.chat_template_utils import qwen3_chat_template

        probe = [{"role": "user", "content": rows[0]["prompt"][0]["content"]}]
        ours = tokenizer.apply_chat_template(probe, tools=[calculate], add_generation_prompt=True)
        tokenizer.chat_template = qwen3_chat_template
        theirs = tokenizer.apply_chat_template(probe, tools=[calculate], add_generation_prompt=True)
        if ours != theirs:
            raise SystemExit("TRL's Qwen3 template renders the prompts differently: not the same prompts")
    clock = StepClock()
    trainer = GRPOTrainer(model=model, reward_funcs=correct, args=args, processing_class=tokenizer,
                          train_dataset=datasets.Dataset.from_list(rows), callbacks=[clock],
                          tools=[calculate] if config["tools"] else None)
    trainer.train()
    ends = clock.ends
    periods = [ends[i] - ends[i - 1] for i in range(1, len(ends) - 1)]  # steps 2..N-1, as for Factory
    steady = [log for log in clock.logs if "completions/mean_length" in log][1:-1]

    def mean(key: str) -> float:
        values = [log[key] for log in steady if key in log]
        return sum(values) / len(values) if values else float("nan")

    n = p * g
    # TRL's completion length counts tool-response tokens too; its tool_mask is not logged, so the sampled
    # tokens are that length minus what the tool responses add (measured the same way on Factory's side:
    # model tokens only). Without tools they are equal.
    return {"periods": periods, "completion_tokens": mean("completions/mean_length") * n,
            "tool_calls": mean("tools/call_frequency") * n if config["tools"] else 0.0}


def run_trl(a: argparse.Namespace, model_path: str, tools: bool, folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model": model_path, "tools": tools, "output_dir": str(folder / "out"), "threads": a.threads,
              "prompts": a.prompts, "group_size": a.group_size, "micro_batch": a.micro_batch,
              "completion_tokens": a.completion_tokens, "steps": a.steps, "bf16": a.bf16, "temperature": a.temperature,
              "repeat_seed": a.repeat_seed}
    (folder / "config.json").write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--trl-worker", str(folder / "config.json")],
                         cwd=folder, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if out.returncode != 0:
        raise SystemExit(f"TRL run failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------- main
def compare(a: argparse.Namespace, model_path: str, tools: bool, work: Path) -> dict:
    factory_periods, trl_periods, rows = [], [], []
    for r in range(a.repeats):
        a.repeat_seed = r
        f = run_factory(a, model_path, tools, work / f"factory-{int(tools)}-{r}")
        t = run_trl(a, model_path, tools, work / f"trl-{int(tools)}-{r}")
        factory_periods += f["periods"]
        trl_periods += t["periods"]
        rows.append((f"repeat {r}", median(f["periods"]), median(t["periods"]),
                     median(f["periods"]) / median(t["periods"]), f["sampled_tokens"], t["completion_tokens"],
                     f["tool_calls"], t["tool_calls"]))
    ratio = median(factory_periods) / median(trl_periods)
    rows.append(("median", median(factory_periods), median(trl_periods), ratio, "", "", "", ""))
    print(f"\n{'with the calculate tool' if tools else 'no tools'}: step time (s), steady steps of each run")
    print(table(["", "factory s", "trl s", "factory/trl", "f model tok", "t compl tok", "f calls", "t calls"],
                rows, first=14))
    return {"ratio": ratio, "factory_s": median(factory_periods), "trl_s": median(trl_periods)}


def main(a: argparse.Namespace) -> dict:
    model_path = model_folder(a.model)
    print(cpu_line())
    print(f"model {a.model}, temperature {a.temperature}; P={a.prompts} prompts x G={a.group_size} per step, completion budget "
          f"{a.completion_tokens} tokens, micro-batch {a.micro_batch}, {a.threads} threads, "
          f"{'bf16 autocast' if a.bf16 else 'float32'}; {a.steps} steps per run, {a.repeats} repeats alternated")
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="factory-vs-trl-") as tmp:
        if a.only in (None, "plain"):
            plain = compare(a, model_path, False, Path(tmp))
            out.update({"factory_over_trl": round(plain["ratio"], 3), "factory_step_s": round(plain["factory_s"], 3),
                        "trl_step_s": round(plain["trl_s"], 3)})
        if a.only in (None, "tools"):
            tools = compare(a, model_path, True, Path(tmp))
            out.update({"factory_over_trl_tools": round(tools["ratio"], 3),
                        "factory_step_tools_s": round(tools["factory_s"], 3),
                        "trl_step_tools_s": round(tools["trl_s"], 3)})
    return {**out, "cpu": cpu()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Factory vs TRL GRPOTrainer step time")
    workload_arguments(parser, BENCH_MODEL)
    parser.add_argument("--temperature", type=float, default=0.7,
                        help="sampling temperature on both sides (the tiny model's calls are well-formed at 0.7)")
    parser.add_argument("--completion-tokens", type=int, default=64, help="completion budget (C)")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward (M)")
    parser.add_argument("--steps", type=int, default=6, help="steps per run (the first and last are not timed)")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast on both sides (default float32)")
    parser.add_argument("--only", choices=["plain", "tools"],
                        help="run one of the two comparisons (its ratio alone in the JSON line)")
    parser.add_argument("--quick", action="store_true", help="one short repeat (a smoke test, not a measurement)")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)  # internal: run one TRL job from this config
    a = parser.parse_args(argv)
    if a.quick:
        a.repeats, a.steps, a.prompts, a.group_size, a.completion_tokens = 1, 3, 1, 4, 16
        a.micro_batch = 4
    if (a.prompts * a.group_size) % a.micro_batch:
        parser.error("prompts x group size must be a multiple of the micro-batch")
    return a


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.trl_worker:
        print(json.dumps(trl_worker(json.loads(Path(arguments.trl_worker).read_text()))))
    else:
        print_json(main(arguments))
