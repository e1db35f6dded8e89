"""Factory's built-in reward functions (factory.rewards), on turns parsed by the rollout's own parser."""
import time
from pathlib import Path

import pytest

from factory.rewards.format import called_tool, tool_call_ok, tools_succeeded
from factory.rewards.math import exact_match, extract_answer, numeric_match
from factory.rollout.parse import parse_tool_calls
from factory.types import ToolResult, Turn

CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2 + 3"}}\n</tool_call>'


def turn(text, *statuses):
    """A model turn as the rollout records it: its text, the calls parsed from it, and their results."""
    calls = parse_tool_calls(text)
    return Turn(text=text, num_tokens=len(text), calls=calls,
                results=[ToolResult(tool=c.name, text="5", status=s) for c, s in zip(calls, statuses)])


def test_answer_is_read_from_the_model_turns_only():
    # An answer inside a tool response is not the model's.
    turns = [turn(CALL, "ok"), turn("no answer")]
    completion = f"{CALL}<tool_response>\n<answer>5</answer>\n</tool_response>no answer"
    assert extract_answer(completion, turns) is None
    assert extract_answer(completion) is None  # without turns: tool responses are cut from the text
    assert extract_answer("", [turn(CALL, "ok"), turn("<answer> 5 </answer>")]) == "5"
    assert numeric_match("q", "", answer="5", turns=[turn(CALL, "ok"), turn("<answer>5</answer>")]) == 1.0
    # nor one drafted in its reasoning (here turn 2 was cut while thinking: no final answer)
    drafted = [turn("<think>it is <answer>5</answer>?</think>" + CALL, "ok"), turn("<think>so the answer")]
    assert extract_answer("", drafted) is None
    assert extract_answer("<think><answer>5</answer></think>no answer") is None
    assert extract_answer("", [turn("<think>maybe <answer>4</answer></think><answer>5</answer>")]) == "5"
    # a turn's text starts with any `<think>` its prompt opened, so a `</think>` in a call's argument is the
    # call's, as the agent loop read it: the answer before it was dropped as reasoning
    quoting = '<answer>5</answer><tool_call>{"name": "s", "arguments": {"q": "</think>"}}</tool_call>'
    assert extract_answer("", [Turn(text=quoting, num_tokens=9)]) == "5"


def test_an_answer_tag_is_closed_within_its_own_turn():
    # turn 1 opened a tag and went on with a call: the next turn's `</answer>` does not close it
    opened = turn("<answer>Let me check 7 + 12 first " + CALL, "ok")
    assert extract_answer("", [opened, turn("<answer>19</answer>")]) == "19"
    assert numeric_match("q", "", answer="19", turns=[opened, turn("<answer>19</answer>")]) == 1.0
    assert extract_answer("", [turn("<answer>19</answer>"), opened]) == "19"  # the last closed one
    assert extract_answer("", [opened, turn("19</answer>")]) is None


@pytest.mark.parametrize("completion, expected", [
    ("<answer>1</answer><answer>2</answer>", "2"),  # the last tag
    ("<answer> a <answer> b </answer>", "a <answer> b"),  # an opener inside a tag is its text
    ("<ANSWER>x</Answer>", "x"),
    ("<answer>1</answer><answer>2", "1"),  # a tag never closed is no answer
    ("</answer><answer>\n 3 \n</answer> trailing </answer>", "3"),
    ("<answer>  </answer>", ""),
    ("<tool_response><answer>1</answer></tool_response><answer>2</answer><tool_response><answer>3</answer>", "3"),
])
def test_the_answer_is_the_last_closed_tag_s_text(completion, expected):
    assert extract_answer(completion) == expected


@pytest.mark.parametrize("completion", ["<answer>" + " " * 20000, "<answer>" * 20000, "<tool_response>" * 20000])
def test_an_answer_tag_never_closed_is_read_in_linear_time(completion):
    # A regex that backtracked took minutes on these, holding the GIL: a thread's `timeout_s` cannot stop that.
    start = time.perf_counter()
    assert extract_answer(completion) is None
    assert time.perf_counter() - start < 2


def test_numeric_match():
    assert numeric_match("q", "<answer>1,234</answer>", answer="1234") == 1.0
    assert numeric_match("q", "<answer>the result is -7.0</answer>", answer="-7") == 1.0
    assert numeric_match("q", "<answer>8</answer>", answer="7") == 0.0
    assert numeric_match("q", "7", answer="7") == 0.0  # no tag, no credit
    assert numeric_match("q", "<answer>x</answer>", answer="7") == 0.0


