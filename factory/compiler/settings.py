"""No silently ignored setting: checks for values the pydantic schema accepts but the pipeline would not use.

The schema forbids unknown keys, but three kinds of setting can still be accepted and then ignored:
- `train.deepspeed` passes extra keys through to DeepSpeed, whose config reader ignores top-level keys
  it does not know (a misspelt `zero_stagee` did nothing). They are checked against the keys DeepSpeed
  reads (`DEEPSPEED_KEYS`, a static list so that `factory check` stays torch-free; a test compares it
  with what DeepSpeed 0.19's own config reader looks up).
- keys of DeepSpeed's config that Factory itself sets from the spec: a second source of truth that
  would silently override (or be overridden by) the spec's own setting.
- keys DeepSpeed reads but that act only through something Factory's update does not use (DeepSpeed's
  data loader, a PipelineModule, `engine.compile()`, `deepspeed.checkpointing`), and keys DeepSpeed 0.19
  has removed (it refuses them when the engine starts, a minute into the run): errors saying what to
  use instead (`NOT_APPLIED`, `REMOVED`).
- settings that only matter together with another one (`train.eval_every` without `data.eval`). Those
  are warnings, not errors, because an override that turns the other setting off (`data.eval=null` to
  skip evaluation for a quick run) is legitimate; `factory check`, `plan` and `run` print them.
"""
from __future__ import annotations

from typing import Any, Protocol

from factory.compiler.translate import nearest, show
from factory.lora import VLLM_MAX_LORA_RANK
from factory.presets import DUAL_CLIP_LOSSES, GROUP_ADVANTAGES, pi_old_source
from factory.reward.graph import per_turn_nodes
from factory.schema import DeepSpeedSpec, Spec

# Every top-level key DeepSpeed 0.19.8's `DeepSpeedConfig` reads (tests/test_settings.py records the
# lookups of the real reader and compares). Any other top-level key is ignored by DeepSpeed.
DEEPSPEED_KEYS = frozenset({
    "activation_checkpointing", "aio", "amp", "autotuning", "bf16", "bfloat16", "checkpoint", "comet",
    "comms_logger", "communication_data_type", "compile", "compression_training", "csv_monitor",
    "curriculum_learning", "data_efficiency", "data_types", "dataloader_drop_last", "datastates_ckpt",
    "disable_allgather", "disable_python_gc", "dump_state", "eigenvalue", "elasticity", "expert_parallel",
    "flops_profiler", "fp16", "gradient_accumulation_steps", "gradient_allreduce_op", "gradient_clipping",
    "gradient_predivide_factor", "graph_harvesting", "hybrid_engine", "log_level",
    "managed_gradient_accumulation", "memory_breakdown", "nebula", "optimizer", "pipeline",
    "prescale_gradients", "progressive_layer_drop", "quantize_training", "scheduler",
    "seq_parallel_communication_data_type", "sequence_parallel_size", "sparse_attention", "sparse_gradients",
    "steps_per_print", "tensor_parallel", "tensorboard", "timers", "torch_autocast", "train_batch_size",
    "train_micro_batch_size_per_gpu", "use_data_before_expert_parallelism", "vocabulary_size",
    "wall_clock_breakdown", "wandb", "weight_quantization", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "zero_optimization",
})

