"""Tool-call parsing in the Hermes/Qwen `<tool_call>{json}</tool_call>` format."""
from factory.rollout.parse import NEVER_CLOSED, parse_tool_calls
from factory.types import ToolCall
from factory.util import without_reasoning


def test_one_good_call():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    assert parse_tool_calls(text) == [
        ToolCall(name="add", arguments={"a": 2, "b": 3}, raw='\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n')
    ]


def test_several_calls_in_order():
    text = ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> and '
            '<tool_call>\n{"name": "mul", "arguments": {"b": [1, 2]}}\n</tool_call>')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.parse_error) for c in calls] == [
        ("add", {"a": 1}, None), ("mul", {"b": [1, 2]}, None)]


def test_no_call():
    assert parse_tool_calls("The answer is <answer>5</answer>.") == []
    assert parse_tool_calls("") == []


def test_malformed_json_keeps_best_effort_name_and_error():
    (call,) = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 2,}}</tool_call>')
    assert call.name == "add" and call.arguments is None
    assert call.parse_error.startswith("invalid JSON: ")
    (call,) = parse_tool_calls("<tool_call>add(2, 3)</tool_call>")
    assert call.name == "?" and call.arguments is None and call.raw == "add(2, 3)"


def test_arguments_given_as_json_string():
    (call,) = parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 2}"}</tool_call>')
    assert (call.name, call.arguments, call.parse_error) == ("add", {"a": 2}, None)
    (call,) = parse_tool_calls('<tool_call>{"name": "add", "arguments": "a=2"}</tool_call>')
    assert call.name == "add" and call.arguments is None and '"arguments" string is not JSON' in call.parse_error


def test_missing_arguments_means_none_given_but_wrong_types_are_errors():
    (call,) = parse_tool_calls('<tool_call>{"name": "now"}</tool_call>')
    assert (call.arguments, call.parse_error) == ({}, None)
    (call,) = parse_tool_calls('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>')
    assert call.arguments is None and "must be a JSON object, got list" in call.parse_error
    (call,) = parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')
    assert call.name == "?" and 'missing "name"' in call.parse_error
    (call,) = parse_tool_calls("<tool_call>[1]</tool_call>")
    assert "expected a JSON object, got list" in call.parse_error


def test_unclosed_call_at_the_end_is_malformed():
    text = ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n'
            '<tool_call>\n{"name": "mul", "arguments": {"a"')
    good, bad = parse_tool_calls(text)
    assert good.arguments == {"a": 1}
    assert bad.name == "mul" and bad.arguments is None and bad.parse_error.startswith("unclosed <tool_call>")
    assert bad.raw == '\n{"name": "mul", "arguments": {"a"'


def test_unclosed_call_before_a_closed_one_is_malformed():
    """A block holds no opening marker, so the closed block's match began at the second marker: the first
    call was dropped without a result or an error."""
    text = '<tool_call>{"name": "a", "arguments": {"x": 1}}\n<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    bad, good = parse_tool_calls(text)
    assert bad.name == "a" and bad.arguments is None and bad.parse_error.startswith("unclosed <tool_call>")
    assert bad.raw == '{"name": "a", "arguments": {"x": 1}}\n'
    assert (good.name, good.arguments, good.parse_error) == ("b", {}, None)
    # the marker in prose, with no `{` after it, is still no call
    assert [c.name for c in parse_tool_calls("I will use <tool_call> blocks.\n" + text)] == ["a", "b"]


