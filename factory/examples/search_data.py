"""Search-R1's training data (NQ + HotpotQA) as parquet in the verl layout, for the GPU DeepSearch recipe.

    bin/prepare-search-data [--out data/nq_hotpotqa] [--sources nq,hotpotqa] [--test-size 512]

The questions and golden answers come from the Hugging Face dataset `RUC-NLPIR/FlashRAG_datasets`
(configs `nq` and `hotpotqa`, each with train and dev/test splits), as in Search-R1's
`qa_search_train_merge.py`; that needs the `datasets` package and a reachable hub. Each row is written
as verl expects it, plus the flat columns Factory reads:

    data_source   "nq" | "hotpotqa"
    prompt        [{"role": "user", "content": <instructions + question>}]   (verl; Factory renders its own
                                                                              from `question` when the spec
                                                                              sets data.prompt)
    ability       "fact-reasoning"
    reward_model  {"style": "rule", "ground_truth": {"target": [answers]}}
    extra_info    {"split": ..., "index": ...}
    question      the question, stripped, ending with "?"
    golden_answers  [answers]   (`data.answer_key: golden_answers`; factory.rewards.qa accepts a list)

`to_row` is the whole transform, a pure function (tested on hand-made rows); `main` only downloads,
maps and writes.
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

DATASET = "RUC-NLPIR/FlashRAG_datasets"
SOURCES = ("nq", "hotpotqa")
# The user turn verl-style trainers see; it names the MCP tool the way prompts/search_question.jinja does.
INSTRUCTIONS = ("Answer the question below. When you are missing a fact, call the `search` tool with a short "
                "query; its results come back in <tool_response> tags, and you may search again. When you know "
                "the answer, write it inside <answer></answer> tags, as a short phrase with no explanation, for "
                "example <answer>Paris</answer>.\n\nQuestion: ")


def normalize_question(text: str) -> str:
    """Stripped, ending with a question mark (Search-R1's preprocessing)."""
    text = " ".join(str(text).split())
    if not text:
        raise ValueError("empty question")
    return text if text.endswith("?") else text + "?"


def to_row(example: dict[str, Any], index: int, source: str, split: str) -> dict[str, Any]:
    """One FlashRAG example {question, golden_answers, ...} as a verl + Factory row."""
    question = normalize_question(example["question"])
    answers = example.get("golden_answers")
    if isinstance(answers, str):
        answers = [answers]
    answers = [str(a).strip() for a in (answers or []) if str(a).strip()]
    if not answers:
        raise ValueError(f"{source}/{split}#{index}: no golden answer")
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": INSTRUCTIONS + question}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": answers}},
        "extra_info": {"split": split, "index": index},
        "question": question,
        "golden_answers": answers,
    }


def build(examples: dict[str, dict[str, list[dict[str, Any]]]], test_size: int, seed: int = 0
          ) -> dict[str, list[dict[str, Any]]]:
    """{source: {split: [examples]}} -> {"train": rows, "test": rows}. Training rows are every source's
    train split; test rows a seeded sample of `test_size` from the sources' dev (else test) splits, spread
    evenly over the sources. Rows that cannot be used (no answer, empty question) are skipped."""
    out: dict[str, list[dict[str, Any]]] = {"train": [], "test": []}
    rng = random.Random(seed)
    per_source = max(1, test_size // max(1, len(examples)))
    for source, splits in examples.items():
        for i, ex in enumerate(splits.get("train", [])):
            try:
                out["train"].append(to_row(ex, i, source, "train"))
            except (KeyError, ValueError):
                continue
        held = "dev" if splits.get("dev") else "test"
        rows = []
        for i, ex in enumerate(splits.get(held, [])):
            try:
                rows.append(to_row(ex, i, source, held))
            except (KeyError, ValueError):
                continue
        out["test"] += rng.sample(rows, min(per_source, len(rows)))
    return out


def write(rows: dict[str, list[dict[str, Any]]], out_dir: Path) -> dict[str, Path]:
    """train.parquet and test.parquet under out_dir."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, data in rows.items():
        paths[split] = out_dir / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(data), paths[split], compression="zstd")
    return paths


def _download(sources: list[str]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    try:
        import datasets
    except ImportError:
        raise SystemExit("prepare-search-data needs the `datasets` package: pip install datasets") from None
    found: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for source in sources:
        ds = datasets.load_dataset(DATASET, source)
        found[source] = {split: ds[split].to_list() for split in ds}
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/nq_hotpotqa"), help="output folder")
    parser.add_argument("--sources", default=",".join(SOURCES), help="FlashRAG configs, comma-separated")
    parser.add_argument("--test-size", type=int, default=512, help="held-out rows (from the dev splits)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sources = [s for s in args.sources.split(",") if s]
    rows = build(_download(sources), args.test_size, args.seed)
    for split, path in write(rows, args.out).items():
        print(f"{path}: {len(rows[split])} rows")


if __name__ == "__main__":
    main()
