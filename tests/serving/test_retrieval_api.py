"""car_fl.serving.retrieval_api: the endpoint's app in-process (FastAPI's test client, no Ray).

It answers exactly what ``load_retriever(...).retrieve`` returns, batches requests of different
``k`` into one call without changing any answer, refuses every bad input with a 4xx naming the
field (and keeps answering), checks the token, and logs queries by count only.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from car_fl.cli import main as cli_main
from car_fl.data.corpus import read_documents
from car_fl.data.labels import LabelMap
from car_fl.model.retriever import build_retriever
from car_fl.results.run import Checkpoint, save_checkpoint
from car_fl.serving.checkpoint import checkpoint_extra, load_retriever
from car_fl.serving.retrieval_api import (
    MAX_QUERY_CHARS,
    RetrievalService,
    RetrieveRequest,
    build_app,
)
from car_fl.serving.retrieval_service import RetrievalConfig
from car_fl.settings.compose import load_settings
from car_fl.testing.tiny import tiny_overrides

QUERIES = ["w5 w47", "k3 w2 w51", "w11 w31 w44 w45"]
TOKEN = "a-retrieval-token"


def corpus_checkpoint(
    folder: Path, tiny_llama: Path, tiny_corpus: tuple[Path, Path], *, seed: int = 0
) -> Path:
    """A document-head checkpoint of the tiny corpus, its documents titled, rows trained away
    from MIPS (random residuals): built in a second, no training."""
    documents, queries = tiny_corpus
    titled = folder / "documents.jsonl"
    folder.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in documents.read_text(encoding="utf-8").splitlines()]
    titled.write_text(
        "".join(json.dumps({**r, "title": f"Title of {r['id']}"}) + "\n" for r in rows),
        encoding="utf-8",
    )
    settings = load_settings(
        [
            *tiny_overrides(tiny_llama, queries, cache_dir=folder / "cache"),
            "dataset=corpus",
            f"dataset.documents_path={titled}",
            "approach=document",
        ]
    )
    docs = read_documents(titled)
    labels = LabelMap(tuple(d.id for d in docs))
    model = build_retriever(settings, len(docs), documents=[d.text for d in docs])
    torch.manual_seed(seed)
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in model.trainable_state_dict().items()}
    ckpt = Checkpoint(
        state=state,
        label_map=labels,
        settings=settings,
        round=1,
        extra=checkpoint_extra(settings, labels.names, model),
    )
    return save_checkpoint(folder / "ckpt", ckpt)


@pytest.fixture(scope="module")
def service(checkpoint: Path) -> RetrievalService:
    return RetrievalService(
        load_retriever(checkpoint, device="cpu"), checkpoint=checkpoint, token=TOKEN
    )


@pytest.fixture(scope="module")
def client(service: RetrievalService) -> TestClient:
    return TestClient(build_app(service), headers={"Authorization": f"Bearer {TOKEN}"})


def assert_same(payload: dict, checkpoint: Path, queries: list[str], k: int) -> None:
    """``payload`` (a /retrieve answer) is exactly what load_retriever's retrieve returns."""
    want = load_retriever(checkpoint, device="cpu").retrieve(queries, k)
    titles = {d.id: d.title for d in read_documents(checkpoint.parent / "documents.jsonl")}
    got = payload["results"]
    assert len(got) == len(want)
    for result, retrieval in zip(got, want, strict=True):
        assert result["score_kind"] == retrieval.score_kind
        docs = result["documents"]
        assert [d["id"] for d in docs] == list(retrieval.labels)
        assert [d["rank"] for d in docs] == list(range(1, len(docs) + 1))
        assert [d["text"] for d in docs] == list(retrieval.documents)
        assert [d["title"] for d in docs] == [titles[i] for i in retrieval.labels]
        for d, score in zip(docs, retrieval.scores, strict=True):
            assert abs(d["score"] - score) <= 1e-6


def test_it_answers_exactly_what_load_retriever_retrieves(
    client: TestClient, checkpoint: Path
) -> None:
    response = client.post("/retrieve", json={"queries": QUERIES, "k": 3})
    assert response.status_code == 200
    assert_same(response.json(), checkpoint, QUERIES, 3)
    one = client.post("/retrieve", json={"queries": QUERIES[0], "k": 12})  # a string is one
    assert one.status_code == 200
    assert_same(one.json(), checkpoint, QUERIES[:1], 12)  # k = every document


