"""The classifier head's shapes and top-K retrieval from scores."""

from __future__ import annotations

import pytest
import torch

from car_fl.heads.scorer import ClassifierHead, retrieve, top_k


def test_head_with_pre_classifier_shapes() -> None:
    head = ClassifierHead(8, 5, pre_classifier_dim=16, dropout=0.5)
    assert head.pre_classifier is not None and head.pre_classifier.out_features == 16
    assert head(torch.randn(3, 8)).shape == (3, 5)


def test_a_head_needs_two_labels() -> None:
    with pytest.raises(ValueError, match="at least 2 labels, got 1"):
        ClassifierHead(8, 1)


def test_top_k_and_retrieve_return_best_labels_first() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, -1.0, 0.0]])
    scores, idx = top_k(logits, 2)
    assert idx.tolist() == [[1, 2], [0, 2]]
    assert torch.all(scores[:, 0] >= scores[:, 1])
    results = retrieve(logits, 5, ["a", "b", "c"])
    assert list(results[0].labels) == ["b", "c", "a"]
    assert results[0].scores == pytest.approx((3.0, 2.0, 0.1))  # the head's own scores
    assert results[1].probabilities is not None
    assert sum(results[1].probabilities) == pytest.approx(1.0)  # softmax over all labels
    assert results[1].hits[0].probability == pytest.approx(torch.softmax(logits[1], 0)[0].item())
    [mips] = retrieve(logits[:1], 2, ["a", "b", "c"], score_kind="cosine", calibrated=False)
    assert mips.score_kind == "cosine" and mips.probabilities is None
    assert [h.probability for h in mips.hits] == [None, None]
    with pytest.raises(ValueError, match="score_kind must be one of"):
        retrieve(logits, 1, ["a", "b", "c"], score_kind="softmax")
    with pytest.raises(ValueError, match="K must be >= 1"):
        top_k(logits, 0)


def test_top_k_breaks_ties_by_label_so_a_smaller_k_is_a_prefix_of_a_larger() -> None:
    # the endpoint answers a batch at its largest k and cuts each request to its own
    logits = torch.zeros(3, 300)
    logits[:, ::7] = 1.0
    logits[1, 5] = 2.0
    _, every = top_k(logits, 300)
    for k in (1, 5, 43, 44, 120):
        _, idx = top_k(logits, k)
        assert torch.equal(idx, every[:, :k])
    assert every[0, :3].tolist() == [0, 7, 14]  # equal scores: the lower label first
    assert every[1, :2].tolist() == [5, 0]


def test_retrieve_returns_each_labels_document_or_its_name() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    [named] = retrieve(logits, 2, ["a", "b", "c"])
    assert named.documents == ("b", "c")
    [documented] = retrieve(logits, 2, ["a", "b", "c"], ["doc a", "doc b", "doc c"])
    assert documented.labels == ("b", "c") and documented.documents == ("doc b", "doc c")
    assert documented.scores == named.scores
