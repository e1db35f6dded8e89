from rewards.format import called_tool, tool_call_ok
from rewards.math import exact_match, extract_answer, numeric_match

CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2 + 3"}}\n</tool_call>'


def test_answer_is_read_from_the_model_text_only():
    # A number inside a tool response must not count as the model's answer.
    completion = f"{CALL}<tool_response>\n<answer>5</answer>\n</tool_response>no answer"
    assert extract_answer(completion) is None
    assert extract_answer(f"{CALL}<tool_response>5</tool_response><answer> 5 </answer>") == "5"


def test_numeric_match():
    assert numeric_match("q", "<answer>1,234</answer>", answer="1234") == 1.0
    assert numeric_match("q", "<answer>the result is -7.0</answer>", answer="-7") == 1.0
    assert numeric_match("q", "<answer>8</answer>", answer="7") == 0.0
    assert numeric_match("q", "7", answer="7") == 0.0  # no tag, no credit
    assert numeric_match("q", "<answer>x</answer>", answer="7") == 0.0


def test_exact_match_ignores_case_and_space():
    assert exact_match("q", "<answer> Paris </answer>", answer="paris") == 1.0
    assert exact_match("q", "<answer>Lyon</answer>", answer="paris") == 0.0


def test_tool_call_format():
    assert tool_call_ok("q", CALL) == 1.0
    assert tool_call_ok("q", "<tool_call>{not json}</tool_call>") == 0.0
    assert tool_call_ok("q", CALL + "<tool_call>[1]</tool_call>") == 0.0  # every call must be well formed
    assert tool_call_ok("q", "<answer>5</answer>") == 0.0
    assert called_tool("q", "<tool_call>{broken") == 1.0
    assert called_tool("q", "<tool_response><tool_call></tool_response>") == 0.0
