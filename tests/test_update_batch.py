"""The update stage's pure pieces: which trajectories train, shaped rewards, the update plan, padding,
and response log-probs from the logits window. No DeepSpeed here: these run in milliseconds."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from factory.algorithms import resolve
from factory.schema import AlgorithmSpec
from factory.types import Trajectory
from factory.update.batch import (MIN_SHARED_PREFIX, TokenBudget, collate, common_prefix, cut, kept, plan, run_once,
                                  shaped_rewards, shard, shared_prefix, sort_keys, without_zero_advantage)
from factory.update.logprobs import response_logprobs


def traj(prompt: list[int], response: list[int], mask: list[int] | None = None, **kw) -> Trajectory:
    return Trajectory(prompt_index=kw.pop("group", 0), sample_index=0, prompt_ids=prompt, response_ids=response,
                      loss_mask=mask if mask is not None else [1] * len(response), turns=[], stop_reason="no_call",
                      row={}, **kw)


def test_kept_drops_infra_errors_and_overlong_only_when_asked():
    trajs = [traj([1], [2]), traj([1], [2], infra_error=True), traj([1], [2], truncated=True)]
    plain = resolve(AlgorithmSpec())
    assert kept(trajs, plain, drop_infra_errors=True) == [True, False, True]
    assert kept(trajs, plain, drop_infra_errors=False) == [True, True, True]
    dapo = resolve(AlgorithmSpec(name="dapo", overlong={"filter": True}))
    assert kept(trajs, dapo, drop_infra_errors=False) == [True, True, False]


def test_shaped_rewards_add_the_soft_overlong_penalty():
    alg = resolve(AlgorithmSpec(overlong={"buffer": 4, "penalty": 1.0}))
    trajs = [traj([1], [2] * n, reward=1.0) for n in (6, 8, 10, 12)]  # budget 10, penalty from 6 on
    assert shaped_rewards(trajs, alg, max_len=10).tolist() == [1.0, 0.5, 0.0, 0.0]
    assert shaped_rewards(trajs, resolve(AlgorithmSpec()), max_len=10).tolist() == [1.0] * 4


def test_plan_covers_each_sample_once_per_epoch_in_sorted_micro_batches():
    lengths = [(p, p + r) for p, r in [(5, 3), (2, 9), (7, 1), (2, 2), (5, 5), (3, 3), (9, 9)]]
    sched = plan(7, lengths, mini_batches=2, micro_batch=2, epochs=3, seed=11)
    assert len(sched) == 6  # epochs x mini-batches optimizer steps
    for epoch in range(3):
        seen = sorted(i for mb in sched[2 * epoch: 2 * epoch + 2] for micro in mb for i in micro)
        assert seen == list(range(7))
    for mb in sched:
        flat = [i for micro in mb for i in micro]
        assert all(len(micro) <= 2 for micro in mb)
        assert [lengths[i] for i in flat] == sorted(lengths[i] for i in flat)  # less padding
    assert sched == plan(7, lengths, 2, 2, 3, seed=11)  # seeded
    assert sched[:2] != sched[2:4] or sched[2:4] != sched[4:6]  # reshuffled per epoch
    assert len(plan(2, lengths[:2], mini_batches=4, micro_batch=1, epochs=1, seed=0)) == 2  # capped at n


def test_with_a_shared_prefix_rows_of_one_prompt_are_cut_together():
    """Two prompts of one length, 4 samples each, their response lengths interleaved: sorted by lengths alone the
    micro-batches mixed the prompts and shared only the system prompt; by sort_keys each is one prompt's group."""
    system = list(range(100, 120))
    a, b = system + [1, 2, 3, 4, 5, 6], system + [7, 8, 9, 10, 11, 12]
    trajs = [traj(a if k % 2 == 0 else b, [0] * (3 + k), group=k % 2) for k in range(8)]
    old = plan(8, [(len(t.prompt_ids), len(t.prompt_ids) + len(t.response_ids)) for t in trajs], 1, 4, 1, seed=0)
    assert [shared_prefix([trajs[i] for i in micro]) for micro in old[0]] == [20, 20]  # the system prompt only
    new = plan(8, sort_keys(trajs, share_prefix=True), 1, 4, 1, seed=0)
    assert [shared_prefix([trajs[i] for i in micro]) for micro in new[0]] == [25, 25]  # all but a prompt's last
    assert [sorted({trajs[i].prompt_index for i in micro}) for micro in new[0]] == [[0], [1]]
    assert [[len(trajs[i].response_ids) for i in micro] for micro in new[0]] == [[3, 5, 7, 9], [4, 6, 8, 10]]
    assert sort_keys(trajs, share_prefix=False) == [(26, (), 26 + 3 + k) for k in range(8)]  # lengths only


