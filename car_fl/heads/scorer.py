"""The interface every head implements: pooled queries ``(batch, d)`` → a score per label.

A head is one :class:`Scorer` subclass in its own module (CaR's classifier, the default, is
here, beside the interface), built from the settings by
:meth:`Scorer.build` and registered in :data:`car_fl.heads.config.HEADS`; the retriever holds it as
its ``head``. An *index* through the current adapter (MIPS's label documents) is built by
:meth:`Scorer.index`, once for all batches of an evaluation.

A head is built from its ``head.kind`` (:func:`build_scorer`): the scorer its registration
names, imported only then.

CaR's own scorer is the classifier head (:class:`ClassifierScorer`): ``ClassifierHead`` maps
``(batch, d)`` → ``(batch, labels)``, one linear layer or a pre-classifier, ReLU, dropout and
the classifier; a query's K best labels are its :class:`Retrieval`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from car_fl.heads.clustering import ExpertLayout
from car_fl.heads.config import HeadConfig, HeadKind, MoEConfig, Similarity


@dataclass(frozen=True)
class ScorerSpec:
    """What a head is built from: its settings, the feature width and the number of labels;
    a mixture of experts also its ``moe`` settings and ``layout``."""

    head: HeadConfig
    dim: int
    num_labels: int
    device: torch.device | str = "cpu"
    moe: MoEConfig | None = None
    layout: ExpertLayout | None = None

    @property
    def similarity(self) -> Similarity:
        """MIPS's and kNN's similarity (resolved by ``Settings``; dot for a bare config)."""
        return self.head.similarity or Similarity.DOT


class Scorer(nn.Module):
    """Pooled queries ``(batch, d)`` → scores ``(batch, labels)`` that rank like logits."""

    kind: ClassVar[HeadKind]
    #: Per-example gradients need a loop over examples (routing is data-dependent, so
    #: ``torch.func.vmap`` cannot trace it).
    per_example_loop: ClassVar[bool] = False
    #: Whether :meth:`index` runs the encoder through the adapter (MIPS's label documents): a
    #: second path to the adapter, so DP-SGD clips one example at a time.
    index_uses_adapter: ClassVar[bool] = False

    #: Whether the softmax of the scores is a probability the head was trained to give
    #: (cross-entropy over the labels); MIPS and kNN have none.
    calibrated: ClassVar[bool] = True

    @classmethod
    def build(cls, spec: ScorerSpec) -> Scorer:
        """The scorer ``spec`` asks for (its initialisation draws from torch's global RNG)."""
        raise NotImplementedError

    @property
    def score_kind(self) -> str:
        """What :meth:`reported` scores are (:data:`car_fl.heads.scorer.SCORE_KINDS`)."""
        return "logit"

    def reported(self, scores: torch.Tensor) -> torch.Tensor:
        """The scores retrieval returns: those :meth:`forward` computed (MIPS undoes its
        temperature, so that a hit's score is its similarity)."""
        return scores

    def index(self, encode: EncodeIds, *, adapted: bool) -> torch.Tensor | None:
        """What the queries are scored against, through the adapter (``None``: nothing)."""
        return None

    def forward(
        self,
        queries: torch.Tensor,
        index: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Scores; ``labels`` are given while training (a mixture of experts routes by them)."""
        raise NotImplementedError

    def loss(self, scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The training loss of ``scores`` from :meth:`forward`: cross-entropy."""
        return F.cross_entropy(scores, labels)

    def evaluation_loss(self, scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed cross-entropy of evaluation ``scores`` (from the last :meth:`forward`)."""
        return F.cross_entropy(scores, labels, reduction="sum")


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
    """CaR: the classifier head (:class:`~car_fl.heads.scorer.ClassifierHead`) scores the labels."""

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


def scorer_class(kind: HeadKind) -> type[Scorer]:
    """The scorer class ``kind``'s registration names (``module:Class``), checked to be a
    :class:`~car_fl.heads.scorer.Scorer` of that kind."""
    module, _, name = kind.spec.scorer.partition(":")
    scorer = getattr(importlib.import_module(module), name)
    if not (isinstance(scorer, type) and issubclass(scorer, Scorer) and scorer.kind is kind):
        raise TypeError(f"head.kind={kind}: {kind.spec.scorer} is no Scorer of kind {kind}")
    return scorer


def build_scorer(
    head: HeadConfig,
    *,
    dim: int,
    num_labels: int,
    device: torch.device | str = "cpu",
    moe: MoEConfig | None = None,
    layout: ExpertLayout | None = None,
) -> Scorer:
    """The scorer of ``head.kind`` (:meth:`~car_fl.heads.scorer.Scorer.build`); ``TypeError``
    for a head with a 0-d parameter, which no message could carry."""
    spec = ScorerSpec(head, dim, num_labels, device=device, moe=moe, layout=layout)
    scorer = scorer_class(head.kind).build(spec)
    for name, parameter in scorer.named_parameters():
        if parameter.dim() == 0:
            raise TypeError(
                f"head.kind={head.kind}: its parameter {name!r} is 0-d, and Flower's messages "
                "carry no 0-d arrays; give it shape (1,)"
            )
    return scorer


#: Token id lists → pooled vectors ``(n, d)`` through the retriever's adapter and encoder.
EncodeIds = Callable[[list[list[int]]], torch.Tensor]
