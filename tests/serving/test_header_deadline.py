"""The header deadline on a real uvicorn server (both of its protocols), as a slow client meets it.

A connection that sends nothing, or half a header, is closed at the deadline; a request sent at
once is answered; a kept-alive connection idle past the deadline still carries its next request.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from car_fl.serving.header_deadline import with_header_deadline

DEADLINE_S = 0.5
REQUEST = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
    )
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(params=[HttpToolsProtocol, H11Protocol], ids=["httptools", "h11"])
def port(request: pytest.FixtureRequest) -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=free,
        http=with_header_deadline(request.param, DEADLINE_S),
        lifespan="off",
        log_level="critical",
        timeout_keep_alive=30,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield free
    server.should_exit = True
    thread.join(timeout=5)


def answer(sock: socket.socket) -> bytes:
    """One whole response (its body is ``ok``)."""
    data = b""
    while not data.endswith(b"\r\n\r\nok"):
        chunk = sock.recv(1024)
        assert chunk, data
        data += chunk
    return data


def closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed ``sock`` (``None``: still open after ``seconds``)."""
    sock.settimeout(seconds)
    started = time.monotonic()
    try:
        while sock.recv(1024):
            pass
    except TimeoutError:
        return None
    return time.monotonic() - started


def test_a_silent_connection_and_half_a_header_are_closed_at_the_deadline(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as silent:
        assert (closed_within(silent, 3) or 9) < DEADLINE_S + 0.5
    with socket.create_connection(("127.0.0.1", port)) as slow:
        slow.sendall(b"GET / HTTP/1.1\r\nHo")
        assert (closed_within(slow, 3) or 9) < DEADLINE_S + 0.5


def test_a_prompt_request_and_a_kept_alive_connection_idle_past_it_are_answered(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(3)
        sock.sendall(REQUEST)
        assert answer(sock).startswith(b"HTTP/1.1 200")
        time.sleep(3 * DEADLINE_S)  # idle: the keep-alive timeout's (30 s), not the header's
        sock.sendall(REQUEST)
        assert answer(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET / HTTP/1.1\r\n")  # the next request's headers, never finished
        assert (closed_within(sock, 3) or 9) < DEADLINE_S + 0.5
