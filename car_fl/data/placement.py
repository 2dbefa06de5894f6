"""Where a record goes (split, shard) decided by its own text alone, never by the others.

A seeded permutation places each record by its rank among all of them: one record added to a
file of 1,000 moved 110 others across the train/test split and 159 of 500 across an IID
partition. Record-level DP's neighbouring data sets differ in one record, so on a node that
splits a shared file the charged ε assumed a neighbour the split did not keep. A keyed hash of
each text places it independently of every other record (``dataset.split=hash``,
``fl.partitioning=hash``). Written here because flwr-datasets' partitioners all place by
position or by label counts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


def hash_placement(texts: Sequence[str], *, seed: int, purpose: str) -> np.ndarray:
    """Each text's place in [0, 1): BLAKE2b of the text alone, keyed by the seed and
    ``purpose`` (a split and a partition draw independently)."""
    key = f"car-fl:{seed}:{purpose}".encode()
    digests = (hashlib.blake2b(t.encode(), key=key, digest_size=8).digest() for t in texts)
    return np.array([int.from_bytes(d, "big") / 2**64 for d in digests], dtype=np.float64)
