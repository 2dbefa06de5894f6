"""The retrieval endpoint without Ray: its schema, its checks and the app that answers.

:class:`RetrievalService` checks the token and ``k`` and answers a batch of requests with one
``retrieve`` call; :func:`build_app` is its FastAPI app (``/retrieve``, ``/health``, ``/docs``),
which Ray Serve runs on its replicas (:mod:`.retrieval_service`). Every bad input is a 4xx
naming the field, never a 500, never echoing the input; queries are logged by count only.
"""

from __future__ import annotations

import asyncio
import hmac
import html
import json
import logging
import unicodedata
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from car_fl.heads.scorer import Retrieval

if TYPE_CHECKING:
    from fastapi import FastAPI

    from car_fl.model.retriever import CaRRetriever

log = logging.getLogger(__name__)

#: Characters one query may hold (a megabyte is refused, not encoded and cut).
MAX_QUERY_CHARS = 8192
#: Queries one request may hold.
MAX_QUERIES = 256
#: Paths anyone may read: the schema and its page (nothing about the checkpoint).
OPEN_PATHS = ("/docs", "/openapi.json")
#: Bytes a request body may declare: the most queries of the longest, every character a
#: 12-byte JSON escape (a surrogate pair), and room for the rest; larger is a 413 unread.
MAX_BODY = MAX_QUERIES * MAX_QUERY_CHARS * 12 + (1 << 20)
#: A request's fields (the schema's, named in the message that refuses any other).
FIELDS = ("queries", "k")


