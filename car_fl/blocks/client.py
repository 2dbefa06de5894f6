"""The node's client of a blocks service: HTTP(S) with a token, bounded retries, clear causes.

On ``http.client``: a node needs no Ray or web stack. A service that is down, slow or
restarting is retried with a growing pause, then :class:`BlocksUnavailable`; a 4xx is never
retried (:class:`BlocksRefused`). Requests are cut to the service's limits and measured speed,
and a request's attempts share one ``Idempotency-Key`` (docs/blocks.md, "Deadlines").
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import torch

from car_fl.blocks.compute import BACKWARD, FORWARD, HEALTH, Answer
from car_fl.blocks.dedupe import HEADER as IDEMPOTENCY_HEADER
from car_fl.blocks.errors import BlocksRefused, BlocksUnavailable
from car_fl.blocks.wire import MEDIA_TYPE, WireError, read_reply, write_request

log = logging.getLogger(__name__)

#: ``(path, body, headers) → Answer``: how a request reaches a service (HTTP, or in process).
Transport = Callable[[str, bytes, dict[str, str]], Answer]
RETRY_STATUSES = (502, 503, 504)
#: Services in this process, by ``inprocess://<name>`` address (tests, benchmarks).
IN_PROCESS: dict[str, Transport] = {}


@dataclass(frozen=True)
class Retry:
    """How long a node waits for a service: per attempt, and how many attempts."""

    timeout_s: float = 120.0
    attempts: int = 4
    #: The pause before the second attempt; each later pause doubles it.
    backoff_s: float = 0.5


#: The retries of a client built without its own (a test may shorten them).
DEFAULT_RETRY = Retry()


#: The most bytes a health reply may have.
HEALTH_REPLY_BYTES = 1 << 20
#: What a health reply must report, each a size in 1..its bound.
SIZES = {"max_rows": 1 << 20, "max_tokens": 1 << 26, "hidden": 1 << 17}
#: The speeds a health reply may report (seconds per 1,000 tokens), and the bounds believed.
SPEEDS = {FORWARD: "forward_s_per_ktoken", BACKWARD: "backward_s_per_ktoken"}
SPEED_BOUNDS = (1e-6, 3600.0)
#: A request's deadline is ``timeout_s`` plus this many times its expected compute; a request
#: is cut so that its expected compute is at most ``timeout_s`` over this.
SLACK = 4.0


class HttpTransport:
    """One kept-alive HTTP(S) connection to a service's address. ``timeout_s`` bounds a whole
    request (a watchdog shuts the socket); a reply above :attr:`max_reply_bytes` is refused
    unread (:class:`BlocksClient` sets both per request)."""

    def __init__(
        self, url: str, *, timeout_s: float, ca_file: str | None = None, route: str = ""
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"blocks service address {url!r} is not http(s)://host:port; e.g. "
                "http://127.0.0.1:8200/blocks"
            )
        self.url = url
        self.scheme, self.host = parts.scheme, parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = (route or parts.path).rstrip("/")
        self.timeout_s = timeout_s
        self.context = (
            ssl.create_default_context(cafile=ca_file) if self.scheme == "https" else None
        )
        self._connection: http.client.HTTPConnection | None = None
        self.max_reply_bytes = HEALTH_REPLY_BYTES

    def _connect(self) -> http.client.HTTPConnection:
        if self._connection is None:
            if self.context is not None:
                self._connection = http.client.HTTPSConnection(
                    self.host, self.port, timeout=self.timeout_s, context=self.context
                )
            else:
                self._connection = http.client.HTTPConnection(
                    self.host, self.port, timeout=self.timeout_s
                )
        return self._connection

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def __call__(self, path: str, body: bytes, headers: dict[str, str]) -> Answer:
        reused = self._connection is not None
        try:
            return self._send(path, body, headers)
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            if not reused:
                raise
        # the server closed the idle kept-alive connection: stateless, so send again at once
        return self._send(path, body, headers)

    def _send(self, path: str, body: bytes, headers: dict[str, str]) -> Answer:
        connection = self._connect()
        connection.timeout = self.timeout_s  # each read's bound: this request's deadline
        if connection.sock is not None:
            connection.sock.settimeout(self.timeout_s)
        method = "GET" if path == HEALTH else "POST"
        expired = threading.Event()
        sent: list[socket.socket] = []  # the reply's socket: an HTTP/1.0 reply unsets .sock

        def expire() -> None:  # the socket's own timeout bounds each read, not the whole
            expired.set()
            for sock in [connection.sock, *sent]:
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)

        watchdog = threading.Timer(self.timeout_s, expire)
        watchdog.daemon = True
        watchdog.start()
        try:
            connection.request(
                method,
                self.prefix + path,
                body=body or None,
                headers={**headers, "Content-Type": MEDIA_TYPE},
            )
            if connection.sock is not None:
                sent.append(connection.sock)
            if expired.is_set():
                raise TimeoutError
            reply = connection.getresponse()
            data = self._read(reply)
            if expired.is_set():
                raise TimeoutError
        except BaseException as err:
            self.close()  # a half-read connection is never reused
            if expired.is_set() and isinstance(err, OSError | http.client.HTTPException):
                raise TimeoutError(f"the reply took longer than {self.timeout_s:g} s") from None
            raise
        finally:
            watchdog.cancel()
        return Answer(reply.status, data, reply.getheader("Content-Type") or "")

    def _read(self, reply: http.client.HTTPResponse) -> bytes:
        """The reply's body, refused above :attr:`max_reply_bytes` or cut short."""
        declared = reply.getheader("Content-Length")
        length = int(declared) if declared and declared.isascii() and declared.isdigit() else None
        if length is not None and length > self.max_reply_bytes:
            raise BlocksRefused(self._too_big(length))
        data = bytearray()
        while chunk := reply.read1(1 << 20):
            data += chunk
            if len(data) > self.max_reply_bytes:
                raise BlocksRefused(self._too_big(len(data)))
        data += reply.read()  # nothing left: marks the reply done, so the connection is reused
        if length is not None and len(data) != length:  # read1 ends quietly on a closed socket
            raise http.client.IncompleteRead(bytes(data), length - len(data))
        return bytes(data)

    def _too_big(self, size: int) -> str:
        return (
            f"the blocks service at {self.url} replied with {size:,} bytes, above the "
            f"{self.max_reply_bytes:,} its limits allow: is it a car-fl blocks service?"
        )


