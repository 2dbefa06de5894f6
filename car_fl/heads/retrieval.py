"""Retrieval without a classifier: maximum inner-product search (MIPS) and k nearest neighbours.

These are the baselines CaR is measured against. Labels are documents: each label has a text
(``dataset.label_texts``, or its name), embedded with the same encoder and pooling as the
queries. Every function returns a score per label ``(queries, labels)`` that ranks like logits,
so top-K accuracy, MRR and macro-F1 are computed exactly as for the classifier.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from car_fl.settings.schema import Similarity


def label_documents(label_names: Sequence[str], label_texts: Mapping[str, str]) -> list[str]:
    """The document text of each label, in label order: its ``label_texts`` entry or its name."""
    return [label_texts.get(name) or name for name in label_names]


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
    """k-nearest-neighbour votes per label ``(q, labels)``, ties broken by nearest similarity.

    The score of a label is the number of the query's ``k`` most similar memory rows that carry
    it, plus a tie-breaker in ``[0, 0.5]``: the label's highest similarity to the query, scaled
    between the query's worst and best label. So labels rank first by votes, then by their
    single nearest example; a label with no example in memory ranks last.
    """
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