class RetrieveRequest(BaseModel):
    """One or many queries (a string is one) and how many documents each gets back."""

    model_config = ConfigDict(extra="forbid")

    queries: list[str] = Field(
        min_length=1,
        max_length=MAX_QUERIES,
        description=f"query texts (a single string is one query), 1 to {MAX_QUERIES}, each "
        f"not blank and at most {MAX_QUERY_CHARS} characters",
    )
    k: StrictInt = Field(ge=1, description="documents per query: 1 to the documents served")

    @field_validator("queries", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("queries")
    @classmethod
    def _each_query(cls, queries: list[str]) -> list[str]:
        for i, query in enumerate(queries):
            if not visible(query):
                raise ValueError(f"query {i} is empty (it has no visible character)")
            if len(query) > MAX_QUERY_CHARS:
                raise ValueError(
                    f"query {i} has {len(query)} characters, at most {MAX_QUERY_CHARS}"
                )
            try:  # JSON's \ud800 escapes decode to lone surrogates no tokenizer takes
                query.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(
                    f"query {i} is not valid Unicode (a lone surrogate): send UTF-8 text"
                ) from None
        return queries


def visible(text: str) -> bool:
    """Whether ``text`` has a character that is neither a space, a control or format character
    (NUL, zero-width space, BOM) nor unassigned: what an encoder has to go on."""
    return any(not unicodedata.category(c).startswith(("C", "Z")) for c in text)


class RetrievedDocument(BaseModel):
    """One retrieved document, best first: ``rank`` 1 is the best."""

    rank: int
    id: str
    score: float
    probability: float | None = Field(
        default=None, description="softmax over all documents (cross-entropy heads only)"
    )
    text: str
    title: str | None = None


class QueryResult(BaseModel):
    """One query's documents and what their scores are (logit, cosine, dot, votes, rrf)."""

    score_kind: str
    documents: list[RetrievedDocument]


class RetrieveResponse(BaseModel):
    """Per query of the request, in its order, its top-k documents."""

    results: list[QueryResult]


class Health(BaseModel):
    """What is served: the checkpoint, its settings' fingerprint, the model, the documents."""

    status: str = "ok"
    checkpoint: str
    fingerprint: str
    model: str
    head: str
    documents: int


class Refused(Exception):
    """A request answered with a 4xx: its status and a message naming the field."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def results_of(
    retrievals: Sequence[Retrieval], titles: dict[str, str] | None = None
) -> list[QueryResult]:
    """``retrieve``'s results as the endpoint returns them (rank from 1, titles of a corpus)."""
    titles = titles or {}
    return [
        QueryResult(
            score_kind=r.score_kind,
            documents=[
                RetrievedDocument(
                    rank=rank,
                    id=hit.id,
                    score=hit.score,
                    probability=hit.probability,
                    text=hit.text,
                    title=titles.get(hit.id),
                )
                for rank, hit in enumerate(r.hits, 1)
            ],
        )
        for r in retrievals
    ]


def corpus_titles(retriever: CaRRetriever) -> dict[str, str]:
    """Each document's title (id → title) of a corpus checkpoint; empty for labels."""
    from car_fl.data.corpus import read_documents
    from car_fl.settings.schema import Reader

    settings = retriever.settings
    if settings is None or settings.dataset.reader is not Reader.CORPUS:
        return {}
    path = settings.dataset.documents_path
    return {d.id: d.title for d in read_documents(path) if d.title} if path else {}


class RetrievalService:
    """A loaded retriever behind the endpoint's checks: token, ``k``, batches of requests."""

    def __init__(
        self,
        retriever: CaRRetriever,
        *,
        checkpoint: str | Path,
        token: str | None = None,
        encode_batch: int | None = None,
    ) -> None:
        from car_fl.settings.compose import fingerprint

        if retriever.label_names is None or retriever.settings is None:
            raise ValueError("the retriever has no labels: load it with load_retriever")
        self.retriever, self.token = retriever, token
        #: Queries encoded at once, sorted by length (``None``: the checkpoint's eval batch).
        self.encode_batch = encode_batch
        self.titles = corpus_titles(retriever)
        self.documents = len(retriever.label_names)
        self.health = Health(
            checkpoint=str(checkpoint),
            fingerprint=fingerprint(retriever.settings),
            model=retriever.settings.model.name_or_path,
            head=str(retriever.kind.value),
            documents=self.documents,
        )

    def authorize(self, header: str | None) -> None:
        """Refuse (401) a request without ``Authorization: Bearer <token>`` when one is set."""
        if self.token and not hmac.compare_digest(
            (header or "").encode(), f"Bearer {self.token}".encode()
        ):
            raise Refused(401, "Authorization: missing or wrong token (send 'Bearer <token>')")

    def check(self, request: RetrieveRequest) -> None:
        """What the schema cannot know: ``k`` against the documents this checkpoint serves."""
        if request.k > self.documents:
            raise Refused(422, f"k: at most the {self.documents} documents this serves")

    def run(self, requests: Sequence[RetrieveRequest]) -> list[RetrieveResponse]:
        """One ``retrieve`` for all queries of ``requests`` (at their largest ``k``), each
        request's own queries and ``k`` cut from it."""
        queries = [q for request in requests for q in request.queries]
        k = max(request.k for request in requests)
        log.info("retrieve: %d requests, %d queries, k=%d", len(requests), len(queries), k)
        found = self.retriever.retrieve(queries, k, batch_size=self.encode_batch)
        results = results_of(found, self.titles)
        out, start = [], 0
        for request in requests:
            mine = results[start : start + len(request.queries)]
            start += len(request.queries)
            cut = [
                QueryResult(score_kind=r.score_kind, documents=r.documents[: request.k])
                for r in mine
            ]
            out.append(RetrieveResponse(results=cut))
        return out

    def run_each(self, requests: Sequence[RetrieveRequest]) -> list[RetrieveResponse | Exception]:
        """:meth:`run`, and when that batch fails, its halves, down to the request that fails:
        only that one gets its error (about ``2 log2 n`` smaller batches, not ``n`` runs)."""
        try:
            return list(self.run(requests))
        except Exception as err:
            if len(requests) == 1:
                log.warning(
                    "retrieve: a request of %d queries failed: %s",
                    len(requests[0].queries),
                    type(err).__name__,
                )
                return [err]
        half = len(requests) // 2
        return [*self.run_each(requests[:half]), *self.run_each(requests[half:])]


def field_message(errors: Sequence[Any]) -> str:
    """Pydantic's errors as one line, each naming its field (``queries.0: ...``), no input."""
    parts = []
    for error in errors:
        loc = [str(p) for p in error.get("loc", ())][1:]  # after "body" (or "header")
        message = str(error.get("msg", "invalid"))
        if error.get("type") == "json_invalid":
            loc = []  # its place in the text, not a field
        if error.get("type") == "extra_forbidden":  # its name is the sender's text
            loc, message = [], f"unknown field (a request holds {', '.join(FIELDS)})"
        where = ".".join(loc) or "body"
        parts.append(f"{where}: {message}")
    return "; ".join(parts)


def schema_page(schema: dict[str, Any]) -> str:
    """The OpenAPI schema as one self-contained HTML page: each operation, then the JSON."""
    rows = "".join(
        f"<li><code>{html.escape(method.upper())} {html.escape(path)}</code>: "
        f"{html.escape(str(operation.get('summary', '')))}</li>"
        for path, operations in schema.get("paths", {}).items()
        for method, operation in operations.items()
    )
    title = html.escape(str(schema.get("info", {}).get("title", "")))
    text = html.escape(json.dumps(schema, indent=2))
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title></head>"
        f"<body><h1>{title}</h1><ul>{rows}</ul><p>Machine-readable: "
        f"<a href='openapi.json'>openapi.json</a></p><pre>{text}</pre></body></html>"
    )


