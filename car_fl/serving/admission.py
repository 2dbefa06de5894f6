"""Admission at Serve's HTTP proxy: what a request must be before any replica sees it.

:class:`Admission` (Serve's proxy callback :func:`proxy_middlewares`, configured by
:func:`environment`) hands a replica only whole bodies, in time (408), declared (411, 413) and
with the token when one is set (401); it caps open requests and reserved body bytes per client
and in all (503 with ``Retry-After`` at once, never silence), and after :func:`drain` refuses
new requests while the open ones finish. Serve 2.55 has none of these at its proxy; headers
have :mod:`.header_deadline`'s deadline. See docs/retrieval.md, "Hostile clients".
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: The environment variable that carries :class:`AdmissionConfig` to the proxy's process.
ENV = "CAR_FL_ADMISSION"
#: Serve's own: the function its proxy calls for the middlewares it wraps itself in.
RAY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "car_fl.serving.admission.proxy_middlewares"

#: The slowest a declared body may arrive, beyond ``body_timeout_s``: 1 MiB/s.
MIN_RATE = 1 << 20

Scope = dict[str, Any]
Message = dict[str, Any]


@dataclass(frozen=True)
class AdmissionConfig:
    """The proxy's limits; the token travels only as its SHA-256."""

    max_body: int
    body_timeout_s: float = 10.0
    header_timeout_s: float = 10.0
    per_client: int = 128
    max_open: int = 2048
    max_buffered: int = 512 << 20
    retry_after_s: int = 1
    #: Paths that need no token (the schema; Serve's own health and routes).
    open_paths: tuple[str, ...] = ()
    token_sha256: str | None = field(default=None, repr=False)
    #: Its existence means "drain": refuse new requests, let open ones finish.
    drain_file: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_body", "per_client", "max_open", "max_buffered", "retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"admission: {name} must be >= 1, got {getattr(self, name)}")
        if not self.body_timeout_s > 0:
            raise ValueError(f"--body-timeout-s must be > 0, got {self.body_timeout_s}")
        if not self.header_timeout_s > 0:
            raise ValueError(f"--header-timeout-s must be > 0, got {self.header_timeout_s}")


def token_digest(token: str | None) -> str | None:
    return hashlib.sha256(token.encode()).hexdigest() if token else None


def environment(config: AdmissionConfig) -> dict[str, str]:
    """The variables that make a proxy started from this environment admit by ``config``."""
    values = asdict(config)
    values["open_paths"] = list(config.open_paths)
    return {ENV: json.dumps(values), RAY_CALLBACK_ENV: CALLBACK}


def proxy_middlewares() -> list[Any]:
    """Serve's HTTP proxy callback: :class:`Admission` configured from :data:`ENV`; it also
    installs the header deadline in the uvicorn server the proxy is about to start."""
    from starlette.middleware import Middleware

    from car_fl.serving.header_deadline import install

    raw = os.environ.get(ENV)
    if not raw:
        return []
    values = json.loads(raw)
    values["open_paths"] = tuple(values["open_paths"])
    config = AdmissionConfig(**values)
    install(config.header_timeout_s)
    return [Middleware(Admission, config=config)]


