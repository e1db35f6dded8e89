"""LoRA (model.lora): the spec, `factory check`'s target-module check, the adapter tensors a sync carries."""
from __future__ import annotations

import shutil

import pytest
import torch

from factory.assets import resolve_model
from factory.compiler.compile import compile_file
from factory.compiler.errors import SpecErrors
from factory.lora import Adapters, merged, short_names, target_problem, targeted
from tests.test_compiler_support import base_spec

LAYERS = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.mlp.up_proj",
          "model.layers.1.self_attn.q_proj"]


def test_target_problem_matches_names_as_peft_does():
    assert target_problem(["q_proj", "up_proj"], LAYERS) is None
    assert target_problem(["self_attn.k_proj"], LAYERS) is None  # a path suffix
    assert target_problem("all-linear", LAYERS) is None
    assert target_problem(["q_prj", "o_proj"], LAYERS) == (
        "'q_prj' (did you mean 'q_proj'?), 'o_proj' (did you mean 'q_proj'?) match no linear layer of the model; "
        "its linear layers: q_proj, k_proj, up_proj")
    assert "matches no linear layer" in target_problem(["proj"], LAYERS)  # whole names only
    # the head is a linear layer, not one adapted: "matches no linear layer" read as a wrong name
    assert target_problem(["lm_head"], LAYERS).startswith(
        "'lm_head' (the output head, which Factory does not adapt: vLLM's LoRA layers do not take it) matches no")
    assert short_names(LAYERS) == ["q_proj", "k_proj", "up_proj"]
    # what peft would refuse, or match nothing with, once every stage has started: said by the check
    assert target_problem([], LAYERS).startswith(
        "no module named: give at least one (the model's linear layers: q_proj")
    assert target_problem("q_proj", LAYERS) == "'q_proj': give a list of module names or 'all-linear'"


def test_targeted_is_the_modules_peft_adapts():
    assert targeted("all-linear", LAYERS) == frozenset(LAYERS)
    assert targeted(["q_proj", "k_proj", "up_proj"], LAYERS) == frozenset(LAYERS)  # every name: all-linear's
    assert targeted(["q_proj"], LAYERS) == {LAYERS[0], LAYERS[3]}
    assert targeted(["proj", "layers.0.self_attn.k_proj"], LAYERS) == {LAYERS[1]}  # whole names, or a path's end


def test_the_linear_layers_are_every_adapted_layer_but_the_output_head():
    """What `all-linear` adapts and the check matches names against, read on the meta device: never the head
    (vLLM's LoRA layers do not take it; listed, `target_modules: [lm_head]` passed the check and failed the run)."""
    from factory.lora import linear_layers

    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj"]
    want = [f"model.layers.{i}.{n}" for i in (0, 1) for n in names]
    assert linear_layers(resolve_model("factory:tiny-qwen3")) == want


def test_the_spec_gives_peft_its_rank_alpha_dropout_and_targets():
    """alpha / r is the adapters' scale in the learner (peft's lora_alpha) and in what a sync carries (`scale`);
    unset, alpha is 2 r."""
    from factory.lora import peft_config, scale
    from factory.schema import LoraSpec

    spec = LoraSpec(r=8, alpha=4, dropout=0.1, target_modules=["q_proj", "v_proj"])
    c = peft_config(spec)
    assert (c.r, c.lora_alpha, c.lora_dropout, c.target_modules) == (8, 4.0, 0.1, {"q_proj", "v_proj"})
    assert scale(spec) == 0.5 and scale(LoraSpec(r=8)) == 2.0 and peft_config(LoraSpec(r=8)).lora_alpha == 16.0
    assert peft_config(LoraSpec(r=8)).target_modules == "all-linear"


def _tiny_spec(project, extra: str) -> str:
    folder = resolve_model("factory:tiny-qwen3")  # on disk: its config is what the check reads
    return project.spec(base_spec(project, "lora_rc").replace('"factory:tiny-qwen3"', f'"{folder}"') + extra)