# The keys (and aliases) of DeepSpeed's `zero_optimization` section (DeepSpeedZeroConfig; DeepSpeed
# refuses others too, but only when the update actor starts, a minute into the run).
ZERO_KEYS = frozenset({
    "allgather_bucket_size", "allgather_partitions", "allgather_sequential", "compute_grad_norm",
    "contiguous_gradients", "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory",
    "elastic_checkpoint", "enable_sanity_checks", "gather_16bit_weights_on_model_save",
    "ignore_unused_parameters", "leaf_module", "legacy_stage1", "load_from_fp32_weights",
    "log_trace_cache_warnings", "max_live_parameters", "max_reuse_distance", "memory_efficient_linear",
    "model_persistence_threshold", "module_granularity_threshold", "offload_optimizer", "offload_param",
    "overlap_comm", "override_module_apply", "param_persistence_threshold", "parameter_alignment",
    "pipeline_loading_checkpoint", "prefetch_bucket_size", "reduce_bucket_size", "reduce_scatter",
    "round_robin_gradients", "save_muon_momentum_buffer_in_memory", "stage", "stage3_allgather_sequential",
    "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_model_persistence_threshold",
    "stage3_module_granularity_threshold", "stage3_param_persistence_threshold", "stage3_prefetch_bucket_size",
    "stage3_use_all_reduce_for_fetch_params", "sub_group_size", "use_all_reduce_for_fetch_params",
    "use_multi_rank_bucket_allreduce", "zenflow", "zero_hpz_partition_size", "zero_quantized_gradients",
    "zero_quantized_nontrainable_weights", "zero_quantized_weights",
})

# (DeepSpeed's pre-division of the gradients over the ranks: numerics of the mean the learner's loss scaling assumes)
_SCALE = ("the update owns the gradient's scale over the ranks (it scales each rank's loss for DeepSpeed's plain "
          "mean); DeepSpeed's ZeRO 2 and 3 refuse it when the update starts, and below them it only reorders the "
          "same mean")
# DeepSpeed keys that Factory derives from the spec (factory.update.engine.deepspeed_config): setting
# them under `train.deepspeed` would fight the spec's own setting, so the error names that setting.
OWNED_KEYS = {
    "train_micro_batch_size_per_gpu": "set train.micro_batch",
    "train_batch_size": "the batch is train.prompts_per_step x rollout.group_size",
    "gradient_accumulation_steps": "Factory accumulates each mini-batch itself: set algorithm.mini_batches "
                                   "and train.micro_batch (train.micro_batch_tokens to cap its tokens)",
    "managed_gradient_accumulation": "Factory accumulates each mini-batch itself",
    "gradient_clipping": "set train.optimizer.grad_clip",
    "optimizer": "set train.optimizer",
    "scheduler": "set train.lr and train.warmup_steps",
    "bf16": "set model.dtype (or train.bf16_autocast)",
    "bfloat16": "set model.dtype (or train.bf16_autocast)",
    "fp16": "set model.dtype",
    "amp": "set model.dtype (or train.bf16_autocast)",
    "torch_autocast": "set train.bf16_autocast",
    "prescale_gradients": _SCALE,
    "gradient_predivide_factor": _SCALE,
    # (factory.update.learner `_update`; left at DeepSpeed's default)
    "gradient_allreduce_op": "the update scales each rank's loss by the number of ranks because DeepSpeed averages "
                             "the gradients over them (its default, mean): another reduction would scale every "
                             "update (sum: by the number of ranks)",
}
OWNED_ZERO_KEYS = {"stage": "set train.deepspeed.zero_stage"}
# zero_optimization keys DeepSpeed 0.19.8 reads only in its ZeRO optimizers of this stage and above (traced with
# Factory's configurations at stage 0: float32, bf16 and fp16 weights, a torch optimizer always given): below it
# they do nothing. A warning, not an error: a spec tuned for ZeRO, overridden to stage 0 for a quick run, is fine.
ZERO_FROM_STAGE = {
    **dict.fromkeys(("allgather_bucket_size", "reduce_bucket_size", "contiguous_gradients", "reduce_scatter",
                     "use_multi_rank_bucket_allreduce", "round_robin_gradients", "parameter_alignment",
                     "ignore_unused_parameters", "elastic_checkpoint", "load_from_fp32_weights", "legacy_stage1"), 1),
    **dict.fromkeys(("sub_group_size", "prefetch_bucket_size", "stage3_prefetch_bucket_size",
                     "param_persistence_threshold", "stage3_param_persistence_threshold", "model_persistence_threshold",
                     "stage3_model_persistence_threshold", "max_live_parameters", "stage3_max_live_parameters",
                     "max_reuse_distance", "stage3_max_reuse_distance", "module_granularity_threshold",
                     "stage3_module_granularity_threshold", "use_all_reduce_for_fetch_params",
                     "stage3_use_all_reduce_for_fetch_params", "allgather_sequential", "stage3_allgather_sequential",
                     "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
                     "zero_quantized_gradients", "log_trace_cache_warnings", "enable_sanity_checks",
                     "save_muon_momentum_buffer_in_memory", "memory_efficient_linear", "override_module_apply",
                     "leaf_module"), 3),
}
_SAVE_16BIT = "it acts only in DeepSpeed's engine.save_16bit_model, which Factory does not call (its checkpoints " \
              "hold the model as a Hugging Face folder at every stage)"
