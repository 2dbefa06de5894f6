"""car-fl's retriever as a LlamaIndex ``BaseRetriever`` (``pip install -e ".[llamaindex]"``).

:class:`CarFlLlamaRetriever` returns per query the top ``k`` documents as ``NodeWithScore``
(car-fl's score and fields in ``metadata``), in-process or from ``car-fl serve``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from car_fl.serving.retrieval_api import QueryResult
from car_fl.serving.retrieval_client import Source, metadata, source


def nodes_of(result: QueryResult) -> list[NodeWithScore]:
    """One query's car-fl result as LlamaIndex nodes with their scores, best first."""
    return [
        NodeWithScore(
            node=TextNode(id_=d.id, text=d.text, metadata=metadata(d, result.score_kind)),
            score=d.score,
        )
        for d in result.documents
    ]


class CarFlLlamaRetriever(BaseRetriever):
    """The top ``k`` documents of a car-fl retriever, in-process or from its endpoint."""

    def __init__(self, found: Source, *, k: int = 4) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        super().__init__()
        self.source, self.k = found, k

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, *, k: int = 4, device: str = "auto"
    ) -> CarFlLlamaRetriever:
        """A retriever loaded in this process from a car-fl checkpoint folder."""
        return cls(source(checkpoint=path, device=device), k=k)

    @classmethod
    def from_endpoint(
        cls, url: str, *, k: int = 4, token: str | None = None, ca_file: str | None = None
    ) -> CarFlLlamaRetriever:
        """The retriever that ``car-fl serve`` runs at ``url`` (``ca_file``: a private CA)."""
        return cls(source(url=url, token=token, ca_file=ca_file), k=k)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        k = min(self.k, self.source.documents())
        [result] = self.source.retrieve([query_bundle.query_str], k)
        return nodes_of(result)

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        k = min(self.k, await asyncio.to_thread(self.source.documents))  # asked once, kept
        [result] = await self.source.aretrieve([query_bundle.query_str], k)
        return nodes_of(result)
