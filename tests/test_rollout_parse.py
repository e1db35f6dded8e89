"""Tool-call parsing in the Hermes/Qwen `<tool_call>{json}</tool_call>` format."""
from factory.rollout.parse import parse_tool_calls
from factory.types import ToolCall


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
