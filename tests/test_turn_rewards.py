"""Per-turn reward nodes (`per: turn`) on hand-computed examples: called once per model turn with that turn,
its index and the row; combinators, gates, clips and `on_missing` turn by turn; a trajectory-level input
counting at every turn; a per-turn node's trajectory value (the mean of its turns); the compiler's checks."""
import pytest

from factory.reward import MissingReward
from factory.reward.graph import per_turn_nodes, required_columns, turn_mean
from factory.types import ToolCall, ToolResult, Turn
from tests.fixtures import reward_fns
from tests.test_reward_stage import make_spec, score, traj

FNS = "tests.fixtures.reward_fns"


def turn(text, statuses=()):
    """A model turn whose calls came back with `statuses` (no calls: the answer turn)."""
    return Turn(text=text, num_tokens=1, calls=[ToolCall(name="calc", arguments={}, raw="") for _ in statuses],
                results=[ToolResult(tool="calc", text="", status=s) for s in statuses])


# t0: ok call, failed call, answer turn (no calls) -- t1: one ok call, then the answer turn
T0 = [turn("a", ["ok"]), turn("bb", ["model_error"]), turn("ccc")]
T1 = [turn("d", ["ok", "ok"]), turn("ee")]


def test_a_per_turn_node_is_called_once_per_turn_with_the_turn_its_index_and_the_row():
    reward_fns.TURN_CALLS.clear()
    spec = make_spec({"step": {"fn": f"{FNS}:call_ok", "per": "turn"}})
    trajs, m = score(spec, [traj("abc", turns=T0, answer="7"), traj("d", turns=T1, answer="8")])
    # the completion is the turn's own text; the row comes along
    assert sorted(reward_fns.TURN_CALLS) == [(0, "a", "7"), (0, "d", "8"), (1, "bb", "7"), (1, "ee", "8"),
                                             (2, "ccc", "7")]
    # answer turns have no calls: missing -> 0.0 (on_missing: zero, per turn)
    assert trajs[0].turn_rewards == {"step": [1.0, 0.0, 0.0]} and trajs[1].turn_rewards == {"step": [1.0, 0.0]}
    assert trajs[0].rewards["step"] == pytest.approx(1 / 3) and trajs[1].rewards["step"] == 0.5  # turn means
    assert trajs[0].turn_reward == [1.0, 0.0, 0.0]  # the training node is per turn
    assert trajs[0].reward == pytest.approx(1 / 3)
    # counts are of turns: the two answer turns are missing
    assert m["rewards/step/missing"] == 2.0
    assert m["rewards/step/mean"] == pytest.approx((1 / 3 + 0.5) / 2)
    assert m["rewards/step/turns/mean"] == pytest.approx(2 / 5) and m["rewards/step/turns"] == 5.0  # 2 of 5 turns score 1
    assert trajs[0].reward_details["step"]["turns"][2]["status"] == "missing"
    assert trajs[0].reward_details["step"]["turns"][0] == {}


def test_the_missing_values_warning_counts_a_per_turn_nodes_turns(caplog):
    """2 of the 5 turns (the answer turns) have no value: not "2 of 2 trajectories' turns"."""
    spec = make_spec({"step": {"fn": f"{FNS}:call_ok", "per": "turn"}})
    score(spec, [traj("abc", turns=T0, answer="7"), traj("d", turns=T1, answer="8")])
    assert [r.getMessage().split(" (first")[0] for r in caplog.records if "no value for" in r.getMessage()] == [
        "reward node step: no value for 2 of 5 trajectories' turns"]