def build_app(
    service: RetrievalService,
    *,
    batch: Callable[[RetrieveRequest], Awaitable[RetrieveResponse | Exception]] | None = None,
) -> FastAPI:
    """The endpoint's FastAPI app; ``batch`` answers one checked request or gives its error
    (default: :meth:`RetrievalService.run` of that request in a thread)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import HTMLResponse, JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    import car_fl

    async def alone(request: RetrieveRequest) -> RetrieveResponse | Exception:
        [answer] = await asyncio.to_thread(service.run, [request])
        return answer

    answer = batch or alone
    app = FastAPI(
        title="car-fl retrieval",
        version=getattr(car_fl, "__version__", "0"),
        description="Top-k documents of a car-fl checkpoint (docs/retrieval.md).",
        docs_url=None,  # FastAPI's page loads Swagger UI from a CDN: blank offline
        redoc_url=None,
    )

    @app.middleware("http")
    async def _token(request: Request, call_next: Any) -> Response:  # before any body is read
        if not request.url.path.endswith(OPEN_PATHS):
            try:
                service.authorize(request.headers.get("authorization"))
            except Refused as err:
                return JSONResponse({"detail": err.message}, status_code=err.status)
            declared = request.headers.get("content-length", "0")
            if not (declared.isascii() and declared.isdigit()) or int(declared) > MAX_BODY:
                detail = f"body: at most {MAX_BODY:,} bytes, with a Content-Length"
                return JSONResponse({"detail": detail}, status_code=413)
        response: Response = await call_next(request)
        return response

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": field_message(err.errors())}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _unparsed(request: Request, err: StarletteHTTPException) -> Response:
        if err.status_code == 400:  # FastAPI's "error parsing the body": not UTF-8, too deep
            detail = "body: cannot be parsed as JSON (send a UTF-8 JSON object)"
            return JSONResponse({"detail": detail}, status_code=422)
        return JSONResponse(
            {"detail": err.detail}, status_code=err.status_code, headers=err.headers
        )

    @app.exception_handler(Refused)
    async def _refused(request: Request, err: Refused) -> JSONResponse:
        return JSONResponse({"detail": err.message}, status_code=err.status)

    @app.post("/retrieve", response_model=RetrieveResponse)
    async def retrieve(body: RetrieveRequest) -> RetrieveResponse:
        """Per query, its top-k documents (ids, scores, texts, titles), best first."""
        service.check(body)
        found = await answer(body)
        if isinstance(found, Exception):
            raise found  # this request's own failure: a 500 for it alone (logged by Starlette)
        return found

    @app.get("/docs", include_in_schema=False)
    async def docs() -> Response:
        """The schema as a page that needs nothing from the network."""
        return HTMLResponse(schema_page(app.openapi()))

    @app.get("/health", response_model=Health)
    async def health() -> Health:
        """The checkpoint served, its settings' fingerprint, the model and the documents."""
        return service.health

    return app
