"""Per-dimension standardisation of pooled features with statistics of the document corpus.

    x ↦ (x − μ) / σ      μ, σ: each dimension's mean and deviation over the documents' embeddings

A generative LM's few "rogue dimensions" (Timkey & van Schijndel, 2021) decide inner products
alone; standardising gives each its share. The public documents alone give μ and σ, so every
party computes the same; a module, so the adapter trains through it (docs/retrieval.md,
"Features worth searching").
"""

from __future__ import annotations

import torch
from torch import nn

#: The fewest documents whose deviation standardisation trusts (a handful of label texts is no
#: sample of a space).
MIN_DOCUMENTS = 8
#: A deviation below this share of the median divides by that floor instead: a dimension
#: constant across documents but not queries would otherwise decide every cosine.
RELATIVE_FLOOR = 0.01


class Standardizer(nn.Module):
    """``(..., d)`` → ``(x − μ) / σ``; the identity until :meth:`fit` is called. μ and σ are
    outside the state dict (never trained, sent or saved): every party computes them."""

    mean: torch.Tensor
    deviation: torch.Tensor

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim), persistent=False)
        self.register_buffer("deviation", torch.ones(dim), persistent=False)
        self.fitted = False

    def fit(self, documents: torch.Tensor) -> None:
        """μ and σ of the documents' embeddings ``(documents, d)``, in float32."""
        if documents.ndim != 2 or documents.shape[1] != self.mean.shape[0]:
            raise ValueError(
                f"documents of shape {tuple(documents.shape)} for features of dimension "
                f"{self.mean.shape[0]}"
            )
        if documents.shape[0] < MIN_DOCUMENTS:
            raise ValueError(
                f"model.standardize=documents needs at least {MIN_DOCUMENTS} documents to "
                f"estimate each dimension's deviation, got {documents.shape[0]}; use a corpus "
                "(dataset=corpus) or model.standardize=none"
            )
        x = documents.detach().float()
        deviation = x.std(dim=0)
        floor = float(RELATIVE_FLOOR * deviation.median())
        deviation = deviation.clamp_min(floor) if floor > 0 else torch.ones_like(deviation)
        with torch.no_grad():
            self.mean.copy_(x.mean(dim=0))
            self.deviation.copy_(deviation)
        self.fitted = True

    def load(self, other: Standardizer) -> None:
        """The statistics ``other`` was fitted to."""
        with torch.no_grad():
            self.mean.copy_(other.mean)
            self.deviation.copy_(other.deviation)
        self.fitted = other.fitted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fitted:
            return x
        return (x.float() - self.mean) / self.deviation
