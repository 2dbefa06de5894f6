"""The retrieval endpoint on a real Ray Serve app, started as ``car-fl serve`` on 127.0.0.1.

One service for the whole module (a start costs ~25 s on 2 cores): equal to
``load_retriever(...).retrieve``, many clients at once batched without changing an answer,
every bad input a 4xx naming its field while it keeps serving, the LangChain and LlamaIndex
retrievers against it with its token, 600 slow bodies from one client that leave another's
``/health`` and ``/retrieve`` answered within a second, headers that never end closed at their
deadline, a busy port refused in one line, and
a SIGTERM that answers the requests in flight, then stops leaving no process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from car_fl.serving.checkpoint import load_retriever
from car_fl.serving.retrieval_client import Endpoint, EndpointError
from tests.serving.processes import ServingProcess
from tests.serving.test_retrieval_api import BAD, QUERIES, TOKEN, assert_same

pytestmark = pytest.mark.slow

#: The service's body deadline in this module (the default is 10 s).
BODY_TIMEOUT_S = 4
#: The service's header deadline in this module (the default is 10 s).
HEADER_TIMEOUT_S = 3
#: Requests one client may have open: the default.
PER_CLIENT = 128
#: A slow body: its headers, then 1 byte of a declared 1,000.
SLOW_HEAD = (
    "POST /retrieve HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
    "Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
)


async def open_slow_bodies(
    port: int, n: int, body: bytes = b'{"queries": ["w5"], "k": 1}' + b" " * 973
) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """``n`` connections from 127.0.0.1 that each send their headers and ``body``'s first byte."""
    head = SLOW_HEAD.format(token=TOKEN, length=len(body)).encode()
    connections = []
    for _ in range(n):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head + body[:1])
        connections.append((reader, writer))
    await asyncio.gather(*(writer.drain() for _, writer in connections))
    return connections


