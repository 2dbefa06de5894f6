"""car_fl.model.retriever: per-dimension scaling with the documents' statistics only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from car_fl.client.round import local_retriever
from car_fl.data.corpus import read_documents
from car_fl.data.labels import LabelMap
from car_fl.model.encoder import load_encoder
from car_fl.model.features import LocalData, document_features, trained_rows
from car_fl.model.retriever import MIN_DOCUMENTS, RELATIVE_FLOOR, Standardizer, build_retriever


def test_fitted_documents_have_mean_zero_and_unit_deviation_and_a_constant_dimension_is_kept() -> (
    None
):
    x = torch.randn(50, 6) * torch.tensor([1.0, 100.0, 0.1, 5.0, 1.0, 1.0]) + 3.0
    x[:, 4] = 7.0  # constant: divided by a floor, not by ~0
    s = Standardizer(6)
    assert torch.equal(s(x), x)  # the identity until fitted
    s.fit(x)
    y = s(x)
    torch.testing.assert_close(y.mean(0), torch.zeros(6), atol=1e-5, rtol=0)
    torch.testing.assert_close(y[:, [0, 1, 2, 3, 5]].std(0), torch.ones(5))
    assert torch.equal(y[:, 4], torch.zeros(50))
    query = torch.zeros(1, 6)
    query[0, 4] = 8.0  # a dimension documents never vary in cannot blow a query up
    floor = RELATIVE_FLOOR * float(x.std(0).median())
    torch.testing.assert_close(s(query)[0, 4], torch.tensor(1.0 / floor))
    assert "mean" not in s.state_dict()  # never saved, never sent: recomputed from the corpus


def test_too_few_documents_or_a_wrong_width_is_refused_with_the_fix() -> None:
    s = Standardizer(4)
    with pytest.raises(ValueError, match=rf"at least {MIN_DOCUMENTS} documents.*dataset=corpus"):
        s.fit(torch.randn(MIN_DOCUMENTS - 1, 4))
    with pytest.raises(ValueError, match="dimension 4"):
        s.fit(torch.randn(20, 5))


def test_standardize_needs_a_corpus(make_settings) -> None:
    with pytest.raises(ValueError, match=r"model.standardize=documents.*dataset=corpus"):
        make_settings("model.standardize=documents")


def test_mips_and_the_document_head_score_standardised_queries_against_standardised_documents(
    make_corpus_settings,
) -> None:
    settings = make_corpus_settings(
        "model.standardize=documents", "approach=mips", "head.similarity=cosine"
    )
    docs = [d.text for d in read_documents(settings.dataset.documents_path or "")]
    raw = document_features(
        settings, docs, get_encoder=lambda: load_encoder(settings.model, device="cpu")
    )
    trained = trained_rows(settings, len(docs))  # new documents arrive later: not in them
    assert trained is not None and not bool(trained.all())
    mean, deviation = raw[trained].mean(0), raw[trained].std(0)
    model = build_retriever(settings, len(docs), documents=docs)
    queries = torch.randn(3, raw.shape[1]) * 4
    expected = F.cosine_similarity(
        ((queries - mean) / deviation)[:, None], ((raw - mean) / deviation)[None], dim=-1
    )
    torch.testing.assert_close(model.head.reported(model.score(queries)), expected)
    head = make_corpus_settings("model.standardize=documents", "approach=document")
    document = build_retriever(head, len(docs), documents=docs)
    torch.testing.assert_close(
        document.head.documents, F.normalize((raw - mean) / deviation, dim=-1)
    )


def test_a_clients_queries_never_enter_the_statistics(make_corpus_settings) -> None:
    """Two clients with different queries (and a server with none) scale by one μ and σ: the
    documents'. Other documents give other statistics."""
    settings = make_corpus_settings("model.standardize=documents", "approach=document")
    docs = read_documents(settings.dataset.documents_path or "")
    names = LabelMap(tuple(d.id for d in docs))
    raw = document_features(
        settings, [d.text for d in docs], get_encoder=lambda: load_encoder(settings.model)
    )
    dim = raw.shape[1]
    trained = trained_rows(settings, len(docs))
    assert trained is not None

    def client(seed: int, n: int) -> LocalData:
        generator = torch.Generator().manual_seed(seed)
        return LocalData(
            labels=torch.randint(0, len(docs), (n,), generator=generator),
            features=torch.randn(n, dim, generator=generator) * (seed + 1),
        )

    first = local_retriever(settings, client(0, 30), names)
    second = local_retriever(settings, client(1, 5), names)
    server = build_retriever(settings, len(docs), documents=[d.text for d in docs])
    for model in (first, second, server):
        torch.testing.assert_close(model.standardizer.mean, raw[trained].mean(0))
        torch.testing.assert_close(model.standardizer.deviation, raw[trained].std(0))
    other = build_retriever(settings, len(docs), documents=[d.text + " w99" for d in docs])
    assert not torch.allclose(other.standardizer.mean, raw[trained].mean(0))
