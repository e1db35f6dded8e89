"""No silently ignored setting: every schema field is read, DeepSpeed pass-through keys are real DeepSpeed
keys, settings that depend on another one say so, and a broken reward node is a located error."""
from __future__ import annotations

import ast
import importlib.util
import os
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from factory.commands import cli
from factory.compiler.compile import compile_file
from factory.compiler.errors import SpecErrors
from factory.compiler.settings import DEEPSPEED_KEYS, ZERO_KEYS
from factory.compiler.translate import _strip, _union_members
from factory.schema import Spec
from tests.test_compiler_support import BASE, report

REPO = Path(__file__).resolve().parents[1]

# Fields read without naming them as an attribute: the combinators' inputs are read by
# factory.reward.graph.node_inputs as getattr(node, <class name>).
READ_INDIRECTLY = {"MinNode.min", "MaxNode.max", "ProductNode.product"}


def _models(ann: typing.Any, out: set[type[BaseModel]]) -> set[type[BaseModel]]:
    ann = _strip(ann)
    for member in _union_members(ann) or (ann,):
        member = _strip(member)
        if typing.get_origin(member) in (dict, list, tuple):
            for arg in typing.get_args(member):
                _models(arg, out)
        elif isinstance(member, type) and issubclass(member, BaseModel) and member not in out:
            out.add(member)
            for field in member.model_fields.values():
                _models(field.annotation, out)
    return out


def _names_read_by_the_pipeline() -> set[str]:
    """Attribute names (and getattr constants) used anywhere in factory/ outside the schema itself and
    the compiler's warnings about unused settings."""
    names: set[str] = set()
    for path in (REPO / "factory").rglob("*.py"):
        if path.name == "schema.py" or path.relative_to(REPO).as_posix() == "factory/compiler/settings.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) > 1
                  and isinstance(node.args[1], ast.Constant)):
                names.add(node.args[1].value)
    return names


def test_every_schema_field_is_read_by_the_pipeline():
    """A guard, not a proof: a field whose name is never read anywhere in factory/ is certainly ignored."""
    read = _names_read_by_the_pipeline()
    unread = sorted(f"{m.__name__}.{f}" for m in _models(Spec, set()) for f in m.model_fields
                    if f not in read and f"{m.__name__}.{f}" not in READ_INDIRECTLY)
    assert unread == []


def test_deepspeed_key_list_is_what_deepspeed_reads():
    """Record every top-level key DeepSpeed's own config reader looks up; the static list must match it
    (after a DeepSpeed upgrade this says which keys to add or drop)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    seen: set[str] = set()

    class Recording(dict):
        def get(self, key, *default):
            seen.add(key)
            return super().get(key, *default)

        def __getitem__(self, key):
            seen.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            seen.add(key)
            return super().__contains__(key)

        def keys(self):  # DeepSpeed also asks `KEY in param_dict.keys()`
            outer = self

            class Keys:
                def __contains__(self, key):
                    seen.add(key)
                    return dict.__contains__(outer, key)

                def __iter__(self):
                    return iter(dict.keys(outer))

                def __len__(self):
                    return dict.__len__(outer)

            return Keys()

        def __copy__(self):
            return self

    DeepSpeedConfig(Recording(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1))
    # sequence_parallel_size is read only when torch.distributed is initialised (not in this process).
    assert DEEPSPEED_KEYS == seen | {"sequence_parallel_size"}
    zero = {n for n, f in DeepSpeedZeroConfig.model_fields.items()} | {
        f.alias for f in DeepSpeedZeroConfig.model_fields.values() if f.alias}
    assert ZERO_KEYS == zero


def _spec(project, mod: str, extra: str = "", base: str = BASE) -> str:
    project.module(mod)
    return project.spec(base.replace("{mod}", mod) + extra)


def _errors(path: str, overrides=()) -> str:
    with pytest.raises(SpecErrors) as e:
        compile_file(path, overrides)
    return report(e)


def test_deepspeed_keys_are_checked_with_a_suggestion(project):
    path = _spec(project, "st_ds", "train:\n  deepspeed:\n    zero_stagee: 2\n    steps_per_prin: 10\n"
                                   "    zero_optimization: {overlap_com: true, stage: 2, reduce_bucket_size: 5}\n"
                                   "    gradient_clipping: 0.5\n    offload_optimizer: true\n")
    assert _errors(path) == (
        "spec.yaml:11: train.deepspeed.zero_stagee: unknown key 'zero_stagee'; did you mean 'zero_stage'?\n"
        "spec.yaml:12: train.deepspeed.steps_per_prin: unknown key 'steps_per_prin'; did you mean 'steps_per_print'?\n"
        "spec.yaml:13: train.deepspeed.zero_optimization.overlap_com: unknown key 'overlap_com'; did you mean "
        "'overlap_comm'?\n"
        "spec.yaml:13: train.deepspeed.zero_optimization.stage: Factory sets this DeepSpeed key from the spec: "
        "set train.deepspeed.zero_stage\n"
        "spec.yaml:14: train.deepspeed.gradient_clipping: Factory sets this DeepSpeed key from the spec: "
        "set train.optimizer.grad_clip\n"
        "spec.yaml:15: train.deepspeed.offload_optimizer: optimizer offload needs ZeRO: set zero_stage to 1, 2 or 3\n"
        "6 errors in spec.yaml")


def test_the_gradients_reduction_over_the_ranks_is_factorys(project):
    """`gradient_allreduce_op: sum` passed check, and over 2 ranks every update was twice the mini-batch's: the
    learner scales each rank's loss by the world size because DeepSpeed averages the gradients (its default)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.constants import GRADIENT_ALLREDUCE_OP_DEFAULT

    assert GRADIENT_ALLREDUCE_OP_DEFAULT == "mean"  # what the learner's scaling is for
    path = _spec(project, "st_ds_sum", "train:\n  deepspeed:\n    zero_stage: 2\n    gradient_allreduce_op: sum\n")
    assert _errors(path) == (
        "spec.yaml:12: train.deepspeed.gradient_allreduce_op: Factory sets this DeepSpeed key from the spec: the "
        "update scales each rank's loss by the number of ranks because DeepSpeed averages the gradients over them "
        "(its default, mean): another reduction would scale every update (sum: by the number of ranks)\n"
        "1 error in spec.yaml")


