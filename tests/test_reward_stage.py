"""The reward stage on hand-computed examples: combinators, the gate, normalisation, missing values under
each `on_missing` policy, the per-step cache, concurrency, and what reward functions receive."""
import asyncio
import math
import os
import sys
from pathlib import Path

import pytest

from factory.compiler.compile import stage_settings
from factory.reward import MissingReward, RewardStage
from factory.reward.graph import NonFiniteReward, combine
from factory.schema import Spec, SumNode
from factory.types import Placement, ToolCall, ToolResult, Trajectory, Turn
from tests.fixtures import reward_fns

FNS = "tests.fixtures.reward_fns"


def make_spec(rewards, reward=None, tools=None):
    return Spec.model_validate({
        "name": "t", "model": {"path": "x"}, "data": {"train": {"generator": "factory.data:arithmetic"}},
        "rewards": rewards, **({"reward": reward} if reward else {}), **({"tools": tools} if tools else {})})


def traj(completion, prompt_index=0, sample_index=0, turns=(), answer="1"):
    return Trajectory(prompt_index=prompt_index, sample_index=sample_index, prompt_ids=[], response_ids=[],
                      loss_mask=[], turns=list(turns), stop_reason="no_call", row={"answer": answer},
                      messages=[{"role": "user", "content": "q"}], completion=completion)


def reward_stage(spec):
    """The reward stage built from its slice of the compiled spec, as the driver builds it."""
    return RewardStage(stage_settings(spec)["reward"])


def score(spec, trajs):
    stage = reward_stage(spec)

    async def go():
        await stage.setup()
        try:
            return await stage.score(trajs)
        finally:
            await stage.close()

    return asyncio.run(go())


def test_sum_min_max_product_and_clip():
    spec = make_spec({
        "len": {"fn": f"{FNS}:length"},
        "half": {"fn": f"{FNS}:async_half"},
        "total": {"sum": {"len": 1.0, "half": 2.0}},
        "lo": {"min": ["len", "half"]},
        "hi": {"max": ["len", "half"]},
        "prod": {"product": ["len", "half"]},
        "capped": {"clip": "len", "lower": 1.0, "upper": 2.0},
        "floor": {"clip": "half", "lower": 0.75},
    })
    trajs, m = score(spec, [traj("abc"), traj("")])
    # "abc": len 3, half 0.5 -> total 3 + 2*0.5 = 4; min 0.5; max 3; product 1.5; clip(3, 1, 2) = 2;
    # clip(0.5, 0.75) = 0.75
    assert trajs[0].rewards == {"len": 3.0, "half": 0.5, "total": 4.0, "lo": 0.5, "hi": 3.0, "prod": 1.5,
                                "capped": 2.0, "floor": 0.75}
    # "": len 0 -> total 0 + 1 = 1; min 0; max 0.5; product 0; clip(0, 1, 2) = 1
    assert (trajs[1].rewards["total"], trajs[1].rewards["lo"], trajs[1].rewards["hi"], trajs[1].rewards["prod"],
            trajs[1].rewards["capped"]) == (1.0, 0.0, 0.5, 0.0, 1.0)
    assert [t.reward for t in trajs] == [4.0, 1.0]  # `total` is the default training node
    assert m["reward/mean"] == 2.5 and m["rewards/len/mean"] == 1.5 and m["rewards/capped/mean"] == 1.5
    assert m["rewards/len/missing"] == 0.0 and "rewards/total/missing" not in m  # combinators cannot miss


def test_a_clip_bound_of_zero_is_a_bound():
    """`lower: 0` / `upper: 0` are bounds like any other (a falsy 0 read as "no bound" would let a negative
    reward through a `clip: x, lower: 0`)."""
    from factory.reward.graph import combine
    from factory.schema import ClipNode

    assert combine(ClipNode(clip="x", lower=0.0), [-3.0]) == 0.0
    assert combine(ClipNode(clip="x", upper=0.0), [2.0]) == 0.0
    assert combine(ClipNode(clip="x", lower=-1.0, upper=0.0), [0.5]) == 0.0


def test_gate_evaluates_then_only_where_the_condition_passes():
    reward_fns.CALLS.clear()
    spec = make_spec({
        "ok": {"fn": f"{FNS}:starts_with_ok"},
        "costly": {"fn": f"{FNS}:counted", "args": {"name": "gated"}},
        "total": {"gate": "ok", "then": "costly", "otherwise": -1.0},
    })
    trajs, m = score(spec, [traj("ok yes"), traj("no"), traj("ok"), traj("nope")])
    assert reward_fns.CALLS["gated"] == 2  # called only for the two that start with "ok"
    assert [t.reward for t in trajs] == [6.0, -1.0, 2.0, -1.0]
    assert [t.rewards["costly"] for t in trajs] == [6.0, None, 2.0, None]
    assert trajs[1].reward_details["costly"] == {"status": "skipped"}
    assert m["rewards/costly/skipped"] == 2.0 and m["rewards/costly/mean"] == 4.0  # mean of what was evaluated
    assert m["reward/mean"] == 1.5  # (6 - 1 + 2 - 1) / 4


def test_gate_threshold():
    spec = make_spec({"len": {"fn": f"{FNS}:length"}, "half": {"fn": f"{FNS}:async_half"},
                      "total": {"gate": "len", "then": "half", "threshold": 3}})
    trajs, _ = score(spec, [traj("ab"), traj("abc")])
    assert [t.reward for t in trajs] == [0.0, 0.5]  # 2 < 3: `otherwise` (0.0); 3 >= 3: half


def test_each_value_is_computed_once_per_trajectory():
    reward_fns.CALLS.clear()
    spec = make_spec({
        "shared": {"fn": f"{FNS}:counted", "args": {"name": "shared"}},
        "a": {"sum": {"shared": 2.0}}, "b": {"max": ["shared", "a"]},
        "total": {"sum": {"a": 1.0, "b": 1.0, "shared": 1.0}},
    })
    trajs, _ = score(spec, [traj("ab"), traj("abcd")])
    assert reward_fns.CALLS["shared"] == 2  # read by a, b and total; computed once per trajectory
    assert [t.reward for t in trajs] == [2 * 2 + 4 + 2, 8 + 8 + 4]


def test_a_trajectory_whose_prompt_fills_the_context_is_not_scored_and_is_dropped():
    """It was scored (a judge would be sent its whole prompt) and trained on, its empty completion in the means."""
    import dataclasses

    reward_fns.CALLS.clear()
    spec = make_spec({"n": {"fn": f"{FNS}:counted", "args": {"name": "ctx"}}, "total": {"sum": {"n": 1.0}}})
    long = dataclasses.replace(traj("", prompt_index=1), stop_reason="prompt_too_long")
    trajs, m = score(spec, [traj("ab"), long])
    assert reward_fns.CALLS["ctx"] == 1 and trajs[1].rewards["n"] is None and trajs[1].reward == 0.0
    assert trajs[1].dropped == "its prompt fills the model's context: nothing was generated"
    assert trajs[0].dropped is None and m["reward/dropped"] == 1.0 and m["reward/mean"] == trajs[0].reward