def budget(limit: int, totals: list[int], prompts: list[list[int]] = ()) -> TokenBudget:
    return TokenBudget(limit, totals, prompts)


def test_cut_keeps_each_micro_batch_within_its_rows_and_its_padded_tokens():
    assert cut([3, 1, 0, 2], 2) == [[3, 1], [0, 2]]  # rows alone: as before
    tokens = [10, 10, 30, 30, 100, 5]
    # rows x the longest row <= 60: [0, 1] (20), then 2 would make 3 x 30; [2, 3] (60); 4 alone (over the budget)
    assert cut([0, 1, 2, 3, 4], 8, budget(60, tokens)) == [[0, 1], [2, 3], [4]]
    assert cut([5, 0, 1, 2], 2, budget(1000, tokens)) == [[5, 0], [1, 2]]  # the row cap still holds
    assert cut([], 4, budget(60, tokens)) == []
    lengths = [(p, p + r) for p, r in [(5, 3), (2, 9), (7, 1), (2, 2), (5, 5), (3, 3), (9, 9)]]
    sched = plan(7, lengths, mini_batches=2, micro_batch=4, epochs=2, seed=3,
                 budget=budget(24, [total for _, total in lengths]))
    for mb in sched:
        assert all(len(m) == 1 or len(m) * max(lengths[i][1] for i in m) <= 24 for m in mb)
    for epoch in (sched[:2], sched[2:]):  # still every sample once per epoch
        assert sorted(i for mb in epoch for m in mb for i in m) == list(range(7))
    assert max(len(m) for mb in sched for m in mb) < 4  # the budget, not the row cap, cut them


def test_a_token_budget_counts_a_shared_prefix_once_as_the_update_runs_it():
    system = list(range(100, 100 + 20))  # 20 tokens every prompt starts with (>= MIN_SHARED_PREFIX)
    prompts = [system + [1, 2], system + [1, 3], system + [4], system + [5, 6, 7], [9] + system]
    totals = [30, 30, 30, 30, 30]
    # padded: 2 rows x 30 = 60 fill the budget. Prefix once: 20 + rows x (30 - 20), so 4 rows make 60; row 4
    # starts elsewhere (no common prefix with 0): its micro-batch would be 5 x 30, so it goes on its own
    assert cut([0, 1, 2, 3, 4], 8, budget(60, totals)) == [[0, 1], [2, 3], [4]]
    assert cut([0, 1, 2, 3, 4], 8, budget(60, totals, prompts)) == [[0, 1, 2, 3], [4]]
    # the common prefix is the micro-batch's, not its first pair's: 0 and 1 share 21 tokens, 2 only 20:
    # 21 + 2 x 9 = 39 <= 40, then 20 + 3 x 10 = 50 > 40
    assert cut([0, 1, 2], 8, budget(40, totals, prompts)) == [[0, 1], [2]]
    # at most the shortest prompt - 1 (a row's last prompt token predicts its first response token, so it is
    # its own): identical prompts of 22 tokens share 21
    same = budget(1000, [30, 30], [system + [1, 2]] * 2)
    assert same.common(0, 1) == same.common(0, 0) == 21
    # a common prefix too short to be run once counts in every row, as the update then runs it
    short = [[1] * (MIN_SHARED_PREFIX - 1) + [7], [1] * (MIN_SHARED_PREFIX - 1) + [8]]
    assert cut([0, 1], 8, budget(40, [25, 25], short)) == [[0], [1]]  # 2 x 25 = 50 > 40
    # what the budget counts is what the update runs: each micro-batch's shared prefix as collate finds it
    trajs = [traj(p, [3] * (t - len(p))) for p, t in zip(prompts, totals)]
    for micro in cut([0, 1, 2, 3, 4], 3, budget(60, totals, prompts)):
        group = [trajs[i] for i in micro]
        once = run_once(len(group), shared_prefix(group))
        assert once + len(group) * (max(totals[i] for i in micro) - once) <= 60