def test_numeric_match_reads_a_leading_dot_and_a_ground_truth_with_separators():
    assert numeric_match("q", "<answer>.5</answer>", answer="0.5") == 1.0  # was read as 5
    assert numeric_match("q", "<answer>.5</answer>", answer="5") == 0.0
    assert numeric_match("q", "<answer>-.25</answer>", answer="-0.25") == 1.0
    assert numeric_match("q", "<answer>1,234</answer>", answer="1,234") == 1.0  # the target's commas too
    assert numeric_match("q", "<answer>1234</answer>", answer=1234.0) == 1.0


@pytest.mark.parametrize("said, truth, expected", [
    ("1,234", "1234", 1.0), ("1,234,567.5", "1234567.5", 1.0),  # thousands separators are dropped
    ("3,4", "34", 0.0), ("3,4", "3", 1.0), ("12,5", "125", 0.0), ("1,2345", "12345", 0.0),  # other commas are not
    ("1, 2, 3", "1", 1.0), ("1,2,3", "123", 0.0),
    ("1/2", "0.5", 1.0), ("1/2", "1", 0.0), ("-3 / 4 of it", "-0.75", 1.0), ("1/3", "0.333333333333", 1.0),
    (r"\frac{1}{2}", "0.5", 1.0), (r"\frac{1}{2}", "1", 0.0), (r"-\dfrac{3}{4}", "-0.75", 1.0), ("1/0", "1", 0.0),
    ("2^{10}", "2", 0.0), ("2^{10}", "1024", 0.0), ("2 ^ 10", "2", 0.0), (r"2 \times 10^3", "2", 0.0),
    ("3 * 4", "3", 0.0), ("2**10", "2", 0.0), ("3\u00d74", "3", 0.0),  # an expression is no answer
    ("3 * -4", "3", 0.0), ("3*(4)", "3", 0.0), ("2 \\cdot 5", "2", 0.0),
    ("**42**", "42", 1.0), ("**42**.", "42", 1.0), ("**42** - the total", "42", 1.0),  # bold: no operand follows
    ("42 * the units", "42", 1.0),
    # bold's closing `**` before a parenthetical or a new line is no multiplication (it read `**42** (x)` as 42 * (x))
    ("**42** (the total)", "42", 1.0), ("**42**\n\n2 boxes of 21", "42", 1.0), ("*42* (forty-two)", "42", 1.0),
    ("3 *\n4", "3", 1.0), ("3\n* 4 boxes", "3", 1.0),  # nor a `*` across a line break (a list item)
    (r"\frac12", "0.5", 1.0), (r"\frac {1}{2}", "0.5", 1.0), (r"\frac{3}4", "0.75", 1.0),  # LaTeX's shorthand
    (r"\frac12", "12", 0.0),
])
def test_numeric_match_reads_separators_fractions_and_refuses_expressions(said, truth, expected):
    assert numeric_match("q", f"<answer>{said}</answer>", answer=truth) == expected


@pytest.mark.parametrize("said, truth", [
    (r"\frac123", "0.5"), (r"\frac123", "1.5"), (r"\frac{1}{2}3", "0.5"), (r"\frac12 3", "0.5"),
    (r"\frac1{2}3", "0.5"), (r"-\frac12.5", "-0.5"),
])
def test_numeric_match_refuses_a_latex_fraction_with_a_number_after_it(said, truth):
    # TeX takes one digit as `\frac`'s argument, so `\frac123` is `\frac{1}{2}3`, a half then a 3 (spaces
    # between them are ignored in math mode): an expression, not its first number (it was read as 0.5)
    assert numeric_match("q", f"<answer>{said}</answer>", answer=truth) == 0.0
    assert numeric_match("q", r"<answer>\frac12.</answer>", answer="0.5") == 1.0  # a full stop is no number


@pytest.mark.parametrize("said, truth, expected", [
    ("3* 4", "3", 0.0), ("3** 4", "3", 0.0), ("the total is 3* 4", "3", 0.0), ("3* (4)", "3", 0.0),
    ("* 3* 4", "3", 0.0), ("*Note:* 3* 4", "3", 0.0),  # a bullet's `*`, or an emphasis already closed
    # a `*` with no space on its left and one on its right closes an emphasis opened before it on its line
    ("**42** 7 boxes", "42", 1.0), ("**The total: 42** (7 boxes)", "42", 1.0), ("*Total 42* 7 boxes", "42", 1.0),
    ("3* apples", "3", 1.0),
])
def test_numeric_match_reads_a_star_with_a_space_on_its_right_as_multiplication(said, truth, expected):
    # `3* 4` was read as 3: a `*` counted only with its operand right after it or spaces on its left
    assert numeric_match("q", f"<answer>{said}</answer>", answer=truth) == expected


