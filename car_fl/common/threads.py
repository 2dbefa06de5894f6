"""Threads where they pay: a loop of small tensor steps runs on one thread.

PyTorch hands every op to its intra-op threads; for a head of a few hundred parameters at
batch 4 the hand-off costs more than the arithmetic, and on a loaded 2-core machine far more
(``scripts/bench_threads.py``, docs/performance.md#threads). :func:`threads_for` runs a
block on one thread when each step's work (multiply-adds, :func:`head_work`) is below
:data:`SMALL_STEP`, and with torch's threads otherwise; an encoder pass keeps them all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

#: Multiply-adds per step below which one thread was faster than two on the 2-core CPU, quiet
#: and beside a busy process (docs/performance.md#threads).
SMALL_STEP = 2_000_000


def head_work(parameters: int, batch: int) -> int:
    """Multiply-adds of one step of a head with ``parameters`` weights over ``batch`` rows
    (each weight is used once per row in the forward)."""
    return parameters * batch


@contextlib.contextmanager
def threads_for(work: int) -> Iterator[int]:
    """torch's intra-op threads set for steps of ``work`` multiply-adds inside the block (one
    below :data:`SMALL_STEP`), restored after it; yields the number used."""
    previous = torch.get_num_threads()
    threads = 1 if work < SMALL_STEP else previous
    if threads != previous:
        torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        if threads != previous:
            torch.set_num_threads(previous)
