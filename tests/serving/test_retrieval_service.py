"""The retrieval endpoint on a real Ray Serve app, started as ``car-fl serve`` on 127.0.0.1.

One service for the whole module (a start costs ~25 s on 2 cores): equal to
``load_retriever(...).retrieve``, many clients at once batched without changing an answer,
every bad input a 4xx naming its field while it keeps serving, the LangChain and LlamaIndex
retrievers against it with its token, and a stop that leaves no process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from car_fl.serving.checkpoint import load_retriever
from car_fl.serving.retrieval_client import Endpoint, EndpointError
from tests.serving.processes import ServingProcess
from tests.serving.test_retrieval_api import BAD, QUERIES, TOKEN, assert_same

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def running(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServingProcess]:
    command = ["serve", "--checkpoint", str(checkpoint), "--device", "cpu"]
    service = ServingProcess(command, tmp_path_factory.mktemp("retrieval-service"), token=TOKEN)
    service.start()
    yield service
    service.end()


@pytest.fixture(scope="module")
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


def test_stopped_it_leaves_no_process(running: ServingProcess) -> None:
    assert running.stop() == []
    assert running.proc is not None and running.proc.returncode == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{running.url}/health", timeout=5)
