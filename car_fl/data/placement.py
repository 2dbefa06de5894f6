"""Where a record goes (split, shard) decided by its own text alone, never by the others.

A seeded permutation moves many records when one is added, so record-level DP's neighbour
would not be the one charged; a keyed hash of each text places it independently
(``dataset.split=hash``, ``fl.partitioning=hash``). flwr-datasets places by position or labels.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from car_fl.data.dedupe import duplicate_key


def hash_placement(texts: Sequence[str], *, seed: int, purpose: str) -> np.ndarray:
    """Each text's place in [0, 1): BLAKE2b of its :func:`duplicate_key` alone (copies agree),
    keyed by the seed and ``purpose``; 53 bits, exact in a float."""
    key = f"car-fl:{seed}:{purpose}".encode()
    digests = (
        hashlib.blake2b(duplicate_key(t).encode(), key=key, digest_size=8).digest() for t in texts
    )
    return np.array([(int.from_bytes(d, "big") >> 11) / 2**53 for d in digests])
