"""The learner on a real DeepSpeed engine (CPU accelerator, gloo) and the tiny Qwen3 on the real Qwen3
tokenizer. Each learner starts in about a second (no DeepSpeed op is compiled: factory.update.engine)."""
from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from factory.assets import resolve_model
from factory.compiler.compile import stage_settings
from factory.schema import Spec
from factory.types import Trajectory, Turn
from factory.update import Learner


@pytest.fixture(scope="module")
def model_path() -> str:
    """The built-in tiny Qwen3 (real tokenizer, 152k vocab): for the tests that train and save."""
    return resolve_model("factory:tiny-qwen3")


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def make_spec(model_path: str, **sections: Any) -> Spec:
    base = {
        "name": "update-test", "model": {"path": model_path},
        "data": {"train": {"generator": "x:y"}}, "rewards": {"r": {"fn": "x:y"}},
        "rollout": {"max_total_tokens": 64},
        # fp32, SGD, no clipping: a step moves every weight by exactly -lr * gradient, so comparing
        # weight deltas compares gradients.
        "train": {"micro_batch": 4, "lr": 0.5, "bf16_autocast": False, "threads": 1,
                  "optimizer": {"name": "sgd", "grad_clip": 0.0}},
    }
    return Spec.model_validate(_merge(base, sections))


@pytest.fixture
def learners():
    """Builds learners one at a time, as the update actor does: making the next one shuts the previous
    one down (its process group is the process's), and the last one is shut down after the test."""
    live: list[Learner] = []

    def make(spec: Spec) -> Learner:
        while live:
            live.pop().shutdown()
        learner = Learner(stage_settings(spec)["update"])
        learner.setup()
        live.append(learner)
        return learner

    yield make
    while live:
        live.pop().shutdown()


