"""Where a record goes (split, shard) decided by its own text alone, never by the others.

A seeded permutation places each record by its rank among all of them: one record added to a
file of 1,000 moved 450 others across the splits and three IID shards
(``tests/data/test_splits.py``). Record-level DP's neighbouring data sets differ in one record,
so on a node that splits a shared file the charged ε assumed a neighbour the split did not
keep. A keyed hash of each text places it independently of every other record
(``dataset.split=hash``, ``fl.partitioning=hash``). Written here because flwr-datasets'
partitioners all place by position or by label counts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from car_fl.data.dedupe import normalize_text


def hash_placement(texts: Sequence[str], *, seed: int, purpose: str) -> np.ndarray:
    """Each text's place in [0, 1): BLAKE2b of the normalised text alone (the form duplicates
    are found by, so every copy and every machine's copy of the file agree), keyed by the seed
    and ``purpose`` (a split and a partition draw independently); 53 bits, exact in a float."""
    key = f"car-fl:{seed}:{purpose}".encode()
    digests = (
        hashlib.blake2b(normalize_text(t).encode(), key=key, digest_size=8).digest() for t in texts
    )
    return np.array([(int.from_bytes(d, "big") >> 11) / 2**53 for d in digests])