ZERO_NOT_APPLIED = {
    "allgather_partitions": "DeepSpeed 0.19 reads it into its config and uses it nowhere",
    "cpu_offload_use_pin_memory": "deprecated, and DeepSpeed 0.19 only warns about it: set pin_memory inside "
                                  "offload_optimizer or offload_param",
    "gather_16bit_weights_on_model_save": _SAVE_16BIT,
    "stage3_gather_16bit_weights_on_model_save": _SAVE_16BIT,
    "stage3_gather_fp16_weights_on_model_save": _SAVE_16BIT,
}

# DeepSpeed keys that do something only through a part of DeepSpeed Factory's update never uses: accepted,
# they would do nothing. Each says why and what to use instead.
_DATA = ("it configures DeepSpeed's own data loader (deepspeed.initialize(training_data=...)), which Factory "
         "does not use: the data stage builds every batch (data.*, train.prompts_per_step)")
NOT_APPLIED = {
    "compile": "DeepSpeed compiles only when engine.compile() is called, and Factory's update does not call it "
               "(the model runs eagerly)",
    "activation_checkpointing": "it configures deepspeed.checkpointing, which Hugging Face models do not call: "
                                "set train.gradient_checkpointing",
    "pipeline": "pipeline parallelism needs a DeepSpeed PipelineModule; Factory trains the Hugging Face model "
                "data-parallel over the update's replicas (with ZeRO: train.deepspeed.zero_stage)",
    "dataloader_drop_last": _DATA,
    "data_efficiency": _DATA,
    "disable_allgather": "DeepSpeed 0.19 reads it into its config and uses it nowhere",
    "vocabulary_size": "DeepSpeed only logs a note when it is not a multiple of 8; the vocabulary is the model's "
                       "own (its config.json)",
}
# Top-level keys DeepSpeed 0.19 has removed: its config reader raises on them (runtime/config.py,
# _REMOVED_TOP_LEVEL_CONFIG_KEYS) only when the update stage starts.
REMOVED = frozenset({"compression_training", "curriculum_learning", "eigenvalue", "elasticity", "graph_harvesting",
                     "nebula", "progressive_layer_drop", "quantize_training", "sparse_attention",
                     "sparse_gradients"})


class Report(Protocol):
    def error(self, path: str, message: str) -> None: ...

    def warn(self, path: str, message: str) -> None: ...


def _unknown(key: str, valid: frozenset[str] | set[str], where: str) -> str:
    near = nearest(key, sorted(valid))
    hint = f"; did you mean '{near}'?" if near else f"; see DeepSpeed's configuration reference for {where}"
    return f"unknown key '{key}'{hint}"


