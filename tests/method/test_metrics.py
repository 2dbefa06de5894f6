"""Metrics against hand-computed values, and properties that must hold for any input."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from car_fl.method.metrics import macro_f1, mean_reciprocal_rank, retrieval_metrics, topk_accuracy


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
    assert topk_accuracy(logits, labels, 1) == 0.25
    assert topk_accuracy(logits, labels, 2) == 0.75
    assert topk_accuracy(logits, labels, 3) == 1.0
    assert abs(mean_reciprocal_rank(logits, labels) - (1 + 0.5 + 1 / 3 + 0.5) / 4) < 1e-7


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
    metrics = retrieval_metrics(logits, labels, top_k=list(range(1, c + 1)))
    accs = [metrics[f"top{k}"] for k in range(1, c + 1)]
    assert accs == sorted(accs) and accs[-1] == 1.0
    assert metrics["top1"] <= metrics["mrr"] <= 1.0


def test_empty_input_gives_nan_not_a_crash() -> None:
    empty = torch.zeros(0, 3)
    assert torch.isnan(torch.tensor(topk_accuracy(empty, torch.zeros(0, dtype=torch.long), 1)))
