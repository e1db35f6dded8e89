"""Turn-level credit (`algorithm.credit: turn`): per-turn returns and advantages worked by hand, their spread
over each turn's loss-mask tokens, and the update: `credit: trajectory` (the default) takes today's path,
and on one-turn trajectories both credits give the same weights bit for bit (tests/test_update.py, beside
its tiny model)."""
import pytest
import torch

from factory.algorithms import ADVANTAGES, discounted_turn_returns, turn_advantages
from factory.schema import AlgorithmSpec
from factory.types import Trajectory, Turn
from factory.update.batch import token_advantages, turn_of_tokens, turn_rewards
from factory.update.learner import targets
from factory.presets import resolve


def close(a, b):
    torch.testing.assert_close(a, torch.tensor(b, dtype=a.dtype), rtol=0, atol=1e-6)


def test_discounted_turn_returns_by_hand():
    r = torch.tensor([1.0, 0.0, 1.0])
    # gamma 0.5, backwards: G2 = 1/1 = 1; G1 = (0 + .5*1) / (1 + .5) = 1/3; G0 = (1 + .5*.5) / (1 + .5*1.5) = 1.25/1.75 = 5/7
    close(discounted_turn_returns(r, 0.5), [5 / 7, 1 / 3, 1.0])
    close(discounted_turn_returns(r, 1.0), [2 / 3, 1 / 2, 1.0])  # means of [1,0,1], [0,1], [1]
    close(discounted_turn_returns(r, 0.0), [1.0, 0.0, 1.0])  # each turn alone
    assert discounted_turn_returns(torch.tensor([]), 0.5).numel() == 0


# group 0: a = [1, 0, 1], b = [0, 1], c = [1, 1, 0]; group 1: d = [2, 2] alone
REWARDS = [torch.tensor(x) for x in ([1.0, 0.0, 1.0], [0.0, 1.0], [1.0, 1.0, 0.0], [2.0, 2.0])]
GROUPS = torch.tensor([0, 0, 0, 1])


def test_turn_advantages_by_hand():
    # gamma 0.5 returns: a [5/7, 1/3, 1]; b [(0 + .5*1)/1.5 = 1/3, 1]; c [(1 + .5*1)/1.75 = 6/7, (1 + 0)/1.5 = 2/3, 0]
    # dr_grpo: G - the mean of the group's returns at the same turn position
    #   position 0: {5/7, 1/3, 6/7} = {45, 21, 54}/63, mean 40/63 -> a 5/63, b -19/63, c 14/63
    #   position 1: {1/3, 1, 2/3}, mean 2/3 -> a -1/3, b 1/3, c 0
    #   position 2: {1, 0} (a, c; b has no turn 2), mean 1/2 -> a 1/2, c -1/2
    #   d is alone in its group at every position: no comparison, 0
    a, b, c, d = turn_advantages(REWARDS, GROUPS, gamma=0.5, advantage="dr_grpo", eps=1e-6)
    close(a, [5 / 63, -1 / 3, 1 / 2])
    close(b, [-19 / 63, 1 / 3])
    close(c, [14 / 63, 0.0, -1 / 2])
    close(d, [0.0, 0.0])
    # grpo also divides by the position's std (Bessel): position 1 deviations -1/3, 1/3, 0 -> var (2/9)/2,
    # std 1/3 -> -1, 1, 0; position 2 deviations 1/2, -1/2 -> var (1/2)/1, std 1/sqrt(2) -> +-sqrt(2)/2
    a, b, c, _ = turn_advantages(REWARDS, GROUPS, gamma=0.5, advantage="grpo", eps=1e-6)
    assert [float(a[1]), float(b[1]), float(c[1])] == pytest.approx([-1.0, 1.0, 0.0], abs=1e-6)
    assert [float(a[2]), float(c[2])] == pytest.approx([2 ** -0.5, -(2 ** -0.5)], abs=1e-6)