def test_a_member_whose_prompt_fills_the_context_is_not_in_its_group_s_normalize():
    """A normalize over the group scored the dropped member anyway and counted its value in the mean and spread:
    the two members below got 1.22 and 0.0 instead of 1 and -1."""
    import dataclasses

    reward_fns.CALLS.clear()
    spec = make_spec({"n": {"fn": f"{FNS}:counted", "args": {"name": "norm"}}, "len": {"fn": f"{FNS}:length"},
                      "both": {"sum": {"len": 1.0, "n": 0.0}}, "total": {"normalize": "both"}})
    long = dataclasses.replace(traj("", sample_index=2), stop_reason="prompt_too_long")
    trajs, _ = score(spec, [traj("aaaa", sample_index=0), traj("aa", sample_index=1), long])
    assert [t.reward for t in trajs] == [1.0, -1.0, 0.0] and reward_fns.CALLS["norm"] == 2


def test_a_group_s_normalize_uses_one_population_whatever_finishes_first():
    """A normalize over the group read its population (the members not dropped) when each member first asked
    for it, while a slower drop_sample node was still to drop "d": "a" (asked at once) was standardised over
    1, 2, 3, 10 and "b", "c" (asked after the drop) over 1, 2, 3. Now every member is standardised over the
    members scored, "d" included: its input has a value, and only the input's own missing values are left out."""
    spec = make_spec({
        "x": {"fn": f"{FNS}:none_late_for_d", "on_missing": "drop_sample"},
        "ok": {"fn": f"{FNS}:passes_late_for_b_c"},
        "len": {"fn": f"{FNS}:length"},
        "z": {"normalize": "len"},
        "gated": {"gate": "ok", "then": "z"},
        "total": {"sum": {"x": 1.0, "gated": 1.0}},
    })
    trajs, _ = score(spec, [traj(c * n, sample_index=k) for k, (c, n) in enumerate(zip("abcd", [1, 2, 3, 10]))])
    mean, std = 4.0, math.sqrt((9 + 4 + 1 + 36) / 4)  # lengths 1, 2, 3, 10
    assert [t.rewards["z"] for t in trajs[:3]] == pytest.approx([(n - mean) / std for n in (1, 2, 3)])
    assert [t.dropped is not None for t in trajs] == [False, False, False, True]


def test_a_reward_function_that_never_returns_holds_up_its_own_node_only():
    """A hung function kept its threads of the one shared pool past timeout_s; once they were all taken, every
    node's calls queued behind them and timed out too (their clock ran while they queued): from the fourth step
    of a run, no reward had a value and nothing was trained. Now each node has threads of its own, its clock
    starts with its thread, and a node whose threads are all held by calls that never returned fails at once."""
    spec = make_spec({"hung": {"fn": f"{FNS}:hangs", "timeout_s": 0.3}, "len": {"fn": f"{FNS}:length", "timeout_s": 0.3},
                      "total": {"sum": {"len": 1.0, "hung": 0.0}}})
    stage = RewardStage(stage_settings(spec)["reward"], threads_per_node=4)

    async def steps():
        await stage.setup()
        try:
            out = []
            for _ in range(3):  # 2 calls of `hung` a step: the third step finds its 4 threads held
                started = asyncio.get_running_loop().time()
                trajs, _ = await stage.score([traj("ab", sample_index=0), traj("abcd", sample_index=1)])
                out.append((trajs, asyncio.get_running_loop().time() - started))
            return out
        finally:
            await stage.close()

    out = asyncio.run(steps())
    for trajs, _ in out:
        assert [t.rewards["len"] for t in trajs] == [2.0, 4.0]  # every step: the other node is not held up
    errors = [[t.reward_details["hung"]["error"] for t in trajs] for trajs, _ in out]
    assert errors[0] == errors[1] == ["TimeoutError: took longer than timeout_s (0.3 s)"] * 2
    assert errors[2] == ["RuntimeError: its last 4 calls passed timeout_s and have not returned (a function that "
                         "never returns: Python cannot stop it), so it is not called again until one does"] * 2
    assert out[2][1] < 0.3  # at once: its place is held, it is not called


def test_a_node_s_threads_are_reused_so_what_a_function_keeps_per_thread_lasts():
    """A thread per call (since the lanes) made a function's `threading.local` state (a client, a parser that is
    not thread-safe) again at every call; the shared pool before reused its threads."""
    stage = reward_stage(make_spec({"n": {"fn": f"{FNS}:calls_in_this_thread"}, "total": {"sum": {"n": 1.0}}}))

    async def go():
        await stage.setup()
        try:
            return [(await stage.score([traj("a")]))[0][0].rewards["n"] for _ in range(3)]
        finally:
            await stage.close()

    assert asyncio.run(go()) == [1.0, 2.0, 3.0]


def test_a_place_left_wakes_one_waiter_and_a_stuck_one_wakes_them_all():
    """Every place left woke every waiter, which all looked again and all but one waited again: quadratic in the
    calls queued (a per-turn node over a batch queues thousands behind a lane's places; 4000 took 8.7 s)."""
    from factory.util import AllStuck, Places

    n, waits = 300, [0]
    loop = asyncio.new_event_loop()
    create_future = loop.create_future

    def counted():  # every wait for a place is a future of the loop
        waits[0] += 1
        return create_future()

    loop.create_future = counted
    places = Places(2)

    async def work():
        await places.take()
        await asyncio.sleep(0)
        places.leave()

    async def all_of_them():
        await asyncio.gather(*(work() for _ in range(n)))

    try:
        loop.run_until_complete(all_of_them())
    finally:
        loop.close()
    assert places.running == 0 and waits[0] <= 2 * n, waits[0]

    async def in_turn():  # a woken waiter that a newcomer beat to the place keeps its turn (it went to the back)
        places, order = Places(1), []
        await places.take()

        async def taker(name):
            await places.take()
            order.append(name)
            await asyncio.sleep(0)
            places.leave()

        first = asyncio.ensure_future(taker("first"))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(taker("second"))
        await asyncio.sleep(0)
        newcomer = asyncio.ensure_future(taker("newcomer"))  # ready to run: it looks before "first" wakes
        places.leave()
        await asyncio.gather(first, second, newcomer)
        assert order == ["newcomer", "first", "second"], order
        # and after an abandon woke every waiter, they still wait in the order they came
        places, order = Places(2), []
        await places.take(), await places.take()
        takers = []
        for name in "abc":
            takers.append(asyncio.ensure_future(taker(name)))
            await asyncio.sleep(0)
        places.abandon()
        await asyncio.sleep(0)
        places.leave(stuck=True)
        places.leave()
        await asyncio.gather(*takers)
        assert order == ["a", "b", "c"], order

    asyncio.run(in_turn())

    async def passed_on():  # a woken taker that was cancelled passes its wake-up on: the place is not left idle
        await places.take()
        await places.take()
        first, second = (asyncio.ensure_future(places.take()) for _ in range(2))
        await asyncio.sleep(0)
        places.leave()  # wakes the first ...
        first.cancel()  # ... which is cancelled before it looks
        await asyncio.wait_for(second, 1.0)
        assert places.running == 2

        places.abandon(), places.abandon()
        with pytest.raises(AllStuck):
            await places.take()
        places.leave(stuck=True), places.leave(stuck=True)
        await places.take()
        await places.take()
        waiting = [asyncio.ensure_future(places.take()) for _ in range(3)]
        await asyncio.sleep(0)
        places.abandon(), places.abandon()  # every waiter hears that every place is stuck
        return await asyncio.wait_for(asyncio.gather(*waiting, return_exceptions=True), 1.0)

    assert [type(e) for e in asyncio.run(passed_on())] == [AllStuck] * 3