def batch(seed: int = 0, groups: int = 3, group_size: int = 4) -> list[Trajectory]:
    """Random token trajectories with tool tokens (mask 0) in the middle and rewards that differ
    within each group, so every group has non-zero advantages."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(100, 5000) for _ in range(rng.randint(4, 12))]
        for s in range(group_size):
            n = rng.randint(6, 20)
            mask = [0 if 2 <= j < 4 else 1 for j in range(n)]  # a 2-token tool response
            out.append(Trajectory(prompt_index=g, sample_index=s, prompt_ids=prompt,
                                  response_ids=[rng.randrange(100, 5000) for _ in range(n)], loss_mask=mask,
                                  turns=[], stop_reason="no_call", row={}, reward=float(s % 2) + 0.1 * g))
    return out


def one_step_delta(learner: Learner, trajs: list[Trajectory]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    before = learner.state_dict()
    stats = learner.step(trajs)
    after = learner.state_dict()
    return {k: after[k] - before[k] for k in before}, stats


def assert_same_delta(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = 1e-5) -> None:
    scale = max(float(v.abs().max()) for v in a.values())
    assert scale > 0, "the update did not move the weights"
    for k, v in a.items():
        torch.testing.assert_close(b[k], v, atol=tol * scale, rtol=0, msg=k)


def surrogate(learner: Learner, trajs: list[Trajectory], logp0: torch.Tensor) -> float:
    """-mean_i A_i * mean_t log pi(token) relative to the first policy: the GRPO objective that the
    steps minimise (0 at the start; lower = more likely good answers, less likely bad ones)."""
    from factory.algorithms import ADVANTAGES

    adv = ADVANTAGES["grpo"](torch.tensor([t.reward for t in trajs]), torch.tensor([t.prompt_index for t in trajs]),
                             eps=1e-6)
    mask = torch.zeros_like(logp0)
    for i, t in enumerate(trajs):
        mask[i, : len(t.loss_mask)] = torch.tensor(t.loss_mask, dtype=mask.dtype)
    delta = (learner.logprobs(trajs) - logp0) * mask
    return float(-(adv * delta.sum(1) / mask.sum(1)).mean())


def test_steps_change_weights_and_lower_the_loss_on_a_fixed_batch(model_path, learners):
    torch.manual_seed(0)
    spec = make_spec(model_path, train={"bf16_autocast": True, "lr": 3e-3,
                                        "optimizer": {"name": "adamw", "grad_clip": 1.0}})
    learner = learners(spec)
    trajs = batch(groups=2)
    logp0 = learner.logprobs(trajs)
    delta, stats = one_step_delta(learner, trajs)
    assert max(float(v.abs().max()) for v in delta.values()) > 1e-4
    losses = [surrogate(learner, trajs, logp0)]
    for _ in range(2):
        learner.step(trajs)
        losses.append(surrogate(learner, trajs, logp0))
    assert losses[0] < 0 and losses[2] < losses[1] < losses[0], losses
    assert stats["actor/tokens"] == sum(sum(t.loss_mask) for t in trajs)
    assert stats["actor/dropped"] == 0 and stats["actor/zero_adv_groups"] == 0 and stats["actor/updates"] == 1
    assert stats["actor/grad_norm"] > 0 and stats["actor/lr"] == 3e-3 and stats["actor/entropy"] > 5
    assert stats["actor/clip_frac_low"] == stats["actor/clip_frac_high"] == 0  # ratio 1 on the first update
    assert abs(stats["actor/approx_kl"]) < 1e-6 and "actor/kl" not in stats  # no reference: no KL, not a 0
    assert learner.ref is None  # kl.coef == 0: no reference model
    assert stats["perf/weight_sync_mb"] > 0  # one_step_delta's state_dict() is a sync's payload


def test_micro_batching_is_exact(small_path, learners):
    """Micro-batch 1 and 4 give the same update as one pass (several mini-batches and epochs: below)."""
    trajs = batch(seed=1)
    deltas = {}
    for micro in (1, 4, 12):
        learner = learners(make_spec(small_path, train={"micro_batch": micro}))
        deltas[micro], stats = one_step_delta(learner, trajs)
        assert stats["actor/updates"] == 1
    assert_same_delta(deltas[12], deltas[1])
    assert_same_delta(deltas[12], deltas[4])


def test_a_token_budget_cuts_micro_batches_shorter_and_the_update_stays_exact(small_path, learners, monkeypatch):
    """`train.micro_batch_tokens`: micro-batches of unequal row counts, the same update as one pass."""
    import factory.update.learner as learner_module

    trajs = batch(seed=1)
    cuts = []
    real_shard = learner_module.shard
    monkeypatch.setattr(learner_module, "shard", lambda *a, **k: cuts.append(real_shard(*a, **k)) or cuts[-1])
    whole, _ = one_step_delta(learners(make_spec(small_path, train={"micro_batch": 12})), trajs)
    cuts.clear()
    budgeted, _ = one_step_delta(learners(make_spec(small_path, train={"micro_batch": 12, "micro_batch_tokens": 64})),
                                 trajs)
    micros = [m for schedule in cuts for minibatch in schedule for m in minibatch if m]
    sizes = {len(m) for m in micros}
    assert len(sizes) > 1 and max(sizes) < 12, sizes  # cut short, and not into equal parts
    totals = [len(t.prompt_ids) + len(t.response_ids) for t in trajs]
    assert all(len(m) * max(totals[i] for i in m) <= 64 for m in micros)
    assert_same_delta(whole, budgeted)


def test_each_mini_batch_and_epoch_is_a_step_of_its_own_normalised_by_its_own_rows(small_path, learners):
    """With a small lr the second optimizer step starts where the first left, to first order, so two
    mini-batches of 6 rows (each loss normalised by its own rows) move the weights twice as far as one pass over
    all 12, and so do two epochs. Normalising each mini-batch by the whole batch's totals halved every step: the
    micro-batching test, which compares micro-batch sizes under one normaliser, passed with it."""
    def dot(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return sum(float((a[k].double() * b[k].double()).sum()) for k in a)

    trajs = batch(seed=1)  # 12 rows
    small = {"lr": 1e-4, "micro_batch": 4}
    one, _ = one_step_delta(learners(make_spec(small_path, train=small)), trajs)
    assert dot(one, one) > 0
    for split in ({"mini_batches": 2}, {"epochs": 2}):
        two, stats = one_step_delta(learners(make_spec(small_path, algorithm=split, train=small)), trajs)
        assert stats["actor/updates"] == 2
        # the update as a whole (per weight, a norm's ~1e-7 step is a few float32 ulps of its 1.0): measured
        # 1.99987 and 1.99996 of the one-pass step along it; halved by the whole-batch normaliser: ~1.0
        assert dot(two, one) / dot(one, one) == pytest.approx(2.0, abs=0.01), split
        assert dot(two, one) / (dot(two, two) * dot(one, one)) ** 0.5 > 0.9999, split  # and in its direction


def test_mini_batches_and_epochs_take_several_steps_from_the_same_old_logprobs(small_path, learners):
    spec = make_spec(small_path, algorithm={"epochs": 2, "mini_batches": 3}, train={"micro_batch": 2, "lr": 3.0})
    stats = learners(spec).step(batch(seed=2))
    assert stats["actor/updates"] == 6
    # later mini-batches see a moved policy against the kept old log-probs: ratios leave 1
    assert stats["actor/approx_kl"] > 0


def test_tool_tokens_do_not_reach_the_gradient(small_path, learners):
    """Changing mask-0 tokens that no model token conditions on (a trailing tool response) changes
    nothing; neither does changing their length (padding)."""
    trajs = batch(seed=3)
    other = []
    for t in trajs:
        tail = [7, 8, 9][: 1 + t.sample_index % 3]
        other.append(Trajectory(**{**t.__dict__, "response_ids": t.response_ids + tail,
                                   "loss_mask": t.loss_mask + [0] * len(tail)}))
    a, sa = one_step_delta(learners(make_spec(small_path)), trajs)
    b, sb = one_step_delta(learners(make_spec(small_path)), other)
    assert_same_delta(a, b)
    assert sa["actor/pg_loss"] == pytest.approx(sb["actor/pg_loss"], abs=1e-6)


def test_infra_error_trajectories_are_kept_out(small_path, learners):
    clean = batch(seed=4)
    broken = [Trajectory(**{**t.__dict__, "reward": 100.0 * (i % 2), "infra_error": True})
              for i, t in enumerate(batch(seed=5))]
    mixed = clean[:6] + broken[:4] + clean[6:]
    a, _ = one_step_delta(learners(make_spec(small_path)), clean)
    b, stats = one_step_delta(learners(make_spec(small_path)), mixed)
    assert stats["actor/dropped"] == 4
    assert_same_delta(a, b)
    c, stats = one_step_delta(learners(make_spec(small_path, rollout={"drop_infra_errors": False})), mixed)
    assert stats["actor/dropped"] == 0
    assert max(float((c[k] - a[k]).abs().max()) for k in a) > 1e-3


def test_overlong_filter_keeps_truncated_trajectories_out(small_path, learners):
    trajs = batch(seed=10)
    cut = [Trajectory(**{**t.__dict__, "truncated": i % 3 == 0}) for i, t in enumerate(trajs)]
    a, _ = one_step_delta(learners(make_spec(small_path, algorithm={"name": "dapo"})),
                          [t for t in cut if not t.truncated])
    b, stats = one_step_delta(learners(make_spec(small_path, algorithm={"name": "dapo", "overlong": {"filter": True}})),
                              cut)
    assert stats["actor/dropped"] == 4
    assert_same_delta(a, b)


def test_train_per_group_trains_the_chosen_samples_as_if_only_they_were_sampled(small_path, learners):
    """Max-variance down-sampling: one step with `train_per_group: 2` is one step on the two extremes of
    each group (advantages over them alone), the others left out."""
    trajs = [Trajectory(**{**t.__dict__, "reward": [0.0, 0.4, 1.0, 0.5][t.sample_index] + 0.1 * t.prompt_index})
             for t in batch(seed=11)]
    chosen = [t for t in trajs if t.sample_index in (0, 2)]  # the worst and the best of each group
    a, _ = one_step_delta(learners(make_spec(small_path)), chosen)
    b, stats = one_step_delta(learners(make_spec(small_path, algorithm={"train_per_group": 2})), trajs)
    assert stats["actor/down_sampled"] == 6 and stats["actor/trained_rows"] == 6
    assert_same_delta(a, b)


def test_a_sync_is_sent_in_the_dtype_the_rollout_resolved_on_its_own_device(small_path, learners, monkeypatch):
    """An update on the CPU beside a rollout on a GPU: the learner ran the rollout's `auto` rule on its own process,
    where Ray hides every GPU (float32), while the engine on its Ampere+ GPU holds bfloat16: every sync went in
    float32, twice the bytes, and resolved.update.weight_sync said so. The driver hands it the rollout's dtype."""
    from factory import device

    monkeypatch.setattr(device, "cuda_devices", lambda: ())  # the update actor's view: no GPU
    learner = learners(make_spec(small_path, resources={"rollout": {"num_gpus": 1}, "update": {"num_gpus": 0}}))
    assert learner.resolved()["weight_sync"] == "full (float32)"  # its own guess, before the driver says
    assert learner.use_sync_dtype("bfloat16")["weight_sync"] == "full (bfloat16)"
    assert {t.dtype for t in learner.state_dict().values()} == {torch.bfloat16}