def test_batch_estimators_compare_the_turns_at_one_position():
    """reinforce_pp and mean_baseline use no groups: under credit: turn they normalised every turn of the
    batch together (a first turn against a third, longer trajectories weighing more)."""
    returns = [discounted_turn_returns(r, 0.5) for r in REWARDS]
    for name in ("reinforce_pp", "mean_baseline", "reinforce_pp_baseline", "grpo"):
        got = turn_advantages(REWARDS, GROUPS, gamma=0.5, advantage=name, eps=1e-6)
        for k in range(3):
            who = [i for i, r in enumerate(returns) if len(r) > k]
            want = ADVANTAGES[name](torch.stack([returns[i][k] for i in who]), GROUPS[who], eps=1e-6)
            close(torch.stack([got[i][k] for i in who]), want.tolist())
    # by hand, mean_baseline at position 1: the returns a 1/3, b 1, c 2/3, d 2 (d's rewards are all 2), mean 1
    _, b, _, d = turn_advantages(REWARDS, GROUPS, gamma=0.5, advantage="mean_baseline", eps=1e-6)
    close(b[1:], [0.0])
    close(d[1:], [1.0])


def test_with_gamma_1_turn_0_gets_the_trajectory_advantage():
    """G_0 with gamma 1 is the mean of the turns: the trajectory's reward under credit: trajectory."""
    first = [adv[0] for adv in turn_advantages(REWARDS, GROUPS, gamma=1.0, advantage="grpo", eps=1e-6)]
    means = torch.stack([r.mean() for r in REWARDS])
    torch.testing.assert_close(torch.stack(first), ADVANTAGES["grpo"](means, GROUPS, eps=1e-6))


def test_each_turn_advantage_lands_on_that_turns_model_tokens():
    # turn 0: 2 tokens, a 2-token tool response, turn 1: 1 token, a tool response, turn 2: 2 tokens
    mask = [1, 1, 0, 0, 1, 0, 1, 1]
    assert turn_of_tokens(mask, [2, 1, 2]).tolist() == [0, 0, -1, -1, 1, -1, 2, 2]
    assert turn_of_tokens([1, 1, 1], [1, 1]).tolist() == [0, 1, 1]  # more model tokens than counted: the last turn's
    assert turn_of_tokens([1, 0, 1, 1], [1, 0, 2]).tolist() == [0, -1, 2, 2]  # a turn of no tokens owns none
    t = traj(mask, [2, 1, 2], reward=0.0)
    adv = token_advantages([t, traj([], [], 0.0)], [torch.tensor([0.5, -1.0, 2.0]), torch.tensor([])], width=10)
    close(adv, [[0.5, 0.5, 0, 0, -1.0, 0, 2.0, 2.0, 0, 0], [0] * 10])


def traj(mask, turn_tokens, reward, group=0, turn_reward=()):
    return Trajectory(prompt_index=group, sample_index=0, prompt_ids=[5, 6], response_ids=[7] * len(mask),
                      loss_mask=mask, turns=[Turn(text="", num_tokens=n) for n in turn_tokens], stop_reason="no_call",
                      row={}, reward=reward, turn_reward=list(turn_reward))


def test_turn_rewards_from_a_per_turn_or_a_trajectory_node_with_the_shaping_at_every_turn():
    per_turn = traj([1, 1], [1, 1], reward=0.5, turn_reward=[1.0, 0.0])
    whole = traj([1, 1, 1], [1, 2], reward=2.0)
    r = turn_rewards([per_turn, whole], torch.tensor([0.5 - 0.25, 2.0]))  # an overlong penalty of 0.25 on the first
    close(r[0], [0.75, -0.25])
    close(r[1], [2.0, 2.0])


