"""LoRA in the learner (model.lora): only the adapters train, at every ZeRO stage; the KL reference is the
base model (adapters off); a sync carries the adapters alone; checkpoints hold the adapters and their
optimizer state, resume exactly, and `factory export` merges them (or, with --adapter, copies them)."""
from __future__ import annotations

import pytest
import torch

from factory.commands import cli
from factory.lora import Adapters
from tests.test_update import (  # noqa: F401  (fixtures)
    batch,
    learners,
    make_spec,
    model_path,
)

LORA = {"r": 4, "target_modules": ["q_proj", "v_proj", "up_proj"]}


def _spec(small_path, model_path, stage=0, **train):
    return make_spec(small_path, model={"path": small_path, "tokenizer": model_path, "lora": LORA},
                     train={"lr": 1e-2, "optimizer": {"name": "adamw"}, "deepspeed": {"zero_stage": stage}, **train})


def _frozen(learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.engine.module.named_parameters() if not v.requires_grad}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_only_the_adapters_train_at_every_zero_stage(small_path, model_path, learners, stage):  # noqa: F811
    learner = learners(_spec(small_path, model_path, stage))
    module = learner.engine.module
    trained = {k for k, p in module.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in k or ".lora_B." in k for k in trained)
    assert len(trained) == 2 * 3 * 2  # A and B of 3 modules in each of 2 layers
    before, frozen = learner.adapters(), learner.weights()
    learner.step(batch(seed=1))
    first = learner.adapters()
    # B starts at 0, so A's gradient is 0 at the first step: only the Bs move; then the As too
    moved = {k for k in before.tensors if not torch.equal(before.tensors[k], first.tensors[k])}
    assert moved == {k for k in before.tensors if ".lora_B." in k}
    learner.step(batch(seed=2))
    after, still = learner.adapters(), learner.weights()
    assert all(torch.equal(still[k], v) for k, v in frozen.items() if "lora_" not in k)  # base untouched
    assert all(not torch.equal(first.tensors[k], after.tensors[k]) for k in before.tensors if ".lora_A." in k)
    sync = learner.state_dict()
    assert isinstance(sync, Adapters) and set(sync.tensors) == set(after.tensors) and sync.scale == 2.0
    assert sync.nbytes() < 0.05 * sum(v.numel() * v.element_size() for v in still.values())


def test_the_kl_reference_is_the_base_model_with_the_adapters_off(small_path, model_path, learners):  # noqa: F811
    spec = _spec(small_path, model_path)
    learner = learners(make_spec(small_path, model={"path": small_path, "tokenizer": model_path, "lora": LORA},
                                 algorithm={"name": "grpo", "kl": {"coef": 0.1}},
                                 train={"lr": 1e-2, "optimizer": {"name": "adamw"}}))
    assert learner.ref is not None and not isinstance(learner.ref, torch.nn.Module)  # no second model
    trajs = batch(seed=2)
    base_lp = learner.logprobs(trajs)
    stats = learner.step(trajs)
    assert stats["actor/kl"] == 0.0  # B starts at 0: policy == reference before the first update
    policy_lp, ref_lp, _ = learner._logprobs_before_update(trajs, [[list(range(len(trajs)))]])
    assert not torch.allclose(policy_lp, base_lp)  # the adapters moved the policy...
    torch.testing.assert_close(ref_lp, base_lp, atol=0, rtol=0)  # ...and the reference is still the base
    assert learner.step(trajs)["actor/kl"] > 0
    del spec


