"""Admission at the proxy, as a hostile client meets it: each limit on a pure ASGI app.

The app behind it records what it was handed; a refused request must never reach it. The same
middleware on Serve's real proxy is tested in test_retrieval_service.py (600 slow bodies).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from car_fl.serving.admission import (
    Admission,
    AdmissionConfig,
    drain,
    environment,
    proxy_middlewares,
    token_digest,
)

TOKEN = "an-admission-token"


class Behind:
    """The app behind admission: it answers 200 with the body it was handed."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.release = asyncio.Event()
        self.hold = False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        message = await receive()
        self.bodies.append(message["body"])
        assert message["more_body"] is False
        if self.hold:
            await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": message["body"]})


def config(**kw: Any) -> AdmissionConfig:
    values: dict[str, Any] = {"max_body": 100, "token_sha256": token_digest(TOKEN)}
    return AdmissionConfig(**{**values, **kw})


def scope(
    *, client: str = "10.0.0.1", token: str | None = TOKEN, length: int | None = 5, **extra: bytes
) -> dict[str, Any]:
    headers = [(k.replace("_", "-").encode(), v) for k, v in extra.items()]
    if token is not None:
        headers.append((b"authorization", f"Bearer {token}".encode()))
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    return {"type": "http", "path": "/retrieve", "client": (client, 5000), "headers": headers}


async def call(
    admission: Admission, request: dict[str, Any], chunks: list[bytes], *, gap_s: float = 0.0
) -> tuple[int, dict[bytes, bytes], bytes]:
    sent: list[dict[str, Any]] = []
    queue = list(chunks)

    async def receive() -> dict[str, Any]:
        if not queue:
            await asyncio.sleep(3600)
        await asyncio.sleep(gap_s)
        chunk = queue.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(queue)}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await admission(request, receive, send)
    start = sent[0]
    return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def test_a_whole_body_reaches_the_app_in_one_message() -> None:
    behind = Behind()
    status, _, body = run(call(Admission(behind, config=config()), scope(), [b"ab", b"cde"]))
    assert (status, body, behind.bodies) == (200, b"abcde", [b"abcde"])


@pytest.mark.parametrize(
    ("request_scope", "status", "says"),
    [
        (scope(token=None), 401, "Authorization"),
        (scope(token="not-the-token"), 401, "Authorization"),
        (scope(transfer_encoding=b"chunked", length=None), 411, "Content-Length"),
        (scope(length=101), 413, "at most 100"),
        (scope(length=None, content_length="²".encode()), 400, "Content-Length"),
    ],
    ids=["no token", "wrong token", "chunked", "too long", "not a number"],
)
def test_what_the_headers_refuse_is_refused_before_the_body(
    request_scope: dict[str, Any], status: int, says: str
) -> None:
    behind = Behind()
    got, _, body = run(call(Admission(behind, config=config()), request_scope, []))
    assert got == status and says in json.loads(body)["detail"]
    assert behind.bodies == []


def test_a_body_longer_than_declared_or_too_slow_never_reaches_the_app() -> None:
    behind = Behind()
    admission = Admission(behind, config=config(body_timeout_s=0.2))
    status, _, body = run(call(admission, scope(length=3), [b"ab", b"cd"]))
    assert status == 400 and "longer" in json.loads(body)["detail"]
    status, _, body = run(call(admission, scope(length=5), [b"a", b"b", b"c"], gap_s=0.15))
    assert status == 408 and "0.2 s" in json.loads(body)["detail"]  # 5 bytes: ~0 s more
    assert behind.bodies == [] and not admission.open and admission.buffered == 0