def test_check_locates_a_target_module_the_model_lacks(project):
    with pytest.raises(SpecErrors) as e:
        compile_file(_tiny_spec(project, ""), ["model.lora.target_modules=[q_proj,qkv_proj]"])
    assert ("model.lora.target_modules: 'qkv_proj' (did you mean 'k_proj'?) matches no linear layer of the model; "
            "its linear layers: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj") in e.value.report()
    spec, plan = compile_file(_tiny_spec(project, ""), ["model.lora.r=8"])  # `model.lora.r=N` alone turns it on
    assert spec.model.lora.r == 8 and spec.model.lora.target_modules == "all-linear"
    assert plan.spec["model"]["lora"] == {"alpha": None, "dropout": 0.0, "r": 8, "target_modules": "all-linear"}


def test_check_of_target_modules_says_a_model_it_cannot_build_at_its_path(project):
    """Checking the target names builds the model on the meta device: a mistyped built-in model was built anyway
    (resolve_model's ValueError), and a config.json transformers does not know raised from the build; both were an
    internal error (exit 1) where the model's path is the spec's mistake."""
    spec = base_spec(project, "lora_bad").replace('"factory:tiny-qwen3"', '"factory:tiny-qwen"')
    with pytest.raises(SpecErrors) as e:
        compile_file(project.spec(spec), ["model.lora.target_modules=[q_proj]"])
    assert "model.path: unknown built-in model 'factory:tiny-qwen'" in e.value.report()
    assert "did you mean 'factory:tiny-qwen3'" in e.value.report()
    project.file("models/mine/config.json", '{"model_type": "no_such_architecture", "hidden_size": 64}')
    project.file("models/mine/model.safetensors")
    spec = base_spec(project, "lora_bad").replace('"factory:tiny-qwen3"', "models/mine")
    with pytest.raises(SpecErrors) as e:
        compile_file(project.spec(spec), ["model.lora.target_modules=[q_proj]"])
    assert e.value.report().startswith(
        "spec.yaml:2: model.path: transformers cannot build this model (ValueError: The checkpoint you are trying "
        "to load has model type `no_such_architecture`")