def drain(config: AdmissionConfig, *, timeout_s: float, poke: Callable[[], None]) -> bool:
    """Ask the proxy to refuse new requests; wait until its open ones ended (True) or
    ``timeout_s`` passed (False). ``poke`` sends one request, so an idle proxy learns of it."""
    if config.drain_file is None:
        return True
    done = Path(config.drain_file + ".done")
    done.unlink(missing_ok=True)
    Path(config.drain_file).touch()
    deadline = time.monotonic() + timeout_s
    poke()
    while not done.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class _Refuse(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


class Admission:
    """The pure ASGI middleware that enforces :class:`AdmissionConfig` (module docstring)."""

    def __init__(self, app: Any, *, config: AdmissionConfig) -> None:
        self.app, self.config = app, config
        self.open: Counter[str] = Counter()
        self.buffered = 0
        self.reserved: Counter[str] = Counter()  # body bytes reserved, by client
        self.expected = f"Bearer {config.token_sha256}" if config.token_sha256 else None

    @property
    def open_total(self) -> int:
        return sum(self.open.values())

    def draining(self) -> bool:
        return self.config.drain_file is not None and os.path.exists(self.config.drain_file)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = (scope.get("client") or ("unknown",))[0]
        try:
            self.admit(client)
        except _Refuse as refused:
            await self.reply(send, refused)
            self.mark_drained()
            return
        self.open[client] += 1
        held = 0
        try:
            headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
            declared = self.check(scope, headers, client)
            held = declared
            self.buffered += held
            self.reserved[client] += held
            body = await self.read(receive, declared)
            await self.app(scope, _replay(body, receive), send)
        except _Refuse as refused:
            await self.reply(send, refused)
        finally:
            self.buffered -= held
            self.reserved[client] -= held
            if not self.reserved[client]:
                del self.reserved[client]
            self.open[client] -= 1
            if not self.open[client]:
                del self.open[client]
            self.mark_drained()

    def mark_drained(self) -> None:
        """Tell :func:`drain` that no request is open any more, once it asked."""
        if not self.open and self.draining():
            Path(str(self.config.drain_file) + ".done").touch()

    def admit(self, client: str) -> None:
        """503 when draining, or when this client, the proxy or its buffers are full."""
        if self.draining():
            raise _Refuse(503, "the service is stopping: retry on another replica or later")
        if self.open[client] >= self.config.per_client:
            raise _Refuse(
                503, f"this client has {self.config.per_client} requests open: retry later"
            )
        if self.open_total >= self.config.max_open:
            raise _Refuse(503, "the service is at its open requests' limit: retry later")

    def check(self, scope: Scope, headers: dict[str, bytes], client: str = "") -> int:
        """The token and the declared body (before a byte of it is read); its length."""
        path = scope.get("path", "")
        if self.expected and not path.endswith(self.config.open_paths):
            sent = headers.get("authorization", b"")
            scheme, _, token = sent.decode("latin-1").partition(" ")
            digest = hashlib.sha256(token.encode("latin-1")).hexdigest()
            if scheme != "Bearer" or not hmac.compare_digest(f"Bearer {digest}", self.expected):
                raise _Refuse(401, "Authorization: missing or wrong token (send 'Bearer <token>')")
        if "transfer-encoding" in headers:
            raise _Refuse(411, "body: send it with a Content-Length, not chunked")
        declared = headers.get("content-length")
        if declared is None:
            return 0
        if not (declared.isascii() and declared.isdigit()):
            raise _Refuse(400, "Content-Length: not a number of bytes")
        length = int(declared)
        if length > self.config.max_body:
            raise _Refuse(413, f"body: at most {self.config.max_body:,} bytes")
        if self.buffered + length > self.config.max_buffered:
            raise _Refuse(503, "the service holds its most bodies in reading: retry later")
        if self.reserved[client] + length > self.config.max_buffered // 4:
            raise _Refuse(503, "this client's bodies in reading are at its share: retry later")
        return length

    async def read(self, receive: Any, declared: int) -> bytes:
        """The whole body under the deadline: exactly ``declared`` bytes."""
        chunks: list[bytes] = []
        got = 0

        async def whole() -> None:
            nonlocal got
            more = True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise _Refuse(400, "body: the client left before sending it")
                chunk = message.get("body", b"")
                got += len(chunk)
                if got > declared:
                    raise _Refuse(400, "body: longer than its Content-Length")
                chunks.append(chunk)
                more = message.get("more_body", False)

        allowed = self.config.body_timeout_s + declared / MIN_RATE
        try:
            await asyncio.wait_for(whole(), allowed)
        except TimeoutError:
            raise _Refuse(408, f"body: not received within {allowed:.3g} s") from None
        return b"".join(chunks)

    async def reply(self, send: Any, refused: _Refuse) -> None:
        """The refusal as JSON ``{"detail": ...}``, closing the connection (a client gone
        already is not an error)."""
        body = json.dumps({"detail": refused.detail}).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        if refused.status == 503:
            headers.append((b"retry-after", str(self.config.retry_after_s).encode()))
        headers.append((b"content-length", str(len(body)).encode()))
        try:
            await send(
                {"type": "http.response.start", "status": refused.status, "headers": headers}
            )
            await send({"type": "http.response.body", "body": body})
        except OSError:
            pass


def _replay(body: bytes, receive: Any) -> Any:
    """A ``receive`` that gives the buffered body in one message, then the client's own."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        message: Message = await receive()
        return message

    return replayed