def test_a_budget_of_trajectories_counts_prompt_and_response_and_a_shared_prefix_only_when_shared():
    """TokenBudget.of, as the learner makes it: each row's prompt + response tokens; the common prefix counted
    once only when the learner runs it once (train.share_prefix), else in every row -- a budget that counted it
    once while the update runs it in every row lets a micro-batch past micro_batch_tokens (out of memory)."""
    system = list(range(100, 120))  # 20 common tokens
    trajs = [traj(system + [1], [3] * 9), traj(system + [2], [3] * 9)]  # 21 + 9 = 30 tokens each
    assert TokenBudget.of(None, trajs, share_prefix=True) is None
    shared, padded = TokenBudget.of(40, trajs, share_prefix=True), TokenBudget.of(40, trajs, share_prefix=False)
    assert shared.totals == padded.totals == [30, 30] and (shared.common(0, 1), padded.common(0, 1)) == (20, 0)
    assert cut([0, 1], 8, shared) == [[0, 1]]  # 20 + 2 x 10 = 40
    assert cut([0, 1], 8, padded) == [[0], [1]]  # 2 x 30 = 60 > 40


def test_padding_stats_by_hand():
    """actor/padding_frac and actor/packed_frac over a step's micro-batches (lengths 10 and 5: 5 pads of 20
    slots; a lone 8: none): 5 of 28 slots are padding; under auto the first is packed (25% > 10%), the lone row
    never is; off packs none."""
    from factory.update.batch import padding_stats

    def rows(*lengths: int) -> list[Trajectory]:  # each a 1-token response after its prompt
        return [traj([1] * (n - 1), [2]) for n in lengths]

    assert padding_stats([rows(10, 5), rows(8)], "auto") == pytest.approx({"actor/padding_frac": 5 / 28,
                                                                           "actor/packed_frac": 0.5})
    assert padding_stats([rows(10, 5), rows(8)], "off")["actor/packed_frac"] == 0.0
    assert padding_stats([rows(10, 9)], "on")["actor/packed_frac"] == 1.0 and padding_stats([], "on") == {
        "actor/padding_frac": 0.0, "actor/packed_frac": 0.0}


def test_packed_frac_counts_only_the_micro_batches_collated_packed():
    """A micro-batch whose rows all have empty responses (a group whose first generate timed out) has nothing
    to pack: the learner collates it padded, yet under `packing: on` actor/packed_frac counted it packed."""
    from factory.update.batch import packs, padding_stats

    empty, answered = [traj([1, 2, 3], []), traj([4, 5], [])], [traj([1, 2, 3], [6]), traj([4, 5], [7, 8])]
    assert not packs("on", empty) and packs("on", answered) and not packs("off", answered)
    assert padding_stats([empty, answered], "on")["actor/packed_frac"] == 0.5


def test_common_prefix_is_the_first_place_two_rows_differ():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        a = torch.randint(0, 3, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g).tolist()
        b = torch.randint(0, 3, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g).tolist()
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert common_prefix(a, b) == n, (a, b)


def test_shard_with_a_token_budget_still_gives_every_rank_as_many_micro_batches():
    tokens = [4, 4, 4, 4, 20, 20, 4, 4]
    schedule = [[list(range(8))]]
    parts = [shard(schedule, rank, 2, 4, budget(16, tokens)) for rank in (0, 1)]
    # rank 0: rows 0 2 4 6 -> [0, 2], [4], [6]; rank 1: 1 3 5 7 -> [1, 3], [5], [7]
    assert parts == [[[[0, 2], [4], [6]]], [[[1, 3], [5], [7]]]]
    uneven = [shard([[[0, 1, 2]]], rank, 2, 4, budget(16, [20, 4, 20])) for rank in (0, 1)]
    assert uneven == [[[[0], [2]]], [[[1], []]]]  # rank 1 pads to rank 0's count


