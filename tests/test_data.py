import json

import pyarrow.parquet as pq
import pytest

from factory.data import DataError, DataStage, PromptRenderer, arithmetic, from_table, load_rows
from factory.data.sources import check_rows
from factory.plan import DataSettings
from factory.schema import DataSource, DataSpec


def _settings(spec: DataSpec, base_dir, required=None, seed: int = 0) -> DataSettings:
    """The data stage's slice, as the compiler cuts it."""
    return DataSettings(data=spec, seed=seed, eval_size=None, required_columns=required or {}, base_dir=str(base_dir))


def test_arithmetic_answers_are_exact_and_seeded():
    rows = list(arithmetic(50, seed=3))
    assert rows == list(arithmetic(50, seed=3))
    assert rows != list(arithmetic(50, seed=4))
    for r in rows:
        terms = r["expression"].split()
        assert 2 <= (len(terms) + 1) // 2 <= 3
        assert all(10 <= int(t) <= 999 for t in terms[::2])
        assert int(r["answer"]) == eval(r["expression"])


def test_arithmetic_refuses_ops_whose_answers_are_not_integers(project):
    """`ops` took any characters: "/" gave answers such as '0.0411...', "//" was read one character at a time
    (true division), and `factory check` said ok to both."""
    for ops in ("+-*/", "//", ""):
        with pytest.raises(ValueError) as e:
            next(iter(arithmetic(5, seed=0, ops=ops)))
        assert str(e.value) == f"ops takes + - * (integer answers), got {ops!r}"
    assert {r["expression"].split()[1] for r in arithmetic(20, seed=0, ops="*")} == {"*"}
    from factory.compiler.compile import compile_file
    from factory.compiler.errors import SpecErrors
    from tests.test_compiler_support import base_spec, report

    with pytest.raises(SpecErrors) as e:
        compile_file(project.spec(base_spec(project, "data_ops")), ["data.train.args.ops=+/"])
    assert report(e) == ("<override 1>: data.train.args.ops: factory.data:arithmetic raised ValueError on its args "
                         "(ops='+/'): ops takes + - * (integer answers), got '+/'\n1 error in spec.yaml")


def test_arithmetic_says_which_operand_or_digit_range_it_cannot_draw_from():
    """`operands: [0, 1]` raised IndexError (no first term) and `digits: [3, 2]` or `[0, 2]` randint's "empty
    range" or a 0.1 lower bound: `factory check` showed "list index out of range" at the key. Each now says what
    the range must be."""
    for args, said in ((dict(operands=(0, 1)), "operands takes [low, high] with 1 <= low <= high, got [0, 1]"),
                       (dict(operands=(3, 2)), "operands takes [low, high] with 1 <= low <= high, got [3, 2]"),
                       (dict(digits=(0, 2)), "digits takes [low, high] with 1 <= low <= high, got [0, 2]"),
                       (dict(digits=(3, 2)), "digits takes [low, high] with 1 <= low <= high, got [3, 2]")):
        with pytest.raises(ValueError) as e:
            next(iter(arithmetic(5, seed=0, **args)))
        assert str(e.value) == said
    assert [r["expression"] for r in arithmetic(3, seed=0, operands=(1, 1), digits=(1, 1))][0].isdigit()


def test_templates_render_messages(tmp_path):
    (tmp_path / "p.jinja").write_text("Solve: {{ question }}")
    (tmp_path / "s.jinja").write_text("You are helpful.")
    spec = DataSpec(train=DataSource(generator="factory.data:arithmetic"), prompt="p.jinja", system_prompt="s.jinja")
    r = PromptRenderer(spec, base_dir=tmp_path)
    row = {"question": "What is 1 + 2?", "answer": "3"}
    assert r.messages(row) == [{"role": "system", "content": "You are helpful."},
                               {"role": "user", "content": "Solve: What is 1 + 2?"}]
    assert r.row_fields(row)["answer"] == "3"


