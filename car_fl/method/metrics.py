"""Retrieval metrics from logits: top-K accuracy, mean reciprocal rank, macro-F1."""

from __future__ import annotations

import torch


def ranks(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """1-based rank of the true label among each row's logits ``(batch,)``.

    Ties count against the model: a label tied with others is ranked after them.
    """
    true = logits.gather(1, labels.view(-1, 1))  # (batch, 1)
    return (logits >= true).sum(dim=1)


def topk_accuracy(logits: torch.Tensor, labels: torch.Tensor, k: int) -> float:
    """Fraction of queries whose true label is among the ``k`` best."""
    if len(labels) == 0:
        return float("nan")
    return float((ranks(logits, labels) <= k).float().mean())


def mean_reciprocal_rank(logits: torch.Tensor, labels: torch.Tensor) -> float:
    if len(labels) == 0:
        return float("nan")
    return float((1.0 / ranks(logits, labels).float()).mean())


def macro_f1(predictions: torch.Tensor, labels: torch.Tensor, num_labels: int) -> float:
    """Unweighted mean of per-label F1 over the labels that occur in ``labels`` or predictions."""
    f1s = []
    for label in range(num_labels):
        predicted = predictions == label
        actual = labels == label
        if not bool(predicted.any()) and not bool(actual.any()):
            continue
        tp = float((predicted & actual).sum())
        precision = tp / max(float(predicted.sum()), 1.0)
        recall = tp / max(float(actual.sum()), 1.0)
        f1s.append(0.0 if tp == 0 else 2 * precision * recall / (precision + recall))
    return float(sum(f1s) / len(f1s)) if f1s else float("nan")


def retrieval_metrics(
    logits: torch.Tensor, labels: torch.Tensor, *, top_k: list[int], loss: float | None = None
) -> dict[str, float]:
    """``loss`` (if given), ``top1``, ``top{k}`` for each K, ``mrr`` and ``macro_f1``."""
    logits = logits.float()
    out: dict[str, float] = {}
    if loss is not None:
        out["loss"] = loss
    for k in sorted({1, *top_k}):
        out[f"top{k}"] = topk_accuracy(logits, labels, k)
    out["mrr"] = mean_reciprocal_rank(logits, labels)
    out["macro_f1"] = macro_f1(logits.argmax(dim=1), labels, logits.shape[1])
    return out
