"""RL algorithms as pure tensor functions, chosen by name from small registries.

Four registries hold the pieces (verl core_algos style): ADVANTAGES turn one reward per sample into one
advantage per sample (`turn_advantages` applies one per model turn, for `credit: turn`), POLICY_LOSSES turn log-probs into a per-token loss, AGGREGATIONS turn per-token
values into the one number to backprop, KL_ESTIMATORS estimate KL(policy || reference) per token.
PRESETS name the published combinations (grpo, dapo, gspo, ...); `resolve` merges a preset with what a
spec sets explicitly into a frozen `Algorithm`, and `policy_objective` computes one micro-batch's loss.

A new algorithm is one function and one `@REGISTRY.register("name")` line, and its name where
factory/presets.py lists it (docs/algorithms.md#a-new-algorithm says where). Shapes: N sequences, T
response tokens; `mask` is 1 on tokens the model produced (tool/template tokens and padding are 0).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

# Presets and resolve() live in a torch-free module so `factory check` stays fast; re-exported here.
from factory.presets import NAMES, PRESETS, Algorithm, UnknownNameError, did_you_mean, resolve  # noqa: F401

# exp() of a log-ratio beyond this is a numerical accident, not a policy change (verl clamps at 20 too).
_MAX_LOG_RATIO = 20.0


class Registry:
    """name -> function. Registering a name twice is an error, so two modules can never silently shadow
    each other's algorithm; an unknown name lists the known ones so `factory check` can show them."""

    def __init__(self, kind: str):
        self.kind = kind
        self._fns: dict[str, Callable[..., Any]] = {}

    def register(self, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def add(fn: Callable[..., Any]) -> Callable[..., Any]:
            if name in self._fns:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._fns[name] = fn
            return fn

        return add

    def __getitem__(self, name: str) -> Callable[..., Any]:
        if name not in self._fns:
            raise UnknownNameError(f"unknown {self.kind} {name!r}{did_you_mean(name, self.names())}; known: "
                                   f"{', '.join(self.names())}")
        return self._fns[name]

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def names(self) -> list[str]:
        return sorted(self._fns)


ADVANTAGES = Registry("advantage")
POLICY_LOSSES = Registry("policy loss")
AGGREGATIONS = Registry("aggregation")
KL_ESTIMATORS = Registry("KL estimator")


# ---------------------------------------------------------------------------------------- advantages
def _group_stats(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sample mean and unbiased std of its group (groups need not be contiguous), in float64. A group
    of one has std 0: it carries no comparison, so it counts as zero-variance.

    float64 because the rewards come in float32: there the mean of eight 10.1s is one ulp off 10.1, every
    deviation is that ulp and their std (~1e-6) passes std_eps, so a group whose rewards all agree looked
    spread and grpo divided the rounding error by itself (+-0.93 each). In float64 the sum of identical float32
    values is exact, so is their mean, and any other rounding is far below std_eps. The estimators cast their
    advantages back to the rewards' dtype."""
    x = rewards.double()  # [N]
    _, inv = torch.unique(group_ids, return_inverse=True)  # [N] dense group index
    k = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(k, dtype=x.dtype).index_add_(0, inv, torch.ones_like(x))  # [G]
    mean = torch.zeros(k, dtype=x.dtype).index_add_(0, inv, x) / count  # [G]
    sq = torch.zeros(k, dtype=x.dtype).index_add_(0, inv, (x - mean[inv]) ** 2)  # [G]
    std = (sq / (count - 1).clamp(min=1)).sqrt()  # [G] Bessel-corrected, as torch.std / TRL / verl
    return mean[inv], std[inv]  # [N], [N] float64


@ADVANTAGES.register("grpo")
def grpo_advantage(rewards: Tensor, group_ids: Tensor, *, eps: float) -> Tensor:
    """(r - group mean) / group std (DeepSeekMath). Zero where std < eps: dividing by a near-zero std
    would turn float noise into large advantages that Adam then amplifies."""
    mean, std = _group_stats(rewards, group_ids)
    flat = std < eps
    return torch.where(flat, 0.0, (rewards.double() - mean) / torch.where(flat, 1.0, std)).to(rewards.dtype)


@ADVANTAGES.register("dr_grpo")
def dr_grpo_advantage(rewards: Tensor, group_ids: Tensor, *, eps: float) -> Tensor:
    """r - group mean, no std scaling (Dr.GRPO: the std divides easy and hard prompts unequally)."""
    mean, std = _group_stats(rewards, group_ids)
    return torch.where(std < eps, 0.0, rewards.double() - mean).to(rewards.dtype)


@ADVANTAGES.register("rloo")
def rloo_advantage(rewards: Tensor, group_ids: Tensor, *, eps: float) -> Tensor:
    """r_i - mean of the OTHER samples of the group = G/(G-1) * (r_i - group mean) (Ahmadian et al.)."""
    mean, std = _group_stats(rewards, group_ids)
    _, inv, count = torch.unique(group_ids, return_inverse=True, return_counts=True)
    g = count[inv].double()  # [N] size of each sample's group
    return torch.where(std < eps, 0.0, (rewards.double() - mean) * g / (g - 1).clamp(min=1)).to(rewards.dtype)


def _batch_normalise(x: Tensor, eps: float) -> Tensor:
    """(x - mean) / std over the whole batch, 0 when it agrees; in float64 as `_group_stats`, cast back."""
    d = x.double()
    std = d.std() if d.numel() > 1 else d.new_zeros(())
    return torch.zeros_like(x) if std < eps else ((d - d.mean()) / std).to(x.dtype)


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp_advantage(rewards: Tensor, group_ids: Tensor, *, eps: float) -> Tensor:
    """REINFORCE++ (Hu 2025): rewards normalised over the whole batch; groups are not used."""
    return _batch_normalise(rewards, eps)


@ADVANTAGES.register("reinforce_pp_baseline")
def reinforce_pp_baseline_advantage(rewards: Tensor, group_ids: Tensor, *, eps: float) -> Tensor:
    """REINFORCE++-baseline: subtract the group mean, then divide by the batch std of the result (its
    batch mean is already 0). Zero-variance groups stay exactly 0."""
    mean, std = _group_stats(rewards, group_ids)
    centred = torch.where(std < eps, 0.0, rewards.double() - mean)  # [N] float64
    scale = centred.std() if centred.numel() > 1 else centred.new_zeros(())
    # not re-centred on the float batch mean (~1e-8, not 0): that left zero-variance groups' rows a hair off 0,
    # so the update's zero-advantage skip never saw them
    return torch.zeros_like(rewards) if scale < eps else (centred / scale).to(rewards.dtype)


@ADVANTAGES.register("mean_baseline")
def mean_baseline_advantage(rewards: Tensor, group_ids: Tensor, *, eps: float) -> Tensor:
    """r - batch mean: plain REINFORCE with a mean baseline, for group_size 1 (the group-mean variant
    is `dr_grpo`). Zero when the whole batch agrees (float64, as `_group_stats`)."""
    x = rewards.double()
    if x.numel() < 2 or x.std() < eps:
        return torch.zeros_like(rewards)
    return (x - x.mean()).to(rewards.dtype)


# ----------------------------------------------------------------------------------- turn credit
def discounted_turn_returns(rewards: Tensor, gamma: float) -> Tensor:
    """[K] each turn's return from its turn rewards [K]: the discounted mean of the rewards from that turn
    on, G_k = sum_{j>=k} gamma^(j-k) r_j / sum_{j>=k} gamma^(j-k).

    The discounted return of RL (Sutton & Barto, ch. 3), divided by the sum of its weights: a turn's
    reward here is a rate that the reward graph defines per turn (a trajectory-level node counts at every
    turn), so the return keeps its scale whatever the number of turns left. gamma = 1: the mean of this
    and later turns (G_0 is the trajectory's reward, the mean over its turns); gamma = 0: r_k alone.
    Summed in float64 and cast back: in float32 the returns of a trajectory scoring 10 at every turn came out an
    ulp or two apart, which group standardisation then amplified as it did for `_group_stats`."""
    out = torch.empty(rewards.shape, dtype=torch.float64)  # [K]
    num = den = 0.0
    for k, r in reversed(list(enumerate(rewards.double().tolist()))):  # a handful of turns: a plain backward scan
        num, den = r + gamma * num, 1.0 + gamma * den
        out[k] = num / den
    return out.to(rewards.dtype)


def turn_advantages(turn_rewards: list[Tensor], group_ids: Tensor, *, gamma: float, advantage: str,
                    eps: float) -> list[Tensor]:
    """One advantage per model turn ([K_i] per trajectory i) from each turn's reward ([K_i] each; N in all).

    Each turn's return (`discounted_turn_returns`) is standardised by the advantage estimator `advantage`
    (grpo: (G - mean) / std, ...) among the turns at the same position k of the same group's trajectories:
    group-relative advantages (GRPO, Shao et al. 2024) taken per step, as GiGPO's step-level groups (Feng
    et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training", arXiv:2505.10978), whose anchor
    states -- the same environment state reached by several trajectories -- are here the same turn of the
    same prompt (the states themselves are not compared). A position that only one trajectory of a group
    reached has no comparison: advantage 0, as a group of one. The estimator sees one position at a time,
    so what it takes over the batch (reinforce_pp's and mean_baseline's mean and std, reinforce_pp_baseline's
    std) is over the batch's turns at that position, never a first turn with a third; like a group's, a
    position few trajectories reach is normalised over those few."""
    lengths = [int(r.numel()) for r in turn_rewards]
    if not sum(lengths):
        return [r.new_zeros(0) for r in turn_rewards]
    returns, cell, _, position = _turn_cells(turn_rewards, group_ids, gamma)
    out = torch.empty_like(returns)
    for k in range(max(lengths)):
        at = position == k
        out[at] = ADVANTAGES[advantage](returns[at], cell[at], eps=eps)
    return list(torch.split(out, lengths))


def _turn_cells(turn_rewards: list[Tensor], group_ids: Tensor,
                gamma: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The turns of a batch that has some ([K_i] rewards per trajectory i), flat: each turn's return
    (`discounted_turn_returns`) [sum K], its cell -- (its trajectory's group, its position k), numbered --
    [sum K], its trajectory [sum K] and its position k [sum K]. A turn's advantage is standardised within
    its cell."""
    lengths = [int(r.numel()) for r in turn_rewards]
    returns = torch.cat([discounted_turn_returns(r, gamma) for r in turn_rewards])  # [sum K]
    position = torch.cat([torch.arange(k) for k in lengths])  # [sum K] turn index within its trajectory
    owner = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))  # [sum K] its trajectory
    _, cell = torch.unique(torch.stack([group_ids[owner], position], 1), dim=0, return_inverse=True)
    return returns, cell, owner, position


# ------------------------------------------------------------------------------------ policy losses
def _per_token(advantages: Tensor) -> Tensor:
    """[N, 1]: one advantage per sequence, broadcast over its tokens; or [N, T] as given (turn credit,
    `kl_to_come_advantage`)."""
    return advantages[:, None] if advantages.dim() == 1 else advantages


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1.0)


def _log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """log(pi/pi_old) per token, 0 on masked tokens so padding (even -inf) never makes inf*0 = nan."""
    return torch.where(mask.bool(), logp - old_logp, 0.0).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # [N, T]


def _clipped(ratio: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, clip_low: float, clip_high: float,
             dual_clip_c: float | None) -> tuple[Tensor, dict[str, Tensor]]:
    """-min(r*A, clip(r, 1-low, 1+high)*A) per token, and its stats. With dual_clip_c, verl's dual clip
    caps a negative-advantage token's loss at c*|A| so a huge ratio cannot blow it up (verl core_algos
    compute_policy_loss_vanilla: pg_losses3 = -A*c; pg_losses = where(A < 0, min(pg_losses3,
    clip_pg_losses1), clip_pg_losses1))."""
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_low, 1 + clip_high))  # [N, T]
    with torch.no_grad():
        r, lr, f = ratio.detach(), log_ratio.detach(), ratio.dtype
        # TRL's definition: the tokens whose gradient the clip removes (low: A < 0, high: A > 0).
        stats = {
            "clip_frac_low": _masked_mean(((r < 1 - clip_low) & (adv < 0)).to(f), mask),
            "clip_frac_high": _masked_mean(((r > 1 + clip_high) & (adv > 0)).to(f), mask),
            "approx_kl": _masked_mean(torch.expm1(lr) - lr, mask),  # k3 of KL(old||new): r - 1 - log r
        }
    if dual_clip_c is not None:
        bound = -adv * dual_clip_c  # [N, 1] or [N, T] = c*|A| where A < 0
        with torch.no_grad():
            stats["clip_frac_dual"] = _masked_mean(((adv < 0) & (loss > bound)).to(ratio.dtype), mask)
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
    return loss, stats


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(logp, old_logp, advantages, mask, *, clip_low, clip_high, dual_clip_c=None):
    """PPO-clip with asymmetric bounds [1-clip_low, 1+clip_high] (DAPO clip-higher); dual clip when
    dual_clip_c is set."""
    lr = _log_ratio(logp, old_logp, mask)  # [N, T]
    return _clipped(lr.exp(), lr, _per_token(advantages), mask, clip_low, clip_high, dual_clip_c)


@POLICY_LOSSES.register("dual_clip")
def dual_clip_loss(logp, old_logp, advantages, mask, *, clip_low, clip_high, dual_clip_c=3.0):
    """PPO-clip with the dual clip always on (c = 3 by default, verl's clip_ratio_c)."""
    c = 3.0 if dual_clip_c is None else dual_clip_c
    return ppo_clip_loss(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high, dual_clip_c=c)


@POLICY_LOSSES.register("gspo")
def gspo_loss(logp, old_logp, advantages, mask, *, clip_low, clip_high, dual_clip_c=None):
    """GSPO (Zheng et al. 2025): one ratio per sequence, s_i = exp(mean_t log(pi/pi_old)), clipped.
    Written per token with the paper's stop-gradient trick (GSPO-token, as verl): log s_i,t =
    sg[log s_i] + logp_t - sg[logp_t] has the value log s_i on every token and the gradient of logp_t,
    so with seq_mean_token_mean it equals TRL's importance_sampling_level="sequence" in value and grad.
    With a rollout correction (TIS) the weight multiplies each token's term, as for every loss here: the
    gradient is then s_i A mean_t(w_t d logp_t), where TRL's sequence level gives (mean_t w_t) s_i A
    mean_t(d logp_t) -- the same value, another gradient (a review's check, 2026-12-07)."""
    lr = _log_ratio(logp, old_logp, mask)  # [N, T]
    m = mask.to(lr.dtype)
    seq_lr = (lr * m).sum(-1) / m.sum(-1).clamp(min=1.0)  # [N]
    lp = torch.where(mask.bool(), logp, 0.0)  # padding (even -inf) out, else -inf - -inf = nan there
    tok_lr = seq_lr.detach()[:, None] + lp - lp.detach()  # [N, T] value = seq_lr, grad = d logp
    loss, stats = _clipped(tok_lr.exp(), tok_lr, _per_token(advantages), mask, clip_low, clip_high, dual_clip_c)
    stats["approx_kl"] = _masked_mean(torch.expm1(lr.detach()) - lr.detach(), mask)  # token-level, as the others
    return loss, stats


@POLICY_LOSSES.register("cispo")
def cispo_loss(logp, old_logp, advantages, mask, *, clip_low, clip_high, dual_clip_c=None):
    """CISPO (MiniMax-M1): -sg[clip(r, 1-clip_low, 1+clip_high)] * A * logp. Clipping the IS weight,
    not the update, keeps the gradient of every token (PPO-clip drops clipped ones). clip_low >= 1
    means no lower bound (the paper's setting; TRL's epsilon_high = 1 + clip_high)."""
    lr = _log_ratio(logp, old_logp, mask)  # [N, T]
    ratio, adv = lr.exp().detach(), _per_token(advantages)
    weight = ratio.clamp(min=max(0.0, 1 - clip_low), max=1 + clip_high)  # [N, T] stop-grad
    loss = -weight * adv * torch.where(mask.bool(), logp, 0.0)
    with torch.no_grad():  # here every clipped weight counts, whatever the sign of A: all still train
        stats = {
            "clip_frac_low": _masked_mean((ratio < 1 - clip_low).to(lr.dtype), mask),
            "clip_frac_high": _masked_mean((ratio > 1 + clip_high).to(lr.dtype), mask),
            "approx_kl": _masked_mean(torch.expm1(lr) - lr, mask),
        }
    return loss, stats


# ------------------------------------------------------------------------------------- aggregations
# Micro-batch aware: the update sums the aggregated losses of a mini-batch's micro-batches, so the
# normalisers are the whole mini-batch's totals and the sum equals the mini-batch's loss.
def _masked(values: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask.bool(), values, 0.0)  # where, not *: a nan/inf on padding stays out


@AGGREGATIONS.register("token_mean")
def token_mean(values, mask, *, num_tokens: float, num_seqs: float, max_len: int) -> Tensor:
    """sum(v*m) / num_tokens: every token weighs the same (DAPO, TRL bnpo/dapo)."""
    return _masked(values, mask).sum() / max(num_tokens, 1.0)


@AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(values, mask, *, num_tokens: float, num_seqs: float, max_len: int) -> Tensor:
    """sum_i mean_t(v_i) / num_seqs: every sequence weighs the same (GRPO, GSPO, TRL grpo)."""
    per_seq = _masked(values, mask).sum(-1) / mask.to(values.dtype).sum(-1).clamp(min=1.0)  # [N]
    return per_seq.sum() / max(num_seqs, 1.0)


@AGGREGATIONS.register("seq_sum_norm")
def seq_sum_norm(values, mask, *, num_tokens: float, num_seqs: float, max_len: int) -> Tensor:
    """sum(v*m) / (num_seqs * max_len): a constant normaliser, so no length bias (Dr.GRPO)."""
    return _masked(values, mask).sum() / max(num_seqs * max_len, 1.0)


# ---------------------------------------------------------------------------------------------- KL
# Schulman's estimators of KL(pi || ref) from tokens sampled by pi; log r = ref_logp - logp.
@KL_ESTIMATORS.register("k1")
def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """-log r = logp - ref_logp: unbiased, high variance, can be negative."""
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """(log r)^2 / 2: biased, low variance, always >= 0."""
    return 0.5 * (logp - ref_logp) ** 2


K3_MAX = 10.0  # per token; verl's bound on its low-variance KL


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """r - 1 - log r: unbiased, low variance, >= 0 (GRPO's and TRL's choice). Bounded at `K3_MAX` per token
    (log r at +-20 first, so exp stays finite), as verl bounds it: r grows as e^(log r), so one sampled token
    far less likely under the policy than under the reference (a gap of 20 nats: e^20 - 1 - 20 = 4.9e8) would
    outweigh the whole mini-batch's policy gradient, and past 88 nats float32's exp overflows and the step is
    skipped as non-finite. A token at the bound gets no KL gradient."""
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    return (torch.expm1(d) - d).clamp(max=K3_MAX)


def kl_reward_penalty(rewards: Tensor, logp: Tensor, ref_logp: Tensor, mask: Tensor, *, coef: float,
                      estimator: str = "k1") -> Tensor:
    """rewards - coef * sum_t KL_t over the model's tokens, for kl_apply == "reward" (InstructGPT): the
    penalty then flows through the advantage, not the loss; one number per row. The REINFORCE++ advantages
    (KL_TO_COME) take the per-token form instead (`kl_to_come_advantage`). Computed without grad."""
    with torch.no_grad():
        kl = _masked(KL_ESTIMATORS[estimator](logp, ref_logp), mask).sum(-1)  # [N]
    return rewards - coef * kl


# The advantages whose KL in the reward is REINFORCE++'s per-token form (`kl_to_come_advantage`), not a row's sum.
KL_TO_COME = frozenset({"reinforce_pp", "reinforce_pp_baseline"})


def kl_to_come_advantage(rewards: Tensor, group_ids: Tensor, kl: Tensor, mask: Tensor, *, coef: float,
                         baseline: bool, eps: float) -> Tensor:
    """[N, T] advantages of REINFORCE++ with its KL in the reward (Hu 2025; OpenRLHF's get_cumulative_returns,
    gamma 1): token t's return is r - coef * sum_{i>=t} KL_i, the KL still to come (a token cannot change the
    KL of the tokens before it, so charging it that was noise), then normalised over the batch's model tokens:
    (x - mean) / std. With `baseline` (REINFORCE++-baseline) the group mean comes off r first and the result is
    divided by the std only, not re-centred, as `reinforce_pp_baseline_advantage`. Tokens off `mask` add no KL,
    count in no statistic and get 0; 0 everywhere when the returns agree (std < eps). Without grad."""
    with torch.no_grad():
        m = mask.bool()  # [N, T]
        r = rewards.double()  # [N]
        if baseline:
            mean, std = _group_stats(rewards, group_ids)
            r = torch.where(std < eps, 0.0, r - mean)
        to_come = _masked(kl.double(), m).flip(-1).cumsum(-1).flip(-1)  # [N, T] sum_{i>=t} KL_i
        returns = r[:, None] - coef * to_come  # [N, T]
        x = returns[m]  # [K] the model tokens'
        scale = x.std() if x.numel() > 1 else x.new_zeros(())
        if scale < eps:
            return torch.zeros(kl.shape, dtype=rewards.dtype, device=kl.device)
        centre = 0.0 if baseline else x.mean()
        return _masked((returns - centre) / scale, m).to(rewards.dtype)


# -------------------------------------------------------------------------------------- DAPO extras
def dynamic_sampling_keep(rewards: Tensor, group_ids: Tensor, eps: float) -> Tensor:
    """BoolTensor[N]: True for samples of groups whose rewards spread (std >= eps). DAPO drops the
    rest (they have zero advantage, so only dilute the batch); the rollout loop refills the batch."""
    _, std = _group_stats(rewards, group_ids)
    return std >= eps


def turn_dynamic_sampling_keep(turn_rewards: list[Tensor], group_ids: Tensor, gamma: float, eps: float) -> Tensor:
    """BoolTensor[N]: `dynamic_sampling_keep` for `credit: turn`: True for samples of groups where the turn
    returns (`discounted_turn_returns`) spread at some turn position, i.e. where some turn gets a non-zero
    advantage (a group whose trajectory rewards agree may still differ turn by turn)."""
    if not sum(int(r.numel()) for r in turn_rewards):
        return torch.zeros(len(turn_rewards), dtype=torch.bool)
    returns, cell, owner, _ = _turn_cells(turn_rewards, group_ids, gamma)
    _, std = _group_stats(returns, cell)  # [sum K]
    spread = group_ids[owner[std >= eps]].unique()  # the groups with a turn position that spreads
    return torch.isin(group_ids, spread)


def max_variance_keep(rewards: Tensor, group_ids: Tensor, m: int) -> Tensor:
    """BoolTensor[N]: m samples of each group, those whose rewards have the largest variance (PODS
    max-variance down-sampling, Xu et al. 2025). Among m of a group's sorted rewards the variance is
    largest for some k best together with the m - k worst (their lemma), so m + 1 candidates are tried.
    Ties keep the earlier sample, and among equal variances the subset first in lexicographic order of batch
    positions, as `max_turn_variance_keep` chooses: on one-turn trajectories both keep the same samples (for
    m >= 2, as train_per_group has it; of one sample none spreads, and this keeps an extreme), and
    the choice is deterministic, the same on every rank. A group of m or fewer keeps all of its samples."""
    keep = torch.zeros(rewards.shape, dtype=torch.bool)
    for g in group_ids.unique():
        members = (group_ids == g).nonzero().flatten()  # [G] in batch order
        if len(members) <= m:
            keep[members] = True
            continue
        values = rewards[members].double()  # [G]
        ranked = values.sort().values  # [G] worst first
        candidates = []
        for k in range(m + 1):  # the k best and the m - k worst
            chosen = torch.cat([ranked[: m - k], ranked[len(ranked) - k:]])  # [m] their values
            candidates.append((float(chosen.var(unbiased=False)), _earliest_with(values, chosen)))
        most = max(var for var, _ in candidates)
        keep[members[min(pos for var, pos in candidates if var >= most - 1e-12)]] = True
    return keep


def _earliest_with(values: Tensor, chosen: Tensor) -> list[int]:
    """The positions in `values` [G] of the values `chosen` [m], each taken by the earliest position holding
    it that is not taken yet (sorted): of the subsets with those values, the first in lexicographic order."""
    taken = torch.zeros(values.shape, dtype=torch.bool)
    for v in chosen.tolist():
        taken[int(((values == v) & ~taken).nonzero()[0])] = True
    return taken.nonzero().flatten().tolist()


# Above this many subsets of one group `max_turn_variance_keep` stops trying them all: C(16, 8) = 12870, so
# groups of up to 16 samples are searched whole (tensor ops over all subsets at once: about 1 ms for a group
# of 8, 30 ms for one of 16, on a 2-core Zen 3).
MAX_SUBSETS = 12870


def max_turn_variance_keep(turn_rewards: list[Tensor], group_ids: Tensor, m: int, gamma: float) -> Tensor:
    """BoolTensor[N]: m samples of each group for `credit: turn`, those whose turn returns spread most:
    the largest sum, over turn positions, of the variance of the chosen samples' returns at that position
    (`discounted_turn_returns`; a position reached by fewer than 2 of them adds 0). That is what turn
    credit standardises, position by position (`turn_advantages`), where `max_variance_keep` looks at one
    reward per trajectory and would keep an arbitrary m of a group whose trajectories agree overall but
    differ turn by turn. Every subset is tried (ties keep the first in lexicographic order of batch
    positions); a group with more than MAX_SUBSETS subsets of m falls back to `max_variance_keep` on each
    trajectory's first-turn return. A group of m or fewer keeps all of its samples."""
    import itertools
    from math import comb

    returns = [discounted_turn_returns(r.double(), gamma) for r in turn_rewards]  # [K_i] each
    keep = torch.zeros(len(returns), dtype=torch.bool)
    for g in group_ids.unique():
        members = (group_ids == g).nonzero().flatten()  # [G] in batch order
        if len(members) <= m:
            keep[members] = True
            continue
        if comb(len(members), m) > MAX_SUBSETS:
            first = torch.tensor([float(returns[i][0]) if len(returns[i]) else 0.0 for i in members.tolist()])
            keep[members[max_variance_keep(first, torch.zeros(len(members), dtype=torch.long), m)]] = True
            continue
        width = max(len(returns[i]) for i in members.tolist())
        table = torch.full((len(members), max(width, 1)), float("nan"), dtype=torch.float64)  # [G, K]
        for row, i in enumerate(members.tolist()):
            table[row, : len(returns[i])] = returns[i]
        subsets = torch.tensor(list(itertools.combinations(range(len(members)), m)))  # [C, m]
        x = table[subsets]  # [C, m, K]
        here = ~x.isnan()
        n = here.sum(1)  # [C, K] chosen samples that reach each position
        mean = x.nan_to_num().sum(1) / n.clamp(min=1)
        var = torch.where(here, x - mean[:, None], 0.0).square().sum(1) / n.clamp(min=1)  # population variance
        score = torch.where(n > 1, var, 0.0).sum(-1)  # [C]
        best = int((score >= score.max() - 1e-12).nonzero()[0])
        keep[members[subsets[best]]] = True
    return keep


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, penalty: float) -> Tensor:
    """DAPO soft overlong punishment, to add to the reward: 0 up to max_len - buffer, then falling
    linearly to -penalty at max_len (and staying there beyond). buffer == 0 turns it off."""
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.get_default_dtype())
    exceed = lengths.to(torch.get_default_dtype()) - (max_len - buffer)
    return -penalty * (exceed / buffer).clamp(0.0, 1.0)


# ------------------------------------------------------------------------------ rollout correction
def truncated_is_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, cap: float) -> Tensor:
    """Truncated importance sampling (TIS; Yao et al. 2025, verl's token-level rollout_is): per token,
    min(pi_old / pi_rollout, cap) = min(exp(old_logp - rollout_logp), cap), without grad. pi_old is the
    learner's probability under the weights that sampled, pi_rollout the rollout engine's: the weight
    undoes the engine/learner mismatch in expectation, and the cap bounds its variance. 1 on masked
    tokens (they carry no loss anyway)."""
    with torch.no_grad():
        log_w = torch.where(mask.bool(), old_logp - rollout_logp, 0.0).clamp(max=_MAX_LOG_RATIO)  # [N, T]
        return log_w.exp().clamp(max=cap)


def rollout_mismatch(learner_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> tuple[float, float, float]:
    """(sum, count, max) of |learner - rollout| log-prob over the model's tokens: the parts of
    rollout/logprob_diff_mean and _max, summable over micro-batches."""
    with torch.no_grad():
        on = mask.bool()
        diff = (learner_logp - rollout_logp).abs()[on]
        return float(diff.sum()), float(on.sum()), float(diff.max()) if diff.numel() else 0.0


# ------------------------------------------------------------------------------------------- update
def policy_objective(alg: Algorithm, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                     ref_logp: Tensor | None = None, entropy: Tensor | None = None, is_weights: Tensor | None = None,
                     num_tokens: float, num_seqs: float, max_len: int) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss to backprop for one micro-batch: aggregated policy loss (each token's loss times its
    rollout-correction weight `is_weights`, when given) + kl_coef * aggregated KL (when kl_apply ==
    "loss") - entropy_coef * token-mean entropy. num_tokens / num_seqs are the mini-batch's totals (see
    AGGREGATIONS). Every returned stat is this micro-batch's SHARE of the mini-batch value, so the
    update sums stats over micro-batches exactly as it sums losses."""
    norm = {"num_tokens": num_tokens, "num_seqs": num_seqs, "max_len": max_len}
    aggregate = AGGREGATIONS[alg.aggregation]
    per_token, raw = POLICY_LOSSES[alg.loss](logp, old_logp, advantages, mask, clip_low=alg.clip_low,
                                             clip_high=alg.clip_high, dual_clip_c=alg.dual_clip_c)
    if is_weights is not None:
        per_token = per_token * is_weights
        raw["tis_weight_mean"] = _masked_mean(is_weights, mask)
        raw["tis_capped_frac"] = _masked_mean((is_weights >= alg.rollout_correction_cap).to(is_weights.dtype), mask)
    pg_loss = aggregate(per_token, mask, **norm)
    loss = pg_loss
    share = mask.to(per_token.dtype).sum() / max(num_tokens, 1.0)  # turns this micro-batch's token means into shares
    stats = {"pg_loss": pg_loss.detach(), **{k: v * share for k, v in raw.items()}}
    if alg.kl_coef > 0 and alg.kl_apply == "loss":
        if ref_logp is None:
            raise ValueError("kl.coef > 0 with kl.apply='loss' needs ref_logp")
        # padding zeroed first: a -inf log-prob there would give KL inf and, through backward, nan grads
        on = mask.bool()
        kl_tok = KL_ESTIMATORS[alg.kl_estimator](torch.where(on, logp, 0.0), torch.where(on, ref_logp, 0.0))
        kl = aggregate(kl_tok, mask, **norm)
        loss = loss + alg.kl_coef * kl
        # the stat a token mean whatever the aggregation, as with `apply: reward` (seq_sum_norm's divides by
        # sequences x budget: a tenth of the per-token KL at a tenth of the budget used, for the same policy)
        stats["kl"] = token_mean(kl_tok, mask, **norm).detach()
    if entropy is not None:
        # A token mean whatever the loss's aggregation (as TRL), so entropy_coef means the same everywhere.
        ent = token_mean(entropy, mask, **norm)
        loss = loss - alg.entropy_coef * ent if alg.entropy_coef else loss
        stats["entropy"] = ent.detach()
    return loss, stats


def minibatches(n: int, mini_batches: int, seed: int) -> list[Tensor]:
    """A seeded random partition of range(n) into `mini_batches` near-equal index tensors; call it
    once per epoch with a different seed (e.g. seed + epoch) to reshuffle."""
    if not 1 <= mini_batches <= n:
        raise ValueError(f"mini_batches must be in [1, {n}] for {n} samples, got {mini_batches}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return list(torch.tensor_split(perm, mini_batches))
