import json

import pyarrow.parquet as pq
import pytest

from factory.data import DataStage, PromptRenderer, arithmetic, from_table, load_rows
from factory.schema import DataSource, DataSpec


def test_arithmetic_answers_are_exact_and_seeded():
    rows = list(arithmetic(50, seed=3))
    assert rows == list(arithmetic(50, seed=3))
    assert rows != list(arithmetic(50, seed=4))
    for r in rows:
        terms = r["expression"].split()
        assert 2 <= (len(terms) + 1) // 2 <= 3
        assert all(10 <= int(t) <= 999 for t in terms[::2])
        assert int(r["answer"]) == eval(r["expression"])


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
    stage = DataStage(spec, seed=0)
    stage.setup()
    (messages, row), = from_table(stage.next_batch(1))
    assert messages == [{"role": "user", "content": "hi"}]
    assert row == {"gt": "x", "answer": "x"}


def test_jsonl_and_epoch_wrap(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": str(i)}) for i in range(3)))
    stage = DataStage(DataSpec(train=DataSource(path=str(path))), seed=1)
    assert stage.setup() == {"train_rows": 3, "eval_rows": 0}
    seen = [row["answer"] for _, row in from_table(stage.next_batch(6))]
    assert sorted(seen[:3]) == ["0", "1", "2"] and sorted(seen[3:]) == ["0", "1", "2"]
    state = stage.state()
    nxt = from_table(stage.next_batch(2))
    stage.restore(state)
    assert from_table(stage.next_batch(2)) == nxt  # a resumed run sees the same data


def test_bad_file_type(tmp_path):
    (tmp_path / "d.csv").write_text("a")
    with pytest.raises(ValueError, match="must be .parquet or .jsonl"):
        load_rows(DataSource(path=str(tmp_path / "d.csv")), seed=0)
