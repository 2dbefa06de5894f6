"""car-fl's retriever as a LangChain ``BaseRetriever`` (``pip install -e ".[langchain]"``).

:class:`CarFlRetriever` returns per query the top ``k`` documents as ``Document`` objects (the
text, the document id, car-fl's fields in ``metadata``), in-process or from ``car-fl serve``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForRetrieverRun,
    CallbackManagerForRetrieverRun,
)
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, Field

from car_fl.serving.retrieval_api import QueryResult
from car_fl.serving.retrieval_client import Source, metadata, source


def documents_of(result: QueryResult) -> list[Document]:
    """One query's car-fl result as LangChain documents, best first."""
    return [
        Document(page_content=d.text, id=d.id, metadata=metadata(d, result.score_kind))
        for d in result.documents
    ]


class CarFlRetriever(BaseRetriever):
    """The top ``k`` documents of a car-fl retriever, in-process or from its endpoint."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    source: Any = Field(description="a car_fl.serving.retrieval_client.Source")
    k: int = Field(default=4, ge=1)

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, *, k: int = 4, device: str = "auto"
    ) -> CarFlRetriever:
        """A retriever loaded in this process from a car-fl checkpoint folder."""
        return cls(source=source(checkpoint=path, device=device), k=k)

    @classmethod
    def from_endpoint(
        cls, url: str, *, k: int = 4, token: str | None = None, ca_file: str | None = None
    ) -> CarFlRetriever:
        """The retriever that ``car-fl serve`` runs at ``url`` (``ca_file``: a private CA)."""
        return cls(source=source(url=url, token=token, ca_file=ca_file), k=k)

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        found: Source = self.source
        [result] = found.retrieve([query], min(self.k, found.documents()))
        return documents_of(result)

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun
    ) -> list[Document]:
        found: Source = self.source
        served = await asyncio.to_thread(found.documents)  # asked once, then kept
        [result] = await found.aretrieve([query], min(self.k, served))
        return documents_of(result)