def test_a_failing_node_is_logged_once_per_sampling_round_however_many_calls_score_it(caplog):
    """Streamed trajectory by trajectory, a step is many `score` calls: one line per node and step (and
    dynamic-sampling attempt), not one per trajectory; `rewards/<node>/missing` counts each call's. A
    function's own None (call_ok on a turn without calls) is said once a run."""
    import asyncio

    from tests.test_reward_stage import reward_stage

    stage = reward_stage(make_spec({"step": {"fn": f"{FNS}:call_ok", "per": "turn"},
                                    "broken": {"fn": f"{FNS}:boom"},
                                    "total": {"sum": {"step": 1.0, "broken": 1.0}}}))

    async def go():
        await stage.setup()
        try:
            for step, attempt in ((1, 0), (1, 0), (1, 1), (2, 0), (2, 0)):
                _, m = await stage.score([traj("boom", turns=T0, answer="7")], step=step, attempt=attempt)
                assert m["rewards/step/missing"] == 1.0 and m["rewards/broken/missing"] == 1.0
        finally:
            await stage.close()

    asyncio.run(go())
    lines = [r.getMessage() for r in caplog.records if "no value for" in r.getMessage()]
    steps = {node: [ln.split("of step ")[1].split(";")[0] for ln in lines if ln.startswith(f"reward node {node}:")]
             for node in ("step", "broken")}
    assert steps == {"step": ["1"], "broken": ["1", "1", "2"]}  # broken: (1, 0), (1, 1), (2, 0)

def test_combinators_clip_and_gate_work_per_turn_with_trajectory_inputs_at_every_turn():
    spec = make_spec({
        "step": {"fn": f"{FNS}:call_ok", "per": "turn", "on_missing": "zero"},
        "idx": {"fn": f"{FNS}:turn_index", "per": "turn"},
        "len": {"fn": f"{FNS}:length"},  # trajectory-level: len(completion)
        "total": {"sum": {"len": 1.0, "step": 10.0, "idx": 100.0}},
        "capped": {"clip": "idx", "upper": 1.0},
        "lo": {"min": ["idx", "len"]},
        "late": {"gate": "idx", "then": "step", "threshold": 1.0, "otherwise": -1.0},
    })
    trajs, m = score(spec, [traj("abc", turns=T0)])
    t = trajs[0]
    assert per_turn_nodes(spec.rewards) == {"step", "idx", "total", "capped", "lo", "late"}
    # turn k: len 3 + 10*step_k + 100*k
    assert t.turn_rewards["total"] == [3.0 + 10.0, 3.0 + 0.0 + 100.0, 3.0 + 0.0 + 200.0]
    assert t.turn_reward == t.turn_rewards["total"] and t.reward == pytest.approx(319.0 / 3)
    assert t.turn_rewards["capped"] == [0.0, 1.0, 1.0]
    assert t.turn_rewards["lo"] == [0.0, 1.0, 2.0]
    assert t.rewards["len"] == 3.0 and "len" not in t.turn_rewards  # trajectory-level: as before
    # the gate passes at turns 1 and 2 only (idx >= 1); turn 0 takes `otherwise`
    assert t.turn_rewards["late"] == [-1.0, 0.0, 0.0]


def test_a_gate_leaves_a_per_turn_node_unevaluated_where_its_condition_fails():
    reward_fns.TURN_CALLS.clear()
    spec = make_spec({
        "idx": {"fn": f"{FNS}:turn_index", "per": "turn"},
        "step": {"fn": f"{FNS}:call_ok", "per": "turn"},
        "total": {"gate": "idx", "then": "step", "threshold": 2.0},
    })
    trajs, m = score(spec, [traj("abc", turns=T0)])
    assert [c[0] for c in reward_fns.TURN_CALLS] == [2]  # only turn 2 passes idx >= 2
    t = trajs[0]
    assert t.turn_rewards["step"] == [None, None, 0.0]  # not evaluated at turns 0 and 1; missing -> 0 at 2
    assert t.rewards["step"] == 0.0
    assert [d.get("status") for d in t.reward_details["step"]["turns"]] == ["skipped", "skipped", "missing"]
    assert m["rewards/step/skipped"] == 2.0 and m["rewards/step/missing"] == 1.0


