"""The driver's step metrics over dynamic-sampling rounds (`_merge`): they describe the step's whole batch."""
from __future__ import annotations

import math

import pytest

from factory.runtime.driver import _merge


def test_rounds_merge_into_the_whole_batchs_metrics():
    # round 1: 8 trajectories, 2 dropped by the reward stage; round 2: 4 trajectories, none dropped
    a = {"reward/mean": 0.5, "rewards/correct/mean": 1.0, "num_turns/mean": 2.0, "timing/generate_s": 3.0,
         "perf/generate_tokens_per_s": 100.0, "tools/calc/calls": 6.0, "tools/calc/latency_s_p50": 0.1,
         "reward/dropped": 2.0, "rollout/stop_budget": 1.0, "tool_servers/calc/restarts": 1.0}
    b = {"reward/mean": 0.0, "rewards/correct/mean": math.nan, "num_turns/mean": 1.0, "timing/generate_s": 1.0,
         "perf/generate_tokens_per_s": 200.0, "tools/calc/calls": 2.0, "tools/calc/latency_s_p50": 0.3,
         "reward/dropped": 0.0, "rollout/stop_budget": 2.0, "tool_servers/calc/restarts": 0.0, "rollout/new": 7.0}
    m = _merge(a, b, 8, 4)
    assert m["reward/mean"] == pytest.approx((0.5 * 6 + 0.0 * 4) / 10)  # over the kept trajectories of both
    assert m["rewards/correct/mean"] == 1.0  # a round with no value weighs nothing
    assert m["num_turns/mean"] == pytest.approx((2.0 * 8 + 1.0 * 4) / 12)
    assert m["perf/generate_tokens_per_s"] == pytest.approx((300 + 200) / 4)  # all tokens over all generate time
    assert m["tools/calc/latency_s_p50"] == pytest.approx((0.1 * 6 + 0.3 * 2) / 8)
    assert (m["timing/generate_s"], m["tools/calc/calls"], m["reward/dropped"], m["rollout/stop_budget"],
            m["tool_servers/calc/restarts"], m["rollout/new"]) == (4.0, 8.0, 2.0, 3.0, 1.0, 7.0)
    # a third round folds in the same way: the merged metrics carry the summed weights
    c = {"reward/mean": 1.0, "reward/dropped": 0.0}
    assert _merge(m, c, 12, 2)["reward/mean"] == pytest.approx((0.5 * 6 + 0.0 * 4 + 1.0 * 2) / 12)


def test_a_gated_nodes_mean_is_weighted_by_the_trajectories_it_has_a_value_for():
    """A judge behind a gate: asked on 1 of 8 trajectories in one part (value 1.0), on 8 of 8 in the other
    (0.0): the step's mean is over its 9 values, not 16 trajectories (groups streamed, dynamic sampling)."""
    a = {"rewards/judge/mean": 1.0, "rewards/judge/values": 1.0, "rewards/judge/skipped": 7.0, "reward/dropped": 0.0}
    b = {"rewards/judge/mean": 0.0, "rewards/judge/values": 8.0, "rewards/judge/skipped": 0.0, "reward/dropped": 0.0}
    m = _merge(a, b, 8, 8)
    assert m["rewards/judge/mean"] == pytest.approx(1 / 9)
    assert (m["rewards/judge/values"], m["rewards/judge/skipped"]) == (9.0, 7.0)


def test_a_single_round_is_unchanged():
    b = {"reward/mean": 0.25, "timing/generate_s": 1.5, "tools/calls": 3.0}
    assert _merge({}, b, 0, 5) == b


def test_a_per_turn_nodes_turn_mean_is_weighted_by_its_turns():
    # two groups scored apart: 6 turns with mean 0.5, then 2 turns with mean 1.0 (4 trajectories each)
    a = {"rewards/step/turns/mean": 0.5, "rewards/step/turns": 6.0, "reward/dropped": 0.0}
    b = {"rewards/step/turns/mean": 1.0, "rewards/step/turns": 2.0, "reward/dropped": 0.0}
    m = _merge(a, b, 4, 4)
    assert m["rewards/step/turns/mean"] == pytest.approx((0.5 * 6 + 1.0 * 2) / 8) and m["rewards/step/turns"] == 8.0


def test_a_deadline_names_the_step_its_call_was_for_step_0_too():
    """A reward node that hung in the first evaluation said "did not answer score within 40 s" with no step:
    step 0 was left out as if it were no step."""
    from factory.runtime.driver import _doing

    assert [_doing(c) for c in ({"step": 0}, {"step": 3, "attempt": 0}, {"step": 3, "attempt": 1}, {})] == [
        "step 0", "step 3", "step 3, attempt 1", ""]


def test_an_update_run_behind_the_rollout_keeps_a_deadline_of_its_own_length(monkeypatch):
    """max_staleness 1: a 150 s update ran behind a 200 s rollout, so its wait took ~0 s, and that ~0 s set
    the next deadline to the 120 s floor: a step that waits for its update in full (an evaluation, a checkpoint,
    the last step) then stopped a healthy run with "did not answer ... within 120 s". Counted from when the
    update was asked for (`since`), it keeps its length. (A clock and a Ray stand-in; the reviewer's script.)"""
    from types import SimpleNamespace

    import factory.runtime.deadlines as dl

    clock = [0.0]

    class Ref:
        def __init__(self, ready_at: float):
            self.ready_at = ready_at

    def wait(refs, num_returns=1, timeout=None, fetch_local=True):
        if sum(r.ready_at <= clock[0] for r in refs) < num_returns:
            clock[0] += timeout
        ready = [r for r in refs if r.ready_at <= clock[0]]
        return ready, [r for r in refs if r not in ready]

    monkeypatch.setattr(dl, "ray", SimpleNamespace(wait=wait, get=lambda refs: [{} for _ in refs]))
    monkeypatch.setattr(dl, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    deadlines = dl.Deadlines(1800.0)
    for step in range(1, 4):  # each update submitted, then the next step's 200 s rollout, then its wait
        submitted = clock[0]
        ref = Ref(submitted + 150.0)
        clock[0] += 200.0
        deadlines.get([ref], "update.step", f"step {step}", since=submitted)
    assert deadlines.budget("update.step") >= 5 * 150.0
    submitted = clock[0]  # a draining step: its update waited for in full, right away
    deadlines.get([Ref(submitted + 150.0)], "update.step", "step 4", since=submitted)


def test_a_first_round_without_a_value_weighs_nothing_either():
    """The other order of test_rounds_merge_into_the_whole_batchs_metrics' NaN: the first round (or streamed
    part) had no value for a node, the second has: the step's mean is the second's, not NaN."""
    m = _merge({"rewards/correct/mean": math.nan, "reward/dropped": 0.0},
               {"rewards/correct/mean": 0.75, "reward/dropped": 0.0}, 4, 4)
    assert m["rewards/correct/mean"] == 0.75


def test_the_logprob_gap_is_named_stale_only_when_the_sampling_weights_were_behind():
    """rollout/logprob_diff_* measures the engine's mismatch; sampled with weights `lag` updates behind the
    learner's, the gap holds the policy's drift too and is logged as rollout/stale_logprob_diff_*."""
    from factory.runtime.driver import stale_named

    stats = {"rollout/logprob_diff_mean": 0.01, "actor/loss": 0.5}
    assert stale_named(stats, 0.0) == stats
    assert stale_named(stats, 1.0) == {"rollout/stale_logprob_diff_mean": 0.01, "actor/loss": 0.5}
