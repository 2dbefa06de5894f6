"""Metrics against hand-computed values, and properties that must hold for any input."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from car_fl.training.train import macro_f1, rank_metrics
from car_fl.training.train import rank_of_true as ranks


def whole_matrix(logits: torch.Tensor, labels: torch.Tensor, top_k: list[int]) -> dict[str, float]:
    """The metrics of a whole ``(queries, labels)`` score matrix, as an evaluation reports them."""
    predictions = logits.argmax(dim=1)
    return rank_metrics(
        ranks(logits, labels),
        top_k=top_k,
        predictions=predictions,
        labels=labels,
        num_labels=logits.shape[1],
    )


def test_hand_computed_topk_and_mrr() -> None:
    logits = torch.tensor(
        [
            [0.9, 0.1, 0.0],  # true 0: rank 1
            [0.9, 0.1, 0.0],  # true 1: rank 2
            [0.9, 0.1, 0.0],  # true 2: rank 3
            [0.2, 0.3, 0.5],  # true 1: rank 2
        ]
    )
    labels = torch.tensor([0, 1, 2, 1])
    out = whole_matrix(logits, labels, [1, 2, 3])
    assert (out["top1"], out["top2"], out["top3"]) == (0.25, 0.75, 1.0)
    assert abs(out["mrr"] - (1 + 0.5 + 1 / 3 + 0.5) / 4) < 1e-7


def test_hand_computed_macro_f1() -> None:
    preds = torch.tensor([0, 0, 1, 1])
    labels = torch.tensor([0, 1, 1, 1])
    # label 0: P=1/2 R=1 F1=2/3; label 1: P=1 R=2/3 F1=0.8
    assert abs(macro_f1(preds, labels, 3) - (2 / 3 + 0.8) / 2) < 1e-7


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 20), c=st.integers(2, 8), seed=st.integers(0, 10_000))
def test_topk_is_monotone_and_reaches_one(n: int, c: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, c, generator=g)
    labels = torch.randint(0, c, (n,), generator=g)
    metrics = whole_matrix(logits, labels, list(range(1, c + 1)))
    accs = [metrics[f"top{k}"] for k in range(1, c + 1)]
    assert accs == sorted(accs) and accs[-1] == 1.0
    assert metrics["top1"] <= metrics["mrr"] <= 1.0


def test_empty_input_gives_nan_not_a_crash() -> None:
    out = rank_metrics(ranks(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long)), top_k=[1])
    assert math.isnan(out["top1"]) and math.isnan(out["mrr"])


def test_hand_computed_recall_and_ndcg_from_ranks() -> None:
    rank = torch.tensor([1, 3, 7, 12])
    out = rank_metrics(rank, top_k=[5])
    assert out["recall@1"] == 0.25 and out["recall@5"] == 0.5 and out["recall@10"] == 0.75
    assert out["top5"] == out["recall@5"]
    ndcg = (1.0 + 1 / math.log2(4) + 1 / math.log2(8) + 0.0) / 4
    assert abs(out["ndcg@10"] - ndcg) < 1e-12
    assert abs(out["mrr"] - (1 + 1 / 3 + 1 / 7 + 1 / 12) / 4) < 1e-12


def test_batched_evaluation_equals_the_whole_matrix() -> None:
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(50, 30, generator=g), torch.randint(0, 30, (50,), generator=g)
    whole = whole_matrix(logits, labels, [5])
    batched = torch.cat([ranks(logits[i : i + 7], labels[i : i + 7]) for i in range(0, 50, 7)])
    predictions = logits.argmax(dim=1)
    parts = rank_metrics(batched, top_k=[5], predictions=predictions, labels=labels, num_labels=30)
    assert parts == {k: v for k, v in whole.items() if k != "loss"}