def test_check_warns_of_a_rank_above_the_hidden_size(project, capsys):
    """r 128 on tiny-qwen3 (hidden size 64) checked ok in silence: adapters larger than the weights they adapt,
    with no rank to learn that r 64 lacks."""
    from factory.commands import cli

    path = _tiny_spec(project, "")
    assert cli.main(["check", path, "model.lora.r=128"]) == 0
    assert capsys.readouterr().err.splitlines()[0] == (
        "<override 1>: model.lora.r: warning: 128 is above the model's hidden size 64, which bounds the rank of every "
        "adapted layer's update: the rank beyond it adds parameters (the adapters then outnumber the weights they "
        "adapt) and nothing they can learn; use r <= 64")
    assert cli.main(["check", path, "model.lora.r=64"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_rollout_gpus_must_divide_the_attention_heads(project):
    # tiny-qwen3 has 4 attention heads; 3 GPUs per replica cannot split them (the line is the spec's)
    path = _tiny_spec(project, "resources:\n  rollout: {num_gpus: 3}\n")
    with pytest.raises(SpecErrors) as e:
        compile_file(path)
    assert ("spec.yaml:10: resources.rollout.num_gpus: vLLM splits the model over the rollout replica's 3 GPUs "
            "(tensor_parallel_size), and 3 does not divide its 4 attention heads: give one of 1, 2, 4"
            ) in e.value.report()
    with pytest.raises(SpecErrors) as e:
        compile_file(_tiny_spec(project, "resources:\n  rollout: {num_gpus: 1.5}\n"))
    assert "resources.rollout.num_gpus: 1.5 GPUs: more than one GPU per rollout replica" in e.value.report()
    with pytest.raises(SpecErrors) as e:  # 2 divides 4: only the missing CUDA devices are wrong here
        compile_file(_tiny_spec(project, "resources:\n  rollout: {num_gpus: 2}\n"))
    assert "tensor_parallel_size" not in e.value.report()


def test_tensor_parallel_sizes_are_those_vllm_splits_every_layer_over():
    """vLLM divides the attention heads, the KV heads (or, when there are fewer than GPUs, holds each on a whole
    number of them) and the MLP's width over tensor_parallel_size GPUs (QKVParallelLinear, the MLP's column- and
    row-parallel layers). Llama-3.2-3B: 24 heads, 8 KV heads, width 8192; 3, 6 and 12 divide the heads but not
    the KV heads (vLLM: "8 is not divisible by 3"), and 24 does not divide the width."""
    from factory.rollout.engine import tensor_parallel_misfit, tensor_parallel_sizes

    llama = {"num_attention_heads": 24, "num_key_value_heads": 8, "intermediate_size": 8192}
    assert tensor_parallel_sizes(llama) == [1, 2, 4, 8]
    assert tensor_parallel_misfit(llama, 3) == "3 does not divide its 8 KV heads"
    assert tensor_parallel_misfit(llama, 12) == "12 is not a multiple of its 8 KV heads"
    assert tensor_parallel_misfit(llama, 5) == "5 does not divide its 24 attention heads"
    assert tensor_parallel_misfit(llama, 24) == "24 does not divide its MLP width 8192"
    # 2 KV heads: 4 GPUs hold each on two of them
    assert tensor_parallel_sizes({"num_attention_heads": 16, "num_key_value_heads": 2}) == [1, 2, 4, 8, 16]
    # no num_key_value_heads: one KV head per attention head (transformers' default)
    assert tensor_parallel_sizes({"num_attention_heads": 12, "intermediate_size": 3072}) == [1, 2, 3, 4, 6, 12]
    assert tensor_parallel_sizes({"hidden_size": 64}) is None  # heads not named: nothing to say
    # a mixture of experts: vLLM's FusedMoE splits each expert's width as well as the dense MLP's
    moe = {"num_attention_heads": 32, "num_key_value_heads": 4, "intermediate_size": 6144, "moe_intermediate_size": 20}
    assert tensor_parallel_sizes(moe) == [1, 2, 4]
    assert tensor_parallel_misfit(moe, 8) == "8 does not divide its experts' MLP width 20"
    # Falcon names its KV heads num_kv_heads (new decoder architecture)
    falcon = {"model_type": "falcon", "num_attention_heads": 96, "num_kv_heads": 8, "new_decoder_architecture": True}
    assert tensor_parallel_misfit(falcon, 12) == "12 is not a multiple of its 8 KV heads"
    assert tensor_parallel_sizes(falcon) == [1, 2, 4, 8, 16, 24, 32, 48, 96]
    assert tensor_parallel_misfit({"hidden_size": 64}, 3) is None


def test_rollout_gpus_must_split_the_kv_heads_too(project):
    """Llama-3.2-3B's head layout (24 heads, 8 KV heads): 3 GPUs divide the heads, so the check took them, and
    suggested 3, 6 and 12 for 5 GPUs; vLLM refused each as it built the model, once every stage had started."""
    import json
    from pathlib import Path

    config = json.loads((Path(resolve_model("factory:tiny-qwen3")) / "config.json").read_text())
    config.update(num_attention_heads=24, num_key_value_heads=8)  # its MLP width: 128
    project.file("models/llama-heads/config.json", json.dumps(config))
    project.file("models/llama-heads/model.safetensors")
    spec = base_spec(project, "tp_kv").replace('"factory:tiny-qwen3"', '"models/llama-heads"')
    for k, why in ((3, "3 does not divide its 8 KV heads"), (5, "5 does not divide its 24 attention heads")):
        with pytest.raises(SpecErrors) as e:
            compile_file(project.spec(spec + f"resources:\n  rollout: {{num_gpus: {k}}}\n"))
        assert (f"resources.rollout.num_gpus: vLLM splits the model over the rollout replica's {k} GPUs "
                f"(tensor_parallel_size), and {why}: give one of 1, 2, 4, 8") in e.value.report()


def test_merged_adds_the_scaled_product_to_the_base_weight():
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # [out=2, in=2]
    a = torch.tensor([[1.0, 0.0]])  # [r=1, in]
    b = torch.tensor([[0.5], [-1.0]])  # [out, r]
    ad = Adapters({"base_model.model.m.q.lora_A.weight": a, "base_model.model.m.q.lora_B.weight": b}, scale=2.0)
    # B @ A = [[0.5, 0], [-1, 0]]; x2 = [[1, 0], [-2, 0]]
    out = merged({"m.q.weight": w}, ad)
    assert torch.equal(out["m.q.weight"], torch.tensor([[2.0, 2.0], [1.0, 4.0]]))
    assert ad.nbytes() == 4 * (2 + 2)
    assert merged({"m.q.weight": w}, ad, torch.bfloat16)["m.q.weight"].dtype == torch.bfloat16
    # a bf16 model: computed in float32 and cast once, W's dtype kept. W = -1, B @ A = 1 + 2^-8: in bf16 the
    # product rounds to 1 (8 significant bits) and the merged weight to 0, where it is 2^-8
    w16 = torch.tensor([[-1.0]], dtype=torch.bfloat16)
    a16, b16 = torch.tensor([[1.0], [1.0]], dtype=torch.bfloat16), torch.tensor([[1.0, 2 ** -8]], dtype=torch.bfloat16)
    low = Adapters({"base_model.model.m.lora_A.weight": a16, "base_model.model.m.lora_B.weight": b16}, scale=1.0)
    out16 = merged({"m.weight": w16}, low)["m.weight"]
    assert out16.dtype == torch.bfloat16 and out16.item() == 2 ** -8


def test_diff_shows_lora_settings_and_still_compares_the_runs():
    """`factory diff` of a full-weight run and a LoRA run of the same model: the LoRA settings are setting
    changes, and the model is not called different (LoRA is a way of training it)."""
    from factory.commands.diff import comparability, plan_changes

    a = {"spec": {"model": {"path": "m", "lora": None}, "train": {"lr": 1e-5}}}
    b = {"spec": {"model": {"path": "m", "lora": {"r": 16, "alpha": None, "dropout": 0.0,
                                                  "target_modules": "all-linear"}}, "train": {"lr": 1e-4}}}
    changes = plan_changes(a, b)
    keys = {c["key"]: (c["a"], c["b"]) for c in changes}
    assert keys["model.lora.r"] == (None, "16") and keys["model.lora.target_modules"] == (None, "all-linear")
    assert comparability(changes) == []
    assert comparability(plan_changes(a, {"spec": {"model": {"path": "other", "lora": None}}})) != []


def test_how_vllm_takes_adapters_by_device_and_the_rank_it_sizes_for(project):
    """vLLM serves adapters of rank at most 512 (its max_lora_rank): `auto` on CUDA picked serve for r 1024, and
    the rollout failed to start after Ray had; auto now merges them, saying why, and an explicit serve is refused."""
    from factory.rollout.engine import vllm_lora_mode
    from factory.rollout.engine_vllm import _lora_rank

    assert vllm_lora_mode("auto", "cpu", 16) == ("merge", None)
    assert vllm_lora_mode("auto", "cuda", 16) == ("serve", None)
    assert vllm_lora_mode("serve", "cpu", 16) == ("serve", None)
    assert vllm_lora_mode("merge", "cuda", 16) == ("merge", None)
    assert vllm_lora_mode("auto", "cuda", 512) == ("serve", None)
    assert vllm_lora_mode("auto", "cuda", 1024) == ("merge", "rank 1024: vLLM serves adapters of rank at most 512")
    assert [_lora_rank(r) for r in (1, 8, 9, 16, 33, 512)] == [8, 8, 16, 16, 64, 512]
    with pytest.raises(SpecErrors) as e:
        compile_file(_tiny_spec(project, ""), ["model.lora.r=1024", "rollout.vllm_lora=serve"])
    assert ("rollout.vllm_lora: vLLM serves adapters of rank at most 512, and model.lora.r is 1024: use merge (or "
            "auto, which merges them), or a rank of at most 512") in e.value.report()
    compile_file(_tiny_spec(project, ""), ["model.lora.r=1024"])  # auto: merged


def test_eval_takes_a_peft_adapter_folder_merged_into_its_base(tmp_path):
    """`factory eval --model DIR` with the folder `export --adapter` writes (or a checkpoint's adapter/) said
    "holds no complete checkpoint (no `latest` marker)"."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from factory.commands.api import _eval_model

    base = resolve_model("factory:tiny-qwen3")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=2, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path / "adapter")
    AutoTokenizer.from_pretrained(base).save_pretrained(tmp_path / "adapter")
    (tmp_path / "scratch").mkdir()
    folder, step, tags, adapters = _eval_model(tmp_path / "adapter", None, tmp_path / "scratch")
    assert (step, tags["factory.eval_model"], adapters) == (0, str((tmp_path / "adapter").resolve()), None)
    assert AutoModelForCausalLM.from_pretrained(folder).config.num_hidden_layers == model.config.num_hidden_layers


def test_an_eval_of_adapters_names_them_as_its_model_not_the_merged_copy_it_removes(project, tmp_path):
    """The eval run's `model.path` param was the merged model's temporary folder, gone once evaluated."""
    import yaml

    from factory.commands.api import tracked_model

    _, plan = compile_file(_tiny_spec(project, ""))
    shown = tracked_model(plan, "/runs/x/step_3")
    assert shown.spec["model"]["path"] == yaml.safe_load(shown.spec_yaml)["model"]["path"] == "/runs/x/step_3"
    assert shown.stages == plan.stages and shown.spec["rollout"] == plan.spec["rollout"]
    # hashed as shown: every eval of the same adapters has one spec hash, whatever scratch folder it loaded
    (tmp_path / "scratch").symlink_to(resolve_model("factory:tiny-qwen3"))  # another scratch folder, same model
    _, again = compile_file(_tiny_spec(project, ""), [f"model.path={tmp_path / 'scratch'}"])
    assert shown.hashes == tracked_model(again, "/runs/x/step_3").hashes != plan.hashes
    # and as a run's spec is hashed: where it ran (resources.ray_address) is not what it is
    _, joined = compile_file(_tiny_spec(project, ""), ["resources.ray_address=10.0.0.1:6379"])
    assert tracked_model(joined, "/runs/x/step_3").hashes == shown.hashes


def _adapter_folder(folder, base: str, r: int = 2, targets=("q_proj",)):
    """A peft adapter folder for `base`, as a LoRA run's checkpoint holds one, with B not 0 (peft starts B at
    0: adapters that change nothing would let a test pass that never added them)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    return model


def test_eval_adds_the_adapters_the_specs_lora_fits_beside_its_model_and_merges_others(tmp_path, capsys):
    """`factory eval --model` of LoRA adapters merged them into a full model (GBs for a large one), which a
    bf16 rollout rounds otherwise than the run's own evaluation did (adapters beside the base): adapters the
    spec's model.lora fits are now added beside the spec's model, as the run's weight syncs added them."""
    from factory.commands.api import _eval_model
    from factory.schema import Spec

    base = resolve_model("factory:tiny-qwen3")
    _adapter_folder(tmp_path / "adapter", base)
    (tmp_path / "scratch").mkdir()

    def spec(lora):
        return Spec.model_validate({"name": "t", "model": {"path": base, "lora": lora},
                                    "data": {"train": {"generator": "factory.data:arithmetic"}},
                                    "rewards": {"r": {"fn": "factory.rewards.math:numeric_match"}}})

    fits = spec({"r": 2, "target_modules": ["q_proj"]})
    assert _eval_model(tmp_path / "adapter", None, tmp_path / "scratch", fits) == (
        None, 0, {"factory.eval_model": str((tmp_path / "adapter").resolve())}, str((tmp_path / "adapter").resolve()))
    assert not any((tmp_path / "scratch").iterdir()) and "note:" not in capsys.readouterr().err  # nothing merged
    for lora, why in [({"r": 4, "target_modules": ["q_proj"]}, "rank 2 and alpha 4, where the spec's model.lora has "
                                                               "4 and 8"),
                      ({"r": 2, "alpha": 2, "target_modules": ["q_proj"]}, "where the spec's model.lora has 2 and 2"),
                      ({"r": 2}, "they adapt other modules than the spec's model.lora.target_modules"),
                      # (docs/lora.md says a note says why: without model.lora none was printed)
                      (None, "note: " + str(tmp_path / "adapter") + ": evaluated merged into its base model (the "
                             "spec has no model.lora to add them with)")]:
        folder, _, _, adapters = _eval_model(tmp_path / "adapter", None, tmp_path / "scratch", spec(lora))
        assert adapters is None and folder == str(tmp_path / "scratch" / "model"), lora
        assert why in capsys.readouterr().err, lora
        shutil.rmtree(folder)
    other = resolve_model("factory:tiny-qwen3-calc")  # another model whose shapes fit: its adapters' base is here
    assert _eval_model(tmp_path / "adapter", None, tmp_path / "scratch", spec({"r": 2, "target_modules": ["q_proj"]})
                       .model_copy(update={"model": fits.model.model_copy(update={"path": other})}))[3] is None
    assert "is not the spec's model" in capsys.readouterr().err


def test_adapters_read_from_a_checkpoint_compute_as_the_peft_model_does(tmp_path, monkeypatch):
    """What `factory eval` adds to the rollout engine (RolloutStage.load_adapters): the folder's adapters, in the
    engine's dtype, at the spec's scale: the engine's model then computes peft's own model's logits. They are read
    and cast on a thread that ends with the read, not the actor's own (a second OpenMP team that lived on would
    slow the engine's generation: docs/performance.md, "One thread for torch")."""
    import threading
    from types import SimpleNamespace

    import factory.lora
    from factory.rollout.engine_hf import HFEngine
    from factory.rollout.stage import RolloutStage
    from factory.schema import LoraSpec

    base = resolve_model("factory:tiny-qwen3")
    peft_model = _adapter_folder(tmp_path / "adapter", base).eval()
    lora = LoraSpec(r=2, target_modules=["q_proj"])
    stage = RolloutStage(SimpleNamespace(model=SimpleNamespace(lora=lora)))  # load_adapters reads model.lora only
    stage.engine = HFEngine(base, lora=lora)
    readers, read = [], factory.lora.read_adapters
    monkeypatch.setattr(factory.lora, "read_adapters", lambda *a, **k: readers.append(threading.current_thread())
                        or read(*a, **k))
    ids = torch.tensor([list(range(5, 25))])
    with torch.no_grad():
        want, before = peft_model(ids).logits, stage.engine.model(ids).logits
        stage.load_adapters(str(tmp_path / "adapter"))
        got = stage.engine.model(ids).logits
    assert torch.allclose(got, want, atol=1e-5) and not torch.allclose(before, want, atol=1e-2)
    assert len(readers) == 1 and readers[0] is not threading.current_thread() and not readers[0].is_alive()


def _tiny_gpt2(folder):
    """A one-layer GPT-2 (transformers' Conv1D layers: each weight stored [in, out], the transpose of a Linear's)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=512, n_positions=64, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def test_the_merge_of_a_conv1d_models_adapters_is_peft_s(tmp_path):
    """vLLM's merge (rollout.vllm_lora: merge) of GPT-2's adapters added B @ A [out, in] to weights stored [in, out]:
    the square attn.c_proj took the transposed update (the rollout sampled another policy than the learner trained),
    c_attn [64, 192] failed the first sync with a shape error. peft sets fan_in_fan_out for Conv1D and merges
    (B @ A)^T; so does the merge now. The check lists Conv1D layers as linear ones (it listed none for GPT-2)."""
    from peft import get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from factory.lora import linear_layers, peft_config, scale
    from factory.rollout.engine_vllm import VLLMEngine
    from factory.schema import LoraSpec

    folder = _tiny_gpt2(tmp_path / "tiny-gpt2")
    assert linear_layers(folder) == ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj",
                                     "transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"]
    spec = LoraSpec(r=2)  # all-linear
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), peft_config(spec))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.5)
    # as the learner sends them (Learner.adapters): the tensors and peft's config, which says fan_in_fan_out
    config = model.peft_config["default"].to_dict()
    assert config["fan_in_fan_out"]
    adapters = Adapters(dict(get_peft_model_state_dict(model)), scale(spec), config=config)
    engine = object.__new__(VLLMEngine)  # the fields _merge reads: no vLLM started
    engine.model_path, engine.dtype, engine._base = str(folder), "float32", {}
    weights = engine._merge(adapters)
    want = model.merge_and_unload().state_dict()  # peft's merge, as the weights are stored
    for layer in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
        key = f"transformer.h.0.{layer}.weight"
        torch.testing.assert_close(weights[key], want[key], msg=key)


def test_adapters_with_peft_options_a_run_never_sets_do_not_fit(tmp_path):
    """`factory eval --model` took an adapter trained with `lora_bias=True` (or fan_in_fan_out on a Linear model,
    use_qalora, layer_replication, ...) as fitting the spec's model.lora, and vLLM's merge then read its lora_B.bias
    as B (or dropped it): another model evaluated. Such adapters are now merged by peft instead, and a merge of
    tensors other than lora_A / lora_B weights is refused. A GPT-2 adapter that Factory trains (fan_in_fan_out, which
    peft sets for Conv1D layers) still fits."""
    import json

    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from factory.lora import adapter_misfit, peft_config
    from factory.schema import LoraSpec

    base = resolve_model("factory:tiny-qwen3")
    spec = LoraSpec(r=2, target_modules=["q_proj"])
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], lora_bias=True))
    model.save_pretrained(tmp_path / "biased")
    assert adapter_misfit(tmp_path / "biased", spec, base) == "peft options a run's rollout never sets (lora_bias)"
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.lora_B\.bias: a tensor other than"):
        Adapters(dict(get_peft_model_state_dict(model)), 2.0).pairs()  # (what vLLM's merge reads: B, or the bias?)

    _adapter_folder(tmp_path / "plain", base)
    assert adapter_misfit(tmp_path / "plain", spec, base) is None
    config = json.loads((tmp_path / "plain" / "adapter_config.json").read_text())
    for option, value in [("fan_in_fan_out", True), ("use_qalora", True), ("layer_replication", [[0, 2]]),
                          ("target_parameters", ["mlp.experts.gate_up_proj"]), ("alora_invocation_tokens", [5]),
                          ("init_lora_weights", "pissa"), ("modules_to_save", ["lm_head"]), ("bias", "all")]:
        (tmp_path / "plain" / "adapter_config.json").write_text(json.dumps({**config, option: value}))
        assert adapter_misfit(tmp_path / "plain", spec, base) == f"peft options a run's rollout never sets ({option})"
    for harmless in [("init_lora_weights", "gaussian"), ("inference_mode", True), ("lora_dropout", 0.1),
                     ("peft_version", "0.99.0")]:
        (tmp_path / "plain" / "adapter_config.json").write_text(json.dumps({**config, harmless[0]: harmless[1]}))
        assert adapter_misfit(tmp_path / "plain", spec, base) is None, harmless

    gpt2 = _tiny_gpt2(tmp_path / "tiny-gpt2")
    trained = get_peft_model(AutoModelForCausalLM.from_pretrained(gpt2), peft_config(LoraSpec(r=2)))  # as the learner
    trained.save_pretrained(tmp_path / "gpt2-adapter")
    assert adapter_misfit(tmp_path / "gpt2-adapter", LoraSpec(r=2), gpt2) is None


def test_the_merge_reads_the_base_weights_of_a_model_saved_as_pytorch_model_bin(tmp_path):
    """A model folder with pytorch_model.bin (which the compiler takes, and vLLM and the learner load): vLLM's merge
    read W0 from *.safetensors only, and the run's first sync failed with a bare KeyError."""
    from transformers import AutoModelForCausalLM

    from factory.compiler.refs import model_problem
    from factory.rollout.engine_vllm import VLLMEngine

    model = AutoModelForCausalLM.from_pretrained(resolve_model("factory:tiny-qwen3"), dtype=torch.float32)
    folder = tmp_path / "bin-model"
    model.save_pretrained(folder)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    torch.save({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
               folder / "pytorch_model.bin")
    assert model_problem(str(folder)) == (None, None)
    w = model.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    a, b = torch.ones(2, w.shape[1]), torch.ones(w.shape[0], 2)
    adapters = Adapters({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a,
                         "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": b}, scale=2.0)
    engine = object.__new__(VLLMEngine)  # the fields _merge reads: no vLLM started
    engine.model_path, engine.dtype, engine._base = str(folder), "float32", {}
    weights = engine._merge(adapters)
    torch.testing.assert_close(weights["model.layers.0.self_attn.q_proj.weight"], w + 2.0 * b @ a)
    # the fused qkv layer is reloaded whole: k and v, unadapted, go as loaded
    torch.testing.assert_close(weights["model.layers.0.self_attn.k_proj.weight"],
                               model.state_dict()["model.layers.0.self_attn.k_proj.weight"])
