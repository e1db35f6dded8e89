"""A LoRA run end to end (specs/tiny.yaml with model.lora): Ray, the rollout engine, DeepSpeed, MLflow. Its
params say what the sync carried; `factory export` merges the adapters into a plain Hugging Face folder
whose greedy generation is the run's last evaluation, token for token."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import torch

import pytest

from tests.tracked_runs import ENGINE, factory, project_copy


# Slow (~40-60 s on a 2-core AMD EPYC Zen 4, then ~30 s of `factory eval`): the default suite has its parts --
# the sync's adapters and the engines' agreement after it (test_rollout_vllm), the adapters' checkpoint, resume
# and merged export (test_update_lora), adapters read from a checkpoint (test_lora) -- and a real run of every
# other path; this is the whole LoRA run once more.
@pytest.mark.slow
def test_a_lora_run_exports_a_merged_model_that_generates_its_last_evaluation(tmp_path):
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM

    work = project_copy(tmp_path / "lora")
    uri = f"sqlite:///{work}/mlflow.db"
    # two steps: step 1 samples the weights read from disk, so the first sync's size is logged at step 2
    out = factory("run", "specs/tiny.yaml", "train.steps=2", "model.lora.r=8", "train.lr=1e-2", "train.eval_size=2",
                  f"rollout.engine={ENGINE}", "tracking.experiment=lora-run", cwd=work, uri=uri)
    assert out.returncode == 0, out.stderr[-4000:]
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("lora-run").experiment_id])
    params = run.data.params
    assert params["model.lora.r"] == "8" and params["resolved.update.weight_sync"] == "adapters (float32)"
    assert params["resolved.rollout.weight_sync"] == ("lora merged into the weights" if ENGINE == "vllm"
                                                      else "lora adapters (peft)")
    assert run.data.metrics["perf/weight_sync_mb"] < 1.0  # adapters: ~0.1 MB here (the weights: ~40 MB)

    merged = tmp_path / "merged"
    assert factory("export", run.info.run_id, "--out", str(merged), cwd=work, uri=uri).returncode == 0
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    table = Path(client.download_artifacts(run.info.run_id, "eval_trajectories", str(tmp_path)))
    last = pq.read_table(sorted(table.glob("step_*.parquet"))[-1]).to_pylist()
    assert last and last[0]["step"] == 2
    for row in last:
        # the first model turn: the response tokens up to the first tool/template token (loss mask 0)
        mask = row["loss_mask"]
        first = row["response_ids"][: mask.index(0) if 0 in mask else len(mask)]
        with torch.no_grad():
            ids = model.generate(torch.tensor([row["prompt_ids"]]), max_new_tokens=len(first), do_sample=False,
                                 pad_token_id=0)[0, len(row["prompt_ids"]):].tolist()
        assert ids == first, json.dumps({"want": first, "got": ids})
    adapter = tmp_path / "adapter"
    assert factory("export", run.info.run_id, "--adapter", "--out", str(adapter), cwd=work, uri=uri).returncode == 0
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()

    # `factory eval` of the run adds its adapters beside the spec's model, as its weight syncs did: the run's
    # final evaluation again, metric for metric (merged into the base instead, a bf16 rollout rounded the sum
    # otherwise and greedy tokens differed), and nothing merged
    ev = factory("eval", "specs/tiny.yaml", "--model", run.info.run_id, "train.steps=2", "model.lora.r=8",
                 "train.lr=1e-2", "train.eval_size=2", f"rollout.engine={ENGINE}", "tracking.experiment=lora-eval",
                 cwd=work, uri=uri)
    assert ev.returncode == 0 and "merged" not in ev.stderr, ev.stderr[-4000:]
    (evaluated,) = client.search_runs([client.get_experiment_by_name("lora-eval").experiment_id])
    final = {k: v for k, v in run.data.metrics.items() if k.startswith("eval/")}
    assert final and evaluated.data.metrics == final
    assert evaluated.data.params["model.path"] == params["model.path"]  # the base, with the run's model.lora
