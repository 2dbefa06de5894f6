"""Threads where they pay: a loop of small tensor steps runs on one thread.

For a small head the intra-op hand-off costs more than the arithmetic
(docs/performance.md#threads-one-for-small-steps): :func:`threads_for` uses one thread
below :data:`SMALL_STEP`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

#: Multiply-adds per step below which one thread was faster (docs/performance.md, "Threads").
SMALL_STEP = 2_000_000


def head_work(parameters: int, batch: int) -> int:
    """Multiply-adds of one step of a head with ``parameters`` weights over ``batch`` rows."""
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