def test_verl_parquet_prompt_column(tmp_path):
    import pyarrow as pa

    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "hi"}]], "gt": ["x"]}), path)
    spec = DataSpec(train=DataSource(path=str(path)), answer_key="gt")
    stage = DataStage(_settings(spec, tmp_path))
    stage.setup()
    (messages, row), = from_table(stage.next_batch(1))
    assert messages == [{"role": "user", "content": "hi"}]
    assert row == {"gt": "x", "answer": "x"}


def test_jsonl_and_epoch_wrap(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": str(i)}) for i in range(3)))
    stage = DataStage(_settings(DataSpec(train=DataSource(path=str(path))), tmp_path, seed=1))
    info = stage.setup()  # "node": None outside Ray, the driver's node when an earlier test left Ray up in-process
    assert info["train_rows"] == 3 and info["eval_rows"] == 0 and set(info) == {"node", "train_rows", "eval_rows",
                                                                                 "train_rows_dropped"}
    seen = [row["answer"] for _, row in from_table(stage.next_batch(6))]
    assert sorted(seen[:3]) == ["0", "1", "2"] and sorted(seen[3:]) == ["0", "1", "2"]
    state = stage.state()
    nxt = from_table(stage.next_batch(2))
    stage.restore(state)
    assert from_table(stage.next_batch(2)) == nxt  # a resumed run sees the same data


def _worked_call(question: str, args) -> dict:
    """A row in the OpenAI/verl multi-turn layout: a worked tool call, then the question."""
    call = {"type": "function", "function": {"name": "tool", "arguments": args}}
    return {"prompt": [{"role": "user", "content": "How many a in banana?"},
                       {"role": "assistant", "content": "", "tool_calls": [call]},
                       {"role": "tool", "content": "3"}, {"role": "user", "content": question}], "answer": "1"}


@pytest.mark.parametrize("second", [{"expression": "1 + 2"}, {"word": "one"}, json.dumps({"word": 1})],
                         ids=["other-keys", "int-vs-str", "dict-vs-json-string"])
def test_a_batch_hands_each_row_its_own_messages(tmp_path, second):
    """The batch table carried messages as one pyarrow struct type inferred over the batch: every message got
    every key another had (`tool_calls: None`), every call's arguments every other call's names (as null), ints
    became floats, and values of two types (1 and "one") raised ArrowInvalid mid-run."""
    rows = [_worked_call("q1", {"word": 1, "letter": "a"}), _worked_call("q2", second)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = DataSpec(train=DataSource(path="rows.jsonl"), shuffle=False)
    stage = DataStage(_settings(spec, tmp_path, {"answer": "rewards.x"}))
    stage.setup()
    assert [m for m, _ in from_table(stage.next_batch(2))] == [r["prompt"] for r in rows]


def test_bad_file_type(tmp_path):
    (tmp_path / "d.csv").write_text("a")
    with pytest.raises(ValueError, match="must be .parquet, .jsonl or .json"):
        load_rows(DataSource(path=str(tmp_path / "d.csv")), seed=0)


# ------------------------------------------------------------------------------------- bad rows
def _stage(tmp_path, text: str, name: str = "rows.jsonl", **spec) -> DataStage:
    (tmp_path / name).write_text(text)
    settings = _settings(DataSpec(train=DataSource(path=name), **spec), tmp_path, {"answer": "rewards.correct"})
    return DataStage(settings.model_copy(update={"valued_columns": ("answer",)}))  # a reward function's parameter


def test_bad_rows_fail_at_data_preparation_naming_file_and_line(tmp_path):
    rows = [
        '{"question": "1+1?", "answer": "2"}',
        '{"question": "2+2?"}',                                   # no answer column
        '',                                                       # blank lines are skipped, not counted
        '{"question": 7, "answer": "3"}',                         # question of the wrong type
        '{"prompt": [{"role": "user", "content": ["x"]}], "answer": "1"}',  # content not a string
        '{"prompt": [{"role": "robot", "content": "hi"}], "answer": "1"}',  # unknown role
        '{"prompt": [], "answer": "1"}',                           # no message at all
        '["not", "an", "object"]',
        '{"answer": "5"}',                                         # nothing to prompt with
        '{"question": "3+3?", "answer": null}',                  # a null ground truth (exact_match scored "None")
    ]
    stage = _stage(tmp_path, "\n".join(rows) + "\n")
    with pytest.raises(DataError) as e:
        stage.setup()
    assert str(e.value).splitlines() == [
        "rows.jsonl:2: missing column 'answer' (needed by rewards.correct)",
        "rows.jsonl:4: column 'question' must be a string, got int",
        "rows.jsonl:5: message 0: content must be a string, got list",
        "rows.jsonl:6: message 0: role must be one of system, user, assistant, tool, got 'robot'",
        "rows.jsonl:7: expected a non-empty list of chat messages, got an empty list",
        "rows.jsonl:8: expected an object of columns, got list",
        "rows.jsonl:9: a row needs a `prompt` messages column, a `question` column or data.prompt",
        "rows.jsonl:10: null value in column 'answer' (needed by rewards.correct): give it a value, or leave the row "
        "out",
    ]


def test_a_lone_surrogate_is_a_row_problem_named_by_line(tmp_path):
    """JSON allows `\\ud800` (scraped text has them), and json.loads makes a str that UTF-8 cannot encode: the
    row passed the check, then a batch (or the tokenizer) raised UnicodeEncodeError mid-run."""
    stage = _stage(tmp_path, '{"question": "ok?", "answer": "1"}\n{"question": "bad \\ud800 text", "answer": "2"}\n'
                             '{"question": "ok?", "answer": "3", "meta": {"\\udc80": 1}}\n')
    with pytest.raises(DataError) as e:
        stage.setup()
    assert str(e.value).splitlines() == [
        "rows.jsonl:2: text that is not valid Unicode (a lone surrogate) in column 'question'",
        "rows.jsonl:3: text that is not valid Unicode (a lone surrogate) in column 'meta'"]


def test_invalid_json_lines_are_named(tmp_path):
    stage = _stage(tmp_path, '{"question": "q", "answer": "1"}\n{"question": "q",\n')
    with pytest.raises(DataError, match=r"^rows.jsonl:2: invalid JSON: Expecting property name"):
        stage.setup()


def test_prompt_template_reading_a_missing_column_names_the_row(tmp_path):
    (tmp_path / "p.jinja").write_text("Solve {{ expression }}")
    stage = _stage(tmp_path, '{"expression": "1+1", "answer": "2"}\n{"answer": "3"}\n', prompt="p.jinja")
    with pytest.raises(DataError) as e:
        stage.setup()
    assert str(e.value) == "rows.jsonl:2: data.prompt needs a column this row does not have: 'expression' is undefined"


def test_a_prompt_template_that_renders_invalid_json_is_one_error_naming_it(tmp_path):
    """A trailing comma in a prompt template's message list was one error per `(char N)` offset (rows of
    different lengths: ~11 lines for the scaffold's data), none naming the template or showing the text at fault."""
    (tmp_path / "p.jinja").write_text('[\n  {"role": "user", "content": {{ question | tojson }}},\n]\n')
    stage = _stage(tmp_path, '{"question": "1+1?", "answer": "2"}\n{"question": "12+34?", "answer": "46"}\n',
                   prompt="p.jinja")
    with pytest.raises(DataError) as e:
        stage.setup()
    assert str(e.value) == ("rows.jsonl:1 and 1 more rows: data.prompt (p.jinja) rendered invalid JSON: Expecting "
                            "value at line 3 of the rendered text, at ']'")
    # a list on one line: the text from the mistake on (the column is where each row's question ends)
    (tmp_path / "p.jinja").write_text('[{"role": "system", "content": "Answer in one word, ' + 'please, ' * 8 + '"},'
                                      ' {"role": "user", "content": {{ question | tojson }}},]')
    with pytest.raises(DataError) as e:
        stage.setup()
    assert str(e.value) == ("rows.jsonl:1 and 1 more rows: data.prompt (p.jinja) rendered invalid JSON: Expecting "
                            "value at line 1 of the rendered text, at ']'")


def test_a_column_printed_without_tojson_is_one_error_quoting_the_template(tmp_path):
    """The commonest JSON mistake, `"content": {{ question }}` without `| tojson`, was one error a row: the rendered
    line quoted held each row's question ("... and 20 more"). The text before the value is the template's."""
    (tmp_path / "p.jinja").write_text('[\n  {"role": "user", "content": {{ question }}}\n]\n')
    said = ("data.prompt (p.jinja) rendered invalid JSON: COMPLAINT at line 2 of the rendered text, in the value "
            "after " + repr(', "content":'))
    for question, complaint in (("What is {i}+{i}?", "Expecting value"),  # stopped where the value starts
                                ("{i}+{i}?", "Expecting ',' delimiter")):  # stopped after the number `7` of `7+7?`
        rows = "".join(f'{{"question": "{question.format(i=i)}", "answer": "{2 * i}"}}\n' for i in range(30))
        with pytest.raises(DataError) as e:
            _stage(tmp_path, rows, prompt="p.jinja").setup()
        assert str(e.value) == "rows.jsonl:1 and 29 more rows: " + said.replace("COMPLAINT", complaint)


def test_a_value_through_tojson_before_the_mistake_is_not_quoted(tmp_path):
    """With a row's value through `tojson` earlier on the line, the quote (the last 40 characters before the value,
    cut at the last `[{,:`, even one inside that value) held each row's question: one error a row again. Quoted
    now from the last bracket or comma outside a JSON string: the key and its colon, the template's text."""
    (tmp_path / "p.jinja").write_text('[{"role": "user", "content": {{ q | tojson }}, "name": {{ who }}}]')
    rows = "".join(f'{{"q": "{q}", "who": "{who}", "answer": "1"}}\n' for q, who in (
        ("What is 12+34?", "ann"), ("Add 5 and 7, then double it", "bob"), ('Say \\"a, b\\": c', "cy")))
    with pytest.raises(DataError) as e:
        _stage(tmp_path, rows, prompt="p.jinja").setup()
    assert str(e.value) == ("rows.jsonl:1 and 2 more rows: data.prompt (p.jinja) rendered invalid JSON: Expecting "
                            "value at line 1 of the rendered text, in the value after ', \"name\":'")


def test_a_missing_column_read_through_tojson_is_named(tmp_path):
    """The scaffold's prompt reads `{{ question | tojson }}`: a row without the column (or a misspelt name) said
    "Object of type StrictUndefined is not JSON serializable", naming no column. Inside a value, too."""
    (tmp_path / "p.jinja").write_text('[{"role": "user", "content": {{ questoin | tojson }}}]')
    (tmp_path / "q.jinja").write_text('[{"role": "user", "content": {{ ({"q": question} | tojson) | tojson }}}]')
    for template, name in (("p.jinja", "questoin"), ("q.jinja", "question")):
        stage = _stage(tmp_path, '{"answer": "3"}\n', prompt=template)
        with pytest.raises(DataError) as e:
            stage.setup()
        assert str(e.value) == f"rows.jsonl:1: data.prompt needs a column this row does not have: '{name}' is undefined"


def test_a_prompt_template_that_renders_nothing_names_the_row(tmp_path):
    """An empty template (or one whose `{% if %}` fails for a row) gave the model an empty message, in silence."""
    (tmp_path / "p.jinja").write_text("{% if expression %}Solve {{ expression }}{% endif %}\n")
    stage = _stage(tmp_path, '{"expression": "1+1", "answer": "2"}\n{"expression": "", "answer": "3"}\n',
                   prompt="p.jinja")
    with pytest.raises(DataError) as e:
        stage.setup()
    assert str(e.value) == "rows.jsonl:2: data.prompt (p.jinja) rendered no text: the user's message would be empty"


def test_parquet_rows_and_many_problems(tmp_path):
    import pyarrow as pa

    pq.write_table(pa.table({"question": [f"q{i}" for i in range(30)], "gold": ["1"] * 30}), tmp_path / "d.parquet")
    stage = DataStage(_settings(DataSpec(train=DataSource(path="d.parquet")), tmp_path, {"answer": "rewards.correct"}))
    with pytest.raises(DataError) as e:
        stage.setup()
    # one line for one problem: it listed 10 identical lines and "... and 20 more"
    assert str(e.value) == "d.parquet row 1 and 29 more rows: missing column 'answer' (needed by rewards.correct)"
    rows = [{"question": "q", "answer": "1"}, [1], {"question": 7}, [2], [3]]
    with pytest.raises(DataError) as e:
        check_rows(rows, [f"row {i + 1}" for i in range(5)], PromptRenderer(DataSpec(train=DataSource(path="x"))))
    assert str(e.value).splitlines() == ["row 2 and 2 more rows: expected an object of columns, got list",
                                         "row 3: column 'question' must be a string, got int"]


def test_eval_rows_are_checked_too(tmp_path):
    (tmp_path / "ok.jsonl").write_text('{"question": "q", "answer": "1"}\n')
    spec = DataSpec(train=DataSource(path="ok.jsonl"), eval=DataSource(generator=f"{__name__}:bad_generator"))
    with pytest.raises(DataError, match=r"^tests.test_data:bad_generator row 2: column 'question' must be a string"):
        DataStage(_settings(spec, tmp_path)).setup()


def test_eval_prompts_are_held_out_of_training(tmp_path, caplog):
    """The eval split's generator only had another seed: 25 of the 64 eval prompts of specs/multi-agent.yaml were
    training prompts too. A training row whose prompt (its rendered messages) an eval row has is dropped, against
    the whole eval split (what trains does not depend on train.eval_size); the eval split stays as it is."""
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n"
                                                  for i in range(5)))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"question": q, "answer": "x"}) + "\n"
                                                 for q in ("q9", "q3", "q1")))
    spec = DataSpec(train=DataSource(path="train.jsonl"), eval=DataSource(path="eval.jsonl"))
    stage = DataStage(_settings(spec, tmp_path).model_copy(update={"eval_size": 1}))
    with caplog.at_level("WARNING", logger="factory.data.stage"):
        info = stage.setup()
    assert (info["train_rows"], info["eval_rows"], info["train_rows_dropped"]) == (3, 1, 2)
    assert [r.getMessage() for r in caplog.records] == [
        "2 training rows dropped: their prompt is in the eval split (data.eval is held out of training)"]
    assert sorted(m[-1]["content"] for m, _ in from_table(stage.next_batch(3))) == ["q0", "q2", "q4"]
    assert [m[-1]["content"] for m, _ in from_table(stage.eval_batch())] == ["q9"]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"question": f"q{i}"}) + "\n" for i in range(6)))
    with pytest.raises(DataError) as e:
        DataStage(_settings(spec, tmp_path)).setup()
    assert str(e.value) == ("data.train: each of its 5 rows has a prompt that data.eval also has, and eval prompts "
                            "are held out of training: no training rows are left")


