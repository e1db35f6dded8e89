"""The chat format: prompts and tool-response deltas as token ids, rendered by a HF jinja chat template.

A trajectory's ids are a concatenation: prompt ids, then for every turn the model's own ids followed by
the ids of whatever the template puts between that turn and the next (tool responses, role headers, the
generation prompt). The model's text is never re-tokenized; only template and tool text is tokenized,
and always starting right after a special token (the end-of-turn token), so the pieces tokenize exactly
as the whole conversation does under `tokenizer.apply_chat_template` -- but for the control tokens' text in a
tool's answer, which is tokenized as plain text (`ChatFormat.defused`).
"""
from __future__ import annotations

import re
from typing import Any, NamedTuple

import jinja2
import jinja2.meta

from factory.types import ToolResult
from factory.util import THINK_CLOSE, THINK_OPEN, template_env

# Stands in for the model's text when rendering; the template must copy it verbatim (every template we
# know does: the assistant content is output as is).
_SENTINEL = "FACTORY-MODEL-TURN-7f3a9c"
_PROBE_USER = "FACTORY-PROBE-QUERY"
WORD_JOINER = "\u2060"  # invisible, and in no tokenizer's added tokens: what `ChatFormat.defused` breaks them with


def named_template(templates: dict[str, str], tools: bool) -> str:
    """Of a tokenizer's named chat templates (`tokenizer.chat_template` a dict: Hermes 2 Pro's and Command R's
    `default` and `tool_use`), the one `apply_chat_template` renders (`tokenizer.get_chat_template`): `tool_use`
    when the prompts list tools, else `default`."""
    if tools and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    raise ValueError(f"the tokenizer has several chat templates ({', '.join(sorted(templates))}) and none is named "
                     f"`default`{'' if tools else ' (without tools)'}; set `chat_template` in the spec")


def template_variables(template: str) -> set[str] | None:
    """The names a chat template reads from its render's arguments (jinja2.meta), or None for a template that
    does not parse. (One that includes another cannot render here: no loader; factory check refuses it.)"""
    try:
        return jinja2.meta.find_undeclared_variables(template_env("chat").parse(template))
    except jinja2.TemplateSyntaxError:
        return None


def compile_template(template: str) -> jinja2.Template:
    """Compile a chat template the way transformers does, so the output is byte-identical to
    `tokenizer.apply_chat_template` (the chat kind of factory.util.template_env)."""
    return template_env("chat").from_string(template)