def test_weight_sync_size_is_logged_once_a_sync_brought_the_weights(small_path, learners):
    """Step 1 samples the weights loaded from disk: it logged perf/weight_sync_mb 0.0, which halved its mean
    over a 2-step run."""
    learner, trajs = learners(make_spec(small_path)), batch(seed=3)
    assert "perf/weight_sync_mb" not in learner.step(trajs)
    payload = learner.state_dict()
    size = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in payload.values()}.values())
    assert learner.step(trajs)["perf/weight_sync_mb"] == size / 1e6


def test_all_dropped_means_no_update(small_path, learners):
    trajs = [Trajectory(**{**t.__dict__, "infra_error": True}) for t in batch(seed=6)]
    delta, stats = one_step_delta(learners(make_spec(small_path)), trajs)
    assert stats["actor/updates"] == 0 and stats["actor/dropped"] == len(trajs)
    assert all(float(v.abs().max()) == 0 for v in delta.values())


@pytest.mark.parametrize("apply", ["loss", "reward"])
def test_reference_model_only_with_kl(small_path, learners, apply):
    spec = make_spec(small_path, algorithm={"kl": {"coef": 0.1, "apply": apply}}, train={"lr": 3.0})
    learner = learners(spec)
    assert learner.ref is not None and not any(p.requires_grad for p in learner.ref.parameters())
    trajs = batch(seed=7)
    first = learner.step(trajs)
    assert first["actor/kl"] == pytest.approx(0.0, abs=1e-6)  # the policy still equals the reference
    assert learner.step(trajs)["actor/kl"] > 1e-4


@pytest.mark.parametrize("stage", [0, 3])
def test_checkpoint_resume_restores_weights_optimizer_and_step(model_path, small_path, learners, tmp_path, stage):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = make_spec(small_path, model={"tokenizer": model_path},
                     train={"lr": 1e-2, "optimizer": {"name": "adamw", "grad_clip": 1.0},
                            "deepspeed": {"zero_stage": stage}})
    trajs = batch(seed=8)
    first = learners(spec)
    assert first.load_checkpoint(str(tmp_path)) is None  # nothing saved yet
    first.step(trajs)
    first.step(trajs)
    out = first.save_checkpoint(str(tmp_path), 2)
    assert out == str(tmp_path / "step_2") and (tmp_path / "latest").read_text().strip() == "step_2"
    saved = first.state_dict()

    hf = AutoModelForCausalLM.from_pretrained(Path(out) / "hf")  # a plain Hugging Face folder
    for k, v in hf.state_dict().items():
        torch.testing.assert_close(v, saved[k], atol=0, rtol=0)
    assert AutoTokenizer.from_pretrained(Path(out) / "hf").convert_tokens_to_ids("<|im_end|>") == 151645

    a = first.step(trajs)
    after_a = first.state_dict()

    second = learners(spec)
    assert second.load_checkpoint(str(tmp_path)) == 2
    for k, v in second.state_dict().items():
        torch.testing.assert_close(v, saved[k], atol=0, rtol=0)
    # Adam's moments came back too: the next step is the same on both
    b = second.step(trajs)
    assert a["actor/pg_loss"] == b["actor/pg_loss"]
    for k, v in second.state_dict().items():
        torch.testing.assert_close(v, after_a[k], atol=0, rtol=0)


@pytest.mark.parametrize("stage", [0, 2])
def test_a_resumed_run_trains_with_its_specs_optimizer_settings(small_path, learners, tmp_path, stage):
    """Resumed under changed train.optimizer settings (`--allow-spec-change`, recorded as applied), the run trained
    with the checkpoint's: torch's load_state_dict keeps the saved param groups' weight_decay and betas, and at ZeRO
    1/2 DeepSpeed restores the saved clip_grad. The Adam moments still come from the checkpoint."""
    old = {"name": "adamw", "weight_decay": 0.0, "betas": (0.9, 0.999), "grad_clip": 1.0}
    new = {"name": "adamw", "weight_decay": 0.1, "betas": (0.8, 0.95), "grad_clip": 0.5}
    first = learners(make_spec(small_path, train={"lr": 1e-3, "optimizer": old, "deepspeed": {"zero_stage": stage}}))
    first.step(batch(seed=0))
    first.save_checkpoint(str(tmp_path), 1)
    moments = [first.optimizer.state[p]["exp_avg"].clone() for p in first.optimizer.param_groups[0]["params"]]
    resumed = learners(make_spec(small_path, train={"lr": 1e-3, "optimizer": new, "deepspeed": {"zero_stage": stage}}))
    assert resumed.load_checkpoint(str(tmp_path)) == 1
    for group in resumed.optimizer.param_groups:
        assert (group["weight_decay"], tuple(group["betas"])) == (0.1, (0.8, 0.95))
    # ZeRO's optimizer clips with its own copy, which loading restored; stage 0's engine clips by its config
    assert resumed.engine.optimizer.clip_grad == 0.5 if stage else resumed.engine.gradient_clipping() == 0.5
    for p, saved in zip(resumed.optimizer.param_groups[0]["params"], moments):
        torch.testing.assert_close(resumed.optimizer.state[p]["exp_avg"], saved, atol=0, rtol=0)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_give_the_stage_0_update(small_path, learners, stage):
    trajs = batch(seed=9)
    base, _ = one_step_delta(learners(make_spec(small_path)), trajs)
    zero, stats = one_step_delta(learners(make_spec(small_path, train={"deepspeed": {"zero_stage": stage}})), trajs)
    assert_same_delta(base, zero)
    assert stats["actor/grad_norm"] > 0


def test_zero_3_gathers_its_weights_a_bucket_at_a_time(small_path, learners, monkeypatch):
    """A weight sync under ZeRO-3 gathered the whole model at once, on every rank's GPU beside its shards;
    now GATHER_BYTES at a time. Gathered in buckets of ~3 parameters, the weights are the unsharded model's:
    every name (the tied head under both), the same values, tied names still one tensor."""
    import deepspeed

    import factory.update.learner as learner_module
    from factory.update.learner import buckets

    assert buckets([], 10) == [] and buckets([4, 4, 4, 20, 1, 9, 1], 10) == [[0, 1], [2], [3], [4, 5], [6]]
    want = learners(make_spec(small_path)).state_dict()
    monkeypatch.setattr(learner_module, "GATHER_BYTES", 3 * 64 * 128 * 4)  # a few of the small model's matrices
    learner = learners(make_spec(small_path, train={"deepspeed": {"zero_stage": 3}}))
    gathers: list[int] = []
    whole = deepspeed.zero.GatheredParameters
    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", lambda ps, **kw: gathers.append(len(ps)) or whole(ps, **kw))
    got = learner.state_dict()
    assert len(gathers) > 5 and sum(gathers) == len(list(learner.engine.module.parameters()))
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert got["lm_head.weight"] is got["model.embed_tokens.weight"]