def test_shard_deals_each_minibatch_over_the_ranks_in_equal_numbers_of_micro_batches():
    schedule = [[[0, 1], [2, 3], [4]], [[5, 6]]]  # two mini-batches, each in plan's length order
    # mini-batch 1 (0..4) dealt round-robin: rank 0 takes 0, 2, 4 (2 micro-batches of at most 2), rank 1
    # takes 1, 3 (1 micro-batch) and pads with one empty stand-in so both run 2 forwards/backwards.
    assert shard(schedule, rank=0, world=2, micro_batch=2) == [[[0, 2], [4]], [[5]]]
    assert shard(schedule, rank=1, world=2, micro_batch=2) == [[[1, 3], []], [[6]]]
    assert shard(schedule, rank=0, world=1, micro_batch=2) == schedule  # one rank: the plan itself
    assert shard([[[0]]], rank=1, world=2, micro_batch=4) == [[[]]]  # more ranks than samples
    for world in (2, 3):  # every sample is trained exactly once, by one rank
        parts = [shard(schedule, r, world, 2) for r in range(world)]
        assert sorted(i for p in parts for mb in p for micro in mb for i in micro) == list(range(7))
        assert len({tuple(len(mb) for mb in p) for p in parts}) == 1


def test_without_zero_advantage_drops_those_rows_and_recuts_full_micro_batches():
    schedule = [[[0, 1], [2, 3], [4]], [[5, 6]]]  # two mini-batches, each in plan's length order
    adv = torch.tensor([0.5, 0.0, 0.0, -1.0, 2.0, 0.0, 0.0])
    # the survivors keep their order and fill micro-batches again; a mini-batch may be left empty
    assert without_zero_advantage(schedule, adv, micro_batch=2) == [[[0, 3], [4]], []]
    assert without_zero_advantage(schedule, torch.ones(7), micro_batch=3) == [[[0, 1, 2], [3, 4]], [[5, 6]]]
    # shard deals what is left; an empty mini-batch gives every rank no micro-batch (the learner runs a
    # weight-0 stand-in there, so the optimizer still steps on zero gradients)
    assert shard([[[0, 3], [4]], []], rank=1, world=2, micro_batch=2) == [[[3]], []]
    # turn credit: [N, T] advantages, 0 on tool/template tokens and padding; a row with any nonzero token trains
    per_token = torch.tensor([[0.0, 0.0, 0.5], [0.0, 0.0, 0.0], [-1.0, 0.0, 0.0]])
    assert without_zero_advantage([[[0, 1], [2]]], per_token, micro_batch=2) == [[[0, 2]]]
    # the rows left are re-cut within the token budget too (30-token rows, 60 tokens: two a micro-batch), not
    # by the row cap alone: a micro-batch past micro_batch_tokens runs out of memory
    left = without_zero_advantage([[[0, 1], [2, 3]]], torch.tensor([1.0, 0.0, 1.0, 1.0]), 4, budget(60, [30] * 4))
    assert left == [[[0, 2], [3]]]


def test_collate_window_targets_are_the_response_tokens():
    trajs = [traj([10, 11, 12], [20, 21], [1, 0]), traj([13], [22, 23, 24, 25], [0, 1, 1, 1])]
    mb = collate(trajs, pad_id=0)
    assert mb.input_ids.tolist() == [[10, 11, 12, 20, 21], [13, 22, 23, 24, 25]]
    assert mb.attention_mask.tolist() == [[1] * 5, [1] * 5]
    # shortest prompt is 1 token: the window starts at position 0 and ends before the last position
    assert (mb.start, mb.end) == (0, 4)
    picked = mb.targets.gather(1, mb.gather)  # the token each response position's logits predict
    assert picked[0, :2].tolist() == [20, 21] and picked[1].tolist() == [22, 23, 24, 25]
    assert mb.mask.tolist() == [[1, 0, 0, 0], [0, 1, 1, 1]]  # padding is masked


