"""Where the LangChain and LlamaIndex retrievers get their documents: in-process or the endpoint.

:class:`InProcess` runs a loaded :class:`~car_fl.model.retriever.CaRRetriever` in this process;
:class:`Endpoint` asks a running ``car-fl serve`` over HTTP(S), with its token. Both answer
``retrieve(queries, k)`` (and ``aretrieve``) with the same
:class:`~car_fl.serving.retrieval_api.QueryResult` list, so a framework's retriever is one
class whichever it uses. An endpoint's refusal is an :class:`EndpointError` with its status
and the message naming the field.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from car_fl.serving.retrieval_api import (
    QueryResult,
    RetrievedDocument,
    RetrieveResponse,
    corpus_titles,
    results_of,
)

if TYPE_CHECKING:
    from car_fl.model.retriever import CaRRetriever


class Source(Protocol):
    """Something that gives each query its top-k documents."""

    def retrieve(self, queries: list[str], k: int) -> list[QueryResult]: ...

    async def aretrieve(self, queries: list[str], k: int) -> list[QueryResult]: ...


class InProcess:
    """A retriever loaded in this process (its encoder in this process's memory)."""

    def __init__(self, retriever: CaRRetriever) -> None:
        self.retriever = retriever
        self.titles = corpus_titles(retriever)

    @classmethod
    def from_checkpoint(cls, path: str | Path, *, device: str = "auto") -> InProcess:
        from car_fl.serving.checkpoint import load_retriever

        return cls(load_retriever(path, device=device))

    def retrieve(self, queries: list[str], k: int) -> list[QueryResult]:
        return results_of(self.retriever.retrieve(queries, k), self.titles)

    async def aretrieve(self, queries: list[str], k: int) -> list[QueryResult]:
        return await asyncio.to_thread(self.retrieve, queries, k)


class EndpointError(RuntimeError):
    """The endpoint refused a request or could not be reached: its status and its message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"car-fl serve answered {status}: {message}")
        self.status = status


class Endpoint:
    """A running ``car-fl serve`` at ``url`` (e.g. ``http://127.0.0.1:8300``)."""

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout_s = timeout_s

    def _answer(self, response: Any) -> list[QueryResult]:
        if response.status_code != 200:
            try:
                message = str(response.json().get("detail"))
            except ValueError:
                message = response.text[:200]
            raise EndpointError(response.status_code, message)
        return RetrieveResponse.model_validate_json(response.content).results

    def retrieve(self, queries: list[str], k: int) -> list[QueryResult]:
        import httpx

        response = httpx.post(
            f"{self.url}/retrieve",
            json={"queries": queries, "k": k},
            headers=self.headers,
            timeout=self.timeout_s,
        )
        return self._answer(response)

    async def aretrieve(self, queries: list[str], k: int) -> list[QueryResult]:
        import httpx

        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            response = await client.post(
                f"{self.url}/retrieve", json={"queries": queries, "k": k}, headers=self.headers
            )
        return self._answer(response)

    def health(self) -> dict[str, Any]:
        import httpx

        response = httpx.get(f"{self.url}/health", headers=self.headers, timeout=self.timeout_s)
        if response.status_code != 200:
            raise EndpointError(response.status_code, response.text[:200])
        health: dict[str, Any] = response.json()
        return health


def source(
    *,
    checkpoint: str | Path | None = None,
    url: str | None = None,
    token: str | None = None,
    device: str = "auto",
) -> Source:
    """A checkpoint loaded here, or the endpoint at ``url``: exactly one of the two."""
    if (checkpoint is None) == (url is None):
        raise ValueError("give exactly one of checkpoint= (in-process) and url= (car-fl serve)")
    if url is not None:
        return Endpoint(url, token=token)
    assert checkpoint is not None
    return InProcess.from_checkpoint(checkpoint, device=device)


def metadata(document: RetrievedDocument, score_kind: str) -> dict[str, Any]:
    """What a framework's document carries of car-fl's answer: id, rank, score and its kind,
    probability, and the title where the corpus has one."""
    found: dict[str, Any] = {
        "id": document.id,
        "rank": document.rank,
        "score": document.score,
        "score_kind": score_kind,
        "probability": document.probability,
    }
    if document.title is not None:
        found["title"] = document.title
    return found