class BlocksClient:
    """A service's forward, backward and health, from the node."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        retry: Retry | None = None,
        ca_file: str | None = None,
        transport: Transport | None = None,
    ) -> None:
        self.url = url
        self.retry = retry or DEFAULT_RETRY
        self.token = token
        if transport is None and url.startswith("inprocess://"):
            transport = _in_process(url)
        self.transport: Transport = transport or HttpTransport(
            url, timeout_s=self.retry.timeout_s, ca_file=ca_file
        )
        self.health_info: dict[str, Any] | None = None
        self.calls = 0
        #: Each forward or backward attempt's deadline, in order (what a test can check).
        self.deadlines: list[float] = []

    # ---------------------------------------------------------------------------- transport
    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def _call(
        self, path: str, body: bytes, *, reply_bytes: int = HEALTH_REPLY_BYTES, tokens: int = 0
    ) -> Answer:
        deadline = self.deadline(path, tokens)
        if isinstance(self.transport, HttpTransport):
            self.transport.max_reply_bytes = reply_bytes
            self.transport.timeout_s = deadline
        headers = self._headers()
        if path != HEALTH:  # one name for every attempt: a retry joins the run still going
            headers[IDEMPOTENCY_HEADER] = uuid.uuid4().hex
        pause = self.retry.backoff_s
        cause = ""
        started = time.monotonic()
        for attempt in range(1, self.retry.attempts + 1):
            if path != HEALTH:
                self.deadlines.append(deadline)
            try:
                answer = self.transport(path, body, headers)
            except (OSError, http.client.HTTPException) as err:  # refused, reset, timed out
                cause = f"{type(err).__name__}: {err}"
            else:
                if answer.status == 200:
                    self.calls += 1
                    return answer
                message = _message(answer)
                if answer.status not in RETRY_STATUSES:
                    raise BlocksRefused(
                        f"the blocks service at {self.url} refused {path} ({answer.status}): "
                        f"{message}"
                    )
                cause = f"HTTP {answer.status}: {message}"
            if attempt < self.retry.attempts:
                log.warning(
                    "blocks service %s: %s (attempt %d of %d); retrying in %.1f s",
                    self.url,
                    cause,
                    attempt,
                    self.retry.attempts,
                    pause,
                )
                time.sleep(pause)
                pause *= 2
        raise BlocksUnavailable(
            f"the blocks service at {self.url} did not answer {path} in "
            f"{self.retry.attempts} attempts over {time.monotonic() - started:.1f} s (each "
            f"allowed {deadline:.0f} s): {cause}. Fix: start it (car-fl serve-blocks) or point "
            "model.blocks_service (a SuperNode's --node-config blocks-service) at one that runs"
        )

    def seconds_per_ktoken(self, path: str) -> float | None:
        """The service's measured speed for ``path`` from its health, where believable."""
        if self.health_info is None:
            return None
        value = self.health_info.get(SPEEDS.get(path, ""))
        low, high = SPEED_BOUNDS
        if isinstance(value, int | float) and not isinstance(value, bool) and low <= value <= high:
            return float(value)
        return None

    def deadline(self, path: str, tokens: int) -> float:
        """``timeout_s``, plus :data:`SLACK` times what ``tokens`` take at the service's speed."""
        speed = self.seconds_per_ktoken(path)
        expected = 0.0 if speed is None else speed * tokens / 1000
        return self.retry.timeout_s + SLACK * expected

    # ---------------------------------------------------------------------------- operations
    def health(self) -> dict[str, Any]:
        """What the service holds (model, fingerprint, weights digest, dtype, limits)."""
        answer = self._call(HEALTH, b"")
        try:
            info = json.loads(answer.body)
        except (ValueError, RecursionError):  # not JSON, not UTF-8, nested past the stack
            raise BlocksRefused(
                f"{self.url}{HEALTH} did not answer JSON: is it a blocks service?"
            ) from None
        if not isinstance(info, dict):
            raise BlocksRefused(f"{self.url}{HEALTH} did not answer a JSON object")
        for key, most in SIZES.items():
            value = info.get(key)
            if not (isinstance(value, int) and not isinstance(value, bool) and 0 < value <= most):
                raise BlocksRefused(
                    f"{self.url}{HEALTH} reports no {key} in 1..{most:,}: is it a car-fl "
                    "blocks service?"
                )
        self.health_info = info  # only once it is one
        return info

    def _limits(self) -> tuple[int, int]:
        info = self.health_info or self.health()
        return int(info["max_rows"]), int(info["max_tokens"])

    def _chunks(self, mask: torch.Tensor, path: str) -> list[slice]:
        """Rows per request: within the service's limits and its measured speed."""
        max_rows, max_tokens = self._limits()
        rows, seq = int(mask.shape[0]), int(mask.shape[1])
        speed = self.seconds_per_ktoken(path)
        if speed is not None:
            max_tokens = min(max_tokens, int(1000 * self.retry.timeout_s / (SLACK * speed)))
        step = max(1, min(max_rows, max_tokens // max(seq, 1)))
        return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]

    def _operation(
        self,
        path: str,
        name: str,
        embeds: torch.Tensor,
        mask: torch.Tensor,
        grad: torch.Tensor | None,
        fingerprint: str,
    ) -> torch.Tensor:
        parts = []
        for rows in self._chunks(mask, path):
            body = write_request(
                embeds[rows],
                mask[rows],
                fingerprint=fingerprint,
                grad=None if grad is None else grad[rows],
            )
            shape = tuple(embeds[rows].shape)
            states = shape[0] * shape[1] * shape[2] * 4  # float32 at most
            tokens = shape[0] * shape[1]
            answer = self._call(path, body, reply_bytes=states + (1 << 16), tokens=tokens)
            try:
                parts.append(read_reply(answer.body, name, shape))
            except WireError as err:
                raise BlocksRefused(f"the blocks service at {self.url}: {err}") from None
        return torch.cat(parts)

    def forward(
        self, embeds: torch.Tensor, mask: torch.Tensor, *, fingerprint: str
    ) -> torch.Tensor:
        """The blocks' output states for ``embeds`` ``(rows, seq, hidden)`` under ``mask``."""
        return self._operation(FORWARD, "states", embeds, mask, None, fingerprint)

    def backward(
        self, embeds: torch.Tensor, mask: torch.Tensor, grad: torch.Tensor, *, fingerprint: str
    ) -> torch.Tensor:
        """The gradient of ``embeds`` given the gradient ``grad`` of the blocks' states."""
        return self._operation(BACKWARD, "grad", embeds, mask, grad, fingerprint)


def _in_process(url: str) -> Transport:
    """The service registered at ``url`` when each request is sent (it may be replaced)."""

    def send(path: str, body: bytes, headers: dict[str, str]) -> Answer:
        if url not in IN_PROCESS:
            raise ConnectionRefusedError(111, f"no blocks service {url} runs in this process")
        return IN_PROCESS[url](path, body, headers)

    return send


#: Characters of a service's error message kept, its control characters blanked (a hostile
#: service's megabyte, or a forged log line, never reaches the node's log whole).
MAX_MESSAGE = 500


def _message(answer: Answer) -> str:
    try:
        text = str(json.loads(answer.body).get("error", ""))
    except (ValueError, AttributeError, RecursionError):
        text = answer.body[:MAX_MESSAGE].decode("utf-8", "replace")
    return "".join(c if c.isprintable() else " " for c in text[:MAX_MESSAGE])
