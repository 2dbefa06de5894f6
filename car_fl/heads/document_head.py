"""The document-initialised head: its rows start as the documents' embeddings.

    score(q, i) = s · ⟨ f(q̂)^ , (g(d̂ᵢ) + Δᵢ)^ ⟩            x^ = x / ‖x‖

``d̂ᵢ`` is document i's frozen unit embedding (never trained, never sent), ``Δᵢ`` its trainable
residual row (zero at start), ``f`` and ``g`` shared maps (:class:`ResidualMap`, identity at
start), ``s`` a learned scale: before training it is MIPS with cosine. A document added later,
or marked untrained (out of the training softmax), is a row with Δ = 0 that changes no other's
score. See docs/retrieval.md, "Heads that know the documents".
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from car_fl.heads.config import HeadConfig, HeadKind, MapKind
from car_fl.heads.scorer import Scorer, ScorerSpec


class ResidualMap(nn.Module):
    """``x ↦ x + x Mᵀ`` (linear: M d×d) or ``x + x Uᵀ Vᵀ`` (lowrank r): identity at start."""

    def __init__(self, dim: int, kind: MapKind, *, rank: int) -> None:
        super().__init__()
        if kind is MapKind.NONE:
            raise ValueError("a ResidualMap needs kind linear or lowrank")
        self.kind = kind
        if kind is MapKind.LINEAR:
            self.weight = nn.Parameter(torch.zeros(dim, dim))
        else:
            generator = torch.Generator().manual_seed(dim * 1009 + rank)
            self.down = nn.Parameter(torch.randn(rank, dim, generator=generator) / math.sqrt(dim))
            self.up = nn.Parameter(torch.zeros(dim, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., d)`` → ``(..., d)``."""
        if self.kind is MapKind.LINEAR:
            return x + x @ self.weight.T
        return x + (x @ self.down.T) @ self.up.T


def residual_map(dim: int, kind: MapKind, *, rank: int) -> ResidualMap | None:
    return None if kind is MapKind.NONE else ResidualMap(dim, kind, rank=rank)


class DocumentHead(nn.Module):
    """Pooled queries ``(batch, d)`` → scores ``(batch, documents)`` (see the module)."""

    documents: torch.Tensor  # (documents, d) unit rows, a buffer
    trained: torch.Tensor  # (documents,) bool, a buffer
    log_scale: torch.Tensor

    def __init__(
        self,
        dim: int,
        num_labels: int,
        cfg: HeadConfig,
        *,
        rows: bool = True,
    ) -> None:
        """``rows=False`` keeps the Δ rows out (a subclass holds them in its own layout)."""
        super().__init__()
        if num_labels < 1:
            raise ValueError(f"a document head needs at least 1 document, got {num_labels}")
        self.dim = dim
        self.num_labels = num_labels
        self.query_map = residual_map(dim, cfg.query_map, rank=cfg.map_rank)
        self.document_map = residual_map(dim, cfg.document_map, rank=cfg.map_rank)
        log_scale = torch.tensor([math.log(cfg.scale)])  # (1,): Flower carries no 0-d arrays
        if cfg.learn_scale:
            self.log_scale = nn.Parameter(log_scale)
        else:
            self.register_buffer("log_scale", log_scale, persistent=False)
        self.rows = nn.Parameter(torch.zeros(num_labels, dim)) if rows and cfg.train_rows else None
        self.register_buffer("documents", torch.zeros(num_labels, dim), persistent=False)
        self.register_buffer("trained", torch.ones(num_labels, dtype=torch.bool), persistent=False)
        self.has_documents = False

    # ------------------------------------------------------------------------------ documents
    def set_document_features(self, features: torch.Tensor) -> None:
        """The documents' frozen embeddings ``(documents, d)``, in label order."""
        if tuple(features.shape) != (self.num_labels, self.dim):
            raise ValueError(
                f"document features of shape {tuple(features.shape)} for {self.num_labels} "
                f"documents of dimension {self.dim}"
            )
        with torch.no_grad():
            self.documents.copy_(F.normalize(features.float(), dim=-1))
        self.has_documents = True

    def set_trained_rows(self, trained: torch.Tensor) -> None:
        """Which rows the training softmax ranges over ``(documents,)`` bool; the others (new
        documents) keep Δ = 0 and are scored only outside training."""
        if tuple(trained.shape) != (self.num_labels,):
            raise ValueError(f"{tuple(trained.shape)} flags for {self.num_labels} documents")
        self.trained.copy_(trained.to(torch.bool))

    def add_documents(self, features: torch.Tensor) -> range:
        """Append documents ``(n, d)`` as rows with Δ = 0; returns their label indices."""
        if features.ndim != 2 or features.shape[1] != self.dim:
            raise ValueError(f"new documents must be (n, {self.dim}), got {tuple(features.shape)}")
        start, added = self.num_labels, int(features.shape[0])
        device = self.documents.device
        self.documents = torch.cat(
            [self.documents, F.normalize(features.float().to(device), dim=-1)]
        )
        self.trained = torch.cat([self.trained, torch.ones(added, dtype=torch.bool, device=device)])
        if self.rows is not None:
            zeros = torch.zeros(added, self.dim, dtype=self.rows.dtype, device=self.rows.device)
            self.rows = nn.Parameter(
                torch.cat([self.rows.detach(), zeros]), requires_grad=self.rows.requires_grad
            )
        self.num_labels += added
        return range(start, self.num_labels)

    # -------------------------------------------------------------------------------- scoring
    @property
    def scale(self) -> torch.Tensor:
        return self.log_scale.exp()

    def queries(self, features: torch.Tensor) -> torch.Tensor:
        """``f(q̂)^``: ``(batch, d)`` unit vectors."""
        q = F.normalize(features.float(), dim=-1)
        if self.query_map is not None:
            q = self.query_map(q)
        return F.normalize(q, dim=-1)

    def document_rows(
        self, index: torch.Tensor | None = None, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``(g(d̂ᵢ) + Δᵢ)^`` for the documents ``index`` (default all): ``(n, d)``.

        ``rows`` (n, d) replaces Δ of those documents (a subclass keeps them elsewhere).
        """
        if not self.has_documents:
            raise RuntimeError("a document head needs its documents: call set_document_features")
        base = self.documents if index is None else self.documents[index]
        if self.document_map is not None:
            base = self.document_map(base)
        if rows is None and self.rows is not None:
            rows = self.rows if index is None else self.rows[index]
        if rows is not None:
            base = base + rows
        return F.normalize(base, dim=-1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """``(batch, d)`` → ``(batch, documents)``; untrained rows are -inf while training."""
        scores = self.scale * self.queries(features) @ self.document_rows().T
        if self.training:
            scores = scores.masked_fill(~self.trained, float("-inf"))
        return scores


class DocumentScorer(DocumentHead, Scorer):
    """CaR with rows that start as the documents' embeddings (:class:`DocumentHead`)."""

    kind = HeadKind.DOCUMENT

    @classmethod
    def build(cls, spec: ScorerSpec) -> Scorer:
        return cls(spec.dim, spec.num_labels, spec.head).to(spec.device)

    def forward(
        self,
        queries: torch.Tensor,
        index: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return DocumentHead.forward(self, queries)