@pytest.mark.parametrize("stage", [0, 3])
def test_checkpoint_holds_adapters_and_optimizer_resumes_and_exports(small_path, model_path, learners, tmp_path,  # noqa: F811
                                                                     stage):
    spec = _spec(small_path, model_path, stage)
    learner = learners(spec)
    trajs = batch(seed=3)
    learner.step(trajs)
    learner.save_checkpoint(str(tmp_path), 1)
    assert (tmp_path / "step_1" / "adapter" / "adapter_config.json").is_file()
    assert not (tmp_path / "step_1" / "hf").exists()
    (model_states,) = (tmp_path / "step_1").glob("*mp_rank_00_model_states.pt")  # DeepSpeed's name per stage
    states = torch.load(model_states, weights_only=False)
    # the adapters, no frozen weights: not the tied head either (DeepSpeed drops frozen weights by their name
    # in named_parameters(), which names a tied lm_head.weight once, as the embeddings: it stayed, 113 MB
    # of a SmolLM2 checkpoint's 165)
    saved = {k for k in states.get("module") or {} if "lora_" not in k}
    assert saved == set(), saved
    assert "module_state_dict" not in vars(learner.engine)  # the class's method again
    learner.step(trajs)
    want = learner.adapters()

    resumed = learners(spec)
    assert resumed.load_checkpoint(str(tmp_path)) == 1
    resumed.step(trajs)  # the same second step: the optimizer state came back too
    got = resumed.adapters()
    for k, v in want.tensors.items():
        torch.testing.assert_close(got.tensors[k], v, atol=0, rtol=0)

    # export: merged weights (the policy as one plain model) by default, the adapter folder with --adapter
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    resumed.save_checkpoint(str(tmp_path), 2)
    ids = torch.tensor([[5, 17, 300, 42, 7]])
    with torch.no_grad():
        policy = resumed.engine.module(input_ids=ids).logits
    merged_dir, adapter_dir = tmp_path.parent / f"merged-{stage}", tmp_path.parent / f"adapter-{stage}"
    assert cli.main(["export", str(tmp_path), "--out", str(merged_dir)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert not any("lora" in k for k in merged.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, policy, atol=1e-5, rtol=1e-5)
    assert cli.main(["export", str(tmp_path), "--adapter", "--out", str(adapter_dir)]) == 0
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(small_path), adapter_dir)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, policy, atol=1e-5, rtol=1e-5)


def test_a_checkpoint_names_its_base_model_wherever_it_is_exported_from(small_path, model_path, learners,  # noqa: F811
                                                                        tmp_path, monkeypatch):
    """A run from a project whose model.path is relative (`models/base`, which the compiler keeps as written): peft
    wrote that path into the checkpoint's adapter/adapter_config.json, and `factory export` (or `factory eval
    --model`) from any other directory could not find the base model. The learner names it by its absolute path."""
    import json
    import shutil

    project = tmp_path / "project"
    shutil.copytree(small_path, project / "models" / "base")
    monkeypatch.chdir(project)
    learner = learners(make_spec("models/base", model={"path": "models/base", "tokenizer": model_path, "lora": LORA},
                                 train={"lr": 1e-2, "optimizer": {"name": "adamw"}}))
    learner.step(batch(seed=1))
    learner.save_checkpoint(str(project / "runs"), 1)
    named = json.loads((project / "runs" / "step_1" / "adapter" / "adapter_config.json").read_text())
    assert named["base_model_name_or_path"] == str(project / "models" / "base")
    monkeypatch.chdir(tmp_path)  # later, elsewhere
    assert cli.main(["export", str(project / "runs"), "--out", str(tmp_path / "merged")]) == 0


def test_export_adapter_of_a_full_weight_run_is_refused(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    assert cli.main(["export", str(tmp_path), "--adapter", "--out", str(tmp_path / "o")]) == 2
    assert "holds full weights (the run trained no LoRA adapters)" in capsys.readouterr().err


def test_export_adapter_names_the_base_model_to_load(tmp_path, capsys):
    """The usage line said `from_pretrained(BASE)`: the base model is the folder the adapter's config names."""
    import json

    adapter = tmp_path / "step_1" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/models/tiny-qwen3-v2"}))
    (adapter / "tokenizer_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    out = tmp_path / "o"
    assert cli.main(["export", str(tmp_path / "step_1"), "--adapter", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert (f"  peft: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained('/models/tiny-qwen3-v2'), "
            f"{str(out)!r})") in said
    # not a folder here (the training machine's model cache): said so, with what to give in its place
    assert ("  (/models/tiny-qwen3-v2 is where the run's learner found its base model, not a folder here: give the "
            "same model's folder or hub id in its place)") in said
    base = tmp_path / "base"
    base.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base)}))
    assert cli.main(["export", str(tmp_path / "step_1"), "--adapter", "--out", str(tmp_path / "o2")]) == 0
    assert "not a folder here" not in capsys.readouterr().out