def test_a_closed_stage_s_lanes_end_their_idle_threads():
    """Close did nothing and each lane thread waited for a next call for the life of the process: every stage
    made (tests, bench/, a notebook, one after another) left its threads behind, 48 after three."""
    import threading

    before = {t.ident for t in threading.enumerate()}
    for _ in range(2):
        score(make_spec({"n": {"fn": f"{FNS}:length"}, "total": {"sum": {"n": 1.0}}}),
              [traj("a" * i, i) for i in range(8)])
    assert not [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("reward-")]


def test_a_hung_call_whose_caller_was_cancelled_keeps_its_place_as_stuck():
    """A scoring call that a `fail` node ended cancels its pending values: a hung function's thread runs on, and
    its place was neither free nor counted as stuck, so a later call waited for a place with no time limit."""
    from factory.reward.lanes import Lane

    async def go():
        lane = Lane("hung", 2)
        calls = [asyncio.ensure_future(lane.run(lambda: reward_fns.hangs("", ""), 5.0)) for _ in range(2)]
        await asyncio.sleep(0.1)
        for c in calls:
            c.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        with pytest.raises(RuntimeError, match="its last 2 calls passed timeout_s and have not returned"):
            await asyncio.wait_for(lane.run(lambda: 1.0, 0.3), 2.0)  # at once: not a wait for a place
        return lane.places.running, lane.places.stuck

    assert asyncio.run(go()) == (2, 2)


def test_a_value_that_lands_as_its_wait_times_out_is_the_call_s_value(monkeypatch):
    """The function's value landing between the wait's timeout and its handling was lost: the call raised
    "TimeoutError: " (the wait's, with no message) though its thread had returned and freed its place."""
    from factory.reward.lanes import Lane

    async def times_out_as_it_lands(waited, timeout):
        await waited  # (the value is in)
        raise TimeoutError

    async def go():
        lane = Lane("x", 1)
        with monkeypatch.context() as m:
            m.setattr(asyncio, "wait_for", times_out_as_it_lands)
            value = await lane.run(lambda: 1.0, 5.0)
        return value, lane.places.running, lane.places.stuck

    assert asyncio.run(go()) == (1.0, 0, 0)


def test_a_call_past_its_timeout_that_raises_later_logs_nothing(caplog):
    """Its error was set on a future nobody awaited any more: asyncio logged "Future exception was never
    retrieved", with the traceback, at ERROR for each such call."""
    import gc
    import logging
    import time

    from factory.reward.lanes import Lane

    def late_failure():
        time.sleep(0.3)
        raise ValueError("after its timeout")

    async def go():
        lane = Lane("x", 2)
        with pytest.raises(TimeoutError):
            await lane.run(late_failure, 0.05)
        for _ in range(100):  # its thread ends, its outcome lands, its place is free
            if lane.places.running == 0:
                break
            await asyncio.sleep(0.05)
        return lane.places.running, lane.places.stuck

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        assert asyncio.run(go()) == (0, 0)
        gc.collect()
    assert "never retrieved" not in caplog.text


@pytest.mark.parametrize("fn, said", [
    ("interrupts", "RuntimeError: the function raised KeyboardInterrupt('from the reward function')"),
    pytest.param("cancels", "RuntimeError: the function raised CancelledError()",
                 marks=pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.10 cannot tell a task's own "
                                          "cancellation from a CancelledError its function raised")),
    ("async_exits", "RuntimeError: the function raised SystemExit(3)"),
])
def test_what_a_reward_function_raises_of_its_own_is_its_node_s_failure(fn, said):
    """KeyboardInterrupt in a reward function's thread ended the reward stage's event loop (the run then waited
    for it for stage_timeout_s, 30 minutes); a CancelledError of its own ended the run as an internal error."""
    trajs, m = score(make_spec({"x": {"fn": f"{FNS}:{fn}"}, "len": {"fn": f"{FNS}:length"},
                                "total": {"sum": {"x": 1.0, "len": 1.0}}}), [traj("fine")])
    assert trajs[0].reward_details["x"] == {"status": "error", "error": said}
    assert trajs[0].rewards["len"] == 4.0 and m["rewards/x/errors"] == 1.0