class ChatFormat:
    """Renders prompts and tool-response deltas with a HF jinja chat template, identical to
    tokenizer.apply_chat_template.

    `template=None` uses the tokenizer's own; of its named templates, the one `apply_chat_template` picks for
    prompts with `tools` or without (`named_template`), chosen once so that prompts and tool deltas render with the
    same. `template_kwargs` are passed to every render (for example `{"enable_thinking": False}` for Qwen3).
    """

    def __init__(self, tokenizer: Any, template: str | None = None, template_kwargs: dict[str, Any] | None = None,
                 *, tools: bool = False):
        template = template if template is not None else tokenizer.chat_template
        if isinstance(template, dict):
            template = named_template(template, tools)
        if not template:
            raise ValueError("the tokenizer has no chat template; set `chat_template` in the spec")
        self.tokenizer = tokenizer
        self.template_text = template
        self._template = compile_template(template)
        # transformers passes the special tokens (bos_token, eos_token, ...) to the template; so do we.
        self._kwargs = {**tokenizer.special_tokens_map, **(template_kwargs or {})}
        self.end_of_turn_text, self.end_of_turn_id = self._find_end_of_turn()
        # the text of the token a model's turn ends on, which a tool delta is tokenized after (tool_delta_ids)
        self._end_token = "" if self.end_of_turn_id is None else tokenizer.convert_ids_to_tokens(self.end_of_turn_id)
        # The tokenizer's added tokens (`<|im_end|>`, `<tool_call>`, `<think>`, ...), longest first: in a tool's
        # answer each is defused (`defused`), so a web page cannot end a turn or open a call.
        marks = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
        marks |= set(tokenizer.all_special_tokens)
        # markup only: some tokenizers add plain text as tokens (runs of spaces for code), which is no control token
        marks = sorted((m for m in marks if len(m) > 1 and any(not (c.isalnum() or c.isspace()) for c in m)),
                       key=len, reverse=True)
        self._marks = re.compile("|".join(map(re.escape, marks))) if marks else None
        # `<think>` where the generation prompt opens a reasoning block the model then writes in (R1's
        # templates): the turn's text starts inside it. "" otherwise (Qwen3 lets the model open it).
        prompt = self.render([{"role": "user", "content": _PROBE_USER}], add_generation_prompt=True).rstrip()
        self.reasoning_opened = THINK_OPEN if prompt.endswith(THINK_OPEN) else ""

    # ------------------------------------------------------------------------------------- rendering
    def render(self, messages: list[dict], tools: list[dict] | None = None, *, add_generation_prompt: bool) -> str:
        """The template's text for a conversation (what apply_chat_template(tokenize=False) returns)."""
        return self._template.render(messages=messages, tools=tools or None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self._kwargs)

    def encode(self, text: str) -> list[int]:
        """Template text to ids, adding no BOS/EOS (the template writes its own special tokens)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """Ids to text, special tokens kept (they delimit turns; rewards and logs may want them), spaces
        left alone (the cleanup would rewrite " ," inside a call's JSON strings)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The prompt, ending with the generation prompt (e.g. `<|im_start|>assistant\\n`)."""
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def tool_delta_ids(self, results: list[ToolResult], turn_ended_with_eos: bool) -> list[int]:
        """The ids to append after a model turn that made calls: the end-of-turn token when the model
        did not write it, whatever the template puts after it, the tool messages and the next
        generation prompt.

        Found by rendering a probe conversation whose assistant turn is a sentinel, with the tool
        messages and a generation prompt, and keeping only what follows the sentinel: template and tool
        text, never the model's. (Diffing against a render without the tool messages would also work for
        the tail, but templates like Qwen3's render the *last* assistant turn differently, so we anchor on
        the sentinel instead of a common prefix.)
        """
        messages = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _SENTINEL}]
        messages += [{"role": "tool", "name": r.tool, "content": self.defused(r.text)} for r in results]
        text = self.render(messages, add_generation_prompt=True)
        # (`factory check` refuses such a template with tools, but cannot read a tokenizer not yet on disk)
        if _SENTINEL not in text:
            raise ValueError("the chat template renders no assistant message, so a tool's answer cannot follow the "
                             "model's turn; use a template that renders every role (prompts/chatml_tools.jinja)")
        tail = text[text.index(_SENTINEL) + len(_SENTINEL):]
        if turn_ended_with_eos:
            if not tail.startswith(self.end_of_turn_text):
                raise ValueError(f"the template does not close an assistant turn with {self.end_of_turn_text!r}")
            tail = tail[len(self.end_of_turn_text):]
            # tokenized after the token the model ended on, as in the whole conversation: alone, a SentencePiece
            # tokenizer (Metaspace, prepend_scheme "first": Llama 2's, Mistral's) starts it with a "▁" it has not
            if self._end_token:
                ids = self.encode(self._end_token + tail)
                if ids[:1] == [self.end_of_turn_id]:
                    return ids[1:]
        return self.encode(tail)

    def defused(self, text: str) -> str:
        """A tool's answer as the model reads it: each added token's text in it (`<|im_end|>`, `<tool_call>`)
        broken by a word joiner after its first character, so it tokenizes as plain text. Tokenized as is, as
        `apply_chat_template` would, a web page holding `<|im_end|><|im_start|>assistant` would be the very control
        tokens that end a turn and start the model's, and `<tool_call>` the model's own call marker. The
        answer's text (rewards, the recording, the cache) is unchanged."""
        for _ in range(8):  # again while one remains: breaking one may leave another across it ("abc", "ab" "bc")
            if self._marks is None or not self._marks.search(text):
                return text
            text = self._marks.sub(lambda m: m[0][0] + WORD_JOINER + m[0][1:], text)
        return text

    @property
    def stop_token_ids(self) -> list[int]:
        """Tokens that end a model turn: the tokenizer's eos and the template's end-of-turn token."""
        ids = {self.end_of_turn_id, self.tokenizer.eos_token_id}
        return sorted(i for i in ids if i is not None)

    def end_of_turn_problem(self) -> str | None:
        """Why the model cannot end its turns as the template closes them, or None: the template closes an
        assistant turn with text that is not one special token of this tokenizer (a ChatML template on a
        tokenizer without `<|im_end|>`, say), so the model stops on its eos and the context after each turn
        holds the eos and then that text, which the template never renders."""
        if self.end_of_turn_text:
            return None
        tail = (self._after_model_turn() or "").strip()
        if not tail or tail.startswith(self.tokenizer.eos_token or "\0"):  # (Llama 2's `' ' + eos`: the eos it is)
            return None
        return (f"the chat template closes an assistant turn with {tail[:30]!r}, which is not one special token "
                f"of the tokenizer: the model stops on its eos instead, and each turn's context holds the eos and "
                f"then that text; use a template whose turn markers are the tokenizer's own special tokens")

    # -------------------------------------------------------------------------------------- internals
    def _after_model_turn(self) -> str | None:
        """What the template writes after an assistant message's content, or None where it renders none: a
        single-turn template (a base model's `Question: ...\\nAnswer:`), whose one turn is sampled and kept as is,
        never rendered, and ends on the eos (with tools and more turns `factory check` refuses such a template)."""
        messages = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _SENTINEL}]
        text = self.render(messages, add_generation_prompt=False)
        return text[text.index(_SENTINEL) + len(_SENTINEL):] if _SENTINEL in text else None

    def _find_end_of_turn(self) -> tuple[str, int | None]:
        """The special token the template writes right after an assistant's content (`<|im_end|>` for
        ChatML), which is what the model emits to end its turn. Falls back to the tokenizer's eos when
        the template closes turns with plain text; its text is then what the template writes up to and with
        the eos (Llama 2's `' ' + eos_token`: the eos the model stops on stands for all of it), or "" when the
        template writes no eos there (or renders no assistant message: _after_model_turn)."""
        tail = self._after_model_turn() or ""
        ids = self.encode(tail)
        special = set(self.tokenizer.all_special_ids) | set(getattr(self.tokenizer, "added_tokens_decoder", {}))
        if ids and ids[0] in special:
            token = self.tokenizer.convert_ids_to_tokens(ids[0])
            if tail.startswith(token):
                return token, ids[0]
        # The model still stops on eos; the text the template writes after a turn is then appended whole, but
        # for an eos it writes first, after spaces at most: that one the model wrote.
        eos = self.tokenizer.eos_token or ""
        spaces = len(tail) - len(tail.lstrip())
        return (tail[:spaces + len(eos)] if eos and tail[spaces:].startswith(eos) else ""), self.tokenizer.eos_token_id


