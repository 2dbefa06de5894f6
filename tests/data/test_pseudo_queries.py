"""car_fl.data.pseudo_queries and rule 5 of the corpus splits: a document's own words as
training queries, never a held-out text, none for new documents."""

from __future__ import annotations

import pytest

from car_fl.data.corpus import CorpusQuery, Document
from car_fl.data.corpus_splits import split_corpus
from car_fl.data.dedupe import duplicate_key
from car_fl.data.pseudo_queries import extractive_queries
from car_fl.settings.schema import DatasetConfig

TEXT = "one two three four five six seven eight nine ten"


def test_windows_are_the_documents_own_words_seeded_and_distinct() -> None:
    pairs = extractive_queries([TEXT, "too short", TEXT], per_document=3, words=4, seed=0)
    assert [d for _, d in pairs] == [0, 0, 0, 2, 2, 2]  # the short document gives none
    for text, _ in pairs:
        assert len(text.split()) == 4 and text in TEXT
    assert len({t for t, d in pairs if d == 0}) == 3
    assert pairs == extractive_queries([TEXT, "too short", TEXT], per_document=3, words=4, seed=0)
    other = extractive_queries([TEXT], per_document=3, words=4, seed=1)
    assert [t for t, _ in other] != [t for t, d in pairs if d == 0]
    every = extractive_queries([TEXT], per_document=50, words=4, seed=0)
    assert len(every) == 7  # all the windows there are
    assert extractive_queries([TEXT], per_document=2, words=4, seed=0, skip=frozenset({0})) == []
    with pytest.raises(ValueError, match="per_document must be >= 0"):
        extractive_queries([TEXT], per_document=-1, seed=0)


def test_pseudo_queries_join_train_after_the_real_ones_and_never_a_held_out_text() -> None:
    docs = [Document(f"d{i}", " ".join(f"t{i}_{k}" for k in range(10))) for i in range(6)]
    held_out = "t2_1 t2_2 t2_3 t2_4"  # d1's test query: a window of d2's text, not of d1's
    queries = [
        CorpusQuery("first real", "d1", "train"),
        CorpusQuery(held_out, "d1", "test"),
        CorpusQuery("another", "d2", "validation"),
    ]
    plain = split_corpus(docs, queries, new_fraction=0.0, seed=0)
    assert plain.texts["train"] == ["first real"] and held_out in plain.texts["test"]
    split = split_corpus(
        docs, queries, new_fraction=0.0, seed=0, pseudo_queries=40, pseudo_query_words=4
    )
    train = split.texts["train"]
    assert train[0] == "first real" and held_out in split.texts["test"]
    assert duplicate_key(held_out) not in {duplicate_key(t) for t in train}  # d2's window dropped
    assert len(train) == 1 + 6 * 7 - 1 == 1 + split.stats["pseudo_queries"]
    for text, doc in zip(train[1:], split.documents["train"][1:], strict=True):
        assert text in docs[doc].text
    newer = split_corpus(
        docs, queries, new_fraction=0.5, seed=0, pseudo_queries=40, pseudo_query_words=4
    )
    assert len(newer.new_documents) == 3
    assert not set(newer.documents["train"]) & newer.new_documents  # none for new documents


def test_a_window_two_documents_share_has_no_right_answer_and_is_dropped() -> None:
    docs = [Document("a", "x y z w unique1"), Document("b", "x y z w unique2")]
    split = split_corpus(docs, [], new_fraction=0.0, seed=0, pseudo_queries=5, pseudo_query_words=4)
    assert "x y z w" not in split.texts["train"]
    assert sorted(split.texts["train"]) == ["y z w unique1", "y z w unique2"]


def test_pseudo_queries_need_a_corpus() -> None:
    with pytest.raises(ValueError, match=r"dataset.pseudo_queries=2 .*dataset=corpus"):
        DatasetConfig(name="t", path="x.tsv", pseudo_queries=2)
