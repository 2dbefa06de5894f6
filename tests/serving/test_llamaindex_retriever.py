"""car_fl.serving.llamaindex_retriever: LlamaIndex's BaseRetriever over a checkpoint in-process.

Sync and async answer exactly what ``load_retriever(...).retrieve`` returns as
``NodeWithScore`` (car-fl's score, rank in metadata). llama-index-core is an optional extra
that CI does not install: without it these tests skip, naming the install command.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip(
    "llama_index.core", reason='needs llama-index-core: pip install -e ".[llamaindex]"'
)

from car_fl.heads.scorer import Retrieval
from car_fl.serving.checkpoint import load_retriever
from car_fl.serving.llamaindex_retriever import CarFlLlamaRetriever
from tests.serving.test_retrieval_api import QUERIES


def assert_nodes(nodes: list, want: Retrieval) -> None:
    """Nodes with scores equal to one ``Retrieval`` of ``load_retriever``."""
    assert [n.node.node_id for n in nodes] == list(want.labels)
    assert [n.node.get_content() for n in nodes] == list(want.documents)
    for rank, (node, score) in enumerate(zip(nodes, want.scores, strict=True), 1):
        assert abs(node.score - score) <= 1e-6 and node.node.metadata["rank"] == rank
        assert node.node.metadata["title"] == f"Title of {node.node.node_id}"


def test_in_process_it_returns_what_load_retriever_retrieves_sync_and_async(
    checkpoint: Path,
) -> None:
    retriever = CarFlLlamaRetriever.from_checkpoint(checkpoint, k=3, device="cpu")
    loaded = load_retriever(checkpoint, device="cpu")
    for query in QUERIES:  # one query a call, as the framework asks
        [expected] = loaded.retrieve([query], 3)
        assert_nodes(retriever.retrieve(query), expected)
        assert_nodes(asyncio.run(retriever.aretrieve(query)), expected)
    with pytest.raises(ValueError, match="k must be >= 1"):
        CarFlLlamaRetriever(retriever.source, k=0)