# ----------------------------------------------------------------------------- prefix preservation
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "probe", "description": "A probe tool.",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]


def _probe_call(x: int) -> str:
    return '<tool_call>\n{"name": "probe", "arguments": {"x": %d}}\n</tool_call>' % x


# A conversation shaped as the multi-turn loop makes it: the model's turns are its text (tool calls
# written as text, no structured tool_calls), tool results are `tool` messages, several in one round.
_PROBE_CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "FACTORY-PROBE-SYSTEM"},
    {"role": "user", "content": _PROBE_USER},
    {"role": "assistant", "content": _probe_call(1) + "\n" + _probe_call(2)},
    {"role": "tool", "name": "probe", "content": "FACTORY-PROBE-RESULT-1"},
    {"role": "tool", "name": "probe", "content": "FACTORY-PROBE-RESULT-2"},
    {"role": "assistant", "content": _probe_call(3)},
    {"role": "tool", "name": "probe", "content": "FACTORY-PROBE-RESULT-3"},
    {"role": "assistant", "content": "FACTORY-PROBE-ANSWER"},
]


_EMPTY_REASONING = re.compile(re.escape(THINK_OPEN) + r"\s*" + re.escape(THINK_CLOSE) + r"\s*")


def _excerpt(text: str, at: int) -> str:
    return repr(text[max(0, at - 40): at + 40])