def bad_generator(n: int, seed: int = 0):
    return [{"question": "fine"}, {"question": None}]


def test_reward_functions_declare_the_columns_they_need(project):
    from factory.compiler.load import load_spec
    from factory.reward.graph import required_columns

    project.module("rq_rewards", "def needs(prompt, completion, answer, unit, scale=1.0, **row):\n    return 0.0\n"
                                 "def relaxed(prompt, completion, answer='', **row):\n    return 0.0\n")
    spec = load_spec(project.spec("""\
        name: x
        model: {path: "factory:tiny-qwen3"}
        data: {train: {generator: factory.data:arithmetic}, answer_key: gold}
        rewards:
          a: {fn: "rq_rewards:needs", args: {unit: cm}}
          b: {fn: "rq_rewards:relaxed"}
          total: {sum: {a: 1, b: 1}}
        """))
    assert required_columns(spec) == {"gold": "rewards.a"}


def test_a_missing_column_says_when_the_function_has_another_nodes_shape(project):
    """A group reward without `group: true` was "missing column 'rows' (needed by rewards.g)", at the data."""
    from factory.compiler.load import load_spec
    from factory.reward.graph import required_columns

    project.module("rq_shapes", "def grp(prompts, completions, rows):\n    return [0.0]\n"
                                "def turns(prompt, completion, turn, index):\n    return 0.0\n"
                                "def indexed(prompt, completion, index):\n    return 0.0\n")
    spec = load_spec(project.spec("""\
        name: x
        model: {path: "factory:tiny-qwen3"}
        data: {train: {generator: factory.data:arithmetic}}
        rewards:
          g: {fn: "rq_shapes:grp"}
          t: {fn: "rq_shapes:turns"}
          i: {fn: "rq_shapes:indexed"}
          total: {sum: {g: 1, t: 1, i: 1}}
        """))
    assert required_columns(spec) == {
        "rows": "rewards.g, which looks like a group reward: set `group: true` on the node",
        "turn": "rewards.t, which looks like a per-turn reward: set `per: turn` on the node",
        "index": "rewards.t, which looks like a per-turn reward: set `per: turn` on the node"}
    assert required_columns(spec.model_copy(update={"rewards": {k: v for k, v in spec.rewards.items()
                                                                if k != "t"}}))["index"] == "rewards.i"  # a column


