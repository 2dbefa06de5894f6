"""One scorer per retrieval method: pooled queries ``(batch, d)`` → a score per label.

``ClassifierScorer`` (CaR): the classifier head's logits. ``DocumentScorer``: CaR with a
document-initialised head (:mod:`~car_fl.heads.document_head`); ``MixtureScorer``: the
same split into experts behind a gate (:mod:`~car_fl.heads.experts`). ``MIPSScorer``:
query·document scores against each label's document
(:func:`~car_fl.heads.retrieval.mips_scores`). ``KNNScorer``: votes of the nearest training
examples (:func:`~car_fl.heads.retrieval.knn_scores`). Each keeps its own state;
:class:`~car_fl.model.retriever.CaRRetriever` composes the encoder, the adapter and one scorer,
registered as its ``head`` (hence the ``head.*`` names of the trainable state).

A scorer may score against an *index* computed through the current adapter (the MIPS label
documents): :meth:`Scorer.index` builds it, so an evaluation can build it once for all batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from car_fl.heads.document_head import DocumentHead
from car_fl.heads.experts import ExpertLayout, MixtureHead
from car_fl.heads.head import ClassifierHead
from car_fl.heads.retrieval import knn_scores, mips_scores
from car_fl.settings.schema import HeadConfig, HeadKind, MoEConfig, Similarity

#: Token id lists → pooled vectors ``(n, d)`` through the retriever's adapter and encoder.
EncodeIds = Callable[[list[list[int]]], torch.Tensor]


class Scorer(nn.Module):
    """Pooled queries ``(batch, d)`` → scores ``(batch, labels)`` that rank like logits."""

    kind: ClassVar[HeadKind]
    #: Per-example gradients need a loop over examples (routing is data-dependent, so
    #: ``torch.func.vmap`` cannot trace it).
    per_example_loop: ClassVar[bool] = False
    #: Whether :meth:`index` runs the encoder through the adapter (MIPS's label documents):
    #: then a query's loss reaches the adapter by a second path, which DP-SGD's batched clipping
    #: (:mod:`car_fl.privacy.ghost`) does not follow, so it takes one example at a time.
    index_uses_adapter: ClassVar[bool] = False

    #: Whether the softmax of the scores is a probability the head was trained to give
    #: (cross-entropy over the labels); MIPS and kNN have none.
    calibrated: ClassVar[bool] = True

    @property
    def score_kind(self) -> str:
        """What :meth:`reported` scores are (:data:`car_fl.heads.head.SCORE_KINDS`)."""
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


class ClassifierScorer(ClassifierHead, Scorer):
    """CaR: the classifier head (:class:`~car_fl.heads.head.ClassifierHead`) scores the labels."""

    kind = HeadKind.CLASSIFIER

    def forward(
        self,
        queries: torch.Tensor,
        index: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return ClassifierHead.forward(self, queries)


class DocumentScorer(DocumentHead, Scorer):
    """CaR with rows that start as the documents' embeddings (:class:`DocumentHead`)."""

    kind = HeadKind.DOCUMENT

    def forward(
        self,
        queries: torch.Tensor,
        index: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return DocumentHead.forward(self, queries)


class MixtureScorer(MixtureHead, Scorer):
    """The mixture of experts (:class:`~car_fl.heads.experts.MixtureHead`)."""

    kind = HeadKind.MOE
    per_example_loop = True

    def evaluation_loss(self, scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return MixtureHead.evaluation_loss(self, scores, labels)


class MIPSScorer(Scorer):
    """MIPS over the label documents: similarity to each label's document, / temperature.

    The documents are token ids (:meth:`set_documents`, re-encoded through the adapter while
    it is in use, encoded once and kept otherwise) or fixed embeddings
    (:meth:`set_document_features`, no encoder needed).
    """

    kind = HeadKind.MIPS
    calibrated = False
    index_uses_adapter = True

    def __init__(
        self,
        num_labels: int,
        *,
        similarity: Similarity,
        temperature: float,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.num_labels = num_labels
        self.similarity = similarity
        self.temperature = temperature
        self.device = torch.device(device)
        self.document_ids: list[list[int]] | None = None
        self.document_features: torch.Tensor | None = None  # (labels, d)

    @property
    def score_kind(self) -> str:  # cosine or dot
        return self.similarity.value

    def reported(self, scores: torch.Tensor) -> torch.Tensor:
        return scores * self.temperature  # the similarity itself

    def set_documents(self, input_ids: list[list[int]]) -> None:
        """The labels' documents as token ids, in label order."""
        self._check_count(len(input_ids))
        self.document_ids = [list(ids) for ids in input_ids]
        self.document_features = None

    def set_document_features(self, features: torch.Tensor) -> None:
        """Precomputed document embeddings ``(labels, d)``."""
        self._check_count(int(features.shape[0]))
        self.document_features = features.to(self.device)

    def _check_count(self, count: int) -> None:
        if count != self.num_labels:
            raise ValueError(f"{count} label documents for {self.num_labels} labels")

    def index(self, encode: EncodeIds, *, adapted: bool) -> torch.Tensor:
        """The label documents ``(labels, d)``: re-encoded (with gradients when enabled) while
        the adapter is in use, encoded once and kept otherwise."""
        if self.document_ids is not None and (adapted or self.document_features is None):
            if adapted:
                return encode(self.document_ids)
            with torch.no_grad():
                self.document_features = encode(self.document_ids)
        if self.document_features is None:
            raise RuntimeError("a MIPS head needs its label documents: call set_documents")
        return self.document_features

    def forward(
        self,
        queries: torch.Tensor,
        index: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if index is None:
            raise ValueError("MIPS scores need the label documents (index)")
        return mips_scores(queries, index, kind=self.similarity, temperature=self.temperature)


class KNNScorer(Scorer):
    """kNN over training examples: votes of the ``k`` most similar memory rows per label."""

    kind = HeadKind.KNN
    calibrated = False

    @property
    def score_kind(self) -> str:
        return "votes"

    def __init__(
        self,
        num_labels: int,
        *,
        k: int,
        similarity: Similarity,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.num_labels = num_labels
        self.k = k
        self.similarity = similarity
        self.device = torch.device(device)
        self.memory: torch.Tensor | None = None  # (n, d)
        self.memory_labels: torch.Tensor | None = None  # (n,)

    def set_memory(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        """The training examples' embeddings ``(n, d)`` and labels ``(n,)``."""
        if len(features) != len(labels):
            raise ValueError(f"{len(features)} memory rows for {len(labels)} labels")
        self.memory = features.to(self.device)
        self.memory_labels = labels.to(self.device)

    def forward(
        self,
        queries: torch.Tensor,
        index: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.memory is None or self.memory_labels is None:
            raise RuntimeError("a kNN head needs its memory: call set_memory(features, labels)")
        return knn_scores(
            queries,
            self.memory,
            self.memory_labels,
            self.num_labels,
            k=self.k,
            kind=self.similarity,
        )


def build_scorer(
    head: HeadConfig,
    *,
    dim: int,
    num_labels: int,
    device: torch.device | str = "cpu",
    moe: MoEConfig | None = None,
    layout: ExpertLayout | None = None,
) -> Scorer:
    """The scorer of ``head.kind``; a classifier's initialisation draws from torch's global RNG.

    A mixture of experts needs its ``moe`` settings and ``layout``.
    """
    kind = head.kind
    if kind is HeadKind.CLASSIFIER:
        scorer: Scorer = ClassifierScorer(
            dim, num_labels, pre_classifier_dim=head.pre_classifier_dim, dropout=head.dropout
        )
        return scorer.to(device)
    if kind is HeadKind.DOCUMENT:
        return DocumentScorer(dim, num_labels, head).to(device)
    if kind is HeadKind.MOE:
        if moe is None or layout is None:
            raise ValueError("a mixture of experts needs its settings (moe) and expert layout")
        return MixtureScorer(dim, num_labels, head, moe, layout).to(device)
    similarity = head.similarity or Similarity.DOT  # resolved by Settings; dot standalone
    if kind is HeadKind.MIPS:
        return MIPSScorer(
            num_labels, similarity=similarity, temperature=head.temperature, device=device
        )
    return KNNScorer(num_labels, k=head.knn_k, similarity=similarity, device=device)