class RenderProblem(NamedTuple):
    """What a chat template leaves out, as a sentence; `fatal` where no run could train with it."""
    sentence: str
    fatal: bool = False


# What the model would never see when a template renders no message of a role.
_UNSEEN = {"user": "the question", "tool": "what its tools answered"}


def _listed(words: list[str], last: str) -> str:
    return ", ".join(words[:-1]) + f" {last} " + words[-1] if len(words) > 1 else words[0]


def render_problems(template: str, special_tokens: dict[str, str] | None = None,
                    template_kwargs: dict[str, Any] | None = None, *, tools: bool = True, turns: bool = True,
                    system: bool = True, few_shot: bool = False) -> list[RenderProblem]:
    """What a chat template leaves out of a prompt (with `tools`: one with tools; with `turns` too: of a rollout
    of more than one turn; with `system`: one that may hold a system message; with `few_shot`: one that may hold
    assistant messages). Fatal, and first: a role whose messages it never renders that the rollout renders, the
    user's (a loop over a misspelt `messages` renders nothing, an undefined name being empty, and the prompt is
    the generation prompt alone), and with tools and turns the tool results' and the model's (the text appended
    after a model's turn is what the template renders after one: ChatFormat.tool_delta_ids). Elsewhere a model's
    turn is kept as sampled, never rendered, so a template without assistant messages (a base model's
    `Question: ...\\nAnswer:`) is sound, but for few-shot answers it would drop (a warning). Warnings too: the
    tool list (a template written for chat alone renders `messages` and ignores `tools`, so the model is never
    told which tools exist or how to call them) and the system message (data.system_prompt would never reach the
    model). Text only, as prefix_problem; jinja errors propagate, but for the whole conversation's (prefix_problem
    says why that does not render)."""
    render = compile_template(template)
    kwargs = {**(special_tokens or {}), **(template_kwargs or {})}
    turns = turns and tools
    messages = _PROBE_CONVERSATION[:2] if system else _PROBE_CONVERSATION[1:2]  # (the system message,) the user's
    text = render.render(messages=messages, tools=_PROBE_TOOLS if tools else None, documents=None,
                         add_generation_prompt=True, **kwargs)
    later = _PROBE_CONVERSATION[2:] if tools else _PROBE_CONVERSATION[-1:]  # the model's turns (and tool results)
    try:
        whole = render.render(messages=messages + later, tools=_PROBE_TOOLS if tools else None, documents=None,
                              add_generation_prompt=False, **kwargs)
    except jinja2.TemplateError:
        whole = None
    rendered = {"user"} if _PROBE_USER in text else set()
    rendered |= {m["role"] for m in later if whole is None or m["content"] in whole}
    dropped = [role for role in ("user", "assistant", "tool") if role not in rendered and (role == "user" or turns)]
    out = []
    if dropped:
        unseen = [_UNSEEN[role] for role in dropped if role in _UNSEEN]
        said = [f"the model would never see {_listed(unseen, 'nor')}"] if unseen else []
        if "assistant" in dropped:
            said.append("the rollout, which appends to a model's turn what the template renders after one (the tool "
                        "results, the next generation prompt), could not find that")
        hint = (" (a name the template misspells renders as nothing: `mesages` for `messages`, say)"
                if "user" in dropped else "; use a template that renders every role (prompts/chatml_tools.jinja)")
        out.append(RenderProblem(f"the chat template renders no {_listed(dropped, 'or')} message: "
                                 f"{', and '.join(said)}{hint}", fatal=True))
    elif few_shot and "assistant" not in rendered:
        out.append(RenderProblem("the chat template renders no assistant message: the answers of data.prompt's "
                                 "few-shot turns would never reach the model"))
    tool = _PROBE_TOOLS[0]["function"]
    if tools and tool["name"] not in text and tool["description"] not in text:
        out.append(RenderProblem(
            "the chat template does not render the tool list (`tools`): the model is never told which tools exist "
            "nor how to call them; use a template that lists them (prompts/chatml_tools.jinja)"))
    if system and messages[0]["content"] not in text:
        out.append(RenderProblem("the chat template drops the system message: data.system_prompt, and a system "
                                 "message of data.prompt, would never reach the model"))
    return out