def test_deepspeed_keys_that_fail_the_update_start_or_every_resume_are_refused(project):
    """Keys that passed check, then failed the update stage as it started (ZeRO-2 refuses a pre-divided gradient;
    DeepSpeed refuses Factory's torch optimizer with an offload that train.deepspeed.offload_optimizer did not
    set up) or failed every resume (Factory's checkpoints are never in DeepSpeed's universal format)."""
    path = _spec(project, "st_ds_start", "train:\n  deepspeed:\n    zero_stage: 2\n    prescale_gradients: true\n"
                                         "    gradient_predivide_factor: 2.0\n    checkpoint: {load_universal: true}\n"
                                         "    zero_optimization: {offload_optimizer: {device: cpu}, "
                                         "cpu_offload: true}\n")
    scale = ("Factory sets this DeepSpeed key from the spec: the update owns the gradient's scale over the ranks (it "
             "scales each rank's loss for DeepSpeed's plain mean); DeepSpeed's ZeRO 2 and 3 refuse it when the update "
             "starts, and below them it only reorders the same mean")
    offload = ("use train.deepspeed.offload_optimizer: true (an offload to the CPU, on which torch's optimizer steps; "
               "alone, this key fails the update's start: DeepSpeed refuses a torch optimizer with ZeRO-Offload)")
    assert _errors(path) == (
        f"spec.yaml:12: train.deepspeed.prescale_gradients: {scale}\n"
        f"spec.yaml:13: train.deepspeed.gradient_predivide_factor: {scale}\n"
        "spec.yaml:14: train.deepspeed.checkpoint.load_universal: Factory's checkpoints are never in DeepSpeed's "
        "universal format, so every resume would fail: remove it\n"
        f"spec.yaml:15: train.deepspeed.zero_optimization.offload_optimizer: {offload}\n"
        f"spec.yaml:15: train.deepspeed.zero_optimization.cpu_offload: {offload}\n"
        "5 errors in spec.yaml")
    # at stage 0 the offload needs ZeRO first; what is not an offload, or not universal, passes
    assert _errors(path, ["train.deepspeed.zero_stage=0"]).splitlines()[3] == (
        f"spec.yaml:15: train.deepspeed.zero_optimization.offload_optimizer: {offload}, with "
        "train.deepspeed.zero_stage 1, 2 or 3 (DeepSpeed refuses an offload without ZeRO)")
    ok = _spec(project, "st_ds_start_ok", "train:\n  deepspeed:\n    zero_stage: 2\n    checkpoint: {load_universal: "
                                          "false, tag_validation: Warn}\n    zero_optimization: {offload_optimizer: "
                                          "{device: none}, cpu_offload: false}\n")
    assert compile_file(ok)


def test_the_optimizer_offload_is_set_in_one_place(project):
    """`offload_optimizer: true` beside a `zero_optimization.offload_optimizer` (or `cpu_offload`): the extra keys
    were merged over Factory's `{device: cpu}`, so `{device: none}` turned the offload the spec asked for off, in
    silence."""
    path = _spec(project, "st_ds_off", "train:\n  deepspeed:\n    zero_stage: 2\n    offload_optimizer: true\n    "
                                       "zero_optimization: {offload_optimizer: {device: none}, cpu_offload: true}\n")
    message = ("train.deepspeed.offload_optimizer: true sets the optimizer offload ({device: cpu}) too: set it in "
               "one place (remove this key, or set train.deepspeed.offload_optimizer to false)")
    assert _errors(path) == (
        f"spec.yaml:13: train.deepspeed.zero_optimization.offload_optimizer: {message}\n"
        f"spec.yaml:13: train.deepspeed.zero_optimization.cpu_offload: {message}\n"
        "2 errors in spec.yaml")


def test_deepspeed_keys_factory_does_not_apply_or_deepspeed_removed_are_errors(project):
    """Keys DeepSpeed reads but that act only through parts of DeepSpeed Factory's update does not use
    (its data loader, a PipelineModule, engine.compile(), deepspeed.checkpointing) were accepted and did
    nothing; keys DeepSpeed 0.19 removed failed a minute into the run. Both are errors at check time."""
    path = _spec(project, "st_ds_na", "train:\n  deepspeed:\n    compile: {deepcompile: true}\n"
                                      "    activation_checkpointing: {partition_activations: true}\n"
                                      "    pipeline: {stages: 2}\n    dataloader_drop_last: true\n"
                                      "    curriculum_learning: {enabled: true}\n"
                                      "    data_efficiency: {enabled: true}\n")
    lines = _errors(path).splitlines()
    assert lines[0] == ("spec.yaml:11: train.deepspeed.compile: not applied by Factory's update: DeepSpeed compiles "
                        "only when engine.compile() is called, and Factory's update does not call it (the model "
                        "runs eagerly)")
    assert lines[1].startswith("spec.yaml:12: train.deepspeed.activation_checkpointing: not applied by Factory's "
                               "update: ") and lines[1].endswith("set train.gradient_checkpointing")
    assert lines[2].startswith("spec.yaml:13: train.deepspeed.pipeline: not applied by Factory's update: pipeline "
                               "parallelism needs a DeepSpeed PipelineModule")
    for line, key in zip(lines[3:], ("dataloader_drop_last", "curriculum_learning", "data_efficiency")):
        assert f"train.deepspeed.{key}: " in line
    assert "DeepSpeed's own data loader" in lines[3] and "DeepSpeed's own data loader" in lines[5]
    assert lines[4].endswith("curriculum_learning: DeepSpeed 0.19 has removed this feature (it refuses the key "
                             "when the engine starts)")
    assert lines[6] == "6 errors in spec.yaml"
    path = _spec(project, "st_ds_op", "train:\n  deepspeed: {zero_stage: 2, zero_optimization: {offload_param: "
                                      "{device: cpu}}}\n")
    assert _errors(path).splitlines()[0] == ("spec.yaml:10: train.deepspeed.zero_optimization.offload_param: "
                                             "parameter offload needs ZeRO-3: set train.deepspeed.zero_stage to 3")
    assert compile_file(path, ["train.deepspeed.zero_stage=3"])  # (ZeRO-3 reads it)
    path = _spec(project, "st_ds_na2", "train:\n  deepspeed: {disable_allgather: true, vocabulary_size: 151936}\n")
    assert _errors(path).splitlines()[:2] == [  # read by DeepSpeed's config, used by nothing (0.19.8's source)
        "spec.yaml:10: train.deepspeed.disable_allgather: not applied by Factory's update: DeepSpeed 0.19 reads it "
        "into its config and uses it nowhere",
        "spec.yaml:10: train.deepspeed.vocabulary_size: not applied by Factory's update: DeepSpeed only logs a note "
        "when it is not a multiple of 8; the vocabulary is the model's own (its config.json)"]