def test_a_process_scoring_with_a_hung_function_still_exits(tmp_path):
    """`factory rescore` printed its table and never exited: the interpreter waited for the pool's hung thread."""
    import subprocess

    code = ("import asyncio, tests.test_reward_stage as t\n"
            "spec = t.make_spec({'h': {'fn': 'tests.fixtures.reward_fns:hangs', 'timeout_s': 0.2}})\n"
            "trajs, _ = t.score(spec, [t.traj('x')])\n"
            "print(trajs[0].reward_details['h']['error'])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0 and "took longer than timeout_s" in done.stdout, done.stderr[-2000:]


def test_processes_run_a_node_s_calls_at_once_and_end_what_hangs_or_dies(tmp_path):
    """`processes: 2`: calls of a function that holds the GIL ran one at a time in threads. Here 2 calls wait for
    each other's process (the value is the number of processes seen: 2.0 only if both ran at once); a call past
    timeout_s ends its process, a process that dies fails its call only, and the node scores on after both."""
    spec = make_spec({"meet": {"fn": f"{FNS}:meets", "args": {"folder": str(tmp_path)}, "processes": 2},
                      "hang": {"fn": f"{FNS}:hangs", "processes": 1, "timeout_s": 1.0},
                      "die": {"fn": f"{FNS}:dies", "processes": 1},
                      "own": {"fn": f"{FNS}:own_timeout", "processes": 1},
                      "exit": {"fn": f"{FNS}:exits", "processes": 1},
                      "total": {"sum": {"meet": 1.0, "hang": 0.0, "die": 0.0, "own": 0.0, "exit": 0.0}}})
    stage = reward_stage(spec)

    async def go():
        await stage.setup()
        try:
            first, _ = await stage.score([traj("a"), traj("b", 0, 1)])
            pids = sorted(int(p.name) for p in tmp_path.iterdir())
            return first, pids, stage._lanes["hang"]._pool.active
        finally:
            await stage.close()

    trajs, pids, active = asyncio.run(go())
    assert [t.rewards["meet"] for t in trajs] == [2.0, 2.0] and len(pids) == 2
    assert os.getpid() not in pids
    details = trajs[0].reward_details
    assert details["hang"]["error"] == "TimeoutError: took longer than timeout_s (1 s); its process was ended"
    assert details["die"]["error"].startswith("RuntimeError: its worker process ended during the call (exit code 7")
    assert details["own"]["error"] == "TimeoutError: the checker's own deadline"  # the function's, not the lane's
    assert details["exit"]["error"] == "RuntimeError: the function raised SystemExit(2)"
    assert active  # the pools went on past the hung and the dead call


def test_what_a_worker_process_cannot_hand_back_is_its_call_s_failure_and_a_dead_pool_is_replaced():
    """Under `processes`, an exception that does not unpickle broke pebble's whole pool (every later call of the
    node failed), a result that does not pickle killed the worker (said as a crash), a CancelledError of the
    function's ended the whole scoring call; and once its idle workers were killed, the node failed for good."""
    import psutil

    spec = make_spec({"m": {"fn": f"{FNS}:misbehaves", "processes": 1}, "total": {"sum": {"m": 1.0}}})
    stage = reward_stage(spec)

    async def go():
        await stage.setup()
        try:
            first, _ = await stage.score([traj(c, 0, i) for i, c in enumerate(["two", "lambda", "cancelled", "ab"])])
            for worker in psutil.Process().children():  # its idle worker, as the OOM killer would
                try:  # (another test's child of this process may have exited and wait to be reaped)
                    command = " ".join(worker.cmdline())
                except psutil.Error:
                    continue
                if "spawn_main" in command:
                    worker.kill()
            await asyncio.sleep(0.5)
            second, _ = await stage.score([traj("abc")])
            return first, second
        finally:
            await stage.close()

    first, second = asyncio.run(go())
    errors = [t.reward_details.get("m", {}).get("error") for t in first]
    assert errors[0] == ("RuntimeError: the TwoArgs it raised (bad answer) cannot be sent back from its worker "
                         "process: TypeError: TwoArgs.__init__() missing 1 required positional argument: 'b'")
    assert errors[1].startswith("RuntimeError: its result cannot be sent back from its worker process: ")
    assert errors[2] == "CancelledError: " and first[3].rewards["m"] == 2.0  # as in a thread
    assert second[0].rewards["m"] == 3.0  # a new pool


def test_normalize_over_group_and_batch():
    spec = make_spec({
        "len": {"fn": f"{FNS}:length"},
        "by_group": {"normalize": "len"},
        "by_batch": {"normalize": "len", "over": "batch"},
        "total": {"sum": {"by_group": 1.0}},
    })
    trajs, _ = score(spec, [traj("a", 0, 0), traj("abc", 0, 1), traj("xx", 1, 0), traj("yy", 1, 1)])
    # group 0: 1, 3 -> mean 2, std 1 -> -1, 1; group 1: 2, 2 agree -> 0, 0
    assert [t.rewards["by_group"] for t in trajs] == [-1.0, 1.0, 0.0, 0.0]
    # batch: 1, 3, 2, 2 -> mean 2, std sqrt(0.5)
    s = math.sqrt(0.5)
    assert [t.rewards["by_batch"] for t in trajs] == pytest.approx([-1 / s, 1 / s, 0.0, 0.0])
    assert reward_stage(spec).settings.whole_batch  # decided by the compiler: one `score` call per step
    per_group = make_spec({"len": {"fn": f"{FNS}:length"}, "total": {"normalize": "len"}})
    assert not reward_stage(per_group).settings.whole_batch


def test_standardize_leaves_missing_values_in_place():
    # 1, None, 3: mean 2, population std 1 -> -1, None, 1 (each value stays at its trajectory's position)
    from factory.reward.graph import standardize

    assert standardize([1.0, None, 3.0]) == [-1.0, None, 1.0]
    assert standardize([None, 2.0, 2.0]) == [None, 0.0, 0.0]


def test_a_reward_function_s_prompt_is_the_last_user_message():
    """A few-shot prompt (system, an example exchange, then the task): `prompt` is the task as posed, not the
    system message nor the example's question."""
    from factory.reward.graph import prompt_text

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1 + 1?"},
                {"role": "assistant", "content": "2"}, {"role": "user", "content": "2 + 3?"}]
    assert prompt_text(messages) == "2 + 3?"
    assert prompt_text([{"role": "system", "content": "be brief"}]) == ""


def _scored(rewards=None, reward=0.0, dropped=None, details=None, turn_rewards=None):
    t = traj("x")
    t.rewards, t.reward, t.dropped = rewards or {}, reward, dropped
    t.reward_details, t.turn_rewards = details or {}, turn_rewards or {}
    return t


def test_reward_metrics_leave_dropped_trajectories_out_of_values_and_turn_means():
    """A drop_sample trajectory is out of every mean and of the counts that weigh a mean across calls:
    `/values` (a gated node's) and a per-turn node's `/turns` and `/turns/mean`."""
    from factory.reward.graph import eval_metrics, reward_metrics

    nodes = make_spec({"ok": {"fn": f"{FNS}:starts_with_ok"}, "costly": {"fn": f"{FNS}:length"},
                       "total": {"gate": "ok", "then": "costly"}}).rewards
    trajs = [_scored({"ok": 1.0, "costly": 2.0, "total": 2.0}, 2.0),
             _scored({"ok": 0.0, "costly": None, "total": 0.0}, 0.0, details={"costly": {"status": "skipped"}}),
             _scored({"ok": 1.0, "costly": 4.0, "total": None}, 0.0, dropped="rewards.x: missing")]
    m = reward_metrics(trajs, nodes, "total")
    # costly has a value on 1 kept trajectory (the dropped one's 4 is out): mean 2 over 1 value
    assert (m["rewards/costly/values"], m["rewards/costly/mean"], m["rewards/costly/skipped"]) == (1.0, 2.0, 1.0)
    assert (m["reward/mean"], m["reward/dropped"]) == (1.0, 1.0)  # (2 + 0) / 2 kept; one dropped
    assert eval_metrics(m, {"acc": "costly"}) == {"eval/acc": 2.0, "eval/reward": 1.0, "eval/dropped": 1.0}

    nodes = make_spec({"step": {"fn": f"{FNS}:length", "per": "turn"}, "total": {"sum": {"step": 1.0}}}).rewards
    trajs = [_scored({"step": 0.5, "total": 0.5}, 0.5, turn_rewards={"step": [1.0, 0.0, None]}),
             _scored({"step": 5.0, "total": None}, 0.0, dropped="rewards.x: missing", turn_rewards={"step": [5.0]})]
    m = reward_metrics(trajs, nodes, "total")
    # the kept trajectory's 2 turns with a value: 1, 0 -> mean 0.5 (the dropped one's 5 is out)
    assert (m["rewards/step/turns"], m["rewards/step/turns/mean"], m["rewards/step/mean"]) == (2.0, 0.5, 0.5)


