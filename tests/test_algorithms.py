"""Hand-worked tests for factory.algorithms: small float64 tensors, the expected numbers written out with
their arithmetic in comments (torchtune style)."""
from __future__ import annotations

import math

import pytest
import torch

from factory import algorithms as A
from factory.algorithms import (
    ADVANTAGES,
    AGGREGATIONS,
    K3_MAX,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    PRESETS,
    Registry,
    dynamic_sampling_keep,
    max_variance_keep,
    kl_reward_penalty,
    kl_to_come_advantage,
    minibatches,
    overlong_penalty,
    policy_objective,
    resolve,
)
from factory.schema import AlgorithmSpec, KLSpec, OverlongSpec

E = math.e


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def t(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


def close(got, want, atol=1e-6):
    torch.testing.assert_close(got, t(want) if not isinstance(want, torch.Tensor) else want, rtol=0, atol=atol)


# -------------------------------------------------------------------------------------------- registry
def test_registry_refuses_duplicates_and_lists_known_names_for_unknown():
    reg = Registry("widget")

    @reg.register("b")
    def b():
        return "b"

    reg.register("a")(lambda: "a")
    assert reg["b"] is b and "a" in reg and "c" not in reg
    assert reg.names() == ["a", "b"]  # sorted
    with pytest.raises(ValueError, match="widget 'b' is already registered"):
        reg.register("b")(lambda: None)
    with pytest.raises(KeyError) as err:
        reg["c"]
    assert str(err.value) == "unknown widget 'c'; known: a, b"


def test_real_registries_refuse_a_second_grpo():
    with pytest.raises(ValueError, match="'grpo' is already registered"):
        ADVANTAGES.register("grpo")(lambda *a, **k: None)


# Every registered function has a hand-worked test below; a new one must add its own.
HAND_WORKED = {
    "advantage": {"grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "mean_baseline"},
    "policy loss": {"ppo_clip", "dual_clip", "gspo", "cispo"},
    "aggregation": {"token_mean", "seq_mean_token_mean", "seq_sum_norm"},
    "KL estimator": {"k1", "k2", "k3"},
}


def test_every_registered_function_is_hand_worked_here():
    for reg in (ADVANTAGES, POLICY_LOSSES, AGGREGATIONS, KL_ESTIMATORS):
        assert set(reg.names()) == HAND_WORKED[reg.kind]


# ------------------------------------------------------------------------------------------ advantages
# Interleaved groups: group 0 = samples 0, 2 (rewards 1, 3); group 1 = samples 1, 3 (0, 2); group 2 =
# samples 4, 5 (5, 5: no spread). Groups 0 and 1: mean 2 and 1, deviations -1, +1,
# unbiased std = sqrt((1 + 1) / (2 - 1)) = sqrt(2).
R = [1.0, 0.0, 3.0, 2.0, 5.0, 5.0]
G = [0, 1, 0, 1, 2, 2]


def test_grpo_advantage_group_mean_and_std():
    s = 1 / math.sqrt(2)  # deviation 1 / std sqrt(2)
    close(ADVANTAGES["grpo"](t(R), torch.tensor(G), eps=1e-6), [-s, -s, s, s, 0.0, 0.0])


def test_grpo_advantage_zero_for_near_constant_and_single_groups():
    # group 0: std of (1, 1 + 1e-9) = 7e-10 < eps 1e-6 -> 0, not +-0.707 amplified noise; group 1: one sample.
    close(ADVANTAGES["grpo"](t([1.0, 1.0 + 1e-9, 4.0]), torch.tensor([0, 0, 1]), eps=1e-6), [0.0, 0.0, 0.0])


def test_dr_grpo_advantage_no_std_scaling():
    # r - group mean: 1-2, 0-1, 3-2, 2-1, 5-5, 5-5
    close(ADVANTAGES["dr_grpo"](t(R), torch.tensor(G), eps=1e-6), [-1.0, -1.0, 1.0, 1.0, 0.0, 0.0])


def test_rloo_advantage_leave_one_out():
    # one group of 3 (0, 3, 6): 0 - (3+6)/2 = -4.5; 3 - (0+6)/2 = 0; 6 - (0+3)/2 = 4.5.
    # A second group (2, 2) has no spread -> 0.
    got = ADVANTAGES["rloo"](t([0.0, 2.0, 3.0, 2.0, 6.0]), torch.tensor([9, 4, 9, 4, 9]), eps=1e-6)
    close(got, [-4.5, 0.0, 0.0, 0.0, 4.5])


def test_reinforce_pp_advantage_batch_normalised():
    # batch (0, 1, 2, 5): mean 2, deviations (-2, -1, 0, 3), squares 4+1+0+9 = 14, std = sqrt(14/3).
    s = math.sqrt(14 / 3)
    got = ADVANTAGES["reinforce_pp"](t([0.0, 1.0, 2.0, 5.0]), torch.tensor([0, 0, 1, 1]), eps=1e-6)
    close(got, [-2 / s, -1 / s, 0.0, 3 / s])
    close(ADVANTAGES["reinforce_pp"](t([2.0, 2.0]), torch.tensor([0, 1]), eps=1e-6), [0.0, 0.0])


def test_every_group_advantage_leaves_a_zero_variance_group_exactly_zero():
    """reinforce_pp_baseline re-centred on the float batch mean (~1e-8): in 167 of 200 random batches a group whose
    rewards agree got advantages a hair off 0, and the update's zero-advantage skip (`ne(0)`) ran its rows."""
    from factory.presets import GROUP_ADVANTAGES

    gen = torch.Generator().manual_seed(0)
    groups = torch.arange(6).repeat_interleave(4)
    for name in GROUP_ADVANTAGES:
        for _ in range(50):
            rewards = torch.rand(24, generator=gen)
            rewards[:4] = 0.3  # group 0 agrees
            assert ADVANTAGES[name](rewards, groups, eps=1e-6)[:4].eq(0).all(), name


@pytest.mark.parametrize("reward", [8.1, 10.1, 20.3, 12.7])
def test_a_group_of_equal_float32_rewards_gets_exactly_zero_advantage(reward):
    """Rewards reach the estimators in float32 (update/batch.py). The float32 mean of eight 10.1s is one ulp off
    10.1, so every deviation is that ulp, their Bessel std (~1e-6) passed std_eps 1e-6 and grpo divided the
    rounding error by itself: every sample got +-0.93, and dynamic sampling kept the group as signal."""
    for size in (6, 8, 16):
        rewards, groups = torch.full((size,), reward), torch.zeros(size, dtype=torch.long)
        for name in ADVANTAGES.names():
            adv = ADVANTAGES[name](rewards, groups, eps=1e-6)
            assert adv.dtype == torch.float32 and adv.eq(0).all(), (name, size, adv.tolist())
        assert not dynamic_sampling_keep(rewards, groups, 1e-6).any(), size


def test_reinforce_pp_baseline_group_centred_then_batch_std():
    # group-centred = (-1, -1, 1, 1, 0, 0), batch mean 0, std = sqrt(4 / 5): 1/sqrt(0.8) = 1.1180;
    # the flat group stays exactly 0.
    s = 1 / math.sqrt(0.8)
    close(ADVANTAGES["reinforce_pp_baseline"](t(R), torch.tensor(G), eps=1e-6), [-s, -s, s, s, 0.0, 0.0])


def test_mean_baseline_advantage_batch_mean():
    # batch mean of (0, 1, 2, 5) = 2 -> (-2, -1, 0, 3), whatever the groups
    close(ADVANTAGES["mean_baseline"](t([0.0, 1.0, 2.0, 5.0]), torch.tensor([0, 0, 0, 0]), eps=1e-6),
          [-2.0, -1.0, 0.0, 3.0])
    close(ADVANTAGES["mean_baseline"](t([3.0, 3.0]), torch.tensor([0, 1]), eps=1e-6), [0.0, 0.0])


# --------------------------------------------------------------------------------------- policy losses
# Four one-token sequences plus a padding column whose log-probs are -inf (padding must not make nan).
#   row 0: log ratio +1 -> r = e = 2.718, A = +1: clip_high 0.28 -> -min(e, 1.28) = -1.28 (clipped high)
#   row 1: r = e,           A = -1: -min(-e, -1.28) = e = 2.71828 (pessimistic side: not clipped)
#   row 2: r = 1/e = 0.368, A = -1: -min(-0.368, -0.8) = 0.8 (clipped low)
#   row 3: r = 1/e,         A = +1: -min(0.368, 0.8) = -0.36788
LOGP = [[-1.0, -math.inf], [-1.0, -math.inf], [-2.0, -math.inf], [-2.0, -math.inf]]
OLD = [[-2.0, 0.0], [-2.0, 0.0], [-1.0, 0.0], [-1.0, 0.0]]
ADV = [1.0, -1.0, -1.0, 1.0]
MASK = [[1, 0], [1, 0], [1, 0], [1, 0]]


def test_ppo_clip_asymmetric_bounds():
    logp = t(LOGP).requires_grad_()
    loss, stats = POLICY_LOSSES["ppo_clip"](logp, t(OLD), t(ADV), t(MASK), clip_low=0.2, clip_high=0.28,
                                            dual_clip_c=None)
    close(loss[:, 0], [-1.28, E, 0.8, -1 / E])
    assert torch.isfinite(loss).all()
    close(stats["clip_frac_low"], 0.25)  # row 2 of 4 tokens
    close(stats["clip_frac_high"], 0.25)  # row 0
    # k3 of KL(old||new) = r - 1 - log r: (e - 2) for rows 0, 1 and (1/e - 1 + 1) for rows 2, 3
    close(stats["approx_kl"], (2 * (E - 2) + 2 / E) / 4)
    loss[:, 0].sum().backward()
    # d/dlogp of -A*r = -A*r where not clipped: row 1: e; row 3: -1/e; clipped rows 0, 2: 0; padding 0
    close(logp.grad[:, 0], [0.0, E, 0.0, -1 / E])
    close(logp.grad[:, 1], [0.0, 0.0, 0.0, 0.0])


def test_clip_fractions_count_only_the_tokens_whose_gradient_the_clip_removes():
    """Rows 1 and 3 above sit outside the clip range on the side PPO's min leaves unclipped (r = e with A < 0,
    r = 1/e with A > 0): both keep their gradient, so neither clip fraction counts them. With rows 0 and 2 (the
    clipped ones) beside them the fractions are symmetric, and a clip_frac_low that counted A > 0 instead of
    A < 0 still read 1/4."""
    rows = [1, 3]
    _, stats = POLICY_LOSSES["ppo_clip"](t(LOGP)[rows], t(OLD)[rows], t(ADV)[rows], t(MASK)[rows], clip_low=0.2,
                                         clip_high=0.28, dual_clip_c=None)
    close(stats["clip_frac_low"], 0.0)
    close(stats["clip_frac_high"], 0.0)


def test_approx_kl_is_kl_of_old_to_new():
    """k3 of KL(pi_old || pi) from tokens sampled by pi_old: r - 1 - log r, r = pi/pi_old. Rows 0 and 1 have
    log r = +1: e - 2 = 0.71828 (KL(pi || pi_old)'s k3, 1/r - 1 + log r, would read 1/e = 0.36788; the four
    rows above mix log r = +1 and -1 evenly, where the two directions sum alike)."""
    rows = [0, 1]
    for name in ("ppo_clip", "cispo"):
        _, stats = POLICY_LOSSES[name](t(LOGP)[rows], t(OLD)[rows], t(ADV)[rows], t(MASK)[rows], clip_low=0.2,
                                       clip_high=0.28, dual_clip_c=None)
        close(stats["approx_kl"], E - 2)


def test_a_huge_log_ratio_is_clamped_so_loss_and_gradient_stay_finite():
    """A token 100 nats likelier under the policy than under pi_old (a stale or mismatched old log-prob): in
    float32 exp(100) is inf. Clamped at log ratio 20: A = +1 is clipped at 1.2 with no gradient, A = -1 (no
    dual clip) costs e^20 and, beyond the clamp, no gradient either. Unclamped, A = -1's loss is inf and
    A = +1's gradient 0 * inf = nan, and the step is lost."""
    logp = torch.zeros(2, 1).requires_grad_()
    loss, _ = POLICY_LOSSES["ppo_clip"](logp, torch.full((2, 1), -100.0), torch.tensor([1.0, -1.0]),
                                        torch.ones(2, 1), clip_low=0.2, clip_high=0.2, dual_clip_c=None)
    torch.testing.assert_close(loss[:, 0], torch.tensor([-1.2, math.exp(20.0)]))
    loss.sum().backward()
    assert torch.equal(logp.grad, torch.zeros(2, 1))


def test_dual_clip_caps_negative_advantage_loss():
    # row 0: r = e^2 = 7.389, A = -1: PPO loss 7.389 -> capped at c*|A| = 3 (no gradient)
    # row 1: r = e = 2.718,   A = -1: 2.718 < 3 -> unchanged
    # row 2: r = e^2,         A = +1: -min(7.389, 1.2) = -1.2 (positive A: dual clip does not apply)
    logp = t([[0.0], [0.0], [0.0]]).requires_grad_()
    args = (logp, t([[-2.0], [-1.0], [-2.0]]), t([-1.0, -1.0, 1.0]), t([[1], [1], [1]]))
    loss, stats = POLICY_LOSSES["dual_clip"](*args, clip_low=0.2, clip_high=0.2, dual_clip_c=3.0)
    close(loss[:, 0], [3.0, E, -1.2])
    close(stats["clip_frac_dual"], 1 / 3)
    loss.sum().backward()
    close(logp.grad[:, 0], [0.0, E, 0.0])
    # dual_clip's c defaults to verl's 3; ppo_clip without c leaves row 0 at e^2
    close(POLICY_LOSSES["dual_clip"](*args, clip_low=0.2, clip_high=0.2, dual_clip_c=None)[0][:, 0],
          [3.0, E, -1.2])
    close(POLICY_LOSSES["ppo_clip"](*args, clip_low=0.2, clip_high=0.2, dual_clip_c=None)[0][:, 0],
          [E**2, E, -1.2])


def test_the_losses_said_to_apply_dual_clip_c_are_the_ones_it_changes():
    """`factory check` warns that dual_clip_c has no effect with the other losses: it must be exact."""
    from factory.presets import DUAL_CLIP_LOSSES

    # one token, r = e^2, A = -1: every clipped loss puts it above c = 3, so where c applies it caps it
    args = (t([[0.0]]), t([[-2.0]]), t([-1.0]), t([[1]]))
    changed = {name for name in POLICY_LOSSES.names()
               if not torch.equal(POLICY_LOSSES[name](*args, clip_low=0.2, clip_high=0.2, dual_clip_c=3.0)[0],
                                  POLICY_LOSSES[name](*args, clip_low=0.2, clip_high=0.2, dual_clip_c=100.0)[0])}
    assert changed == DUAL_CLIP_LOSSES == {"ppo_clip", "dual_clip", "gspo"}


def test_the_advantages_said_to_need_groups_are_the_ones_that_give_a_group_of_one_nothing():
    """`factory check` refuses `rollout.group_size: 1` with the advantages in GROUP_ADVANTAGES (every row's
    advantage would be 0: a run that trains nothing): the set must be exact, or a new group advantage left
    out of it lets such a run start and silently learn nothing."""
    from factory.presets import GROUP_ADVANTAGES

    rewards, alone = t([0.0, 1.0, 3.0]), torch.tensor([0, 1, 2])  # three prompts, one sample each
    silent = {name for name in ADVANTAGES.names() if not ADVANTAGES[name](rewards, alone, eps=1e-6).any()}
    assert silent == GROUP_ADVANTAGES == {"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"}


def test_gspo_sequence_ratio_with_stop_gradient():
    # row 0: log ratios (0.2, 0.4), mean 0.3 -> s = e^0.3 = 1.3499 > 1.2, A = +1: every token -1.2, clipped
    # row 1: log ratios (0.1, -0.1, pad), mean 0 -> s = 1, A = -1: every token +1
    logp = t([[0.2, 0.4, 0.0], [0.1, -0.1, 0.0]]).requires_grad_()
    mask = t([[1, 1, 0], [1, 1, 0]])
    loss, stats = POLICY_LOSSES["gspo"](logp, torch.zeros(2, 3, dtype=torch.float64), t([1.0, -1.0]), mask,
                                        clip_low=0.2, clip_high=0.2, dual_clip_c=None)
    close(loss * mask, [[-1.2, -1.2, 0.0], [1.0, 1.0, 0.0]])
    close(stats["clip_frac_high"], 0.5)  # both tokens of row 0, of 4
    agg = AGGREGATIONS["seq_mean_token_mean"](loss, mask, num_tokens=4.0, num_seqs=2.0, max_len=3)
    close(agg, (-1.2 + 1.0) / 2)  # -0.1
    agg.backward()
    # row 1: loss = -A*s, ds/dlogp_t = s/|y| = 1/2, over num_seqs 2 -> 0.25 per token; row 0 clipped -> 0
    close(logp.grad, [[0.0, 0.0, 0.0], [0.25, 0.25, 0.0]])


def test_cispo_clips_the_weight_not_the_gradient():
    # log ratios (1, 0): weights min(e, 1.28) = 1.28 and 1; A = 2; logp (-0.5, -2):
    # loss = -w*A*logp = (-1.28*2*-0.5, -1*2*-2) = (1.28, 4); gradient -w*A = (-2.56, -2): the clipped
    # token still trains (PPO-clip would give it 0).
    logp = t([[-0.5, -2.0]]).requires_grad_()
    loss, stats = POLICY_LOSSES["cispo"](logp, t([[-1.5, -2.0]]), t([2.0]), t([[1, 1]]), clip_low=1.0,
                                         clip_high=0.28, dual_clip_c=None)
    close(loss, [[1.28, 4.0]])
    close(stats["clip_frac_high"], 0.5)
    loss.sum().backward()
    close(logp.grad, [[-2.56, -2.0]])


def test_gspo_sequence_ratio_is_the_mean_over_the_model_tokens_not_the_padded_width():
    # log ratios (0.1, 0.1, pad): mean over the 2 model tokens 0.1 -> s = e^0.1 = 1.10517 < 1.2, A = +1: every
    # token -s (a mean over the padded width 3, 0.2/3, would give e^0.0667 = 1.06894: the sequence's ratio
    # would depend on how long the micro-batch's longest row is).
    loss, _ = POLICY_LOSSES["gspo"](t([[0.1, 0.1, 0.0]]), torch.zeros(1, 3, dtype=torch.float64), t([1.0]),
                                    t([[1, 1, 0]]), clip_low=0.2, clip_high=0.2, dual_clip_c=None)
    close(loss[:, :2], [[-math.exp(0.1), -math.exp(0.1)]])
    # row 0 of the test above: log ratios (0.2, 0.4), token-level k3 = mean(e^x - 1 - x), not the sequence's
    # e^0.3 - 1 - 0.3 on each token
    _, stats = POLICY_LOSSES["gspo"](t([[0.2, 0.4]]), torch.zeros(1, 2, dtype=torch.float64), t([1.0]),
                                     t([[1, 1]]), clip_low=0.2, clip_high=0.2, dual_clip_c=None)
    close(stats["approx_kl"], (math.expm1(0.2) - 0.2 + math.expm1(0.4) - 0.4) / 2)


def test_cispo_lower_bound_applies_when_clip_low_is_below_1():
    # clip_low 0.2 (not the paper's 1, which means no lower bound): log ratio -1 -> r = 1/e = 0.368, weight
    # clamped up to 0.8; A = 1, logp -1: loss = -0.8 * 1 * -1 = 0.8, gradient -0.8 (unclamped: 0.368)
    logp = t([[-1.0]]).requires_grad_()
    loss, stats = POLICY_LOSSES["cispo"](logp, t([[0.0]]), t([1.0]), t([[1]]), clip_low=0.2, clip_high=0.28,
                                         dual_clip_c=None)
    close(loss, [[0.8]])
    close(stats["clip_frac_low"], 1.0)
    loss.sum().backward()
    close(logp.grad, [[-0.8]])


# ---------------------------------------------------------------------------------------- aggregations
V = [[1.0, 2.0, math.nan], [4.0, 5.0, 6.0]]  # the nan sits on padding and must not leak
M = [[1, 1, 0], [1, 0, 0]]


def test_token_mean():
    # (1 + 2 + 4) / 3 tokens = 7/3; with the mini-batch holding 6 tokens: 7/6
    close(AGGREGATIONS["token_mean"](t(V), t(M), num_tokens=3.0, num_seqs=2.0, max_len=4), 7 / 3)
    close(AGGREGATIONS["token_mean"](t(V), t(M), num_tokens=6.0, num_seqs=2.0, max_len=4), 7 / 6)


def test_seq_mean_token_mean():
    # row means (1+2)/2 = 1.5 and 4/1 = 4 -> (1.5 + 4) / 2 sequences = 2.75
    close(AGGREGATIONS["seq_mean_token_mean"](t(V), t(M), num_tokens=3.0, num_seqs=2.0, max_len=4), 2.75)


def test_seq_sum_norm():
    # (1 + 2 + 4) / (2 sequences * budget 4) = 7/8
    close(AGGREGATIONS["seq_sum_norm"](t(V), t(M), num_tokens=3.0, num_seqs=2.0, max_len=4), 0.875)


@pytest.mark.parametrize("name", ["token_mean", "seq_mean_token_mean", "seq_sum_norm"])
def test_aggregations_sum_over_micro_batches(name):
    # one row per micro-batch, normalised by the mini-batch's totals, sums to the mini-batch value
    fn, norm = AGGREGATIONS[name], {"num_tokens": 3.0, "num_seqs": 2.0, "max_len": 4}
    whole = fn(t(V), t(M), **norm)
    parts = fn(t(V)[:1], t(M)[:1], **norm) + fn(t(V)[1:], t(M)[1:], **norm)
    close(parts, whole)


# ------------------------------------------------------------------------------------------------ KL
def test_kl_estimators():
    # token 0: logp 0, ref -1 -> log r = ref - logp = -1; token 1: logp -1, ref 0 -> log r = +1
    logp, ref = t([[0.0, -1.0]]), t([[-1.0, 0.0]])
    close(KL_ESTIMATORS["k1"](logp, ref), [[1.0, -1.0]])  # -log r
    close(KL_ESTIMATORS["k2"](logp, ref), [[0.5, 0.5]])  # (log r)^2 / 2
    close(KL_ESTIMATORS["k3"](logp, ref), [[1 / E, E - 2]])  # r - 1 - log r: e^-1 - 1 + 1, e - 1 - 1


def test_k3_is_bounded_so_one_unlikely_token_cannot_swamp_the_step():
    # a token 20 nats (and 100: float32's exp overflows past 88) less likely under the policy than under the
    # reference: unbounded, k3 is 4.9e8 and inf; bounded at K3_MAX, with no gradient there, where a small gap
    # keeps its value and its gradient (r - 1)
    logp = t([[-20.0, -100.0, -1.0]]).requires_grad_()
    k3 = KL_ESTIMATORS["k3"](logp, t([[0.0, 0.0, 0.0]]))
    close(k3.detach(), [[K3_MAX, K3_MAX, E - 2]])
    k3.sum().backward()
    close(logp.grad, [[0.0, 0.0, -(E - 1)]])


def test_kl_reward_penalty_sums_over_model_tokens():
    # row 0 k3 = 1/e + (e - 2) = 1.08616 -> 1 - 0.1 * 1.08616 = 0.891384; row 1: KL 0 (its second token
    # is masked: a tool token, whatever its log-probs) -> 2
    logp, ref = t([[0.0, -1.0], [0.0, -5.0]]), t([[-1.0, 0.0], [0.0, 0.0]])
    got = kl_reward_penalty(t([1.0, 2.0]), logp, ref, t([[1, 1], [1, 0]]), coef=0.1, estimator="k3")
    close(got, [1 - 0.1 * (1 / E + E - 2), 2.0])


def test_reinforce_pp_kl_in_the_reward_is_the_kl_still_to_come_at_each_token():
    """REINFORCE++ (Hu 2025; OpenRLHF get_cumulative_returns): token t's return is r - coef * sum_{i>=t} KL_i,
    then normalised over the batch's model tokens. k1 KL [1, 0, -1] and [0, 0, 0], rewards 1 and 0, coef 0.5:
    KL to come [0, -1, -1] -> row 0's returns 1 - 0.5 * [0, -1, -1] = [1, 1.5, 1.5]; row 1's [0, 0, 0].
    Mean over the 6 tokens 4/6 = 2/3; unbiased std sqrt((1/9 + 2 * 25/36 + 3 * 4/9) / 5) = sqrt(17/30) = 0.7528.
    (Before, every token of row 0 paid the whole row's KL, 0: one advantage per row.)"""
    kl = t([[1.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
    mask = t([[1, 1, 1], [1, 1, 1]])
    got = kl_to_come_advantage(t([1.0, 0.0]), torch.tensor([0, 1]), kl, mask, coef=0.5, baseline=False, eps=1e-6)
    s = math.sqrt(17 / 30)
    close(got, [[(1 - 2 / 3) / s, (1.5 - 2 / 3) / s, (1.5 - 2 / 3) / s], [-(2 / 3) / s] * 3])
    # a masked token (a tool token, or padding) adds no KL, counts in no statistic and gets advantage 0:
    # row 0's first token masked -> returns [_, 1.5, 1.5], row 1 [0, 0, 0]; mean 3/5 = 0.6, std
    # sqrt((2 * 0.81 + 3 * 0.36) / 4) = sqrt(0.675)
    big = t([[99.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
    got = kl_to_come_advantage(t([1.0, 0.0]), torch.tensor([0, 1]), big, t([[0, 1, 1], [1, 1, 1]]), coef=0.5,
                               baseline=False, eps=1e-6)
    s = math.sqrt(0.675)
    close(got, [[0.0, 0.9 / s, 0.9 / s], [-0.6 / s] * 3])
    # reinforce_pp_baseline: the group mean comes off the reward first (rewards 1, 0 in one group -> 0.5, -0.5),
    # then the KL to come, then the batch std over the model tokens without re-centring (as its row-level form):
    # returns [0.5, 1, 1] and [-0.5] * 3, mean 1/6, the same deviations as above: std sqrt(17/30)
    got = kl_to_come_advantage(t([1.0, 0.0]), torch.tensor([0, 0]), kl, mask, coef=0.5, baseline=True, eps=1e-6)
    s = math.sqrt(17 / 30)
    close(got, [[0.5 / s, 1 / s, 1 / s], [-0.5 / s] * 3])
    # no spread anywhere: all zero
    close(kl_to_come_advantage(t([1.0, 1.0]), torch.tensor([0, 1]), kl * 0, mask, coef=0.5, baseline=False,
                               eps=1e-6), [[0.0] * 3] * 2)


def test_the_reinforce_pp_presets_give_per_token_advantages_when_kl_goes_in_the_reward():
    """The learner's targets, with the numbers above: the presets put k1 KL in the reward, to come per token."""
    from factory.types import Trajectory, Turn
    from factory.update.learner import targets

    def traj(i, reward):
        return Trajectory(prompt_index=i, sample_index=0, prompt_ids=[1, 2], response_ids=[3, 4, 5],
                          loss_mask=[1, 1, 1], turns=[Turn("x", 3)], stop_reason="no_call", row={}, reward=reward)

    old, ref = torch.tensor([[0.0, -1.0, -2.0], [-1.0, -1.0, -1.0]]), torch.full((2, 3), -1.0)  # k1: [1, 0, -1]
    s = math.sqrt(17 / 30)
    for name, second_group, want in (("reinforce_pp", 1, [[1 / 3, 5 / 6, 5 / 6], [-2 / 3] * 3]),
                                     ("reinforce_pp_baseline", 0, [[0.5, 1.0, 1.0], [-0.5] * 3])):
        alg = resolve(AlgorithmSpec(name=name, kl={"coef": 0.5}))
        assert alg.kl_apply == "reward" and alg.kl_estimator == "k1"
        got = targets([traj(0, 1.0), traj(second_group, 0.0)], alg, 100, old, ref, torch.ones(2, 3)).adv
        close(got, t(want, torch.float32) / s, atol=1e-6)


# -------------------------------------------------------------------------------------- DAPO extras
def test_dynamic_sampling_keeps_groups_with_spread():
    # groups (1, 1) and (0, 0) agree -> dropped; (0, 1) keeps both
    got = dynamic_sampling_keep(t([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1, 2, 2]), 1e-6)
    assert got.tolist() == [False, False, True, True, False, False]


def test_max_variance_keep_takes_the_extremes_of_each_group():
    # group 0: two right of eight -> both right ones and the first two wrong ones (variance 0.25, the most
    # four of them can have); group 1 has no more than m: all kept; group 2, interleaved, all equal: the first m
    rewards = t([1, 0, 0, 0, 0, 0, 1, 0, 0.5, 0.2, 3, 3, 3, 3, 3])
    groups = torch.tensor([0] * 8 + [1, 1] + [2] * 5)
    got = max_variance_keep(rewards, groups, 4).nonzero().flatten().tolist()
    assert got == [0, 1, 2, 6, 8, 9, 10, 11, 12, 13]


def test_max_variance_keep_ties_keep_the_earlier_sample():
    """m = 2 of (1, 1, 0, 0, 0): one 1 and one 0, the earlier of each (samples 0 and 2). The best were taken from
    the top of an ascending sort, so the later 1 (sample 1) was kept, against the docstring, and against
    max_turn_variance_keep, which keeps samples 0 and 2 of the same one-turn trajectories."""
    from factory.algorithms import max_turn_variance_keep

    rewards, groups = t([1.0, 1.0, 0.0, 0.0, 0.0]), torch.zeros(5, dtype=torch.long)
    assert max_variance_keep(rewards, groups, 2).tolist() == [True, False, True, False, False]
    assert max_turn_variance_keep([r.reshape(1) for r in rewards], groups, 2, 1.0).tolist() == [
        True, False, True, False, False]
    # ties among the best and the worst at once, interleaved: 3 of (0, 2, 2, 0, 0, 2) are the first 2, then 0 and 2
    assert max_variance_keep(t([0.0, 2.0, 2.0, 0.0, 0.0, 2.0]), torch.zeros(6, dtype=torch.long), 3).tolist() == [
        True, True, True, False, False, False]


@pytest.mark.parametrize("seed", range(4))
def test_max_variance_keep_chooses_as_the_turn_search_on_one_turn_trajectories(seed):
    """Rewards of 0, 1, 2 (ties everywhere): the m + 1 candidates choose the subset max_turn_variance_keep's
    search over every subset chooses, so `credit: turn` and `credit: trajectory` train the same samples."""
    from factory.algorithms import max_turn_variance_keep

    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (7,), generator=gen).double()
    groups = torch.zeros(7, dtype=torch.long)
    for m in range(2, 7):
        by_turn = max_turn_variance_keep([r.reshape(1) for r in rewards], groups, m, 1.0)
        assert torch.equal(max_variance_keep(rewards, groups, m), by_turn), (rewards.tolist(), m)


@pytest.mark.parametrize("seed", range(6))
def test_max_variance_keep_finds_the_most_spread_subset(seed):
    """Against every subset of size m, on rewards with ties and without: no subset spreads more."""
    import itertools

    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 4, (8,), generator=gen).float() if seed % 2 else torch.rand(8, generator=gen)
    for m in (2, 3, 4, 5):
        keep = max_variance_keep(rewards, torch.zeros(8, dtype=torch.long), m)
        assert int(keep.sum()) == m
        best = max(float(rewards[list(c)].var(unbiased=False)) for c in itertools.combinations(range(8), m))
        assert float(rewards[keep].var(unbiased=False)) == pytest.approx(best, abs=1e-7), (seed, m)


def test_overlong_penalty_dapo_formula():
    # budget 100, buffer 20: penalty starts after 80; exceed = len - 80 = (-10, 0, 10, 20, 40)
    # -> -clamp(exceed / 20, 0, 1) = (0, 0, -0.5, -1, -1), times penalty 0.5
    got = overlong_penalty(torch.tensor([70, 80, 90, 100, 120]), max_len=100, buffer=20, penalty=0.5)
    close(got.double(), [0.0, 0.0, -0.25, -0.5, -0.5])
    assert overlong_penalty(torch.tensor([120]), max_len=100, buffer=0, penalty=1.0).tolist() == [0.0]


# ------------------------------------------------------------------------------------- update helpers
def test_minibatches_partition_and_seed():
    parts = minibatches(10, 3, seed=7)
    assert [len(p) for p in parts] == [4, 3, 3]
    assert sorted(torch.cat(parts).tolist()) == list(range(10))
    assert all(torch.equal(a, b) for a, b in zip(parts, minibatches(10, 3, seed=7)))
    assert not torch.equal(torch.cat(parts), torch.cat(minibatches(10, 3, seed=8)))
    with pytest.raises(ValueError, match="mini_batches must be in"):
        minibatches(2, 3, seed=0)


def _bnpo(**kw):
    return resolve(AlgorithmSpec(name="bnpo", clip=(0.2, 0.28), **kw))


def test_policy_objective_adds_kl_and_subtracts_entropy():
    # the ppo_clip rows above: (-1.28 + e + 0.8 - 1/e) / 4 tokens = 1.8704 / 4 = 0.46760 (token mean)
    # + 0.1 * k1 (ref = logp - 0.5 on every model token: KL 0.5) = +0.05
    # - 0.01 * token-mean entropy (1 + 2 + 3 + 4) / 4 = 2.5 -> -0.025
    alg = _bnpo(kl=KLSpec(coef=0.1, estimator="k1"), entropy_coef=0.01)
    logp = t(LOGP)
    ref = torch.where(t(MASK).bool(), logp - 0.5, 0.0)
    ent = t([[1.0, 9.0], [2.0, 9.0], [3.0, 9.0], [4.0, 9.0]])
    pg = (-1.28 + E + 0.8 - 1 / E) / 4
    for name in ("bnpo", "gspo", "cispo"):  # -inf on padding leaves every loss's gradient finite
        leaf = logp.clone().requires_grad_()
        spec = AlgorithmSpec(name=name, kl=KLSpec(coef=0.1, estimator="k3"), entropy_coef=0.01)
        policy_objective(resolve(spec), leaf, t(OLD), t(ADV), t(MASK), ref_logp=t(LOGP) - 1, entropy=ent,
                         num_tokens=4.0, num_seqs=4.0, max_len=2)[0].backward()
        assert torch.isfinite(leaf.grad).all() and (leaf.grad[:, 1] == 0).all(), name
    loss, stats = policy_objective(alg, logp, t(OLD), t(ADV), t(MASK), ref_logp=ref, entropy=ent,
                                   num_tokens=4.0, num_seqs=4.0, max_len=2)
    close(loss, pg + 0.1 * 0.5 - 0.01 * 2.5)
    close(stats["pg_loss"], pg)
    close(stats["kl"], 0.5)
    close(stats["entropy"], 2.5)


def test_policy_objective_kl_takes_the_loss_aggregation_and_entropy_and_the_kl_stat_a_token_mean():
    """With grpo's seq_mean_token_mean and rows of 2 and 1 tokens the aggregations differ (the test above
    uses token_mean, where they agree). On-policy with A = 0, so only KL and entropy count:
      KL (k1 = logp - ref) per token (1, 3 | 5): seq_mean_token_mean (2 + 5) / 2 = 3.5 in the loss, as the
      policy loss is aggregated (verl); the stat its token mean 9 / 3 = 3.
      entropy (2, 4 | 9): token mean 15 / 3 = 5 whatever the aggregation (seq mean would be 6).
    loss = 0.1 * 3.5 - 0.01 * 5 = 0.30."""
    alg = resolve(AlgorithmSpec(name="grpo", kl=KLSpec(coef=0.1, estimator="k1", apply="loss"), entropy_coef=0.01))
    assert alg.aggregation == "seq_mean_token_mean"
    logp, mask = t([[-1.0, -2.0], [-0.5, 0.0]]), t([[1, 1], [1, 0]])
    ref = logp - t([[1.0, 3.0], [5.0, 7.0]])
    ent = t([[2.0, 4.0], [9.0, 100.0]])
    loss, stats = policy_objective(alg, logp, logp, t([0.0, 0.0]), mask, ref_logp=ref, entropy=ent,
                                   num_tokens=3.0, num_seqs=2.0, max_len=2)
    close(loss, 0.1 * 3.5 - 0.01 * 5)
    close(stats["kl"], 3.0)
    close(stats["entropy"], 5.0)


def test_policy_objective_stats_are_micro_batch_shares():
    # rows 0-1 and rows 2-3 as two micro-batches of a 4-token mini-batch: each clip fraction (1/4) and
    # the loss come out the same when summed
    alg = _bnpo()
    norm = {"num_tokens": 4.0, "num_seqs": 4.0, "max_len": 2}
    whole = policy_objective(alg, t(LOGP), t(OLD), t(ADV), t(MASK), **norm)
    halves = [policy_objective(alg, t(LOGP)[h], t(OLD)[h], t(ADV)[h], t(MASK)[h], **norm)
              for h in (slice(0, 2), slice(2, 4))]
    close(halves[0][0] + halves[1][0], whole[0])
    for key in ("pg_loss", "clip_frac_low", "clip_frac_high", "approx_kl"):
        close(halves[0][1][key] + halves[1][1][key], whole[1][key])
    close(whole[1]["clip_frac_low"], 0.25)


def test_policy_objective_kl_needs_ref_and_reward_mode_leaves_loss_alone():
    args = (t(LOGP), t(OLD), t(ADV), t(MASK))
    norm = {"num_tokens": 4.0, "num_seqs": 4.0, "max_len": 2}
    with pytest.raises(ValueError, match="needs ref_logp"):
        policy_objective(_bnpo(kl=KLSpec(coef=0.1)), *args, **norm)
    plain = policy_objective(_bnpo(), *args, **norm)[0]
    in_reward = policy_objective(_bnpo(kl=KLSpec(coef=0.1, apply="reward")), *args, ref_logp=t(LOGP) - 1, **norm)
    close(in_reward[0], plain)
    assert "kl" not in in_reward[1]


# -------------------------------------------------------------------------------------------- resolve
@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo", "bnpo", "gspo", "cispo", "rloo", "reinforce_pp",
                                  "reinforce_pp_baseline", "mean_baseline"])
def test_every_preset_resolves_to_known_names(name):
    alg = resolve(AlgorithmSpec(name=name))
    assert alg.name == name
    assert alg.advantage in ADVANTAGES and alg.loss in POLICY_LOSSES and alg.aggregation in AGGREGATIONS
    assert alg.kl_estimator in KL_ESTIMATORS and not alg.needs_reference


def test_presets_set_what_their_papers_set():
    assert set(PRESETS) >= {"grpo", "dr_grpo", "dapo", "bnpo", "gspo", "cispo", "rloo", "reinforce_pp",
                            "mean_baseline"}
    grpo, dr, dapo = resolve(AlgorithmSpec(name="grpo")), resolve(AlgorithmSpec(name="dr_grpo")), \
        resolve(AlgorithmSpec(name="dapo"))
    assert (grpo.advantage, grpo.aggregation, grpo.clip_low, grpo.clip_high) == ("grpo", "seq_mean_token_mean",
                                                                              0.2, 0.2)
    assert (dr.advantage, dr.aggregation) == ("dr_grpo", "seq_sum_norm")
    assert (dapo.aggregation, dapo.clip_high, dapo.dynamic_sampling) == ("token_mean", 0.28, True)
    assert resolve(AlgorithmSpec(name="gspo")).loss == "gspo"
    cispo = resolve(AlgorithmSpec(name="cispo"))
    assert (cispo.loss, cispo.clip_low, cispo.clip_high) == ("cispo", 1.0, 4.0)  # weight in [0, 5]
    assert resolve(AlgorithmSpec(name="reinforce_pp")).kl_apply == "reward"


def test_explicit_fields_override_the_preset():
    alg = resolve(AlgorithmSpec.model_validate({
        "name": "dapo", "clip": [0.1, 0.3], "dynamic_sampling": False, "aggregation": "seq_mean_token_mean",
        "loss": "dual_clip", "kl": {"coef": 0.05, "apply": "loss"}, "epochs": 2, "mini_batches": 4,
        "overlong": {"filter": True, "buffer": 16, "penalty": 0.5}, "entropy_coef": 0.001,
    }))
    assert (alg.clip_low, alg.clip_high, alg.dynamic_sampling, alg.aggregation) == (0.1, 0.3, False,
                                                                                     "seq_mean_token_mean")
    assert alg.loss == "dual_clip" and alg.dual_clip_c == 3.0  # verl's default c for dual clip
    assert (alg.kl_coef, alg.kl_apply, alg.needs_reference) == (0.05, "loss", True)
    assert (alg.epochs, alg.mini_batches, alg.entropy_coef) == (2, 4, 0.001)
    assert (alg.overlong_filter, alg.overlong_buffer, alg.overlong_penalty) == (True, 16, 0.5)
    # an explicit kl.apply beats the preset's (reinforce_pp puts KL in the reward)
    assert resolve(AlgorithmSpec.model_validate({"name": "reinforce_pp", "kl": {"apply": "loss"}})).kl_apply \
        == "loss"


def test_resolve_names_the_bad_value_and_lists_known_names():
    with pytest.raises(KeyError) as err:
        resolve(AlgorithmSpec(name="grpoo"))
    assert str(err.value) == ("unknown algorithm 'grpoo' (did you mean 'grpo'?); known: bnpo, cispo, dapo, dr_grpo, grpo, gspo, "
                              "mean_baseline, reinforce_pp, reinforce_pp_baseline, rloo")
    with pytest.raises(KeyError) as err:
        resolve(AlgorithmSpec(loss="ppo"))
    assert str(err.value) == ("algorithm.loss: unknown policy loss 'ppo' (did you mean 'ppo_clip'?); known: cispo, "
                              "dual_clip, gspo, ppo_clip")
    with pytest.raises(KeyError, match="algorithm.advantage: unknown advantage 'gae'"):
        resolve(AlgorithmSpec(advantage="gae"))
    # Rewards, generators and tools are named by import path; an advantage written that way is told why not
    with pytest.raises(KeyError) as err:
        resolve(AlgorithmSpec(advantage="mine.algos:my_advantage"))
    assert str(err.value) == (
        "algorithm.advantage: unknown advantage 'mine.algos:my_advantage'; known: dr_grpo, grpo, mean_baseline, "
        "reinforce_pp, reinforce_pp_baseline, rloo (algorithm.advantage takes a registry name, not an import path: "
        "a new advantage is a function in factory/algorithms.py, docs/algorithms.md#a-new-algorithm)")


def test_resolve_rejects_bad_numbers():
    with pytest.raises(ValueError, match=r"algorithm.dual_clip_c: must be > 1, got 0.5"):
        resolve(AlgorithmSpec(dual_clip_c=0.5))
    with pytest.raises(ValueError, match=r"algorithm.epochs: must be >= 1, got 0"):
        resolve(AlgorithmSpec(epochs=0))
    with pytest.raises(ValueError, match=r"algorithm.clip: bounds must be >= 0"):
        resolve(AlgorithmSpec(clip=(-0.1, 0.2)))
    with pytest.raises(ValueError, match=r"algorithm.overlong.buffer: must be >= 0"):
        resolve(AlgorithmSpec(overlong=OverlongSpec(buffer=-1)))


def test_module_is_float64_safe():
    # the whole objective keeps float64 (the parity tests compare to 1e-6 and rely on it)
    loss, stats = policy_objective(_bnpo(), t(LOGP), t(OLD), t(ADV), t(MASK), num_tokens=4.0, num_seqs=4.0,
                                   max_len=2)
    assert loss.dtype == torch.float64 and all(v.dtype == torch.float64 for v in stats.values())
    assert A.ADVANTAGES["grpo"](t(R), torch.tensor(G), eps=1e-6).dtype == torch.float64


def test_preset_names_match_the_registries():
    # factory.presets keeps a torch-free copy of the registry names for `factory check`.
    from factory import algorithms as A
    from factory.presets import NAMES

    assert NAMES == {"advantage": A.ADVANTAGES.names(), "policy loss": A.POLICY_LOSSES.names(),
                     "aggregation": A.AGGREGATIONS.names(), "KL estimator": A.KL_ESTIMATORS.names()}


def test_the_spec_reference_lists_every_registry_name():
    """The field docs of algorithm.advantage/loss/aggregation list the names by hand: a new one must be added
    there too (docs/algorithms.md#a-new-algorithm), or the generated reference leaves it out."""
    import re

    from factory.presets import NAMES
    from factory.schema import AlgorithmSpec

    for field, kind in (("advantage", "advantage"), ("loss", "policy loss"), ("aggregation", "aggregation")):
        listed = re.search(r"\(([^)]*)\)", AlgorithmSpec.model_fields[field].description).group(1)
        assert sorted(listed.split(", ")) == NAMES[kind], field


# ------------------------------------------------------------------------------ rollout correction
def test_truncated_is_weights_hand_worked():
    # token 0: pi_old 0.5, pi_rollout 0.2 -> 2.5, capped at 2.0
    # token 1: pi_old 0.3, pi_rollout 0.6 -> 0.5
    # token 2: a tool token (mask 0) -> 1, whatever its numbers
    old = torch.log(t([[0.5, 0.3, 0.9]]))
    rollout = torch.log(t([[0.2, 0.6, 0.1]]))
    close(A.truncated_is_weights(old, rollout, t([[1.0, 1.0, 0.0]]), cap=2.0), [[2.0, 0.5, 1.0]])


def test_tis_in_the_policy_objective_hand_worked():
    # on-policy (ratio 1), A = +1, PPO-clip: each token's loss is -1; times the weights 2.0 and 0.5
    # -> [-2, -0.5]; token mean over 2 tokens = -1.25
    alg = resolve(AlgorithmSpec(name="bnpo", rollout_correction={"kind": "tis", "cap": 2.0}))
    logp = torch.log(t([[0.5, 0.3]]))
    weights = A.truncated_is_weights(logp, torch.log(t([[0.2, 0.6]])), t([[1.0, 1.0]]), cap=2.0)
    loss, stats = policy_objective(alg, logp, logp, t([1.0]), t([[1.0, 1.0]]), is_weights=weights,
                                   num_tokens=2.0, num_seqs=1.0, max_len=2)
    close(loss, -1.25)
    close(stats["tis_weight_mean"], 1.25)  # (2.0 + 0.5) / 2
    close(stats["tis_capped_frac"], 0.5)  # one of the two tokens hit the cap


def test_rollout_mismatch_sums_over_model_tokens():
    # |(-1) - (-1.5)| = 0.5 and |(-2) - (-1.9)| = 0.1 on model tokens; the tool token's 9 is ignored
    total, count, worst = A.rollout_mismatch(t([[-1.0, -2.0, 0.0]]), t([[-1.5, -1.9, 9.0]]), t([[1.0, 1.0, 0.0]]))
    assert (round(total, 6), count, round(worst, 6)) == (0.6, 2.0, 0.5)


def test_rollout_correction_and_rollout_logprobs_exclude_each_other():
    assert resolve(AlgorithmSpec(rollout_correction={"cap": 3.0})).rollout_correction_cap == 3.0
    assert resolve(AlgorithmSpec()).rollout_correction is None
    with pytest.raises(ValueError, match="algorithm.rollout_correction: with use_rollout_logprobs"):
        resolve(AlgorithmSpec(rollout_correction={"kind": "tis"}, use_rollout_logprobs=True))