def test_zero_keys_deepspeed_refuses_or_never_reads_at_the_specs_stage(project, capsys):
    """zero_optimization keys were all accepted at every ZeRO stage. Traced in DeepSpeed 0.19.8 with Factory's
    engine (a torch optimizer, float32/bf16/fp16 weights): some fail the update when it starts or at its first
    backward at stage 0 (errors now), some are read by nothing Factory calls (errors), and the rest act only in
    the ZeRO optimizers, so below their stage they do nothing (warnings: a ZeRO spec run at stage 0 is fine)."""
    path = _spec(project, "st_ds_z0", "train:\n  deepspeed:\n    zero_optimization: {overlap_comm: true, "
                                      "compute_grad_norm: false, offload_optimizer: {device: cpu}, zenflow: "
                                      "{topk_ratio: 0.1}, allgather_partitions: true, pipeline_loading_checkpoint: "
                                      "true}\n")
    lines = _errors(path).splitlines()
    key = "spec.yaml:11: train.deepspeed.zero_optimization."
    assert lines[0].startswith(f"{key}overlap_comm: DeepSpeed refuses overlap_comm below ZeRO-2")
    assert lines[1].startswith(f"{key}compute_grad_norm: Factory's non-finite guard needs DeepSpeed's gradient norm")
    assert lines[2].startswith(f"{key}offload_optimizer: use train.deepspeed.offload_optimizer: true") and \
        lines[2].endswith("with train.deepspeed.zero_stage 1, 2 or 3 (DeepSpeed refuses an offload without ZeRO)")
    assert lines[3].startswith(f"{key}zenflow: ZenFlow runs inside DeepSpeed's ZeRO optimizers")
    assert lines[4] == (f"{key}allgather_partitions: not applied by Factory's update: DeepSpeed 0.19 reads it into "
                        "its config and uses it nowhere")
    assert lines[5].startswith(f"{key}pipeline_loading_checkpoint: DeepSpeed loads checkpoints that way at ZeRO-3")
    assert lines[6] == "6 errors in spec.yaml"
    # at ZeRO-2 DeepSpeed takes the first four (offload_optimizer: {device: none} never offloads, at any stage), and
    # Factory refuses compute_grad_norm: false at every stage and an offload it did not set up
    at2 = _errors(path, ["train.deepspeed.zero_stage=2"]).splitlines()
    assert at2[:2] == lines[1:2] + [lines[2].split(", with train.deepspeed.zero_stage")[0]] and at2[2:4] == lines[4:6]
    ok = _spec(project, "st_ds_z0w", "train:\n  deepspeed:\n    zero_optimization: {reduce_bucket_size: 5, "
                                    "sub_group_size: 10, offload_optimizer: {device: none}}\n")
    for stage, warned in [(0, ["reduce_bucket_size", "sub_group_size"]), (2, ["sub_group_size"]), (3, [])]:
        assert cli.main(["check", ok, f"train.deepspeed.zero_stage={stage}"]) == 0
        said = [line for line in capsys.readouterr().err.splitlines() if "zero_optimization." in line]
        assert [line.split("zero_optimization.")[1].split(":")[0] for line in said] == warned, stage
        assert all(f"has no effect at train.deepspeed.zero_stage {stage}: DeepSpeed reads it only in its ZeRO "
                   in line for line in said)
    # a Hugging Face Trainer config's "auto", which DeepSpeed's config models drop (its default applies)
    auto = "train.deepspeed.zero_optimization.reduce_bucket_size"
    assert cli.main(["check", ok, "train.deepspeed.zero_stage=2", f"{auto}=auto"]) == 0
    assert (f"{auto}: warning: 'auto' is filled in by Hugging Face's Trainer, not by DeepSpeed, which drops it, so "
            "its default applies") in capsys.readouterr().err
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    assert DeepSpeedZeroConfig(stage=2, reduce_bucket_size="auto").reduce_bucket_size == \
        DeepSpeedZeroConfig(stage=2).reduce_bucket_size


