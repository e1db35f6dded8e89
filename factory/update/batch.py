"""From trajectories to tensors: rewards, the loss mask, the mini/micro-batch plan, padded micro-batches.

Pure functions of their inputs (no model, no engine), so each is tested by hand.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from factory.algorithms import (Algorithm, dynamic_sampling_keep, minibatches, overlong_penalty,
                                turn_dynamic_sampling_keep)
from factory.types import Trajectory, trains


def kept(trajs: list[Trajectory], alg: Algorithm, drop_infra_errors: bool) -> list[bool]:
    """Which trajectories train: not those hit by an infrastructure tool failure (when the spec drops
    them: their episode says nothing about the policy), nor, with DAPO overlong filtering, those cut by
    the token budget, nor those the reward stage dropped (a `drop_sample` node had no value). Dropped
    ones are still logged and counted, never forwarded."""
    return [trains(t, alg.overlong_filter, drop_infra_errors) for t in trajs]


def shaped_rewards(trajs: list[Trajectory], alg: Algorithm, max_len: int) -> Tensor:
    """[N] the reward each advantage starts from: the training node's value plus DAPO's soft overlong
    penalty on the response length (model and tool tokens, what the budget counts). A KL-in-reward
    penalty is applied later, once reference log-probs exist."""
    rewards = torch.tensor([float(t.reward) for t in trajs], dtype=torch.float32)  # [N]
    lengths = torch.tensor([len(t.response_ids) for t in trajs])  # [N]
    return rewards + overlong_penalty(lengths, max_len, alg.overlong_buffer, alg.overlong_penalty).float()


def with_signal(trajs: list[Trajectory], turn_gamma: float | None, eps: float,
                trained: Sequence[bool] | None = None) -> list[bool]:
    """Which trajectories dynamic sampling (DAPO) keeps: those of groups whose rewards spread (std >= eps); with
    `credit: turn` (`turn_gamma` set), those of groups whose turn returns spread at some turn position. Only the
    members the update will train count (`trained`, `kept`'s answer; None: all): a group whose spread came from
    a member it drops (a tool's infrastructure failure scored 0 beside three right answers) has no signal left
    for the update, and is refilled. A kept group keeps all its members (the update drops its own)."""
    counted = [t for t, k in zip(trajs, trained if trained is not None else [True] * len(trajs)) if k]
    if not counted:
        return [False] * len(trajs)
    groups = torch.tensor([t.prompt_index for t in counted])
    rewards = torch.tensor([float(t.reward) for t in counted])
    if turn_gamma is not None:
        keep = turn_dynamic_sampling_keep(turn_rewards(counted, rewards), groups, turn_gamma, eps).tolist()
    else:
        keep = dynamic_sampling_keep(rewards, groups, eps).tolist()
    spread = {t.prompt_index for t, k in zip(counted, keep) if k}
    return [t.prompt_index in spread for t in trajs]


def turn_rewards(trajs: list[Trajectory], shaped: Tensor) -> list[Tensor]:
    """[K_i] per trajectory: the trained reward at each of its model turns, for `credit: turn`. A per-turn
    training node gives its own values (`turn_reward`); a trajectory-level one counts at every turn. What
    shaping added to the trajectory's reward (`shaped` [N] - reward: the overlong penalty) counts at every
    turn too, so a turn's reward is shaped as the trajectory's is (its turn mean moves by exactly that). A KL
    in the reward is not shaping of this kind: each turn pays its own (`turn_sums`, in the learner's
    `targets`)."""
    # built as shaped_rewards builds the rewards, so the shift is exactly 0 where nothing was added
    shift = shaped - torch.tensor([float(t.reward) for t in trajs], dtype=shaped.dtype)  # [N]
    out = []
    for t, d in zip(trajs, shift):
        values = t.turn_reward if t.turn_reward else [float(t.reward)] * len(t.turns)
        out.append(torch.tensor(values, dtype=shaped.dtype) + d)  # [K]
    return out


def turn_of_tokens(loss_mask: Sequence[int] | Tensor, turn_tokens: Sequence[int]) -> Tensor:
    """[R] long: the model turn each response token belongs to, -1 on tool/template tokens: the mask's 1s are
    the turns' generated tokens in order (the rollout appends each turn's ids as generated), turn k holding
    `turn_tokens[k]` of them. Model tokens beyond the turns' count (a record made by hand) go to the last
    turn. Tensor ops, no loop over tokens: the update step runs it on every row of the batch."""
    on = torch.as_tensor(loss_mask).bool()  # [R]
    ordinal = on.long().cumsum(0) - 1  # [R] where on: this is the model's ordinal-th token
    ends = torch.tensor(list(turn_tokens), dtype=torch.long).cumsum(0)  # [K] turn k ends before ends[k]
    turn = torch.searchsorted(ends, ordinal, right=True).clamp(max=max(len(turn_tokens) - 1, 0))  # [R]
    return torch.where(on, turn, -1)


def turn_sums(trajs: list[Trajectory], per_token: Tensor) -> list[Tensor]:
    """[K_i] per trajectory: `per_token` ([N, width], one value per response token) summed over each model
    turn's tokens (`turn_of_tokens`); tool/template tokens and padding count nowhere."""
    out = []
    for t, row in zip(trajs, per_token):
        sums = torch.zeros(len(t.turns), dtype=per_token.dtype)
        if t.turns:  # (no model turn: no model token either)
            turn = turn_of_tokens(t.loss_mask, [x.num_tokens for x in t.turns])[: row.numel()]  # [R]
            on = turn >= 0
            sums.index_add_(0, turn[on], row[: len(turn)][on])
        out.append(sums)
    return out


def token_advantages(trajs: list[Trajectory], turn_adv: list[Tensor], width: int) -> Tensor:
    """[N, width] each model token's advantage: its turn's (`turn_adv`, [K_i] per trajectory), 0 on
    tool/template tokens and padding. What the policy losses take in place of one advantage per row."""
    out = torch.zeros(len(trajs), width)  # [N, width]
    for i, (t, adv) in enumerate(zip(trajs, turn_adv)):
        if not adv.numel():  # no model turn: no model token either
            continue
        turn = turn_of_tokens(t.loss_mask, [x.num_tokens for x in t.turns])  # [R]
        out[i, : len(turn)] = torch.where(turn >= 0, adv.to(out.dtype)[turn.clamp(min=0)], 0.0)
    return out


# Below this many shared tokens a second forward call costs more than it saves (factory.update.logprobs).
MIN_SHARED_PREFIX = 16


def run_once(rows: int, shared: int) -> int:
    """How many of `rows` sequences' `shared` common leading tokens are run once (0: none)."""
    return shared if rows > 1 and shared >= MIN_SHARED_PREFIX else 0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` have in common."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]: halve (slice compares run in C)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid)
    return lo


@dataclass(frozen=True)
class TokenBudget:
    """`train.micro_batch_tokens`: the most tokens one micro-batch may compute, and what each row brings.

    A micro-batch computes its rows laid out padded (rows x its longest row, prompt + response: what a
    padded micro-batch computes and a packed one never exceeds), except that with `prompts` (the rows'
    prompt ids, given when the learner runs a shared prefix once: `train.share_prefix`, unless gradient
    checkpointing, dropout or ZeRO-3 over several ranks turn it off) the rows' common leading tokens count
    once, as the update runs them (`run_once`): shared + rows x (longest - shared). The prefix's keys and values, which
    every row then reads, are not counted: per token they are a small part of a layer's activations."""

    limit: int
    totals: Sequence[int]  # each row's prompt + response tokens
    prompts: Sequence[Sequence[int]] = ()  # each row's prompt ids: a micro-batch's common prefix counts once

    @classmethod
    def of(cls, limit: int | None, trajs: Sequence[Trajectory], share_prefix: bool) -> TokenBudget | None:
        """The budget of `trajs`' rows (None: no `limit`, micro-batches cut by their rows alone)."""
        if limit is None:
            return None
        return cls(limit, [len(t.prompt_ids) + len(t.response_ids) for t in trajs],
                   [t.prompt_ids for t in trajs] if share_prefix else ())

    def common(self, a: int, b: int) -> int:
        """The leading tokens rows `a` and `b` (a == b: one row) have in common that could be run once: at most
        either's prompt - 1 (see `shared_prefix`); 0 without `prompts`."""
        if not self.prompts:
            return 0
        pa, pb = self.prompts[a], self.prompts[b]
        return min(common_prefix(pa, pb), len(pa) - 1, len(pb) - 1)

    def cost(self, rows: int, longest: int, shared: int) -> int:
        """The tokens a micro-batch of `rows` rows computes, its longest row `longest` tokens and its rows'
        common prefix `shared` tokens."""
        once = run_once(rows, shared)
        return once + rows * (longest - once)


def cut(rows: list[int], micro_batch: int, budget: TokenBudget | None = None) -> list[list[int]]:
    """`rows`, in their order, cut into consecutive micro-batches of at most `micro_batch` rows and, with a
    `budget`, of at most `budget.limit` tokens as `budget.cost` counts them. A row over the limit goes
    alone."""
    if budget is None:
        return [rows[k:k + micro_batch] for k in range(0, len(rows), micro_batch)]
    out: list[list[int]] = []
    current: list[int] = []
    longest = shared = 0  # the current micro-batch's longest row and its rows' common prefix
    for i in rows:
        if current:
            grown, common = max(longest, budget.totals[i]), min(shared, budget.common(current[0], i))
            if len(current) < micro_batch and budget.cost(len(current) + 1, grown, common) <= budget.limit:
                current.append(i)
                longest, shared = grown, common
                continue
            out.append(current)
        current, longest, shared = [i], budget.totals[i], budget.common(i, i)
    return out + [current] if current else out


def sort_keys(trajs: Sequence[Trajectory], share_prefix: bool) -> list[tuple]:
    """Each row's place in a mini-batch's order (`plan`): (prompt length, total length), and with
    `share_prefix` the prompt's ids between the two, so that rows of one prompt (a group) sit together and a
    micro-batch of them runs their whole prompt once. By lengths alone, prompts of one length mixed by total
    length and a micro-batch shared only their common start (a system prompt): on bench/vs_trl.py's
    quickstart batch (4 prompts of 39-41 tokens x 8, micro-batches of 8) two of its four micro-batches shared
    30 tokens instead of a whole prompt."""
    return [(len(t.prompt_ids), tuple(t.prompt_ids) if share_prefix else (), len(t.prompt_ids) + len(t.response_ids))
            for t in trajs]


def plan(num: int, lengths: Sequence[tuple], mini_batches: int, micro_batch: int, epochs: int,
         seed: int, budget: TokenBudget | None = None) -> list[list[list[int]]]:
    """The update schedule of one training step: for each epoch x mini-batch, its micro-batches as lists
    of positions in range(num).

    Mini-batches are a seeded random partition (factory.algorithms.minibatches, reshuffled per epoch);
    inside one, samples are sorted by `lengths` (`sort_keys`: prompt length, [prompt,] total length) before being
    cut into micro-batches
    (`cut`: `micro_batch` rows, and within the token `budget` when given), so each right-padded
    micro-batch wastes little on padding and the logits window (see `collate`) stays short. The order
    inside a mini-batch does not change its gradient: the loss is normalised by the mini-batch's totals.
    `mini_batches` is capped at `num` (fewer kept samples than mini-batches)."""
    out: list[list[list[int]]] = []
    for epoch in range(epochs):
        for mb in minibatches(num, min(mini_batches, num), seed + epoch):
            order = sorted(mb.tolist(), key=lambda i: lengths[i])
            out.append(cut(order, micro_batch, budget))
    return out


def without_zero_advantage(schedule: list[list[list[int]]], advantages: Tensor, micro_batch: int,
                           budget: TokenBudget | None = None) -> list[list[list[int]]]:
    """`schedule` (see `plan`) without the rows whose advantage is exactly 0 (every token's, for [N, T]
    advantages: turn credit), each mini-batch's remaining
    rows (still in length order) re-cut into micro-batches (`cut`); a mini-batch may end up with none.

    Such a row (its group's rewards all agreed) adds exactly 0 to every policy loss here and to its
    gradient -- each is the advantage times a function of the ratio -- so running it is wasted work: once
    a quickstart group is solved, that is most of the batch. The loss must still be normalised by the
    whole mini-batch's totals (the learner keeps them), and nothing else may be in the loss."""
    out = []
    for minibatch in schedule:
        rows = [i for micro in minibatch for i in micro if bool(advantages[i].ne(0).any())]
        out.append(cut(rows, micro_batch, budget))
    return out


def shard(schedule: list[list[list[int]]], rank: int, world: int, micro_batch: int,
          budget: TokenBudget | None = None) -> list[list[list[int]]]:
    """One rank's part of an update schedule (see `plan`), for data parallelism over `world` ranks.

    Each mini-batch's samples, in `plan`'s length order, are dealt round-robin over the ranks (so the
    ranks get near-equal work) and cut into micro-batches (`cut`). Every rank runs the same number of
    micro-batches per mini-batch: ZeRO-2/3 reduce gradients inside backward and ZeRO-3 gathers
    parameters inside forward, so the ranks' passes must pair up. A rank short of samples gets empty
    micro-batches, which the learner runs on a stand-in sample with weight 0. One rank: `schedule`."""
    return shards(schedule, world, micro_batch, budget)[rank]


def shards(schedule: list[list[list[int]]], world: int, micro_batch: int,
           budget: TokenBudget | None = None) -> list[list[list[list[int]]]]:
    """Every rank's part of `schedule` (see `shard`), worked out once: each rank computes all of them alike,
    from the same plan."""
    if world == 1:
        return [schedule]
    out: list[list[list[list[int]]]] = [[] for _ in range(world)]
    for minibatch in schedule:
        members = [i for micro in minibatch for i in micro]
        cuts = [cut(members[r::world], micro_batch, budget) for r in range(world)]
        count = max(len(c) for c in cuts)
        for r in range(world):
            out[r].append(cuts[r] + [[] for _ in range(count - len(cuts[r]))])
    return out


@dataclass
class MicroBatch:
    """Right-padded prompt+response sequences and where their response tokens sit.

    The logits that predict response tokens lie in the window of positions [start, end) (start = the
    shortest prompt - 1, end = the longest sequence - 1): only those are computed (`logits_to_keep`),
    never [B, L, V] over the prompts. `gather[b, j]` is the window column that predicts row b's j-th
    response token; `targets` are the next-token ids of every window column.
    """

    input_ids: Tensor  # [B, L] long, right-padded
    attention_mask: Tensor  # [B, L] long
    start: int
    end: int
    targets: Tensor  # [B, W] long, W = end - start: the token each window column predicts
    gather: Tensor  # [B, R] long, column of window for each response position (clamped on padding)
    mask: Tensor  # [B, R] float: 1 on model-generated tokens, 0 on tool/template tokens and padding
    shared: int = 0  # leading tokens every row has in common (<= start): a system prompt, few-shot turns

    def to(self, device: torch.device | str) -> MicroBatch:
        move = {k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in self.__dict__.items()}
        return MicroBatch(**move)


def collate(trajs: list[Trajectory], pad_id: int = 0) -> MicroBatch:
    """Pad a micro-batch of trajectories (token ids are concatenated as generated, never re-tokenised)."""
    prompts = [len(t.prompt_ids) for t in trajs]
    responses = [len(t.response_ids) for t in trajs]
    if min(prompts) < 1:
        raise ValueError("a trajectory has an empty prompt: its first response token has no context")
    seq_len = max(p + r for p, r in zip(prompts, responses))
    resp_len = max(max(responses), 1)
    ids = torch.full((len(trajs), seq_len), pad_id, dtype=torch.long)  # [B, L]
    attn = torch.zeros_like(ids)  # [B, L]
    mask = torch.zeros(len(trajs), resp_len)  # [B, R]
    for b, t in enumerate(trajs):
        seq = t.prompt_ids + t.response_ids
        ids[b, : len(seq)] = torch.tensor(seq)
        attn[b, : len(seq)] = 1
        mask[b, : len(t.loss_mask)] = torch.tensor(t.loss_mask, dtype=mask.dtype)
    start = min(prompts) - 1
    end = max(seq_len - 1, start + 1)
    gather = (torch.tensor(prompts)[:, None] - 1 - start + torch.arange(resp_len)).clamp(max=end - start - 1)
    targets = torch.cat([ids, torch.full((len(trajs), 1), pad_id)], 1)[:, start + 1: end + 1]  # [B, W]
    return MicroBatch(ids, attn, start, end, targets, gather, mask, shared_prefix(trajs))


def shared_prefix(trajs: list[Trajectory]) -> int:
    """How many leading prompt tokens all `trajs` have in common, at most the shortest prompt - 1 (the
    position that predicts a first response token must be a row's own)."""
    first, cap = trajs[0].prompt_ids, min(len(t.prompt_ids) for t in trajs) - 1
    return max(0, min([cap] + [common_prefix(first, t.prompt_ids) for t in trajs[1:]]))


# ---------------------------------------------------------------------------------------- packing
# `train.packing: auto` packs a micro-batch whose padded layout would be more than this share padding
# (measured on CPU: docs/performance.md#sequence-packing).
PACK_ABOVE = 0.10


def padding_fraction(lengths: list[int]) -> float:
    """The share of a right-padded micro-batch's tokens that are padding: 1 - sum(L) / (B * max(L))."""
    return 1.0 - sum(lengths) / (len(lengths) * max(max(lengths), 1)) if lengths else 0.0


def padding_stats(micro_batches: list[list[Trajectory]], mode: str) -> dict[str, float]:
    """actor/padding_frac: the share of the padded layout's tokens that are padding, over a step's
    micro-batches; actor/packed_frac: the share of them packed (`packs`)."""
    micro_lengths = [[len(t.prompt_ids) + len(t.response_ids) for t in micro] for micro in micro_batches]
    padded = sum(len(ls) * max(ls) for ls in micro_lengths)
    return {"actor/padding_frac": 1.0 - sum(map(sum, micro_lengths)) / padded if padded else 0.0,
            "actor/packed_frac": (sum(packs(mode, micro) for micro in micro_batches) / len(micro_batches)
                                  if micro_batches else 0.0)}


def packs(mode: str, trajs: list[Trajectory]) -> bool:
    """Whether the learner collates a micro-batch of `trajs` packed: `train.packing` says so for its lengths
    and some row has a response. Rows with no response at all (a group whose first generate timed out, kept
    by `rollout.drop_infra_errors: false`) have nothing to pack; the padded layout gives them an all-0 mask
    and still runs the model, so the loss keeps its graph and every ZeRO-3 rank its forward."""
    return (any(t.response_ids for t in trajs)
            and should_pack(mode, [len(t.prompt_ids) + len(t.response_ids) for t in trajs]))


def should_pack(mode: str, lengths: list[int]) -> bool:
    """`train.packing` for one micro-batch of sequences of `lengths` tokens: on, off, or auto (above PACK_ABOVE
    padding). A single row has nothing to pack."""
    if len(lengths) < 2 or mode == "off":
        return False
    return mode == "on" or padding_fraction(lengths) > PACK_ABOVE


@dataclass
class PackedBatch:
    """A micro-batch's rows laid end to end in one row: no padding. Each row keeps its own positions
    (0.., or prefix.. after a shared prefix) and attends only to itself and the shared prefix
    (factory.attention.packed_attention reads `lengths`).

    `prefix` [1, P] is the rows' common prefix, run once before the packed row (P = `shared`, 0: none);
    `keep` [K] are the packed positions whose logits predict a response token (every row's, in order),
    `targets` [K] those tokens, and `gather[b, j]` the index in K of row b's j-th response token (clamped on
    padding, which `mask` zeroes)."""

    input_ids: Tensor  # [1, T] long: every row's tokens after the shared prefix
    position_ids: Tensor  # [1, T] long
    lengths: list[int]  # tokens of each row in input_ids
    prefix: Tensor  # [1, P] long
    keep: Tensor  # [K] long
    targets: Tensor  # [K] long
    gather: Tensor  # [B, R] long
    mask: Tensor  # [B, R] float: 1 on model-generated tokens, 0 on tool/template tokens and padding
    shared: int = 0

    def to(self, device: torch.device | str) -> PackedBatch:
        move = {k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in self.__dict__.items()}
        return PackedBatch(**move)


def collate_packed(trajs: list[Trajectory], shared: int = 0) -> PackedBatch:
    """Pack a micro-batch (see PackedBatch); `shared` leading tokens, common to every row and shorter than
    every prompt (`shared_prefix`), are left out of the rows and run once."""
    prompts = [len(t.prompt_ids) for t in trajs]
    if min(prompts) < 1:
        raise ValueError("a trajectory has an empty prompt: its first response token has no context")
    if shared > min(prompts) - 1:
        raise ValueError(f"a shared prefix of {shared} tokens would swallow the token before a response")
    if not any(t.response_ids for t in trajs):
        raise ValueError("no response token to pack: the rows' log-probs would gather from nothing")
    ids, pos, lengths, keep, targets, firsts = [], [], [], [], [], []
    offset = found = 0
    for t, p in zip(trajs, prompts):
        seq = t.prompt_ids + t.response_ids
        ids += seq[shared:]
        pos += range(shared, len(seq))
        lengths.append(len(seq) - shared)
        r = len(t.response_ids)
        keep += range(offset + p - 1 - shared, offset + p - 1 - shared + r)  # the position before each token
        targets += t.response_ids
        firsts.append(found)
        offset, found = offset + len(seq) - shared, found + r
    resp_len = max(max(len(t.response_ids) for t in trajs), 1)
    mask = torch.zeros(len(trajs), resp_len)  # [B, R]
    gather = torch.zeros(len(trajs), resp_len, dtype=torch.long)  # [B, R]
    for b, t in enumerate(trajs):
        r = len(t.response_ids)
        mask[b, : len(t.loss_mask)] = torch.tensor(t.loss_mask, dtype=mask.dtype)
        gather[b] = firsts[b] + torch.arange(resp_len).clamp(max=max(r - 1, 0))
    gather = gather.clamp(max=max(len(keep) - 1, 0))
    return PackedBatch(torch.tensor([ids]), torch.tensor([pos]), lengths, torch.tensor([trajs[0].prompt_ids[:shared]]),
                       torch.tensor(keep, dtype=torch.long), torch.tensor(targets, dtype=torch.long), gather, mask, shared)
