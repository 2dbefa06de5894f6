"""Reciprocal-rank fusion of rankings over the same documents (Cormack et al., SIGIR 2009).

    fused(q, i) = Σ_r w_r / (k + rank_r(q, i))

Ranks, not scores, are combined, so no common scale is needed. Tied documents share one rank
(one plus the number scored strictly higher); a document a ranking did not retrieve (score
−∞) adds nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: The constant of the original paper.
RRF_K = 60
#: Added once, divided by the first ranking's rank: equal sums (head 1 and BM25 3 against
#: head 3 and BM25 1) are ordered by the first ranking, far below any difference of two sums.
TIE_BREAK = 1e-12


def competition_ranks(scores: torch.Tensor) -> torch.Tensor:
    """1-based ranks ``(batch, documents)``: 1 + how many documents score strictly higher."""
    descending = (-scores.float()).sort(dim=-1).values  # ascending order of −score
    return torch.searchsorted(descending, -scores.float().contiguous()) + 1


def reciprocal_rank_fusion(
    *scores: torch.Tensor, k: int = RRF_K, weights: Sequence[float] | None = None
) -> torch.Tensor:
    """Fused scores ``(batch, documents)`` of rankings given as scores of equal shape;
    ``weights`` (one per ranking, default 1 each) scale each ranking's reciprocal ranks."""
    if not scores:
        raise ValueError("fusion needs at least one ranking")
    if k < 1:
        raise ValueError(f"the fusion constant k must be >= 1, got {k}")
    weights = [1.0] * len(scores) if weights is None else list(weights)
    if len(weights) != len(scores) or any(not w >= 0 for w in weights):
        raise ValueError(f"{len(scores)} rankings need as many weights >= 0, got {weights}")
    shape = scores[0].shape
    if any(s.shape != shape for s in scores):
        raise ValueError(f"rankings of shapes {[tuple(s.shape) for s in scores]} cannot be fused")
    fused = torch.zeros(shape, dtype=torch.float64, device=scores[0].device)
    for s, weight in zip(scores, weights, strict=True):
        share = weight / (k + competition_ranks(s).double())
        fused += torch.where(torch.isneginf(s), torch.zeros_like(share), share)
    return fused + TIE_BREAK / competition_ranks(scores[0]).double()
