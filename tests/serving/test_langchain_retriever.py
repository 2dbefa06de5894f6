"""car_fl.serving.langchain_retriever: LangChain's BaseRetriever over a checkpoint in-process.

Sync and async answer exactly what ``load_retriever(...).retrieve`` returns, car-fl's score and
rank in each document's metadata (against the endpoint: tests/serving/test_retrieval_service.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("langchain_core", reason='needs langchain-core: pip install -e ".[langchain]"')

from car_fl.heads.scorer import Retrieval
from car_fl.serving.checkpoint import load_retriever
from car_fl.serving.langchain_retriever import CarFlRetriever
from car_fl.serving.retrieval_client import source
from tests.serving.test_retrieval_api import QUERIES


def assert_documents(documents: list, want: Retrieval) -> None:
    """LangChain documents equal to one ``Retrieval`` of ``load_retriever``."""
    assert [d.id for d in documents] == list(want.labels)
    assert [d.page_content for d in documents] == list(want.documents)
    for rank, (doc, score) in enumerate(zip(documents, want.scores, strict=True), 1):
        assert doc.metadata["rank"] == rank and doc.metadata["id"] == doc.id
        assert abs(doc.metadata["score"] - score) <= 1e-6
        assert (
            doc.metadata["score_kind"] == want.score_kind
            and doc.metadata["title"] == f"Title of {doc.id}"
        )


def test_in_process_it_returns_what_load_retriever_retrieves_sync_and_async(
    checkpoint: Path,
) -> None:
    retriever = CarFlRetriever.from_checkpoint(checkpoint, k=4, device="cpu")
    loaded = load_retriever(checkpoint, device="cpu")
    for query in QUERIES:  # one query a call, as the framework asks
        [expected] = loaded.retrieve([query], 4)
        assert_documents(retriever.invoke(query), expected)
        assert_documents(asyncio.run(retriever.ainvoke(query)), expected)


def test_it_needs_exactly_one_source_and_a_positive_k(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        source()
    with pytest.raises(ValueError, match="exactly one"):
        source(checkpoint=checkpoint, url="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        CarFlRetriever.from_endpoint("http://127.0.0.1:1", k=0)


def test_a_k_above_the_documents_returns_them_all_and_a_blank_query_is_refused_as_served(
    checkpoint: Path,
) -> None:
    from car_fl.serving.retrieval_client import EndpointError

    retriever = CarFlRetriever.from_checkpoint(checkpoint, k=50, device="cpu")
    assert len(retriever.invoke(QUERIES[0])) == 12  # the checkpoint's documents
    for blank in ("", "   ", "\u200b\u200b", "\x00\x00", "\ufeff"):
        with pytest.raises(EndpointError, match=r"query 0 is empty") as err:
            retriever.invoke(blank)
        assert err.value.status == 422