def test_a_batch_of_requests_of_different_k_answers_each_as_alone(
    service: RetrievalService,
) -> None:
    requests = [
        RetrieveRequest(queries=QUERIES[:2], k=1),
        RetrieveRequest(queries=QUERIES[2:], k=5),
        RetrieveRequest(queries=QUERIES, k=3),
    ]
    chunked = RetrievalService(service.retriever, checkpoint="c", encode_batch=2)
    together = chunked.run(requests)  # encoded 2 at a time, sorted by length
    for request, answer in zip(requests, together, strict=True):
        [alone] = service.run([request])
        assert all(len(r.documents) == request.k for r in answer.results)
        for got, want in zip(answer.results, alone.results, strict=True):
            assert [d.id for d in got.documents] == [d.id for d in want.documents]
            assert [d.title for d in got.documents] == [d.title for d in want.documents]
            for a, b in zip(got.documents, want.documents, strict=True):  # padded with others:
                assert abs(a.score - b.score) <= 1e-6 * max(1.0, abs(b.score))  # float32 bits


BAD = [
    ({"queries": [""], "k": 2}, "queries", "query 0 is empty"),
    ({"queries": ["w5", "   "], "k": 2}, "queries", "query 1 is empty"),
    ({"queries": ["\u200b\u200b\ufeff"], "k": 2}, "queries", "query 0 is empty"),
    ({"queries": ["\x00\x00"], "k": 2}, "queries", "query 0 is empty"),
    ({"queries": "x" * 1_000_000, "k": 2}, "queries", f"at most {MAX_QUERY_CHARS}"),
    ({"queries": [], "k": 2}, "queries", "at least 1"),
    ({"queries": ["w5"], "k": 0}, "k", "greater than or equal to 1"),
    ({"queries": ["w5"], "k": -3}, "k", "greater than or equal to 1"),
    ({"queries": ["w5"], "k": 13}, "k", "at most the 12 documents"),
    ({"queries": ["w5"], "k": "many"}, "k", "integer"),
    ({"queries": ["w5"], "k": "3"}, "k", "integer"),
    ({"queries": ["w5"], "k": True}, "k", "integer"),
    ({"queries": ["w5"], "k": 2.0}, "k", "integer"),
    ({"queries": ["w5"]}, "k", "required"),
    ({"queries": ["w5"], "k": 2, "top_secret_field": 3}, "body", "unknown field"),
    ({"queries": [5], "k": 2}, "queries.0", "string"),
]


@pytest.mark.parametrize(("body", "field", "says"), BAD, ids=[b[2] for b in BAD])
def test_bad_input_is_a_4xx_naming_the_field_and_it_keeps_answering(
    client: TestClient, body: dict, field: str, says: str
) -> None:
    response = client.post("/retrieve", json=body)
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert detail.startswith(f"{field}: ") and says in detail
    assert len(response.content) < 1000  # the input is never echoed back
    assert "secret" not in detail and "many" not in detail and "13" not in detail
    assert client.post("/retrieve", json={"queries": ["w5"], "k": 1}).status_code == 200