def test_a_client_at_its_cap_gets_503_with_retry_after_and_another_client_is_served() -> None:
    async def scenario() -> None:
        behind = Behind()
        behind.hold = True
        admission = Admission(behind, config=config(per_client=2, max_open=3))
        held = [asyncio.create_task(call(admission, scope(), [b"abcde"])) for _ in range(2)]
        await asyncio.sleep(0.05)
        status, headers, _ = await call(admission, scope(), [b"abcde"])
        assert (status, headers[b"retry-after"]) == (503, b"1")
        other = asyncio.create_task(call(admission, scope(client="10.0.0.2"), [b"abcde"]))
        await asyncio.sleep(0.05)
        status, _, body = await call(admission, scope(client="10.0.0.3"), [b"abcde"])
        assert status == 503 and "open requests' limit" in json.loads(body)["detail"]
        behind.release.set()
        assert [(await t)[0] for t in [*held, other]] == [200, 200, 200]
        assert not admission.open

    run(scenario())


def test_bodies_past_the_buffer_budget_or_a_clients_share_of_it_get_503() -> None:
    behind = Behind()
    admission = Admission(behind, config=config(max_buffered=40))
    admission.buffered = 36  # other requests' bodies being read
    status, headers, _ = run(call(admission, scope(length=5), [b"abcde"]))
    assert (status, headers[b"retry-after"]) == (503, b"1")
    admission.buffered, admission.reserved["10.0.0.1"] = 6, 6  # this client's own: 6 of 10
    status, _, body = run(call(admission, scope(length=5), [b"abcde"]))
    assert status == 503 and "share" in json.loads(body)["detail"]
    status, _, _ = run(call(admission, scope(client="10.0.0.2", length=5), [b"abcde"]))
    assert status == 200 and admission.reserved == {"10.0.0.1": 6}


def test_a_large_body_gets_a_second_per_mib_beyond_the_timeout() -> None:
    admission = Admission(Behind(), config=config(max_body=8 << 20, body_timeout_s=0.1))
    chunk = b"x" * (1 << 20)  # 2 MiB arriving 0.3 s apart: 0.6 s, within 0.1 + 2 s
    status, _, _ = run(call(admission, scope(length=2 << 20), [chunk, chunk], gap_s=0.3))
    assert status == 200


def test_a_drain_refuses_new_requests_and_ends_when_the_open_ones_are_answered(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        behind = Behind()
        behind.hold = True
        cfg = config(drain_file=str(tmp_path / "drain"))
        admission = Admission(behind, config=cfg)
        flying = asyncio.create_task(call(admission, scope(), [b"abcde"]))
        await asyncio.sleep(0.05)
        pokes: list[int] = []

        def poke() -> None:  # a request the draining proxy refuses
            pokes.append(1)

        waiting = asyncio.create_task(asyncio.to_thread(drain, cfg, timeout_s=5, poke=poke))
        await asyncio.sleep(0.2)
        status, headers, _ = await call(admission, scope(client="10.0.0.9"), [b"abcde"])
        assert (status, headers[b"retry-after"]) == (503, b"1")
        assert not waiting.done()
        behind.release.set()
        assert (await flying)[0] == 200
        assert await waiting is True and pokes == [1]

    run(scenario())


def test_a_drain_of_an_idle_proxy_ends_at_its_poke_and_one_that_never_empties_times_out(
    tmp_path: Path,
) -> None:
    cfg = config(drain_file=str(tmp_path / "drain"))
    admission = Admission(Behind(), config=cfg)
    assert drain(cfg, timeout_s=5, poke=lambda: run(call(admission, scope(), [b"abcde"])))
    admission.open["10.0.0.1"] = 1  # a request that never ends
    (tmp_path / "drain.done").unlink()
    assert not drain(cfg, timeout_s=0.2, poke=lambda: run(call(admission, scope(), [b"abcde"])))


def test_the_proxy_reads_its_config_from_the_environment_and_never_the_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = config(open_paths=("/docs",))
    variables = environment(cfg)
    assert TOKEN not in json.dumps(variables)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    [middleware] = proxy_middlewares()
    assert middleware.kwargs["config"] == cfg
    monkeypatch.delenv("CAR_FL_ADMISSION")
    assert proxy_middlewares() == []