def test_zero_3_builds_the_policy_and_the_reference_partitioned(small_path, learners, monkeypatch):
    """ZeRO-3 loads the policy under zero.Init (each rank builds only its part: a whole float32 copy per
    rank first is what runs a node out of host memory on a real model), and the KL term's reference too
    (a frozen engine of its own); a model loaded afterwards in the process is an ordinary one, and so is a
    ZeRO-2 learner's reference. The update with the KL term equals the ZeRO-0 one."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    built: list[bool] = []  # per model loaded: were its parameters DeepSpeed-partitioned as it came back?
    load = AutoModelForCausalLM.from_pretrained

    def spy(*args: Any, **kwargs: Any) -> torch.nn.Module:
        model = load(*args, **kwargs)
        built.append(all(hasattr(p, "ds_id") for p in model.parameters()))
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    trajs = batch(seed=9)
    first = learners(make_spec(small_path, algorithm={"kl": {"coef": 0.1}}))
    first.step(trajs)  # the second step is the one whose KL is not 0: the policy has left the reference
    base, base_stats = one_step_delta(first, trajs)
    built.clear()
    learner = learners(make_spec(small_path, algorithm={"kl": {"coef": 0.1}}, train={"deepspeed": {"zero_stage": 3}}))
    assert built == [True, True] and not is_deepspeed_zero3_enabled()
    assert all(hasattr(p, "ds_id") and not p.requires_grad for p in learner.ref.parameters())
    learner.step(trajs)
    zero, stats = one_step_delta(learner, trajs)
    assert_same_delta(base, zero)
    assert base_stats["actor/kl"] > 1e-4 and stats["actor/kl"] == pytest.approx(base_stats["actor/kl"], rel=1e-4)
    learners(make_spec(small_path, algorithm={"kl": {"coef": 0.1}}, train={"deepspeed": {"zero_stage": 2}}))
    assert built[2:] == [False, False]


def test_gradient_checkpointing_gives_the_same_update(small_path, learners):
    trajs = batch(seed=10)
    base, _ = one_step_delta(learners(make_spec(small_path)), trajs)
    learner = learners(make_spec(small_path, train={"gradient_checkpointing": True}))
    assert learner.engine.module.is_gradient_checkpointing
    recomputed, _ = one_step_delta(learner, trajs)
    assert_same_delta(base, recomputed)


def test_shared_prefix_once_gives_the_same_update(small_path, learners):
    """Trajectories that start with a common system/few-shot block: running it once per micro-batch
    (train.share_prefix, the default) moves the weights as running it for every sequence does."""
    system = [7 + i for i in range(20)]  # >= MIN_SHARED_PREFIX tokens every prompt starts with
    trajs = [replace(t, prompt_ids=system + t.prompt_ids) for t in batch(seed=11)]
    base, _ = one_step_delta(learners(make_spec(small_path, train={"share_prefix": False})), trajs)
    for stage in (0, 2):
        learner = learners(make_spec(small_path, train={"deepspeed": {"zero_stage": stage}}))
        assert learner.resolved()["share_prefix"] == "on"
        shared, stats = one_step_delta(learner, trajs)
        assert_same_delta(base, shared)
        assert stats["perf/update_flops_per_s"] > 0
    no_cache = learners(make_spec(small_path, train={"gradient_checkpointing": True}))
    assert no_cache.resolved()["share_prefix"] == "off"  # HF drops the KV cache under checkpointing


def test_a_token_budget_counts_the_prefix_the_update_runs_once(small_path, learners, monkeypatch):
    """`train.micro_batch_tokens` with a shared prefix: a micro-batch holds the rows whose cost as the
    update runs them (the prefix once) fits, more than their padded size would allow; still exact."""
    import factory.update.learner as learner_module
    from factory.update.batch import run_once, shared_prefix

    system = [7 + i for i in range(20)]  # >= MIN_SHARED_PREFIX tokens every prompt starts with
    trajs = [replace(t, prompt_ids=system + t.prompt_ids) for t in batch(seed=11)]  # rows of 30-52 tokens
    whole, _ = one_step_delta(learners(make_spec(small_path, train={"micro_batch": 12})), trajs)
    cuts = []
    real_shard = learner_module.shard
    monkeypatch.setattr(learner_module, "shard", lambda *a, **k: cuts.append(real_shard(*a, **k)) or cuts[-1])
    budgeted, _ = one_step_delta(learners(make_spec(small_path, train={"micro_batch": 12, "micro_batch_tokens": 100})),
                                 trajs)
    micros = [[trajs[i] for i in m] for schedule in cuts for minibatch in schedule for m in minibatch if m]
    totals = [[len(t.prompt_ids) + len(t.response_ids) for t in m] for m in micros]
    once = [run_once(len(m), shared_prefix(m)) for m in micros]
    assert all(len(m) == 1 or s + len(m) * (max(n) - s) <= 100 for m, n, s in zip(micros, totals, once))
    assert any(len(n) * max(n) > 100 for n in totals)  # padded counting would have cut these
    assert_same_delta(whole, budgeted)


@pytest.fixture(scope="module")
def dropout_path(small_path, tmp_path_factory) -> str:
    """The small Qwen3 with attention dropout 0.1 (applied functionally in training mode, no nn.Dropout)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(small_path)
    config.attention_dropout = 0.1
    out = tmp_path_factory.mktemp("small-qwen3-dropout")
    AutoModelForCausalLM.from_pretrained(small_path, config=config).save_pretrained(out)
    return str(out)


def test_a_model_with_dropout_does_not_share_the_prefix(small_path, dropout_path, learners):
    """Under dropout a prefix run once for all rows would share one dropout mask, where one pass per row
    draws a mask per row: not the same update, so sharing is off (and the run's params say why). With
    the same RNG state the update is then exactly the unshared one; had the prefix been shared, the masks
    (and the number of random draws) would differ."""
    from transformers import AutoModelForCausalLM

    from factory.update.logprobs import active_dropout

    assert active_dropout(AutoModelForCausalLM.from_pretrained(small_path)) == []
    assert active_dropout(AutoModelForCausalLM.from_pretrained(dropout_path)) == ["config.attention_dropout=0.1"]
    system = [7 + i for i in range(20)]
    trajs = [replace(t, prompt_ids=system + t.prompt_ids) for t in batch(seed=16)]
    deltas = []
    for share in (False, True):
        learner = learners(make_spec(dropout_path, train={"share_prefix": share, "disable_dropout": False}))
        assert learner.resolved()["share_prefix"] == ("off (dropout)" if share else "off")
        assert learner.resolved()["dropout"] == "on (config.attention_dropout=0.1)"
        torch.manual_seed(0)
        deltas.append(one_step_delta(learner, trajs)[0])
    assert_same_delta(*deltas, tol=0)


