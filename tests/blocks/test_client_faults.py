"""A service that is down, slow or restarting: bounded retries, then a cause that names it."""

from __future__ import annotations

import socket

import pytest
import torch

from car_fl.blocks.client import BlocksClient, BlocksRefused, BlocksUnavailable, Retry
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
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class OneRequestPerConnection(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # promises keep-alive, then closes after each reply

        def do_GET(self) -> None:
            body = json.dumps({"fingerprint": "f"}).encode()
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