@pytest.mark.parametrize("said, truth, expected", [
    ("3 + 4", "3", 0.0), ("3+4", "3", 0.0), ("3 -4", "3", 0.0), ("3 - 4", "3", 0.0), ("3-4", "3", 0.0),
    ("3 - -4", "3", 0.0), ("3 + (4)", "3", 0.0), ("3 - .5", "3", 0.0), ("1/2 + 1", "0.5", 0.0),
    (r"\frac12 - 1", "0.5", 0.0), ("1/2/3", "0.5", 0.0), (r"\frac{1}{2} / 3", "0.5", 0.0),
    # an operand that is a LaTeX command (a fraction, a root, a constant) makes an expression too
    (r"1 + \frac{1}{2}", "1", 0.0), (r"\frac{1}{2} + \frac{1}{3}", "0.5", 0.0), (r"3 - \sqrt{2}", "3", 0.0),
    (r"2 + \pi", "2", 0.0), (r"1/2 - \frac{1}{4}", "0.5", 0.0), (r"3 * \frac{1}{2}", "3", 0.0),
    (r"42 - \text{the total}", "42", 1.0),  # words typeset as text after a dash: prose, as `42 - the total`
    # as a `*`, a sign with no operand after it on its line is no expression: prose's dash, a list item
    ("-3", "-3", 1.0), ("3-", "3", 1.0), ("3 +", "3", 1.0), ("42 - that is my answer", "42", 1.0),
    ("42 -- done", "42", 1.0), ("3\n- 4 boxes", "3", 1.0), ("3 -\n4", "3", 1.0), ("42-fold", "42", 1.0),
])
def test_numeric_match_refuses_a_sum_or_difference(said, truth, expected):
    # `3 + 4` and `3 -4` were read as 3, `1/2/3` as 0.5: only `^`, `\times`, `\cdot`, `×` and `*` counted
    assert numeric_match("q", f"<answer>{said}</answer>", answer=truth) == expected


def test_numeric_match_compares_a_ground_truth_past_float_range_exactly():
    # As floats, 10**400 and "inf" were inf, and |x - inf| <= 1e-6 * inf held: every number scored 1.0.
    big = 10 ** 400
    assert numeric_match("q", "<answer>1</answer>", answer=str(big)) == 0.0
    assert numeric_match("q", f"<answer>{big}</answer>", answer=str(big)) == 1.0
    assert numeric_match("q", f"<answer>{big + 10 ** 380}</answer>", answer=str(big)) == 1.0  # 1e-20 off: in
    assert numeric_match("q", f"<answer>{big + 10 ** 395}</answer>", answer=str(big)) == 0.0  # 1e-5 off: out
    for truth in ("inf", "-inf", "nan", float("inf")):
        assert numeric_match("q", "<answer>5</answer>", answer=truth) == 0.0
    assert numeric_match("q", "<answer>1e999999999999999999999</answer>", answer="1") == 0.0  # past decimal's too


@pytest.mark.parametrize("minus", ["-", "\u2212", "\ufe63", "\uff0d"])  # ASCII, typeset, small, full-width
def test_numeric_match_reads_a_typeset_minus_as_a_sign(minus):
    assert numeric_match("q", f"<answer>{minus}7</answer>", answer="-7") == 1.0
    assert numeric_match("q", f"<answer>{minus}7</answer>", answer="7") == 0.0
    assert numeric_match("q", f"<answer>2e{minus}3</answer>", answer="0.002") == 1.0
    assert numeric_match("q", "<answer>-7</answer>", answer=f"{minus}7") == 1.0  # in the ground truth too


@pytest.mark.parametrize("truth", ["1/2", r"\frac{1}{2}", "$18", "Natalia sold 48/2 = 24 clips. #### 72", "",
                                   None, ["72"]])
def test_numeric_match_raises_on_a_ground_truth_that_is_not_a_number(truth):
    """A dataset whose answers need converting must show as errors (`rewards/<node>/errors`, logged each
    step), not score 0.0 on every sample as if the model were wrong."""
    with pytest.raises(ValueError, match="is not a number"):
        numeric_match("q", "<answer>72</answer>", answer=truth)
    with pytest.raises(ValueError, match="is not a number"):  # whatever the model wrote
        numeric_match("q", "no tag", answer=truth)