def test_turning_off_deepspeeds_gradient_norm_is_refused_for_the_non_finite_guard(project):
    """`zero_optimization.compute_grad_norm: false` was accepted at ZeRO 1 and 2, where DeepSpeed then computes no
    gradient norm and (in float32 and bfloat16) checks no overflow: an update with a NaN gradient was applied,
    uncounted, while the learner relies on ZeRO to skip it (learner.py `_update`)."""
    path = _spec(project, "st_ds_gn", "train:\n  deepspeed:\n    zero_stage: 2\n"
                                      "    zero_optimization: {compute_grad_norm: false}\n")
    said = ("spec.yaml:12: train.deepspeed.zero_optimization.compute_grad_norm: Factory's non-finite guard needs "
            "DeepSpeed's gradient norm: without it ZeRO 1 and 2 apply an update whose gradient is inf or NaN (in "
            "float32 and bfloat16) instead of skipping it, and DeepSpeed refuses it at stages 0 and 3: remove it\n"
            "1 error in spec.yaml")
    for stage in (0, 1, 2, 3):
        assert _errors(path, [f"train.deepspeed.zero_stage={stage}"]) == said, stage
    assert compile_file(path, ["train.deepspeed.zero_optimization.compute_grad_norm=true"])


def test_float16_weights_need_zero(project):
    """`model.dtype: float16` at ZeRO stage 0 (the default) passed check, and every update was 2^16 too small: there
    DeepSpeed 0.19.8 wraps the optimizer in its FP16_UnfusedOptimizer, whose step divides the gradients by the
    dynamic loss scale (2^16 at the start), while engine.backward scales the loss only for the ZeRO optimizers;
    train.optimizer.grad_clip, compared with the divided norm, never acted either."""
    f16 = BASE.replace('{path: "factory:tiny-qwen3"}', '{path: "factory:tiny-qwen3", dtype: float16}')
    path = _spec(project, "st_f16", base=f16)
    assert _errors(path) == (
        "spec.yaml:2: model.dtype: float16 weights need DeepSpeed's ZeRO loss scaling (at zero_stage 0 DeepSpeed "
        "leaves the loss unscaled but divides each update by its loss scale, 2^16 at the start): set "
        "train.deepspeed.zero_stage: 1, or use bfloat16\n"
        "1 error in spec.yaml")
    for stage in (1, 2, 3):
        assert compile_file(path, [f"train.deepspeed.zero_stage={stage}"])
    assert compile_file(path, ["model.dtype=bfloat16"])


def test_the_zero_keys_factory_refuses_by_stage_are_deepspeeds_and_its_own_refusal_agrees():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from factory.compiler.settings import ZERO_FROM_STAGE, ZERO_NOT_APPLIED, _zero_problem

    assert set(ZERO_FROM_STAGE) | set(ZERO_NOT_APPLIED) <= ZERO_KEYS
    assert not set(ZERO_FROM_STAGE) & set(ZERO_NOT_APPLIED)
    # the deprecated spelling offloads too; an offload to device "none" is none
    said = _zero_problem("cpu_offload", True, 0)
    assert said is not None and said == _zero_problem("offload_optimizer", {"device": "nvme"}, 0)
    assert not _zero_problem("cpu_offload", False, 1) and not _zero_problem("offload_optimizer", {"device": "none"}, 0)
    for stage in (0, 1, 2, 3):  # refused by Factory at every stage, by DeepSpeed's own validator where it says so
        assert "DeepSpeed refuses it at stages 0 and 3" in _zero_problem("compute_grad_norm", False, stage)
        try:
            DeepSpeedZeroConfig(stage=stage, compute_grad_norm=False)
        except ValueError:
            assert stage in (0, 3), stage
        else:
            assert stage in (1, 2), stage


def test_removed_deepspeed_keys_are_the_ones_deepspeed_refuses():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import _REMOVED_TOP_LEVEL_CONFIG_KEYS

    from factory.compiler.settings import OWNED_KEYS, REMOVED

    assert REMOVED == set(_REMOVED_TOP_LEVEL_CONFIG_KEYS) - set(OWNED_KEYS)  # amp: Factory's own message


def test_real_deepspeed_keys_pass(project):
    path = _spec(project, "st_ds_ok", "train:\n  deepspeed: {zero_stage: 2, offload_optimizer: true, "
                                      "steps_per_print: 5, zero_optimization: {overlap_comm: true}}\n")
    spec, _ = compile_file(path)
    assert spec.train.deepspeed.model_extra == {"steps_per_print": 5, "zero_optimization": {"overlap_comm": True}}