def test_a_limit_reads_only_the_first_rows_of_each_kind_of_source(tmp_path):
    """`factory check` reads at most CHECKED_ROWS rows of a source: the first ones, whatever its kind."""
    import pyarrow as pa

    from factory.data.sources import read_source

    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"question": str(i)}) + "\n" for i in range(4)) + "{bad\n")
    pq.write_table(pa.table({"question": [str(i) for i in range(5)]}), tmp_path / "rows.parquet")
    for name in ("rows.jsonl", "rows.parquet"):
        rows, origins = read_source(DataSource(path=name), seed=0, base_dir=tmp_path, limit=3)
        assert [r["question"] for r in rows] == ["0", "1", "2"] and len(origins) == 3
    with pytest.raises(DataError, match="rows.jsonl:5: invalid JSON"):  # without a limit, every line
        read_source(DataSource(path="rows.jsonl"), seed=0, base_dir=tmp_path)
    rows, _ = read_source(DataSource(generator="factory.data:arithmetic", size=100), seed=0, limit=7)
    assert len(rows) == 7


def test_a_null_column_printed_by_the_prompt_is_a_row_problem(tmp_path):
    """`{{ question }}` of a null question put the text 'None' in the model's prompt, and check said ok."""
    (tmp_path / "p.jinja").write_text("Solve: {{ question }}{% if hint %} ({{ hint }}){% endif %}{{ hint or '' }}")
    (tmp_path / "d.jsonl").write_text('{"question": "1 + 1?", "hint": null}\n{"question": null}\n')
    spec = DataSpec(train=DataSource(path="d.jsonl"), prompt="p.jinja")
    renderer = PromptRenderer(spec, base_dir=tmp_path)
    assert renderer.messages({"question": "1 + 1?", "hint": None}) == [{"role": "user", "content": "Solve: 1 + 1?"}]
    with pytest.raises(DataError, match=r"d.jsonl:2: data.prompt printed a null value .* write `\{\{ x or '' \}\}`"):
        DataStage(_settings(spec, tmp_path)).setup()