def test_a_functions_none_is_said_once_a_run_and_an_error_every_step(caplog):
    """None is a function's own "no value here" (a per-turn node on a turn without calls): said at its first
    step, not at every step of the run; an exception is news each step it happens."""
    import logging

    spec = make_spec({"opinion": {"fn": f"{FNS}:none_for_empty"}, "broken": {"fn": f"{FNS}:boom"},
                      "total": {"sum": {"opinion": 1.0, "broken": 1.0}}})
    stage = reward_stage(spec)

    async def go():
        await stage.setup()
        try:
            for step in (1, 2, 3):
                await stage.score([traj("abc", 0, 0), traj("", 0, 1), traj("boom", 0, 2)], step=step)
        finally:
            await stage.close()

    with caplog.at_level(logging.WARNING, logger="factory.reward.stage"):
        asyncio.run(go())
    said = [r.getMessage() for r in caplog.records if "no value for" in r.getMessage()]
    by_node = [m.split(":")[0].removeprefix("reward node ") for m in said]
    assert (by_node.count("opinion"), by_node.count("broken")) == (1, 3)
    assert [m.endswith("(nor, in later steps, a None of its function's)") for m in said if "opinion" in m] == [True]


def test_a_missing_value_whose_error_holds_a_lone_surrogate_is_said_as_its_escape(caplog):
    """A drop_sample node's error quoting a file name that is not UTF-8: the stage's warning could not be written
    to a UTF-8 stream (logging printed its own traceback in its place)."""
    import logging

    spec = make_spec({"has_file": {"fn": f"{FNS}:output_file", "on_missing": "drop_sample"},
                      "total": {"sum": {"has_file": 1.0}}})
    with caplog.at_level(logging.WARNING, logger="factory.reward.stage"):
        (t,), m = score(spec, [traj("r\udce9sultat.txt")])
    assert m["reward/dropped"] == 1.0
    assert t.dropped == "rewards.has_file: error: FileNotFoundError: no output file r\udce9sultat.txt"
    (said,) = [r.getMessage() for r in caplog.records if "no value for" in r.getMessage()]
    assert "(first: FileNotFoundError: no output file r\\udce9sultat.txt)" in said.encode("utf-8").decode()


@pytest.mark.parametrize("policy", ["zero", "drop_sample", "fail"])
def test_on_missing(policy):
    from factory.algorithms import resolve
    from factory.schema import AlgorithmSpec
    from factory.update.batch import kept

    spec = make_spec({"len": {"fn": f"{FNS}:length"},
                      "opinion": {"fn": f"{FNS}:none_for_empty", "on_missing": policy},
                      "total": {"sum": {"len": 1.0, "opinion": 1.0}}, "acc": {"max": ["opinion"]}})
    trajs = [traj("abc", 0, 0), traj("", 0, 1)]  # none_for_empty: 1.0 for "abc", None for ""
    if policy == "fail":
        with pytest.raises(MissingReward) as e:
            score(spec, trajs)
        assert str(e.value) == ("reward node 'opinion' has no value for trajectory 0.1 and its on_missing is "
                                "'fail': missing: returned None")
        return
    trajs, m = score(spec, trajs)
    assert trajs[1].reward_details["opinion"] == {"status": "missing", "error": "returned None"}
    assert m["rewards/opinion/missing"] == 1.0 and m["rewards/opinion/errors"] == 0.0
    keep = kept(trajs, resolve(AlgorithmSpec()), drop_infra_errors=True)
    if policy == "zero":
        # "" counts 0 everywhere: total 0 + 0; the trained reward and every mean include it
        assert trajs[1].rewards["opinion"] == 0.0 and trajs[1].reward == 0.0 and trajs[1].dropped is None
        assert keep == [True, True]
        assert m["reward/mean"] == 2.0 and m["rewards/opinion/mean"] == 0.5 and m["rewards/acc/mean"] == 0.5
        assert m["reward/dropped"] == 0.0
    else:
        # "" leaves the loss and every mean, and every node reading `opinion` has no value there either
        assert trajs[1].rewards["opinion"] is None and trajs[1].rewards["total"] is None
        assert trajs[1].rewards["len"] == 0.0  # nodes that do not read it still have their values (logged)
        assert trajs[1].dropped == "rewards.opinion: missing: returned None"
        assert keep == [True, False]
        assert m["reward/mean"] == 4.0 and m["rewards/opinion/mean"] == 1.0 and m["rewards/len/mean"] == 3.0
        assert m["reward/dropped"] == 1.0


def test_failures_are_recorded_counted_and_the_run_goes_on():
    spec = make_spec({"b": {"fn": f"{FNS}:boom"}, "word": {"fn": f"{FNS}:not_a_number"},
                      "nan": {"fn": f"{FNS}:nan"}, "total": {"sum": {"b": 1.0, "word": 1.0, "nan": 1.0}}})
    trajs, m = score(spec, [traj("fine"), traj("boom")])
    assert trajs[0].rewards["b"] == 1.0 and trajs[1].rewards["b"] == 0.0  # on_missing: zero (the default)
    assert trajs[1].reward_details["b"] == {"status": "error", "error": "RuntimeError: reward function crashed"}
    assert trajs[0].reward_details["word"] == {"status": "error", "error": "returned 'high', not a number"}
    assert trajs[0].reward_details["nan"] == {"status": "non_finite", "error": "the value is not finite: nan"}
    assert (m["rewards/b/errors"], m["rewards/word/errors"], m["rewards/nan/errors"]) == (1.0, 2.0, 0.0)
    assert m["rewards/nan/missing"] == 2.0 and m["rewards/nan/non_finite"] == 2.0
    assert [t.reward for t in trajs] == [1.0, 0.0]
    spec = make_spec({"text": {"fn": f"{FNS}:numeric_text"}, "np": {"fn": f"{FNS}:numpy_scalar"},
                      "total": {"sum": {"text": 1.0, "np": 1.0}}})
    trajs, _ = score(spec, [traj("fine")])
    assert trajs[0].reward_details["text"] == {"status": "error", "error": "returned '0.5', not a number"}
    assert trajs[0].rewards["np"] == 0.25
    # SystemExit is no Exception: it went through the stage, and Ray ended the reward stage's actor with it
    trajs, m = score(make_spec({"x": {"fn": f"{FNS}:exits"}, "total": {"sum": {"x": 1.0}}}), [traj("fine")])
    said = "RuntimeError: the function raised SystemExit(2)"
    assert trajs[0].reward_details["x"] == {"status": "error", "error": said}
    assert m["rewards/x/errors"] == 1