def test_calls_written_while_thinking_are_not_made():
    """Qwen3's `<think>` may mention or draft a call: the regex took a mention's `<tool_call>` up to the real
    call's closing marker, so the real call became one "invalid JSON" call; a drafted call ran beside the
    real one; a mention alone made the turn a malformed call instead of an answer."""
    real = '<tool_call>\n{"name": "search", "arguments": {"query": "capital of France"}}\n</tool_call>'
    mention = "<think>\nI should emit a <tool_call> block with a short query.\n</think>\n\n"
    assert [(c.name, c.arguments) for c in parse_tool_calls(mention + real)] == [
        ("search", {"query": "capital of France"})]
    drafted = '<think>maybe <tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call></think>'
    assert [c.arguments for c in parse_tool_calls(drafted + real)] == [{"query": "capital of France"}]
    assert parse_tool_calls("<think>\nI should not use <tool_call> here\n</think>\n\n<answer>5</answer>") == []
    assert parse_tool_calls("<think>cut while thinking, <tool_call>{") == []  # a block left open
    # R1's template opened it in the prompt: the agent loop writes that `<think>` at the start of the turn's text
    assert len(parse_tool_calls("<think>R1's template opened it. <tool_call>{}</tool_call></think>" + real)) == 1
    # outside reasoning, a stray marker in prose does not swallow the call after it
    assert [c.arguments for c in parse_tool_calls("I use <tool_call> now: " + real)] == [{"query": "capital of France"}]


def test_a_closing_think_in_an_argument_drops_no_call():
    """without_reasoning took a `</think>` with none before it for the end of reasoning the prompt opened, and
    dropped all before it: here both calls (the agent loop writes that `<think>` into the text itself)."""
    first = '<tool_call>{"name": "echo", "arguments": {"s": "x"}}</tool_call>'
    second = '<tool_call>{"name": "echo", "arguments": {"s": "close with </think>"}}</tool_call>'
    calls = parse_tool_calls(f"ok {first} {second}", opened_before=False)  # as the agent loop reads a turn
    assert [(c.arguments, c.parse_error) for c in calls] == [({"s": "x"}, None), ({"s": "close with </think>"}, None)]
    # a completion as a reward reads it (its prompt may have opened the reasoning): before `</think>`, reasoning
    assert parse_tool_calls(f"drafting {first}</think> answer") == []


def test_an_opening_think_in_an_argument_opens_no_reasoning():
    """without_reasoning took a `<think>` quoted in a call's argument for reasoning left open and cut the rest
    of the turn: the call became an unclosed one, and a reward lost the answer after it."""
    call = '<tool_call>{"name": "search", "arguments": {"query": "what does <think> mean in Qwen3"}}</tool_call>'
    calls = parse_tool_calls(f"{call}\n{call}", opened_before=False)
    assert [(c.arguments, c.parse_error) for c in calls] == [({"query": "what does <think> mean in Qwen3"}, None)] * 2
    assert without_reasoning(f"{call} <answer>tags</answer>").endswith("<answer>tags</answer>")
    # reasoning before and after the call is still reasoning, and a call drafted inside it is still no call
    text = f"<think>first {call}</think>{call}<think>then</think> done"
    assert without_reasoning(text) == f"{call} done"
    assert len(parse_tool_calls(text)) == 1
    # a block whose JSON does not read is no shelter: its `<think>` opens reasoning, as before
    assert without_reasoning('<tool_call>{"name": "s", <think> x</tool_call> y') == '<tool_call>{"name": "s", '
    # nor is the first marker the only one looked at: prose or a broken block before the call
    for before in ("Use <tool_call> like so. ", '<tool_call>{"name": "s"} junk</tool_call>'):
        assert without_reasoning(f"{before}{call} <answer>7</answer>") == f"{before}{call} <answer>7</answer>"
    # inside reasoning the prompt opened (R1's), a quoted `<think>` is no opener: the drafted call is dropped
    r1 = f'draft <answer>4</answer> {call}</think><answer>5</answer>'
    assert without_reasoning(r1) == "<answer>5</answer>" and parse_tool_calls(r1) == []
    # a call longer than the first window its JSON is read in (4096 characters) is still read whole
    long = call.replace("what does", "x" * 9000)
    assert parse_tool_calls(long + " <think>a</think>", opened_before=False)[0].arguments["query"].startswith("xxx")
    # a call that reads but stopped before its closing marker is an unclosed call, not reasoning
    cut = '<tool_call>{"name": "search", "arguments": {"query": "<think>"}}\n'
    assert without_reasoning(cut) == cut
    assert parse_tool_calls(cut, opened_before=False)[0].parse_error.startswith("unclosed <tool_call>")


