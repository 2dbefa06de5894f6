"""The trained retriever as an endpoint on Ray Serve: one checkpoint, many RAG applications.

:func:`start` checks that the checkpoint loads before Ray starts, then runs
:func:`deployment`: each replica loads the retriever once and serves
:func:`.retrieval_api.build_app`, many clients' requests batched into one ``retrieve``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

from car_fl.serving.ray_app import ServeConfig, start_serve
from car_fl.serving.ray_app import stop as stop  # the service's stop is every Serve app's
from car_fl.serving.retrieval_api import (
    MAX_BODY,
    MAX_QUERIES,
    OPEN_PATHS,
    RetrievalService,
    RetrieveRequest,
    RetrieveResponse,
    build_app,
)

log = logging.getLogger(__name__)

APP_NAME = "car-fl-retrieval"
ROUTE = "/"


@dataclass(frozen=True)
class RetrievalConfig(ServeConfig):
    """How the endpoint runs (:class:`~car_fl.serving.ray_app.ServeConfig`), on port 8300."""

    port: int = 8300
    #: Queries one batch holds at most (the requests of many clients together).
    max_batch_queries: int = MAX_QUERIES
    #: How long a batch waits to fill: 50 ms doubles what 32 clients get through against 5 ms
    #: (docs/retrieval.md, "Under load"), and is what a lone request waits.
    batch_wait_s: float = 0.05
    #: Queries the encoder runs at once, sorted by length: a batch of many clients' queries is
    #: cut into such chunks, so a long query pads a few short ones, not all of them.
    encode_batch: int = 8
    open_paths: ClassVar[tuple[str, ...]] = OPEN_PATHS

    @property
    def max_body(self) -> int:
        return MAX_BODY

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_batch_queries < MAX_QUERIES:
            raise ValueError(
                f"--max-batch-queries must be >= {MAX_QUERIES} (one request's queries), "
                f"got {self.max_batch_queries}"
            )
        if self.encode_batch < 1:
            raise ValueError(f"--encode-batch must be >= 1, got {self.encode_batch}")


def _queries(requests: list[RetrieveRequest]) -> int:
    return sum(len(request.queries) for request in requests)


def load_service(checkpoint: str, service: RetrievalConfig, *, device: str) -> RetrievalService:
    """The checkpoint's retriever behind the endpoint's checks (raises what cannot load)."""
    from car_fl.serving.checkpoint import load_retriever

    return RetrievalService(
        load_retriever(checkpoint, device=device),
        checkpoint=checkpoint,
        token=service.token,
        encode_batch=service.encode_batch,
    )


def deployment(service: RetrievalConfig, checkpoint: str, *, device: str) -> Any:
    """The Serve deployment of ``checkpoint``'s endpoint (imported lazily: ray[serve])."""
    from ray import serve

    def build() -> Any:  # on each replica, once
        import torch

        logging.basicConfig(level=logging.INFO)
        torch.set_num_threads(max(1, int(service.cpus_per_replica)))  # the CPUs Ray gave it
        retrieval = load_service(checkpoint, service, device=device)

        @serve.batch(
            max_batch_size=service.max_batch_queries,
            batch_wait_timeout_s=service.batch_wait_s,
            batch_size_fn=_queries,
        )
        async def batched(requests: list[RetrieveRequest]) -> list[RetrieveResponse | Exception]:
            return await asyncio.to_thread(retrieval.run_each, requests)

        return build_app(retrieval, batch=batched)

    return serve.deployment(
        serve.ingress(build)(),
        name="retrieval",
        num_replicas=service.replicas,
        ray_actor_options=service.actor_options(),
        max_ongoing_requests=2 * service.max_batch_queries,  # a batch can fill while one runs
    )


def start(checkpoint: str, service: RetrievalConfig, *, device: str = "auto") -> str:
    """Check that ``checkpoint`` loads, start Ray and Serve, run the endpoint; its URL."""
    from ray import serve

    probe = load_service(checkpoint, service, device=device)  # fails before Ray
    log.info("serving %s (%d documents)", checkpoint, probe.documents)
    del probe
    start_serve(service, namespace=APP_NAME)
    app = deployment(service, checkpoint, device=device).bind()
    serve.run(app, name=APP_NAME, route_prefix=ROUTE, blocking=False)
    return service.url