@pytest.mark.parametrize("policy", ["zero", "drop_sample", "fail"])
def test_an_infinite_reward_is_no_value_and_its_on_missing_applies(policy):
    """inf passed as a value before (only NaN was caught): one +inf made the group's advantages NaN."""
    spec = make_spec({"big": {"fn": f"{FNS}:inf_for_big", "on_missing": policy}, "len": {"fn": f"{FNS}:length"},
                      "total": {"sum": {"big": 1.0, "len": 1.0}}})
    if policy == "fail":
        with pytest.raises(MissingReward, match=r"reward node 'big' has no value for trajectory 0.1 .*"
                                                r"non_finite: the value is not finite: inf"):
            score(spec, [traj("ok"), traj("big", 0, 1)])
        return
    trajs, m = score(spec, [traj("ok"), traj("big", 0, 1)])
    assert trajs[1].reward_details["big"] == {"status": "non_finite", "error": "the value is not finite: inf"}
    assert m["rewards/big/non_finite"] == 1.0 and m["rewards/big/missing"] == 1.0
    assert all(math.isfinite(t.reward) for t in trajs) and math.isfinite(m["reward/mean"])
    assert trajs[1].rewards["total"] == (3.0 if policy == "zero" else None)


def test_a_value_too_large_for_float32_is_no_value():
    """1e308 passed the finiteness check and became inf in the update's float32 advantages: every update of
    the run was skipped, with nothing on the console."""
    spec = make_spec({"big": {"fn": f"{FNS}:huge_for_big"}, "len": {"fn": f"{FNS}:length"},
                      "total": {"sum": {"big": 0.1, "len": 1.0}}})
    trajs, m = score(spec, [traj("ok"), traj("big", 0, 1)])
    assert trajs[1].reward_details["big"] == {
        "status": "non_finite", "error": "the value is not finite: 1e+308 in float32, the dtype the update "
                                         "computes advantages in"}
    assert m["rewards/big/non_finite"] == 1.0 and trajs[1].rewards["total"] == 3.0  # on_missing: zero


@pytest.mark.parametrize("weights, completion, shown", [
    ({"len": 1e308}, "ab", "inf"), ({"len": 1e300}, "ab", r"2e\+300"),
    # math.fsum raised its own OverflowError (1e308 + 1e308) and ValueError (inf + -inf), past the stage
    ({"a": 1e308, "b": 1e308}, "x", "inf"), ({"a": 1e308, "b": -1e308}, "ab", "nan"),
    ({"a": 1e308, "b": 1e308, "c": -1e308}, "x", r"1e\+308"),  # a partial sum overflowed, the whole did not
])
def test_a_combinator_that_overflows_is_a_located_failure(weights, completion, shown):
    spec = make_spec({**{name: {"fn": f"{FNS}:length"} for name in weights}, "total": {"sum": weights}})
    inputs = ", ".join(f"'{name}': {len(completion)}.0" for name in weights)
    with pytest.raises(NonFiniteReward, match=rf"reward node 'total' is {shown} for trajectory 0.0 from finite "
                                              rf"inputs \{{{inputs}\}}: its weights or its inputs' sizes overflow "
                                              r"a float32"):
        score(spec, [traj(completion)])


def test_a_sum_whose_partial_sums_overflow_is_its_exact_value():
    weights = {"a": 1e308, "b": 1e308, "c": -1e308, "d": -1e308, "e": 1.0}
    assert combine(SumNode(sum=weights), [1.0] * 5) == 1.0


def test_independent_nodes_and_trajectories_run_concurrently():
    reward_fns.INFLIGHT.update(now=0, peak=0)
    spec = make_spec({"a": {"fn": f"{FNS}:overlapping"}, "b": {"fn": f"{FNS}:overlapping"},
                      "c": {"fn": f"{FNS}:overlapping"}, "total": {"sum": {"a": 1.0, "b": 1.0, "c": 1.0}}})
    trajs, _ = score(spec, [traj(str(i), i) for i in range(4)])
    assert reward_fns.INFLIGHT["peak"] == 12  # 3 nodes x 4 trajectories all in flight at once
    assert [t.reward for t in trajs] == [3.0] * 4


def test_turns_reach_only_functions_that_declare_them():
    turns = [Turn(text='<tool_call>{"name": "add"}</tool_call>', num_tokens=9,
                  calls=[ToolCall(name="add", arguments={}, raw='{"name": "add"}')],
                  results=[ToolResult(tool="add", text="Error: missing a", status="model_error")]),
             Turn(text="<answer>2</answer>", num_tokens=5)]
    spec = make_spec({"calls": {"fn": f"{FNS}:sees_turns"}, "answer": {"fn": f"{FNS}:sees_row"},
                      "total": {"sum": {"calls": 1.0, "answer": 1.0}}})
    trajs, m = score(spec, [traj("x", turns=turns, answer="2")])
    assert trajs[0].rewards == {"calls": 1.0, "answer": 2.0, "total": 3.0} and m["rewards/calls/errors"] == 0.0


def test_a_function_that_changes_what_it_is_given_changes_no_other_node_nor_the_record():
    """Each call gets its own copy of the turns (and a group function of the rows): `turns.pop()` in one node
    took the last turn from every other node's input and from the trajectory the step saves."""
    import copy

    turns = [Turn(text="<tool_call>{}</tool_call>", num_tokens=9, calls=[ToolCall(name="add", arguments={}, raw="{}")],
                  results=[ToolResult(tool="add", text="3")]),
             Turn(text="<answer>3</answer>", num_tokens=5)]
    spec = make_spec({"early": {"fn": f"{FNS}:pops_a_turn"}, "grp": {"fn": f"{FNS}:group_clears", "group": True},
                      "each": {"fn": f"{FNS}:turn_clears", "per": "turn"},
                      "calls": {"fn": f"{FNS}:sees_turns"}, "answer": {"fn": f"{FNS}:sees_row"},
                      "total": {"sum": {"early": 1.0, "grp": 1.0, "each": 1.0, "calls": 1.0, "answer": 1.0}}})
    trajs, m = score(spec, [traj("x", turns=copy.deepcopy(turns), answer="2")])
    assert trajs[0].turns == turns and trajs[0].row == {"answer": "2"}
    assert trajs[0].rewards == {"early": 1.0, "grp": 0.0, "each": 0.0, "calls": 1.0, "answer": 2.0, "total": 4.0}
    assert sum(m[f"rewards/{n}/errors"] for n in ("early", "grp", "each", "calls", "answer")) == 0.0


def test_a_function_gets_only_the_row_columns_it_names():
    """Without `**row` a reward function is passed the columns it names, not every column of the row (each
    call raised TypeError before, and the node scored nothing). No function is passed a row's `completion`
    (or `prompt`) column, which would clash with its own argument, and the node's `args` win over a column
    of the same name."""
    spec = make_spec({"plain": {"fn": f"{FNS}:no_row"},
                      "named": {"fn": f"{FNS}:named_columns", "args": {"scale": 10.0}},
                      "all": {"fn": f"{FNS}:scaled_row", "args": {"scale": 10.0}},
                      "total": {"sum": {"plain": 1.0, "named": 1.0, "all": 1.0}}})
    settings = stage_settings(spec)["reward"]
    assert settings.row_keywords == {"plain": (), "named": ("answer",)}  # decided by the compiler; `all`: every column
    t = traj("abc", answer="2")
    t.row = {"answer": "2", "question": "1 + 1", "level": 3, "completion": "the row's", "scale": 100}
    trajs, m = score(spec, [t])
    assert trajs[0].rewards == {"plain": 3.0, "named": 20.0, "all": 20.0, "total": 43.0}
    assert m["rewards/plain/errors"] == m["rewards/named/errors"] == m["rewards/all/errors"] == 0.0


