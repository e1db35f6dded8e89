"""The DeepSearch example: the Wikipedia corpus, the question generator, BM25 retrieval of the answer
article, and the MCP search server over stdio (through the ToolBox) and streamable HTTP."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import re
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import yaml
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError
from mcp.types import INTERNAL_ERROR

from factory.compiler.refs import generator_problem
from factory.examples import search as S
from factory.rewards.qa import normalize_answer
from factory.schema import HttpServer, StdioServer
from factory.tools import ToolBox
from factory.types import ToolCall, ToolResult
from tests.servers import free_port, http_server

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def index():
    """One in-memory index for the module (built in 0.6-1.7 s)."""
    return S.Index(S.load_corpus())


def article(title, extract, description="", topic="Technology"):
    return {"title": title, "extract": extract, "description": description, "topic": topic}


# ------------------------------------------------------------------------------------------ corpus
def test_corpus_is_the_vital_articles():
    articles = S.load_corpus()
    assert len(articles) == 10033
    assert all(a["title"] and a["extract"] for a in articles)
    bronze = next(a for a in articles if a["title"] == "Bronze")
    assert bronze["description"] == "Alloy of copper and tin"
    assert bronze["extract"].startswith("Bronze is an alloy")


# ------------------------------------------------------------------------------------------ questions
def test_definition_question_from_the_first_sentence():
    a = article("Bronze", "Bronze is an alloy consisting primarily of copper, commonly with tin. It is hard.",
                "Alloy of copper and tin")
    rows = S.article_questions(a, {"alloy of copper and tin": 1})
    assert rows == [
        {"question": "What is an alloy consisting primarily of copper, commonly with tin?", "answer": "Bronze",
         "title": "Bronze", "form": "definition"},
        {"question": "What is the alloy of copper and tin?", "answer": "Bronze", "title": "Bronze",
         "form": "description"},
    ]


def test_people_get_who_and_proper_nouns_keep_their_capital():
    a = article("John Wycliffe", "John Wycliffe was an English scholastic philosopher and Christian reformer at "
                "Oxford.", "English theologian (1328–1384)", topic="People")
    questions = [r["question"] for r in S.article_questions(a, {"english theologian (1328–1384)": 1})]
    assert questions == ["Who was an English scholastic philosopher and Christian reformer at Oxford?",
                         "Who was the English theologian (1328–1384)?"]


def test_unusable_forms_are_dropped():
    shared = {"literary genre": 3}
    # The sentence is about someone else; the description is shared by three articles.
    assert S.article_questions(article("Odyssey", "In antiquity Homer was said to be its author, a blind poet "
                                       "of Ionia.", "Literary genre"), shared) == []
    # The answer is in the question; the predicate is too short to name one thing.
    assert S.article_questions(article("Paris", "Paris is the capital of France, and Paris is large."), {}) == []
    assert S.article_questions(article("Lu Xun", "Lu Xun was a Chinese writer.", topic="People"), {}) == []


def test_who_is_asked_of_people_filed_anywhere():
    assert S.is_person(article("Adam Smith", "", "Scottish economist and philosopher (1723–1790)", "Uncategorized"))
    assert not S.is_person(article("Leviathan", "", "Book by a philosopher (1651)", "Uncategorized"))
    assert not S.is_person(article("Great Depression", "", "Worldwide economic depression (1929–1939)",
                                   "Uncategorized"))


def test_a_description_that_repeats_the_definition_is_asked_once():
    a = article("Cinematography", "Cinematography is the art of motion picture photography and of film making.",
                "Art of motion picture photography and of film making")
    assert [r["form"] for r in S.article_questions(a, {a["description"].lower(): 1})] == ["definition"]


def test_answer_drops_the_disambiguating_qualifier():
    assert S.answer_of("Mercury (planet)") == "Mercury"
    assert S.answer_of("Maximilian I, Holy Roman Emperor") == "Maximilian I, Holy Roman Emperor"


def test_a_long_predicate_is_cut_at_a_clause():
    clause = "a city " + ", ".join(f"known for thing number {i}" for i in range(30))
    trimmed = S._trim(clause)
    assert len(trimmed) <= S.MAX_CLUE_CHARS and not trimmed.endswith(",")
    assert clause.startswith(trimmed) and clause[len(trimmed)] == ","


def test_generator_is_deterministic_and_prefix_stable():
    first = list(S.questions(40, seed=3))
    assert first == list(S.questions(40, seed=3))
    assert list(S.questions(10, seed=3)) == first[:10]
    assert first != list(S.questions(40, seed=4))
    assert all(set(r) == {"question", "answer", "title", "form"} for r in first)
    assert generator_problem(S.questions, "factory.examples.search:questions", {"split": "test"}) is None


def test_splits_are_disjoint_by_article_about_eighty_ten_five_five():
    titles = {split: {r["title"] for r in S.split_questions(split)} for split in S.SPLITS}
    assert all(titles.values())
    assert all(not titles[a] & titles[b] for a, b in itertools.combinations(S.SPLITS, 2))
    total = sum(map(len, titles.values()))
    assert 0.09 < len(titles["validation"]) / total < 0.12
    assert all(0.045 < len(titles[split]) / total < 0.06 for split in ("retired_test", "test"))
    assert set(S.article_splits()) == {a["title"] for a in S.load_corpus()}  # every article dealt, once
    with pytest.raises(ValueError, match="split must be one of"):
        list(S.questions(1, split="heldout"))


def test_an_answer_string_stays_on_one_side():
    """Jupiter (god) and Jupiter the planet both answer "Jupiter": dealt by article, one could train while
    the other was asked on a held-out split. Dealt by the normalised answer, no answer is on two sides."""
    keys = {split: {S.answer_key(r["title"]) for r in S.split_questions(split)} for split in S.SPLITS}
    assert all(not keys[a] & keys[b] for a, b in itertools.combinations(S.SPLITS, 2))
    splits = S.article_splits()
    assert S.answer_key("Jupiter (god)") == S.answer_key("Jupiter") and splits["Jupiter (god)"] == splits["Jupiter"]


def test_the_test_slice_is_new_and_every_evaluated_article_is_for_choosing():
    """Settings were chosen on the first held-out slice (both halves it was once split into): all of it is
    validation. The first test slice was reported once: it stands apart as retired_test, and the test slice
    holds neither."""
    splits = S.article_splits()
    first_slice = {t for t in splits if S.held_out(t)}
    assert len(first_slice) > 900
    assert all(splits[t] == "validation" for t in first_slice)
    test = {r["title"] for r in S.split_questions("test")}
    assert not first_slice & test and not test & {r["title"] for r in S.split_questions("retired_test")}


def test_a_question_that_holds_its_normalised_answer_is_dropped():
    """The raw text check let this through ("the nutcracker" is not in it), but exact match normalises the
    article away, so answering "Nutcracker", a word of the question, scored."""
    question = "What is an 1892 two-act classical ballet set in a child's imagination featuring a Nutcracker doll?"
    assert "the nutcracker" not in question.lower() and S.gives_away("The Nutcracker", question)
    assert S.gives_away("Bronze", "What are bronzes made of?")
    assert not S.gives_away("Corvidae", "What is the family of birds that contains the crows and nutcrackers?")
    a = article("The Nutcracker", "The Nutcracker, Op. 71, is an 1892 two-act classical ballet by Pyotr Ilyich "
                "Tchaikovsky, set in a child's imagination featuring a Nutcracker doll.", "1892 ballet by Tchaikovsky")
    assert [r["form"] for r in S.article_questions(a, {a["description"].lower(): 1})] == ["description"]


def test_draw_seed_gives_every_run_seed_the_same_held_out_questions():
    a = list(S.questions(64, seed=7 + 1_000_003, split="test", draw_seed=0))
    assert a == list(S.questions(64, seed=8 + 1_000_003, split="test", draw_seed=0))
    assert a != list(S.questions(64, seed=7 + 1_000_003, split="test"))


def test_no_question_gives_its_answer_away_or_has_two_answers():
    rows = tuple(row for split in S.SPLITS for row in S.split_questions(split))
    assert len({r["question"].lower() for r in rows}) == len(rows)
    for row in rows:
        assert row["question"].endswith("?") and row["question"].count("(") == row["question"].count(")")
    # Checked apart from the filter: the normalised answer is not even a part of a word of the normalised
    # question. One training question is ("... new princes?" -> The Prince: "prince" scores); a filter that
    # dropped it would reorder every training draw of the measured recipe, so it stays, said here.
    copied = [r["answer"] for r in rows if normalize_answer(r["answer"]) in normalize_answer(r["question"])]
    assert copied == ["The Prince"] and S.split_of("The Prince") == "train"


def test_the_frozen_splits_do_not_move():
    """Each test slice was frozen (both on 2026-12-05) before any run evaluated on it; the first was reported
    once and retired: a change to the question rules, the normalisation or the draw that moves either must be
    seen, not made in passing. (The retired slice's hash is the one it had as the test split.)"""
    splits = S.article_splits()

    def digest(name: str) -> str:
        return hashlib.sha256("\n".join(sorted(t for t, s in splits.items() if s == name)).encode()).hexdigest()
    assert digest("retired_test") == "82d1a62c39e0ef0092252ae4461fe8bc514cae16557760a4359aea29942df740"
    assert digest("test") == "0b2b042c7e669b071448ccb3a4d0f9ff62617ce6bd8bb588ad28f71a80646870"
    assert [len(S.split_questions(split)) for split in S.SPLITS] == [13_815, 1_794, 920, 914]


def test_more_rows_than_questions_go_round_again():
    pool = S.split_questions("test")
    rows = list(S.questions(len(pool) + 5, seed=1, split="test"))
    assert len(rows) == len(pool) + 5
    first_pass = {(r["question"], r["title"]) for r in rows[:len(pool)]}
    assert first_pass == {(r["question"], r["title"]) for r in pool}  # each question once per pass


# ------------------------------------------------------------------------------------------ retrieval
def test_the_answer_article_is_retrieved_for_most_questions(index):
    """Measured (2026-12-05, 300 questions a split): the answer's article is in the top 3 for 98.7-99.0% of the
    test, retired_test and validation questions, in the top 1 for 94.0-95.3%."""
    rows = list(S.questions(300, seed=0, split="test"))
    titles = [a["title"] for a in S.load_corpus()]
    hits = sum(r["title"] in {titles[i] for i in index.top(r["question"], 3)} for r in rows)
    assert hits / len(rows) >= 0.9


def test_search_text_is_numbered_passages(index):
    text = index.search("alloy of copper and tin", top_k=2)
    docs = text.split("\n\n")
    assert len(docs) == 2
    assert docs[0].startswith("Doc 1 (Title: Bronze; Alloy of copper and tin)\nBronze is an alloy")
    assert docs[1].startswith("Doc 2 (Title: ")
    assert index.search("the of and", top_k=3) == ""  # stop words only: nothing to match


def test_a_long_extract_is_cut_at_a_word():
    text = S.format_passage(1, article("X", "word " * 300))
    assert text.startswith("Doc 1 (Title: X)\nword")
    assert text.endswith("word ...") and len(text) < S.PASSAGE_CHARS + 30


def test_index_cache_is_reused_and_keyed_by_the_corpus(tmp_path):
    articles = S.load_corpus()[:50]
    built = S.Index(articles, cache=tmp_path, corpus_sha256="a")
    [saved] = list(tmp_path.iterdir())
    loaded = S.Index(articles, cache=tmp_path, corpus_sha256="a")
    query = articles[7]["title"]
    assert loaded.top(query, 5) == built.top(query, 5) and loaded.top(query, 5)[0] == 7
    S.Index(articles, cache=tmp_path, corpus_sha256="b")  # another corpus: another folder
    assert len(list(tmp_path.iterdir())) == 2 and saved.is_dir()
    (tmp_path / "file").write_text("")
    unwritable = S.Index(articles, cache=tmp_path / "file" / "cache", corpus_sha256="a")  # no cache: no error
    assert unwritable.top(query, 1) == [7]


def test_passage_length_is_a_server_option(monkeypatch, index):
    monkeypatch.setattr(S, "_index", index)
    monkeypatch.setattr(S, "_passage_chars", S.PASSAGE_CHARS)
    S._start(S.argparse.Namespace(passage_chars=40, retriever_url=None))
    first = asyncio.run(S.search("alloy of copper and tin", 1))
    assert first == "Doc 1 (Title: Bronze; Alloy of copper and tin)\nBronze is an alloy consisting primarily ..."
    with pytest.raises(SystemExit, match="--passage-chars must be at least 1"):
        S._start(S.argparse.Namespace(passage_chars=0, retriever_url=None))


def test_search_tool_refuses_a_query_without_words(monkeypatch, index):
    monkeypatch.setattr(S, "_index", index)
    assert asyncio.run(S.search("alloy of copper and tin", 1)).startswith("Doc 1 (Title: Bronze")
    with pytest.raises(ToolError, match="no passage matches"):
        asyncio.run(S.search("the of and"))


# ------------------------------------------------------------------------------ remote retriever
# What Search-R1's retrieval server (e5 over the 2018 Wikipedia dump) answers for one query: contents are
# '"Title"\ntext', best hit first.
RETRIEVED = [{"document": {"id": "1", "contents": '"Bronze"\nBronze is an alloy consisting primarily of copper.'},
              "score": 0.91},
             {"document": {"id": "2", "contents": '"Brass"\nBrass is an alloy of copper and zinc.'}, "score": 0.85}]


def test_retriever_hits_become_numbered_passages():
    assert S.retriever_passages(RETRIEVED) == (
        "Doc 1 (Title: Bronze)\nBronze is an alloy consisting primarily of copper.\n\n"
        "Doc 2 (Title: Brass)\nBrass is an alloy of copper and zinc.")
    assert S.retriever_passages([]) == ""


@contextlib.contextmanager
def canned_retriever(port: int = 0, status: int = 200, seen: list | None = None,
                     answer: object = None) -> Iterator[int]:
    """Search-R1's retrieval server's HTTP contract on 127.0.0.1 (`port`, else a free one, yielded): answers
    RETRIEVED's first `topk` hits (or `answer`, when given), or only `status` when that is not 200; the requests
    go to `seen`."""
    class Retriever(BaseHTTPRequestHandler):
        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if seen is not None:
                seen.append(request)
            body = json.dumps(answer if answer is not None else {"result": [RETRIEVED[: request["topk"]]]}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            if status == 200:
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = HTTPServer(("127.0.0.1", port), Retriever)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield httpd.server_port
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_search_goes_to_the_retriever_over_http(monkeypatch):
    seen = []
    with canned_retriever(seen=seen) as port:
        try:
            monkeypatch.setattr(S, "_index", None)
            S._start(S.argparse.Namespace(passage_chars=20, retriever_url=f"http://127.0.0.1:{port}/retrieve"))
            assert S._index is None  # no local index is built for a remote retriever
            text = asyncio.run(S.search("copper alloy", 1))
        finally:
            monkeypatch.setattr(S, "_retriever_url", None)
            monkeypatch.setattr(S, "_passage_chars", S.PASSAGE_CHARS)
    assert seen == [{"queries": ["copper alloy"], "topk": 1, "return_scores": True}]
    assert text == "Doc 1 (Title: Bronze)\nBronze is an alloy ..."


def test_a_retriever_that_fails_is_a_server_error_that_says_why():
    """A retriever down or failing is no fault of the model's query: a JSON-RPC error (ToolBox: infra_error),
    not a ToolError (the model's)."""
    with canned_retriever(status=503) as port:
        with pytest.raises(MCPError, match="answered HTTP 503") as failed:
            asyncio.run(S.retrieve(f"http://127.0.0.1:{port}/retrieve", "copper alloy", 1))
    assert failed.value.code == INTERNAL_ERROR
    with pytest.raises(MCPError, match="could not be reached") as failed:  # nothing listens there now
        asyncio.run(S.retrieve(f"http://127.0.0.1:{port}/retrieve", "copper alloy", 1))
    assert failed.value.code == INTERNAL_ERROR


@pytest.mark.parametrize("answer", [{"result": [None]}, {"result": [["Bronze\nan alloy"]]}, {"result": ["x"]},
                                    {"result": [{"hit": 1}]}, {"result": [[{"document": "Bronze"}]]}])
def test_a_retriever_answer_not_in_search_r1s_shape_is_a_server_error(answer):
    """Only `result[0]` was guarded: hits of another shape (null, a list of texts, a text) raised TypeError or
    AttributeError as the passages were made, which reached the model as its own error, trained on and cached."""
    with canned_retriever(answer=answer) as port:
        with pytest.raises(MCPError, match="answered no Search-R1 hits") as failed:
            asyncio.run(S.retrieve(f"http://127.0.0.1:{port}/retrieve", "copper alloy", 1))
    assert failed.value.code == INTERNAL_ERROR


def test_a_retriever_outage_is_an_infra_error_and_not_cached(monkeypatch, tmp_path):
    """Through the ToolBox, as a run sees it: the outage is infra_error with its reason (retried, never trained
    on, counted by max_infra_error_rate) and `cache: true` does not keep it: the next run gets the answer."""
    monkeypatch.setenv("FACTORY_CACHE", str(tmp_path))
    port = free_port()  # nothing listens yet: the retriever is down

    async def ask() -> ToolResult:
        spec = StdioServer(command=sys.executable, cwd=str(ROOT), timeout_s=15, cache=True,
                           args=["-m", "factory.examples.search", "--retriever-url", f"http://127.0.0.1:{port}/retrieve"])
        async with ToolBox.from_spec({"search": spec}, base_dir=ROOT) as box:
            return await box.call(ToolCall("search", {"query": "copper alloy", "top_k": 1}, raw=""))

    down = asyncio.run(ask())
    assert (down.status, down.error_kind) == ("infra_error", "transport"), down
    assert "could not be reached" in down.text
    with canned_retriever(port):
        up = asyncio.run(ask())
    assert (up.status, up.text) == ("ok", "Doc 1 (Title: Bronze)\nBronze is an alloy consisting primarily of copper.")


# ------------------------------------------------------------------------------------------ server
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_server_over_stdio_through_the_toolbox(tmp_path, anyio_backend):
    spec = StdioServer(command="python", args=["-m", "factory.examples.search"], cwd=str(ROOT), timeout_s=10,
                       env={"FACTORY_CACHE": str(tmp_path)})
    async with ToolBox.from_spec({"search": spec}, base_dir=ROOT) as box:
        [schema] = box.schemas()
        assert schema["function"]["name"] == "search"
        assert schema["function"]["parameters"]["required"] == ["query"]
        result = await box.call(ToolCall(name="search", arguments={"query": "Norwegian painter The Scream"}, raw=""))
        assert result.status == "ok", result.text
        assert "(Title: Edvard Munch" in result.text and result.text.count("\nDoc ") == 2
        one = await box.call(ToolCall(name="search", arguments={"query": "Edvard Munch", "top_k": 1}, raw=""))
        assert one.text.startswith("Doc 1 (Title: Edvard Munch") and "Doc 2" not in one.text
        bad = await box.call(ToolCall(name="search", arguments={"query": "x", "top_k": 0}, raw=""))
        assert (bad.status, bad.error_kind) == ("model_error", "bad_arguments")
        empty = await box.call(ToolCall(name="search", arguments={"query": "the of"}, raw=""))
        assert (empty.status, empty.error_kind) == ("model_error", "tool_error")
    assert len(list((tmp_path / "search-index").iterdir())) == 1  # the index was saved for the next start


@pytest.fixture
def http_url(tmp_path):
    """The search server over streamable HTTP on a free 127.0.0.1 port, stopped after the test."""
    port = free_port()
    argv = [sys.executable, "-m", "factory.examples.search", "--http", "--port", str(port)]
    with http_server(argv, port, cwd=ROOT, env={"FACTORY_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}):
        yield f"http://127.0.0.1:{port}/mcp"


@pytest.mark.slow  # ~4 s: a second server start; the transport itself is covered with the calculator
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_server_over_streamable_http(http_url, anyio_backend):
    async with ToolBox.from_spec({"search": HttpServer(url=http_url, timeout_s=10)}, base_dir=ROOT) as box:
        result = await box.call(ToolCall(name="search", arguments={"query": "alloy of copper and tin"}, raw=""))
    assert result.status == "ok" and result.text.startswith("Doc 1 (Title: Bronze")


# ------------------------------------------------------------------------------ Search-R1 data (GPU recipe)
def test_flashrag_rows_become_verl_rows():
    from factory.examples.search_data import INSTRUCTIONS, to_row

    row = to_row({"id": "train_0", "question": " who got the first nobel prize in physics ",
                  "golden_answers": ["Wilhelm Conrad Röntgen"], "metadata": {}}, 0, "nq", "train")
    assert row == {
        "data_source": "nq",
        "prompt": [{"role": "user", "content": INSTRUCTIONS + "who got the first nobel prize in physics?"}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": ["Wilhelm Conrad Röntgen"]}},
        "extra_info": {"split": "train", "index": 0},
        "question": "who got the first nobel prize in physics?",
        "golden_answers": ["Wilhelm Conrad Röntgen"],
    }
    assert to_row({"question": "Is it?", "golden_answers": "yes"}, 3, "hotpotqa", "dev")["golden_answers"] == ["yes"]
    with pytest.raises(ValueError, match="no golden answer"):
        to_row({"question": "q", "golden_answers": [" "]}, 1, "nq", "train")


def test_search_r1_data_and_retriever_overrides_compile(tmp_path, monkeypatch):
    """The command docs/gallery/deepsearch.md gives for NQ + HotpotQA and the e5 retriever compiles."""
    import pyarrow.parquet as pq

    from factory.compiler.compile import compile_file
    from factory.examples.search_data import build, write

    examples = {"nq": {"train": [{"question": "capital of france", "golden_answers": ["Paris"]},
                                 {"question": "no answer", "golden_answers": []}],
                       "dev": [{"question": "largest ocean", "golden_answers": ["Pacific", "Pacific Ocean"]}]},
                "hotpotqa": {"train": [{"question": "q2?", "golden_answers": ["a2"]}],
                             "test": [{"question": "q3", "golden_answers": ["a3"]}]}}
    rows = build(examples, test_size=4)
    assert [r["question"] for r in rows["train"]] == ["capital of france?", "q2?"]  # the unanswerable row skipped
    assert sorted(r["data_source"] for r in rows["test"]) == ["hotpotqa", "nq"]
    paths = write(rows, tmp_path / "data" / "nq_hotpotqa")
    assert pq.read_table(paths["train"]).column("golden_answers").to_pylist() == [["Paris"], ["a2"]]
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # the spec's GPUs are a cluster's, not this machine's
    page = (ROOT / "docs/gallery/deepsearch.md").read_text()
    block = re.search(r"```yaml[^\n]*\n(data:\n.*?)```", page, re.DOTALL).group(1)
    spec = yaml.safe_load((ROOT / "specs/deepsearch-qwen3-4b.yaml").read_text())
    spec.update(yaml.safe_load(block))
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs/nq.yaml").write_text(yaml.safe_dump(spec))
    (tmp_path / "prompts").symlink_to(ROOT / "prompts")
    monkeypatch.chdir(tmp_path)
    compiled, _ = compile_file(tmp_path / "specs/nq.yaml")
    assert compiled.data.train.path == "data/nq_hotpotqa/train.parquet" and compiled.data.answer_key == "golden_answers"
    assert compiled.tools["search"].args[-1] == "http://127.0.0.1:8000/retrieve"
