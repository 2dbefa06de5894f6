"""Extractive pseudo-queries: windows of a document's own words as extra training queries.

Each document gives ``per_document`` windows of ``words`` words at seeded positions, from the
public documents alone, so they carry nothing of any node's records and need no second model.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: A window's length in words when none is set: about an abstract sentence's half.
DEFAULT_WORDS = 12


def extractive_queries(
    texts: Sequence[str],
    *,
    per_document: int,
    words: int = DEFAULT_WORDS,
    seed: int,
    skip: frozenset[int] = frozenset(),
) -> list[tuple[str, int]]:
    """``(query text, document index)`` pairs, documents in order, none for those in ``skip``
    nor for a document of ``words`` words or fewer (its one window would be itself)."""
    if per_document < 0 or words < 1:
        raise ValueError(f"per_document must be >= 0 and words >= 1, got {per_document}, {words}")
    out: list[tuple[str, int]] = []
    for index, text in enumerate(texts):
        tokens = text.split()
        if per_document == 0 or index in skip or len(tokens) <= words:
            continue
        starts = len(tokens) - words + 1
        rng = np.random.default_rng([seed, index])
        chosen = sorted(rng.choice(starts, size=min(per_document, starts), replace=False))
        out += [(" ".join(tokens[s : s + words]), index) for s in chosen]
    return out