def test_a_group_reward_gets_only_the_members_scored():
    """A member never generated from (its prompt fills the context) was passed to the group function, whose
    ranks then counted its empty completion: the two below got 2 and 1 instead of 1 and 0."""
    import dataclasses

    spec = make_spec({"rank": {"fn": f"{FNS}:group_rank", "group": True}, "total": {"sum": {"rank": 1.0}}})
    long = dataclasses.replace(traj("", sample_index=2), stop_reason="prompt_too_long")
    trajs, _ = score(spec, [traj("aaaa", sample_index=0), traj("aa", sample_index=1), long])
    assert [t.rewards["rank"] for t in trajs] == [1.0, 0.0, None] and trajs[2].reward == 0.0


def test_group_reward_gets_each_group():
    call = Turn(text="", num_tokens=1, calls=[ToolCall(name="add", arguments={}, raw="")])
    spec = make_spec({"rank": {"fn": f"{FNS}:group_rank", "group": True},
                      "calls": {"fn": f"{FNS}:group_calls", "group": True},
                      "total": {"sum": {"rank": 1.0, "calls": 1.0}}})
    trajs, _ = score(spec, [traj("aaa", 0, 0, turns=[call, call]), traj("a", 0, 1), traj("bb", 1, 0),
                            traj("b", 1, 1, turns=[call])])
    assert [t.rewards["rank"] for t in trajs] == [1.0, 0.0, 1.0, 0.0]
    assert [t.rewards["calls"] for t in trajs] == [1.0, -1.0, -0.5, 0.5]  # calls minus the group's mean


def test_a_group_function_behind_a_gate_ranks_its_whole_group_where_any_member_passes():
    """The documented exception to a gate's `then` being evaluated only where it passes (docs/rewards.md): a group
    function's values are one per member, shared by every node that reads them, over the members scored (as a group
    normalize's population), so it is called on the whole group, and its value is used only where the gate passes.
    A group where no member passes does not call it."""
    reward_fns.GROUPS_SEEN.clear()
    spec = make_spec({"ok": {"fn": f"{FNS}:starts_with_ok"}, "rank": {"fn": f"{FNS}:group_rank_seen", "group": True},
                      "total": {"gate": "ok", "then": "rank", "otherwise": -1.0}})
    trajs, m = score(spec, [traj("ok a", 0, 0), traj("no bb", 0, 1), traj("ok ccc", 0, 2), traj("no x", 1, 0),
                            traj("no yy", 1, 1)])
    assert reward_fns.GROUPS_SEEN == [["ok a", "no bb", "ok ccc"]]  # "no bb" ranked among them; group 1 not called
    assert [t.rewards["rank"] for t in trajs] == [0.0, None, 2.0, None, None]
    assert [t.reward for t in trajs] == [0.0, -1.0, 2.0, -1.0, -1.0] and m["rewards/rank/skipped"] == 3.0


def test_the_stage_scores_in_the_compiled_order():
    spec = make_spec({"t": {"sum": {"a": 1, "m": 1}}, "m": {"max": ["a"]}, "g": {"gate": "a", "then": "m"},
                      "a": {"fn": f"{FNS}:length"}}, reward="t")
    order = reward_stage(spec).order
    assert order.index("a") < order.index("m") < order.index("t") and order.index("m") < order.index("g")


def test_tool_node_calls_a_python_tool_and_an_mcp_tool():
    spec = make_spec(
        {"len": {"tool": "scorer", "arguments": {"text": "{{ completion }}"}},
         "calc": {"tool": "calc.calculate", "arguments": {"expression": "{{ answer }} * 2"}},
         "total": {"sum": {"len": 1.0, "calc": 1.0}}},
        tools={"scorer": {"function": f"{FNS}:length_score"},
               "calc": {"command": sys.executable, "args": ["-m", "factory.examples.calculator"]}})
    from factory.tools.stage import ToolsStage

    settings = stage_settings(spec)
    tools, stage = ToolsStage(settings["tools"]), RewardStage(settings["reward"])

    async def go():
        await tools.setup()
        # the plan's reward -> tools call edge, under the role the reward stage's slice names
        await stage.setup(Placement(peers={settings["reward"].tool_peer: tools}))
        try:
            for _ in range(2):  # the second step reuses the tool servers the tools stage started
                trajs, m = await stage.score([traj("abcdefghij")])
                # length_score("abcdefghij") = 10 / 10 = 1.0; calculate("1 * 2") = 2 (the row's answer is "1")
                assert trajs[0].rewards == {"len": 1.0, "calc": 2.0, "total": 3.0}
                assert m["rewards/len/errors"] == 0.0
        finally:
            await stage.close()
            await tools.close()

    asyncio.run(go())


def test_a_tool_nodes_call_is_named_by_its_trajectory_s_place_in_the_run_and_the_node():
    """What a replay answers a tool node's call by (ToolCall.origin): the trajectory's place (Trajectory.origin,
    its sampling round included: dynamic sampling renumbers prompts after scoring), the node (two nodes asking
    the same question keep their own answers) and the turn for a per-turn node. Without it every reward call was
    answered from one queue per tool and arguments over the whole recording: a rescore of step 3 alone got step
    1's answers. A trajectory whose place is not known (read back from an older table) calls without one."""
    spec = make_spec({"a": {"tool": "grade", "arguments": {"text": "{{ answer }}"}},
                      "b": {"tool": "grade", "arguments": {"text": "{{ answer }}"}},
                      "each": {"tool": "grade", "arguments": {"text": "{{ completion }}"}, "per": "turn"},
                      "total": {"sum": {"a": 1.0, "b": 1.0, "each": 1.0}}},
                     tools={"grade": {"function": f"{FNS}:length_score"}})

    class Tools:  # the tools stage, as the reward stage calls it: what it was asked
        def __init__(self):
            self.origins = []

        def schemas(self):
            return []

        def call(self, call):
            self.origins.append(call.origin)
            return ToolResult(call.name, "1.0")

    settings = stage_settings(spec)["reward"]
    stage, tools = RewardStage(settings), Tools()
    turns = [Turn(text="x", num_tokens=1), Turn(text="y", num_tokens=1)]
    trajs = [traj("xy", 0, s, turns) for s in (0, 1, 2)]
    trajs[0].origin, trajs[1].origin = "train/3/1/0/0", "train/3/1/0/1"

    async def go():
        await stage.setup(Placement(peers={settings.tool_peer: tools}))
        try:
            return await stage.score(trajs, step=3, attempt=1)
        finally:
            await stage.close()

    scored, _ = asyncio.run(go())
    assert [t.reward for t in scored] == [3.0, 3.0, 3.0]
    assert sorted(tools.origins) == [""] * 4 + [f"reward/train/3/1/0/{s}/{node}" for s in (0, 1)
                                                for node in ("a", "b", "each/0", "each/1")]