def check_deepspeed(spec: Spec, r: Report) -> None:
    """Every extra key under `train.deepspeed` is one DeepSpeed reads and Factory does not set itself."""
    extra: dict[str, Any] = dict(spec.train.deepspeed.model_extra or {})
    for key, value in extra.items():
        path = f"train.deepspeed.{key}"
        if key in OWNED_KEYS:
            r.error(path, f"Factory sets this DeepSpeed key from the spec: {OWNED_KEYS[key]}")
        elif key in NOT_APPLIED:
            r.error(path, f"not applied by Factory's update: {NOT_APPLIED[key]}")
        elif key in REMOVED:
            r.error(path, "DeepSpeed 0.19 has removed this feature (it refuses the key when the engine starts)")
        elif key not in DEEPSPEED_KEYS:
            # Factory's own keys first: `zero_stagee` most likely meant `zero_stage`.
            r.error(path, _unknown(key, set(DeepSpeedSpec.model_fields) | DEEPSPEED_KEYS, "the top level"))
        elif key == "checkpoint" and isinstance(value, dict) and value.get("load_universal"):
            # (DeepSpeed then looks for ds_to_universal's layout, which no Factory checkpoint has)
            r.error(f"{path}.load_universal", "Factory's checkpoints are never in DeepSpeed's universal format, so "
                                              "every resume would fail: remove it")
        elif key == "zero_optimization":
            if not isinstance(value, dict):
                r.error(path, f"expected a mapping, got {show(value)}")
                continue
            for sub, v in value.items():
                if sub in OWNED_ZERO_KEYS:
                    r.error(f"{path}.{sub}", f"Factory sets this DeepSpeed key from the spec: {OWNED_ZERO_KEYS[sub]}")
                elif sub in ("offload_optimizer", "cpu_offload") and spec.train.deepspeed.offload_optimizer:
                    # merged over Factory's {device: cpu}, this one won, in silence: `{device: none}` offloaded nothing
                    r.error(f"{path}.{sub}", "train.deepspeed.offload_optimizer: true sets the optimizer offload "
                                             "({device: cpu}) too: set it in one place (remove this key, or set "
                                             "train.deepspeed.offload_optimizer to false)")
                elif sub not in ZERO_KEYS:
                    r.error(f"{path}.{sub}", _unknown(str(sub), ZERO_KEYS, "zero_optimization"))
                elif sub in ZERO_NOT_APPLIED:
                    r.error(f"{path}.{sub}", f"not applied by Factory's update: {ZERO_NOT_APPLIED[sub]}")
                elif v == "auto":  # (Hugging Face's DeepSpeed config templates are full of them)
                    r.warn(f"{path}.{sub}", "'auto' is filled in by Hugging Face's Trainer, not by DeepSpeed, which "
                                            "drops it, so its default applies: give a value, or remove the key")
                elif problem := _zero_problem(str(sub), v, spec.train.deepspeed.zero_stage):
                    r.error(f"{path}.{sub}", problem)
                elif ZERO_FROM_STAGE.get(sub, 0) > spec.train.deepspeed.zero_stage:
                    n = ZERO_FROM_STAGE[sub]
                    r.warn(f"{path}.{sub}", f"has no effect at train.deepspeed.zero_stage "
                                            f"{spec.train.deepspeed.zero_stage}: DeepSpeed reads it only in its ZeRO "
                                            f"{'optimizers' if n == 1 else 'stage 3'}")
    ds = spec.train.deepspeed
    if ds.offload_optimizer and ds.zero_stage == 0:
        r.error("train.deepspeed.offload_optimizer", "optimizer offload needs ZeRO: set zero_stage to 1, 2 or 3")
    if spec.model.dtype == "float16" and ds.zero_stage == 0:
        # DeepSpeed 0.19.8's stage-0 fp16 wrapper (FP16_UnfusedOptimizer) unscales gradients that its engine.backward
        # never scaled (it scales the loss for the ZeRO optimizers only): every update, and the clip's norm, 2^-16
        r.error("model.dtype", "float16 weights need DeepSpeed's ZeRO loss scaling (at zero_stage 0 DeepSpeed leaves "
                               "the loss unscaled but divides each update by its loss scale, 2^16 at the start): set "
                               "train.deepspeed.zero_stage: 1, or use bfloat16")


