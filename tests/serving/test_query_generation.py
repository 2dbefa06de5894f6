"""car_fl.serving.query_generation: queries the causal LM writes, kept by a round trip."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from car_fl.data.corpus import Document
from car_fl.heads.scorer import Hit
from car_fl.serving.query_generation import (
    GeneratedQuery,
    clean_query,
    generate_queries,
    prompt_for,
    round_trip,
)
from car_fl.serving.rag import load_generator


def test_a_generated_text_becomes_one_clean_line() -> None:
    assert clean_query('Query: "federated learning with DP"\nmore text') == (
        "federated learning with DP"
    )
    assert clean_query("\n\n  search query -  sparse   attention ") == "sparse attention"
    assert clean_query("Text: Equivariant Phantom") == "Equivariant Phantom"  # the prompt's echo
    assert clean_query("   \n ") == ""


def test_sampling_is_seeded_per_document_and_names_each_queries_document(
    tiny_generator: Path,
) -> None:
    generator = load_generator(str(tiny_generator), device="cpu", dtype="float32")
    docs = [Document(f"d{i}", f"k{i} w{i} w{i + 20} about topic {i}") for i in range(3)]
    first = generate_queries(generator, docs, per_document=3, seed=0, max_new_tokens=6)
    again = generate_queries(generator, docs, per_document=3, seed=0, max_new_tokens=6)
    other = generate_queries(generator, docs, per_document=3, seed=1, max_new_tokens=6)
    assert first == again and first != other
    assert {q.document_id for q in first} <= {"d0", "d1", "d2"}
    for doc in ("d0", "d1", "d2"):
        texts = [q.text.casefold() for q in first if q.document_id == doc]
        assert len(texts) <= 3 and len(set(texts)) == len(texts)  # distinct per document
    assert all(q.text and q.rank is None for q in first)
    # the document alone goes into the prompt, cut to the token budget
    assert "k1 w1 w21" in prompt_for(generator, docs[1].text)
    long = " ".join(f"w{i}" for i in range(400))
    assert "w399" not in prompt_for(generator, long, document_tokens=16)
    with pytest.raises(ValueError, match="per_document"):
        generate_queries(generator, docs, per_document=0, seed=0)


@dataclass
class _Result:
    hits: list[Hit]


class _Ranker:
    """Ranks documents by how many of their id's characters the query holds (a stand-in)."""

    def __init__(self, ids: Sequence[str]) -> None:
        self.ids = list(ids)
        self.asked: list[int] = []

    def retrieve(self, texts: Sequence[str], k: int) -> list[_Result]:
        self.asked.append(len(texts))
        out = []
        for text in texts:
            order = sorted(self.ids, key=lambda d: (-(d in text.split()), d))
            out.append(_Result([Hit(d, d, 0.0) for d in order[:k]]))
        return out


def test_the_round_trip_keeps_a_query_only_if_its_document_comes_back_in_the_top_k() -> None:
    ranker = _Ranker(["a", "b", "c", "d"])
    queries = [
        GeneratedQuery("about a", "a"),  # a first: kept at rank 1
        GeneratedQuery("about b", "c"),  # b first, c third of the rest: depends on k
        GeneratedQuery("nothing", "d"),  # alphabetical: d last
    ]
    kept = round_trip(ranker, queries, keep_top_k=1, batch=2)  # type: ignore[arg-type]
    assert kept == [GeneratedQuery("about a", "a", 1)]
    assert ranker.asked == [2, 1]  # in batches
    wider = round_trip(ranker, queries, keep_top_k=3)  # type: ignore[arg-type]
    assert wider == [GeneratedQuery("about a", "a", 1), GeneratedQuery("about b", "c", 3)]
    with pytest.raises(ValueError, match="keep_top_k"):
        round_trip(ranker, queries, keep_top_k=0)  # type: ignore[arg-type]
