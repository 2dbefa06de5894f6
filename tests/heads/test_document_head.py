"""The document-initialised head: starts as MIPS, new documents are rows, maps start as identity."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from car_fl.heads.document_head import DocumentHead, ResidualMap
from car_fl.heads.retrieval import MIPSScorer
from car_fl.settings.schema import HeadConfig, MapKind, Similarity


def head_config(**changes: object) -> HeadConfig:
    return HeadConfig(kind="document", **changes)  # type: ignore[arg-type]


def trained_head(
    docs: torch.Tensor, queries: torch.Tensor, labels: torch.Tensor, **cfg: object
) -> DocumentHead:
    """A head after a few steps, so that Δ, the maps and the scale are not at their start."""
    head = DocumentHead(docs.shape[1], len(docs), head_config(**cfg))
    head.set_document_features(docs)
    optimizer = torch.optim.Adam(head.parameters(), lr=0.05)
    head.train()
    for _ in range(5):
        loss = F.cross_entropy(head(queries), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return head.eval()


def test_before_training_the_document_head_is_mips_with_cosine_similarity() -> None:
    g = torch.Generator().manual_seed(0)
    docs, queries = torch.randn(30, 16, generator=g), torch.randn(9, 16, generator=g)
    for query_map in MapKind:
        for document_map in MapKind:
            cfg = head_config(scale=7.0, query_map=query_map, document_map=document_map)
            head = DocumentHead(16, 30, cfg)
            head.set_document_features(docs)
            mips = MIPSScorer(30, similarity=Similarity.COSINE, temperature=1 / 7.0)
            mips.set_document_features(docs)
            ours, theirs = head(queries), mips(queries, docs)
            assert torch.allclose(ours, theirs, atol=1e-5)
            assert torch.equal(ours.argmax(dim=1), theirs.argmax(dim=1))


def test_adding_a_document_row_changes_no_other_documents_score() -> None:
    g = torch.Generator().manual_seed(1)
    docs, queries = torch.randn(20, 8, generator=g), torch.randn(40, 8, generator=g)
    labels = torch.randint(0, 20, (40,), generator=g)
    head = trained_head(
        docs, queries, labels, query_map=MapKind.LOWRANK, document_map=MapKind.LINEAR, map_rank=3
    )
    assert head.rows is not None and head.rows.abs().sum() > 0  # trained: not at its start
    before = head(queries)
    added = head.add_documents(torch.randn(3, 8, generator=g))
    after = head(queries)
    assert list(added) == [20, 21, 22] and after.shape == (40, 23)
    assert torch.equal(after[:, :20], before)
    assert head.rows is not None and torch.equal(head.rows[20:], torch.zeros(3, 8))


def test_untrained_rows_stay_at_the_document_embedding_as_if_added_after_training() -> None:
    g = torch.Generator().manual_seed(2)
    docs, queries = torch.randn(12, 8, generator=g), torch.randn(50, 8, generator=g)
    labels = torch.randint(0, 9, (50,), generator=g)  # documents 9-11 have no training query
    torch.manual_seed(0)
    masked = DocumentHead(8, 12, head_config())
    masked.set_document_features(docs)
    masked.set_trained_rows(torch.arange(12) < 9)
    optimizer = torch.optim.Adam(masked.parameters(), lr=0.05)
    masked.train()
    for _ in range(5):
        loss = F.cross_entropy(masked(queries), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    masked.eval()
    assert masked.rows is not None and torch.equal(masked.rows[9:], torch.zeros(3, 8))
    torch.manual_seed(0)
    later = trained_head(docs[:9], queries, labels)  # trained on 9 documents, 3 added after
    later.add_documents(docs[9:])
    assert torch.allclose(masked(queries), later(queries), atol=1e-5)


def test_residual_maps_start_as_the_identity() -> None:
    x = torch.randn(5, 12)
    for kind in (MapKind.LINEAR, MapKind.LOWRANK):
        assert torch.equal(ResidualMap(12, kind, rank=4)(x), x)