def test_markers_inside_an_arguments_string_do_not_end_the_call():
    """The block ended at the first `</tool_call>`, one inside an argument too: the call was "invalid JSON"."""
    second = '<tool_call>{"name": "echo", "arguments": {"s": "d"}}</tool_call>'
    text = '<tool_call>{"name": "echo", "arguments": {"s": "a </tool_call> b <tool_call> c"}}</tool_call>\n' + second
    calls = parse_tool_calls(text)
    assert [(c.arguments, c.parse_error) for c in calls] == [({"s": "a </tool_call> b <tool_call> c"}, None),
                                                             ({"s": "d"}, None)]
    assert calls[0].raw == '{"name": "echo", "arguments": {"s": "a </tool_call> b <tool_call> c"}}'
    # JSON that does not read still ends at the first closing marker
    bad, good = parse_tool_calls('<tool_call>{"name": "echo", "arguments": {"s": 1,}}</tool_call>' + second)
    assert bad.parse_error.startswith("invalid JSON") and good.arguments == {"s": "d"}


def test_llama_style_parameters_are_the_arguments():
    """`{"name": "a", "parameters": {...}}` ran with no arguments and no parse error (tool_call_ok credited it)."""
    (call,) = parse_tool_calls('<tool_call>{"name": "add", "parameters": {"a": 1}}</tool_call>')
    assert (call.arguments, call.parse_error) == ({"a": 1}, None)


def test_an_empty_arguments_string_is_no_arguments_and_an_empty_name_no_name():
    """OpenAI's wire format gives a tool without parameters `"arguments": ""`: that is `{}`, not a JSON error the
    model is told about. A name of "" names no tool: a malformed call (a reward crediting well-formed calls
    must not count it)."""
    (call,) = parse_tool_calls('<tool_call>{"name": "now", "arguments": ""}</tool_call>')
    assert (call.name, call.arguments, call.parse_error) == ("now", {}, None)
    (call,) = parse_tool_calls('<tool_call>{"name": "", "arguments": {}}</tool_call>')
    assert call.arguments is None and 'missing "name"' in call.parse_error


def test_each_unclosed_call_before_a_closed_one_has_its_own_text():
    # two calls never closed, then a closed one: each unclosed call's raw runs to the next marker only
    text = ('<tool_call>{"name": "a", "arguments": {}}\n<tool_call>{"name": "b", "arguments": {}}\n'
            '<tool_call>{"name": "c", "arguments": {}}</tool_call>')
    a, b, c = parse_tool_calls(text)
    assert (a.name, a.raw) == ("a", '{"name": "a", "arguments": {}}\n')
    assert (b.name, b.raw, b.parse_error.startswith("unclosed")) == ("b", '{"name": "b", "arguments": {}}\n', True)
    assert (c.name, c.arguments) == ("c", {})



def test_unclosed_calls_after_the_last_closed_one_are_read_as_between_blocks():
    # two calls never closed at the end of a turn were one malformed call (named "a", its raw text holding both)
    # where the same two before a closed block are two; a marker cut off at the end is still one call
    text = 'ok <tool_call>{"name": "a", "arguments": {}}\n<tool_call>{"name": "b", "arguments": {"x": 1'
    a, b = parse_tool_calls(text)
    assert (a.name, a.raw) == ("a", '{"name": "a", "arguments": {}}\n')
    assert (b.name, b.raw) == ("b", '{"name": "b", "arguments": {"x": 1')
    assert a.parse_error == b.parse_error == "unclosed <tool_call>: no </tool_call> after it"
    (cut,) = parse_tool_calls('I will call <tool_call> now\n<tool_call>')  # no JSON after either: the first
    assert (cut.name, cut.raw, cut.arguments) == ("?", " now\n<tool_call>", None)