def test_dropout_is_off_by_default_so_the_update_is_of_the_function_that_sampled(small_path, dropout_path, learners):
    """`train.disable_dropout` (the default): the model's attention dropout 0.1 is off in the update, so
    the step is the same whatever the random state, it is the update of the same model without dropout,
    and the prefix is shared again. With dropout kept, two random states give two updates."""
    system = [7 + i for i in range(20)]
    trajs = [replace(t, prompt_ids=system + t.prompt_ids) for t in batch(seed=16)]
    deltas = []
    for seed in (0, 1):
        learner = learners(make_spec(dropout_path))
        assert learner.resolved()["dropout"] == "off (disabled)" and learner.resolved()["share_prefix"] == "on"
        torch.manual_seed(seed)
        deltas.append(one_step_delta(learner, trajs)[0])
    assert_same_delta(*deltas)
    assert_same_delta(deltas[0], one_step_delta(learners(make_spec(small_path)), trajs)[0])
    kept = []
    for seed in (0, 1):
        learner = learners(make_spec(dropout_path, train={"disable_dropout": False, "share_prefix": False}))
        torch.manual_seed(seed)
        kept.append(one_step_delta(learner, trajs)[0])
    with pytest.raises(AssertionError):
        assert_same_delta(*kept)


def test_a_checkpoint_keeps_the_models_dropout_rates_in_its_config(dropout_path, model_path, learners, tmp_path):
    """`train.disable_dropout` zeroes the config's rates in memory; the checkpoint's (and so the export's)
    config.json still says the model's own attention_dropout 0.1, and the run goes on without dropout."""
    learner = learners(make_spec(dropout_path, model={"tokenizer": model_path}))
    learner.step(batch(seed=1))
    out = Path(learner.save_checkpoint(str(tmp_path), 1))
    assert json.loads((out / "hf" / "config.json").read_text())["attention_dropout"] == 0.1
    assert learner.engine.module.config.attention_dropout == 0.0 and learner.resolved()["dropout"] == "off (disabled)"


def test_a_lora_runs_kl_reference_is_the_base_model_without_dropout(dropout_path, model_path, learners):
    """The LoRA reference is the policy's own module with its adapters off, which the engine keeps in
    training mode: under `train.disable_dropout: false` it would be dropout-noised, changing from call to
    call, where a full-weight run's reference copy is in eval mode."""
    trajs = batch(seed=2)
    micro = [[list(range(len(trajs)))]]  # one micro-batch of every row
    train, kl = {"disable_dropout": False, "share_prefix": False}, {"kl": {"coef": 0.1}}
    full = learners(make_spec(dropout_path, model={"tokenizer": model_path}, algorithm=kl, train=train))
    base = full._logprobs_before_update(trajs, micro, policy=False)[1]
    lora = learners(make_spec(dropout_path, model={"tokenizer": model_path, "lora": {"r": 4}}, algorithm=kl,
                              train=train))
    for _ in range(2):
        torch.testing.assert_close(lora._logprobs_before_update(trajs, micro, policy=False)[1], base, atol=1e-5, rtol=0)
    assert lora.engine.module.training  # given back in training mode


def test_zero_advantage_rows_are_skipped_and_the_update_is_the_same(small_path, learners, monkeypatch):
    """Rows of a group whose rewards all agree add nothing to the gradient: the update does not run them,
    and moves the weights as running them does -- also when a whole step is flat, where AdamW's moments
    still move the weights (a stand-in sample keeps its optimizer step)."""
    import factory.update.learner as learner_module

    trajs = batch(seed=12, groups=3)
    flat = [replace(t, reward=1.0) if t.prompt_index == 1 else t for t in trajs]  # group 1 agrees
    all_flat = [replace(t, reward=0.0) for t in batch(seed=13, groups=2)]
    spec = make_spec(small_path, train={"lr": 1e-3, "optimizer": {"name": "adamw", "grad_clip": 1.0}})

    def run() -> tuple[list[dict[str, torch.Tensor]], list[dict[str, float]]]:
        learner = learners(spec)
        (d1, s1), (d2, s2) = one_step_delta(learner, flat), one_step_delta(learner, all_flat)
        return [d1, d2], [s1, s2]

    skipped, skipped_stats = run()
    monkeypatch.setattr(learner_module, "without_zero_advantage", lambda schedule, adv, micro_batch, *rest: schedule)
    full, full_stats = run()
    for a, b in zip(full, skipped):
        assert_same_delta(a, b)
    assert [s["actor/skipped_zero_adv"] for s in skipped_stats] == [4, 8]
    assert [s["actor/zero_adv_groups"] for s in skipped_stats] == [1, 2]  # the groups whose rewards all agree
    assert [s["actor/skipped_zero_adv"] for s in full_stats] == [0, 0]
    assert skipped_stats[0]["actor/pg_loss"] == pytest.approx(full_stats[0]["actor/pg_loss"], abs=1e-6)
    assert skipped_stats[0]["actor/entropy"] > 5  # a token mean over the rows that ran, not diluted
    assert "actor/entropy" not in skipped_stats[1]  # nothing ran: nothing measured (not a fake 0)
    assert skipped_stats[1]["actor/grad_norm"] == 0