def test_on_missing_drop_sample_and_fail_work_per_turn():
    spec = make_spec({"step": {"fn": f"{FNS}:call_ok", "per": "turn", "on_missing": "drop_sample"},
                      "len": {"fn": f"{FNS}:length"}, "total": {"sum": {"step": 1.0, "len": 1.0}}})
    trajs, m = score(spec, [traj("abc", turns=T0), traj("d", turns=T1[:1])])
    assert trajs[0].dropped == "rewards.step (turn 2): missing: returned None"
    assert trajs[0].turn_rewards["total"] == [4.0, 3.0, None]
    assert trajs[1].dropped is None and trajs[1].turn_rewards["total"] == [2.0]
    assert m["reward/dropped"] == 1.0
    spec = make_spec({"step": {"fn": f"{FNS}:call_ok", "per": "turn", "on_missing": "fail"}})
    with pytest.raises(MissingReward, match=r"trajectory 0\.0 \(turn 2\) and its on_missing is 'fail'"):
        score(spec, [traj("abc", turns=T0)])


def test_a_trajectory_without_turns_has_no_per_turn_value():
    trajs, _ = score(make_spec({"step": {"fn": f"{FNS}:turn_index", "per": "turn"}}), [traj("", turns=[])])
    assert trajs[0].turn_rewards == {"step": []} and trajs[0].rewards["step"] is None and trajs[0].reward == 0.0
    assert turn_mean([None, 1.0, 2.0]) == 1.5 and turn_mean([]) is None


def test_trajectories_without_turns_leave_a_per_turn_node_s_counts_and_streamed_mean_right(tmp_path):
    """A trajectory with no turns (prompt_too_long, an episode timed out in its first turn): a per-turn judge
    never asked counted a call, and a step scored in parts weighed each part's mean over every kept trajectory,
    those without a value too, so the streamed mean was not the whole batch's."""
    import dataclasses

    from factory.runtime.driver import _merge
    from tests.servers import free_port
    from tests.test_reward_judge import _score

    (tmp_path / "judge.jinja").write_text("{{ completion }}")
    spec = make_spec({"judge": {"llm_judge": "judge.jinja", "endpoint": f"http://127.0.0.1:{free_port()}/v1",
                                "retries": 0, "per": "turn"}})
    empty = [dataclasses.replace(traj("", turns=[]), stop_reason="prompt_too_long"),
             dataclasses.replace(traj("", 1, turns=[]), stop_reason="timeout")]
    _, m = _score(spec, empty, tmp_path)
    assert m["rewards/judge/calls"] == 0.0  # no request was made

    spec = make_spec({"step": {"fn": f"{FNS}:turn_index", "per": "turn"}})
    a = [dataclasses.replace(traj("", 0, turns=[]), stop_reason="timeout"),
         traj("x", 1, turns=[turn("a"), turn("b")])]
    b = [traj("y", 2, turns=[turn("c")])]
    _, whole = score(spec, [dataclasses.replace(t) for t in a + b])
    _, ma = score(spec, a)
    _, mb = score(spec, b)
    assert whole["rewards/step/mean"] == pytest.approx(0.25)  # (0 + 1) / 2 and 0: over the two with turns
    assert _merge(ma, mb, len(a), len(b))["rewards/step/mean"] == pytest.approx(0.25)
    assert whole["rewards/step/values"] == 2.0


def test_trajectory_level_nodes_are_unchanged():
    trajs, _ = score(make_spec({"len": {"fn": f"{FNS}:length"}}), [traj("abc", turns=T0)])
    assert trajs[0].rewards == {"len": 3.0} and trajs[0].turn_rewards == {} and trajs[0].turn_reward == []


def test_schema_and_compiler_refuse_what_per_turn_cannot_do():
    with pytest.raises(ValueError, match="`per: turn` is for one value per model turn"):
        make_spec({"g": {"fn": f"{FNS}:group_rank", "group": True, "per": "turn"}})
    from factory.compiler.compile import stage_settings
    from factory.compiler.errors import SpecErrors

    spec = make_spec({"step": {"fn": f"{FNS}:turn_index", "per": "turn"}, "total": {"normalize": "step"}})
    with pytest.raises(SpecErrors, match="'step' has one value per model turn"):
        stage_settings(spec)
    # `turn` and `index` are passed, never data columns
    spec = make_spec({"step": {"fn": f"{FNS}:call_ok", "per": "turn"}})
    assert required_columns(spec) == {}
    from factory.compiler.refs import reward_problem

    assert reward_problem(reward_fns.call_ok, "f", {}, False, per_turn=True) is None
    assert "unexpected keyword argument 'turn'" in reward_problem(_no_turn, "f", {}, False, per_turn=True)