def test_targets_by_credit():
    """credit: trajectory is today's path ([n] from the registry, bit for bit); turn: [n, Rmax] per token."""
    trajs = [traj([1, 0, 1], [1, 1], 0.5, turn_reward=[1.0, 0.0]), traj([1, 0, 1], [1, 1], 1.0, turn_reward=[1.0, 1.0]),
             traj([1], [1], 0.0, turn_reward=[0.0])]
    mask = torch.tensor([[1.0, 0, 1], [1, 0, 1], [1, 0, 0]])
    default = resolve(AlgorithmSpec(name="grpo"))
    assert default.credit == "trajectory"
    got = targets(trajs, default, 64, None, None, mask)
    expected = ADVANTAGES["grpo"](torch.tensor([0.5, 1.0, 0.0]), torch.tensor([0, 0, 0]), eps=default.std_eps)
    assert got.adv.shape == (3,) and torch.equal(got.adv, expected)
    turn = resolve(AlgorithmSpec(name="dr_grpo", credit="turn", gamma=0.0))
    got = targets(trajs, turn, 64, None, None, mask)
    # position 0: {1, 1, 0}, mean 2/3 -> 1/3, 1/3, -2/3; position 1: {0, 1} (the third has one turn) -> -1/2, 1/2
    close(got.adv, [[1 / 3, 0, -1 / 2], [1 / 3, 0, 1 / 2], [-2 / 3, 0, 0]])


def test_a_kl_in_the_reward_under_turn_credit_is_paid_by_each_turn_for_its_own_tokens():
    """The whole trajectory's KL penalty was added at every turn: a later turn's return carried the KL of
    earlier ones, which its tokens cannot change. Each turn's reward now pays its own tokens' KL: with
    gamma 0 (each turn's own reward) a turn whose tokens match the reference keeps its reward exactly."""
    from factory.algorithms import KL_ESTIMATORS
    from factory.update.batch import turn_sums

    # turn 0: tokens 0-1, a tool response (2-3), turn 1: token 4; the second row has one turn
    trajs = [traj([1, 1, 0, 0, 1], [2, 1], 1.0), traj([1, 1, 0, 0, 1], [2, 1], 0.0), traj([1, 0, 0, 0, 0], [1], 0.5)]
    mask = torch.tensor([[1.0, 1, 0, 0, 1], [1, 1, 0, 0, 1], [1, 0, 0, 0, 0]])
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5, 0.2], [0.5, 0.5, 0.9, 0.9, 0.5], [0.3, 0.5, 0.5, 0.5, 0.5]]))
    ref = torch.log(torch.full((3, 5), 0.5))  # row 0 differs at turn 1 only, row 1 at tool tokens only, row 2 at turn 0
    alg = resolve(AlgorithmSpec(name="dr_grpo", credit="turn", gamma=0.0, kl={"coef": 0.1, "apply": "reward"}))
    kl = KL_ESTIMATORS[alg.kl_estimator](old, ref)
    sums = turn_sums(trajs, kl * mask)
    close(sums[0], [0.0, float(kl[0, 4])])
    close(sums[1], [0.0, 0.0])  # the tool tokens' differences are no turn's
    close(sums[2], [float(kl[2, 0])])
    got = targets(trajs, alg, 64, old, ref, mask)
    close(got.rewards, [1.0 - 0.1 * float(kl[0, 4]), 0.0, 0.5 - 0.1 * float(kl[2, 0])])  # the trajectory's, as before
    # gamma 0: each turn's advantage from its own reward. Position 0: {1, 0, 0.5 - 0.1 KL}; position 1:
    # {1 - 0.1 KL, 0}: turn 0 of row 0 keeps its whole reward, turn 1 pays for its token
    r2 = 0.5 - 0.1 * float(kl[2, 0])
    mean0, mean1 = (1.0 + 0.0 + r2) / 3, (1.0 - 0.1 * float(kl[0, 4])) / 2
    close(got.adv[:, [0, 4]], [[1.0 - mean0, 1.0 - 0.1 * float(kl[0, 4]) - mean1], [0.0 - mean0, 0.0 - mean1],
                               [r2 - mean0, 0.0]])