def _zero_problem(key: str, value: Any, stage: int) -> str | None:
    """What DeepSpeed 0.19.8 would refuse, or fail on, in `zero_optimization.<key>: value` at ZeRO `stage`
    with Factory's engine: said by `factory check` rather than when the update starts (or first steps)."""
    if key in ("offload_param", "cpu_offload_param") and stage != 3:
        # (DeepSpeed hands it to ZeRO-3's optimizer only; stages 1 and 2 never read it)
        return "parameter offload needs ZeRO-3: set train.deepspeed.zero_stage to 3"
    offloads = ((key == "cpu_offload" and value is True)  # (the deprecated spelling of a CPU offload_optimizer)
                or (key == "offload_optimizer" and isinstance(value, dict) and value.get("device", "none") != "none"))
    if offloads:  # (check_deepspeed says so first beside train.deepspeed.offload_optimizer: true)
        # Factory's setting also lets its torch optimizer step on the offloaded states (zero_force_ds_cpu_optimizer)
        use = ("use train.deepspeed.offload_optimizer: true (an offload to the CPU, on which torch's optimizer steps; "
               "alone, this key fails the update's start: DeepSpeed refuses a torch optimizer with ZeRO-Offload)")
        return f"{use}, with train.deepspeed.zero_stage 1, 2 or 3 (DeepSpeed refuses an offload without ZeRO)" \
            if stage == 0 else use
    if key == "overlap_comm" and value is True and stage < 2:
        return ("DeepSpeed refuses overlap_comm below ZeRO-2 where Factory accumulates each mini-batch's gradients "
                "itself (managed_gradient_accumulation false): set train.deepspeed.zero_stage to 2 or 3, or remove it")
    if key == "compute_grad_norm" and value is False:
        # (ZeRO 1/2 check a float32 or bf16 gradient for inf/NaN only through the norm; the learner relies on it)
        return ("Factory's non-finite guard needs DeepSpeed's gradient norm: without it ZeRO 1 and 2 apply an update "
                "whose gradient is inf or NaN (in float32 and bfloat16) instead of skipping it, and DeepSpeed refuses "
                "it at stages 0 and 3: remove it")
    if key == "zenflow" and value and stage == 0:
        return ("ZenFlow runs inside DeepSpeed's ZeRO optimizers: without ZeRO the first backward fails; set "
                "train.deepspeed.zero_stage to 1, 2 or 3")
    if key == "pipeline_loading_checkpoint" and value is True and stage != 3:
        return ("DeepSpeed loads checkpoints that way at ZeRO-3 only (below it a resume fails, or it does nothing): "
                "set train.deepspeed.zero_stage to 3, or remove it")
    return None


def _set(model: Any, field: str) -> bool:
    """Whether the user wrote the field (a default does not count)."""
    return field in model.model_fields_set


VLLM_ONLY = ("kv_cache_gb", "vllm_compile", "vllm_lora", "vllm_sleep")  # the rollout settings only vLLM reads


def vllm_only(rollout: Any) -> list[str]:
    """The rollout settings the user wrote that only vLLM reads: said when the engine is transformers, by
    the spec (`factory check`) or by `engine: auto`'s choice on the machine (the run's start)."""
    return [f for f in VLLM_ONLY if _set(rollout, f)]


