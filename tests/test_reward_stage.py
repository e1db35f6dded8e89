import asyncio
import time

from factory.reward import RewardStage, topological_order
from factory.schema import Spec
from factory.types import Trajectory


def make_spec(rewards, reward=None):
    return Spec.model_validate({
        "name": "t", "model": {"path": "x"}, "data": {"train": {"generator": "factory.data:arithmetic"}},
        "rewards": rewards, **({"reward": reward} if reward else {})})


def traj(completion, prompt_index=0, sample_index=0):
    return Trajectory(prompt_index=prompt_index, sample_index=sample_index, prompt_ids=[], response_ids=[],
                      loss_mask=[], turns=[], stop_reason="no_call", row={"answer": "1"},
                      messages=[{"role": "user", "content": "q"}], completion=completion)


def score(spec, trajs):
    stage = RewardStage(spec)
    stage.setup()

    async def go():
        try:
            return await stage.score(trajs)
        finally:
            await stage.close()

    return asyncio.run(go())


def test_graph_values_and_combinators():
    spec = make_spec({
        "len": {"fn": "tests.fixtures.reward_fns:length"},
        "half": {"fn": "tests.fixtures.reward_fns:async_half"},
        "none": {"fn": "tests.fixtures.reward_fns:none_for_empty"},
        "total": {"sum": {"len": 1.0, "half": 2.0, "none": 10.0}},
        "lo": {"min": ["len", "half", "none"]},
        "gate": {"product": ["half", "len"]},
    })
    trajs, m = score(spec, [traj("abc"), traj("")])
    # "abc": len 3, half 0.5, none 1 -> total 3 + 1 + 10 = 14; min 0.5; product 1.5
    assert trajs[0].rewards == {"len": 3.0, "half": 0.5, "none": 1.0, "total": 14.0, "lo": 0.5, "gate": 1.5}
    # "": len 0, none None -> counts 0 in the sum (0 + 1 + 0), ignored by min, 0 in the product
    assert trajs[1].rewards["total"] == 1.0 and trajs[1].rewards["lo"] == 0.0 and trajs[1].rewards["none"] is None
    assert [t.reward for t in trajs] == [14.0, 1.0]  # `total` is the default training node
    assert m["reward/mean"] == 7.5 and m["rewards/none/mean"] == 1.0


def test_failing_reward_is_recorded_and_run_goes_on():
    spec = make_spec({"b": {"fn": "tests.fixtures.reward_fns:boom"}})
    trajs, m = score(spec, [traj("fine"), traj("boom")])
    assert trajs[0].rewards["b"] == 1.0 and trajs[1].rewards["b"] is None
    assert trajs[1].reward == 0.0 and m["rewards/b/errors"] == 1.0


def test_rewards_run_in_parallel():
    spec = make_spec({"s": {"fn": "tests.fixtures.reward_fns:slow", "args": {"delay": 0.2}}})
    t0 = time.perf_counter()
    score(spec, [traj(str(i)) for i in range(8)])
    # 8 calls of 0.2 s: serial would take 1.6 s.
    assert time.perf_counter() - t0 < 1.0


def test_group_reward_gets_each_group():
    spec = make_spec({"rank": {"fn": "tests.fixtures.reward_fns:group_rank", "group": True}})
    trajs, _ = score(spec, [traj("aaa", 0, 0), traj("a", 0, 1), traj("bb", 1, 0), traj("b", 1, 1)])
    assert [t.rewards["rank"] for t in trajs] == [1.0, 0.0, 1.0, 0.0]


def test_topological_order():
    spec = make_spec({"t": {"sum": {"a": 1, "m": 1}}, "m": {"max": ["a"]},
                      "a": {"fn": "tests.fixtures.reward_fns:length"}})
    order = topological_order(spec.rewards)
    assert order.index("a") < order.index("m") < order.index("t")


def test_tool_node_calls_a_python_tool_and_an_mcp_tool(tmp_path):
    import sys

    spec = Spec.model_validate({
        "name": "t", "model": {"path": "x"}, "data": {"train": {"generator": "factory.data:arithmetic"}},
        "tools": {"scorer": {"function": "tests.fixtures.reward_fns:length_score"},
                  "calc": {"command": sys.executable, "args": ["-m", "factory.examples.calculator"]}},
        "rewards": {"len": {"tool": "scorer", "arguments": {"text": "{{ completion }}"}},
                    "calc": {"tool": "calc.calculate", "arguments": {"expression": "{{ answer }} * 2"}},
                    "total": {"sum": {"len": 1.0, "calc": 1.0}}}})
    stage = RewardStage(spec)
    stage.setup()

    async def go():
        try:
            for _ in range(2):  # the second step reuses the tool servers the first one started
                trajs, m = await stage.score([traj("abcdefghij")])
                # length_score("abcdefghij") = 10 / 10 = 1.0; calculate("1 * 2") = 2 (the row's answer is "1")
                assert trajs[0].rewards == {"len": 1.0, "calc": 2.0, "total": 3.0}
                assert m["rewards/len/errors"] == 0.0
        finally:
            await stage.close()

    asyncio.run(go())