def test_eval_only_settings_without_eval_data_warn_in_check(project, capsys):
    path = _spec(project, "st_eval", "metrics: {acc: correct}\ntrain: {eval_every: 2, eval_size: 4}\n")
    assert cli.main(["check", path]) == 0
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "spec.yaml:10: train.eval_every: warning: has no effect without data.eval (there is nothing to evaluate)",
        "spec.yaml:10: train.eval_size: warning: has no effect without data.eval (there is nothing to evaluate)",
    ]
    # not `metrics` (it was warned of too): its first entry is the task the reward-hacking monitors read on the
    # training batch; deleted as the warning said, the monitors took the first function node instead
    assert compile_file(path, ["metrics.acc=fmt"])[1].driver.watch.task_node == "fmt"
    # with eval data they are what they say
    assert cli.main(["check", path, "data.eval={generator: 'factory.data:arithmetic', size: 4}"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_turn_credit_with_one_turn_a_trajectory_warns_in_check(project, capsys):
    """One model turn per trajectory: turn credit gives the advantages trajectory credit gives (bit for bit,
    tests/test_update.py), and checked ok in silence."""
    path = _spec(project, "st_turn", "algorithm: {credit: turn}\nrollout: {max_turns: 1}\n")
    assert cli.main(["check", path]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "spec.yaml:9: algorithm.credit: warning: has no effect with rollout.max_turns 1: each trajectory's one model "
        "turn gets the advantage credit 'trajectory' gives it (raise max_turns for turns to compare)"]
    assert cli.main(["check", path, "rollout.max_turns=2"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_train_per_group_must_be_below_the_group_size(project):
    path = _spec(project, "st_tpg", "rollout: {group_size: 4}\nalgorithm: {train_per_group: 4}\n")
    assert _errors(path) == ("spec.yaml:10: algorithm.train_per_group: 4 is not below rollout.group_size (4), so "
                             "every sample would train anyway: lower it or remove it\n1 error in spec.yaml")
    compile_file(path, ["algorithm.train_per_group=3"])


def test_one_sample_a_prompt_needs_an_advantage_without_groups(project):
    """grpo with group_size 1 checked ok and trained 0 rows every step (each row its group's mean)."""
    path = _spec(project, "st_g1", "rollout: {group_size: 1}\n")
    assert _errors(path) == (
        "spec.yaml:9: rollout.group_size: 1 sample a prompt trains nothing: advantage 'grpo' compares each sample "
        "with the others of its prompt's group, and a group of 1 has no others: set 2 or more (8 is usual), or "
        "algorithm.advantage: reinforce_pp or mean_baseline (no groups) without dynamic sampling\n1 error in spec.yaml")
    assert "dynamic sampling keeps only the groups" in _errors(path, ["algorithm.name=dapo",
                                                                      "algorithm.advantage=mean_baseline"])
    for ok in (["algorithm.name=reinforce_pp"], ["algorithm.advantage=mean_baseline"]):
        compile_file(path, ok)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (Python 3.10, "
                    "FACTORY_NO_VLLM=1)")
def test_vllm_settings_that_do_not_apply_warn(project):
    """`vllm_compile` / `vllm_lora` under the transformers engine, `vllm_lora` without LoRA: checked ok in silence."""
    path = _spec(project, "st_vllm", "rollout: {engine: hf, vllm_compile: true, vllm_lora: serve}\n")
    assert compile_file(path)[1].warnings == (
        "spec.yaml:9: rollout.vllm_compile: warning: has no effect with engine 'hf' (vLLM only)",
        "spec.yaml:9: rollout.vllm_lora: warning: has no effect with engine 'hf' (vLLM only)")
    assert compile_file(path, ["rollout.engine=vllm"])[1].warnings == (
        "spec.yaml:9: rollout.vllm_lora: warning: has no effect without model.lora (there are no adapters to sync)",)
    assert not compile_file(path, ["rollout.engine=vllm", "model.lora.r=4"])[1].warnings


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (Python 3.10, "
                    "FACTORY_NO_VLLM=1)")
def test_vllm_sleep_needs_a_gpu_rollout_and_no_staleness(project):
    """`rollout.vllm_sleep` frees vLLM's GPU memory during the update: on a CPU vLLM refuses sleep mode (when the
    rollout starts), and with max_staleness the next rollout would wake it during the update."""
    path = _spec(project, "st_sleep", "rollout: {engine: vllm, vllm_sleep: true}\n")
    assert _errors(path) == (
        "spec.yaml:9: rollout.vllm_sleep: vLLM's sleep mode gives back GPU memory, and this rollout runs on the CPU "
        "(vLLM refuses sleep mode there): remove it, or give the rollout a GPU (resources.rollout.num_gpus)\n"
        "1 error in spec.yaml")
    gpus = ["resources.rollout.num_gpus=0.5", "resources.update.num_gpus=0.5"]  # (this machine has none: errors too)
    assert "rollout.vllm_sleep" not in _errors(path, gpus)
    assert ("rollout.vllm_sleep: with train.max_staleness 1 the next rollout runs while the update does, so vLLM "
            "would wake during the update: set max_staleness to 0, or remove vllm_sleep") in _errors(
                path, [*gpus, "train.max_staleness=1"])
    assert compile_file(path, ["rollout.engine=hf"])[1].warnings == (
        "spec.yaml:9: rollout.vllm_sleep: warning: has no effect with engine 'hf' (vLLM only)",)


def test_share_prefix_switched_off_by_another_setting_warns(project):
    """`share_prefix: true` beside gradient checkpointing or LoRA dropout checked ok, and the learner ran every
    row's prefix itself (`resolved.update.share_prefix: off`)."""
    path = _spec(project, "st_prefix", "train: {share_prefix: true, gradient_checkpointing: true}\n")
    assert compile_file(path)[1].warnings == (
        "spec.yaml:9: train.share_prefix: warning: has no effect with train.gradient_checkpointing: the update "
        "runs every row's prefix itself",)
    _, plan = compile_file(path, ["train.gradient_checkpointing=false", "model.lora={r: 4, dropout: 0.1}"])
    assert plan.warnings == (
        "spec.yaml:9: train.share_prefix: warning: has no effect with model.lora.dropout 0.1 (the rows would share "
        "one dropout mask over the prefix): the update runs every row's prefix itself",)
    assert not compile_file(path, ["train.gradient_checkpointing=false"])[1].warnings  # it applies: no warning


def test_a_turn_budget_above_the_trajectory_budget_warns(project):
    """`max_total_tokens: 1` under `max_new_tokens: 32` checked ok and trained 1-token turns."""
    path = _spec(project, "st_budget", "rollout: {max_new_tokens: 32, max_total_tokens: 16}\n")
    _, plan = compile_file(path)
    assert plan.warnings == (
        "spec.yaml:9: rollout.max_new_tokens: warning: has no effect above rollout.max_total_tokens (16), which "
        "bounds a trajectory's response tokens: no turn can be longer",)
    # max_new_tokens the default: the warning was at rollout.max_new_tokens, located at the spec's first line
    path = _spec(project, "st_budget_default", "")
    assert compile_file(path, ["rollout.max_total_tokens=8"])[1].warnings == (
        "<override 1>: rollout.max_total_tokens: warning: below rollout.max_new_tokens (128, the default), which then "
        "has no effect: this bounds a trajectory's response tokens, so no turn can be longer",)


def test_more_mini_batches_than_trajectories_warns(project):
    """`algorithm.mini_batches: 100` over 8 trajectories a step checked ok and made 8 optimizer steps (the update
    caps it at the rows)."""
    path = _spec(project, "st_minib", "")
    assert compile_file(path, ["algorithm.mini_batches=100", "train.prompts_per_step=2", "rollout.group_size=4"])[1].warnings == (
        "<override 1>: algorithm.mini_batches: warning: above the 8 trajectories a step trains "
        "(train.prompts_per_step x rollout.group_size): a step makes at most 8 optimizer steps, one a trajectory",)
    assert compile_file(path, ["algorithm.mini_batches=8", "train.prompts_per_step=2", "rollout.group_size=4"])[1].warnings == ()


def test_settings_that_another_setting_switches_off_warn(project):
    path = _spec(project, "st_dep", "rollout: {engine: hf, kv_cache_gb: 4}\ntrain: {optimizer: {name: sgd, betas: [0.9, 0.95]}}\n"
                                    "algorithm: {kl: {estimator: k1}, loss: cispo, dual_clip_c: 3, overlong: {penalty: 0.5}}\n")
    _, plan = compile_file(path)
    assert plan.warnings == (
        "spec.yaml:9: rollout.kv_cache_gb: warning: has no effect with engine 'hf' (vLLM only)",
        "spec.yaml:10: train.optimizer.betas: warning: has no effect with optimizer 'sgd' (AdamW only)",
        "spec.yaml:11: algorithm.kl.estimator: warning: has no effect while algorithm.kl.coef is 0 (no KL term)",
        ("spec.yaml:11: algorithm.dual_clip_c: warning: has no effect with loss 'cispo' (it applies to dual_clip, "
         "gspo, ppo_clip)"),
        ("spec.yaml:11: algorithm.overlong.penalty: warning: has no effect while algorithm.overlong.buffer is 0 "
         "(no soft penalty)"),
    )
    for loss in ("ppo_clip", "gspo", "dual_clip"):  # they apply it (past one on-policy update): no warning
        _, plan = compile_file(path, [f"algorithm.loss={loss}", "algorithm.mini_batches=2"])
        assert not [w for w in plan.warnings if "dual_clip_c" in w], loss
    # gamma discounts the turns' values in a turn's return: with a trajectory-level training node every turn's value
    # is the trajectory's reward, and a discounted mean of equal values is that value whatever gamma is
    turn = ["algorithm.credit=turn", "algorithm.gamma=0.5"]
    assert [w for w in compile_file(path, turn)[1].warnings if "gamma" in w] == [
        "<override 2>: algorithm.gamma: warning: has no effect while the training node 'total' is trajectory-level "
        "and no KL is in the reward: every turn's value is the trajectory's reward, and a discounted mean of equal "
        "values is that value (a per-turn training node, `per: turn`, or algorithm.kl.apply: reward gives each turn "
        "a value of its own)"]
    for own in ("rewards.fmt.per=turn", "algorithm.kl={coef: 0.01, apply: reward}"):  # the turns' values differ
        assert not [w for w in compile_file(path, [*turn, own])[1].warnings if "gamma" in w], own


def test_settings_that_corrupt_the_objective_are_refused_or_said(project):
    """Three a review found checked ok: an overlong buffer past the budget (every trajectory penalised, an empty one
    too), k1 as a loss term (its gradient zero in expectation: noise only), and top-p sampling with the rollout's
    log-probs in the ratio (its log-probs are the truncated distribution's: the ratio starts at the kept mass, and
    every negative advantage clips at once)."""
    path = _spec(project, "st_obj", "rollout: {max_new_tokens: 32, max_total_tokens: 64, top_p: 0.9}\n"
                                    "algorithm: {overlong: {buffer: 65}, use_rollout_logprobs: true}\n")
    assert _errors(path) == (
        "spec.yaml:9: rollout.top_p: rollout.top_p 0.9 with algorithm.use_rollout_logprobs: the rollout's log-probs "
        "are those of the truncated distribution it samples (renormalised over the kept tokens), the learner's those "
        "of the whole softmax, so their ratio starts below 1 at every token (the kept mass) and the clip cuts the "
        "gradient of every negative advantage: sample from the whole distribution (top_p: 1, top_k: 0), or take "
        "pi_old from the learner (remove the settings named)\n"
        "spec.yaml:10: algorithm.overlong.buffer: 65 is above rollout.max_total_tokens (64), so every trajectory, even "
        "an empty one, would be penalised: set it to the last stretch of the budget (a quarter of it is usual)\n"
        "2 errors in spec.yaml")
    ok = ["algorithm.overlong.buffer=16", "algorithm.use_rollout_logprobs=false"]
    assert not compile_file(path, ok)[1].warnings  # on-policy, pi_old the learner's own: top-p is fine
    for sampler in (["train.max_staleness=1"], ["algorithm.rollout_correction={kind: tis}"]):
        assert "rollout.top_p 0.9 with " in _errors(path, [*ok, *sampler])
    assert "rollout.top_k 5 with train.max_staleness 1" in _errors(path, [*ok, "rollout.top_p=1", "rollout.top_k=5",
                                                                         "train.max_staleness=1"])
    warned = compile_file(path, [*ok, "algorithm.kl={coef: 0.01, estimator: k1}"])[1].warnings
    assert warned == ("<override 3>: algorithm.kl.estimator: warning: has no effect as a loss term: k1's gradient on "
                      "the policy's own samples is zero in expectation (that of log pi), so the term adds only noise: "
                      "use k2 (its gradient is the KL's) or k3 (GRPO's), or kl.apply: reward",)
    for fine in ("algorithm.kl={coef: 0.01, estimator: k1, apply: reward}", "algorithm.kl={coef: 0.01, estimator: k2}"):
        assert not compile_file(path, [*ok, fine])[1].warnings


def test_vllm_settings_that_engine_auto_made_moot_are_said_at_the_start(project):
    """`factory check` cannot know what `engine: auto` takes on the machine; the run's start does (the rollout
    stage's resolved engine), and says so of what the spec wrote for vLLM; `replay.on_miss` without a run."""
    from types import SimpleNamespace

    from factory.runtime.driver import auto_unused

    path = _spec(project, "st_auto", "rollout: {kv_cache_gb: 4, vllm_compile: true}\nreplay: {on_miss: live}\n")
    _, plan = compile_file(path)
    assert plan.warnings == ("spec.yaml:10: replay.on_miss: warning: has no effect without replay.run (no run's tool "
                             "calls are replayed)",)
    groups = {s.name: SimpleNamespace(stage=s) for s in plan.stages}
    took = {"rollout": {"engine": "hf", "engine_reason": "a short run"}, "update": {"device": "cpu"}}
    assert auto_unused(groups, took) == [
        f"rollout.{field}: has no effect: engine auto took transformers here (a short run); only vLLM reads it"
        for field in ("kv_cache_gb", "vllm_compile")]
    assert auto_unused(groups, {"rollout": {"engine": "vllm"}}) == []
    _, plan = compile_file(path, ["rollout.engine=hf"])  # said by check instead
    assert auto_unused({s.name: SimpleNamespace(stage=s) for s in plan.stages}, took) == []


def test_generator_settings_on_a_file_are_errors(project):
    project.file("rows.jsonl", '{"question": "1+1?", "answer": "2"}\n')
    base = BASE.replace("train: {generator: factory.data:arithmetic, size: 8}",
                        "train: {path: rows.jsonl, size: 8, args: {a: 1}}")
    path = _spec(project, "st_file", base=base)
    assert _errors(path) == (
        "spec.yaml:4: data.train.size: 'size' applies to a generator; every row of the file rows.jsonl is used\n"
        "spec.yaml:4: data.train.args: 'args' applies to a generator; every row of the file rows.jsonl is used\n"
        "2 errors in spec.yaml")
    # as their documentation says (`size` was "ignored for files": docs/reference/spec.md, the JSON Schema's hover
    # text, `factory plan --explain`)
    from factory.schema import DataSource

    assert DataSource.model_fields["size"].description.endswith("`size` with `path` is an error.")
    assert DataSource.model_fields["args"].description.endswith("(an error with `path`).")


@pytest.mark.parametrize("total, message", [
    ("total: {sum: {correct: {a: 1}, shaping: 0.2, attempted: 0.1}}",
     "rewards.total.sum.correct: expected a number, got a mapping"),
    ("total: {sum: {correct: [1, 2], shaping: 0.2, attempted: 0.1}}",
     "rewards.total.sum.correct: expected a number, got a list"),
    ("total: {nested: {sum: {correct: 1.0}}}", "rewards.total: expected one of the keys: fn, llm_judge, "),
    ("total: [correct, shaping]", "rewards.total: expected a mapping with one of the keys: fn, llm_judge, "),
])
def test_calculator_reward_node_replaced_by_a_mapping_or_list_is_located(tmp_path, monkeypatch, capsys, total,
                                                                        message):
    """A mapping or list in place of a weight, or of the whole training node, crashed the compiler with an
    AssertionError (exit 1); it is a located spec error (exit 2)."""
    text = (REPO / "specs/calculator.yaml").read_text()
    line = "total: {sum: {correct: 1.0, shaping: 0.2, attempted: 0.1}}"
    assert line in text
    spec = tmp_path / "calculator.yaml"
    spec.write_text(text.replace(line, total))
    lineno = text[: text.index(line)].count("\n") + 1
    monkeypatch.chdir(REPO)  # the spec's reward functions and prompts are the repository's
    assert cli.main(["check", str(spec)]) == 2
    err = capsys.readouterr().err
    assert f"{spec}:{lineno}: {message}" in err and "internal error" not in err


def test_monitor_settings_that_no_monitor_can_read_here_are_said(project):
    """A `train.monitors` setting is read only by its monitors (factory.monitors.READS): where each of them can
    never speak in the spec, setting it did nothing, in silence (`dominance` with a training node that is not a
    sum, `train_rise` without data.eval, any of them when the run ends before the first window is over)."""
    path = _spec(project, "st_mon", "metrics: {accuracy: correct}\ntrain: {steps: 10, monitors: {pass_at: 0.7, "
                                    "disagreement: 0.5, tool_call_ratio: 2, dominance: 0.5, length_ratio: 3, "
                                    "train_rise: 0.5}}\n")
    _, plan = compile_file(path, ["reward=correct"])
    said = [w.split(": warning: ") for w in plan.warnings]
    never = "has no effect: monitor {} can never speak here: {}"
    assert [(where.split(": ")[1], what) for where, what in said] == [
        ("train.monitors.dominance", never.format("reward_dominance", "the training reward 'correct' is not a `sum` "
                                                  "(the monitor weighs the shares of its inputs)")),
        ("train.monitors.tool_call_ratio", never.format("tool_call_rate", "the spec has no `tools`")),
        *[(f"train.monitors.{f}", never.format("judge_disagreement", "there is no judge node in `rewards` to check "
                                                                     "against the verifier"))
          for f in ("disagreement", "pass_at")],
        ("train.monitors.train_rise", never.format("train_eval_divergence",
                                                   "there is no held-out metric without data.eval")),
    ]  # (length_ratio: length_drift can speak)
    short = project.spec(BASE.replace("{mod}", "st_mon") + "metrics: {accuracy: correct}\ntrain: {steps: 2, "
                         "monitors: {length_ratio: 3, min_task_gain: 0.1}}\n", "short.yaml")
    _, plan = compile_file(short)
    assert [w.split(": ", 1)[1] for w in plan.warnings] == [  # (the window's reason said once, for its readers)
        "train.monitors.min_task_gain: warning: has no effect: the monitors that read it (reward_dominance, "
        "length_drift, tool_call_rate) can never speak here: train.steps 2 ends before step 3, the first a monitor "
        "speaks at (train.monitors.window + 1)",
        "train.monitors.length_ratio: warning: has no effect: monitor length_drift can never speak here: train.steps 2 "
        "ends before step 3, the first a monitor speaks at (train.monitors.window + 1)"]
    # a window the run is too short for is what silences the monitors: said as that, not as "no effect"
    assert compile_file(short, ["train.steps=4", "train.monitors.window=5"])[1].warnings[0].endswith(
        "train.monitors.window: warning: 5 leaves no monitor a step to speak at: train.steps 4 ends before step 6 "
        "(window + 1, the first they speak at): shorten it or run more steps")
    assert compile_file(path, ["train.monitors={}"])[1].warnings == ()

def _said(path: str, overrides: list[str]) -> dict[str, str]:
    """The compiled spec's warnings: setting -> what was said."""
    warnings = compile_file(path, overrides)[1].warnings
    return dict(w.split(": ", 1)[1].split(": warning: ") for w in warnings)


def test_settings_nothing_reads_in_this_spec_are_said(project, monkeypatch):
    """Accepted in silence before (a review of every field, 2026-12-06): each is read only where the spec has
    something it lacks here, or another setting decides instead."""
    path = _spec(project, "st_more", "metrics: {accuracy: correct, fmt: fmt}\ntrain: {steps: 4}\n")
    said = _said(path, ["rollout.eval_temperature=0.6", "tracking.record_tools=false", "resources.tools.num_cpus=64",
                        "resources.rollout.strategy=STRICT_SPREAD", "resources.rollout.replicas=2",
                        "train.share_prefix=true", "train.deepspeed.zero_stage=3", "resources.update.replicas=2",
                        "algorithm.clip=[0.1,0.1]", "algorithm.dual_clip_c=2"])
    assert said == {
        "rollout.eval_temperature": "has no effect without data.eval (there is nothing to evaluate)",
        "metrics.fmt": "has no effect without data.eval: a metric after the first is a held-out one only",
        "train.share_prefix": "has no effect with train.deepspeed.zero_stage 3 over 2 ranks (resources.update."
                              "replicas: their forwards must pair up): the update runs every row's prefix itself",
        "resources.tools": "has no effect without tools (there is no tools stage to place)",
        "tracking.record_tools": "has no effect without tools (there are no tool calls to record)",
        "resources.rollout.strategy": "has no effect while the stage reserves nothing (num_cpus, num_gpus and custom "
                                      "all 0): its replicas get no placement group to spread; reserve what a "
                                      "replica needs",
        **{f"algorithm.{f}": "has no effect while each step makes one on-policy update (algorithm.epochs 1, "
                             "mini_batches 1, no train.max_staleness): pi_old is the policy being updated, so every "
                             "ratio is 1 and nothing is clipped; clipping acts with more mini-batches or epochs, "
                             "staleness, algorithm.use_rollout_logprobs, or KL in the reward under dropout"
           for f in ("clip", "dual_clip_c")},
    }  # (resources.tools.num_cpus 64 was counted for a tools stage the plan does not have: "would wait at placement")
    assert "resources.tools" in _said(path, ["resources.tools.num_gpus=1"])  # (was an error: "1 GPU reserved but
    # this machine has no CUDA device", for a stage the plan does not have)
    for moot in (["algorithm.mini_batches=2"], ["algorithm.epochs=2"], ["train.max_staleness=1"],
                 ["algorithm.use_rollout_logprobs=true"],  # the ratio moves: clipping acts (with KL in the
                 ["algorithm.kl.coef=0.1", "algorithm.kl.apply=reward"]):  # reward, pi_old's own pass under dropout)
        assert not {k for k in _said(path, ["algorithm.clip=[0.1,0.1]", *moot]) if k.startswith("algorithm.clip")}
    assert "train.bf16_autocast" in _said(path, ["model.dtype=bfloat16", "train.bf16_autocast=false"])
    assert "train.bf16_autocast" not in _said(path, ["model.dtype=float16", "train.deepspeed.zero_stage=1",
                                                     "train.bf16_autocast=false"])  # (it
    # picks the rollout's `auto`: bfloat16 or float16/float32)
    assert _said(path, ["resources.update.strategy=SPREAD", "resources.update.num_cpus=1"])[
        "resources.update.strategy"] == "has no effect with one replica (resources.update.replicas 1): a strategy " \
                                        "spreads several"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # a cluster joined through the environment
    assert "resources.object_store_gb" in _said(path, ["resources.object_store_gb=4"])


def test_an_object_store_larger_than_this_machine_is_refused_unless_a_cluster_is_joined(project, monkeypatch):
    """`object_store_gb: 5000` passed check, then `factory run` died in ray.init as an internal error (Ray's
    "After taking into account object store and redis memory usage ...", no spec key). A cluster's nodes were
    sized when they started: there the setting is unused (a warning), whatever this machine has."""
    from factory import device

    monkeypatch.setattr(device, "system_memory", lambda: 8 * 2**30)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    path = _spec(project, "st_store", "resources: {object_store_gb: 5000}\n")
    assert _errors(path) == (
        "spec.yaml:9: resources.object_store_gb: 5000 GB is more than this machine's memory (8 GB), so a local "
        "Ray would not start: give less (Ray keeps the rest for its tasks and actors; 1 is usual), or join a Ray "
        "cluster that has it (resources.ray_address or $RAY_ADDRESS)\n1 error in spec.yaml")
    compile_file(path, ["resources.object_store_gb=7.5"])
    assert "resources.object_store_gb" in _said(path, ["resources.ray_address=10.0.0.1:6379"])
