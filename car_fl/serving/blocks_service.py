"""The blocks service on Ray Serve: the frozen blocks of one model, shared by many nodes.

:func:`load_runner` loads the model, fingerprints it and strips what nodes keep;
:class:`BlocksDeployment` serves ``/forward``, ``/backward`` and ``/health``, batching many
nodes' requests by tokens per batch; a retried request (``Idempotency-Key``) waits for its
first run. :func:`start` runs it on a Ray of its own or an existing cluster. Who may run one,
as Ray assumes a trusted network: docs/blocks.md.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from car_fl.blocks.compute import BACKWARD, FORWARD, Answer, BlocksHandler, BlocksRunner, Identity
from car_fl.blocks.dedupe import HEADER as IDEMPOTENCY
from car_fl.blocks.dedupe import Deduplicator
from car_fl.blocks.parts import (
    identity_fingerprint,
    model_folder,
    node_tensor_names,
    strip_for_service,
    weights_digest,
)
from car_fl.blocks.wire import Limits, Request
from car_fl.serving.ray_app import ServeConfig, start_serve
from car_fl.serving.ray_app import stop as stop  # the service's stop is every Serve app's
from car_fl.settings.schema import ModelConfig

log = logging.getLogger(__name__)

APP_NAME = "car-fl-blocks"
ROUTE = "/blocks"
#: The widest hidden size the proxy lets a body be sized for (Llama-3 70B's 8,192).
MAX_HIDDEN = 8192


@dataclass(frozen=True)
class ServiceConfig(ServeConfig):
    """How the service runs (:class:`~car_fl.serving.ray_app.ServeConfig`) and its limits."""

    limits: Limits = field(default_factory=Limits)
    route: ClassVar[str] = ROUTE

    @property
    def max_body(self) -> int:
        """The proxy's bound, before the model says its width: embeds and grad of
        ``max_tokens`` at a width of up to :data:`MAX_HIDDEN` (each replica checks exactly)."""
        return self.limits.max_tokens * MAX_HIDDEN * 4 * 2 + (1 << 20)


def load_runner(
    cfg: ModelConfig, *, device: str = "auto", limits: Limits | None = None, replicas: int = 1
) -> BlocksRunner:
    """The stripped blocks of ``cfg``'s model with their :class:`Identity`."""
    from car_fl.model.encoder import load_weights, placement

    name, target, dtype, _ = placement(cfg, device)
    model = load_weights(cfg, name, dtype=dtype, device=target)
    folder = model_folder(name, cfg.revision)
    fingerprint = identity_fingerprint(folder, node_tensor_names(model))
    norm_on_node = strip_for_service(model)
    model.to(target)
    identity = Identity(
        model=cfg.name_or_path,
        fingerprint=fingerprint,
        weights=weights_digest(folder),
        dtype=str(dtype).removeprefix("torch."),
        hidden=int(model.config.hidden_size),
        norm_on_node=norm_on_node,
        limits=limits or Limits(),
        replicas=replicas,
    )
    return BlocksRunner(model, identity)


def _tokens(items: list[Request]) -> int:
    return sum(item.tokens for item in items)


def deployment(service: ServiceConfig) -> Any:
    """The Serve deployment class, configured for ``service`` (imported lazily: ray[serve])."""
    from ray import serve
    from starlette.requests import Request as HttpRequest
    from starlette.responses import Response

    @serve.deployment(
        name="blocks",
        num_replicas=service.replicas,
        ray_actor_options=service.actor_options(),
        max_ongoing_requests=4 * service.max_batch_requests,
    )
    class BlocksDeployment:
        def __init__(self, model: dict[str, Any], device: str, limits: dict[str, int]) -> None:
            import torch

            logging.basicConfig(level=logging.INFO)
            torch.set_num_threads(max(1, int(service.cpus_per_replica)))  # the CPUs Ray gave it
            self.dedupe = Deduplicator()
            self.handler = BlocksHandler(
                load_runner(
                    ModelConfig(**model),
                    device=device,
                    limits=Limits(**limits),
                    replicas=service.replicas,
                ),
                token=service.token,
            )
            batches: tuple[Any, ...] = (self.forward_batch, self.backward_batch)
            for batched in batches:
                batched.set_max_batch_size(int(limits["max_tokens"]))  # tokens (batch_size_fn)
                batched.set_batch_wait_timeout_s(service.batch_wait_s)
            self.handler.warm_up()  # /health reports a measured speed from the start

        async def __call__(self, request: HttpRequest) -> Response:
            path = "/" + request.url.path.rstrip("/").rsplit("/", 1)[-1]
            refused = self.handler.admit(path, dict(request.headers))  # before the body
            if refused is not None:
                return Response(refused.body, refused.status, media_type=refused.media_type)
            body = bytearray()
            async for chunk in request.stream():  # a body without Content-Length is bounded too
                body += chunk
                if len(body) > self.handler.max_body:
                    too_big = Answer.error(413, f"the body is above {self.handler.max_body:,}")
                    return Response(too_big.body, 413, media_type=too_big.media_type)
            prepared = self.handler.prepare(path, bytes(body), dict(request.headers))
            if isinstance(prepared, Answer):
                answer = prepared
            else:
                batch = self.backward_batch if path == BACKWARD else self.forward_batch
                answer = await self.dedupe.answer(  # a retry waits for its first run
                    request.headers.get(IDEMPOTENCY), bytes(body), lambda: batch(prepared)
                )
            return Response(answer.body, status_code=answer.status, media_type=answer.media_type)

        @serve.batch(max_batch_size=16_384, batch_size_fn=_tokens)
        async def forward_batch(self, requests: list[Request]) -> list[Answer]:
            return await asyncio.to_thread(self.handler.run, FORWARD, requests)

        @serve.batch(max_batch_size=16_384, batch_size_fn=_tokens)
        async def backward_batch(self, requests: list[Request]) -> list[Answer]:
            return await asyncio.to_thread(self.handler.run, BACKWARD, requests)

    return BlocksDeployment


def model_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """``cfg`` as plain values a Ray actor can receive (enums as their names)."""
    return {k: (v.value if hasattr(v, "value") else v) for k, v in asdict(cfg).items()}


def start(cfg: ModelConfig, service: ServiceConfig, *, device: str = "auto") -> str:
    """Start Ray (or join ``service.ray_address``) and the Serve app; returns its URL."""
    from ray import serve

    start_serve(service, namespace=APP_NAME)
    app = deployment(service).bind(model_kwargs(cfg), device, asdict(service.limits))
    serve.run(app, name=APP_NAME, route_prefix=ROUTE, blocking=False)
    return service.url
