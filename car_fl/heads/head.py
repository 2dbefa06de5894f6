"""The classifier head (CaR's own scorer, :class:`ClassifierScorer`) and top-K retrieval.

``ClassifierHead``: ``(batch, d)`` → ``(batch, labels)``, one linear layer or a pre-classifier,
ReLU, dropout and the classifier; a query's K best labels are its :class:`Retrieval`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from car_fl.heads.config import HeadKind
from car_fl.heads.scorer import Scorer, ScorerSpec


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


class ClassifierScorer(ClassifierHead, Scorer):
    """CaR: the classifier head (:class:`~car_fl.heads.head.ClassifierHead`) scores the labels."""

    kind = HeadKind.CLASSIFIER

    @classmethod
    def build(cls, spec: ScorerSpec) -> Scorer:
        head = spec.head
        return cls(
            spec.dim,
            spec.num_labels,
            pre_classifier_dim=head.pre_classifier_dim,
            dropout=head.dropout,
        ).to(spec.device)

    def forward(
        self,
        queries: torch.Tensor,
        index: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return ClassifierHead.forward(self, queries)


@dataclass(frozen=True)
class Hit:
    """One retrieved document: its id (the label name), text, the score the head computed
    (see :class:`Retrieval`'s ``score_kind``) and, where the head has one, its probability."""

    id: str
    text: str
    score: float
    probability: float | None = None


#: What a retrieval's scores are: the head's own numbers, never a softmax over the labels.
SCORE_KINDS = ("logit", "cosine", "dot", "votes", "rrf")


@dataclass(frozen=True)
class Retrieval:
    """One query's best labels, best first: names (document ids), scores, documents and, for a
    head trained with cross-entropy, probabilities (else ``None``). ``score_kind``: ``logit``,
    ``cosine`` or ``dot`` (MIPS, no temperature), ``votes`` (kNN) or ``rrf`` (fusion)."""

    labels: tuple[str, ...]
    scores: tuple[float, ...]
    documents: tuple[str, ...]
    score_kind: str = "logit"
    probabilities: tuple[float, ...] | None = None

    @property
    def hits(self) -> list[Hit]:
        """The retrieved documents as (id, text, score, probability), best first."""
        probabilities = self.probabilities or (None,) * len(self.labels)
        return [
            Hit(id=i, text=t, score=s, probability=p)
            for i, t, s, p in zip(
                self.labels, self.documents, self.scores, probabilities, strict=True
            )
        ]


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores (as given) and indices of the ``k`` best labels: two ``(batch, min(k, labels))``.
    Ties go to the lower index (a stable sort), so the top ``k`` is a prefix of any larger top."""
    if k < 1:
        raise ValueError(f"K must be >= 1, got {k}")
    exact = logits if logits.dtype == torch.float64 else logits.float()  # fused ranks: float64
    scores, indices = torch.sort(exact, dim=-1, descending=True, stable=True)
    keep = min(k, logits.shape[-1])
    return scores[..., :keep], indices[..., :keep]


def retrieve(
    logits: torch.Tensor,
    k: int,
    label_names: Sequence[str],
    documents: Sequence[str] | None = None,
    *,
    score_kind: str = "logit",
    calibrated: bool = True,
) -> list[Retrieval]:
    """For each query, its ``k`` best labels with the head's scores and documents (default:
    the names); with ``calibrated``, also each label's softmax probability over all labels."""
    if score_kind not in SCORE_KINDS:
        raise ValueError(f"score_kind must be one of {', '.join(SCORE_KINDS)}, got {score_kind!r}")
    docs = label_names if documents is None else documents
    scores, indices = top_k(logits, k)
    probs = (
        torch.softmax(logits.float(), dim=-1).gather(-1, indices).tolist() if calibrated else None
    )
    return [
        Retrieval(
            labels=tuple(label_names[i] for i in row_i),
            scores=tuple(row_s),
            documents=tuple(docs[i] for i in row_i),
            score_kind=score_kind,
            probabilities=tuple(probs[n]) if probs is not None else None,
        )
        for n, (row_s, row_i) in enumerate(zip(scores.tolist(), indices.tolist(), strict=True))
    ]