def test_a_lone_surrogate_is_a_4xx_and_a_query_that_breaks_the_model_fails_alone(
    client: TestClient, service: RetrievalService, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = b'{"queries": ["w5", "w2 \\ud800 w3"], "k": 1}'  # valid JSON, not valid UTF-8 text
    response = client.post("/retrieve", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 422
    assert (
        response.json()["detail"].startswith("queries: ")
        and "surrogate" in response.json()["detail"]
    )
    real = service.retriever.retrieve
    calls: list[int] = []

    def breaks_on_w2(queries: list[str], k: int, **kw: int | None) -> list:
        calls.append(len(queries))
        if any("w2" in q for q in queries):
            raise RuntimeError("the model broke")
        return real(queries, k, **kw)

    monkeypatch.setattr(service.retriever, "retrieve", breaks_on_w2)
    good = ["w5 w47", "w11 w31 w44 w45", "w7", "w9 w13", "w17", "w19 w33", "w39"]
    texts = [*good[:5], QUERIES[1], *good[5:]]  # the sixth of eight holds w2
    answers = service.run_each([RetrieveRequest(queries=[q], k=2) for q in texts])
    assert [isinstance(a, RuntimeError) for a in answers] == [i == 5 for i in range(8)]
    assert len(calls) <= 7  # halves down to the bad one: 2 log2 8 + 1, not 8 + 1
    for answer, query in zip(answers, texts, strict=True):
        if isinstance(answer, Exception):
            continue
        [want] = service.run([RetrieveRequest(queries=[query], k=2)])
        assert [d.id for d in answer.results[0].documents] == [
            d.id for d in want.results[0].documents
        ]


def test_a_body_above_the_bound_is_refused_unread(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    import car_fl.serving.retrieval_api as api

    monkeypatch.setattr(api, "MAX_BODY", 1000)
    response = client.post("/retrieve", json={"queries": ["w5 " * 500], "k": 1})
    assert response.status_code == 413 and response.json()["detail"].startswith("body: ")
    assert client.post("/retrieve", json={"queries": ["w5"], "k": 1}).status_code == 200


def test_a_malformed_body_is_a_4xx_naming_the_body(client: TestClient) -> None:
    malformed = (
        b"{not json",
        b"",
        b"[1, 2]",
        b'{"queries": ["\xff\xfe"], "k": 1}',  # not UTF-8
        bytes(range(256)),  # binary
        b'{"queries": ["w5"], "k": 1' + b"0" * 5000 + b"}",  # an integer of 5,000 digits
        b"[" * 100_000 + b"]" * 100_000,  # nested past any parser's stack
    )
    for content in malformed:
        response = client.post(
            "/retrieve", content=content, headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 422 and response.json()["detail"].startswith("body: ")


def test_a_missing_or_wrong_token_is_refused_and_the_schema_is_open(
    service: RetrievalService, client: TestClient
) -> None:
    bare = TestClient(build_app(service))
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": TOKEN}):
        for method, path in (("post", "/retrieve"), ("get", "/health")):
            response = bare.request(method, path, json={"queries": ["w5"], "k": 1}, headers=headers)
            assert response.status_code == 401 and "Authorization" in response.json()["detail"]
    schema = bare.get("/openapi.json")
    assert schema.status_code == 200 and {"/retrieve", "/health"} <= set(schema.json()["paths"])
    page = bare.get("/docs")
    assert page.status_code == 200 and "POST /retrieve" in page.text
    assert "<script" not in page.text and "cdn" not in page.text.lower()  # nothing to fetch
    health = client.get("/health").json()
    assert health["documents"] == 12 and health["head"] == "document"
    assert len(health["fingerprint"]) == 16 and health["model"]


def test_queries_are_logged_by_count_never_by_content(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        assert client.post("/retrieve", json={"queries": ["secret w5 words"], "k": 1}).is_success
    assert "1 queries" in caplog.text and "secret" not in caplog.text


def test_the_config_refuses_other_hosts_without_a_token_or_tls_and_small_batches() -> None:
    with pytest.raises(ValueError, match="without a token"):
        RetrievalConfig(host="0.0.0.0")
    with pytest.raises(ValueError, match=r"in clear text.*--ssl-certfile.*--plain-http"):
        RetrievalConfig(host="0.0.0.0", token="t")
    assert RetrievalConfig(host="0.0.0.0", token="t", plain_http=True).url == (
        "http://0.0.0.0:8300"
    )
    tls = RetrievalConfig(host="10.0.0.2", token="t", ssl_certfile="c", ssl_keyfile="k")
    assert tls.url == "https://10.0.0.2:8300"
    assert "a-secret-token" not in repr(RetrievalConfig(token="a-secret-token"))
    with pytest.raises(ValueError, match="--max-batch-queries"):
        RetrievalConfig(max_batch_queries=8)


def test_a_checkpoint_that_cannot_load_fails_in_one_line_before_ray_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import ray

    assert cli_main(["serve", "--checkpoint", str(tmp_path), "--port", "8399"]) == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("car-fl serve: ") and "not a car-fl checkpoint" in line
    assert not ray.is_initialized()