def test_an_integer_past_pythons_digit_limit_is_a_malformed_call_not_an_exception():
    """Since Python 3.11 json raises a plain ValueError (not JSONDecodeError) on an integer of more than 4300
    digits, a degenerate `1111...` loop in an argument: it came out of the parser and failed the rollout."""
    big = "1" * 4301
    closed = '<tool_call>\n{"name": "add", "arguments": {"a": ' + big + '}}\n</tool_call>'
    (call,) = parse_tool_calls(closed, opened_before=False)
    assert call.name == "add" and call.arguments is None
    assert call.parse_error.startswith("invalid JSON: Exceeds the limit (4300 digits)")
    (call,) = parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": ' + big + '}"}</tool_call>')
    assert call.name == "add" and call.parse_error.startswith('"arguments" string is not JSON: Exceeds the limit')
    (call,) = parse_tool_calls(closed[:-len("</tool_call>")], opened_before=False)  # cut before its closing marker
    assert call.parse_error == NEVER_CLOSED
    # reasoning is still found after such a call
    assert without_reasoning(closed + "<think>x</think> done") == closed + " done"


def test_a_call_cut_inside_an_argument_that_quotes_the_markers_is_one_never_closed_call():
    """A turn cut inside a call whose argument quotes `<tool_call>{...` read as two unclosed calls (the agent loop
    drops only the last, so the first -- the same cut call -- was answered as the model's malformed call); one
    quoting a whole block read that quoted block as a closed "invalid JSON" call."""
    head = '<tool_call>\n{"name": "write_file", "arguments": {"text": "A call looks like '
    for quoted in ('<tool_call>{\\"name\\": \\"add', '<tool_call>{\\"name\\": \\"add\\"}</tool_call> and',
                   '<tool_call> caf\\u00'):  # (cut inside a `\uXXXX` escape)
        (call,) = parse_tool_calls(head + quoted, opened_before=False, cut=True)
        assert (call.name, call.parse_error, call.raw) == ("write_file", NEVER_CLOSED, (head + quoted)[11:])
    # a string the model left open in a call it closed, before a later call, still ends at the first closing marker
    bad, good = parse_tool_calls('<tool_call>{"name": "a", "arguments": {"x": "oops}}</tool_call>\n'
                                 '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert bad.parse_error.startswith("invalid JSON: ") and (good.name, good.arguments) == ("b", {})


def test_a_call_cut_before_its_closing_marker_whose_argument_quotes_it_is_never_closed():
    """The object read whole but the turn stopped before its closing marker: the `</tool_call>` quoted in an
    argument ended a "closed" block whose JSON was then invalid -- the model's error, not the limit's cut."""
    text = '<tool_call>\n{"name": "write_file", "arguments": {"text": "end a call with </tool_call>"}}\n'
    (call,) = parse_tool_calls(text, opened_before=False)
    assert (call.name, call.parse_error, call.raw) == ("write_file", NEVER_CLOSED, text[11:])
    # with text between the object and a closing marker, the model closed the call: its error, to that marker
    text = '<tool_call>{"name": "w", "arguments": {"t": "</tool_call>"}} oops</tool_call>'
    (call,) = parse_tool_calls(text)
    assert call.parse_error.startswith("invalid JSON: Extra data") and call.raw == text[11:-12]


def test_a_finished_call_left_with_an_open_string_is_invalid_json_and_only_a_cut_one_never_closed():
    """A turn that ends inside a call's string was read as cut by the token limit whether it was or not: a model that
    left out a quote, closed the call and stopped was told "no </tool_call> after it" (there is one), not that its
    JSON is invalid. Only the caller knows whether the turn was cut."""
    text = '<tool_call>{"name": "a", "arguments": {"x": "1}}</tool_call>'
    (call,) = parse_tool_calls(text, opened_before=False)
    assert (call.name, call.raw) == ("a", text[11:-12])
    assert call.parse_error.startswith("invalid JSON: Unterminated string")
    (call,) = parse_tool_calls(text, opened_before=False, cut=True)
    assert (call.name, call.parse_error, call.raw) == ("a", NEVER_CLOSED, text[11:])
    (call,) = parse_tool_calls(text + "<think>x", opened_before=False, cut=True)  # quoted in the cut string
    assert call.raw == text[11:] + "<think>x"
    # a reward reads a finished completion: a `<think>` after the open quote is reasoning, as before
    assert without_reasoning(text + "<think>x</think> done") == text + " done"