def test_a_json_array_file_and_a_byte_order_mark(tmp_path):
    """A .json file holding one array of rows (a common export) was read as JSON Lines ('expected an object
    of columns, got list'); a UTF-8 byte-order mark (Windows tools write one) made line 1 invalid JSON."""
    from factory.data.sources import read_source

    (tmp_path / "rows.json").write_text('[\n  {"question": "a", "answer": "1"},\n  {"question": "b", "answer": "2"}\n]\n')
    rows, origins = read_source(DataSource(path="rows.json"), seed=0, base_dir=tmp_path)
    assert [r["question"] for r in rows] == ["a", "b"] and origins == ["rows.json row 1", "rows.json row 2"]
    assert len(read_source(DataSource(path="rows.json"), seed=0, base_dir=tmp_path, limit=1)[0]) == 1
    (tmp_path / "lines.json").write_text('{"question": "a"}\n{"question": "b"}\n')  # JSON Lines, as before
    assert len(read_source(DataSource(path="lines.json"), seed=0, base_dir=tmp_path)[0]) == 2
    (tmp_path / "bad.json").write_text('[\n  {"question": "a"},\n  {"question" "b"}\n]\n')
    with pytest.raises(DataError, match=r"bad.json:3: invalid JSON"):
        read_source(DataSource(path="bad.json"), seed=0, base_dir=tmp_path)
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"question": "a"}\n')
    assert read_source(DataSource(path="bom.jsonl"), seed=0, base_dir=tmp_path)[0] == [{"question": "a"}]