async def status_of(reader: asyncio.StreamReader, timeout: float) -> tuple[int, bytes]:
    """A response's status and its head (``0`` when none came within ``timeout``)."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
        return 0, b""
    return int(head.split(b" ", 2)[1]), head.lower()


def other_client(running: ServingProcess) -> httpx.AsyncClient:
    """Another client: its requests come from 127.0.0.2 (all of 127/8 is loopback on Linux)."""
    return httpx.AsyncClient(
        base_url=running.url,
        headers={"Authorization": f"Bearer {TOKEN}"},
        transport=httpx.AsyncHTTPTransport(local_address="127.0.0.2"),
        timeout=30,
    )


@pytest.fixture(scope="module")
def service(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServingProcess]:
    command = ["serve", "--checkpoint", str(checkpoint), "--device", "cpu"]
    command += [
        "--body-timeout-s",
        str(BODY_TIMEOUT_S),
        "--header-timeout-s",
        str(HEADER_TIMEOUT_S),
    ]
    service = ServingProcess(command, tmp_path_factory.mktemp("retrieval-service"), token=TOKEN)
    service.start()
    yield service
    service.end()


@pytest.fixture
def running(service: ServingProcess) -> ServingProcess:
    """The module's service, started again if a test stopped it cleanly: pytest-xdist's
    worksteal may run the SIGTERM test before others of this module. A crash fails here."""
    assert service.proc is not None
    if service.proc.poll() is not None:
        log = (service.tmp / "service.log").read_text(errors="replace")[-3000:]
        assert service.proc.returncode == 0, f"the service ended by itself: {log}"
        service.start()
    return service


AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def client(running: ServingProcess) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=running.url, headers=headers, timeout=60) as http:
        yield http


def test_it_answers_what_load_retriever_retrieves_and_names_what_it_serves(
    client: httpx.Client, checkpoint: Path
) -> None:
    response = client.post("/retrieve", json={"queries": QUERIES, "k": 4})
    assert response.status_code == 200
    assert_same(response.json(), checkpoint, QUERIES, 4)
    health = client.get("/health").json()
    assert health["checkpoint"] == str(checkpoint) and health["documents"] == 12
    assert len(health["fingerprint"]) == 16 and health["model"]
    assert client.get("/docs").status_code == 200


#: A Ray Serve worker: its title (``/proc/PID/comm`` keeps 15 characters of it, and where the
#: title does not show in ``cmdline`` only those), or, untitled, Ray's worker scripts.
SERVE_WORKER = re.compile(r"ray::(ServeRepli|ProxyActor|ServeContr)|.*/(setup|default)_worker\.py$")


def _describe(process: psutil.Process) -> list[str]:
    """Its name and first arguments: what tells a Ray worker, however its title shows."""
    with contextlib.suppress(psutil.Error):  # gone since: nothing to tell
        return [process.name(), *process.cmdline()[:3]]
    return []


def test_its_replicas_and_proxy_run_at_the_commands_priority(running: ServingProcess) -> None:
    assert running.proc is not None
    deadline = time.monotonic() + 60  # the replica may still be starting under load
    while True:
        tree = psutil.Process(running.proc.pid).children(recursive=True)
        seen = {p.pid: _describe(p) for p in tree}
        serving = [p for p in tree if any(SERVE_WORKER.match(s) for s in seen[p.pid])]
        if len(serving) >= 3 or time.monotonic() > deadline:  # controller, proxy, replica
            break
        time.sleep(1)
    listing = "\n".join(f"{pid}: {described}" for pid, described in seen.items())
    assert len(serving) >= 3, f"Serve's workers not found in the service's tree:\n{listing}"
    niceness = {}
    for p in tree:
        with contextlib.suppress(psutil.Error):
            niceness[p.pid] = p.nice()
    wrong = {pid: nice for pid, nice in niceness.items() if nice != os.nice(0)}  # Ray's is 15
    assert not wrong, f"not at the command's niceness {os.nice(0)}: {wrong}\n{listing}"


def test_many_clients_at_once_each_get_their_own_answer(
    client: httpx.Client, checkpoint: Path
) -> None:
    loaded = load_retriever(checkpoint, device="cpu")
    asks = [(QUERIES[i % 3 :] or QUERIES, 1 + i % 5) for i in range(32)]

    def one(ask: tuple[list[str], int]) -> bool:
        queries, k = ask
        got = client.post("/retrieve", json={"queries": queries, "k": k}).json()["results"]
        want = loaded.retrieve(queries, k)
        return all(
            [d["id"] for d in g["documents"]] == list(w.labels)
            and all(  # batched with other clients' queries: equal to float32's last bits
                abs(d["score"] - s) <= 1e-6 * max(1.0, abs(s))
                for d, s in zip(g["documents"], w.scores, strict=True)
            )
            for g, w in zip(got, want, strict=True)
        )

    with ThreadPoolExecutor(32) as pool:
        assert all(pool.map(one, asks))


def test_every_bad_input_is_a_4xx_naming_its_field_and_it_keeps_serving(
    client: httpx.Client, running: ServingProcess
) -> None:
    for body, field, says in BAD:
        response = client.post("/retrieve", json=body)
        assert response.status_code == 422, (body if len(str(body)) < 100 else field, response)
        detail = response.json()["detail"]
        assert detail.startswith(f"{field}: ") and says in detail
    for content in (b"{not json", b"", b"[1, 2]"):
        response = client.post(
            "/retrieve", content=content, headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 422 and response.json()["detail"].startswith("body: ")
    for headers in ({}, {"Authorization": "Bearer not-the-token"}):
        bare = httpx.post(
            f"{running.url}/retrieve", json={"queries": ["w5"], "k": 1}, headers=headers
        )
        assert bare.status_code == 401 and "Authorization" in bare.json()["detail"]
    with pytest.raises(EndpointError, match="401"):
        Endpoint(running.url, token="not-the-token").retrieve(["w5"], 1)
    assert client.post("/retrieve", json={"queries": ["w5"], "k": 1}).status_code == 200


def test_the_langchain_and_llamaindex_retrievers_against_it_equal_load_retriever(
    running: ServingProcess, checkpoint: Path
) -> None:
    from car_fl.serving.langchain_retriever import CarFlRetriever

    loaded = load_retriever(checkpoint, device="cpu")
    chain = CarFlRetriever.from_endpoint(running.url, k=3, token=TOKEN)
    for query in QUERIES:
        [want] = loaded.retrieve([query], 3)
        for documents in (chain.invoke(query), asyncio.run(chain.ainvoke(query))):
            assert [d.id for d in documents] == list(want.labels)
            assert [d.page_content for d in documents] == list(want.documents)
            assert [d.metadata["rank"] for d in documents] == [1, 2, 3]
            assert (
                max(
                    abs(d.metadata["score"] - s)
                    for d, s in zip(documents, want.scores, strict=True)
                )
                <= 1e-6
            )
    llama = pytest.importorskip(
        "car_fl.serving.llamaindex_retriever",
        reason='needs llama-index-core: pip install -e ".[llamaindex]"',
    )
    index = llama.CarFlLlamaRetriever.from_endpoint(running.url, k=3, token=TOKEN)
    for query in QUERIES:
        [want] = loaded.retrieve([query], 3)
        for nodes in (index.retrieve(query), asyncio.run(index.aretrieve(query))):
            assert [n.node.node_id for n in nodes] == list(want.labels)
            assert max(abs(n.score - s) for n, s in zip(nodes, want.scores, strict=True)) <= 1e-6


def test_600_slow_bodies_leave_another_client_answered_within_a_second(
    running: ServingProcess, checkpoint: Path
) -> None:
    async def attack() -> None:
        slow = await open_slow_bodies(running.port, 600)
        try:
            async with other_client(running) as other:
                started = time.monotonic()
                health = await other.get("/health")
                assert health.status_code == 200, health.text
                assert time.monotonic() - started < 1.0
                started = time.monotonic()
                found = await other.post("/retrieve", json={"queries": QUERIES, "k": 4})
                assert time.monotonic() - started < 1.0
                assert found.status_code == 200, found.text
                assert_same(found.json(), checkpoint, QUERIES, 4)
            at_once = await asyncio.gather(*(status_of(r, 0.5) for r, _ in slow))
            busy = [head for status, head in at_once if status == 503]
            assert len(busy) == 600 - PER_CLIENT and all(b"retry-after: 1" in h for h in busy)
            held = [c for c, (status, _) in zip(slow, at_once, strict=True) if status == 0]
            assert len(held) == PER_CLIENT  # held at the proxy, never at the replica
            late = await asyncio.gather(*(status_of(r, BODY_TIMEOUT_S + 5) for r, _ in held))
            assert {status for status, _ in late} == {408}
        finally:
            for _, writer in slow:
                writer.close()

    asyncio.run(attack())


def test_headers_that_never_end_are_closed_at_their_deadline_and_others_are_served(
    running: ServingProcess,
) -> None:
    async def attack() -> None:
        held = []
        for i in range(300):  # half silent, half a header that never ends
            reader, writer = await asyncio.open_connection("127.0.0.1", running.port)
            writer.write(b"" if i % 2 else b"POST /retrieve HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            held.append((reader, writer))
        try:
            async with other_client(running) as other:
                started = time.monotonic()
                assert (await other.get("/health")).status_code == 200
                assert time.monotonic() - started < 1.0

            async def closed(reader: asyncio.StreamReader) -> float:
                started = time.monotonic()
                await asyncio.wait_for(reader.read(), HEADER_TIMEOUT_S + 10)
                return time.monotonic() - started

            waits = await asyncio.gather(*(closed(r) for r, _ in held))
            assert max(waits) < HEADER_TIMEOUT_S + 3
        finally:
            for _, writer in held:
                writer.close()

    asyncio.run(attack())


def test_a_second_service_on_its_port_fails_in_one_line_naming_the_holder(
    running: ServingProcess, checkpoint: Path
) -> None:
    command = ["serve", "--checkpoint", str(checkpoint), "--device", "cpu"]
    flags = ["--port", str(running.port)]
    started = time.monotonic()
    second = subprocess.run(
        [sys.executable, "-m", "car_fl.cli", *command, *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CAR_FL_SERVE_TOKEN": TOKEN},
    )
    assert second.returncode == 1 and time.monotonic() - started < 60
    [line] = second.stderr.strip().splitlines()
    assert f"127.0.0.1:{running.port} is in use by " in line and "--port" in line
    assert httpx.get(f"{running.url}/health", headers=AUTH, timeout=10).status_code == 200


def test_sigterm_answers_the_requests_in_flight_then_stops_leaving_no_process(
    running: ServingProcess,
) -> None:
    body = json.dumps({"queries": QUERIES, "k": 2}).encode()

    tree: list[psutil.Process] = []

    assert running.proc is not None
    folders = {  # Ray's temp folder of this service, named in its processes' command lines
        found
        for process in psutil.Process(running.proc.pid).children(recursive=True)
        for found in re.findall(r"/tmp/car-fl-ray-\w+", " ".join(process.cmdline()))
    }
    folders_seen = list(folders)
    assert len(folders_seen) == 1 and Path(folders_seen[0]).is_dir()

    async def stop_in_flight() -> tuple[list[int], int, str]:
        flying = await open_slow_bodies(running.port, 64, body)
        await asyncio.sleep(0.5)  # admitted: their bodies are being read
        tree.extend(running.terminate())
        await asyncio.sleep(1.0)
        async with other_client(running) as other:  # a new request while it drains
            late = await other.get("/health")
        for _, writer in flying:
            writer.write(body[1:])
        answered = await asyncio.gather(*(status_of(r, 30) for r, _ in flying))
        for _, writer in flying:
            writer.close()
        return [status for status, _ in answered], late.status_code, late.headers["retry-after"]

    statuses, late, retry_after = asyncio.run(stop_in_flight())
    assert statuses == [200] * 64
    assert (late, retry_after) == (503, "1")
    assert running.wait(tree) == []
    assert running.proc is not None and running.proc.returncode == 0
    assert not any(Path(folder).exists() for folder in folders_seen)
    log = (running.tmp / "service.log").read_text(errors="replace")
    for noise in ("graceful_shutdown failed", "HTTP config differs", "Traceback"):
        assert noise not in log, noise
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{running.url}/health", timeout=5)
