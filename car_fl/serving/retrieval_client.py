"""Where the LangChain and LlamaIndex retrievers get their documents: in-process or the endpoint.

:class:`InProcess` (a loaded retriever) and :class:`Endpoint` (a running ``car-fl serve``)
answer ``retrieve``/``aretrieve`` with the same results, check requests by the endpoint's own
schema (a refusal is the same :class:`EndpointError` in both) and say how many documents they
serve, so a framework's retriever is one class whichever it uses.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import ssl
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from car_fl.serving.retrieval_api import (
    QueryResult,
    RetrievedDocument,
    RetrieveRequest,
    RetrieveResponse,
    corpus_titles,
    field_message,
    results_of,
)

if TYPE_CHECKING:
    from car_fl.model.retriever import CaRRetriever


class Source(Protocol):
    """Something that gives each query its top-k documents."""

    def retrieve(self, queries: list[str], k: int) -> list[QueryResult]: ...

    async def aretrieve(self, queries: list[str], k: int) -> list[QueryResult]: ...

    def documents(self) -> int: ...


class InProcess:
    """A retriever loaded in this process (its encoder in this process's memory)."""

    def __init__(self, retriever: CaRRetriever) -> None:
        self.retriever = retriever
        self.titles = corpus_titles(retriever)

    @classmethod
    def from_checkpoint(cls, path: str | Path, *, device: str = "auto") -> InProcess:
        from car_fl.serving.checkpoint import load_retriever

        return cls(load_retriever(path, device=device))

    def documents(self) -> int:
        return len(self.retriever.label_names or ())

    def retrieve(self, queries: list[str], k: int) -> list[QueryResult]:
        """The endpoint's answer, computed here: refused as the endpoint refuses it."""
        from pydantic import ValidationError

        try:
            RetrieveRequest(queries=queries, k=k)
        except ValidationError as err:
            raise EndpointError(
                422, field_message([{**e, "loc": ("body", *e["loc"])} for e in err.errors()])
            ) from None
        if k > self.documents():
            raise EndpointError(422, f"k: at most the {self.documents()} documents this serves")
        return results_of(self.retriever.retrieve(queries, k), self.titles)

    async def aretrieve(self, queries: list[str], k: int) -> list[QueryResult]:
        return await asyncio.to_thread(self.retrieve, queries, k)


class EndpointError(RuntimeError):
    """The endpoint refused a request, could not be reached or answered something else than
    the schema promises: its status (0: no HTTP answer) and its message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"car-fl serve answered {status}: {message}")
        self.status = status


#: Characters of an endpoint's error message kept (a hostile server's megabyte is cut).
MAX_DETAIL = 500


def checked(results: list[QueryResult], queries: int, k: int) -> list[QueryResult]:
    """``results`` if they are what a car-fl endpoint answers ``queries`` queries at ``k``:
    one result per query, each exactly ``k`` documents ranked 1..k by non-increasing finite
    scores, probabilities in [0, 1]; else :class:`EndpointError` (a server that is not one)."""

    def refuse(what: str) -> EndpointError:
        return EndpointError(200, f"the answer is not a car-fl retrieval: {what}")

    if len(results) != queries:
        raise refuse(f"{len(results)} results for {queries} queries")
    for i, result in enumerate(results):
        docs = result.documents
        if len(docs) != k:
            raise refuse(f"query {i} got {len(docs)} documents, asked for {k}")
        if [d.rank for d in docs] != list(range(1, k + 1)):
            raise refuse(f"query {i}'s ranks are not 1..{k}")
        scores = [d.score for d in docs]
        if not all(math.isfinite(x) for x in scores):
            raise refuse(f"query {i} has a score that is not finite")
        if any(a < b for a, b in itertools.pairwise(scores)):
            raise refuse(f"query {i}'s documents are not best first")
        if any(
            d.probability is not None and not 0.0 <= d.probability <= 1.0 for d in docs
        ):  # NaN fails the comparison too
            raise refuse(f"query {i} has a probability outside [0, 1]")
    return results


class Endpoint:
    """A running ``car-fl serve`` at ``url`` (e.g. ``http://127.0.0.1:8300``).

    ``timeout_s`` bounds a whole request, however slowly the server sends; ``max_reply_bytes``
    bounds the bytes read (a compressed reply is refused); every answer is :func:`checked`.
    Every call runs on one event loop of its own in a daemon thread with one kept-alive HTTP
    client (:meth:`close` ends both)."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout_s: float = 60.0,
        max_reply_bytes: int = 64 << 20,
        ca_file: str | Path | None = None,
    ) -> None:
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 (parses it: a port out of range or not a number raises)
        except ValueError:
            parts = None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"endpoint {url!r} is not http(s)://host:port (car-fl serve's URL)")
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout_s = timeout_s
        self.max_reply_bytes = max_reply_bytes
        self.verify: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=str(ca_file)) if ca_file else True
        )
        self._documents: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: Any = None
        self._lock = threading.Lock()

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        """This endpoint's own loop, started on first use in a daemon thread."""
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(
                    target=loop.run_forever, name="car-fl-endpoint", daemon=True
                ).start()
                self._loop = loop
            return self._loop

    def _http(self) -> Any:
        """The one HTTP client (made on this endpoint's loop, where it is used)."""
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s, verify=self.verify)
        return self._client

    def close(self) -> None:
        """Close the HTTP client's connections and stop the loop (a later call starts anew)."""
        with self._lock:
            loop, client, self._loop, self._client = self._loop, self._client, None, None
        if loop is None:
            return
        if client is not None:
            asyncio.run_coroutine_threadsafe(client.aclose(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:  # never the token
        return f"Endpoint({self.url!r})"

    async def _exchange(self, method: str, path: str, payload: Any = None) -> tuple[int, bytes]:
        """One request's status and raw body: identity encoding only (a compressed reply could
        inflate past any bound), at most :attr:`max_reply_bytes` read."""

        headers = {**self.headers, "Accept-Encoding": "identity"}
        body = bytearray()
        client = self._http()
        async with client.stream(
            method, f"{self.url}{path}", json=payload, headers=headers
        ) as response:
            encoding = response.headers.get("content-encoding", "identity").lower()
            if encoding != "identity":
                raise EndpointError(0, "the reply is compressed, which this client refuses")
            async for chunk in response.aiter_raw():
                body += chunk
                if len(body) > self.max_reply_bytes:
                    raise EndpointError(
                        0, f"the reply is above {self.max_reply_bytes:,} bytes (max_reply_bytes)"
                    )
        return response.status_code, bytes(body)

    async def _within_deadline(
        self, method: str, path: str, payload: Any = None
    ) -> tuple[int, bytes]:
        """:meth:`_exchange` cancelled at :attr:`timeout_s`: connecting, sending, headers, body."""
        import httpx

        try:
            return await asyncio.wait_for(self._exchange(method, path, payload), self.timeout_s)
        except (TimeoutError, httpx.TimeoutException):
            raise EndpointError(
                0, f"{self.url} did not answer within {self.timeout_s:g} s"
            ) from None
        except httpx.HTTPError as err:  # unreachable, a broken reply, a malformed URL
            what = f"{self.url} cannot be reached or its reply cannot be read: {err}"
            raise EndpointError(0, what[:MAX_DETAIL]) from None

    def _wait(self, method: str, path: str, payload: Any = None) -> tuple[int, bytes]:
        """The exchange from synchronous code, on this endpoint's loop (the caller may be
        inside a running loop, as a notebook is)."""
        work = self._within_deadline(method, path, payload)
        return asyncio.run_coroutine_threadsafe(work, self._running_loop()).result()

    async def _await(self, method: str, path: str, payload: Any = None) -> tuple[int, bytes]:
        """The exchange from the caller's loop, run on this endpoint's (cancelled with it)."""
        work = self._within_deadline(method, path, payload)
        future = asyncio.run_coroutine_threadsafe(work, self._running_loop())
        return await asyncio.wrap_future(future)

    def _answer(self, status: int, body: bytes, queries: int, k: int) -> list[QueryResult]:
        if status != 200:
            raise EndpointError(status, _detail(body))
        try:
            results = RetrieveResponse.model_validate_json(body).results
        except (ValueError, RecursionError) as err:
            what = f"the answer is not a car-fl retrieval: {err}"
            raise EndpointError(200, what[:MAX_DETAIL]) from None
        return checked(results, queries, k)

    def retrieve(self, queries: list[str], k: int) -> list[QueryResult]:
        status, body = self._wait("POST", "/retrieve", {"queries": queries, "k": k})
        return self._answer(status, body, len(queries), k)

    async def aretrieve(self, queries: list[str], k: int) -> list[QueryResult]:
        payload = {"queries": queries, "k": k}
        status, body = await self._await("POST", "/retrieve", payload)
        return self._answer(status, body, len(queries), k)

    def documents(self) -> int:
        """How many documents the endpoint serves (its health, asked once)."""
        if self._documents is None:
            documents = self.health().get("documents")
            if (
                not (isinstance(documents, int) and not isinstance(documents, bool))
                or documents < 1
            ):
                raise EndpointError(
                    200, "the health answer names no documents: is it car-fl serve?"
                )
            self._documents = documents
        return self._documents

    def health(self) -> dict[str, Any]:
        """What the endpoint serves (checkpoint, fingerprint, model, head, documents)."""
        status, body = self._wait("GET", "/health")
        if status != 200:
            raise EndpointError(status, _detail(body))
        try:
            health = json.loads(body)
        except (ValueError, RecursionError):
            health = None
        if not isinstance(health, dict):
            raise EndpointError(200, "the health answer is not a JSON object: is it car-fl serve?")
        return health


def _detail(body: bytes) -> str:
    """An error reply's message, cut to :data:`MAX_DETAIL` characters, control characters
    blanked."""
    try:
        found = json.loads(body)
        text = str(found.get("detail")) if isinstance(found, dict) else str(found)
    except (ValueError, RecursionError):
        text = body[: 4 * MAX_DETAIL].decode("utf-8", "replace")
    return "".join(c if c.isprintable() else " " for c in text[:MAX_DETAIL])


def source(
    *,
    checkpoint: str | Path | None = None,
    url: str | None = None,
    token: str | None = None,
    device: str = "auto",
    ca_file: str | Path | None = None,
) -> Source:
    """A checkpoint loaded here, or the endpoint at ``url``: exactly one of the two."""
    if (checkpoint is None) == (url is None):
        raise ValueError("give exactly one of checkpoint= (in-process) and url= (car-fl serve)")
    if url is not None:
        return Endpoint(url, token=token, ca_file=ca_file)
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