@pytest.mark.parametrize("name", ["grpo", "bnpo", "dr_grpo"])  # the three aggregations' normalisers
def test_zero_advantage_skip_moves_the_weights_as_plain_sgd_on_every_row_does(small_path, learners, monkeypatch, name):
    """The exact claim, tested where it can fail: with plain SGD (no clipping) a step moves every weight by
    -lr x gradient, so a wrongly scaled gradient (a normaliser over the rows that ran instead of the whole
    mini-batch) shows in the delta. AdamW's first step is lr x sign(gradient), which hides any scale.
    The batch holds zero-advantage rows in the middle (group 1 agrees), so the micro-batches are re-cut."""
    import factory.update.learner as learner_module

    trajs = batch(seed=15, groups=4)
    flat = [replace(t, reward=0.5) if t.prompt_index in (1, 2) else t for t in trajs]  # 8 of 16 rows flat
    spec = make_spec(small_path, algorithm={"name": name})  # SGD, lr 0.5, no clip, fp32 (make_spec)
    skipped, skipped_stats = one_step_delta(learners(spec), flat)
    monkeypatch.setattr(learner_module, "without_zero_advantage", lambda schedule, adv, micro_batch, *rest: schedule)
    full, full_stats = one_step_delta(learners(spec), flat)
    assert skipped_stats["actor/skipped_zero_adv"] == 8 and full_stats["actor/skipped_zero_adv"] == 0
    assert (skipped_stats["actor/trained_rows"], full_stats["actor/trained_rows"]) == (8, 16)
    ran_tokens = sum(sum(t.loss_mask) for t in flat if t.prompt_index not in (1, 2))
    assert skipped_stats["actor/trained_tokens"] == ran_tokens  # perf/update_tokens_per_s counts these
    assert skipped_stats["actor/tokens"] == full_stats["actor/tokens"] == sum(sum(t.loss_mask) for t in flat)
    assert_same_delta(full, skipped)
    assert skipped_stats["actor/grad_norm"] == pytest.approx(full_stats["actor/grad_norm"], rel=1e-5)
    # and it can fail: the same gradient over the rows that ran only (their own normalisers) differs
    ran = [t for t in flat if t.prompt_index not in (1, 2)]
    only_ran, _ = one_step_delta(learners(spec), ran)
    with pytest.raises(AssertionError):
        assert_same_delta(full, only_ran)


def test_zero_advantage_rows_still_run_when_a_kl_term_is_in_the_loss(small_path, learners):
    trajs = [replace(t, reward=1.0) for t in batch(seed=14, groups=2)]
    learner = learners(make_spec(small_path, algorithm={"kl": {"coef": 0.1, "apply": "loss"}}))
    assert learner.step(trajs)["actor/skipped_zero_adv"] == 0  # the KL gradient needs every row