def check_dependent(spec: Spec, algorithm: dict[str, Any], r: Report, *, train_node: str | None,
                    joins: bool = False) -> None:
    """Settings that conflict with the source they belong to (errors), and settings that do nothing
    because another setting is off (warnings). `train_node`: the reward node that trains the policy (None: the
    reward graph's errors say why there is none); `joins`: the run joins a Ray cluster (compile.cluster_address)."""
    for split in ("train", "eval"):
        source = getattr(spec.data, split)
        if source is None or source.path is None:
            continue
        for field in ("size", "args"):
            if _set(source, field):
                r.error(f"data.{split}.{field}", f"'{field}' applies to a generator; every row of the file "
                                                 f"{source.path} is used")
    unused = "has no effect"
    if spec.data.eval is None:
        for path, model, field in (("train.eval_every", spec.train, "eval_every"),
                                   ("train.eval_size", spec.train, "eval_size"),
                                   ("rollout.eval_temperature", spec.rollout, "eval_temperature")):
            if _set(model, field):
                r.warn(path, f"{unused} without data.eval (there is nothing to evaluate)")
        for name in list(spec.metrics)[1:]:  # (the first is also the task the monitors read on the training batch)
            r.warn(f"metrics.{name}", f"{unused} without data.eval: a metric after the first is a held-out one only")
    if spec.train.share_prefix and _set(spec.train, "share_prefix"):  # (the learner decides it: Learner.setup)
        ranks = spec.resources.update.replicas
        off = ("train.gradient_checkpointing" if spec.train.gradient_checkpointing else
               f"model.lora.dropout {spec.model.lora.dropout:g} (the rows would share one dropout mask over the prefix)"
               if spec.model.lora is not None and spec.model.lora.dropout > 0 else
               f"train.deepspeed.zero_stage 3 over {ranks} ranks (resources.update.replicas: their forwards must pair "
               "up)" if spec.train.deepspeed.zero_stage == 3 and ranks > 1 else None)
        if off:
            r.warn("train.share_prefix", f"{unused} with {off}: the update runs every row's prefix itself")
    if spec.rollout.max_new_tokens > spec.rollout.max_total_tokens:  # `max_total_tokens: 1` trained 1-token turns
        if _set(spec.rollout, "max_new_tokens"):
            r.warn("rollout.max_new_tokens", f"{unused} above rollout.max_total_tokens "
                                             f"({spec.rollout.max_total_tokens}), which bounds a trajectory's response "
                                             "tokens: no turn can be longer")
        else:  # the default: at max_new_tokens it was located at the spec's first line, which holds no rollout
            r.warn("rollout.max_total_tokens", f"below rollout.max_new_tokens ({spec.rollout.max_new_tokens}, the "
                                               "default), which then has no effect: this bounds a trajectory's "
                                               "response tokens, so no turn can be longer")
    if spec.rollout.vllm_sleep and spec.rollout.engine != "hf":
        if spec.resources.rollout.num_gpus == 0:
            r.error("rollout.vllm_sleep", "vLLM's sleep mode gives back GPU memory, and this rollout runs on the CPU "
                                          "(vLLM refuses sleep mode there): remove it, or give the rollout a GPU "
                                          "(resources.rollout.num_gpus)")
        elif spec.train.max_staleness > 0:
            r.error("rollout.vllm_sleep", f"with train.max_staleness {spec.train.max_staleness} the next rollout runs "
                                          "while the update does, so vLLM would wake during the update: set "
                                          "max_staleness to 0, or remove vllm_sleep")
    if spec.rollout.engine == "hf":
        for field in vllm_only(spec.rollout):
            r.warn(f"rollout.{field}", f"{unused} with engine '{spec.rollout.engine}' (vLLM only)")
    if not spec.tools:
        if spec.resources.tools.model_fields_set:
            r.warn("resources.tools", f"{unused} without tools (there is no tools stage to place)")
        if _set(spec.tracking, "record_tools"):
            r.warn("tracking.record_tools", f"{unused} without tools (there are no tool calls to record)")
    for name in ("rollout", "update"):
        group = getattr(spec.resources, name)
        if _set(group, "strategy") and not (group.num_cpus or group.num_gpus or group.custom):
            r.warn(f"resources.{name}.strategy", f"{unused} while the stage reserves nothing (num_cpus, num_gpus and "
                                                 "custom all 0): its replicas get no placement group to spread; "
                                                 "reserve what a replica needs")
        elif _set(group, "strategy") and group.replicas == 1:
            r.warn(f"resources.{name}.strategy", f"{unused} with one replica (resources.{name}.replicas 1): a "
                                                 "strategy spreads several")
    if _set(spec.train, "bf16_autocast") and spec.model.dtype == "bfloat16":  # (float16 weights: it still moves
        # the rollout's `auto` to bfloat16, factory.device.auto_dtype)
        r.warn("train.bf16_autocast", f"{unused} with model.dtype bfloat16: the update computes in the weights' own "
                                      "dtype (DeepSpeed's bf16 mode), and the rollout's `auto` follows the weights")
    if spec.replay.run is None and _set(spec.replay, "on_miss"):
        r.warn("replay.on_miss", f"{unused} without replay.run (no run's tool calls are replayed)")
    if spec.rollout.engine != "hf" and spec.model.lora is None and _set(spec.rollout, "vllm_lora"):
        r.warn("rollout.vllm_lora", f"{unused} without model.lora (there are no adapters to sync)")
    elif (spec.rollout.engine != "hf" and spec.rollout.vllm_lora == "serve" and spec.model.lora is not None
          and spec.model.lora.r > VLLM_MAX_LORA_RANK):  # (vLLM's LoRAConfig refuses it once Ray has started)
        r.error("rollout.vllm_lora", f"vLLM serves adapters of rank at most {VLLM_MAX_LORA_RANK}, and model.lora.r "
                                     f"is {spec.model.lora.r}: use merge (or auto, which merges them), or a rank of "
                                     f"at most {VLLM_MAX_LORA_RANK}")
    if spec.train.optimizer.name != "adamw" and _set(spec.train.optimizer, "betas"):
        r.warn("train.optimizer.betas", f"{unused} with optimizer '{spec.train.optimizer.name}' (AdamW only)")
    if spec.algorithm.kl.coef == 0:
        for field in ("estimator", "apply"):
            if _set(spec.algorithm.kl, field):
                r.warn(f"algorithm.kl.{field}", f"{unused} while algorithm.kl.coef is 0 (no KL term)")
    if _set(spec.algorithm, "dual_clip_c") and algorithm.get("loss") not in DUAL_CLIP_LOSSES:
        r.warn("algorithm.dual_clip_c", f"{unused} with loss '{algorithm.get('loss')}' (it applies to "
                                        f"{', '.join(sorted(DUAL_CLIP_LOSSES))})")
    if spec.rollout.group_size == 1 and algorithm:  # (every row's advantage 0: a run that trains nothing)
        why = (f"advantage '{algorithm['advantage']}' compares each sample with the others of its prompt's group"
               if algorithm["advantage"] in GROUP_ADVANTAGES else
               "dynamic sampling keeps only the groups whose rewards differ" if algorithm["dynamic_sampling"] else "")
        if why:
            r.error("rollout.group_size", f"1 sample a prompt trains nothing: {why}, and a group of 1 has no "
                                          "others: set 2 or more (8 is usual), or algorithm.advantage: "
                                          "reinforce_pp or mean_baseline (no groups) without dynamic sampling")
    keep = spec.algorithm.train_per_group
    if keep is not None and keep >= spec.rollout.group_size:
        r.error("algorithm.train_per_group", f"{keep} is not below rollout.group_size ({spec.rollout.group_size}), "
                                             "so every sample would train anyway: lower it or remove it")
    per_group, of = ((keep, "algorithm.train_per_group") if keep is not None and keep < spec.rollout.group_size
                     else (spec.rollout.group_size, "rollout.group_size"))
    rows = spec.train.prompts_per_step * per_group
    if spec.algorithm.mini_batches > rows:  # (the update caps it at the rows: factory.update.batch.plan)
        r.warn("algorithm.mini_batches", f"above the {rows} trajectories a step trains (train.prompts_per_step x "
                                         f"{of}): a step makes at most {rows} optimizer steps, one a trajectory")
    a = spec.algorithm
    kl_in_reward = a.kl.coef > 0 and algorithm.get("kl_apply") == "reward"  # (a pass of its own for pi_old, whose
    # dropout mask is not the update's: with dropout the first ratio is not 1)
    pi_old = pi_old_source(bool(algorithm.get("use_rollout_logprobs", a.use_rollout_logprobs)),
                           algorithm.get("rollout_correction", a.rollout_correction) is not None,
                           stale=spec.train.max_staleness > 0, updates=a.epochs * min(a.mini_batches, rows),
                           kl_in_reward=kl_in_reward)
    if not (pi_old.own_pass or pi_old.from_rollout):
        # pi_old is then the update pass's own, detached: every ratio is 1
        clipping = [f for f in ("clip", "dual_clip_c") if _set(a, f)
                    and (f == "clip" or algorithm.get("loss") in DUAL_CLIP_LOSSES)]  # (else said above)
        for field in clipping:
            r.warn(f"algorithm.{field}", f"{unused} while each step makes one on-policy update (algorithm.epochs 1, "
                                         "mini_batches 1, no train.max_staleness): pi_old is the policy being "
                                         "updated, so every ratio is 1 and nothing is clipped; clipping acts with "
                                         "more mini-batches or epochs, staleness, algorithm.use_rollout_logprobs, or "
                                         "KL in the reward under dropout")
    if spec.algorithm.credit == "turn" and spec.rollout.max_turns == 1:
        r.warn("algorithm.credit", f"{unused} with rollout.max_turns 1: each trajectory's one model turn gets the "
                                   "advantage credit 'trajectory' gives it (raise max_turns for turns to compare)")
    elif a.credit == "turn" and _set(a, "gamma") and train_node is not None and not kl_in_reward and (
            train_node not in per_turn_nodes(spec.rewards)):  # (factory.update.batch.turn_rewards)
        r.warn("algorithm.gamma", f"{unused} while the training node '{train_node}' is trajectory-level and no KL "
                                  "is in the reward: every turn's value is the trajectory's reward, and a discounted "
                                  "mean of equal values is that value (a per-turn training node, `per: turn`, or "
                                  "algorithm.kl.apply: reward gives each turn a value of its own)")
    overlong = spec.algorithm.overlong
    if _set(overlong, "penalty") and overlong.buffer == 0:
        r.warn("algorithm.overlong.penalty", f"{unused} while algorithm.overlong.buffer is 0 (no soft penalty)")
    if overlong.buffer > spec.rollout.max_total_tokens:  # the ramp would start before the first token
        r.error("algorithm.overlong.buffer", f"{overlong.buffer} is above rollout.max_total_tokens "
                                             f"({spec.rollout.max_total_tokens}), so every trajectory, even an empty "
                                             "one, would be penalised: set it to the last stretch of the budget "
                                             "(a quarter of it is usual)")
    kl = spec.algorithm.kl
    if kl.coef > 0 and kl.estimator == "k1" and kl.apply == "loss":
        r.warn("algorithm.kl.estimator", f"{unused} as a loss term: k1's gradient on the policy's own samples is "
                                         "zero in expectation (that of log pi), so the term adds only noise: use "
                                         "k2 (its gradient is the KL's) or k3 (GRPO's), or kl.apply: reward")
    truncated = [f"rollout.{f} {getattr(spec.rollout, f):g}" for f, off in (("top_p", 1.0), ("top_k", 0))
                 if getattr(spec.rollout, f) != off]
    sampler = [why for why, on in (
        ("algorithm.use_rollout_logprobs", spec.algorithm.use_rollout_logprobs),
        (f"train.max_staleness {spec.train.max_staleness}", spec.train.max_staleness > 0),
        ("algorithm.rollout_correction", spec.algorithm.rollout_correction is not None)) if on]
    if truncated and sampler:
        # The engines report the log-prob of the distribution they sample (renormalised over the kept
        # tokens); the learner computes the whole softmax. Their ratio is the kept mass, below 1, at every
        # token before any update: negative-advantage tokens clip at once (no gradient), the others shrink.
        r.error(f"rollout.{truncated[0].split()[0].split('.')[1]}",
                f"{' and '.join(truncated)} with {' and '.join(sampler)}: the rollout's log-probs are those of "
                "the truncated distribution it samples (renormalised over the kept tokens), the learner's those of "
                "the whole softmax, so their ratio starts below 1 at every token (the kept mass) and the clip "
                "cuts the gradient of every negative advantage: sample from the whole distribution (top_p: 1, "
                "top_k: 0), or take pi_old from the learner (remove the settings named)")
    if joins and _set(spec.resources, "object_store_gb"):
        r.warn("resources.object_store_gb", f"{unused} when joining a Ray cluster (resources.ray_address or "
                                            "$RAY_ADDRESS): its nodes' stores were sized when they started")
