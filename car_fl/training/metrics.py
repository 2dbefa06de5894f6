"""Retrieval metrics: top-K accuracy, Recall@K, MRR, nDCG@10, macro-F1.

Every metric is a function of the true label's rank per query (:func:`ranks`), so an
evaluation keeps one rank and one prediction per query. With one relevant document per query
Recall@K is top-K accuracy and nDCG@10 is 1/log2(1 + rank) for a rank of at most 10, else 0.
"""

from __future__ import annotations

import torch


def ranks(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """1-based rank of the true label among each row's logits; ties count against the model."""
    true = logits.gather(1, labels.view(-1, 1))  # (batch, 1)
    return (logits >= true).sum(dim=1)


def macro_f1(predictions: torch.Tensor, labels: torch.Tensor, num_labels: int) -> float:
    """Unweighted mean of per-label F1 over the labels that occur in ``labels`` or predictions."""
    predictions, labels = predictions.long().cpu(), labels.long().cpu()
    predicted = torch.bincount(predictions, minlength=num_labels).double()
    actual = torch.bincount(labels, minlength=num_labels).double()
    tp = torch.bincount(labels[predictions == labels], minlength=num_labels).double()
    present = (predicted > 0) | (actual > 0)
    if not bool(present.any()):
        return float("nan")
    precision = tp / predicted.clamp_min(1.0)
    recall = tp / actual.clamp_min(1.0)
    f1 = torch.where(tp > 0, 2 * precision * recall / (precision + recall).clamp_min(1e-300), 0.0)
    return float(f1[present].mean())


#: Recall@K and nDCG@K reported beside the top-K accuracies.
RECALL_K = (1, 5, 10)
NDCG_K = 10


def rank_metrics(
    rank: torch.Tensor,
    *,
    top_k: list[int],
    predictions: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    num_labels: int | None = None,
    loss: float | None = None,
) -> dict[str, float]:
    """Metrics of 1-based ranks: ``loss``, ``top{k}``, ``recall@{k}``, ``mrr``, ``ndcg@10``, F1."""
    out: dict[str, float] = {}
    if loss is not None:
        out["loss"] = loss
    r = rank.double()
    empty = len(r) == 0

    def share(mask: torch.Tensor) -> float:
        return float("nan") if empty else float(mask.double().mean())

    for k in sorted({1, *top_k}):
        out[f"top{k}"] = share(r <= k)
    for k in RECALL_K:
        out[f"recall@{k}"] = share(r <= k)
    out["mrr"] = float("nan") if empty else float((1.0 / r).mean())
    gain = torch.where(r <= NDCG_K, 1.0 / torch.log2(r + 1.0), torch.zeros_like(r))
    out[f"ndcg@{NDCG_K}"] = float("nan") if empty else float(gain.mean())
    if predictions is not None and labels is not None and num_labels is not None:
        out["macro_f1"] = macro_f1(predictions, labels, num_labels)
    return out