def _no_turn(prompt, completion, answer=""):
    return 1.0


def test_judge_and_tool_nodes_per_turn_render_each_turn(tmp_path):
    """A per-turn judge is asked about each turn (`completion` is the turn's text) and a per-turn tool is
    called with each turn's arguments."""
    import asyncio
    import sys

    from factory.compiler.compile import stage_settings
    from factory.reward import RewardStage
    from factory.tools.stage import ToolsStage
    from factory.types import Placement
    from tests.servers import free_port, http_server
    from tests.test_reward_judge import REPO

    port = free_port()
    (tmp_path / "judge.jinja").write_text("Grade turn {{ index }}: {{ completion }}")
    spec = make_spec({
        "judge": {"llm_judge": "judge.jinja", "endpoint": f"http://127.0.0.1:{port}/v1", "model": "m", "per": "turn"},
        "len": {"tool": "scorer", "arguments": {"text": "{{ completion }}"}, "per": "turn"},
        "total": {"sum": {"judge": 1.0, "len": 1.0}}},
        tools={"scorer": {"function": f"{FNS}:length_score"}})
    settings = stage_settings(spec, tmp_path)
    tools, stage = ToolsStage(settings["tools"]), RewardStage(settings["reward"])

    async def go():
        await tools.setup()
        await stage.setup(Placement(peers={settings["reward"].tool_peer: tools}))
        try:
            return await stage.score([traj("x", turns=[turn("ab [good]"), turn("[bad]")])])
        finally:
            await stage.close()
            await tools.close()

    with http_server([sys.executable, "-m", "tests.judge_server", str(port)], port, cwd=REPO):
        trajs, m = asyncio.run(go())
    # the judge server scores "[good]" 1 and "[bad]" 0; length_score is len / 10: "ab [good]" 0.9, "[bad]" 0.5
    assert trajs[0].turn_rewards["judge"] == [1.0, 0.0]
    assert trajs[0].turn_rewards["len"] == pytest.approx([0.9, 0.5])
    assert trajs[0].turn_rewards["total"] == pytest.approx([1.9, 0.5])
    assert m["rewards/judge/calls"] == 2.0


def test_a_rescored_trajectory_gets_the_same_per_turn_values():
    """`factory rescore` reads turns back from the saved table: a per-turn node scores them as the run did."""
    import pyarrow as pa

    from factory.commands.rescore import trajectory_from_record
    from factory.tracking.mlflow_tracker import trajectory_records

    spec = make_spec({"step": {"fn": f"{FNS}:call_ok", "per": "turn"}})
    (scored,), _ = score(spec, [traj("abc", turns=T0)])
    (record,) = pa.Table.from_pylist(trajectory_records([scored], step=1)).to_pylist()
    (again,), _ = score(spec, [trajectory_from_record(record)])
    assert again.turn_rewards == scored.turn_rewards == {"step": [1.0, 0.0, 0.0]}


def test_the_documented_call_ok_gives_a_call_that_never_ran_no_credit():
    """docs/rewards.md's per-turn `call_ok` (and this suite's copy) gave 1.0 to a last turn whose call never
    ran (the episode ended at max_turns): it has no result, and all() of no results is True."""
    from tests.docblocks import REPO, parse

    block = next(b for b in parse(REPO / "docs" / "rewards.md").blocks if b.attrs.get("file") == "rewards/steps.py")
    documented: dict = {}
    exec(block.text, documented)
    unrun = Turn(text="<tool_call>\n<answer>", num_tokens=4,
                 calls=[ToolCall(name="?", arguments=None, raw="\n<answer>", parse_error="unclosed <tool_call>")])
    for call_ok in (documented["call_ok"], reward_fns.call_ok):
        assert [call_ok("q", t.text, turn=t, index=0) for t in (unrun, turn("a", ["ok"]), turn("b"))] == [
            0.0, 1.0, None]
