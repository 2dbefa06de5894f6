"""Corpus splits: per-document held-out queries, no query text in two splits, new documents."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from car_fl.data.corpus import CorpusQuery, Document
from car_fl.data.corpus_splits import assign_splits, phrase_in, split_corpus, words
from car_fl.data.dedupe import duplicate_key
from car_fl.data.partition import partition
from car_fl.data.splits import load_splits
from car_fl.settings.schema import DatasetConfig, Partitioning


def test_splits_by_position_when_the_file_names_none() -> None:
    queries = [CorpusQuery(f"q{i}", d) for i, d in enumerate("aaaabbc")]
    assert assign_splits(queries) == [
        *("train", "train", "validation", "test"),  # a: 4 queries
        *("train", "test"),  # b: 2 queries, no validation
        "test",  # c: 1 query
    ]


def test_duplicates_collapse_and_conflicts_leave_every_split() -> None:
    docs = [Document("a", "alpha text"), Document("b", "beta text")]
    queries = [
        CorpusQuery("Same  Words", "a", "train"),
        CorpusQuery("same words", "a", "train"),  # a copy: collapses
        CorpusQuery("shared", "a", "train"),
        CorpusQuery("SHARED", "a", "test"),  # cross-split: both go
        CorpusQuery("two docs", "a", "validation"),
        CorpusQuery("two docs", "b", "validation"),  # two documents: both go
        CorpusQuery("alpha", "a", "test"),  # inside its own document: goes
        CorpusQuery("beta question", "b", "test"),
    ]
    split = split_corpus(docs, queries, new_fraction=0.0, seed=0)
    assert split.texts == {"train": ["Same  Words"], "validation": [], "test": ["beta question"]}
    assert split.stats["duplicates_removed"] == 1
    assert split.stats["conflicting_or_cross_split_removed"] == 4
    assert split.stats["heldout_in_document_removed"] == 1


def test_a_held_out_query_goes_only_when_its_words_stand_whole_in_its_document() -> None:
    docs = [Document("a", "Education of the alpha-beta kind (BERT)."), Document("b", "other")]
    queries = [
        CorpusQuery("cat", "a", "test"),  # letters inside "education", not a word: stays
        CorpusQuery("Alpha-beta KIND!", "a", "validation"),  # whole words, in order: goes
        CorpusQuery("kind alpha-beta", "a", "test"),  # its words, out of order: stays
        CorpusQuery("the alpha", "a", "test"),  # words of "the alpha-beta": goes
        CorpusQuery("OF THE", "a", "test"),  # whole words, in order: goes
        CorpusQuery("BERT", "a", "test"),  # a word in brackets: goes
        CorpusQuery("of education", "a", "test"),  # its words, out of order: stays
    ]
    split = split_corpus(docs, queries, new_fraction=0.0, seed=0)
    assert split.texts["test"] == ["cat", "kind alpha-beta", "of education"]
    assert split.texts["validation"] == []
    assert split.stats["heldout_in_document_removed"] == 4


texts = st.text(alphabet="abcAB ", min_size=1, max_size=6).filter(lambda t: t.strip())


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(texts, st.integers(0, 3), st.sampled_from(["train", "validation", "test"])),
        min_size=1,
        max_size=40,
    ),
    st.floats(0.0, 0.9),
)
def test_no_query_text_is_in_two_splits_and_new_documents_have_no_train_query(
    rows: list[tuple[str, int, str]], new_fraction: float
) -> None:
    docs = [Document(f"d{i}", f"document number {i}") for i in range(4)]
    queries = [CorpusQuery(t, f"d{d}", s) for t, d, s in rows]
    split = split_corpus(docs, queries, new_fraction=new_fraction, seed=3)
    seen = {s: {duplicate_key(t) for t in split.texts[s]} for s in split.texts}
    assert not seen["train"] & seen["validation"]
    assert not seen["train"] & seen["test"]
    assert not seen["validation"] & seen["test"]
    assert not set(split.documents["train"]) & split.new_documents
    assert len(split.new_documents) == round(new_fraction * 4)
    for s in ("validation", "test"):
        for t, d in zip(split.texts[s], split.documents[s], strict=True):
            assert not phrase_in(t, words(docs[d].text))


def write_corpus(folder: Path, *, docs: int = 30, per_doc: int = 5) -> DatasetConfig:
    topics = ["math", "physics", "biology"]
    with (folder / "documents.jsonl").open("w") as handle:
        for i in range(docs):
            row = {
                "id": f"p{i}",
                "text": f"paper {i} body",
                "metadata": {"category": topics[i % 3]},
            }
            handle.write(json.dumps(row) + "\n")
    with (folder / "queries.jsonl").open("w") as handle:
        for i in range(docs):
            for j in range(per_doc):
                handle.write(
                    json.dumps({"query": f"question {j} on {i}", "document_id": f"p{i}"}) + "\n"
                )
    return DatasetConfig(
        name="c",
        reader="corpus",  # type: ignore[arg-type]  # parsed by __post_init__
        hub_id=None,
        path=str(folder / "queries.jsonl"),
        documents_path=str(folder / "documents.jsonl"),
        new_fraction=0.2,
    )


def test_load_splits_reads_a_corpus_with_documents_as_labels(tmp_path: Path) -> None:
    cfg = write_corpus(tmp_path)
    splits = load_splits(cfg, seed=1)
    assert splits.label_map.names == tuple(f"p{i}" for i in range(30))  # file order
    assert splits.documents is not None and splits.documents[4].text == "paper 4 body"
    assert len(splits.new_documents) == 6
    assert len(splits.test) == len(splits.validation) == 30
    assert len(splits.train) == 24 * 3  # 3 train queries per old document
    assert not set(splits.train["label"]) & splits.new_documents
    assert set(splits.train["topic"]) == {"math", "physics", "biology"}
    assert load_splits(cfg, seed=1).new_documents == splits.new_documents
    assert load_splits(cfg, seed=2).new_documents != splits.new_documents


def test_a_client_with_other_documents_is_refused(tmp_path: Path) -> None:
    cfg = write_corpus(tmp_path)
    server = load_splits(cfg, seed=1).label_map
    (tmp_path / "other").mkdir()
    other = write_corpus(tmp_path / "other", docs=31)
    with pytest.raises(ValueError, match=r"differ from the server's corpus \(31 here, 30 there\)"):
        load_splits(other, seed=1, label_map=server)


def test_topic_shards_are_skewed_by_topic_and_cover_train_once(tmp_path: Path) -> None:
    splits = load_splits(write_corpus(tmp_path, docs=60), seed=1)
    shards = [
        partition(
            splits.train,
            partition_id=i,
            num_partitions=3,
            scheme=Partitioning.TOPIC,
            alpha=0.1,
            seed=0,
        )
        for i in range(3)
    ]
    assert sum(len(s) for s in shards) == len(splits.train)
    mixes = [Counter(s["topic"]) for s in shards]
    assert any(max(m.values()) > 0.6 * sum(m.values()) for m in mixes)  # skewed, not IID
    with pytest.raises(ValueError, match=r"fl.partitioning=topic needs a corpus"):
        partition(splits.test, partition_id=0, num_partitions=2, scheme=Partitioning.TOPIC, seed=0)


def test_the_arxiv_script_writes_a_corpus_whose_held_out_sentences_leave_the_document(
    tmp_path: Path,
) -> None:
    import subprocess
    import sys

    papers = [
        {
            "id": "0704.0001",
            "title": "A  title of paper one",
            "abstract": "First sentence here is long. As in Fig. 2 a second one. The third "
            "sentence is this. The fourth and last sentence.",
            "categories": "hep-ph math.CO",
        },
        {
            "id": "0704.0002",
            "title": "Short",
            "abstract": "Only one sentence in it.",
            "categories": "cs.LG",
        },
    ]
    source = tmp_path / "arxiv.jsonl"
    source.write_text("".join(json.dumps(p) + "\n" for p in papers))
    script = Path(__file__).resolve().parents[2] / "scripts" / "arxiv_corpus.py"
    subprocess.run([sys.executable, str(script), str(source), str(tmp_path)], check=True)
    docs = [json.loads(line) for line in (tmp_path / "documents.jsonl").open()]
    queries = [json.loads(line) for line in (tmp_path / "queries.jsonl").open()]
    assert (
        docs[0]["text"]
        == "A title of paper one. First sentence here is long. As in Fig. 2 a second one."
    )
    assert docs[0]["metadata"] == {"category": "hep-ph"}
    assert [(q["query"], q["split"]) for q in queries if q["document_id"] == "0704.0001"] == [
        ("A title of paper one", "train"),
        ("First sentence here is long.", "train"),
        ("As in Fig. 2 a second one.", "train"),
        ("The third sentence is this.", "validation"),
        ("The fourth and last sentence.", "test"),
    ]
    # "Short" has fewer than 3 words: dropped; the single sentence is the test query
    assert [(q["query"], q["split"]) for q in queries if q["document_id"] == "0704.0002"] == [
        ("Only one sentence in it.", "test")
    ]


def test_generated_queries_join_train_on_the_terms_of_pseudo_queries() -> None:
    """Rule 6: a model's query is a training query, never for a new document, never a held-out
    text, never one two documents share (with each other or with a pseudo-query)."""
    docs = [Document(f"d{i}", f"doc {i} text words here") for i in range(4)]
    queries = [CorpusQuery("real d0", "d0", "train"), CorpusQuery("held out", "d1", "test")]
    generated = [
        CorpusQuery("about d0", "d0"),
        CorpusQuery("About  D0", "d0"),  # the same text again: once
        CorpusQuery("held out", "d2"),  # a held-out text: dropped
        CorpusQuery("shared", "d2"),  # two documents: no right answer
        CorpusQuery("shared", "d3"),
        CorpusQuery("about d3", "d3"),
    ]
    split = split_corpus(docs, queries, new_fraction=0.0, seed=0, generated=generated)
    pairs = list(zip(split.texts["train"], split.documents["train"], strict=True))
    assert pairs == [("real d0", 0), ("about d0", 0), ("about d3", 3)]
    assert split.stats["generated_queries"] == 2 and split.stats["pseudo_queries"] == 0
    assert split.texts["test"] == ["held out"]
    newer = split_corpus(docs, queries, new_fraction=0.5, seed=0, generated=generated)
    assert newer.new_documents == {0, 2}  # their queries never count, "shared" is d3's alone
    pairs = list(zip(newer.texts["train"], newer.documents["train"], strict=True))
    assert pairs == [("shared", 3), ("about d3", 3)]
