"""Retrieval without a classifier, the baselines CaR is measured against: maximum inner-product
search (:class:`MIPSScorer`) and k nearest neighbours (:class:`KNNScorer`).

Each label's text is embedded like the queries; every score ranks like logits, so the metrics
are computed exactly as for the classifier.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from car_fl.heads.config import HeadKind, Similarity
from car_fl.heads.scorer import EncodeIds, Scorer, ScorerSpec


def similarity(queries: torch.Tensor, keys: torch.Tensor, kind: Similarity) -> torch.Tensor:
    """``(q, d)`` and ``(k, d)`` → ``(q, k)`` inner products (of unit vectors for ``cosine``)."""
    queries, keys = queries.float(), keys.to(device=queries.device).float()
    if kind is Similarity.COSINE:
        queries, keys = F.normalize(queries, dim=-1), F.normalize(keys, dim=-1)
    return queries @ keys.T


def mips_scores(
    queries: torch.Tensor,
    documents: torch.Tensor,
    *,
    kind: Similarity = Similarity.DOT,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Query·document scores ``(q, labels)``; divided by ``temperature`` (a softmax scale)."""
    return similarity(queries, documents, kind) / temperature


def knn_scores(
    queries: torch.Tensor,
    memory: torch.Tensor,
    memory_labels: torch.Tensor,
    num_labels: int,
    *,
    k: int,
    kind: Similarity = Similarity.DOT,
    chunk: int = 1024,
) -> torch.Tensor:
    """k-nearest-neighbour votes per label ``(q, labels)``, ties broken by nearest similarity
    (scaled into ``[0, 0.5]``); a label with no example in memory ranks last."""
    if len(memory) == 0:
        raise ValueError("kNN needs at least one training example in memory")
    k = min(k, len(memory))
    memory_labels = memory_labels.to(queries.device)
    out = []
    for start in range(0, len(queries), chunk):
        sims = similarity(queries[start : start + chunk], memory, kind)  # (c, m)
        top = sims.topk(k, dim=1).indices  # (c, k)
        votes = torch.zeros(len(sims), num_labels, device=sims.device)
        votes.scatter_add_(1, memory_labels[top], torch.ones_like(top, dtype=votes.dtype))
        best = torch.full((len(sims), num_labels), float("-inf"), device=sims.device)
        best.scatter_reduce_(
            1, memory_labels.expand(len(sims), -1), sims, reduce="amax", include_self=True
        )
        present = torch.isfinite(best)
        low = torch.where(present, best, torch.inf).min(dim=1, keepdim=True).values
        high = torch.where(present, best, -torch.inf).max(dim=1, keepdim=True).values
        tie = 0.5 * (best - low) / (high - low).clamp_min(1e-12)
        out.append(votes + torch.where(present, tie, torch.full_like(tie, -1.0)))
    return torch.cat(out)


class MIPSScorer(Scorer):
    """MIPS over the label documents: similarity to each label's document, / temperature; the
    documents are token ids (:meth:`set_documents`, through the adapter while it trains) or
    fixed embeddings (:meth:`set_document_features`)."""

    kind = HeadKind.MIPS
    calibrated = False
    index_uses_adapter = True

    @classmethod
    def build(cls, spec: ScorerSpec) -> Scorer:
        return cls(
            spec.num_labels,
            similarity=spec.similarity,
            temperature=spec.head.temperature,
            device=spec.device,
        )

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

    @classmethod
    def build(cls, spec: ScorerSpec) -> Scorer:
        return cls(
            spec.num_labels, k=spec.head.knn_k, similarity=spec.similarity, device=spec.device
        )

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
