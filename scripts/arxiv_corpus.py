"""Turn arXiv metadata (JSON lines: id, title, abstract, categories) into a retrieval corpus.

    python scripts/arxiv_corpus.py ../shared/data/arxiv_dev/arxiv_dev.jsonl corpus/arxiv_dev

Papers are documents; the title and the abstract's sentences are queries. Per paper the last
abstract sentence is the test query, the one before it the validation query, the rest (title
included) train; the document's text is the title and the abstract *without* the validation
and test sentences, so a held-out query is never inside its document. Queries of fewer than
3 words are dropped ("(abridged)"). Writes ``documents.jsonl`` (id, title, text, metadata
with the primary category) and ``queries.jsonl`` (query, document_id, split) for
``dataset=corpus``; duplicates across splits or documents and the new documents are car-fl's
(:mod:`car_fl.data.corpus_splits`).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

ABBREVIATION = re.compile(
    r"(\b(e\.g|i\.e|et al|etc|cf|vs|resp|Fig|Figs|Eq|Eqs|Ref|Refs|Sec|Secs|Dr|Mr|Prof|approx|"
    r"no|Nos|ca|viz|al|St|Jr|Ch|Tab|Thm|Prop|Lem|Def|Cor|Vol|pp)\.)$",
    re.IGNORECASE,
)
MIN_WORDS = 3


def split_sentences(text: str) -> list[str]:
    """Sentences: a boundary is . ! or ? then whitespace and an upper-case letter, digit, $, (,
    [ or a quote; not after a common abbreviation or an initial; fragments of < 3 words join
    the sentence before them."""
    parts = re.split(r"(?<=[.!?])\s+(?=[A-Z0-9$(\[\"'`\\])", text)
    out: list[str] = []
    for part in (p.strip() for p in parts):
        if not part:
            continue
        after_abbreviation = bool(out) and bool(
            ABBREVIATION.search(out[-1]) or re.search(r"\b[A-Z]\.$", out[-1])
        )
        if out and (after_abbreviation or len(part.split()) < MIN_WORDS):
            out[-1] = f"{out[-1]} {part}"
        else:
            out.append(part)
    return out


def paper_records(paper: dict[str, str]) -> tuple[dict[str, object], list[dict[str, str]]]:
    """One paper's document and its queries."""
    doc_id = str(paper["id"])
    title = " ".join(str(paper["title"]).split())
    sentences = split_sentences(" ".join(str(paper["abstract"]).split()))
    test = sentences[-1] if sentences else None
    validation = sentences[-2] if len(sentences) >= 2 else None
    earlier = sentences[:-2]
    text = f"{title}. {' '.join(earlier)}" if earlier else f"{title}."
    category = str(paper["categories"]).split()[0]
    document = {"id": doc_id, "title": title, "text": text, "metadata": {"category": category}}
    queries = [(title, "train"), *((s, "train") for s in earlier)]
    queries += [(q, split) for q, split in ((validation, "validation"), (test, "test")) if q]
    return document, [
        {"query": q, "document_id": doc_id, "split": split}
        for q, split in queries
        if len(q.split()) >= MIN_WORDS
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="arXiv metadata, JSON lines")
    parser.add_argument("out", type=Path, help="folder for documents.jsonl and queries.jsonl")
    parser.add_argument("--limit", type=int, default=None, help="only the first N papers")
    parser.add_argument(
        "--sample", type=int, default=None, help="a seeded random sample of N papers (file order)"
    )
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed (0)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    documents, queries = [], []
    with args.source.open(encoding="utf-8") as handle:
        lines = [(n, line) for n, line in enumerate(handle, start=1) if line.strip()]
    if args.sample is not None:
        if not 0 < args.sample <= len(lines):
            parser.error(f"--sample must be in 1..{len(lines)} (the papers in {args.source})")
        kept = set(random.Random(args.seed).sample(range(len(lines)), args.sample))
        lines = [item for i, item in enumerate(lines) if i in kept]
    for number, line in lines:
        try:
            paper = json.loads(line)
            document, paper_queries = paper_records(paper)
        except (json.JSONDecodeError, KeyError) as err:
            raise SystemExit(f"{args.source}, line {number}: {err!r}") from err
        documents.append(document)
        queries.extend(paper_queries)
        if args.limit is not None and len(documents) >= args.limit:
            break
    for name, rows in (("documents.jsonl", documents), ("queries.jsonl", queries)):
        with (args.out / name).open("w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    splits = {s: sum(q["split"] == s for q in queries) for s in ("train", "validation", "test")}
    print(json.dumps({"documents": len(documents), "queries": splits, "out": str(args.out)}))


if __name__ == "__main__":
    main()