def test_gamma_is_refused_without_turn_credit():
    with pytest.raises(ValueError, match="`gamma` discounts later turns' rewards under `credit: turn`; with credit "
                                         "'trajectory' nothing reads it: set `credit: turn`, or remove `gamma`"):
        AlgorithmSpec(gamma=0.9)


def test_dynamic_sampling_under_turn_credit_keeps_groups_whose_turns_differ():
    from factory.algorithms import dynamic_sampling_keep, turn_dynamic_sampling_keep

    # group 0: [1, 0] and [0, 1] agree as trajectories (mean 0.5 each) but not at turn 1 (returns 0 vs 1, gamma 1);
    # group 1: [1, 1] twice agree everywhere; group 2: one turn and no turn (a lone position each)
    rewards = [torch.tensor(x) for x in ([1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0], [])]
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    means = torch.tensor([0.5, 0.5, 1.0, 1.0, 1.0, 0.0])
    assert dynamic_sampling_keep(means[:4], groups[:4], 1e-6).tolist() == [False] * 4  # trajectory credit drops both
    assert turn_dynamic_sampling_keep(rewards, groups, 1.0, 1e-6).tolist() == [True, True, False, False, False, False]


def test_turn_credit_gives_zero_advantage_to_a_group_whose_rewards_all_agree():
    """Every trajectory of the group scored 10 at every turn (a trajectory-level node), over 1 to 6 turns, gamma 0.8.
    Each turn return is 10, but the float32 backward scan left it an ulp or two off, and grpo turned that rounding
    into advantages up to 1.79; dynamic sampling kept the group. The same with 10.1 and gamma 1."""
    from factory.algorithms import turn_dynamic_sampling_keep

    groups = torch.zeros(6, dtype=torch.long)
    for value, gamma in ((10.0, 0.8), (10.1, 1.0), (10.1, 0.8)):
        rewards = [torch.full((k,), value) for k in range(1, 7)]
        for name in ADVANTAGES.names():
            adv = turn_advantages(rewards, groups, gamma=gamma, advantage=name, eps=1e-6)
            assert all(a.dtype == torch.float32 and a.eq(0).all() for a in adv), (name, value, gamma, adv)
        assert not turn_dynamic_sampling_keep(rewards, groups, gamma, 1e-6).any(), (value, gamma)


def test_the_update_skips_a_group_whose_float32_rewards_all_agree():
    """Through the learner: 8 samples of one prompt all scored 10.1 (say `sum: {correct: 10, format: 0.1}`).
    targets() gave every row +-0.935, the zero-advantage skip ran all 8 rows and the step counted no
    zero-advantage group."""
    from factory.update.batch import without_zero_advantage
    from factory.update.learner import _zero_groups

    trajs = [traj([1, 1], [2], 10.1) for _ in range(8)]
    got = targets(trajs, resolve(AlgorithmSpec(name="grpo")), 64, None, None, torch.ones(8, 2))
    assert without_zero_advantage([[list(range(8))]], got.adv, 8) == [[]], got.adv.tolist()
    assert _zero_groups(got.adv, got.groups) == 1


def test_dynamic_sampling_under_turn_credit_compares_returns_at_the_same_position_only():
    """Group 0's trajectories are the same [1, 0] twice: at each position the returns agree (gamma 1: 0.5 at
    turn 0, 0 at turn 1), so every turn's advantage is 0 and the group is dropped, though its returns differ
    from one position to the next; group 1 ([1, 0] and [0, 0]) differs at turn 0 and is kept."""
    from factory.algorithms import turn_dynamic_sampling_keep

    rewards = [torch.tensor(x) for x in ([1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 0.0])]
    groups = torch.tensor([0, 0, 1, 1])
    assert all(not a.any() for a in turn_advantages(rewards[:2], groups[:2], gamma=1.0, advantage="grpo", eps=1e-6))
    assert turn_dynamic_sampling_keep(rewards, groups, 1.0, 1e-6).tolist() == [False, False, True, True]