@pytest.mark.slow
def test_smollm2_sized_update_stays_in_memory(tmp_path, learners):
    """A SmolLM2-135M-shaped Llama (random weights) on a realistic batch: 32 sequences x ~250 tokens,
    micro-batch 4, bf16 autocast, AdamW. Measured here: 42-61 s/step on 1 busy core, peak RSS 5.3 GB
    (a plain-PyTorch prototype at micro-batch 16 peaked at 13.5 GB)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                         tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    spec = make_spec(str(tmp_path), rollout={"max_total_tokens": 256},
                     train={"micro_batch": 4, "lr": 1e-5, "bf16_autocast": True,
                            "optimizer": {"name": "adamw", "grad_clip": 1.0}})
    rng = random.Random(0)
    trajs = []
    for g in range(4):
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(110, 140))]
        for s in range(8):
            n = rng.randint(90, 140)
            trajs.append(Trajectory(prompt_index=g, sample_index=s, prompt_ids=prompt,
                                    response_ids=[rng.randrange(100, 40000) for _ in range(n)],
                                    loss_mask=[0 if 40 <= j < 60 else 1 for j in range(n)], turns=[],
                                    stop_reason="no_call", row={}, reward=float(rng.random() < 0.5)))
    stats = learners(spec).step(trajs)
    assert stats["actor/tokens"] > 2500 and stats["actor/grad_norm"] > 0
    assert stats["perf/update_max_rss_gb"] < 8.0


def _with_sampler_logprobs(learner: Learner, trajs: list[Trajectory], shift: float = 0.0) -> list[Trajectory]:
    """The trajectories as a rollout engine would record them: the current policy's log-prob of each
    model token (plus `shift`, a stand-in for engine/learner mismatch), 0 on mask-0 tokens."""
    logp = learner.logprobs(trajs)
    return [Trajectory(**{**t.__dict__, "sampler_logprobs": [float(logp[i, j]) + shift if m else 0.0
                                                              for j, m in enumerate(t.loss_mask)]})
            for i, t in enumerate(trajs)]


def test_rollout_logprob_mismatch_is_reported(small_path, learners):
    learner = learners(make_spec(small_path))
    exact = learner.step(_with_sampler_logprobs(learner, batch(seed=11)))
    assert exact["rollout/logprob_diff_mean"] < 1e-5 and exact["rollout/logprob_diff_max"] < 1e-5
    off = learner.step(_with_sampler_logprobs(learner, batch(seed=11), shift=-0.3))
    assert off["rollout/logprob_diff_mean"] == pytest.approx(0.3, abs=1e-4)
    assert "rollout/logprob_diff_mean" not in learner.step(batch(seed=11))  # nothing recorded, nothing reported
    # with a pre-update pass (several mini-batches) the numbers come from that pass
    spec = make_spec(small_path, algorithm={"mini_batches": 2})
    learner = learners(spec)
    assert learner.step(_with_sampler_logprobs(learner, batch(seed=11), shift=0.2))[
        "rollout/logprob_diff_mean"] == pytest.approx(0.2, abs=1e-4)


def test_tis_weights_the_loss_by_the_capped_ratio(small_path, learners):
    """Sampler probabilities e^0.5 below the learner's give weight min(e^0.5, cap): with cap 1.5 every
    token's gradient is 1.5x the uncorrected one (ratio 1, single update); without a shift it is 1x."""
    trajs = batch(seed=12)
    plain, _ = one_step_delta(learners(make_spec(small_path)), trajs)
    spec = make_spec(small_path, algorithm={"rollout_correction": {"kind": "tis", "cap": 1.5}})
    learner = learners(spec)
    same, stats = one_step_delta(learner, _with_sampler_logprobs(learner, trajs))
    assert_same_delta(plain, same, tol=1e-4)
    assert stats["actor/tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    learner = learners(spec)
    capped, stats = one_step_delta(learner, _with_sampler_logprobs(learner, trajs, shift=-0.5))
    assert_same_delta({k: 1.5 * v for k, v in plain.items()}, capped, tol=1e-4)
    assert stats["actor/tis_weight_mean"] == pytest.approx(1.5) and stats["actor/tis_capped_frac"] == pytest.approx(1.0)


def test_rollout_logprobs_stand_in_for_the_old_logprob_pass(small_path, learners):
    """use_rollout_logprobs: no pre-update pass even with several updates, and pi_old is the sampler's."""
    spec = make_spec(small_path, algorithm={"mini_batches": 3, "use_rollout_logprobs": True})
    learner = learners(spec)
    trajs = _with_sampler_logprobs(learner, batch(seed=13))
    passes = []
    pass_of = learner._logprobs_before_update
    learner._logprobs_before_update = lambda *a, policy=True: passes.append(policy) or pass_of(*a, policy=policy)
    stats = learner.step(trajs)
    assert passes == [False]  # asked for no policy log-probs: only a reference model would be run
    assert stats["actor/updates"] == 3 and stats["actor/entropy"] > 0
    # the same update as the learner's own pass gives when the sampler matches the learner
    reference = learners(make_spec(small_path, algorithm={"mini_batches": 3}))
    a, _ = one_step_delta(reference, trajs)
    b, _ = one_step_delta(learners(spec), trajs)
    assert_same_delta(a, b, tol=1e-4)
    with pytest.raises(ValueError, match="recorded no log-probs"):
        learners(spec).step(batch(seed=13))


def test_no_deepspeed_op_is_compiled_for_the_update(learners, small_path):
    """DeepSpeed's CPU TorchBackend JIT-compiles its shm_comm op (a minute on a slow CPU) unless told it is
    unavailable; only inference_all_reduce uses it (factory.update.engine)."""
    from deepspeed.comm import comm

    learners(make_spec(small_path))
    # the backend the learner's engine uses: neither built nor loaded from an earlier build's cache
    assert comm.cdb is not None and comm.cdb.shm_comm_op is None


def test_stale_rollouts_take_pi_old_from_the_sampler_not_the_current_weights(small_path, learners):
    """train.max_staleness > 0: the weights that sampled the batch are older than the learner's, so the
    single-update shortcut (pi_old = the update pass's own log-probs, ratio 1) would be wrong. pi_old is
    the sampler's: log-probs e^0.5 below the learner's give ratio e^0.5 > 1 + 0.28, clipped wherever the
    advantage is positive. With a rollout correction, the learner's pass is pi_old and TIS weighs the rest."""
    trajs = batch(seed=14)
    learner = learners(make_spec(small_path))
    fresh = learner.step(_with_sampler_logprobs(learner, trajs, shift=-0.5))
    assert fresh["actor/clip_frac_high"] == 0.0  # on-policy: ratio 1 whatever the sampler said
    learner = learners(make_spec(small_path, train={"max_staleness": 1}))
    stale = learner.step(_with_sampler_logprobs(learner, trajs, shift=-0.5))
    assert 0.2 < stale["actor/clip_frac_high"] < 0.8  # the tokens with a positive advantage
    spec = make_spec(small_path, train={"max_staleness": 1}, algorithm={"rollout_correction": {"kind": "tis", "cap": 1.5}})
    learner = learners(spec)
    sampled, passes = _with_sampler_logprobs(learner, trajs, shift=-0.5), []
    pass_of = learner._logprobs_before_update
    learner._logprobs_before_update = lambda *a, policy=True: passes.append(policy) or pass_of(*a, policy=policy)
    corrected = learner.step(sampled)
    assert passes == [True] and corrected["actor/clip_frac_high"] == 0.0  # pi_old from the pass: ratio 1
    assert corrected["actor/tis_weight_mean"] == pytest.approx(1.5)  # min(e^0.5, 1.5)
    with pytest.raises(ValueError, match="train.max_staleness: pi_old is the rollout's log-probs"):
        learners(make_spec(small_path, train={"max_staleness": 1})).step(batch(seed=14))


@pytest.mark.parametrize("stage", [0, 2])
def test_non_finite_values_never_reach_the_weights(small_path, learners, stage):
    """A reward of inf (NaN advantages) and a NaN sampler log-prob (a NaN loss, with finite gradients: the
    clipped objective's max takes the finite branch) each skip the step's update, counted; the weights stay
    as they were, finite; the third such step in a row stops. Stage 0 skips by Factory's own check, ZeRO
    by DeepSpeed's overflow check."""
    import math

    from factory.update.learner import NonFiniteUpdate

    spec = make_spec(small_path, algorithm={"use_rollout_logprobs": True},
                     train={"max_non_finite_steps": 3, "deepspeed": {"zero_stage": stage}})
    learner = learners(spec)
    trajs = _with_sampler_logprobs(learner, batch(seed=21))
    trajs[0] = Trajectory(**{**trajs[0].__dict__, "reward": math.inf})
    delta, stats = one_step_delta(learner, trajs)
    assert stats["actor/skipped_non_finite"] == 1 and stats["actor/updates"] == 0
    assert all(float(v.abs().max()) == 0 for v in delta.values())
    trajs = _with_sampler_logprobs(learner, batch(seed=22))
    trajs[0].sampler_logprobs[1] = math.nan  # a model token's
    delta, stats = one_step_delta(learner, trajs)
    assert stats["actor/skipped_non_finite"] == 1 and stats["actor/updates"] == 0 and "actor/grad_norm" not in stats
    assert all(float(v.abs().max()) == 0 for v in delta.values())
    with pytest.raises(NonFiniteUpdate, match="3 steps in a row had a non-finite loss or gradient norm .* the "
                                              "weights are still those of step 0\\."):
        learner.step(trajs)
    assert all(bool(torch.isfinite(v).all()) for v in learner.state_dict().values())
    # a good step resets the count; the message names the last good step (it said step -1 above, 0 here)
    good = learners(spec)
    good.step(trajs)
    good.step(_with_sampler_logprobs(good, batch(seed=23)))
    assert good.non_finite_steps == 0
    good.step(trajs)
    good.step(trajs)
    with pytest.raises(NonFiniteUpdate, match="the weights are still those of step 2\\."):
        good.step(trajs)


def test_the_run_of_non_finite_steps_survives_a_resume(small_path, learners, tmp_path):
    """The count of non-finite steps in a row is checkpointed: a run killed after its first such step and
    resumed stops at the second, as the uninterrupted run does (it restarted at 0, and never stopped)."""
    import math

    from factory.update.learner import NonFiniteUpdate

    spec = make_spec(small_path, train={"max_non_finite_steps": 2})
    trajs = batch(seed=24)
    trajs[0] = Trajectory(**{**trajs[0].__dict__, "reward": math.nan})
    killed = learners(spec)
    killed.step(trajs)
    assert killed.non_finite_steps == 1
    killed.save_checkpoint(str(tmp_path), 1)
    resumed = learners(spec)
    assert resumed.load_checkpoint(str(tmp_path)) == 1 and resumed.non_finite_steps == 1
    with pytest.raises(NonFiniteUpdate, match="2 steps in a row .* the weights are still those of step 0\\."):
        resumed.step(trajs)


def test_an_fp16_loss_scale_settling_is_not_counted_as_a_broken_step():
    """DeepSpeed's fp16 loss scale starts at 2^16 and halves at each overflow, skipping that update: counted toward
    train.max_non_finite_steps, three such warm-up steps stopped a healthy fp16 run. At the scale's floor, or in
    bf16/fp32 (no scaler), a skip counts as before."""
    from types import SimpleNamespace

    from factory.update.learner import Learner

    learner = object.__new__(Learner)  # the rule alone (an fp16 DeepSpeed engine needs a GPU)

    def engine(fp16: bool, scale: float) -> SimpleNamespace:
        scaler = SimpleNamespace(dynamic=True, cur_scale=scale, min_scale=1.0)
        return SimpleNamespace(fp16_enabled=lambda: fp16, optimizer=SimpleNamespace(loss_scaler=scaler))

    learner.engine = engine(True, 2.0**15)
    assert learner._loss_scale_settling()
    learner.engine = engine(True, 1.0)  # at its floor: an overflow now is the run's
    assert not learner._loss_scale_settling()
    learner.engine = engine(False, 2.0**15)
    assert not learner._loss_scale_settling()
    learner.engine = SimpleNamespace(fp16_enabled=lambda: True, optimizer=object())  # no scaler found: counted
    assert not learner._loss_scale_settling()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_with_inf_or_nan_are_found_whatever_their_sum(dtype):
    """The check before a weight sync or a checkpoint sums each tensor first: a NaN, an inf, or infs of both
    signs are found; finite weights whose sum overflows are not taken for non-finite; integer buffers pass."""
    import math

    from factory.update.learner import NonFiniteUpdate, _check_finite

    big = torch.finfo(dtype).max
    _check_finite({"w": torch.full((4,), big, dtype=dtype), "steps": torch.tensor([7]), "e": torch.empty(0, dtype=dtype)})
    assert not math.isfinite(torch.full((4,), big, dtype=dtype).sum())  # the sum overflows: the slow path decided
    for bad in ([1.0, math.nan], [1.0, math.inf], [math.inf, -math.inf], [-math.inf, 2.0]):
        with pytest.raises(NonFiniteUpdate, match="hold inf or NaN \\(bad\\)"):
            _check_finite({"ok": torch.ones(3, dtype=dtype), "bad": torch.tensor(bad, dtype=dtype)})


# ------------------------------------------------------------------------ turn credit (algorithm.credit)
def with_turns(trajs, split):
    """`batch()`'s trajectories (2 model tokens, a 2-token tool response, the rest model tokens) as two turns
    (`split`) or one turn holding every model token; per-turn rewards that differ within each group."""
    out = []
    for t in trajs:
        model = sum(t.loss_mask)
        turns = [Turn(text="", num_tokens=2), Turn(text="", num_tokens=model - 2)] if split else [Turn(text="", num_tokens=model)]
        values = [t.reward, float(t.sample_index % 3)] if split else []
        out.append(replace(t, turns=turns, turn_reward=values, reward=sum(values) / 2 if split else t.reward))
    return out


def test_one_turn_trajectories_train_bit_for_bit_the_same_under_both_credits(small_path, learners):
    """With one turn per trajectory a turn's advantage is its trajectory's, spread over the same tokens:
    the per-token path ([n, Rmax]) must give exactly the update of the per-row one ([n]), weight for weight."""
    trajs = with_turns(batch(seed=3), split=False)
    deltas = {}
    for credit in ("trajectory", "turn"):
        learner = learners(make_spec(small_path, algorithm={"credit": credit}))
        deltas[credit], stats = one_step_delta(learner, trajs)
    assert max(float(v.abs().max()) for v in deltas["trajectory"].values()) > 0
    for k, v in deltas["trajectory"].items():
        assert torch.equal(v, deltas["turn"][k]), k


def test_turn_credit_trains_each_turn_on_its_own_advantage(small_path, learners):
    trajs = with_turns(batch(seed=4), split=True)
    learner = learners(make_spec(small_path, algorithm={"credit": "turn", "gamma": 0.0}))
    delta, stats = one_step_delta(learner, trajs)
    assert max(float(v.abs().max()) for v in delta.values()) > 0 and stats["actor/updates"] == 1
    assert stats["actor/advantage_abs_mean"] > 0 and stats["actor/zero_adv_groups"] == 0
    # the same batch under trajectory credit moves the weights differently
    other, _ = one_step_delta(learners(make_spec(small_path)), trajs)
    assert any(not torch.equal(v, other[k]) for k, v in delta.items())


def test_train_per_group_under_turn_credit_keeps_the_samples_whose_turns_differ(small_path, learners):
    """Every trajectory's reward is 0.5, but samples 2 and 3 of each group split it differently between their
    two turns ([1, 0] and [0, 1]; samples 0 and 1: [0.5, 0.5]). Down-sampling to 2 by trajectory reward would
    keep samples 0 and 1 (all ties; nothing to learn, no update); by turn returns it keeps 2 and 3, and the step
    is the step on those two alone."""
    split = [[0.5, 0.5], [0.5, 0.5], [1.0, 0.0], [0.0, 1.0]]
    trajs = [replace(t, turns=[Turn(text="", num_tokens=2), Turn(text="", num_tokens=sum(t.loss_mask) - 2)],
                     turn_reward=split[t.sample_index], reward=0.5) for t in batch(seed=5)]
    turn = {"credit": "turn", "gamma": 1.0}
    a, _ = one_step_delta(learners(make_spec(small_path, algorithm=turn)), [t for t in trajs if t.sample_index >= 2])
    b, stats = one_step_delta(learners(make_spec(small_path, algorithm={**turn, "train_per_group": 2})), trajs)
    assert stats["actor/down_sampled"] == 6 and stats["actor/trained_rows"] == 6
    assert_same_delta(a, b)


def test_lora_adapters_start_from_the_specs_seed(small_path, learners):
    """peft draws lora_A from torch's random stream, unseeded: two LoRA runs of one spec and seed started from
    different adapters (their samples parted from step 2 on), and a resumed run had no uninterrupted twin."""
    spec = make_spec(small_path, model={"path": small_path, "lora": {"r": 4}})
    torch.manual_seed(1)
    first = {k: v.clone() for k, v in learners(spec).engine.module.named_parameters() if "lora_A" in k}
    torch.manual_seed(2)
    second = dict(learners(spec).engine.module.named_parameters())
    assert first and all(torch.equal(second[k], v) for k, v in first.items())
    other = dict(learners(make_spec(small_path, seed=7, model={"path": small_path, "lora": {"r": 4}}))
                 .engine.module.named_parameters())
    assert not all(torch.equal(other[k], v) for k, v in first.items())
