"""A service that is down, slow or restarting: bounded retries, then a cause that names it."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from car_fl.blocks.client import (
    BlocksClient,
    BlocksRefused,
    BlocksUnavailable,
    Retry,
)
from car_fl.blocks.compute import Answer, BlocksHandler
from car_fl.blocks.wire import Request

FAST = Retry(timeout_s=1.0, attempts=3, backoff_s=0.0)


class Flaky:
    """A transport that fails its first ``failures`` calls (``error``), then passes through."""

    def __init__(self, handler: BlocksHandler, failures: int, error: Exception | int) -> None:
        self.handler, self.failures, self.error, self.calls = handler, failures, error, 0

    def __call__(self, path: str, body: bytes, headers: dict[str, str]) -> Answer:
        self.calls += 1
        if self.calls <= self.failures:
            if isinstance(self.error, int):
                return Answer.error(self.error, "restarting")
            raise self.error
        return self.handler.handle(path, body, headers)


def call(client: BlocksClient, handler: BlocksHandler) -> torch.Tensor:
    hidden = handler.runner.identity.hidden
    return client.forward(
        torch.randn(3, 4, hidden), torch.ones(3, 4), fingerprint=handler.runner.identity.fingerprint
    )


@pytest.mark.parametrize("error", [ConnectionRefusedError(111, "refused"), TimeoutError(), 503])
def test_a_service_back_within_the_retries_answers(service: BlocksHandler, error: object) -> None:
    flaky = Flaky(service, 2, error)  # type: ignore[arg-type]
    client = BlocksClient("http://x", retry=FAST, transport=flaky)
    assert call(client, service).shape == (3, 4, service.runner.identity.hidden)


def test_a_service_down_past_the_retries_names_the_address_and_cause(
    service: BlocksHandler,
) -> None:
    flaky = Flaky(service, 99, ConnectionRefusedError(111, "Connection refused"))
    client = BlocksClient("http://10.9.8.7:8200/blocks", retry=FAST, transport=flaky)
    with pytest.raises(BlocksUnavailable, match=r"10\.9\.8\.7:8200.*3 attempts.*refused"):
        call(client, service)
    assert flaky.calls == 3


def test_a_refusal_is_never_retried(service: BlocksHandler) -> None:
    flaky = Flaky(service, 99, 409)
    client = BlocksClient("http://x", retry=FAST, transport=flaky)
    with pytest.raises(BlocksRefused, match="409"):
        call(client, service)
    assert flaky.calls == 1


def test_nothing_listening_is_unavailable_over_real_http() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = BlocksClient(f"http://127.0.0.1:{port}/blocks", retry=FAST)
    with pytest.raises(BlocksUnavailable, match="ConnectionRefusedError"):
        client.health()


def test_a_large_batch_is_cut_to_the_service_limits(service: BlocksHandler) -> None:
    seen: list[int] = []

    def counting(path: str, body: bytes, headers: dict[str, str]) -> Answer:
        answer = service.handle(path, body, headers)
        if path != "/health":
            seen.append(1)
        return answer

    client = BlocksClient("http://x", retry=FAST, transport=counting)
    hidden = service.runner.identity.hidden
    embeds, mask = torch.randn(150, 3, hidden), torch.ones(150, 3)
    states = client.forward(embeds, mask, fingerprint=service.runner.identity.fingerprint)
    assert states.shape == (150, 3, hidden) and len(seen) == 3  # 64 + 64 + 22 rows
    (alone,) = service.runner.forward([_request(embeds[100:101], mask[100:101])])
    assert torch.allclose(states[100:101], alone, atol=1e-5)


def _request(embeds: torch.Tensor, mask: torch.Tensor) -> Request:
    return Request(embeds, mask.long(), None, "")


def test_a_kept_alive_connection_the_server_closed_is_reopened_without_a_retry(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A server closes an idle kept-alive connection (its keep-alive timeout, as Serve's proxy
    does): the next request goes out again at once on a new connection, no retry, no warning."""

    class OneRequestPerConnection(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # promises keep-alive, then closes after each reply

        def do_GET(self) -> None:
            health = {"fingerprint": "f", "max_tokens": 64, "hidden": 8, "max_rows": 8}
            body = json.dumps(health).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = True

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), OneRequestPerConnection)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = BlocksClient(f"http://127.0.0.1:{server.server_port}/blocks", retry=FAST)
        with caplog.at_level("WARNING"):
            for _ in range(3):
                assert client.health()["fingerprint"] == "f"
        assert not [r for r in caplog.records if "retrying" in r.getMessage()]
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def _serve(reply: Callable[[BaseHTTPRequestHandler], None]) -> Iterator[ThreadingHTTPServer]:
    """A server on 127.0.0.1 whose every GET and POST is answered by ``reply``, while open."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                reply(self)  # a client that gives up is what these tests want

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_a_reply_that_drips_in_is_cut_at_the_timeout() -> None:
    def drip(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", "100")
        handler.end_headers()
        for _ in range(100):  # 10 s in all, each byte well inside the socket's timeout
            handler.wfile.write(b" ")
            handler.wfile.flush()
            time.sleep(0.1)

    with _serve(drip) as server:
        client = BlocksClient(
            f"http://127.0.0.1:{server.server_port}/blocks",
            retry=Retry(timeout_s=0.5, attempts=2, backoff_s=0.0),
        )
        start = time.monotonic()
        with pytest.raises(BlocksUnavailable, match=r"longer than 0\.5 s"):
            client.health()
        assert time.monotonic() - start < 3.0  # two attempts of about 0.5 s


def test_a_reply_above_what_the_limits_allow_is_refused_unread() -> None:
    def huge(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", str(1 << 40))  # a terabyte, declared
        handler.end_headers()
        handler.wfile.write(b"{}")

    def streamed(handler: BaseHTTPRequestHandler) -> None:  # no length: chunks until cut
        handler.send_response(200)
        handler.end_headers()
        for _ in range(8):
            handler.wfile.write(b" " * (1 << 20))

    for reply in (huge, streamed):
        with _serve(reply) as server:
            client = BlocksClient(f"http://127.0.0.1:{server.server_port}/blocks", retry=FAST)
            with pytest.raises(BlocksRefused, match="above the 1,048,576 its limits allow"):
                client.health()


HEALTH = {"fingerprint": "f", "max_tokens": 4096, "hidden": 8, "max_rows": 8}


def _health_then(
    post: Callable[[BaseHTTPRequestHandler], None],
) -> contextlib.AbstractContextManager[ThreadingHTTPServer]:
    """A service whose health is :data:`HEALTH` and whose every POST is answered by ``post``."""

    def reply(handler: BaseHTTPRequestHandler) -> None:
        if handler.command == "POST":
            post(handler)
            return
        body = json.dumps(HEALTH).encode()
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    return _serve(reply)


def test_a_reply_above_the_states_of_the_rows_sent_is_refused_unread() -> None:
    def flood(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", str(1 << 20))  # 1 MiB for 16 floats' states
        handler.end_headers()
        handler.wfile.write(b"\0" * (1 << 20))

    with _health_then(flood) as server:
        client = BlocksClient(f"http://127.0.0.1:{server.server_port}/blocks", retry=FAST)
        with pytest.raises(BlocksRefused, match="replied with 1,048,576 bytes"):
            client.forward(torch.zeros(1, 2, 8), torch.ones(1, 2), fingerprint="f")


def test_headers_that_drip_in_are_cut_at_the_timeout_too() -> None:
    def drip_headers(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.flush_headers()
        for i in range(30):  # 9 s of headers, each line well inside the socket's timeout
            handler.wfile.write(f"X-Slow-{i}: 1\r\n".encode())
            handler.wfile.flush()
            time.sleep(0.3)

    with _serve(drip_headers) as server:
        client = BlocksClient(
            f"http://127.0.0.1:{server.server_port}/blocks",
            retry=Retry(timeout_s=0.5, attempts=1, backoff_s=0.0),
        )
        start = time.monotonic()
        with pytest.raises(BlocksUnavailable, match=r"longer than 0\.5 s"):
            client.health()
        assert time.monotonic() - start < 2.0


LYING_HEALTH = [
    b'{"max_tokens": Infinity, "hidden": 8, "max_rows": 8}',
    b'{"max_tokens": 1000000000000, "hidden": 1000000, "max_rows": 8}',
    b'{"max_tokens": 64, "hidden": 8, "max_rows": "abc"}',
    b'{"max_tokens": true, "hidden": 8, "max_rows": 8}',
    b"[1, 2]",
    b"\xff\xfe not utf-8",
    b"[" * 100_000,
]


@pytest.mark.parametrize("body", LYING_HEALTH, ids=range(len(LYING_HEALTH)))
def test_a_health_that_lies_is_refused_and_never_kept(body: bytes) -> None:
    def reply(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    with _serve(reply) as server:
        client = BlocksClient(f"http://127.0.0.1:{server.server_port}/blocks", retry=FAST)
        with pytest.raises(BlocksRefused, match="health"):
            client.health()
        assert client.health_info is None


def test_an_error_message_is_cut_and_its_control_characters_blanked() -> None:
    def refuse(handler: BaseHTTPRequestHandler) -> None:
        body = json.dumps({"error": "ok\n\x1b[31mFAKE LOG LINE" + "A" * 100_000}).encode()
        handler.send_response(400)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    with _health_then(refuse) as server:
        client = BlocksClient(f"http://127.0.0.1:{server.server_port}/blocks", retry=FAST)
        with pytest.raises(BlocksRefused) as err:
            client.forward(torch.zeros(1, 2, 8), torch.ones(1, 2), fingerprint="f")
        assert len(str(err.value)) < 700 and "\n" not in str(err.value)
        assert "\x1b" not in str(err.value)
