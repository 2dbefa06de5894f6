"""car_fl.serving.retrieval_client.Endpoint against a hostile server (a local HTTP server).

A server that is not a car-fl endpoint, or one that lies, cannot make the client return more
documents than asked, unranked or non-finite scores, or no results; it cannot hold the client
past its deadline by dripping bytes, fill its memory with a huge reply, or push a megabyte of
error text into the caller's logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from car_fl.serving.retrieval_client import MAX_DETAIL, Endpoint, EndpointError

#: ``handler → None``: what the server does with one request.
Behaviour = Callable[[BaseHTTPRequestHandler], None]


def document(rank: int, score: float, **extra: object) -> dict[str, object]:
    return {"rank": rank, "id": f"d{rank}", "score": score, "text": "t", **extra}


def answer(results: list[list[dict[str, object]]]) -> bytes:
    payload = {"results": [{"score_kind": "logit", "documents": docs} for docs in results]}
    return json.dumps(payload).encode()


def replies(status: int, body: bytes) -> Behaviour:
    def send(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    return send


@pytest.fixture
def server() -> Iterator[Callable[[Behaviour], str]]:
    """Start a server on 127.0.0.1 that answers every request with the given behaviour."""
    running: list[ThreadingHTTPServer] = []

    def start(behaviour: Behaviour) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    behaviour(self)  # a client that gives up is what some tests want

            do_GET = do_POST

            def log_message(self, *args: object) -> None:
                pass

        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        httpd.daemon_threads = True
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        running.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}"

    yield start
    for httpd in running:
        httpd.shutdown()
        httpd.server_close()


GOOD = [[document(1, 2.0, probability=0.7), document(2, 1.0, probability=0.2)]]
LIES = [
    ([[document(1, 2.0), document(2, 1.0), document(3, 0.5)]], "got 3 documents, asked for 2"),
    ([], "0 results for 1 queries"),
    ([[document(1, 2.0)]], "got 1 documents"),
    ([[document(1, 2.0), document(3, 1.0)]], "ranks are not 1..2"),
    ([[document(1, 1.0), document(2, 2.0)]], "not best first"),
    ([[document(1, float("nan")), document(2, 1.0)]], "not finite"),
    ([[document(1, 2.0, probability=1.5), document(2, 1.0)]], "probability outside"),
    ([GOOD[0], GOOD[0]], "2 results for 1 queries"),
]


def test_an_honest_answer_is_returned_as_sent(server: Callable[[Behaviour], str]) -> None:
    url = server(replies(200, answer(GOOD)))
    [result] = Endpoint(url).retrieve(["q"], 2)
    assert [d.id for d in result.documents] == ["d1", "d2"]
    [again] = asyncio.run(Endpoint(url).aretrieve(["q"], 2))
    assert again == result


@pytest.mark.parametrize(("results", "says"), LIES, ids=[lie[1] for lie in LIES])
def test_an_answer_that_breaks_the_schemas_promises_is_refused(
    server: Callable[[Behaviour], str], results: list, says: str
) -> None:
    url = server(replies(200, answer(results)))
    with pytest.raises(EndpointError, match="not a car-fl retrieval") as err:
        Endpoint(url).retrieve(["q"], 2)
    assert says in str(err.value)
    with pytest.raises(EndpointError, match=says.replace(".", r"\.")):
        asyncio.run(Endpoint(url).aretrieve(["q"], 2))


def test_a_body_that_is_not_the_schema_is_refused(server: Callable[[Behaviour], str]) -> None:
    url = server(replies(200, b'{"results": "no"}'))
    with pytest.raises(EndpointError, match="not a car-fl retrieval"):
        Endpoint(url).retrieve(["q"], 2)


def test_a_server_that_drips_bytes_is_given_up_at_the_deadline(
    server: Callable[[Behaviour], str],
) -> None:
    def drip(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", "100")
        handler.end_headers()
        for _ in range(100):  # 10 s in all, each byte well inside the read timeout
            handler.wfile.write(b" ")
            handler.wfile.flush()
            time.sleep(0.1)

    url = server(drip)
    for ask in (
        lambda: Endpoint(url, timeout_s=0.6).retrieve(["q"], 2),
        lambda: asyncio.run(Endpoint(url, timeout_s=0.6).aretrieve(["q"], 2)),
    ):
        start = time.monotonic()
        with pytest.raises(EndpointError, match=r"did not answer within 0\.6 s"):
            ask()
        assert time.monotonic() - start < 2.0


def test_a_huge_reply_is_refused_past_its_bound(server: Callable[[Behaviour], str]) -> None:
    url = server(replies(200, b" " * (3 << 20)))
    with pytest.raises(EndpointError, match="above 1,048,576 bytes"):
        Endpoint(url, max_reply_bytes=1 << 20).retrieve(["q"], 2)
    with pytest.raises(EndpointError, match="above 1,048,576 bytes"):
        asyncio.run(Endpoint(url, max_reply_bytes=1 << 20).aretrieve(["q"], 2))


def test_an_error_message_is_cut_and_the_token_never_shown(
    server: Callable[[Behaviour], str],
) -> None:
    url = server(replies(422, json.dumps({"detail": "x" * 100_000}).encode()))
    endpoint = Endpoint(url, token="a-secret-token")
    with pytest.raises(EndpointError) as err:
        endpoint.retrieve(["q"], 2)
    assert err.value.status == 422 and len(str(err.value)) < MAX_DETAIL + 100
    assert "a-secret-token" not in repr(endpoint)


def test_an_address_that_is_not_http_is_refused_at_once() -> None:
    for url in ("127.0.0.1:8300", "http://[bad", "http://host:99999", "ftp://host"):
        with pytest.raises(ValueError, match="not http"):
            Endpoint(url)


def test_headers_that_drip_in_are_cut_at_the_deadline(server: Callable[[Behaviour], str]) -> None:
    def drip_headers(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.flush_headers()
        for i in range(30):  # 9 s of headers, each line well inside the read timeout
            handler.wfile.write(f"X-Slow-{i}: 1\r\n".encode())
            handler.wfile.flush()
            time.sleep(0.3)

    url = server(drip_headers)
    for ask in (
        lambda: Endpoint(url, timeout_s=0.6).retrieve(["q"], 2),
        lambda: Endpoint(url, timeout_s=0.6).health(),
    ):
        start = time.monotonic()
        with pytest.raises(EndpointError, match=r"did not answer within 0\.6 s"):
            ask()
        assert time.monotonic() - start < 2.0


def test_a_compressed_reply_is_refused_before_it_inflates(
    server: Callable[[Behaviour], str],
) -> None:
    import gzip

    bomb = gzip.compress(b" " * (64 << 20))  # 64 MiB of spaces in about 64 KiB

    def compressed(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Encoding", "gzip")
        handler.send_header("Content-Length", str(len(bomb)))
        handler.end_headers()
        handler.wfile.write(bomb)

    url = server(compressed)
    with pytest.raises(EndpointError, match="compressed"):
        Endpoint(url, max_reply_bytes=1 << 20).retrieve(["q"], 2)


@pytest.mark.parametrize(
    "body", [b"[" * 100_000, b"not json", b"[1, 2]"], ids=["nested", "not json", "a list"]
)
def test_a_broken_error_or_health_body_is_an_endpoint_error(
    server: Callable[[Behaviour], str], body: bytes
) -> None:
    with pytest.raises(EndpointError) as err:
        Endpoint(server(replies(422, body))).retrieve(["q"], 2)
    assert err.value.status == 422
    with pytest.raises(EndpointError, match="not a JSON object"):
        Endpoint(server(replies(200, body))).health()


def test_one_endpoint_keeps_one_connection_for_its_sync_and_async_calls() -> None:
    peers: list[tuple[str, int]] = []
    asked: list[int] = []

    class KeepAlive(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            peers.append(self.client_address)
            self._send(json.dumps({"documents": 2}).encode())

        def do_POST(self) -> None:
            peers.append(self.client_address)
            asked.append(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["k"])
            self._send(answer(GOOD))

        def _send(self, body: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), KeepAlive)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with Endpoint(f"http://127.0.0.1:{httpd.server_address[1]}") as endpoint:
            for _ in range(3):
                endpoint.retrieve(["q"], 2)
                asyncio.run(endpoint.aretrieve(["q"], 2))
            assert endpoint.documents() == 2 and endpoint.documents() == 2  # asked once
        assert len(peers) == 7 and len(set(peers)) == 1  # one connection, kept alive
        lc = pytest.importorskip("car_fl.serving.langchain_retriever")
        chain = lc.CarFlRetriever.from_endpoint(f"http://127.0.0.1:{httpd.server_address[1]}")
        assert len(chain.invoke("q")) == 2 and asked[-1] == 2  # its default k=4, cut to 2
    finally:
        httpd.shutdown()
        httpd.server_close()