def prefix_problem(template: str, special_tokens: dict[str, str] | None = None,
                   template_kwargs: dict[str, Any] | None = None, *, strict: bool = True) -> str | None:
    """Why `template` cannot serve the multi-turn loop, or None. Text only (jinja, no tokenizer), so
    `factory check` can ask it without torch.

    The loop never re-renders a conversation: the context of turn k+1 is the context of turn k, the
    model's own text, and the template text after it (tool results, the next generation prompt). That
    equals what the template renders for the conversation so far only if the template is
    prefix-preserving across turns: rendering the conversation up to the next generation prompt must
    begin with the previous render followed by the model's turn verbatim. A template that rewrites an
    earlier message once later ones follow (drops a reasoning block, moves tool results into the system
    prompt, re-renders the last assistant turn) would train the model on contexts it never sees when the
    template is used. The answer names the first message whose text changes. Not `strict`: an empty reasoning
    block (`<think></think>`) the generation prompt holds and the history leaves out is no difference (Qwen3
    with enable_thinking false: the model's later turns are trained with an empty block before its earlier
    answers that a re-rendering server would not show)."""
    render = compile_template(template)
    kwargs = {**(special_tokens or {}), **(template_kwargs or {})}

    def text(messages: list[dict[str, Any]], generation: bool) -> str:
        return render.render(messages=messages, tools=_PROBE_TOOLS, documents=None,
                             add_generation_prompt=generation, **kwargs)

    msgs = _PROBE_CONVERSATION
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    try:
        for a, b in zip(turns, turns[1:]):
            seen = text(msgs[:a], True) + msgs[a]["content"]  # what the model had written at the end of turn a
            later = text(msgs[:b], True)  # the template's render when turn b is generated
            if later.startswith(seen) or not strict and _EMPTY_REASONING.sub("", later).startswith(
                    _EMPTY_REASONING.sub("", seen)):
                continue
            at = next((i for i, (x, y) in enumerate(zip(seen, later)) if x != y), min(len(seen), len(later)))
            # the message whose text holds the first difference: the last one whose render ends before it
            culprit = a
            for m in range(1, a + 1):  # (a template may refuse to render no messages at all)
                before = text(msgs[:m], False)
                if len(before) > at or not seen.startswith(before):
                    culprit = m - 1
                    break
            role = msgs[culprit]["role"]
            return (f"the chat template is not prefix-preserving across turns: message {culprit} ({role}) of a "
                    f"multi-turn tool conversation renders differently once later turns follow, so the context the "
                    f"model generated in is not what the template renders for the conversation. The model saw "
                    f"{_excerpt(seen, at)}; with the next turn the template renders {_excerpt(later, at)}")
    except jinja2.TemplateError as e:
        return f"the chat template cannot render a multi-turn tool conversation: {e}"
    return None
