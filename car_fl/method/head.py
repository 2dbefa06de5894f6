"""The classifier head and top-K retrieval.

``ClassifierHead``: pooled states ``(batch, d)`` → logits ``(batch, labels)``, either one linear
layer or a linear pre-classifier, ReLU, dropout, then the linear classifier. The K largest
scores of a query are its K retrieved labels (documents): a :class:`Retrieval`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


class ClassifierHead(nn.Module):
    """``(batch, d)`` → ``(batch, num_labels)``."""

    def __init__(
        self,
        dim: int,
        num_labels: int,
        *,
        pre_classifier_dim: int | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if num_labels < 2:
            raise ValueError(f"a classifier needs at least 2 labels, got {num_labels}")
        self.pre_classifier = (
            nn.Linear(dim, pre_classifier_dim) if pre_classifier_dim is not None else None
        )
        self.dropout = nn.Dropout(dropout)
        width = pre_classifier_dim if pre_classifier_dim is not None else dim
        self.classifier = nn.Linear(width, num_labels)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        x = pooled.to(self.classifier.weight.dtype)
        if self.pre_classifier is not None:
            x = torch.relu(self.pre_classifier(x))
        logits: torch.Tensor = self.classifier(self.dropout(x))
        return logits


@dataclass(frozen=True)
class Hit:
    """One retrieved document: its id (the label name), text and softmax score."""

    id: str
    text: str
    score: float


@dataclass(frozen=True)
class Retrieval:
    """One query's best labels, best first: their names (document ids), softmax scores and
    documents (texts)."""

    labels: tuple[str, ...]
    scores: tuple[float, ...]
    documents: tuple[str, ...]

    @property
    def hits(self) -> list[Hit]:
        """The retrieved documents as (id, text, score), best first."""
        return [
            Hit(id=i, text=t, score=s)
            for i, t, s in zip(self.labels, self.documents, self.scores, strict=True)
        ]


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax scores and indices of the ``k`` best labels: two ``(batch, min(k, labels))``."""
    if k < 1:
        raise ValueError(f"K must be >= 1, got {k}")
    probs = torch.softmax(logits.float(), dim=-1)
    scores, indices = probs.topk(min(k, logits.shape[-1]), dim=-1)
    return scores, indices


def retrieve(
    logits: torch.Tensor,
    k: int,
    label_names: Sequence[str],
    documents: Sequence[str] | None = None,
) -> list[Retrieval]:
    """For each query, its ``k`` best labels with scores and documents (default: the names)."""
    docs = label_names if documents is None else documents
    scores, indices = top_k(logits, k)
    return [
        Retrieval(
            labels=tuple(label_names[i] for i in row_i),
            scores=tuple(row_s),
            documents=tuple(docs[i] for i in row_i),
        )
        for row_s, row_i in zip(scores.tolist(), indices.tolist(), strict=True)
    ]