def test_collate_pads_on_the_right():
    mb = collate([traj([1, 2], [3]), traj([4, 5, 6, 7], [8, 9])], pad_id=0)
    assert mb.input_ids.tolist() == [[1, 2, 3, 0, 0, 0], [4, 5, 6, 7, 8, 9]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 0, 0, 0], [1] * 6]
    assert (mb.start, mb.end) == (1, 5)
    assert mb.targets.gather(1, mb.gather)[:, :1].tolist() == [[3], [8]]
    with pytest.raises(ValueError, match="empty prompt"):
        collate([traj([], [1])])


@pytest.fixture(scope="module")
def tiny_model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=128)
    return Qwen3ForCausalLM(config).eval()


def test_response_logprobs_match_full_logits_of_each_sequence_alone(tiny_model):
    """The windowed, padded batch gives each token the log-prob a lone full forward gives it."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    shapes = [(3, 5), (9, 2), (1, 7), (6, 6)]
    trajs = [traj(torch.randint(1, 97, (p,), generator=g).tolist(), torch.randint(1, 97, (r,), generator=g).tolist())
             for p, r in shapes]
    mb = collate(trajs)
    with torch.no_grad():
        logp, ent = response_logprobs(tiny_model, mb, amp=None, entropy=True)
    assert logp.shape == ent.shape == (4, 7)
    for b, t in enumerate(trajs):
        ids = torch.tensor([t.prompt_ids + t.response_ids])
        with torch.no_grad():
            full = torch.log_softmax(tiny_model(ids).logits[0].double(), -1)  # [L, V]
        p, r = len(t.prompt_ids), len(t.response_ids)
        want = full[p - 1: p + r - 1].gather(1, torch.tensor(t.response_ids)[:, None])[:, 0]
        want_ent = -(full[p - 1: p + r - 1].exp() * full[p - 1: p + r - 1]).sum(-1)
        torch.testing.assert_close(logp[b, :r].double(), want, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent[b, :r].double(), want_ent, atol=1e-5, rtol=0)


def test_response_logprobs_carry_gradient_only_when_needed(tiny_model):
    mb = collate([traj([1, 2], [3, 4])])
    logp, ent = response_logprobs(tiny_model, mb, amp=None, entropy=True)
    assert logp.requires_grad and not ent.requires_grad
    _, ent = response_logprobs(tiny_model, mb, amp=None, entropy=True, entropy_grad=True)
    assert ent.requires_grad


def test_shared_prefix_stops_at_the_first_difference_and_before_the_shortest_prompt_ends():
    assert shared_prefix([traj([1, 2, 3, 4, 5], [9]), traj([1, 2, 3, 7, 5, 6], [9])]) == 3
    # identical prompts: the last prompt token stays each row's own (it predicts the first response token)
    assert shared_prefix([traj([1, 2, 3], [9]), traj([1, 2, 3], [8])]) == 2
    assert shared_prefix([traj([1, 2, 3, 4], [9]), traj([1, 2], [8, 7])]) == 1
    assert shared_prefix([traj([5, 2], [9]), traj([1, 2], [8])]) == 0
    assert collate([traj([1, 2, 3, 4, 5], [9]), traj([1, 2, 3, 7, 5, 6], [9])]).shared == 3


def test_shared_prefix_pass_gives_the_same_logprobs_and_gradients(tiny_model):
    """The common prefix run once (its KV repeated for the rows) is the same function of the weights:
    the same log-probs and entropies, and the same gradient, as the full forward of every row."""
    torch.manual_seed(2)
    model = type(tiny_model)(tiny_model.config).train()  # its own copy: gradients accumulate on it
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(1, 97, (24,), generator=g).tolist()  # >= MIN_SHARED_PREFIX
    trajs = [traj(prefix + torch.randint(1, 97, (p,), generator=g).tolist(),
                  torch.randint(1, 97, (r,), generator=g).tolist()) for p, r in [(3, 5), (6, 2), (1, 7)]]
    mb = collate(trajs)
    assert mb.shared == 24
    results = []
    for share in (False, True):
        model.zero_grad()
        logp, ent = response_logprobs(model, mb, amp=None, entropy=True, entropy_grad=True, share_prefix=share)
        ((logp * mb.mask).sum() + (ent * mb.mask).sum()).backward()
        results.append((logp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()]))
    (lp0, en0, g0), (lp1, en1, g1) = results
    torch.testing.assert_close(lp1 * mb.mask, lp0 * mb.mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(en1 * mb.mask, en0 * mb.mask, atol=1e-5, rtol=0)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert any(float(x.abs().sum()) > 0 for x in g1[:1])  # the embeddings got gradient through the prefix


def _spec(**train):
    from factory.schema import Spec

    return Spec.model_validate({"name": "t", "model": {"path": "m"}, "data": {"train": {"generator": "x:y"}},
                                "rewards": {"r": {"fn": "x:y"}}, "train": train})


def test_learning_rate_warms_up_linearly_over_training_steps():
    from factory.update.engine import learning_rate

    spec = _spec(lr=1e-3, warmup_steps=4)
    assert [learning_rate(spec, s) for s in (1, 2, 4, 9)] == pytest.approx([2.5e-4, 5e-4, 1e-3, 1e-3])
    assert learning_rate(_spec(lr=1e-3), 1) == 1e-3


def test_deepspeed_config_from_the_spec_with_extra_keys_passed_through():
    from factory.update.engine import deepspeed_config

    cfg = deepspeed_config(_spec(micro_batch=2, optimizer={"grad_clip": 0.5},
                                 deepspeed={"zero_stage": 2, "zero_optimization": {"overlap_comm": False},
                                            "communication_data_type": "fp32"}))
    assert cfg["train_micro_batch_size_per_gpu"] == 2 and cfg["gradient_clipping"] == 0.5
    # accumulation boundaries are the learner's: one engine.step per mini-batch
    assert cfg["gradient_accumulation_steps"] == 1 and cfg["managed_gradient_accumulation"] is False
    assert cfg["zero_optimization"] == {"stage": 2, "overlap_comm": False}  # merged, not replaced
    assert cfg["communication_data_type"] == "fp32" and "bf16" not in cfg
    offload = deepspeed_config(_spec(deepspeed={"zero_stage": 1, "offload_optimizer": True}))
    assert offload["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}


def test_deepspeeds_deprecated_collectives_do_not_reach_the_display():
    """torch 2.13's FutureWarning on ZeRO's all_gather_into_tensor (DeepSpeed's call) showed in the display of
    every run with 2 update ranks; other FutureWarnings still show."""
    import warnings

    from factory.update.engine import quiet_deprecated_collectives

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_deprecated_collectives()
        for collective in (torch.distributed.all_gather_into_tensor, torch.distributed.reduce_scatter_tensor):
            with pytest.raises(Exception):  # noqa: B017 (no process group: only the warning before it matters)
                collective(torch.zeros(2), torch.zeros(1))
        warnings.warn("another", FutureWarning)
    assert [str(w.message) for w in seen] == ["another"]


def test_a_world_of_several_nccl_ranks_is_bound_to_each_ranks_gpu(monkeypatch):
    """Factory makes the update's process group itself, so it binds the GPU where DeepSpeed's own init would
    have: each rank's (LOCAL_RANK's) in a world of 2+ NCCL ranks; never a world of one (deepspeed#8248) nor gloo."""
    from factory.update.engine import bound_device

    monkeypatch.setenv("LOCAL_RANK", "1")
    assert bound_device("nccl", 2) == torch.device("cuda", 1)
    monkeypatch.delenv("LOCAL_RANK")
    assert bound_device("nccl", 4) == torch.device("cuda", 0)
    assert bound_device("nccl", 1) is None and bound_device("gloo", 4) is None


def test_a_single_rank_cuda_update_does_not_warn_of_its_barrier_device():
    """The first CUDA run printed torch's "barrier(): using the device under current context" from every update
    process (a world of one, left unbound); the text is torch's own, read from its barrier()."""
    import inspect
    import warnings

    from factory.update.engine import quiet_single_rank_barrier

    text = "barrier(): using the device under current context. "
    assert text in inspect.getsource(torch.distributed.distributed_c10d.barrier)  # torch still says it
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_single_rank_barrier()
        warnings.warn(text + "You can specify `device_id` in `init_process_group` to mute this warning.", UserWarning)
        warnings.warn("barrier(): something else", UserWarning)
    assert [str(w.message) for w in seen] == ["barrier(): something else"]