def test_numeric_match_tolerance_is_relative_as_math_isclose():
    # It was absolute below a ground truth of 1 (rel_tol * max(1, |truth|)): a wrong sign, or 0 for 5e-7, scored 1.0.
    assert numeric_match("q", "<answer>-0.004</answer>", answer="0.005", rel_tol=0.01) == 0.0
    assert numeric_match("q", "<answer>0</answer>", answer="0.0000005") == 0.0
    assert numeric_match("q", "<answer>0.00499</answer>", answer="0.005", rel_tol=0.01) == 1.0
    assert numeric_match("q", "<answer>101</answer>", answer="100", rel_tol=0.01) == 1.0  # of the larger, as isclose
    assert numeric_match("q", "<answer>102</answer>", answer="100", rel_tol=0.01) == 0.0
    assert numeric_match("q", "<answer>0</answer>", answer="0") == 1.0
    # abs_tol: a floor of the user's choosing, for ground truths near 0
    assert numeric_match("q", "<answer>-0.004</answer>", answer="0.005", rel_tol=0.01, abs_tol=0.01) == 1.0
    # the default rel_tol was 1e-6: a quickstart answer of ~4.7e8 (3 operands of 3 digits) off by 400 scored 1.0
    assert numeric_match("q", "<answer>470000400</answer>", answer="470000000") == 0.0
    assert numeric_match("q", "<answer>470000001</answer>", answer="470000000") == 0.0
    assert numeric_match("q", "<answer>470000000</answer>", answer="470000000") == 1.0
    assert numeric_match("q", "<answer>0.30000000000000004</answer>", answer="0.3") == 1.0  # float noise still counts
    assert numeric_match("q", "<answer>0.0001</answer>", answer="0", abs_tol=1e-3) == 1.0
    assert numeric_match("q", "<answer>0.0001</answer>", answer="0") == 0.0


def test_exact_match_ignores_case_and_space():
    assert exact_match("q", "<answer> Paris </answer>", answer="paris") == 1.0
    assert exact_match("q", "<answer>Lyon</answer>", answer="paris") == 0.0
    # runs of whitespace inside count as one space (only the ends were stripped)
    assert exact_match("q", "<answer>New  York</answer>", answer="new york") == 1.0
    assert exact_match("q", "<answer>new\n\tyork</answer>", answer=" New   York ") == 1.0
    assert exact_match("q", "<answer>newyork</answer>", answer="new york") == 0.0


def test_tool_call_format_comes_from_the_parsed_calls():
    assert tool_call_ok("q", "", turns=[turn(CALL, "ok"), turn("<answer>5</answer>")]) == 1.0
    assert tool_call_ok("q", "", turns=[turn("<tool_call>{not json}</tool_call>", "model_error")]) == 0.0
    # every call must be well formed, in every turn
    assert tool_call_ok("q", "", turns=[turn(CALL, "ok"), turn("<tool_call>[1]</tool_call>", "model_error")]) == 0.0
    assert tool_call_ok("q", "", turns=[turn("<answer>5</answer>")]) == 0.0
    assert called_tool("q", "", turns=[turn("<tool_call>{broken")]) == 1.0  # an unclosed call is an attempt
    assert called_tool("q", "", turns=[turn("<answer>5</answer>")]) == 0.0

def test_a_call_to_a_tool_the_servers_do_not_offer_is_not_well_formed():
    # A search model put its guess in the call's name ({"name": "Bronze", ...}): valid JSON, but no tool.
    guess = '<tool_call>\n{"name": "Bronze", "arguments": {"query": "alloy"}}\n</tool_call>'
    calls = parse_tool_calls(guess)
    unknown = Turn(text=guess, num_tokens=9, calls=calls,
                   results=[ToolResult(tool="Bronze", text="Error: unknown tool 'Bronze'.", status="model_error",
                                       error_kind="unknown_tool")])
    assert tool_call_ok("q", "", turns=[unknown, turn("<answer>Bronze</answer>")]) == 0.0
    assert tool_call_ok("q", "", turns=[turn(CALL, "ok"), unknown]) == 0.0
    # a call the rollout did not run (the last turn's) has no result: the spec's tool names decide
    assert tool_call_ok("q", "", turns=[turn(guess)]) == 1.0
    assert tool_call_ok("q", "", turns=[turn(guess)], tools=["calculate"]) == 0.0
    assert tool_call_ok("q", "", turns=[turn(CALL, "ok"), turn(CALL)], tools=["calculate"]) == 1.0
    assert called_tool("q", "", turns=[unknown]) == 1.0  # still an attempt