def test_a_byte_that_is_not_utf8_is_named_by_its_line_and_column(tmp_path):
    """The decoder's own message named a position in its read buffer ("byte 0xe9 in position 3496" of line 2001, at
    byte 101800 of the file): the file's line and column of each such byte are said, as for invalid JSON."""
    from factory.data.sources import read_source

    good = b'{"question": "1 + 1?", "answer": "2"}\n' * 2000
    (tmp_path / "late.jsonl").write_bytes(good + b'{"question": "caf\xe9?"}\r\n{"q": "ok"}\n{"\xff": 1}\n')
    with pytest.raises(DataError) as e:
        read_source(DataSource(path="late.jsonl"), seed=0, base_dir=tmp_path)
    assert str(e.value) == ("late.jsonl:2001: not UTF-8 (byte 0xe9 at column 18)\n"
                            "late.jsonl:2003: not UTF-8 (byte 0xff at column 3)")
    (tmp_path / "rows.json").write_bytes(b'\xef\xbb\xbf[\n  {"question": "a"},\n  {"question": "\xc3\xa9t\xe9"}\n]\n')
    with pytest.raises(DataError, match=r"^rows.json:3: not UTF-8 \(byte 0xe9 at column 19\)$"):
        read_source(DataSource(path="rows.json"), seed=0, base_dir=tmp_path)