def test_a_reward_function_past_its_timeout_has_no_value_and_scoring_goes_on():
    """`timeout_s` on a function node: a call that hangs (0.2 s here against 0.05) is an error, counted, and
    the other nodes and trajectories are scored as usual."""
    import time

    spec = make_spec({"slow": {"fn": f"{FNS}:slow", "args": {"delay": 0.2}, "timeout_s": 0.05},
                      "len": {"fn": f"{FNS}:length"}, "total": {"sum": {"slow": 1.0, "len": 1.0}}})
    t0 = time.monotonic()
    trajs, m = score(spec, [traj("ab"), traj("abc", 0, 1)])
    assert time.monotonic() - t0 < 0.2 + 1.0
    assert trajs[0].reward_details["slow"] == {"status": "error", "error": "TimeoutError: took longer than timeout_s "
                                                                             "(0.05 s)"}
    assert m["rewards/slow/errors"] == 2.0 and [t.reward for t in trajs] == [2.0, 3.0]


@pytest.mark.parametrize("fn", ["async_scorer", "decorated_async"])
def test_an_async_function_inspect_does_not_see_is_awaited_within_its_timeout(fn):
    """An object with an async `__call__`, or an async function under a plain decorator, is no coroutine function
    to `inspect`: run in a thread, its call handed back a coroutine, never awaited, and every value was an error
    ("returned '<coroutine ...>', not a number")."""
    spec = make_spec({"a": {"fn": f"{FNS}:{fn}"}, "slow": {"fn": f"{FNS}:{fn}", "args": {"delay": 5}, "timeout_s": 0.1},
                      "total": {"sum": {"a": 1.0, "slow": 1.0}}})
    trajs, m = score(spec, [traj("x")])
    assert trajs[0].rewards["a"] == 1.0, trajs[0].reward_details
    assert trajs[0].reward_details["slow"] == {"status": "error",
                                               "error": "TimeoutError: took longer than timeout_s (0.1 s)"}


@pytest.mark.parametrize("timeout_s", [60, None])
def test_a_function_s_own_timeouterror_is_not_said_to_be_past_timeout_s(timeout_s):
    """A TimeoutError the function raised at once (socket.timeout) was said to be "took longer than timeout_s";
    with timeout_s null, writing that message raised TypeError."""
    spec = make_spec({"own": {"fn": f"{FNS}:own_timeout", "timeout_s": timeout_s}, "total": {"sum": {"own": 1.0}}})
    trajs, m = score(spec, [traj("a")])
    assert trajs[0].reward_details["own"] == {"status": "error", "error": "TimeoutError: the checker's own deadline"}
    assert m["rewards/own/errors"] == 1.0


@pytest.mark.parametrize("fn,group", [("group_overflow", True), ("overflow_for_big", False)])
def test_an_integer_too_large_for_a_float_is_a_non_finite_value(fn, group):
    """float(10**400) raises OverflowError, which a group reward's values let escape the stage (a traceback
    that stopped the run); a plain function's was an 'error'."""
    spec = make_spec({"x": {"fn": f"{FNS}:{fn}", "group": group}, "total": {"sum": {"x": 1.0}}})
    trajs, m = score(spec, [traj("ok"), traj("big", 0, 1)])
    assert trajs[1].reward_details["x"] == {"status": "non_finite",
                                            "error": "the value is not finite: an integer of 1,329 bits"}
    assert m["rewards/x/non_finite"] == 1.0 and trajs[0].rewards["x"] == 1.0


def test_a_group_value_whose_float_raises_is_that_member_s_failure_not_the_run_s():
    """float() of a group reward's value raising RuntimeError (not TypeError/ValueError) escaped score()."""
    spec = make_spec({"g": {"fn": f"{FNS}:group_lazy", "group": True}, "total": {"sum": {"g": 1.0}}})
    trajs, m = score(spec, [traj("lazy"), traj("ok", 0, 1)])
    assert trajs[0].reward_details["g"] == {"status": "error",
                                            "error": "RuntimeError: lazy score could not be evaluated"}
    assert m["rewards/g/errors"] == 1.0 and trajs[1].rewards["g"] == 1.0


def test_a_node_that_fails_on_every_trajectory_of_a_step_is_named_once_a_run():
    """A reward function raising on every call ran a whole run with one reward-stage line a step, "no value for 1
    of 1 trajectories" when they are scored one at a time, and read as a model that learned nothing."""
    from factory.reward.graph import failing_everywhere
    from factory.runtime.display import Display

    spec = make_spec({"broken": {"fn": f"{FNS}:boom"}, "opinion": {"fn": f"{FNS}:none_for_empty"},
                      "total": {"sum": {"broken": 1.0, "opinion": 1.0}}})
    trajs, _ = score(spec, [traj("boom", 0), traj("boom boom", 1), traj("boom!", 2)])
    assert failing_everywhere(trajs) == ["broken"]
    assert failing_everywhere(score(spec, [traj("boom"), traj("fine")])[0]) == []  # failed on some only
    assert failing_everywhere(score(make_spec({"opinion": {"fn": f"{FNS}:none_for_empty"}}),
                                    [traj(""), traj("")])[0]) == []  # a None everywhere is the function's own choice
    import io

    from rich.console import Console

    out = io.StringIO()
    with Display(3, console=Console(file=out, width=300, log_path=False)) as d:
        for step in (1, 2):
            d.step(step, {"reward/mean": 0.0}, failing=["broken"], trajectories=3)
    said = [line for line in out.getvalue().splitlines() if "failed on all" in line]
    assert len(said) == 1 and "step 1: reward node broken failed on all 3 of the step's trajectories" in said[0]


def test_scoring_reports_its_progress_while_it_runs():
    """A slow judge's step showed nothing after the rollout ended, and the driver's deadline took it for a hang
    if it ran past 5x the longest scoring so far: the stage reports trajectories scored of those given, and
    every node value settled (a heartbeat before any trajectory is done)."""
    spec = make_spec({"slow": {"fn": f"{FNS}:slow", "args": {"delay": 0.3}},
                      "len": {"fn": f"{FNS}:length"}, "total": {"sum": {"slow": 1.0, "len": 1.0}}})
    stage = reward_stage(spec)

    async def go():
        await stage.setup()
        try:
            first = asyncio.ensure_future(stage.score([traj("ab"), traj("abc", 0, 1)]))
            await asyncio.sleep(0.15)  # `len` has settled on both, `slow` on none
            during = await stage.progress()
            await first
            after = await stage.progress()
            await stage.score([traj("a")])  # nothing in flight before it: a new batch's count
            return during, after, await stage.progress()
        finally:
            await stage.close()

    during, after, again = asyncio.run(go())
    assert during[:2] == (0, 2) and during[2] >= 2
    assert after[:2] == (2, 2) and after[2] == 4
    assert again == (1, 1, 6)
