"""The learner: a DeepSpeed engine that turns scored trajectories into policy updates.

One `step(trajs)` is one training step, each part a method or a pure function below it:
  1. `_begin`: infra-error trajectories (when the spec drops them), overlong-filtered and dropped ones
     leave the loss; the step's learning rate
  2. `batch.plan`: epochs x mini-batches x micro-batches over the kept trajectories
  3. `_before_update`: pi_old (where from: `pi_old_source`), reference and sampler log-probs, before any
     update, kept for every epoch
  4. `targets`: rewards (+ overlong penalty, + KL penalty when KL goes in the reward) -> group advantages
  5. `_train`: per mini-batch (`_update`), forward/backward each micro-batch (`_micro_loss`, normalised by
     the mini-batch totals), then one engine.step (reduce, clip, optimizer step)
  6. `step_stats`: the actor/* metrics

Data parallel over the ranks of a DeepSpeed world (the update stage's replicas): every rank receives the
whole scored batch (one object in Ray's store), so rewards, advantages and the loss normalisers
(num_tokens, num_seqs of each mini-batch) are computed from all of it, identically on every rank --
the same totals an all-reduce of the shards would give, without the round trip. The forward/backward
work is sharded (`batch.shard`); the old and reference log-probs each rank computes for its shard are
all-reduced so every rank holds all of them, and so are the loss statistics. The result does not depend
on the number of ranks (tests/test_update_ranks.py).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import factory.update.checkpoint as ckpt
from factory.algorithms import (
    ADVANTAGES,
    KL_ESTIMATORS,
    KL_TO_COME,
    Algorithm,
    kl_reward_penalty,
    kl_to_come_advantage,
    max_turn_variance_keep,
    max_variance_keep,
    policy_objective,
    rollout_mismatch,
    truncated_is_weights,
    turn_advantages,
)
from factory.allocator import running_allocator
from factory.attention import use_packed_attention
from factory.device import resolve_dtype
from factory.lora import Adapters
from factory.plan import UpdateSettings
from factory.presets import pi_old_source
from factory.types import Trajectory
from factory.update.batch import (
    MicroBatch,
    PackedBatch,
    TokenBudget,
    collate,
    collate_packed,
    kept,
    token_advantages,
    turn_rewards,
    turn_sums,
    plan,
    shaped_rewards,
    shard,
    shards,
    packs,
    padding_stats,
    run_once,
    shared_prefix,
    sort_keys,
    without_zero_advantage,
)
from factory.update.engine import (
    autocast_dtype,
    deepspeed_config,
    init_process_group,
    learning_rate,
    make_optimizer,
    partitioned_loading,
    release_process_group,
)
from factory.update.flops import ModelShape, forward_flops
from factory.update.logprobs import active_dropout, config_rates, disable_dropout, rates_as_built, response_logprobs
from factory.util import UserError


class NonFiniteUpdate(UserError):
    """Several steps in a row could not update the weights: their loss or gradient norm was inf or NaN."""


SKIPPED = "skipped_non_finite"  # a step's count of updates skipped for a non-finite value (`_train`'s sums)


class Learner:
    """The policy being trained, wrapped in a DeepSpeed engine (ZeRO stage from the spec).

    Checkpoint layout: see factory.update.checkpoint (`<dir>/step_<N>/` DeepSpeed files + `hf/`,
    `<dir>/latest`)."""

    def __init__(self, settings: UpdateSettings, chat_template: str | None = None):
        # No side effects: the actor constructs this in the driver's process description; setup() loads.
        self.spec = settings  # the update's slice of the spec (model, rollout, train, the resolved algorithm)
        self.chat_template = chat_template  # the text of the spec's chat template, for saved hf/ folders
        self.alg = settings.algorithm
        self.rank, self.world = 0, 1
        self.engine = None
        self.ref: torch.nn.Module | None = None
        self.tokenizer = None  # for the hf/ folder of checkpoints; loaded on first save
        self.steps_done = 0  # training steps completed (restored by load_checkpoint)
        self.share_prefix = False  # run a micro-batch's common prefix once (decided in setup)
        self.sync_bytes = 0  # what the last weight sync (state_dict) carried
        self.non_finite_steps = 0  # steps in a row whose every update was skipped for a non-finite value
        self.dropout: list[str] = []  # where the model drops out in training mode (decided in setup)

    # ---------------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        if self.spec.compute.device == "cpu":
            # The compiler's device (no GPU reserved). Say it before DeepSpeed guesses, loudly, on every start
            # ("Setting accelerator to CPU"), or takes a GPU this stage did not reserve.
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
        import deepspeed.comm as dist
        from transformers import AutoModelForCausalLM

        from factory.assets import resolve_model

        if self.spec.train.threads:
            torch.set_num_threads(self.spec.train.threads)
        self.model_path = resolve_model(self.spec.model.path)
        if os.path.isdir(self.model_path):  # a folder by its absolute path: the name a LoRA checkpoint's adapter
            self.model_path = os.path.abspath(self.model_path)  # config keeps, read from wherever it is exported
        init_process_group()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        config = deepspeed_config(self.spec)
        with partitioned_loading(config):  # ZeRO-3: each rank loads its part of the weights, not all of them
            model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
            self.shape = ModelShape.of(model)
            if self.spec.train.packing != "off":  # packed rows need attention that stays inside each row
                use_packed_attention(model)
            # the engine sampled without dropout: the ratio's log-probs and the gradient are of that function
            self.config_rates = config_rates(model)  # what the saved config.json keeps (the export's model)
            self.dropped_out = disable_dropout(model) if self.spec.train.disable_dropout else []
            self.lora = self.spec.model.lora
            if self.lora is not None:  # adapters beside the frozen weights: only they require grad
                from peft import get_peft_model

                from factory.lora import peft_config

                # from the spec's seed, as everything random in a run is: peft draws lora_A from torch's stream,
                # so two runs of one spec started from different adapters and parted from step 2 on
                with torch.random.fork_rng(devices=[]):  # (the CPU's stream only: peft builds them on the CPU)
                    torch.random.default_generator.manual_seed(self.spec.seed)
                    model = get_peft_model(model, peft_config(self.lora))
            if self.spec.train.gradient_checkpointing:
                # non-reentrant: the variant that works under ZeRO-3's parameter gathering
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.optimizer = make_optimizer(self.spec, [p for p in model.parameters() if p.requires_grad])
            self.engine, *_ = deepspeed.initialize(model=model, optimizer=self.optimizer, config=config)
        self.engine.train()
        self.amp = autocast_dtype(self.spec)
        # HF drops the KV cache under gradient checkpointing; ZeRO-3 ranks must run paired forwards; under
        # dropout a shared prefix would share one dropout mask across the rows (logprobs.active_dropout)
        self.dropout = active_dropout(model)
        self.share_prefix = (self.spec.train.share_prefix and not self.spec.train.gradient_checkpointing
                             and not (self.engine.zero_optimization_stage() == 3 and self.world > 1)
                             and not self.dropout)
        if self.alg.needs_reference and self.lora is not None:
            self.ref = AdaptersOff(self.engine.module)  # the base model IS the reference: no second copy
        elif self.alg.needs_reference:  # only then: a second copy of the weights is not free
            self.ref = self._reference(config)
        # the rollout engine's dtype, by the rule its own stage applies (a learner built outside a plan: float32):
        # a guess where this device is not the rollout's, which the driver corrects once both are placed
        rollout = self.spec.rollout_compute
        self.sync_dtype = _DTYPES[resolve_dtype(rollout) if rollout is not None else "float32"]

    def _reference(self, config: dict[str, Any]) -> Any:
        """The frozen reference model for the KL term, in the policy's dtype. Under ZeRO-3 partitioned as the
        policy is: a DeepSpeed engine without an optimizer, each rank holding its part and gathering a layer
        at a time in the forward (so every rank runs every reference forward, stand-ins too): a whole copy per
        rank is the largest fixed item of a rank's memory on a real model (docs/scale.md). Else a whole copy."""
        import deepspeed
        from transformers import AutoModelForCausalLM

        if self.engine.zero_optimization_stage() != 3:
            ref = model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self._module_dtype())
            ref.requires_grad_(False).eval().to(self.engine.device)
        else:
            zero = {k: v for k, v in config["zero_optimization"].items() if k != "offload_optimizer"}
            frozen = {**config, "zero_optimization": zero}  # no optimizer: nothing to offload
            with partitioned_loading(frozen):
                model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
                model.requires_grad_(False)
                ref, *_ = deepspeed.initialize(model=model, config=frozen)
            ref.eval()
        if self.spec.train.packing != "off":
            use_packed_attention(model)  # the HF module (the engine's, under ZeRO-3)
        return ref

    def resolved(self) -> dict[str, str]:
        """What this learner computes with, as chosen for its device: the run's params record it."""
        return {"device": torch.device(self.engine.device).type,
                "dtype": str(self._module_dtype()).removeprefix("torch."),
                "autocast": str(self.amp).removeprefix("torch.") if self.amp is not None else "off",
                "share_prefix": "on" if self.share_prefix else "off (dropout)" if self.dropout and
                                self.spec.train.share_prefix else "off",
                "packing": self.spec.train.packing,
                "allocator": running_allocator(),
                "dropout": f"on ({', '.join(self.dropout)})" if self.dropout else "off (disabled)" if self.dropped_out
                else "off",
                "weight_sync": f"adapters ({str(self.sync_dtype).removeprefix('torch.')})" if self.lora is not None
                else f"full ({str(self.sync_dtype).removeprefix('torch.')})"}

    def use_sync_dtype(self, dtype: str) -> dict[str, str]:
        """Send weights in `dtype` from now on: the rollout engine's, as its stage resolved it on its own device.
        Guessed here on the update's device, an update on the CPU beside a GPU rollout (Ray hides the GPUs from a
        stage that reserves none) sent float32 to a bf16 engine: twice the bytes. Returns `resolved()`."""
        self.sync_dtype = _DTYPES[dtype]
        return self.resolved()

    def _module_dtype(self) -> torch.dtype:
        return next(self.engine.module.parameters()).dtype

    # ----------------------------------------------------------------------------------------- step
    def step(self, trajs: list[Trajectory]) -> dict[str, float]:
        """One training step on a scored rollout batch; returns the actor/* and timing metrics."""
        t0 = time.perf_counter()
        assert self.engine is not None, "call setup() first"
        alg, micro_batch = self.alg, self.spec.train.micro_batch
        sub, stats = self._begin(trajs)
        if not sub:  # nothing to learn from; the step still counts so the LR schedule stays aligned
            self.steps_done += 1
            return {**stats, "actor/tokens": 0.0, "actor/updates": 0.0, "actor/skipped_non_finite": 0.0,
                    "actor/trained_rows": 0.0}

        lengths = sort_keys(sub, self.share_prefix)
        budget = TokenBudget.of(self.spec.train.micro_batch_tokens, sub, self.share_prefix)
        schedule = plan(len(sub), lengths, alg.mini_batches, micro_batch, alg.epochs,
                        seed=self.spec.seed * 100_003 + self.steps_done * 101, budget=budget)
        first_epoch = shard(schedule, self.rank, self.world, micro_batch, budget)[: len(schedule) // alg.epochs]
        t_old = time.perf_counter()
        before = self._before_update(sub, schedule, first_epoch)
        stats["timing/update_fwd_old_s"] = time.perf_counter() - t_old
        target = targets(sub, alg, self.spec.rollout.max_total_tokens, before.old, before.ref, before.mask)
        if not bool(torch.isfinite(target.adv).all()):  # a value from outside that was not finite: no update at all
            return self._skipped(stats, "advantages")

        # Rows whose advantage is exactly 0 add exactly 0 to the loss's gradient when nothing else is in the
        # loss (no KL term, no entropy bonus): the update skips them (batch.without_zero_advantage), keeping
        # each mini-batch's normalisers over all its rows. Only without a pre-update pass, whose micro-batches
        # must be the update's for the first ratio to be 1 bit for bit.
        skip = before.ref is None and alg.entropy_coef == 0 and not before.own_pass
        update_plan = without_zero_advantage(schedule, target.adv, micro_batch, budget) if skip else schedule
        # A mini-batch left with no rows runs one stand-in sample with weight 0 (see _update): its optimizer
        # step then sees zero gradients, as without skipping, so Adam's moments move the same way.
        update_mine = [micros or [[]] for micros in shard(update_plan, self.rank, self.world, micro_batch, budget)]

        t_train = time.perf_counter()
        sums = self._train(sub, schedule, update_plan, update_mine, before, target.adv)
        stats["timing/update_train_s"] = time.perf_counter() - t_train
        stats.update(mismatch_stats(before.mismatch))
        self.steps_done += 1
        stats.update(step_stats(sums, schedule, update_plan, alg.epochs, before, target))
        def ran(sched: list[list[list[int]]]) -> list[list[int]]:  # every rank's micro-batches of `sched`
            return [m for part in shards(sched, self.world, micro_batch, budget) for mbs in part for m in mbs if m]

        stats.update(padding_stats([[sub[i] for i in micro] for micro in ran(update_plan)], self.spec.train.packing))
        # the largest rank's, as the FLOP/s below are the world's: the ranks' memory is what runs out
        stats["perf/update_max_rss_gb"] = self._all_max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
        if self.sync_bytes:  # the sync that brought the weights this step sampled with (step 1's came from disk)
            stats["perf/weight_sync_mb"] = self.sync_bytes / 1e6
        elapsed = stats["timing/update_step_s"] = time.perf_counter() - t0
        # model tokens of the rows trained (once per epoch; a skipped row's are not) per second of the whole
        # step, old-log-prob pass included
        stats["perf/update_tokens_per_s"] = stats["actor/trained_tokens"] * alg.epochs / max(elapsed, 1e-9)
        stats["perf/update_flops_per_s"] = (
            # LoRA's backward computes no gradient of the frozen weights: forward + input gradients only
            (self._pass_flops(sub, ran(update_plan[: len(update_plan) // alg.epochs])) * (2 if self.lora else 3) * alg.epochs
             + self._pass_flops(sub, ran(schedule[: len(schedule) // alg.epochs])) * (before.own_pass + (before.ref is not None)))
            / max(elapsed, 1e-9))
        return stats

    def _begin(self, trajs: list[Trajectory]) -> tuple[list[Trajectory], dict[str, float]]:
        """The trajectories that train this step (see batch.kept) and the step's learning rate, set on
        the optimizer; with the first stats (how many were dropped, how many down-sampled, the LR)."""
        keep = kept(trajs, self.alg, self.spec.rollout.drop_infra_errors)
        sub = [t for t, k in zip(trajs, keep) if k]
        stats = {"actor/dropped": float(len(trajs) - len(sub))}
        if self.alg.train_per_group is not None and sub:  # after the drops: the kept m are trainable ones
            shaped = shaped_rewards(sub, self.alg, self.spec.rollout.max_total_tokens)
            groups = torch.tensor([t.prompt_index for t in sub])
            # under turn credit, by the spread of what it standardises: the turn returns, position by position
            chosen = (max_turn_variance_keep(turn_rewards(sub, shaped), groups, self.alg.train_per_group, self.alg.gamma)
                      if self.alg.credit == "turn" else max_variance_keep(shaped, groups, self.alg.train_per_group))
            stats["actor/down_sampled"] = float(len(sub) - int(chosen.sum()))
            sub = [t for t, k in zip(sub, chosen.tolist()) if k]
        lr = learning_rate(self.spec, self.steps_done + 1)
        for group in self.optimizer.param_groups:  # DeepSpeed's ZeRO wrappers share these dicts
            group["lr"] = lr
        return sub, {**stats, "actor/lr": lr}

    def _before_update(self, sub: list[Trajectory], schedule: list[list[list[int]]],
                       first_epoch: list[list[list[int]]]) -> BeforeUpdate:
        """pi_old, the reference log-probs and the sampler's, before any optimizer step (see pi_old_source):
        a pass runs over the first epoch's exact micro-batches (this rank's), so the first mini-batch
        sees ratio 1 bit for bit."""
        sampler = _rollout_logprobs(sub)  # [n, Rmax] the sampler's, or None when the engine gave none
        source = pi_old_source(self.alg.use_rollout_logprobs, self.alg.rollout_correction is not None,
                               stale=self.spec.train.max_staleness > 0, updates=len(schedule),
                               kl_in_reward=self.ref is not None and self.alg.kl_apply == "reward",
                               recorded=sampler is not None)
        old, ref, entropy = self._logprobs_before_update(sub, first_epoch, policy=source.own_pass)
        mask = _padded([t.loss_mask for t in sub], 0.0)  # [n, Rmax]
        # The learner's pre-update log-probs vs the sampler's on the same tokens: from the pass when
        # there was one, else from the first mini-batch's update pass (still the sampling weights).
        mismatch = [0.0, 0.0, 0.0]  # sum, count, max
        if old is not None and sampler is not None:
            mismatch = list(rollout_mismatch(old, sampler, mask))
        return BeforeUpdate(old=sampler if source.from_rollout else old, ref=ref, entropy=entropy,
                            sampler=sampler, mask=mask, mismatch=mismatch, own_pass=source.own_pass)

    def _train(self, sub: list[Trajectory], schedule: list[list[list[int]]], update_plan: list[list[list[int]]],
               update_mine: list[list[list[int]]], before: BeforeUpdate, adv: Tensor) -> dict[str, float]:
        """One optimizer step per mini-batch of `schedule`, running this rank's `update_mine` (its share of
        `update_plan`); returns the loss statistics summed over the mini-batches and the ranks. When no
        pass measured the sampler mismatch, the first mini-batch's update pass does (into before.mismatch)."""
        sums: dict[str, float] = defaultdict(float)
        norms = []
        measured = before.mismatch[1] == 0 and before.sampler is not None
        for i, (minibatch, micros) in enumerate(zip(schedule, update_mine)):
            measure = before.mismatch if i == 0 and measured else None
            part, norm = self._update(sub, minibatch, micros, before, adv, measure,
                                      computed=[j for m in update_plan[i] for j in m])
            for key, value in part.items():
                sums[key] += value
            norms.append(norm)
        sums = self._all_sum_stats(sums)
        skipped = sum(n is not None and not math.isfinite(n) for n in norms)  # updates not applied (see _update)
        finite = [n for n in norms if n is not None and math.isfinite(n)]
        if all(n is not None for n in norms) and finite:
            sums["grad_norm"] = sum(finite) * len(norms) / len(finite)  # the mean below is over the applied ones
        sums[SKIPPED] = float(skipped)  # the same on every rank: the gradient norm is global
        self._count_non_finite(skipped == len(norms) and not self._loss_scale_settling())
        if measured:  # each rank measured its share of the first mini-batch
            before.mismatch = self._all_mismatch(before.mismatch)
        return sums

    def _loss_scale_settling(self) -> bool:
        """Whether an fp16 update's overflow is DeepSpeed's dynamic loss scale settling (it starts at 2^16 and halves
        at each overflow, skipping that update) rather than a broken run: so while the scale is above its floor
        (at the floor DeepSpeed raises by itself). Counted as non-finite, three such warm-up steps stopped a
        healthy fp16 run (train.max_non_finite_steps)."""
        if not self.engine.fp16_enabled():
            return False
        scaler = getattr(self.engine.optimizer, "loss_scaler", None)
        return (getattr(scaler, "dynamic", False)
                and getattr(scaler, "cur_scale", 0.0) > getattr(scaler, "min_scale", float("inf")))

    def _collate(self, group: list[Trajectory]) -> MicroBatch | PackedBatch:
        """One micro-batch's tensors: packed where `packs` says so (actor/packed_frac counts the same), else
        right-padded. Packed rows leave out the prefix they share when it is run once (`share_prefix`)."""
        if not packs(self.spec.train.packing, group):
            return collate(group)
        return collate_packed(group, run_once(len(group), shared_prefix(group)) if self.share_prefix else 0)

    def _skipped(self, stats: dict[str, float], what: str) -> dict[str, float]:
        """A step that updates nothing because its `what` are not finite; counted, and the LR schedule kept."""
        self._count_non_finite(True, what)
        self.steps_done += 1
        return {**stats, "actor/tokens": 0.0, "actor/updates": 0.0, "actor/skipped_non_finite": 1.0}

    def _count_non_finite(self, whole_step: bool, what: str = "loss or gradient norm") -> None:
        """Steps in a row that skipped every update for a non-finite value: `train.max_non_finite_steps` of
        them stop the run (the weights stay those of the last good step, as do the checkpoints). Called before
        this step is counted in `steps_done`."""
        self.non_finite_steps = self.non_finite_steps + 1 if whole_step else 0
        limit = self.spec.train.max_non_finite_steps
        if limit and self.non_finite_steps >= limit:
            raise NonFiniteUpdate(
                f"{self.non_finite_steps} steps in a row had a non-finite {what} (inf or NaN), and their updates "
                f"were skipped: the weights are still those of step {self.steps_done + 1 - self.non_finite_steps}. "
                "Look at actor/skipped_non_finite and the rewards' non_finite counts; a lower train.lr or "
                "train.optimizer.grad_clip usually helps (train.max_non_finite_steps: 0 goes on regardless)")

    def _pass_flops(self, sub: list[Trajectory], micros: list[list[int]]) -> float:
        """FLOPs of one forward over the micro-batches `micros` (every rank's) as the learner runs them:
        with prefix sharing, each micro-batch's shared prefix once."""
        total = 0.0
        for micro in micros:
            group = [sub[i] for i in micro]
            shared = run_once(len(group), shared_prefix(group)) if self.share_prefix else 0
            total += forward_flops(self.shape, [(len(t.prompt_ids), len(t.response_ids)) for t in group], shared)
        return total

    def logprobs(self, trajs: list[Trajectory]) -> Tensor:
        """[N, max response length] log-probs of every response token under the current policy (no
        grad; zeros past each response). For evaluation and tests; step() uses the same code path."""
        lengths = sort_keys(trajs, self.share_prefix)
        train = self.spec.train
        budget = TokenBudget.of(train.micro_batch_tokens, trajs, self.share_prefix)
        schedule = plan(len(trajs), lengths, 1, train.micro_batch, 1, 0, budget=budget)
        mine = shard(schedule, self.rank, self.world, train.micro_batch, budget)
        return self._logprobs_before_update(trajs, mine)[0]

    @torch.no_grad()
    def _logprobs_before_update(self, sub: list[Trajectory], micro_plan: list[list[list[int]]], *,
                                policy: bool = True) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """[n, Rmax] log-probs of the policy that sampled (old) and its entropy (for the stat) when
        `policy`, and of the reference model when there is one; None for what is not computed. All
        over the same micro-batches (this rank's; an empty one is a stand-in forward that keeps ZeRO-3's
        parameter gathers paired across ranks), then summed over the ranks, each row being one rank's;
        zeros past each response."""
        width = max(max(len(t.response_ids) for t in sub), 1)
        old = torch.zeros(len(sub), width) if policy else None
        entropy = torch.zeros(len(sub), width) if policy else None
        ref = torch.zeros(len(sub), width) if self.ref is not None else None
        if old is None and ref is None:
            return None, None, None
        temperature = self.spec.rollout.temperature
        for minibatch in micro_plan:
            for micro in minibatch:
                mb = self._collate([sub[i] for i in micro or [0]]).to(self.engine.device)
                if old is not None:
                    logp, ent = response_logprobs(self.engine, mb, amp=self.amp, temperature=temperature,
                                                  entropy=True, share_prefix=self.share_prefix)
                    if micro:
                        old[micro, : logp.shape[1]], entropy[micro, : logp.shape[1]] = logp.cpu(), ent.cpu()
                if ref is not None:  # a stand-in too: a ZeRO-3 reference's gathers pair up across the ranks
                    logp = response_logprobs(self.ref, mb, amp=self.amp, temperature=temperature,
                                             share_prefix=self.share_prefix)[0]
                    if micro:
                        ref[micro, : logp.shape[1]] = logp.cpu()
        old, ref, entropy = (self._all_sum(x) for x in (old, ref, entropy))
        valid = torch.arange(width) < torch.tensor([len(t.response_ids) for t in sub])[:, None]  # [n, Rmax]

        def zero(x: Tensor | None) -> Tensor | None:
            return None if x is None else torch.where(valid, x, 0.0)

        return zero(old), zero(ref), zero(entropy)

    def _update(self, sub: list[Trajectory], minibatch: list[list[int]], micros: list[list[int]],
                before: BeforeUpdate, adv: Tensor, measure: list[float] | None,
                computed: list[int]) -> tuple[dict[str, float], float | None]:
        """Accumulate one mini-batch's gradient over this rank's micro-batches (`micros`, its share of
        `minibatch`) and take one optimizer step; returns this rank's stats and the global gradient norm.
        policy_objective normalises each micro-batch by the whole mini-batch's totals and returns stats
        as shares, so summing both over micro-batches (and ranks) gives the mini-batch's exact loss and
        stats; engine.backward(scale_wrt_gas=False) adds gradients unscaled (gradient_accumulation_steps
        is 1 and the accumulation boundary is ours: managed_gradient_accumulation=false).
        `measure` ([sum, count, max]) collects this rank's rollout/learner log-prob mismatch; `computed`:
        the mini-batch's rows the update runs (all of them unless zero-advantage rows are skipped), over
        which the token stats are."""
        engine, mask = self.engine, before.mask
        members = [i for micro in minibatch for i in micro]
        totals = {"num_tokens": float(mask[members].sum()), "num_seqs": float(len(members)),
                  "max_len": self.spec.rollout.max_total_tokens}
        out: dict[str, float] = defaultdict(float)
        for micro in micros:
            # An empty micro-batch (this rank ran out of samples) runs a stand-in sample with weight 0,
            # so its forward and backward still pair up with the other ranks' collectives.
            weight = 1.0 if micro else 0.0
            loss, st = self._micro_loss(sub, micro or members[:1], before, adv, totals, measure if weight else None)
            if not bool(torch.isfinite(loss)):
                # A non-finite loss can still give finite gradients (the clipped objective's max takes the
                # finite branch): an update from a loss nobody can read. Make its gradient not finite, so the
                # update is skipped as one with a NaN gradient is (ZeRO 1-3: DeepSpeed's overflow check, which
                # every rank sees through the gradient all-reduce; stage 0: ours, below).
                loss = loss * math.nan
            # DeepSpeed averages gradients over the ranks; each rank's loss is its share of the
            # mini-batch's loss, whose gradient is the SUM of the shares: scale by the world size.
            engine.backward(loss * (weight * self.world), scale_wrt_gas=False)
            for key, value in st.items():
                out[key] += weight * float(value)
        if len(computed) < len(members):
            # the stats are shares of the whole mini-batch's tokens: make them means over the rows run
            scale = totals["num_tokens"] / max(float(mask[computed].sum()), 1.0)
            out = {k: v if k == "pg_loss" else v * scale for k, v in out.items()}
        # ZeRO's optimizers report the global norm they clip with; plain stage 0 (fp32, no wrapper, one
        # rank: the compiler asks for ZeRO when there are several) reports none, so there we measure it
        # on the module's gradients before they are consumed.
        local = _grad_norm(engine.module) if engine.zero_optimization_stage() == 0 else None
        if local is not None and not math.isfinite(local):
            # ZeRO 1-3 skip an update whose gradient norm is inf/NaN themselves (and report it so); stage 0
            # would apply it: a NaN in every weight from then on.
            engine.zero_grad()
            return out, math.inf
        engine.step()
        norm = engine.get_global_grad_norm()
        norm = local if norm is None else norm
        return out, None if norm is None else float(norm)

    def _micro_loss(self, sub: list[Trajectory], micro: list[int], before: BeforeUpdate, adv: Tensor,
                    totals: dict[str, float], measure: list[float] | None) -> tuple[Tensor, dict[str, Tensor]]:
        """One micro-batch's share of its mini-batch's loss (with grad) and stats. Without a pre-update pass
        (on-policy, or pi_old from the rollout) this pass also measures the entropy stat, without grad, and
        pi_old is its own log-probs, detached; `measure` adds its learner/sampler mismatch."""
        alg, dev = self.alg, self.engine.device
        mb = self._collate([sub[i] for i in micro]).to(dev)
        logp, ent = response_logprobs(self.engine, mb, amp=self.amp, temperature=self.spec.rollout.temperature,
                                      entropy=before.entropy is None or alg.entropy_coef > 0,
                                      entropy_grad=alg.entropy_coef > 0, share_prefix=self.share_prefix)
        r = logp.shape[1]
        old_logp = logp.detach() if before.old is None else before.old[micro, :r].to(dev)
        sampler = before.sampler[micro, :r].to(dev) if before.sampler is not None else None
        if measure is not None and sampler is not None:
            part = rollout_mismatch(logp.detach(), sampler, mb.mask)
            measure[0], measure[1], measure[2] = measure[0] + part[0], measure[1] + part[1], max(measure[2], part[2])
        weights = None
        if alg.rollout_correction == "tis" and sampler is not None:
            weights = truncated_is_weights(old_logp, sampler, mb.mask, alg.rollout_correction_cap)
        ref = before.ref[micro, :r].to(dev) if before.ref is not None and alg.kl_apply == "loss" else None
        rows = adv[micro] if adv.dim() == 1 else adv[micro, :r]  # [B], or [B, r] (turn credit, KL to come)
        return policy_objective(alg, logp, old_logp, rows.to(dev), mb.mask, ref_logp=ref, entropy=ent,
                                is_weights=weights, **totals)

    def _all_sum(self, x: Tensor | None) -> Tensor | None:
        """x summed over the ranks (x itself with one rank)."""
        if x is None or self.world == 1:
            return x
        import deepspeed.comm as dist

        on_device = x.to(self.engine.device)  # nccl reduces CUDA tensors, gloo CPU ones
        dist.all_reduce(on_device)
        return on_device.cpu()

    def _all_sum_stats(self, stats: dict[str, float]) -> dict[str, float]:
        """Per-rank shares of the loss statistics, summed over the ranks (every rank has the same keys:
        stand-in micro-batches report theirs with weight 0)."""
        keys = sorted(stats)
        total = self._all_sum(torch.tensor([stats[k] for k in keys], dtype=torch.float64))
        return dict(zip(keys, total.tolist()))

    def _all_mismatch(self, mismatch: list[float]) -> list[float]:
        """[sum, count, max] of the log-prob mismatch over the ranks' shares."""
        if self.world == 1:
            return mismatch
        sums = self._all_sum(torch.tensor(mismatch[:2], dtype=torch.float64)).tolist()
        return [*sums, self._all_max(mismatch[2])]

    def _all_max(self, value: float) -> float:
        """value's largest over the ranks (value itself with one rank)."""
        if self.world == 1:
            return value
        import deepspeed.comm as dist

        peak = torch.tensor([value], dtype=torch.float64, device=self.engine.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return float(peak)

    # ------------------------------------------------------------------------- weights, checkpoints
    def state_dict(self, every_rank: bool = False, copy: bool = True) -> dict[str, Tensor] | Adapters | None:
        """What a weight sync sends, in the rollout engine's dtype (`sync_dtype`: a bf16 engine gets bf16, half
        the bytes; the cast is the one the engine would make), on rank 0 (None elsewhere, unless
        `every_rank`); gathered from the ranks' shards under ZeRO-3 (every rank must call it then).

        Full weights: under Hugging Face names, tied weights under both names (one tensor), as
        `module.state_dict()` (vLLM's reload needs lm_head.weight). With LoRA: the adapters only
        (factory.lora.Adapters), the frozen weights never change. `copy=False`: full weights may be the live
        tensors (see `weights`)."""
        out = (self.adapters(every_rank, dtype=self.sync_dtype) if self.lora is not None
               else self.weights(every_rank, dtype=self.sync_dtype, copy=copy))
        if out is not None:  # for the next step's perf/weight_sync_mb (tied tensors count once)
            tensors = out.tensors if isinstance(out, Adapters) else out
            self.sync_bytes = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in tensors.values()}.values())
        return out

    def weights(self, every_rank: bool = False, dtype: torch.dtype | None = None,
                copy: bool = True) -> dict[str, Tensor] | None:
        """The full weights on CPU under Hugging Face names, in `dtype` (default: the module's). With
        `copy=False`, without ZeRO-3, on a CPU and in the module's dtype they are the live tensors: for the
        update actor's answer to a weight sync, which Ray copies into its object store as the call returns,
        before the next update can touch them (one copy of 0.5 GB less per sync for SmolLM2 in float32)."""
        module = self.engine.module
        if self.engine.zero_optimization_stage() == 3:
            weights = self._gathered(module, every_rank or self.rank == 0, dtype)
            if weights is None:
                return None
        else:
            if self.rank != 0 and not every_rank:
                return None
            copies: dict[int, Tensor] = {}  # keep tied tensors tied: one copy per storage
            weights = {k: copies.setdefault(v.data_ptr(), v.detach().to("cpu", dtype=dtype or v.dtype, copy=copy))
                       for k, v in module.state_dict().items()}
        _check_finite(weights)  # never synced to the rollout, nor checkpointed (save_checkpoint gathers here)
        return weights

    @staticmethod
    def _gathered(module: torch.nn.Module, keep: bool, dtype: torch.dtype | None) -> dict[str, Tensor] | None:
        """ZeRO-3's full weights on CPU (on the ranks that `keep` them; every rank must call it), gathered
        GATHER_BYTES of parameters at a time and copied out before the next: the whole model gathered at
        once sat on every rank's GPU beside its shards (64 GB for a 32B model in bf16)."""
        import deepspeed

        state = module.state_dict(keep_vars=True)  # the Parameter objects: tied names share one
        params = list({id(v): v for v in state.values() if hasattr(v, "ds_numel")}.values())
        copies: dict[int, Tensor] = {}
        for bucket in buckets([p.ds_numel * p.element_size() for p in params], GATHER_BYTES):
            chunk = [params[i] for i in bucket]
            with deepspeed.zero.GatheredParameters(chunk, modifier_rank=None):
                if keep:  # a gathered tensor is freed when the gather ends: copied
                    copies.update({id(p): p.detach().to("cpu", dtype=dtype or p.dtype, copy=True) for p in chunk})
        if not keep:
            return None
        return {k: copies[id(v)] if id(v) in copies else v.detach().to("cpu", dtype=dtype or v.dtype, copy=True)
                for k, v in state.items()}  # buffers are whole on every rank

    def adapters(self, every_rank: bool = False, dtype: torch.dtype | None = None) -> Adapters | None:
        """The LoRA adapters (peft's names, as its adapter files hold them) on CPU in `dtype` (default:
        their own), with the scale they are added with."""
        import deepspeed
        from peft import get_peft_model_state_dict

        from factory.lora import Adapters, scale

        module = self.engine.module
        trained = [p for p in module.parameters() if p.requires_grad]
        gather = (deepspeed.zero.GatheredParameters(trained, modifier_rank=None)
                  if self.engine.zero_optimization_stage() == 3 else contextlib.nullcontext())
        with gather:
            if self.rank != 0 and not every_rank:
                return None
            tensors = {k: v.detach().to("cpu", dtype=dtype or v.dtype, copy=True)
                       for k, v in get_peft_model_state_dict(module).items()}
        _check_finite(tensors)  # adapters with inf/NaN are synced nowhere either
        # peft's adapter_config.json as a plain dict (sets as lists), for an engine that loads an adapter folder
        config = json.loads(json.dumps(module.peft_config["default"].to_dict(),
                                       default=lambda v: sorted(v) if isinstance(v, set) else str(v)))
        return Adapters(tensors, scale(self.lora), version=self.steps_done, config=config)

    def save_checkpoint(self, directory: str, step: int, state: dict[str, Any] | None = None) -> str:
        """Save `<dir>/step_<step>/`: DeepSpeed model + optimizer + {step, rng, non-finite run}, `state`
        (the driver's: data position, run id; JSON) and an `hf/` folder that transformers loads, with the
        run's chat template. Written under a staging name and committed by one rename (factory.update.checkpoint), so
        a crash at any point leaves `latest` naming a complete checkpoint; then only the newest
        `train.keep_checkpoints` are kept. Every rank must call it. Returns the step folder."""
        import deepspeed.comm as dist

        name = ckpt.tag(step)
        staged = ckpt.staging(directory, name)
        if dist.get_rank() == 0:
            ckpt.clear_staging(directory, name)
        dist.barrier()
        # With LoRA the frozen weights are the model folder's: the checkpoint holds the adapters and their
        # optimizer state only.
        with _tied_frozen_left_out(self.engine) if self.lora is not None else contextlib.nullcontext():
            # the run of non-finite steps too: a run killed mid-run would otherwise get train.max_non_finite_steps
            # more such steps in a row after each resume, and never stop
            self.engine.save_checkpoint(directory, tag=staged,
                                        client_state={"step": step, "rng": ckpt.rng_state(),
                                                      "non_finite": self.non_finite_steps},
                                        save_latest=False, exclude_frozen_parameters=self.lora is not None)
        weights = self.adapters() if self.lora is not None else self.weights()
        if dist.get_rank() == 0:
            folder = Path(directory) / staged
            if self.lora is not None:  # peft's adapter folder (config names the base model's folder)
                self.engine.module.save_pretrained(folder / ckpt.ADAPTER, state_dict=weights.tensors)
                self._tokenizer().save_pretrained(folder / ckpt.ADAPTER)
            else:
                with rates_as_built(self.engine.module.config, self.config_rates):
                    self.engine.module.save_pretrained(folder / ckpt.HF, state_dict=weights)
                self._tokenizer().save_pretrained(folder / ckpt.HF)
            ckpt.readable(folder / (ckpt.ADAPTER if self.lora is not None else ckpt.HF))  # a model to serve
            ckpt.write_run_state(folder, {"step": step, **(state or {})})
        dist.barrier()  # every rank's shards are written before the folder is committed
        if dist.get_rank() == 0:
            ckpt.commit(directory, name, keep=self.spec.train.keep_checkpoints)
        dist.barrier()
        return str(Path(directory) / name)

    def _tokenizer(self):
        """Loaded on first save only: parsing a 150k-token tokenizer.json takes ~1 s, and the update
        itself never needs text. It carries the run's chat template (the spec's, when it names one), so
        `apply_chat_template` on the saved folder, and a vLLM server of it, format chats as the run did."""
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            from factory.assets import resolve_model

            self.tokenizer = AutoTokenizer.from_pretrained(resolve_model(self.spec.model.tokenizer or self.model_path))
            if self.chat_template is not None:
                self.tokenizer.chat_template = self.chat_template
        return self.tokenizer

    def load_checkpoint(self, directory: str, name: str | None = None) -> int | None:
        """Resume from checkpoint `name` (`step_<N>`; default: the one `<dir>/latest` names): weights,
        optimizer state, step, RNG and the run of non-finite steps. None when there is none."""
        name = name or ckpt.read_latest(directory)
        if name is None:
            return None
        # The spec's optimizer settings, as the fresh optimizer holds them: torch's load_state_dict keeps the saved
        # param groups' (weight_decay, betas, ...), and DeepSpeed's ZeRO and bf16 wrappers the saved clip_grad, so a
        # resume under changed train.optimizer settings (--allow-spec-change) trained with the old ones.
        settings = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        # LoRA checkpoints hold no frozen weights: those stay as loaded from the model folder
        path, client = self.engine.load_checkpoint(directory, tag=name, load_module_strict=self.lora is None)
        if path is None:
            raise FileNotFoundError(f"{directory}/latest names {name!r} but DeepSpeed could not load it")
        for group, own in zip(self.optimizer.param_groups, settings, strict=True):
            group.update(own)
        if hasattr(self.engine.optimizer, "clip_grad"):
            self.engine.optimizer.clip_grad = self.spec.train.optimizer.grad_clip
        ckpt.set_rng_state(client["rng"])
        self.steps_done = int(client["step"])
        self.non_finite_steps = int(client.get("non_finite", 0))  # checkpoints saved before it was kept lack it
        return self.steps_done

    def shutdown(self) -> None:
        """Release the engine and the process group (a later setup() in this process starts afresh)."""
        for engine in (self.ref, self.engine):  # (a ZeRO-3 reference is an engine too)
            if hasattr(engine, "destroy"):
                engine.destroy()
        self.engine = self.ref = None
        release_process_group()


class AdaptersOff:
    """The KL reference of a LoRA run: the policy's own module with its adapters switched off (peft's
    `disable_adapter`), which is the frozen base model -- no second copy of the weights. Called like a model."""

    def __init__(self, module: torch.nn.Module):
        self.module = module  # not a submodule of anything: .eval()/.requires_grad_ on us never reach it

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # the engine keeps the policy in training mode: under `train.disable_dropout: false` the base model's
        # dropout would noise the reference (a full-weight run's copy is in eval mode); called under no_grad
        training = self.module.training
        self.module.eval()
        try:
            with self.module.disable_adapter():
                return self.module(*args, **kwargs)
        finally:
            self.module.train(training)


GATHER_BYTES = 1 << 30  # a weight sync's ZeRO-3 gather: parameters gathered together at most (one larger goes alone)


def buckets(sizes: list[int], limit: int) -> list[list[int]]:
    """Consecutive indices of `sizes`, in runs whose sizes sum to at most `limit` (a size over it alone)."""
    out: list[list[int]] = []
    total = limit + 1
    for i, size in enumerate(sizes):
        if total + size > limit:
            out.append([])
            total = 0
        out[-1].append(i)
        total += size
    return out


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _rollout_logprobs(trajs: list[Trajectory]) -> Tensor | None:
    """[n, Rmax] the sampler's log-prob of every response token (0 on tool/template tokens and padding),
    or None when some trajectory has none recorded (an engine that reports none, a hand-made record)."""
    if any(len(t.sampler_logprobs) != len(t.response_ids) for t in trajs):
        return None
    return _padded([t.sampler_logprobs for t in trajs], 0.0)


def _check_finite(weights: dict[str, Tensor]) -> None:
    """Weights with an inf or NaN go nowhere: the updates that could make them are skipped (see `_update`),
    so one here is a bug or a path we did not foresee, and it must not reach the rollout or a checkpoint.

    Each tensor's sum first: an inf or NaN anywhere makes it non-finite, so a finite sum clears the tensor
    in one read (SmolLM2's 0.54 GB: 0.02 s, against 0.31 s for `isfinite(...).all()`, which writes a bool
    per weight: a quarter of a CPU weight sync). Only a non-finite sum -- a real inf/NaN, or finite weights
    whose sum overflows -- is looked at element by element."""
    bad = [k for k, v in weights.items() if v.is_floating_point() and not math.isfinite(v.sum())
           and not bool(torch.isfinite(v).all())]
    if bad:
        raise NonFiniteUpdate(f"the policy's weights hold inf or NaN ({', '.join(bad[:3])}"
                              f"{', ...' if len(bad) > 3 else ''}): not synced to the rollout, not checkpointed")


def _grad_norm(module: torch.nn.Module) -> float | None:
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else None


def _padded(rows: list[list[int]], fill: float) -> Tensor:
    """[n, max(len, 1)] float tensor of ragged rows."""
    out = torch.full((len(rows), max(max(len(r) for r in rows), 1)), fill)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=out.dtype)
    return out


def _zero_groups(adv: Tensor, groups: Tensor) -> int:
    """Groups whose every advantage is exactly 0 (all rewards agreed): they teach nothing this step."""
    return sum(int((adv[groups == g] == 0).all()) for g in groups.unique())


# ------------------------------------------------------------------ the step's decisions, as pure functions
@dataclass
class BeforeUpdate:
    """What a step knows before its first optimizer step: [n, Rmax] tensors over the kept rows."""

    old: Tensor | None  # pi_old; None: the update pass's own log-probs, detached (see pi_old_source)
    ref: Tensor | None  # the reference model's, when there is one
    entropy: Tensor | None  # measured by the pre-update pass; None: the first update pass measures it
    sampler: Tensor | None  # the rollout engine's, when it recorded them
    mask: Tensor  # 1 on model tokens
    mismatch: list[float]  # [sum, count, max] |learner - sampler| log-prob; count 0: not measured yet
    own_pass: bool  # a pre-update policy pass ran


@dataclass(frozen=True)
class Targets:
    """What the update pushes towards: [n] per kept row."""

    rewards: Tensor  # shaped: overlong penalty, and the KL penalty when KL goes in the reward
    groups: Tensor  # the prompt each row answers
    adv: Tensor  # the advantage; [n, Rmax] per token with `credit: turn` (each token its turn's)
    kl_tokens: Tensor | None  # [n, Rmax] per-token KL to the reference (when pi_old and ref both exist)


def targets(sub: list[Trajectory], alg: Algorithm, max_len: int, old: Tensor | None, ref: Tensor | None,
            mask: Tensor) -> Targets:
    """Rewards (+ overlong penalty, + KL penalty when KL goes in the reward) -> group advantages: one per
    row ([n]), or with `credit: turn` one per model turn spread over that turn's tokens ([n, Rmax]), or for
    REINFORCE++ with KL in the reward one per model token, each paying the KL still to come ([n, Rmax])."""
    shaped = rewards = shaped_rewards(sub, alg, max_len)  # [n]
    kl_tokens = KL_ESTIMATORS[alg.kl_estimator](old, ref) if ref is not None and old is not None else None
    kl_in_reward = kl_tokens is not None and alg.kl_apply == "reward"
    if kl_in_reward:
        rewards = kl_reward_penalty(rewards, old, ref, mask, coef=alg.kl_coef, estimator=alg.kl_estimator)
    groups = torch.tensor([t.prompt_index for t in sub])  # [n]
    if alg.credit == "turn":
        per_turn_rewards = turn_rewards(sub, shaped)  # the reward and its shaping at every turn
        if kl_in_reward:  # each turn pays its own tokens' KL (the whole trajectory's at every turn was variance)
            per_turn_rewards = [r - alg.kl_coef * k for r, k in zip(per_turn_rewards, turn_sums(sub, kl_tokens * mask))]
        per_turn = turn_advantages(per_turn_rewards, groups, gamma=alg.gamma, advantage=alg.advantage,
                                   eps=alg.std_eps)  # [K_i] each
        adv = token_advantages(sub, per_turn, mask.shape[1])  # [n, Rmax]
    elif kl_in_reward and alg.advantage in KL_TO_COME:  # REINFORCE++: each token pays the KL still to come
        adv = kl_to_come_advantage(shaped, groups, kl_tokens, mask, coef=alg.kl_coef,
                                   baseline=alg.advantage == "reinforce_pp_baseline", eps=alg.std_eps)  # [n, Rmax]
    else:
        adv = ADVANTAGES[alg.advantage](rewards, groups, eps=alg.std_eps)  # [n]
    return Targets(rewards=rewards, groups=groups, adv=adv, kl_tokens=kl_tokens)


def mismatch_stats(mismatch: list[float]) -> dict[str, float]:
    """rollout/logprob_diff_* from [sum, count, max]; none when nothing was measured."""
    if not mismatch[1]:
        return {}
    return {"rollout/logprob_diff_mean": mismatch[0] / mismatch[1], "rollout/logprob_diff_max": mismatch[2]}


@contextlib.contextmanager
def _tied_frozen_left_out(engine: Any) -> Iterator[None]:
    """DeepSpeed leaves a frozen weight out of a checkpoint by its name in `named_parameters()`, which names a
    tied weight once: a tied lm_head (SmolLM2's, the tiny Qwen3's) stayed in every LoRA checkpoint (113 MB of
    165). While this holds, the engine's module state leaves out every name of a frozen weight."""
    whole = engine.module_state_dict

    def without_frozen(*args: Any, exclude_frozen_parameters: bool = False, **kwargs: Any) -> Any:
        sd = whole(*args, exclude_frozen_parameters=exclude_frozen_parameters, **kwargs)
        if exclude_frozen_parameters and sd is not None:
            for n, p in engine.module.named_parameters(remove_duplicate=False):
                if not p.requires_grad:
                    sd.pop(n, None)
        return sd

    engine.module_state_dict = without_frozen
    try:
        yield
    finally:
        del engine.module_state_dict  # the class's method again


def step_stats(sums: dict[str, float], schedule: list[list[list[int]]], update_plan: list[list[list[int]]],
               epochs: int, before: BeforeUpdate, target: Targets) -> dict[str, float]:
    """The actor/* metrics of a step from the loss statistics summed over its mini-batches (`sums`)."""
    stats: dict[str, float] = {}
    mask, tokens = before.mask, float(before.mask.sum())
    # Loss and gradient norm: means over the mini-batches. Token stats (entropy, clip fractions, ...):
    # over the mini-batches that ran rows -- one whose rows were all skipped measured nothing.
    ran = sum(1 for minibatch in update_plan if any(minibatch))
    skipped = sums.get(SKIPPED, 0.0)  # updates skipped for a non-finite loss or gradient norm
    for key, value in sums.items():
        if key == SKIPPED:
            continue
        if key in ("pg_loss", "grad_norm") or ran:
            stats[f"actor/{key}"] = value / (len(schedule) if key in ("pg_loss", "grad_norm") else ran)
    if "actor/entropy" not in stats and before.entropy is not None:  # measured by the pre-update pass
        stats["actor/entropy"] = float((before.entropy * mask).sum()) / max(tokens, 1.0)
    # the rows the update ran: all of them unless zero-advantage rows were skipped
    computed = [i for minibatch in update_plan[: len(update_plan) // epochs] for micro in minibatch for i in micro]
    kl_tokens, adv = target.kl_tokens, target.adv
    if kl_tokens is not None and "actor/kl" not in stats:  # no reference model: no KL to report, not a 0
        stats["actor/kl"] = float((kl_tokens * mask).sum()) / max(tokens, 1.0)
    stats.update({
        "actor/updates": float(len(schedule)) - skipped,
        "actor/skipped_non_finite": skipped,
        "actor/tokens": tokens,  # model tokens in the loss's normalisers (every kept row's)
        "actor/trained_rows": float(len(computed)),
        "actor/trained_tokens": float(mask[computed].sum()) if computed else 0.0,
        "actor/skipped_zero_adv": float(len(adv) - len(computed)),  # rows the update did not run
        # per row; per model token where advantages are per token (turn credit, REINFORCE++'s KL to come)
        "actor/advantage_abs_mean": float(adv.abs().mean()) if adv.dim() == 1
        else float((adv.abs() * mask).sum()) / max(tokens, 1.0),
        "actor/reward_shaped_mean": float(target.rewards.mean()),
        "actor/zero_adv_groups": float(_zero_groups(adv, target.groups)),
    })
    return stats