def test_check_warns_when_data_system_prompt_is_not_used(project):
    """A data.prompt that renders its own system message kept it, and data.system_prompt was dropped
    without a word."""
    from factory.compiler.compile import compile_file
    from tests.test_compiler_support import base_spec

    project.file("prompts/own.jinja", '[{"role": "system", "content": "Own."}, {"role": "user", "content": "{{ question }}"}]')
    project.file("prompts/user.jinja", "{{ question }}")
    project.file("prompts/sys.jinja", "Global.")
    base = base_spec(project, "dw_system").replace(
        "  train: {generator: factory.data:arithmetic, size: 8}\n",
        "  train: {generator: factory.data:arithmetic, size: 8}\n  prompt: prompts/own.jinja\n"
        "  system_prompt: prompts/sys.jinja\n")
    _, plan = compile_file(project.spec(base))
    assert plan.warnings == ("spec.yaml:6: data.system_prompt: warning: not used for factory.data:arithmetic row 1 and "
                             "7 more rows of data.train: their messages already begin with a system message, which is kept",)
    _, plan = compile_file(project.spec(base.replace("prompts/own.jinja", "prompts/user.jinja"), "b.yaml"))
    assert plan.warnings == ()


def test_a_dotted_answer_key_reads_a_nested_column_as_verl_keeps_it(tmp_path):
    """verl's parquet keeps the ground truth in `reward_model.ground_truth`: 'missing column' before."""
    from factory.data.sources import PromptRenderer, check_rows

    row = {"prompt": [{"role": "user", "content": "2+3?"}], "reward_model": {"ground_truth": "5", "style": "rule"}}
    renderer = PromptRenderer(DataSpec(train=DataSource(path="d.jsonl"), answer_key="reward_model.ground_truth"))
    assert renderer.row_fields(row)["answer"] == "5"
    check_rows([row], ["d.jsonl:1"], renderer, {"reward_model.ground_truth": "rewards.correct"})
    with pytest.raises(DataError, match=r"d.jsonl:1: missing column 'reward_model.truth'"):
        check_rows([row], ["d.jsonl:1"], renderer, {"reward_model.truth": "rewards.correct"})
    assert "answer" not in PromptRenderer(DataSpec(train=DataSource(path="d.jsonl"))).row_fields(row)