def test_down_sampling_under_turn_credit_keeps_the_samples_whose_turns_differ():
    from factory.algorithms import max_turn_variance_keep, max_variance_keep

    # one group of 4, all with the same trajectory reward (0.5, gamma 1): a and b agree turn by turn,
    # c and d do not (returns at turn 1: 0 and 1). By trajectory reward every pair ties and the first two
    # (a, b: nothing to learn) are kept; by turn returns c and d, the only pair with a spread.
    rewards = [torch.tensor(x) for x in ([0.5, 0.5], [0.5, 0.5], [1.0, 0.0], [0.0, 1.0])]
    groups = torch.zeros(4, dtype=torch.long)
    assert max_variance_keep(torch.full((4,), 0.5), groups, 2).tolist() == [True, True, False, False]
    assert max_turn_variance_keep(rewards, groups, 2, gamma=1.0).tolist() == [False, False, True, True]
    # a group of m or fewer keeps all; a second group is chosen on its own
    two = max_turn_variance_keep(rewards + [torch.tensor([1.0])], torch.tensor([0, 0, 0, 0, 1]), 2, gamma=1.0)
    assert two.tolist() == [False, False, True, True, True]


@pytest.mark.parametrize("seed", range(3))
def test_down_sampling_under_turn_credit_with_one_reward_per_trajectory_is_max_variance(seed):
    """A trajectory-level reward counts at every turn: with equal turn counts the turn objective is the turn
    count times the reward's variance, so it keeps the subset max_variance_keep keeps (distinct rewards)."""
    from factory.algorithms import max_turn_variance_keep, max_variance_keep

    gen = torch.Generator().manual_seed(seed)
    reward = torch.rand(16, generator=gen)
    groups = torch.tensor([0] * 8 + [1] * 8)
    turns = [r.repeat(3) for r in reward]
    for m in (2, 3, 5):
        assert torch.equal(max_turn_variance_keep(turns, groups, m, gamma=0.7), max_variance_keep(reward, groups, m))


def test_down_sampling_under_turn_credit_falls_back_to_first_turn_returns_for_big_groups():
    from factory.algorithms import MAX_SUBSETS, max_turn_variance_keep, max_variance_keep
    from math import comb

    assert comb(18, 9) > MAX_SUBSETS >= comb(16, 8)
    gen = torch.Generator().manual_seed(3)
    rewards = [torch.rand(int(torch.randint(1, 4, (1,), generator=gen)), generator=gen) for _ in range(18)]
    groups = torch.zeros(18, dtype=torch.long)
    first = torch.stack([discounted_turn_returns(r, 0.5)[0] for r in rewards])
    got = max_turn_variance_keep(rewards, groups, 9, gamma=0.5)
    assert torch.equal(got, max_variance_keep(first, groups, 9)) and int(got.sum()) == 9


@pytest.mark.parametrize("seed", range(4))
def test_down_sampling_under_turn_credit_keeps_the_subset_that_spreads_most_turn_by_turn(seed):
    """Against every subset written out by hand: turn counts of 1-3, some with no turn at all."""
    import itertools

    from factory.algorithms import max_turn_variance_keep

    gen = torch.Generator().manual_seed(seed)
    rewards = [torch.randint(0, 3, (int(torch.randint(0, 4, (1,), generator=gen)),), generator=gen).float()
               for _ in range(8)]
    returns = [discounted_turn_returns(r, 0.8).tolist() for r in rewards]

    def spread(chosen):
        total = 0.0
        for k in range(4):
            at = [returns[i][k] for i in chosen if len(returns[i]) > k]
            if len(at) > 1:
                total += sum((x - sum(at) / len(at)) ** 2 for x in at) / len(at)
        return total

    for m in (2, 3, 5):
        got = max_turn_variance_keep(rewards, torch.zeros(8, dtype=torch.long), m, gamma=0.8)
        assert int(got.sum()) == m
        best = max(spread(c) for c in itertools.combinations(range(8), m))
        assert spread(got.nonzero().flatten().tolist()) == pytest.approx(best, abs=1e-9), (seed, m)