def test_tools_succeeded_reads_result_status():
    assert tools_succeeded("q", "", turns=[turn(CALL + CALL, "ok", "infra_error"), turn("done")]) == 0.5
    assert tools_succeeded("q", "", turns=[turn("<answer>5</answer>")]) is None


def test_reference_chain_is_the_value_of_each_operation_in_the_order_it_is_computed():
    from factory.rewards.chain import chain_step, reference_chain
    from factory.types import ToolCall

    assert reference_chain("7 + 12 - 5 + 33") == [19, 14, 47]
    assert reference_chain("2 + 3 * 4") == [12, 14]  # 3 * 4 first: 2 + 3 = 5 is no step of it
    assert reference_chain("12 + 34 * 5") == [170, 182]
    assert reference_chain("8") == []

    def call(value):
        return Turn(text="<tool_call>", num_tokens=1, calls=[ToolCall("calculate", {}, "")],
                    results=[ToolResult(tool="calculate", text=value, status="ok")])

    row = {"expression": "12 + 34 * 5", "answer": "182"}
    right, precedence_error = [call("170"), call("182")], [call("46"), call("182")]
    assert chain_step("q", "", right[0], 0, turns=right, **row) == 1.0
    assert chain_step("q", "", precedence_error[0], 0, turns=precedence_error, **row) == 0.0


def test_chain_steps_columns_are_required_of_the_data(monkeypatch):
    """A dataset without `expression` must be refused before step 1 (the data stage checks every row for the
    columns reward functions cannot do without), not score every tool-calling turn 0."""
    import factory
    from factory.reward.graph import required_columns

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    needed = required_columns(factory.load("specs/arith-chain.yaml"))
    assert needed["expression"] == "rewards.step" and "answer" in needed


def test_chain_step_checks_each_turn_on_its_own():
    from factory.rewards.chain import chain_step
    from factory.types import ToolCall

    def call(*results, status="ok"):
        return Turn(text="<tool_call>", num_tokens=1, calls=[ToolCall("calculate", {}, "") for _ in results],
                    results=[ToolResult(tool="calc", text=r, status=status) for r in results])

    row = {"expression": "7 + 12 - 5", "answer": "14"}
    step1, whole, wrong, answer = call("19"), call("14"), call("20"), Turn(text="<answer>14</answer>", num_tokens=1)
    turns = [step1, whole, answer]

    def score(k, ts=turns):
        return chain_step("q", ts[k].text, ts[k], k, turns=ts, **row)

    assert [score(0), score(1), score(2)] == [1.0, 1.0, 1.0]  # 19, then 14 (new), then the right answer
    assert score(1, [step1, call("19"), answer]) == 0.0  # repeating a value already reached earns nothing
    assert score(0, [wrong, answer]) == 0.0  # 20 is not on the chain
    assert score(0, [call("19", status="model_error"), answer]) == 0.0  # a failed call is no step
    assert score(0, [Turn(text="", num_tokens=1, calls=step1.calls), answer]) == 0.0  # calls never run
    assert score(1, [step1, Turn(text="<answer>15</answer>", num_tokens=1)]) == 0.0  # a wrong answer
    assert score(0, [call("19", "14"), answer]) == 1.0  # two right steps at once


@pytest.mark.parametrize("fn", ["factory.rewards.math:numeric_match", "factory.rewards.math:exact_match",
                                "factory.rewards.qa:exact_match", "factory.rewards.qa:f1",
                                "factory.rewards.qa:near_miss"])
def test_the_builtin_answer_checkers_require_the_answer_column(fn, project):
    """Data without the ground-truth column is refused before step 1 (the data stage checks every row), not
    scored 0 on every sample by a default `answer=""`."""
    from factory.compiler.load import load_spec
    from factory.reward.graph import required_columns

    spec = load_spec(project.spec(f"""\
        name: x
        model: {{path: "factory:tiny-qwen3"}}
        data: {{train: {{generator: factory.data:arithmetic}}, answer_key: gold}}
        rewards: {{r: {{fn: "{fn}"}}}}
        """))
    assert required_columns(spec) == {"gold": "rewards.r"}
